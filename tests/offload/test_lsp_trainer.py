"""The trainer with `[optimizer] offload = "lsp"`: ledger and bytes as predicted, refit, resume,
fine-tuning from a run, low precision, and what is refused."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from llmscale.cli import main
from llmscale.config import load_config
from llmscale.errors import ConfigError
from llmscale.offload import OffloadedAdamW
from llmscale.plan.lsp import lsp_bytes_per_step, matrix_dims, one_process_split
from llmscale.plan.predict import runtime_metric_bytes
from llmscale.train.metrics import read_jsonl
from llmscale.train.trainer import Trainer

# One block (7 matrices through the projectors), 2 micro-batches per step.
LSP = (
    "--optimizer.offload", "lsp", "--model.n_layers", "1",
    "--train.micro_batch_size", "2", "--train.global_batch_size", "4",
)  # fmt: skip
# Check every 2 steps and always refit at a check: steps 0 (fit) and 2 (check, refit).
REFIT = ("--optimizer.lsp_check_every", "2", "--optimizer.lsp_refit_threshold", "1e-9")


class CountingCopier:
    """A copier that adds up the bytes it copies (what crosses the link)."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.lane, self.nbytes = inner, inner.lane, 0
        self.meter = inner.meter  # the metric's count (offload_bytes_moved), inner's copies

    def copy(self, dst: torch.Tensor, src: torch.Tensor, *args: Any) -> Any:
        self.nbytes += src.nbytes
        return self.inner.copy(dst, src, *args)

    def close(self) -> None:
        self.inner.close()


def _wq(t: Trainer) -> torch.nn.Parameter:
    return dict(t.model.named_parameters())["layers.0.attention.wq.weight"]


def _rows(t: Trainer) -> list[dict]:
    return [r for r in read_jsonl(t.run_dir / "metrics.jsonl") if r["kind"] == "train"]


def test_ledger_and_bytes_moved_are_the_planners(cfg_factory) -> None:
    cfg = cfg_factory(*LSP, *REFIT, "--train.steps", "3")
    t = Trainer(cfg)
    opt = t.optimizer
    assert isinstance(opt, OffloadedAdamW)
    lsp_slots = [s for s in opt.slots if s.lsp is not None]
    assert len(lsp_slots) == 7 and all(s.name.startswith("layers.0.") for s in lsp_slots)
    down, up = CountingCopier(opt.d2h), CountingCopier(opt.h2d)
    opt.d2h, opt.h2d = down, up
    r = t.fit()
    assert all(torch.isfinite(torch.tensor(r.losses)))
    rows = _rows(t)
    # memory: every byte key the planner predicts is what the runtime measured
    want = runtime_metric_bytes(cfg, device="cpu")
    steady = want.pop("offload_bytes_moved")  # a steady step's: checked step by step below
    assert want["device_lsp_bytes"] > 0
    for row in rows:
        got = {k: row[k] for k in want}
        assert got == want
        assert 0 < row["lsp_reconstruction_error"] < 1  # measured ~0.1-0.3 after the fits
    # traffic: three steady steps, a fit at step 0, a check and a refit at step 2
    kw = {
        "lsp_dim": cfg.optimizer.lsp_dim,
        "lsp_nonzeros": cfg.optimizer.lsp_nonzeros,
        "precision": cfg.precision.mode,
        "n_microbatches": cfg.n_microbatches,
    }
    steps = [
        lsp_bytes_per_step(cfg.model, **kw, fit=True),
        lsp_bytes_per_step(cfg.model, **kw),
        lsp_bytes_per_step(cfg.model, **kw, check=True, fit=True, refit=True),
    ]
    assert down.nbytes == sum(s.down for s in steps)
    assert up.nbytes == sum(s.up for s in steps)
    # the metric counts the same copies, step by step; the planner's is a steady step's
    assert [row["offload_bytes_moved"] for row in rows] == [s.down + s.up for s in steps]
    assert steady == steps[1].down + steps[1].up
    # and what the blocks move is a quarter of what ZeRO-Offload would (d = 32 of 64 rows)
    sp = one_process_split(cfg.model)
    full = sum(m * n for m, n in sp.matrices)
    sub = sum(matrix_dims(s, 512, 16)[0] ** 2 for s in sp.matrices)
    assert sub / full < 0.25


