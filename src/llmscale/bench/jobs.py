"""A short job: the override list that every benchmark and test starts from (torch-free).

    load_config(None, short_job(train__steps=5, train__micro_batch_size=2))

Short means: 40 files of the stdlib corpus, sequences of 32 tokens, 3 steps, no progress bar and
no checkpoints. Everything else is the caller's: a keyword `section__key=value` sets
`--section.key value` (replacing the default when it is one of the five above); the other
defaults of `JobConfig` apply as usual.
"""

from __future__ import annotations

SHORT_JOB: dict[str, object] = {
    "data.max_files": 40,
    "data.seq_len": 32,
    "train.steps": 3,
    "metrics.progress": False,
    "checkpoint.enabled": False,
}


def short_job(**overrides: object) -> list[str]:
    """`--section.key value` overrides for a short job; keywords `section__key=value`."""
    values = dict(SHORT_JOB)
    for name, value in overrides.items():
        section, sep, key = name.partition("__")
        if not (sep and section and key):
            raise TypeError(f"short_job: {name!r} is not section__key (e.g. train__steps=5)")
        values[f"{section}.{key}"] = value
    out: list[str] = []
    for key, value in values.items():
        out += [f"--{key}", _text(value)]
    return out


def _text(value: object) -> str:
    """The value as the command line spells it (TOML literals: true/false for booleans)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)
