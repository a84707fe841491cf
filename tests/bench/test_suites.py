"""The bench suites on the tiny model: numbers that must hold, not timings."""

from __future__ import annotations

import pytest

from llmscale.bench.report import markdown
from llmscale.bench.runner import BenchOptions
from llmscale.bench.suites import SUITES, get_suite
from llmscale.cli import main


@pytest.fixture(scope="module")
def opts(tmp_path_factory) -> BenchOptions:
    base = tmp_path_factory.mktemp("bench")
    return BenchOptions(
        model="tiny",
        seq_len=32,
        steps=1,
        warmup=0,
        device="cpu",
        data_files=8,
        seeds=2,
        png_dir=base / "png",
        work_dir=base,
    )


def test_memory_states_exact_and_activations_within_3_percent(opts) -> None:
    res = get_suite("memory")(opts)
    states = [
        r
        for r in res.rows
        if r.quantity in ("param", "grad", "optimizer") and "offload" not in r.config
    ]
    assert len(states) == 6 and all(r.ratio == 1.0 for r in states)
    acts = [r for r in res.rows if r.quantity == "activations"]
    assert len(acts) == 22  # 2 precisions x 2 micro-batch sizes x 5 recompute modes + 2 offload
    offload = [r for r in res.rows if "offload" in r.config]
    assert offload and all(r.measured == r.predicted for r in offload)
    host = [r for r in offload if r.quantity == "host master + moments"]
    assert len(host) == 2 and all(r.measured > 0 for r in host)
    assert all(abs(r.ratio - 1) < 0.03 for r in acts)
    assert res.figures[0].read_bytes()[:4] == b"\x89PNG"


def test_accumulation_gradients_equal_and_activations_scale(opts) -> None:
    res = get_suite("accum")(opts)
    (header, rows) = next(iter(res.tables.values()))
    assert all(float(r[1]) < 1e-5 for r in rows)
    acts = {r.config: r.measured for r in res.rows if r.quantity == "activations"}
    assert acts["b=32 k=1"] > acts["b=8 k=4"] > acts["b=2 k=16"]


def test_recompute_overheads_predicted_from_flops(opts) -> None:
    """The extra FLOPs of each mode against a hand count for the tiny model at seq 32 (dim 64,
    4 blocks of 49,152 matmul weights (wq, wo 64 x 64; wk, wv 64 x 32; w1, w2, w3 64 x 192),
    vocabulary 264): forward per token 2 x 4 x (49,152 + 2 x 32 x 64) = 425,984 in the blocks,
    2 x 264 x 64 = 33,792 in the head; training 3x that. Full recompute redoes the blocks'
    forward, every_k (k = 2) half the blocks, selective the attention core (2 x 4 x 2 x 32 x 64)."""
    res = get_suite("recompute")(opts)
    pred = {r.config: r.predicted for r in res.rows}
    assert 1 < pred["recompute=selective"] < pred["recompute=every_k"] < pred["recompute=full"]
    train = 3 * (425_984 + 33_792)
    hand = {"none": 0.0, "full": 425_984 / train, "every_k": 212_992 / train,
            "selective": 32_768 / train}  # fmt: skip
    (header, rows) = res.tables["step times (fastest step)"]
    extra = {row[0]: row[header.index("extra FLOPs")] for row in rows}
    for mode, share in hand.items():
        assert extra[mode] == f"+{100 * share:.1f}%", mode
    assert (extra["full"], extra["every_k"], extra["selective"]) == ("+30.9%", "+15.4%", "+2.4%")
    for r in res.rows:  # each row's note is its mode's hand count
        mode = r.config.split("=")[1]
        if mode in hand:
            assert r.note == f"FLOPs alone: +{100 * hand[mode]:.1f}%"


def test_precision_underflow_falls_with_scale(opts) -> None:
    res = get_suite("precision")(opts)
    assert {r.config for r in res.rows} == {"fp32", "bf16", "fp16"}
    assert all(r.ratio == 1.0 for r in res.rows if r.quantity == "states")
    table = next(v for k, v in res.tables.items() if "underflow" in k)[1]
    cast = [float(row[1].rstrip("%")) for row in table]
    assert cast == sorted(cast, reverse=True) and cast[0] > cast[-1]
    assert len(table) == 14 and table[0][0] == "2^0" and table[-1][0] == "2^15"
    # median over opts.seeds runs, within their range
    for row in table:
        lo, hi = (float(x) for x in row[2].rstrip("%").split("-"))
        assert lo <= float(row[1].rstrip("%")) <= hi


