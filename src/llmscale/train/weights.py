"""A run's weights outside training: read from its checkpoints, or start a run from others'.

`checkpoint.init_from` starts a new run from existing weights (the usual way to fine-tune):
- `hf:DIR`, a Hugging Face Llama folder (config.json + safetensors);
- `RUN_DIR`, another llmscale run: the weights of its newest complete checkpoint.
The rule for the model's shape: it is the source's (DIR/config.json, or RUN_DIR/config.toml's
[model]), whatever [model] says; only the weights come over, never optimizer state or the step.
A run that resumes from its own checkpoint ignores init_from.

`read_run_weights` is the one reader of a run's checkpoint as a plain full state dict (export,
generate, eval and init_from RUN_DIR): it chooses the checkpoint through the checkpoint reader
(`train.checkpoint.choose_checkpoint`: verified against its manifest, a damaged newest one
skipped with a notice, one line when none is intact). DCP stores each shard with its global
place, so a single process loads a checkpoint saved under any parallel layout into whole tensors.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from llmscale.config import JobConfig, load_config
from llmscale.errors import ConfigError
from llmscale.hf.check import HF_PREFIX, check_hf_init_from
from llmscale.hf.folder import read_llama_folder
from llmscale.model.config import ModelConfig, value_name
from llmscale.model.transformer import build_model
from llmscale.parallel.materialize import copy_full_into
from llmscale.train.checkpoint import Checkpointer, choose_checkpoint, notice, read_manifest


@dataclass(frozen=True)
class RunWeights:
    """A run's config and the whole fp32 weights of one of its checkpoints."""

    cfg: JobConfig
    step: int
    state_dict: dict[str, torch.Tensor]
    path: Path | None = None  # the checkpoint folder read


def read_run_config(run_dir: str | Path, field: str = "RUN_DIR") -> JobConfig:
    """RUN_DIR/config.toml (what `train` wrote), or a one-line error naming `field`."""
    path = Path(run_dir) / "config.toml"
    if not Path(run_dir).is_dir():
        raise ConfigError(field, str(run_dir), "an llmscale run folder (with config.toml)")
    if not path.is_file():
        raise ConfigError(field, str(run_dir), "an llmscale run folder (no config.toml in it)")
    cfg = load_config(path)
    cfg.job.run_dir = str(run_dir)
    return cfg


def find_checkpoint(
    run_dir: str | Path,
    cfg: JobConfig,
    step: int | None = None,
    field: str = "RUN_DIR",
    say: Callable[[str], None] = notice,
) -> tuple[int, Path]:
    """The newest intact checkpoint of the run (or the one of `step`, which must be intact)."""
    return choose_checkpoint(
        Path(run_dir) / cfg.checkpoint.folder, source=str(run_dir), field=field, step=step, say=say
    )


def read_run_weights(
    run_dir: str | Path, step: int | None = None, field: str = "RUN_DIR"
) -> RunWeights:
    """The run's config and its checkpoint's full weights, on the CPU in fp32."""
    cfg = read_run_config(run_dir, field)
    step, path = find_checkpoint(run_dir, cfg, step, field)
    template = {
        name: torch.empty(p.shape, dtype=torch.float32)
        for name, p in build_model(cfg.model, "meta").named_parameters()
    }
    # The trainer saves {"app": {"model": ..., "optim": ..., "trainer": ...}}; DCP loads only
    # the keys asked for.
    Checkpointer(path.parent).load(path, {"app": {"model": template}})
    return RunWeights(cfg=cfg, step=step, state_dict=template, path=path)


# ---- checkpoint.init_from ---------------------------------------------------------------------


def source_model(init_from: str) -> ModelConfig:
    """The model shape of an init_from source (see the module's rule)."""
    if init_from.startswith(HF_PREFIX):
        return read_llama_folder(init_from[len(HF_PREFIX) :])[0]
    return read_run_config(init_from, "checkpoint.init_from").model


def with_source_model(cfg: JobConfig) -> JobConfig:
    """`cfg` with [model] replaced by the init_from source's (cfg itself without init_from).

    A Hugging Face folder is checked against the run's data first (`hf.check.check_hf_init_from`:
    its config, vocabulary and tokenizer, torch-free, as `llmscale train` does before importing
    torch), one line instead of an index error in the first step; then its weights are read."""
    init_from = cfg.checkpoint.init_from
    if not init_from:
        return cfg
    check_hf_init_from(cfg)
    return dataclasses.replace(cfg, model=source_model(init_from))


