"""`selective` under a fused attention kernel: what checkpointing the attention core saves.

`selective` checkpoints each block's `AttentionCore` (`parallel/activation_checkpoint.py`). What
that gives back depends on the kernel SDPA runs. The CPU flash kernel (what the runtime takes on
the CPU) keeps q, k, v, its output and an fp32 log-sum-exp per head and token, no s x s tensor:
checkpointing the core gives back the log-sum-exp only. The math kernel (forced here with
`sdpa_kernel(SDPBackend.MATH)`) is a composite of matmuls and a softmax that keeps the s x s
softmax output, the scaled q, k and v repeated to the query heads and a copy of its output:
checkpointing the core gives those back.

Measured with the runtime's own counter (`SavedActivations`: autograd's saved-tensor hooks plus
what a checkpoint keeps), over one forward of the runtime model and its loss; predicted by the
planner's per-tensor list (`plan/activations.py`) with the kernel named
(`Kernels(device="cpu", attention=...)`). CPU only, fp32.

    python -m llmscale.bench.selective                       # print the figures
    python -m llmscale.bench.selective --json-out docs/results/selective.json
                                # the record docs/memory-model.md's table is rendered from
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from llmscale.instrument.activations import SavedActivations, model_state_tensors
from llmscale.model.config import ModelConfig
from llmscale.model.transformer import AttentionCore, build_model
from llmscale.parallel.activation_checkpoint import apply_recompute
from llmscale.plan import activations as act
from llmscale.train.trainer import lm_loss

SUITE = "selective_kernels"
# Llama-shaped with grouped-query attention (2 kv heads of 4), 4 blocks: tiny, exact on the CPU.
MODEL = ModelConfig(
    dim=48, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=80, vocab_size=264, max_seq_len=16
)
MICRO_BATCH, SEQ = 3, 10
MODES = ("none", "selective")
# The SDPA path: "auto" is what the runtime takes (SDPA's own choice), "math" the forced composite.
BACKENDS: dict[str, SDPBackend | None] = {"auto": None, "math": SDPBackend.MATH}


class Saved(NamedTuple):
    """One forward's saved activation bytes and the autograd node of the attention output
    (which kernel ran: `ScaledDotProductFlashAttentionForCpuBackward0`, ...)."""

    bytes: int
    kernel_node: str


def saved_bytes(
    model_cfg: ModelConfig,
    recompute: str,
    backend: str,
    micro_batch: int = MICRO_BATCH,
    seq: int = SEQ,
) -> Saved:
    """Bytes autograd keeps over one forward and loss of the runtime model in fp32 on the CPU
    under `recompute`, with SDPA on `backend` ("auto" or "math")."""
    torch.manual_seed(0)
    model = build_model(model_cfg)
    apply_recompute(model, recompute)
    nodes: list[str] = []

    def note(_m: Any, _a: Any, out: torch.Tensor) -> None:
        if out.grad_fn is not None:
            nodes.append(type(out.grad_fn).__name__)

    for m in model.modules():
        if isinstance(m, AttentionCore):
            m.register_forward_hook(note)
    tokens = torch.randint(
        0, model_cfg.vocab_size, (micro_batch, seq + 1), generator=torch.Generator().manual_seed(1)
    )
    kind = BACKENDS[backend]
    with (
        sdpa_kernel(kind) if kind is not None else contextlib.nullcontext(),
        SavedActivations(model_state_tensors(model)) as counter,
    ):
        lm_loss(model(tokens[:, :-1]), tokens[:, 1:])
    return Saved(counter.bytes, nodes[0] if nodes else "")


def planner_kernel(model_cfg: ModelConfig, backend: str) -> str:
    """The planner's name of the kernel SDPA runs on `backend` on the CPU in fp32."""
    if backend == "math":
        return "math"
    return act.Kernels.for_runtime(model_cfg, 1, "cpu").attention_kernel(model_cfg, "fp32")


