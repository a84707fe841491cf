"""`offload_bytes_moved`: counted by the copiers, predicted by plan/offload_traffic.py, equal.

Every metrics row carries the bytes copied between device and host in its step, both
directions. On this CPU host the "device" is the CPU too, but the copies run all the same.
"""

from __future__ import annotations

import threading

import pytest
import torch

from llmscale.bench.jobs import short_job
from llmscale.config import load_config
from llmscale.offload.engine import (
    InlineCopier,
    ThreadCopier,
    TrafficMeter,
    issued_bytes,
    make_agents,
    reset_meters,
)
from llmscale.plan import activations as act
from llmscale.plan.memory import MemoryOptions
from llmscale.plan.offload_traffic import TRAFFIC, offload_traffic
from llmscale.plan.plan import Plan
from llmscale.plan.predict import expected_runtime_metrics
from llmscale.train.trainer import Trainer

CPU = MemoryOptions(kernels=act.RUNTIME_CPU)


def test_copiers_count_what_they_are_asked_to_copy_on_one_meter() -> None:
    d2h, h2d, worker = make_agents(torch.device("cpu"), overlap=True, timeline=None)
    try:
        assert d2h.meter is h2d.meter
        a, b = torch.zeros(100), torch.zeros(30, dtype=torch.bfloat16)
        d2h.copy(torch.empty_like(a), a, 0, "u", "download").wait()
        h2d.copy(torch.empty_like(b), b, 0, "u", "upload").wait()
        h2d.copy(torch.empty_like(b), b, 0, "u", "upload").wait()
        assert d2h.meter.by_lane() == {"d2h": 400, "h2d": 120}
        # Host work queued before the read issues its copies first: the read waits for it.
        gate = threading.Event()
        worker.submit(lambda: (gate.wait(5), h2d.copy(torch.empty_like(a), a, 0, "u", "up")))
        threading.Timer(0.05, gate.set).start()
        assert issued_bytes((d2h, h2d), worker) == 520 + 400
        reset_meters((d2h, h2d))
        assert d2h.meter.bytes == 0
    finally:
        for agent in (d2h, h2d, worker):
            agent.close()


def test_inline_and_thread_copiers_count_alike() -> None:
    meter = TrafficMeter()
    inline, thread = InlineCopier("d2h", None, meter=meter), ThreadCopier("h2d", None, meter=meter)
    x = torch.arange(10.0)
    inline.copy(torch.empty_like(x), x, 0, "u", "download")
    thread.copy(torch.empty_like(x), x, 0, "u", "upload").wait()
    thread.close()
    assert meter.bytes == 80 and meter.by_lane() == {"d2h": 40, "h2d": 40}


def test_every_offload_mode_has_a_traffic_model() -> None:
    from llmscale.config import OFFLOAD_MODES

    assert set(OFFLOAD_MODES) <= set(TRAFFIC)


CASES = {
    "none": dict(optimizer__offload="none"),
    "optimizer": dict(optimizer__offload="optimizer"),
    "optimizer-accum-bf16": dict(
        optimizer__offload="optimizer", train__global_batch_size=4, precision__mode="bf16"
    ),
    "optimizer-serial-accum": dict(
        optimizer__offload="optimizer", optimizer__offload_overlap=False, train__global_batch_size=4
    ),
    # No clipping: the update and its uploads run inside backward (update_in_backward).
    "optimizer-in-backward": dict(optimizer__offload="optimizer", train__max_grad_norm=0),
    "params": dict(optimizer__offload="optimizer+params"),
    "params-accum-bf16": dict(
        optimizer__offload="optimizer+params", train__global_batch_size=4, precision__mode="bf16"
    ),
    "params-tied-accum": dict(
        optimizer__offload="optimizer+params",
        train__global_batch_size=4,
        model__tie_embeddings=True,
    ),
    "params-recompute-eval": dict(
        optimizer__offload="optimizer+params", train__recompute="full", train__eval_every=1
    ),
}


@pytest.mark.parametrize("name", list(CASES))
def test_bytes_moved_predicted_equals_measured(name, tmp_path) -> None:
    kw = {"train__global_batch_size": 2, **CASES[name]}
    cfg = load_config(None, short_job(job__run_dir=tmp_path, train__micro_batch_size=2, **kw))
    want = expected_runtime_metrics(cfg, options=CPU)["offload_bytes_moved"]
    with Trainer(cfg) as t:
        got = []
        for _ in range(3):
            got.append(t.train_step()["offload_bytes_moved"])
            if cfg.train.eval_every:
                t.evaluate()  # its fetches are not a training step's traffic
    assert got == [want] * 3
    if name == "none":
        assert want == 0
    else:
        assert want > 0


def test_traffic_by_hand_for_zero_offload() -> None:
    """ZeRO-Offload: gradients down per micro-step, weights up once, in the working dtype."""
    cfg = load_config(
        None,
        short_job(
            optimizer__offload="optimizer",
            train__micro_batch_size=2,
            train__global_batch_size=6,
            precision__mode="bf16",
        ),
    )
    n = cfg.model.num_params()
    t = offload_traffic(Plan.from_job(cfg), 0, act.RUNTIME_CPU)
    assert t is not None and (t.down, t.up) == (2 * n * 3, 2 * n)


def test_params_offload_under_a_pipeline_is_not_modelled() -> None:
    cfg = load_config(
        None,
        short_job(
            optimizer__offload="optimizer+params",
            parallel__pp=2,
            train__micro_batch_size=2,
            train__global_batch_size=4,
        ),
    )
    assert offload_traffic(Plan.from_job(cfg), 0, act.RUNTIME_CPU) is None
    assert "offload_bytes_moved" not in expected_runtime_metrics(cfg, options=CPU)
