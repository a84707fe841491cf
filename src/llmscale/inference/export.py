"""`llmscale export`: a run's checkpoint as a Hugging Face model folder.

Llama-family models export as `LlamaForCausalLM`, GPT-style ones as `GPT2LMHeadModel` where the
architecture is GPT-2's (tied head, biases, no grouped-query attention); any other mix is
refused with one line (`hf.convert.export_family`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal, get_args

from llmscale.errors import ConfigError
from llmscale.hf.convert import export_family, to_hf_state_dict
from llmscale.hf.folder import write_folder
from llmscale.inference.tokenizer import run_tokenizer
from llmscale.paths import check_output_folder
from llmscale.train.weights import read_run_config, read_run_weights

Format = Literal["hf"]
FORMATS: tuple[Format, ...] = get_args(Format)


@dataclass(frozen=True)
class Exported:
    out: Path
    step: int
    architecture: str  # "llama" | "gpt2"


def export_run(
    run_dir: str | Path, out: str | Path, step: int | None = None, fmt: str = "hf"
) -> Exported:
    """Write the folder `out` from the run's newest checkpoint (or that of `step`)."""
    if fmt not in FORMATS:
        raise ConfigError("--format", fmt, " | ".join(FORMATS))
    if Path(out).exists() and not Path(out).is_dir():
        raise ConfigError("--out", str(out), "a folder (new, or one to overwrite), not a file")
    check_output_folder("--out", out)  # before the weights are read, not after
    family = export_family(read_run_config(run_dir).model)  # refuse before reading weights
    run = read_run_weights(run_dir, step)
    tokenizer = run_tokenizer(run.cfg)
    folder = write_folder(
        out, run.cfg.model, to_hf_state_dict(run.cfg.model, run.state_dict), tokenizer.files
    )
    return Exported(out=folder, step=run.step, architecture=family)
