"""Published training runs, and the planner's prediction for each (bench/published.py).

The rows live in `validation/data/published.toml` (each with its source). Every prediction uses the
catalog's calibration of the GPU it ran on (one per GPU: hardware/data/gpus.toml) and the
stack that ran it (`llmscale.stack`), nothing per row; a pipeline is timed as `llmscale plan`
times the plans it shows (re-timed by the schedule simulator where its ops are few enough,
`plan.search.simulated`):

- Narayanan et al. 2021, Table 1 and Korthikanti et al. 2022, Table 5 / Fig. 1: Megatron-LM on
  DGX A100 80GB (stack "megatron-2021": fp16, dropout, materialised softmax, vocabulary-parallel
  head and loss, pipeline sends scattered over tensor-parallel ranks, the data-parallel
  all-reduce after the flush, 18 B of states per parameter).
- torchtitan (December 2024): Llama 3.1 8B under FSDP2 on H100 96GB (stack "torchtitan":
  FSDP2 resharding after forward, op-level selective checkpointing).
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmscale.config import PP_SCHEDULES, PPSchedule
from llmscale.errors import ConfigError
from llmscale.hardware.catalog import GiB
from llmscale.model.config import ModelConfig, get_preset
from llmscale.plan.cluster import Cluster
from llmscale.plan.memory import estimate_memory, memory_options
from llmscale.plan.plan import Plan
from llmscale.plan.search import simulated
from llmscale.plan.time import TimeParams, estimate_step_time, time_params
from llmscale.stack import MEGATRON_2021, TORCHTITAN

MEGATRON_2021_RUNTIME = time_params(MEGATRON_2021)
A100 = ("a100-80g", "dgx-a100")
H100_96G = ("h100-96g", "hgx-h100-96g")
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


def load_rows(
    path: str | Path = DATA, table: str = "narayanan2021"
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The `assume` table and the rows of `table` (each must carry a source)."""
    raw = tomllib.loads(Path(path).read_text())
    rows = raw.get(table, [])
    for i, row in enumerate(rows):
        if not str(row.get("source", "")).strip():
            raise ConfigError(f"{table}[{i}].source", row.get("source"), "a citation")
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
        tie_embeddings=True,  # GPT: under pp the megatron stacks keep a copy on the last stage
    )


def narayanan_2021(
    path: str | Path = DATA, params: TimeParams = MEGATRON_2021_RUNTIME
) -> list[Comparison]:
    """Predicted vs published TFLOP/s per GPU for every Table 1 row."""
    assume, rows = load_rows(path)
    cluster = Cluster.of(*A100)
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
        step = estimate_step_time(plan, cluster, params, simulate=simulated(plan))
        flops = narayanan_flops(int(row["batch"]), int(row["layers"]), int(row["hidden"]))
        predicted = flops / (step.seconds * gpus) / 1e12
        out.append(
            Comparison(
                plan.model.name, plan, float(row["tflops_per_gpu"]), predicted, row["source"]
            )
        )
    return out


@dataclass(frozen=True)
class Row:
    """One published number and the planner's prediction of it."""

    case: str
    layout: str
    quantity: str  # what is compared, with its unit
    published: float
    predicted: float
    source: str
    tolerance: float = 0.10  # |ratio - 1| the tests hold it to

    @property
    def ratio(self) -> float:
        """Predicted / published."""
        return self.predicted / self.published

    @property
    def within(self) -> bool:
        return abs(self.ratio - 1) <= self.tolerance


def narayanan_rows(path: str | Path = DATA) -> list[Row]:
    """Narayanan et al. 2021, Table 1, as rows (TFLOP/s per GPU)."""
    out = []
    for c in narayanan_2021(path):
        p = c.plan
        layout = f"t{p.tp} p{p.pp} d{p.dp}, {p.world_size} GPUs, batch {p.global_batch_size}"
        out.append(
            Row(c.name, layout, "TFLOP/s per GPU", c.published_tflops, c.predicted_tflops,
                c.source)
        )  # fmt: skip
    return out


def korthikanti_plan(row: dict[str, Any], recompute: str, sp: bool) -> Plan:
    """The Table 5 layout of `row` with `recompute` and sequence parallelism `sp`."""
    tp, pp, chunks = int(row["tp"]), int(row["pp"]), int(row["chunks"])
    return Plan(
        model=gpt_model(row),
        seq_len=SEQ_LEN,
        micro_batch_size=int(row["micro_batch"]),
        global_batch_size=int(row["batch"]),
        recompute=recompute,  # type: ignore[arg-type]
        precision="fp16",
        dp_replicate=int(row["gpus"]) // (tp * pp),
        tp=tp,
        pp=pp,
        pp_schedule="interleaved_1f1b" if chunks > 1 else "1f1b",
        pp_chunks=chunks,
        sequence_parallel=sp,
    )