def predicted_bytes(
    model_cfg: ModelConfig,
    recompute: str,
    kernel: str,
    micro_batch: int = MICRO_BATCH,
    seq: int = SEQ,
) -> float:
    """The planner's saved bytes for the same forward in fp32 (no weight casts), attention on
    `kernel` (a `Kernels.attention` name)."""
    kern = dataclasses.replace(act.Kernels.for_runtime(model_cfg, 1, "cpu"), attention=kernel)
    blocks = model_cfg.n_layers * act.block_bytes(
        model_cfg, micro_batch, seq, "fp32", 1, False, kern, recompute
    )
    ends = [
        *act.embedding_tensors(micro_batch, seq),
        *act.head_tensors(model_cfg, micro_batch, seq, "fp32", 1, False, kern),
    ]
    return blocks + sum(float(t.nbytes) for t in ends)


def saving_by_hand(
    model_cfg: ModelConfig, kernel: str, micro_batch: int = MICRO_BATCH, seq: int = SEQ
) -> int:
    """What checkpointing the attention core gives back over the model in fp32, counted by hand
    from what each kernel's autograd nodes save (per token and block; H heads, d = H x head_dim,
    d_kv the keys' width):

    - flash: q, k, v, the output and the log-sum-exp; checkpointed, the core keeps its inputs
      q, k, v and wo keeps a view of the output: the log-sum-exp, 4·H B, is given back.
    - math: QK^T keeps the scaled q and k repeated to the H heads (4·d each), the softmax its
      s x s output (4·H·s; the scores are not kept), its product with v that output and v
      repeated (4·d); the output's copy is wo's input either way. Checkpointed, the core keeps
      q, k and v (4·d + 2·4·d_kv): 8·d − 8·d_kv + 4·H·s B is given back.
    """
    d, kv, h = model_cfg.dim, model_cfg.kv_dim, model_cfg.n_heads
    if kernel == "math":
        per_token = 8 * d - 8 * kv + 4 * h * seq
    elif kernel in act.FUSED_ATTENTION:
        per_token = 4 * h
    else:
        raise ValueError(f"no hand count for attention kernel {kernel!r}")
    return per_token * micro_batch * seq * model_cfg.n_layers


def rows() -> list[dict[str, Any]]:
    """Every (backend, recompute) of `MODEL`: measured and predicted, results.json's row schema,
    the kernel that ran in the note."""
    from llmscale.bench.report import Row

    out = []
    for backend in BACKENDS:
        kernel = planner_kernel(MODEL, backend)
        for mode in MODES:
            got = saved_bytes(MODEL, mode, backend)
            row = Row(SUITE, f"{backend} recompute={mode}", "activations", "B", got.bytes,
                      predicted_bytes(MODEL, mode, kernel), got.kernel_node)  # fmt: skip
            out.append(row.to_dict())
    return out


def record(argv: list[str]) -> dict[str, Any]:
    """The rows as a record in results.json's suite schema (docs/results/selective.json), with
    the model, shape and torch version they were measured with."""
    from llmscale.bench.timed import now_iso

    return {
        SUITE: {
            "measured_at": now_iso(),
            "title": "Saved activations under none and selective, CPU flash vs math attention",
            "rows": rows(),
            "tables": {},
            "figures": [],
            "notes": [
                f"runtime model, {MODEL.n_layers} blocks, d {MODEL.dim}, {MODEL.n_heads} heads, "
                f"{MODEL.n_kv_heads} kv heads, b {MICRO_BATCH}, s {SEQ}, fp32, CPU; one forward "
                "and loss, saved_tensors_hooks"
            ],
            "command": "python -m llmscale.bench.selective " + " ".join(argv),
            "torch": torch.__version__,
            "model": dataclasses.asdict(MODEL),
            "micro_batch_size": MICRO_BATCH,
            "seq_len": SEQ,
            "precision": "fp32",
        }
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        prog="python -m llmscale.bench.selective",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument(
        "--json-out",
        type=Path,
        help="write the figures as a record (docs/results/selective.json: make docs renders "
        "docs/memory-model.md's table from it)",
    )
    args = ap.parse_args(argv)
    rec = record(sys.argv[1:] if argv is None else argv)
    for r in rec[SUITE]["rows"]:
        print(f"{r['config']:<26} measured {r['measured']:>9,} B  predicted "
              f"{r['predicted']:>11,.0f} B  {r['note']}")  # fmt: skip
    if args.json_out is not None:
        args.json_out.parent.mkdir(parents=True, exist_ok=True)
        args.json_out.write_text(json.dumps(rec, indent=1) + "\n")
        print(f"wrote {args.json_out}")


if __name__ == "__main__":
    main()
