"""How long `llmscale plan`'s search takes: Llama 2 70B (and 405B) from 8 to 4096 GPUs.

An entry point only: the benchmark lives in `llmscale.bench.plan_speed`, also runnable as
`python -m llmscale.bench.plan_speed`; `--help` lists its flags.
"""

from llmscale.bench.plan_speed import main

if __name__ == "__main__":
    main()
