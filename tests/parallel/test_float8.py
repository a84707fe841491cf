"""precision.mode = "fp8": torchao's float8 linears swapped in where they can run, refused with
one line where not (parallel/float8.py)."""

from __future__ import annotations

import math

import pytest
import torch

from llmscale.bench.jobs import short_job
from llmscale.config import load_config
from llmscale.errors import ConfigError
from llmscale.model.config import get_preset
from llmscale.model.transformer import build_model
from llmscale.parallel import float8
from llmscale.parallel.parallelize import check_runtime_support

pytest.importorskip("torchao")


def _cfg(*extra: str):
    return load_config(None, [*short_job(), "--precision.mode", "fp8", *extra])


def test_every_block_linear_becomes_float8_but_the_output_projection() -> None:
    model = build_model(get_preset("small"), "meta")  # dims 256 / 768: multiples of 16
    n = float8.convert_to_fp8(model)
    kinds = {name: type(m).__name__ for name, m in model.named_modules()}
    assert n == 7 * model.cfg.n_layers  # wq wk wv wo w1 w2 w3 per block
    assert kinds["layers.0.attention.wq"] == "Float8Linear"
    assert kinds["layers.0.feed_forward.w2"] == "Float8Linear"
    assert kinds["output"] == "Linear"
    # The weights are the same parameters, under the same names (checkpoints are unchanged).
    assert {k for k, _ in model.named_parameters()} == {
        k for k, _ in build_model(get_preset("small"), "meta").named_parameters()
    }


def test_a_linear_scaled_mm_cannot_take_stays_bf16() -> None:
    odd = torch.nn.Linear(24, 40)
    assert not float8.fp8_eligible("layers.0.attention.wq", odd)  # 24 % 16 != 0
    assert float8.fp8_eligible("layers.0.attention.wq", torch.nn.Linear(32, 48))
    assert not float8.fp8_eligible("output", torch.nn.Linear(32, 48))


def test_fp8_on_a_cpu_is_one_line_naming_what_it_needs() -> None:
    with pytest.raises(ConfigError) as e:
        check_runtime_support(_cfg(), torch.device("cpu"))
    assert e.value.field == "precision.mode" and "\n" not in str(e.value)
    assert "a CUDA GPU with FP8 matmuls (this device: cpu)" in str(e.value)


@pytest.mark.parametrize(
    ("capability", "tp", "needle"),
    [
        ((8, 0), 1, "compute capability >= 8.9 (this GPU: 8.0)"),
        ((9, 0), 2, "parallel.tp = 1 (got 2"),
        ((9, 0), 1, None),  # Hopper, no tensor parallelism: runs
    ],
)
def test_fp8_on_a_gpu(monkeypatch, capability, tp, needle) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    cfg = _cfg("--parallel.tp", str(tp))
    cuda = torch.device("cuda", 0)
    if needle is None:
        assert float8.fp8_problem(cfg, cuda) is None
        check_runtime_support(cfg, cuda)
    else:
        with pytest.raises(ConfigError) as e:
            check_runtime_support(cfg, cuda)
        assert needle in str(e.value) and "\n" not in str(e.value)


@pytest.mark.slow  # two runs of 10 steps of the tiny model
def test_fp8_trains_on_a_cpu_like_bf16(cfg_factory, monkeypatch) -> None:
    """The trainer's fp8 path executed: `parallelize` swaps torchao's Float8Linear in (the CUDA
    check bypassed by the test-only switch; torchao emulates the scaled matmuls on the CPU), 10
    steps of the tiny model, the final loss finite and within 5% of the same run in bf16."""
    from llmscale.train.trainer import Trainer

    common = ("--train.steps", "10")
    bf16 = Trainer(cfg_factory(*common, "--precision.mode", "bf16", run="bf16"))
    bf16_loss = bf16.fit().losses[-1]
    monkeypatch.setattr(float8, "_ALLOW_CPU_FOR_TESTS", True)
    fp8 = Trainer(cfg_factory(*common, "--precision.mode", "fp8", run="fp8"))
    kinds = {type(m).__name__ for m in fp8.model.modules()}
    assert "Float8Linear" in kinds  # the blocks' linears (tiny: dims 64 / 192)
    fp8_loss = fp8.fit().losses[-1]
    assert math.isfinite(fp8_loss)
    assert fp8_loss == pytest.approx(bf16_loss, rel=0.05)
    assert fp8_loss < 0.9 * math.log(256)  # it trained: below the uniform guess's loss


@pytest.mark.parametrize("recipe", ["rowwise", "rowwise_with_gw_hp"])
def test_the_recipe_picks_torchaos_scaling(recipe: str) -> None:
    """precision.float8_recipe reaches torchao: rowwise scales each operand per row (axiswise),
    and the linears are the same Float8Linear swap."""
    from torchao.float8.config import ScalingGranularity  # type: ignore[import-untyped]

    model = build_model(get_preset("small"), "meta")
    assert float8.convert_to_fp8(model, recipe) == 7 * model.cfg.n_layers
    lin = model.get_submodule("layers.0.attention.wq")
    assert lin.config.cast_config_input.scaling_granularity is ScalingGranularity.AXISWISE
    assert _cfg("--precision.float8_recipe", recipe).precision.float8_recipe == recipe


def test_a_float8_recipe_needs_fp8() -> None:
    with pytest.raises(ConfigError) as e:
        load_config(None, [*short_job(), "--precision.float8_recipe", "rowwise"])
    assert e.value.field == "precision.float8_recipe"
    assert "tensorwise with precision.mode fp32" in str(e.value)
