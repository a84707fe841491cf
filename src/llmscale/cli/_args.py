"""What every command shares: the parser whose errors are one line (exit 2), one-line messages,
choice checks and printing a report."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from typing import Any

from llmscale.errors import ConfigError, ExitCode

EXIT_USAGE = int(ExitCode.BAD_INPUT)


class Parser(argparse.ArgumentParser):
    """argparse, but errors are one line on stderr and exit code 2 (its own default code).

    `lazy_epilog`, when set, builds the epilog only when help is asked for (the train command's
    list of config keys parses the config's source).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # No abbreviations: `bench --json` must not silently mean `--json-out`.
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)
        self.lazy_epilog: Callable[[], str] | None = None

    def error(self, message: str) -> None:  # type: ignore[override]
        # prog is "llmscale" or "llmscale <command>": the program name once.
        sys.stderr.write(one_line(f"{self.prog}: error: {message}") + "\n")
        raise SystemExit(EXIT_USAGE)

    def format_help(self) -> str:
        if self.lazy_epilog is not None:
            self.epilog = self.lazy_epilog()
        return super().format_help()


class EpilogAsWritten(argparse.HelpFormatter):
    """Wraps the description as usual, but keeps a multi-line text (the key list) as written."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        if "\n" in text:
            return "".join(indent + line for line in text.splitlines(keepends=True))
        return super()._fill_text(text, width, indent)


# What str.splitlines() breaks a line at: echoed from an argument, it would split the message.
_LINE_BREAKS = str.maketrans({c: repr(c)[1:-1] for c in "\n\r\v\f\x1c\x1d\x1e\x85\u2028\u2029"})


def one_line(message: str) -> str:
    """An error message as one line: the line breaks a user's argument brought in, escaped."""
    return message.translate(_LINE_BREAKS)


def one_of(field: str, value: str, allowed: Sequence[str]) -> None:
    """A choice-valued flag: the same one-line error as a config field."""
    if value not in allowed:
        raise ConfigError(field, value, " | ".join(allowed))


def show(*parts: object) -> int:
    """Print a report's parts (title, rich table, the sentences that read it) in order; exit 0."""
    from llmscale.ui import console

    out = console()
    for part in parts:
        out.print(part)
    return 0


def config_keys_help() -> str:
    from llmscale.config_docs import help_text

    return help_text()


MODEL_HELP = (
    "the model: a preset NAME (llmscale models), a FILE.toml holding a [model] table (with "
    "`name`: that preset, its other keys overriding its shape; without: a custom shape, "
    "vocab_size, dim, n_layers, n_heads, n_kv_heads, ffn_dim and max_seq_len required, the "
    "rest defaulted), or a Hugging Face DIR holding config.json (model_type llama, gpt2, or "
    "mistral without a sliding window; rope_scaling / rope_parameters read)"
)


def add_model_arg(p: argparse.ArgumentParser, default: str | None, **kwargs: Any) -> None:
    """`--model NAME | FILE.toml | DIR`, one flag for every command that takes a model shape
    (resolved by `config.load_model`)."""
    more = f" (default {default})" if default else ""
    p.add_argument("--model", default=default, metavar="NAME|FILE|DIR", help=MODEL_HELP + more,
                   **kwargs)  # fmt: skip


def add_stack_option_args(p: argparse.ArgumentParser) -> None:
    """The stack settings (`llmscale.stack.options`) as flags: --NAME, and --no-NAME where the
    setting can be turned off; unset, the stack's own default. Each one's help names the stacks
    that have it."""
    from llmscale.stack.options import STACK_OPTIONS

    group = p.add_argument_group(
        "the stack's own settings (default: as the stack runs by default; refused under a "
        "stack that has no such setting)"
    )
    for o in STACK_OPTIONS:
        action: Any = argparse.BooleanOptionalAction if o.when_off is not None else "store_const"
        extra: dict[str, Any] = {} if o.when_off is not None else {"const": True}
        if o.choices is not None:  # --NAME VALUE
            action, extra = "store", {"choices": list(o.choices)}
        group.add_argument(
            f"--{o.name}",
            dest=f"stack_option_{o.dest}",
            action=action,
            default=None,
            help=f"{o.what} ({', '.join(o.stacks)}): {o.help}",
            **extra,
        )


def stack_options_given(args: argparse.Namespace) -> dict[str, bool | str]:
    """The stack settings given on the command line, by name (unset ones left out): on or
    off, or a valued setting's value."""
    from llmscale.stack.options import STACK_OPTIONS

    given = {o.name: getattr(args, f"stack_option_{o.dest}", None) for o in STACK_OPTIONS}
    return {k: v if isinstance(v, str) else bool(v) for k, v in given.items() if v is not None}
