"""Every config key with its default, allowed values and description, read from the dataclasses.

The docstring under each field of `config.py` (and of `ModelConfig` in `model/config.py`) is the
one description of a key; a `Literal` type is the one list of its allowed values. From them come
`llmscale train --help` (`help_text`) and the README's table of keys (`markdown_table`):

    python -m llmscale.config_docs --write README.md   # regenerate the table between the markers
    python -m llmscale.config_docs --check README.md   # exit 1 when the README's table is stale
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import inspect
import sys
import textwrap
import typing
from pathlib import Path
from typing import Any, Literal, NamedTuple

from llmscale.config import JobConfig, toml_value

BEGIN = "<!-- config-keys:begin (generated: python -m llmscale.config_docs --write README.md) -->"
END = "<!-- config-keys:end -->"


class ConfigKey(NamedTuple):
    """One `--section.key`: its type, default (the built-in config's), allowed values, meaning."""

    section: str
    name: str
    type: str
    default: Any
    choices: tuple[Any, ...]
    doc: str

    @property
    def key(self) -> str:
        return f"{self.section}.{self.name}"

    @property
    def allowed(self) -> str:
        """`a | b | c` for a choice, else the type's name."""
        return " | ".join(str(c) for c in self.choices) if self.choices else self.type


class Section(NamedTuple):
    """A `[section]` of the TOML file: its name, the first line of its docstring, its keys."""

    name: str
    doc: str
    keys: list[ConfigKey]


def field_docs(cls: type) -> dict[str, str]:
    """{field: its docstring on one line}: the string literal right under each annotated field."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = next(n for n in tree.body if isinstance(n, ast.ClassDef)).body
    docs: dict[str, str] = {}
    for node, after in zip(body, body[1:], strict=False):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ):
            docs[node.target.id] = " ".join(after.value.value.split())
    return docs


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return _type_name(type(typing.get_args(tp)[0]))
    if origin is list:
        return f"list of {_type_name(typing.get_args(tp)[0])}"
    return {bool: "bool", int: "int", float: "float", str: "str"}.get(tp, str(tp))


def _section_doc(cls: type, name: str) -> str:
    first = (inspect.getdoc(cls) or "").splitlines()[0]
    return first.removeprefix(f"[{name}]:").strip()


@functools.cache
def sections() -> tuple[Section, ...]:
    """Every section of `JobConfig`, in file order, each key with its default and docstring."""
    cfg = JobConfig()
    out = []
    for sec in dataclasses.fields(JobConfig):
        value = getattr(cfg, sec.name)
        cls = type(value)
        hints, docs = typing.get_type_hints(cls), field_docs(cls)
        keys = []
        for f in dataclasses.fields(cls):
            tp = hints[f.name]
            literal = typing.get_origin(tp) is Literal
            keys.append(
                ConfigKey(
                    section=sec.name,
                    name=f.name,
                    type=_type_name(tp),
                    default=getattr(value, f.name),
                    choices=typing.get_args(tp) if literal else (),
                    doc=docs.get(f.name, ""),
                )
            )
        out.append(Section(sec.name, _section_doc(cls, sec.name), keys))
    return tuple(out)


def config_keys() -> list[ConfigKey]:
    """Every key of every section."""
    return [k for s in sections() for k in s.keys]


# ---- `llmscale train --help` ------------------------------------------------------------------


def help_text(width: int = 100) -> str:
    """The keys as the epilog of `llmscale train --help`: key, allowed values, default, meaning."""
    lines = textwrap.wrap(
        "configuration keys (set them in the --config file, or override any as --section.key "
        "value; [model]'s defaults are the tiny preset's, another model.name brings its own):",
        width,
    )
    for s in sections():
        lines += ["", f"[{s.name}]  {s.doc}"]
        for k in s.keys:
            lines.append(f"  --{k.key} {k.allowed}  (default {toml_value(k.default)})")
            lines += textwrap.wrap(k.doc, width, initial_indent=" " * 6, subsequent_indent=" " * 6)
    return "\n".join(lines)


# ---- the README's table -----------------------------------------------------------------------


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def markdown_table() -> str:
    """The keys as a Markdown table (the README's configuration reference)."""
    rows = ["| key | default | values | description |", "|---|---|---|---|"]
    for k in config_keys():
        allowed = _cell(k.allowed) if k.choices else k.type
        default = _cell(toml_value(k.default))
        rows.append(f"| `{k.key}` | `{default}` | {allowed} | {_cell(k.doc)} |")
    return "\n".join(rows)


def with_table(text: str) -> str:
    """`text` with the block between BEGIN and END replaced by the current table."""
    start, end = text.find(BEGIN), text.find(END)
    if start < 0 or end < start:
        raise ValueError(f"no block between {BEGIN!r} and {END!r}")
    return text[:start] + BEGIN + "\n" + markdown_table() + "\n" + text[end:]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m llmscale.config_docs", description=__doc__.splitlines()[0]
    )
    action = parser.add_mutually_exclusive_group(required=True)
    action.add_argument("--write", metavar="FILE", help="regenerate FILE's table in place")
    action.add_argument("--check", metavar="FILE", help="exit 1 when FILE's table is stale")
    args = parser.parse_args(argv)
    path = Path(args.write or args.check)
    text = path.read_text()
    fresh = with_table(text)
    if args.check:
        if fresh != text:
            sys.stderr.write(
                f"{path}: the config key table is stale; run python -m llmscale.config_docs "
                f"--write {path}\n"
            )
            return 1
        return 0
    if fresh != text:
        path.write_text(fresh)
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
