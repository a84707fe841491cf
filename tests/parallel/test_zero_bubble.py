"""The zero-bubble pipeline schedules (zero_bubble, zbv, dualpipev) train like one process.

Two torchrun process groups (2 and 4 ranks) train their layouts in turn, as in test_layouts.py:
5 steps of the tiny model (fp32, gloo, global batch 8 x 32 tokens); losses, validation loss and
final parameters equal an in-process single-process run to 1e-5 relative. The 2-rank group also
saves and resumes (bit-exactly under zbv; across schedules, 1f1b to zbv) and records the
pipeline timeline, whose per-rank F/B/W order must be torch's own `pipeline_order`.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch
from parallel_harness import BASE, assert_same_run, rel_error, run_layouts, single_process_reference

from llmscale.config import load_config
from llmscale.errors import ConfigError
from llmscale.instrument.pipeline import FILE_NAME
from llmscale.model.config import get_preset
from llmscale.model.transformer import build_model
from llmscale.parallel import pipeline
from llmscale.parallel.pipeline import pipeline_split, schedule_stage_ids
from llmscale.parallel.timeline import PipelineTimeline, rank_op_orders
from llmscale.train.metrics import read_jsonl


def _pp(schedule: str, pp: int = 2, **more: Any) -> list[str]:
    args = ["--parallel.pp", str(pp), "--parallel.pp_schedule", schedule]
    if schedule == "zero_bubble":
        args += ["--parallel.pp_chunks", "2"]
    for k, v in more.items():
        args += [f"--{k.replace('__', '.')}", str(v).lower()]
    return args


TIMELINE = {"metrics__pipeline_timeline": True}
CKPT = ["--checkpoint.enabled", "true", "--checkpoint.keep_last", "5"]
WORLD2 = {
    "zb": _pp("zero_bubble", **TIMELINE),
    "zbv": _pp("zbv", **TIMELINE),
    "dualpipev": _pp("dualpipev", **TIMELINE),
    "zb_recompute_full": _pp("zero_bubble", train__recompute="full"),
    "zbv_recompute_selective": _pp("zbv", train__recompute="selective"),
}
RESUME = [
    # zbv saves after step 3 and resumes to step 5: bit for bit the uninterrupted zbv run.
    {"name": "zbv_save", "run": "zbv_resume", "args": [*_pp("zbv"), *CKPT,
                                                       "--checkpoint.stop_after", "3"]},
    {"name": "zbv_load", "run": "zbv_resume", "args": [*_pp("zbv"), *CKPT,
                                                       "--checkpoint.resume", "true"]},
    # 1f1b (stages 0 | 1 by rank) saves; zbv (stages 0, 3 | 1, 2) resumes from it.
    {"name": "f1b_save", "run": "cross", "args": [*_pp("1f1b"), *CKPT,
                                                  "--checkpoint.stop_after", "3"]},
    {"name": "zbv_from_1f1b", "run": "cross", "args": [*_pp("zbv"), *CKPT,
                                                       "--checkpoint.resume", "true"]},
]  # fmt: skip
BF16 = {"zbv_bf16": [*_pp("zbv"), "--precision.mode", "bf16"]}
L8 = ("--model.n_layers", "8")
WORLD4 = {  # name: (args, the reference's extra overrides)
    "zbv_fsdp": (_pp("zbv", parallel__dp_shard=2, parallel__zero_stage=2), ()),
    "zb_fsdp": (_pp("zero_bubble", parallel__dp_shard=2, parallel__zero_stage=2), ()),
    # zero 3: FSDP reshards each stage after every F; B and W must still see the gathered
    # parameters (parallel/pipeline.py `_gather_before_split_backward`).
    "zbv_fsdp_zero3": (_pp("zbv", parallel__dp_shard=2, parallel__zero_stage=3), ()),
    "zb_fsdp_zero3": (_pp("zero_bubble", parallel__dp_shard=2, parallel__zero_stage=3), ()),
    "dualpipev_tp": (_pp("dualpipev", parallel__tp=2), ()),
    "zbv_pp4": ([*_pp("zbv", pp=4), *L8], L8),
    "zb_pp4": ([*_pp("zero_bubble", pp=4), *L8], L8),
    # dualpipev at pp=4 needs 2 x 4 micro-batches: 8 of one sequence each.
    "dualpipev_pp4": ([*_pp("dualpipev", pp=4, train__micro_batch_size=1), *L8], L8),
}


def _layouts(table: dict[str, list[str]]) -> list[dict[str, Any]]:
    return [{"name": n, "args": a} for n, a in table.items()]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[str, Any]:
    return single_process_reference(tmp_path_factory.mktemp("single") / "run")


@pytest.fixture(scope="module")
def world2(tmp_path_factory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("zb_world2")
    layouts = [*_layouts(WORLD2), *RESUME, *_layouts(BF16)]
    return {"out": out, **run_layouts(2, out, layouts, timeout=400)}


@pytest.fixture(scope="module")
def world4(tmp_path_factory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("zb_world4")
    layouts = [{"name": n, "args": a} for n, (a, _) in WORLD4.items()]
    return run_layouts(4, out, layouts, timeout=500)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(WORLD2))
def test_two_ranks_equal_one_process(name, world2, reference) -> None:
    assert_same_run(world2[name], reference, name)


@pytest.fixture(scope="module")
def reference_8_layers(tmp_path_factory) -> dict[str, Any]:
    return single_process_reference(tmp_path_factory.mktemp("single8") / "run", L8)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(WORLD4))
def test_four_ranks_equal_one_process(name, world4, reference, reference_8_layers) -> None:
    ref = reference_8_layers if WORLD4[name][1] else reference
    assert_same_run(world4[name], ref, name)


@pytest.mark.slow
def test_resume_under_zbv_is_bit_exact(world2) -> None:
    saved, resumed, whole = world2["zbv_save"], world2["zbv_load"], world2["zbv"]
    assert saved["steps_done"] == 3 and resumed["steps_done"] == 5
    assert saved["losses"] == whole["losses"][:3]
    assert resumed["losses"] == whole["losses"][3:]  # steps 4 and 5, bit for bit
    assert set(resumed["params"]) == set(whole["params"])
    for k, want in whole["params"].items():
        assert torch.equal(resumed["params"][k], want), k


@pytest.mark.slow
def test_a_1f1b_checkpoint_resumes_under_zbv(world2, reference) -> None:
    """Blocks keep their names whatever the placement, so rank 0's stage 3 (a V) takes its
    layers from what 1f1b's rank 1 saved; the curve is the uninterrupted one."""
    resumed = world2["zbv_from_1f1b"]
    assert resumed["steps_done"] == 5 and len(resumed["losses"]) == 2
    rows = [r for r in read_jsonl(resumed["run_dir"] / "metrics.jsonl") if r["kind"] == "train"]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    for row, want in zip(rows, reference["losses"], strict=True):
        assert rel_error(row["loss"], want) < 1e-5, (row["step"], row["loss"], want)
    for k, want in reference["params"].items():
        assert rel_error(resumed["params"][k], want) < 1e-5, k


