"""How long `llmscale plan`'s search takes: issue 25's two searches (or one of your own).

An entry point only: the benchmark lives in `llmscale.bench.plan_speed`, also runnable as
`python -m llmscale.bench.plan_speed`; `--help` lists its flags.
"""

from llmscale.bench.plan_speed import main

if __name__ == "__main__":
    main()
