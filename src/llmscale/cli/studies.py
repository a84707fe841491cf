"""The roofline, network and infer: the analyses beside training plans."""

from __future__ import annotations

import argparse

from llmscale.cli._args import (
    Parser,
    one_of,
    show,
)
from llmscale.config import (
    PRECISIONS,
)

# ---- roofline -----------------------------------------------------------------------------


def _add_roofline(sub: argparse._SubParsersAction[Parser]) -> None:
    p = sub.add_parser(
        "roofline",
        help="arithmetic intensity of training and decoding vs the GPU's ridge point",
        description=(
            "FLOPs per byte of HBM traffic for a training step (batch x seq tokens) and for "
            "decoding one token for each of `batch` sequences with `seq` tokens of KV cache, "
            "compared with the GPU's ridge point (dense peak / HBM bandwidth): above it the "
            "work is compute-bound, below it memory-bound."
        ),
        epilog="Example: llmscale roofline --gpu h200 --model llama2-70b --batch 1 --seq 4096",
    )
    p.add_argument("--gpu", default="h200", help="GPU name (llmscale hw; default h200)")
    p.add_argument(
        "--model", default="llama2-70b", help="model preset (llmscale models; default llama2-70b)"
    )
    p.add_argument("--batch", type=int, default=1, help="sequences (default 1)")
    p.add_argument("--seq", type=int, help="tokens per sequence (default: the model's maximum)")
    p.add_argument("--precision", default="bf16", help=" | ".join(PRECISIONS) + " (default bf16)")
    p.set_defaults(func=_cmd_roofline)


def _cmd_roofline(args: argparse.Namespace, overrides: list[str]) -> int:
    from llmscale.hardware.catalog import get_gpu
    from llmscale.model.config import get_preset
    from llmscale.report.roofline_report import roofline_report

    model, gpu = get_preset(args.model), get_gpu(args.gpu)
    one_of("precision", args.precision, PRECISIONS)
    rep = roofline_report(
        model, gpu, args.batch, model.max_seq_len if args.seq is None else args.seq, args.precision
    )
    return show(rep.title, rep.table, rep.conclusion)


# ---- network ------------------------------------------------------------------------------


def _add_network(sub: argparse._SubParsersAction[Parser]) -> None:
    p = sub.add_parser(
        "network",
        help="rail-optimized fat-tree vs rail-only (and optics): switches, cost, step time",
        description=(
            "Size a non-blocking rail-optimized fat-tree and a rail-only network (Wang et al. "
            "2023) for the GPUs: tiers, switches, links, transceivers and cost (assumed prices "
            "in hardware/data/network.toml), plus a co-packaged-optics fat-tree; then the step "
            "time of the best plan for --model on each, and an all-to-all (MoE-style) time, "
            "where rail-only forwards cross-rail bytes over NVLink. --gpus is capped at what a "
            "3-tier non-blocking Clos of the NIC's switches connects (65,536 for h100 and h200: "
            "radix 64, 8 NICs per node, answered in about 2 s; 16,000 for the a100s: radix 40)."
        ),
        epilog="Example: llmscale network --gpus 1024 --gpu h100",
    )
    p.add_argument("--gpus", type=int, required=True, help="number of GPUs (whole nodes)")
    p.add_argument("--gpu", default="h100", help="GPU name (default h100)")
    p.add_argument(
        "--model", default="llama2-70b", help="model preset for the plan (default llama2-70b)"
    )
    p.add_argument("--seq", type=int, default=4096, help="sequence length (default 4096)")
    p.add_argument("--global-batch", type=int, help="sequences per step (default: GPUs)")
    p.add_argument(
        "--a2a-mb", type=float, default=256.0, help="all-to-all MB per GPU (default 256)"
    )
    p.set_defaults(func=_cmd_network)


def _cmd_network(args: argparse.Namespace, overrides: list[str]) -> int:
    from llmscale.model.config import get_preset
    from llmscale.report.network_report import network_report

    rep = network_report(
        get_preset(args.model), args.gpus, args.gpu, args.seq, args.global_batch, args.a2a_mb
    )
    return show(rep.table, *rep.lines)


# ---- infer --------------------------------------------------------------------------------


def _add_infer(sub: argparse._SubParsersAction[Parser]) -> None:
    from llmscale.plan.inference import ASSUMPTIONS, DEFAULT_RESERVE, INFER_PRECISIONS

    p = sub.add_parser(
        "infer",
        help="serving throughput: prefill, decode, KV-cache batch bound, tensor parallelism",
        description=(
            "Predict offline serving throughput of a model on catalog GPUs (torch-free, "
            "plan/inference.py): prefill of the prompt tokens (compute: FLOPs at the GPU's "
            "calibrated GEMM efficiency), decode of one token per step (memory: the weight "
            "shard and the KV caches read at the calibrated HBM bandwidth), the batch bounded "
            "by the HBM left for KV caches after the weights and a reserve (grouped-query "
            "attention counted through n_kv_heads), tensor parallelism inside one node with "
            "two all-reduces per block over its scale-up link, and each phase's roofline "
            "regime against the GPU's ridge point. Assumptions: " + "; ".join(ASSUMPTIONS) + "."
        ),
        epilog=(
            "Example: llmscale infer --model llama2-70b --gpu h200 --gpus 1 --input-len 2048 "
            "--output-len 128 --precision fp8   (NVIDIA's 1.9x H200/H100 case; docs/inference.md)"
        ),
    )
    p.add_argument("--model", required=True, help="model preset (llmscale models)")
    p.add_argument("--gpu", required=True, help="GPU name (llmscale hw)")
    p.add_argument("--gpus", type=int, required=True, help="GPUs serving (replicas x tp)")
    p.add_argument("--input-len", type=int, required=True, help="prompt tokens per sequence")
    p.add_argument("--output-len", type=int, required=True, help="generated tokens per sequence")
    p.add_argument(
        "--precision",
        default="bf16",
        help=" | ".join(INFER_PRECISIONS) + " (weights and KV cache; default bf16)",
    )
    p.add_argument("--tp", type=int, help="tensor-parallel degree (default: the fastest)")
    p.add_argument("--batch", type=int, help="sequences per batch (default: the most that fit)")
    p.add_argument(
        "--reserve",
        type=float,
        default=DEFAULT_RESERVE,
        help=f"fraction of HBM held back (default {DEFAULT_RESERVE}: vLLM's 0.9 utilisation)",
    )
    p.add_argument("--json", action="store_true", help="print the prediction as JSON")
    p.set_defaults(func=_cmd_infer)


def _cmd_infer(args: argparse.Namespace, overrides: list[str]) -> int:
    import json

    from llmscale.model.config import get_preset
    from llmscale.plan.inference import INFER_PRECISIONS, predict
    from llmscale.report.inference_report import inference_report

    one_of("precision", args.precision, INFER_PRECISIONS)
    pred = predict(
        get_preset(args.model), args.gpu, args.gpus, args.input_len, args.output_len,
        args.precision, tp=args.tp, batch=args.batch, reserve=args.reserve, model_name=args.model,
    )  # fmt: skip
    if args.json:
        print(json.dumps(pred.to_dict(), indent=2))
        return 0
    rep = inference_report(pred)
    return show(rep.title, rep.table, *rep.lines)


def add(sub: argparse._SubParsersAction[Parser]) -> None:
    """Register this family's commands."""
    _add_roofline(sub)
    _add_network(sub)
    _add_infer(sub)