@pytest.mark.slow
def test_bf16_trains(world2, reference) -> None:
    """Mixed precision under zbv (autocast, no data parallelism): finite and near fp32."""
    got = world2["zbv_bf16"]["losses"]
    assert len(got) == 5 and all(x == x for x in got)
    for a, b in zip(got, reference["losses"], strict=True):
        assert rel_error(a, b) < 2e-2, (a, b)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["zb", "zbv", "dualpipev"])
def test_measured_op_order_is_torchs(name, world2) -> None:
    """Each rank's recorded F / B / W ops, by start time, are torch's pipeline_order for the
    schedule, every step (W ops timed apart from their B)."""
    payload = torch.load(world2["out"] / f"{name}.stage0.pt", weights_only=False)
    want = [[tuple(op) for op in rank] for rank in payload["torch_order"]]
    assert any(k == "W" for rank in want for k, _, _ in rank)  # a split backward: W ops
    path = world2[name]["run_dir"] / FILE_NAME
    tl = PipelineTimeline.load(path)
    assert json.loads(path.read_text())["chunks"] == 2
    assert sorted(tl.steps) == [1, 2, 3, 4, 5]
    for step, ops in tl.steps.items():
        got = [[tuple(op) for op in rank] for rank in rank_op_orders(ops, 2)]
        assert got == want, (name, step)
        v = name != "zb"
        for o in ops:  # the chunk is the stage's place on its rank: loop style or a V
            assert o.chunk == ([o.rank, 3 - o.rank] if v else [o.rank, o.rank + 2]).index(o.stage)


# ---- in one process -----------------------------------------------------------------------


def test_v_placement_splits_the_model_into_a_v() -> None:
    assert [schedule_stage_ids("zbv", r, 4, 1) for r in range(4)] == [
        [0, 7], [1, 6], [2, 5], [3, 4],
    ]  # fmt: skip
    assert schedule_stage_ids("dualpipev", 1, 2, 2) == [1, 2]
    assert schedule_stage_ids("zero_bubble", 1, 2, 2) == [1, 3]
    assert schedule_stage_ids("1f1b", 1, 2, 1) == [1]
    model = build_model(get_preset("tiny"), "meta")
    parts, ids = pipeline_split(model, 0, 2, 1, schedule="zbv")
    assert ids == [0, 3]
    assert [list(p.layers) for p in parts] == [["0"], ["3"]]
    assert parts[0].tok_embeddings is not None and parts[0].output is None
    assert parts[1].tok_embeddings is None and parts[1].output is not None


