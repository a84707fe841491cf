"""The usability review's bad-input sweep: every case run and classified (figures).

An entry point only: the sweep lives in `llmscale.bench.bad_inputs`, also runnable as
`python -m llmscale.bench.bad_inputs`; `--help` lists its flags.
"""

from llmscale.bench.bad_inputs import main

if __name__ == "__main__":
    main()
