"""Trainer step time vs a plain hand-written PyTorch loop on the same model and data.

An entry point only: the benchmark lives in `llmscale.bench.overhead`, also runnable as
`python -m llmscale.bench.overhead`; `--help` lists its flags.
"""

from llmscale.bench.overhead import main

if __name__ == "__main__":
    main()