def test_time_suite_rows_scale_with_the_tokens_and_sum_their_parts(opts) -> None:
    """Against references outside the time model: on one device's figures, 4x the tokens (mbs
    16 vs 4) costs more but at most 4x (per-step costs do not grow with the tokens, nothing grows
    faster than them), and each predicted row is the sum of the parts its note lists (ms,
    rounded). The measured side is not compared with the prediction here: on a shared 2-core
    machine it moves by 10x, and so do the figures of two shapes calibrated minutes apart (the
    suite's rows each use their own shape's), so the scaling is checked on one calibration."""
    from llmscale.bench.timing import calibrated
    from llmscale.plan.predict import predict_step_time

    res = get_suite("time")(opts)
    assert len(res.rows) == 4 and all(r.measured > 0 for r in res.rows)
    for precision in ("fp32", "bf16"):
        cluster, params, _ = calibrated(opts, 4, precision)
        small, big = (
            predict_step_time(
                opts.job("--precision.mode", precision, "--train.micro_batch_size", str(mbs),
                         "--train.global_batch_size", str(mbs)),
                cluster, params,
            ).seconds
            for mbs in (4, 16)
        )  # fmt: skip
        assert 1.0 < big / small <= 4.0, precision
    for r in res.rows:
        parts = [float(p.split()[-1]) for p in r.note.removeprefix("ms: ").split(", ")]
        assert sum(parts) == pytest.approx(1000 * r.predicted, abs=0.5 * len(parts))
    md = markdown([res], header="# results")
    assert "| fp32 mbs=4 | step time |" in md


def test_every_listed_suite_exists() -> None:
    for name in SUITES:
        assert callable(get_suite(name))


def test_cli_rejects_unknown_suite(capsys) -> None:
    assert main(["bench", "--what", "speed"]) == 2
    assert "--what: got 'speed'" in capsys.readouterr().err


def test_cli_rejects_no_seeds(capsys) -> None:
    assert main(["bench", "--what", "precision", "--seeds", "0"]) == 2
    assert "--seeds: got 0" in capsys.readouterr().err


def test_finetune_compares_the_modes_from_the_same_weights(opts) -> None:
    from llmscale.bench import finetune

    res = finetune.run(opts, pretrain_steps=3, steps=5)
    modes = finetune.contenders()
    assert {"none", "optimizer"} <= set(modes) and "optimizer+params" not in modes
    (header, table) = next(iter(res.tables.values()))
    assert [r[0] for r in table] == modes
    first = {r[0]: float(r[1]) for r in table}
    # The same pretrained weights and batches: the first step's loss is the same for every mode.
    assert first["optimizer"] == pytest.approx(first["none"], rel=1e-6)
    final = {r[0]: float(r[2]) for r in table}
    assert final["optimizer"] == pytest.approx(final["none"], rel=1e-4)  # fused kernel: ~1e-6
    moved = {r.config: r for r in res.rows if r.quantity == "bytes moved per step"}
    assert moved["none"].measured == 0
    assert moved["optimizer"].measured == moved["optimizer"].predicted > 0
    # The overlapped step times are medians of interleaved rounds, each quoted with its spread.
    timed = [r for r in res.rows if r.suite == "finetune-time" and "median" in r.quantity]
    assert timed and all(r.spread is not None and 0 <= r.spread < r.measured for r in timed)
    assert res.figures[0].read_bytes()[:4] == b"\x89PNG"


def test_finetune_lsp_keeps_the_loss_and_moves_a_quarter_of_the_bytes(tmp_path) -> None:
    """Issue 17's goals on the bench's model (small: 256 to 768 wide, d = 64 to 128): LSP-Offload
    ends within 3% of ZeRO-Offload's fine-tuning loss and moves at most a quarter of its bytes,
    as predicted (the step-time goal is the bench's, not a test's)."""
    from llmscale.bench import finetune

    opts = BenchOptions(
        model="small", seq_len=32, steps=1, warmup=0, device="cpu", data_files=8,
        png_dir=None, work_dir=tmp_path,
    )  # fmt: skip
    res = finetune.run(opts, pretrain_steps=10, steps=10, links_gbps=())
    final = {r.config: r.measured for r in res.rows if r.quantity.startswith("final loss")}
    assert abs(final["lsp"] / final["optimizer"] - 1) <= 0.03  # measured -0.49%
    moved = {r.config: r for r in res.rows if r.quantity == "bytes moved per step"}
    assert moved["lsp"].measured == moved["lsp"].predicted
    assert moved["lsp"].measured <= moved["optimizer"].measured / 4  # measured 0.14
