"""The memory-mapped shard loader: tokens/s and resident memory as the corpus grows (figures).

An entry point only: the benchmark lives in `llmscale.bench.loader`, also runnable as
`python -m llmscale.bench.loader`; `--help` lists its flags.
"""

from llmscale.bench.loader import main

if __name__ == "__main__":
    main()
