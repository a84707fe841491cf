"""Data-parallel throughput for 1, 2, 4 processes on this machine (figures, not asserts).

An entry point only: the benchmark lives in `llmscale.bench.scaling`, also runnable as
`python -m llmscale.bench.scaling`; `--help` lists its flags.
"""

from llmscale.bench.scaling import main

if __name__ == "__main__":
    main()