@pytest.mark.slow  # three runs with checkpoints
def test_resume_is_bitwise_across_a_refit(cfg_factory) -> None:
    common = (*LSP, *REFIT, "--train.steps", "3", "--checkpoint.enabled", "true")
    full = Trainer(cfg_factory(*common, run="full"))
    full.fit()
    first = Trainer(cfg_factory(*common, "--checkpoint.stop_after", "2", run="resumed"))
    assert first.fit().interrupted
    second = Trainer(cfg_factory(*common, "--checkpoint.resume", "true", run="resumed"))
    r = second.fit()  # step 2 (the third) is a check and a refit, after the resume
    assert r.steps_done == 3 and len(r.losses) == 1
    assert [x["loss"] for x in _rows(full)] == [x["loss"] for x in _rows(second)]
    errs = [x["lsp_reconstruction_error"] for x in _rows(full)]
    assert errs == [x["lsp_reconstruction_error"] for x in _rows(second)]
    for p, q in zip(full.model.parameters(), second.model.parameters(), strict=True):
        assert torch.equal(p, q)
        a, b = full.optimizer.state[p], second.optimizer.state[q]
        assert a.keys() == b.keys()
        for k in a:
            assert torch.equal(a[k], b[k]), k
    keys = full.optimizer.state[_wq(full)].keys()
    assert {"lsp_p_vals", "lsp_q_rows", "exp_avg"} <= set(keys) and "master" not in keys


@pytest.mark.slow  # two runs
def test_fine_tunes_from_a_run(cfg_factory, tmp_path) -> None:
    base = Trainer(
        cfg_factory(*LSP, "--train.steps", "2", "--checkpoint.enabled", "true", run="base")
    )
    base.fit()
    ft = Trainer(cfg_factory(*LSP, "--train.steps", "1", "--checkpoint.init_from",
                             str(tmp_path / "base"), run="ft"))  # fmt: skip
    for (name, p), q in zip(ft.model.named_parameters(), base.model.parameters(), strict=True):
        assert torch.equal(p, q), name  # the base run's last weights, not a fresh init
    assert all(float(s.step) == 0 for s in ft.optimizer.slots)  # and no optimizer state
    r = ft.fit()
    assert r.steps_done == 1 and torch.isfinite(torch.tensor(r.losses)).all()
    assert 0 < _rows(ft)[0]["lsp_reconstruction_error"] < 1  # its projectors fitted afresh


