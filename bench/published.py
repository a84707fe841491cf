"""Predicted / published training throughput for Narayanan et al. 2021, Table 1.

An entry point only: the benchmark lives in `llmscale.bench.published`, also runnable as
`python -m llmscale.bench.published`; `--help` lists its flags.
"""

from llmscale.bench.published import main

if __name__ == "__main__":
    main()