def _layout(p: Plan) -> str:
    v = f" v{p.chunks}" if p.chunks > 1 else ""
    sp = " sp" if p.sequence_parallel else ""
    return f"t{p.tp} p{p.pp}{v}{sp}, {p.world_size} GPUs, batch {p.global_batch_size}"


def korthikanti_2022(path: str | Path = DATA) -> list[Row]:
    """Table 5 iteration times and Fig. 1 per-GPU memory of Korthikanti et al. 2022."""
    _, rows = load_rows(path, "korthikanti2022")
    params = time_params(MEGATRON_2021)
    cluster = Cluster.of(*A100)
    opts = memory_options(MEGATRON_2021)
    out = []
    for row in rows:
        case, src = f"GPT {row['params_billion']}B", str(row["source"])
        for recompute, sp, key, what in (
            ("full", False, "full_recompute_s", "iteration s, full recompute"),
            ("selective", True, "sp_selective_s", "iteration s, SP + selective"),
        ):
            plan = korthikanti_plan(row, recompute, sp)
            step = estimate_step_time(
                plan, cluster, params, validate=False, simulate=simulated(plan)
            )
            out.append(Row(case, _layout(plan), what, float(row[key]), step.seconds, src))
        full = korthikanti_plan(row, "none", False)
        # Fig. 1 counts the transformer layers' states (18 B x 12 l h^2 / (t p)): a middle
        # stage, without the first stage's embedding; activations peak on the first stage.
        middle = full.pp // 2
        mem = estimate_memory(full, opts, ranks=(middle,), validate=False).per_rank[0]
        states = (mem.params + mem.grads + mem.optimizer + mem.working_params) / GiB
        out.append(Row(case, _layout(full), "GiB params + optimizer", float(row["states_GiB"]),
                       states, src))  # fmt: skip
        for recompute, sp, key, what in (
            ("none", False, "activations_none_GiB", "GiB activations, no recompute"),
            ("selective", True, "activations_sp_selective_GiB", "GiB activations, SP + selective"),
        ):
            plan = korthikanti_plan(row, recompute, sp)
            acts = estimate_memory(plan, opts, ranks=(0,), validate=False).per_rank[0].activations
            out.append(Row(case, _layout(plan), what, float(row[key]), acts / GiB, src))
    return out


def torchtitan_plan(row: dict[str, Any]) -> Plan:
    gpus, local = int(row["gpus"]), int(row["local_batch"])
    return Plan(
        model=get_preset(str(row["model"])),
        seq_len=int(row["seq_len"]),
        micro_batch_size=local,
        global_batch_size=local * gpus,
        recompute="selective_op",  # torchtitan's selective AC, op policy
        precision="bf16",
        dp_shard=gpus,
    )


def torchtitan_2024(path: str | Path = DATA) -> list[Row]:
    """torchtitan's Llama 3.1 8B on H100 96GB: tokens/s per GPU and peak memory."""
    _, rows = load_rows(path, "torchtitan2024")
    cluster = Cluster.of(*H100_96G)
    opts = memory_options(TORCHTITAN)
    params = time_params(TORCHTITAN)
    out = []
    for row in rows:
        plan = torchtitan_plan(row)
        case, src = f"Llama 3.1 8B, {row['gpus']} GPUs", str(row["source"])
        layout = f"FSDP {plan.dp_shard}, local batch {plan.micro_batch_size}, seq {plan.seq_len}"
        step = estimate_step_time(plan, cluster, params, validate=False, simulate=simulated(plan))
        tps = plan.micro_batch_size * plan.seq_len / step.seconds
        out.append(Row(case, layout, "tokens/s per GPU", float(row["tokens_per_s_per_gpu"]),
                       tps, src))  # fmt: skip
        mem = estimate_memory(plan, opts, validate=False).total / GiB
        out.append(Row(case, layout, "GiB peak memory", float(row["memory_GiB"]), mem, src))
    return out


def all_rows(path: str | Path = DATA) -> list[Row]:
    """Every published row with its prediction."""
    return narayanan_rows(path) + korthikanti_2022(path) + torchtitan_2024(path)
