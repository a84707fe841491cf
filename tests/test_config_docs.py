"""The config's field docstrings and Literal types are its documentation: help and README."""

from __future__ import annotations

import dataclasses
import typing
from pathlib import Path

import pytest

from llmscale import config
from llmscale.config import JobConfig, load_config
from llmscale.config_docs import BEGIN, END, config_keys, field_docs, main, with_table
from llmscale.errors import ConfigError
from llmscale.model.config import ModelConfig

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_table_is_current() -> None:
    """Fails when a field, default, choice or docstring changed without regenerating the table:
    run `python -m llmscale.config_docs --write README.md`."""
    assert main(["--check", str(README)]) == 0


def test_check_fails_on_a_stale_table(tmp_path, capsys) -> None:
    stale = tmp_path / "README.md"
    stale.write_text(f"intro\n{BEGIN}\n| old | table |\n{END}\noutro\n")
    assert main(["--check", str(stale)]) == 1
    assert "stale" in capsys.readouterr().err
    assert main(["--write", str(stale)]) == 0
    assert main(["--check", str(stale)]) == 0
    text = stale.read_text()
    assert text.startswith("intro\n") and text.endswith(f"{END}\noutro\n")
    assert (
        '| `train.recompute` | `"none"` | none \\| full \\| selective \\| selective_op \\| every_k |'
        in text
    )


def test_with_table_needs_the_markers() -> None:
    with pytest.raises(ValueError):
        with_table("no markers here")


def test_every_field_has_a_docstring() -> None:
    sections = [type(getattr(JobConfig(), f.name)) for f in dataclasses.fields(JobConfig)]
    for cls in [*sections, ModelConfig]:
        docs = field_docs(cls)
        missing = [f.name for f in dataclasses.fields(cls) if not docs.get(f.name)]
        assert not missing, f"{cls.__name__}: no docstring under {missing}"


def test_every_key_is_listed_once() -> None:
    keys = [k.key for k in config_keys()]
    assert len(keys) == len(set(keys))
    assert {"train.recompute", "model.pos_emb", "parallel.zero_stage"} <= set(keys)
    for k in config_keys():
        load_config(None, [f"--{k.key}", _toml(k.default)])  # every default is accepted


def _toml(v: object) -> str:
    return config.toml_value(v)


def test_choices_come_from_the_field_types() -> None:
    """Every string option is a Literal; validation, help and the README read its values."""
    by_key = {k.key: k for k in config_keys()}
    assert by_key["precision.mode"].choices == config.PRECISIONS
    assert by_key["train.recompute"].choices == config.RECOMPUTE_MODES
    assert by_key["parallel.pp_schedule"].choices == config.PP_SCHEDULES
    assert by_key["optimizer.offload"].choices == config.OFFLOAD_MODES
    assert by_key["lr_scheduler.decay"].choices == config.LR_DECAYS
    assert by_key["job.device"].choices == config.DEVICES
    assert by_key["job.memory_check"].choices == config.MEMORY_CHECKS
    assert by_key["optimizer.offload_kernel"].choices == ("fused", "exact")
    assert by_key["model.mlp"].choices == ("swiglu", "gelu", "relu2")
    assert by_key["precision.float8_recipe"].choices == config.FLOAT8_RECIPES
    assert by_key["parallel.zero_stage"].choices == (0, 1, 2, 3)
    # A string-valued field that is not a free-form name or path is a Literal.
    free = {"name", "run_dir", "path", "glob", "folder", "published_source", "init_from", "dataset"}
    for k in config_keys():
        if k.type == "str" and not k.choices and k.name not in free:
            raise AssertionError(f"{k.key} is a plain str: give it a Literal type")


def test_choice_validation_reads_the_type() -> None:
    cfg = JobConfig()
    cfg.parallel.pp_schedule = "interleaved-1f1b"  # type: ignore[assignment]
    with pytest.raises(ConfigError, match="gpipe | 1f1b | interleaved_1f1b"):
        cfg.validate()
    # The loader checks a Literal field on the way in, with the same message; bool is no int.
    with pytest.raises(ConfigError, match="parallel.zero_stage: got True; allowed: 0 | 1 | 2 | 3"):
        load_config(None, ["--parallel.zero_stage", "true"])
    with pytest.raises(ConfigError, match="model.norm: got 'batchnorm'"):
        load_config(None, ["--model.norm", "batchnorm"])
    assert load_config(None, ["--parallel.zero_stage", "2"]).parallel.zero_stage == 2
    assert typing.get_args(typing.get_type_hints(ModelConfig)["pos_emb"]) == ("rope", "learned")
