"""Published training throughputs, and the planner's prediction for each (bench/published.py).

The rows live in `plan/data/published.toml` (each with its source). Narayanan et al. 2021,
Table 1 ran Megatron-LM on DGX A100 80GB nodes; the prediction uses the planner's default
efficiencies (`TimeParams()`), with only the facts of that runtime changed, the same for every
row: Megatron's kernels (fp16, dropout, materialised softmax, vocabulary-parallel head:
`MEGATRON_2021`), its scatter/gather of pipeline sends over tensor-parallel ranks, and its
data-parallel all-reduce after the pipeline flush (no overlap).
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from llmscale.config import PP_SCHEDULES, PPSchedule
from llmscale.errors import ConfigError
from llmscale.model.config import ModelConfig
from llmscale.plan import activations as act
from llmscale.plan.cluster import Cluster
from llmscale.plan.plan import Plan
from llmscale.plan.time import DEFAULT_TIME, TimeParams, estimate_step_time

MEGATRON_2021_RUNTIME = replace(
    DEFAULT_TIME, kernels=act.MEGATRON_2021, p2p_scatter_gather=True, dp_overlap=0.0
)
SEQ_LEN = 2048
VOCAB = 51200
DATA = Path(__file__).parent / "data" / "published.toml"


@dataclass(frozen=True)
class Comparison:
    name: str
    plan: Plan
    published_tflops: float
    predicted_tflops: float
    source: str

    @property
    def ratio(self) -> float:
        """Predicted / published."""
        return self.predicted_tflops / self.published_tflops


def narayanan_flops(
    batch: int, layers: int, hidden: int, seq: int = SEQ_LEN, vocab: int = VOCAB
) -> float:
    """FLOPs per iteration as Narayanan et al. 2021 count them (eq. 3, recomputation included)."""
    s, l_, h, v = seq, layers, hidden, vocab
    return 96.0 * batch * s * l_ * h * h * (1 + s / (6 * h) + v / (16 * l_ * h))


def load_rows(path: str | Path = DATA) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    raw = tomllib.loads(Path(path).read_text())
    rows = raw.get("narayanan2021", [])
    for i, row in enumerate(rows):
        if not str(row.get("source", "")).strip():
            raise ConfigError(f"narayanan2021[{i}].source", row.get("source"), "a citation")
    return raw.get("assume", {}), rows


def _schedule(name: str) -> PPSchedule:
    for schedule in PP_SCHEDULES:
        if schedule == name:
            return schedule
    raise ConfigError("pp_schedule", name, " | ".join(PP_SCHEDULES))


def gpt_model(row: dict[str, Any]) -> ModelConfig:
    h = int(row["hidden"])
    return ModelConfig(
        name=f"gpt-{row['params_billion']}b",
        vocab_size=VOCAB,
        dim=h,
        n_layers=int(row["layers"]),
        n_heads=int(row["heads"]),
        n_kv_heads=int(row["heads"]),
        ffn_dim=4 * h,
        max_seq_len=SEQ_LEN,
        norm="layernorm",
        mlp="gelu",
        pos_emb="learned",
        bias=True,
        tie_embeddings=int(row["pp"]) == 1,  # Megatron keeps a copy on the last stage otherwise
    )


def narayanan_2021(
    path: str | Path = DATA, params: TimeParams = MEGATRON_2021_RUNTIME
) -> list[Comparison]:
    """Predicted vs published TFLOP/s per GPU for every Table 1 row."""
    assume, rows = load_rows(path)
    cluster = Cluster.of("a100-80g", node="dgx-a100")
    out = []
    for row in rows:
        tp, pp, gpus = int(row["tp"]), int(row["pp"]), int(row["gpus"])
        plan = Plan(
            model=gpt_model(row),
            seq_len=SEQ_LEN,
            micro_batch_size=int(assume.get("micro_batch_size", 1)),
            global_batch_size=int(row["batch"]),
            recompute="full",
            precision="fp16",
            dp_replicate=gpus // (tp * pp),
            tp=tp,
            pp=pp,
            pp_schedule=_schedule(str(assume.get("pp_schedule", "1f1b"))),
        )
        step = estimate_step_time(plan, cluster, params)
        flops = narayanan_flops(int(row["batch"]), int(row["layers"]), int(row["hidden"]))
        predicted = flops / (step.seconds * gpus) / 1e12
        out.append(
            Comparison(
                plan.model.name, plan, float(row["tflops_per_gpu"]), predicted, row["source"]
            )
        )
    return out
