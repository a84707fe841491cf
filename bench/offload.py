"""Step time with the optimizer on the device, offloaded serially, and offloaded with overlap.

An entry point only: the benchmark lives in `llmscale.bench.offload`, also runnable as
`python -m llmscale.bench.offload`; `--help` lists its flags.
"""

from llmscale.bench.offload import main

if __name__ == "__main__":
    main()