@pytest.mark.parametrize("mode, clip", [("bf16", "1.0"), ("fp16", "1.0"), ("fp32", "0")])
def test_low_precision_clipping_and_updates_in_backward(cfg_factory, mode: str, clip: str) -> None:
    """bf16/fp16 with loss scaling and clipping; fp32 unclipped updates during backward."""
    args = ("--train.steps", "2", "--precision.mode", mode, "--train.max_grad_norm", clip)
    t = Trainer(cfg_factory(*LSP, *args, run=mode))
    assert t.optimizer.update_in_backward == (clip == "0")
    before = _wq(t).detach().clone()
    r = t.fit()
    assert all(torch.isfinite(torch.tensor(r.losses)))
    w = _wq(t)
    assert w.dtype == {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[mode]
    assert not torch.equal(w.detach(), before)  # the decompressed updates were applied
    row = _rows(t)[-1]
    assert row["grad_norm"] > 0 and 0 < row["lsp_reconstruction_error"] < 1


ONE_EACH = ("--train.micro_batch_size", "1", "--train.global_batch_size", "2")


@pytest.mark.parametrize(
    "args, field",
    [
        (("--optimizer.lsp_dim", "0"), "optimizer.lsp_dim"),
        (("--optimizer.lsp_nonzeros", "-1"), "optimizer.lsp_nonzeros"),
        (("--optimizer.lsp_refit_threshold", "0"), "optimizer.lsp_refit_threshold"),
        (("--optimizer.lsp_check_every", "0"), "optimizer.lsp_check_every"),
        (("--optimizer.lsp_dim", "8", "--optimizer.lsp_nonzeros", "9"), "optimizer.lsp_nonzeros"),
        (("--parallel.tp", "2"), "parallel.tp"),
        (("--parallel.cp", "2", *ONE_EACH), "parallel.cp"),
        (("--parallel.pp", "2", *ONE_EACH), "parallel.pp"),
    ],
)
def test_bad_settings_are_one_line_errors(args, field, tmp_path, capsys) -> None:
    with pytest.raises(ConfigError) as e:
        load_config(None, ["--optimizer.offload", "lsp", *args])
    assert e.value.field == field
    rc = main(["train", "--dry-run", "--job.run_dir", str(tmp_path / "x"),
               "--optimizer.offload", "lsp", *args])  # fmt: skip
    err = capsys.readouterr().err.strip()
    assert rc == 2 and field in err and "Traceback" not in err


def test_the_factored_gradient_is_the_dense_one_compressed(cfg_factory, monkeypatch) -> None:
    """One process: the blocks' linear layers hand (X, dY) to the optimizer, which compresses
    (P dYᵀ)(Q Xᵀ)ᵀ without forming G, except on the micro-step that checks (here: fits and
    refits) the projectors. The run equals one whose layers form G (the ordinary path) to
    float rounding, and the ordinary compression runs only on the checks' micro-steps."""
    from llmscale.offload import adamw, lsp

    args = (*LSP, *REFIT, "--train.steps", "4")
    calls = {"whole": 0, "factors": 0}
    whole, factors = lsp.Projectors.compress, lsp.Projectors.compress_factors

    def count(name: str, fn: Any) -> Any:
        def wrapped(*a: Any) -> Any:
            calls[name] += 1
            return fn(*a)

        return wrapped

    monkeypatch.setattr(lsp.Projectors, "compress", count("whole", whole))
    monkeypatch.setattr(lsp.Projectors, "compress_factors", count("factors", factors))
    t = Trainer(cfg_factory(*args, run="factored"))
    assert all(t.optimizer._factored(s) for s in t.optimizer.slots if s.lsp is not None)
    t.fit()
    # 7 matrices x 2 micro-steps x 4 steps. Steps 0 and 2 check on their first micro-step, from
    # the whole gradient: step 0 fits, then compresses; step 2 measures the error (one
    # compression), refits, then compresses
    assert calls == {"whole": 7 * (1 + 2), "factors": 7 * (2 * 4 - 2)}
    assert all(p.grad is None for p in t.model.parameters())
    monkeypatch.setattr(adamw.OffloadedAdamW, "_factored", lambda self, slot: False)
    ref = Trainer(cfg_factory(*args, run="whole"))
    ref.fit()
    got, want = _rows(t), _rows(ref)
    for a, b in zip(got, want, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)
        assert a["offload_bytes_moved"] == b["offload_bytes_moved"]
    for p, q in zip(t.model.parameters(), ref.model.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(
    "extra", [("--train.recompute", "full"), ("--train.recompute", "selective_op"),
              ("--train.compile", "true")],
)  # fmt: skip
def test_the_factored_gradient_composes(cfg_factory, monkeypatch, extra) -> None:
    """Recomputed blocks (the swapped layers run again in backward) and compiled blocks (the
    layers run plain F.linear inside the compiled graph: the ordinary gradient path) train
    as the whole-gradient path does."""
    from llmscale.offload import adamw

    args = (*LSP, *REFIT, "--train.steps", "3", *extra)
    got = Trainer(cfg_factory(*args, run="factored")).fit().losses
    monkeypatch.setattr(adamw.OffloadedAdamW, "_factored", lambda self, slot: False)
    want = Trainer(cfg_factory(*args, run="whole")).fit().losses
    assert got == pytest.approx(want, rel=1e-5)