def source_weights(init_from: str) -> dict[str, torch.Tensor]:
    """The whole fp32 weights of an init_from source, in llmscale's names."""
    if init_from.startswith(HF_PREFIX):
        return read_llama_folder(init_from[len(HF_PREFIX) :])[1]
    return read_run_weights(init_from, field="checkpoint.init_from").state_dict


@torch.no_grad()
def load_full_weights(parts: Sequence[nn.Module], state_dict: dict[str, torch.Tensor]) -> None:
    """Copy whole tensors into the (possibly sharded, split) materialized model parts.

    Like `parallel.materialize`: each rank holds the full value and keeps its own slice
    (`distribute_tensor(..., src_data_rank=None)`, no communication), so any layout works.
    """
    for part in parts:
        cfg: ModelConfig = part.cfg  # type: ignore[assignment]
        for name, p in part.named_parameters():
            # A tied model's last pipeline stage: its copy takes the embedding's weights.
            source = value_name(cfg, name)
            if source not in state_dict:
                raise ConfigError("checkpoint.init_from", name, "a source holding every weight")
            full = state_dict[source]
            if tuple(full.shape) != tuple(p.shape):
                raise ConfigError(
                    "checkpoint.init_from",
                    f"{name} {tuple(full.shape)}",
                    f"the model's shape {tuple(p.shape)}",
                )
            copy_full_into(p, full)


def apply_init_from(parts: Sequence[nn.Module], cfg: JobConfig) -> bool:
    """Load checkpoint.init_from's weights into `parts`, unless the run resumes its own
    checkpoint (which then holds everything). True when weights were loaded."""
    ck = cfg.checkpoint
    if not ck.init_from:
        return False
    if ck.resume and Checkpointer(Path(cfg.job.run_dir) / ck.folder).latest() is not None:
        return False
    load_full_weights(parts, source_weights(ck.init_from))
    return True


# ---- what a checkpoint was trained as ---------------------------------------------------------

# The [model] keys that decide the weights' names, shapes or how they are read (the heads'
# split); the others (rope_theta, norm_eps, init_std, max_seq_len under rope) may change.
SHAPE_KEYS = (
    "vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "norm", "mlp",
    "pos_emb", "bias", "tie_embeddings",
)  # fmt: skip
_MODEL_FQN = "app.model."


def checkpoint_record(cfg: JobConfig) -> dict[str, Any]:
    """What the trainer adds to each checkpoint's manifest: the model's shape and precision."""
    return {
        "model": {k: getattr(cfg.model, k) for k in SHAPE_KEYS},
        "precision": cfg.precision.mode,
    }


def _shapes_text(model: ModelConfig) -> str:
    return ", ".join(
        f"{k}={getattr(model, k)}" for k in ("dim", "n_layers", "n_heads", "vocab_size")
    )


def check_resume_model(path: Path, model: ModelConfig) -> None:
    """One line (ConfigError, exit 2) when the checkpoint at `path` holds another model than
    `model`, whichever way they differ: the keys its manifest records, then every weight's name
    and shape (checkpoints written before the manifest kept the model have only those)."""
    again = f"resume with the [model] checkpoint {path.name} was trained with; it is left as it is"
    stored = read_manifest(path).get("model")
    if isinstance(stored, dict):
        diff = [k for k in SHAPE_KEYS if k in stored and stored[k] != getattr(model, k)]
        if len(diff) == 1:
            k = diff[0]
            raise ConfigError(f"model.{k}", getattr(model, k), f"{stored[k]!r} ({again})")
        if diff:
            raise ConfigError(
                "model",
                ", ".join(f"{k}={getattr(model, k)}" for k in diff),
                ", ".join(f"{k}={stored[k]}" for k in diff) + f" ({again})",
            )
    entries = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    have = {
        k[len(_MODEL_FQN) :]: tuple(getattr(v, "size", ()))
        for k, v in entries.items()
        if k.startswith(_MODEL_FQN)
    }
    want = {k: tuple(v.shape) for k, v in build_model(model, "meta").state_dict().items()}
    if have == want:
        return
    changed = sorted(k for k in want.keys() & have.keys() if want[k] != have[k])
    missing, extra = sorted(want.keys() - have.keys()), sorted(have.keys() - want.keys())
    if changed:
        k = changed[0]
        why = f"holds {k} of shape {have[k]}, this model's is {want[k]}"
    elif extra:
        why = f"holds {len(extra)} weights this model lacks (e.g. {extra[0]})"
    else:
        why = f"lacks {len(missing)} weights this model has (e.g. {missing[0]})"
    raise ConfigError(
        "model", _shapes_text(model), f"the model of {path.name}, which {why}; {again}"
    )