@pytest.mark.parametrize(
    ("args", "field", "says"),
    [
        (_pp("dualpipev", train__global_batch_size=6), "train.global_batch_size",
         "at least 2 x pp=4 for dualpipev"),
        ([*_pp("zero_bubble", pp=4, train__global_batch_size=12), *L8],
         "train.global_batch_size", "a multiple of pp=4 for zero_bubble"),
        (_pp("zbv", parallel__pp_chunks=3), "parallel.pp_chunks", "unset or 2"),
    ],
)  # fmt: skip
def test_what_torch_cannot_run_is_refused_in_one_line(args, field, says) -> None:
    with pytest.raises(ConfigError) as e:
        load_config(None, [*BASE, *args])
    msg = str(e.value)
    assert msg.startswith(f"{field}: ") and says in msg and "\n" not in msg


def test_zero3_is_accepted_under_the_split_backward_schedules() -> None:
    for args in (
        _pp("zbv", parallel__dp_shard=2),
        _pp("dualpipev", parallel__dp_shard=2, parallel__dp_replicate=2,
            train__global_batch_size=32),
    ):  # fmt: skip
        assert load_config(None, [*BASE, *args]).parallel.zero_stage == 3


def _zero3_stage_grads(tmp_path, schedule: str, gather: bool) -> dict[str, float | None]:
    """Both stages of `schedule` on one rank (pp = 1 holds the whole V or loop), each FSDP2
    zero 3 over a 1-rank mesh; one step of 4 micro-batches. Each parameter's gradient error
    relative to the plain model's (None: no gradient). `gather=False` leaves torch alone."""
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh

    from llmscale.parallel.data_parallel import apply_fsdp

    if dist.is_initialized():
        pytest.skip("a process group already exists")
    tmp_path.mkdir(parents=True)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        model = build_model(get_preset("tiny"))
        plain = build_model(get_preset("tiny"))
        parts, ids = pipeline_split(model, 0, 1, 2, schedule=schedule)
        for part in parts:
            apply_fsdp(part, init_device_mesh("cpu", (1,)), shard=True, zero_stage=3,
                       precision="fp32")  # fmt: skip
        gen = torch.Generator().manual_seed(0)
        x, y = (torch.randint(0, 256, (8, 16), generator=gen) for _ in range(2))

        def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            return F.cross_entropy(logits.flatten(0, 1), targets.flatten()) / 4

        keep = pipeline._gather_before_split_backward
        if not gather:
            pipeline._gather_before_split_backward = lambda stage: None
        try:
            sched: Any = pipeline.build_pipeline_schedule(
                parts, ids, 2, schedule, 4, loss_fn, torch.device("cpu"), dist.group.WORLD
            )
        finally:
            pipeline._gather_before_split_backward = keep
        sched.step(x, target=y, return_outputs=False)
        F.cross_entropy(plain(x).flatten(0, 1), y.flatten()).backward()
        want = {n: p.grad for n, p in plain.named_parameters()}
        out: dict[str, float | None] = {}
        for part in parts:
            for n, p in part.named_parameters():
                g = None if p.grad is None else p.grad.full_tensor()
                out[n] = None if g is None else rel_error(g, want[n])
        sched = None  # its stages hold the process group: gone before it is destroyed
        return out
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("schedule", ["zbv", "zero_bubble"])
def test_zero3_split_backward_needs_the_stage_gathered(tmp_path, schedule) -> None:
    """Why the runtime gathers a zero-3 stage before each B and W: torch 2.13's B reads
    `submod.parameters()` before its autograd call, and after an F FSDP2 has swapped them for
    the sharded DTensors, which are in no graph, so that micro-batch's weight gradients are
    dropped without a word. The first half fails if torch changes (then the gather can go)."""
    without = _zero3_stage_grads(tmp_path / "torch", schedule, gather=False)
    dropped = [n for n, e in without.items() if e is None or e > 1e-3]
    assert dropped, "torch's split backward now sees FSDP's parameters: drop the gather"
    with_gather = _zero3_stage_grads(tmp_path / "gathered", schedule, gather=True)
    assert set(with_gather) == set(without)
    for n, e in with_gather.items():
        assert e is not None and e < 1e-5, (schedule, n, e)
