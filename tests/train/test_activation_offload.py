"""Activation offload moves where saved tensors wait, not the numbers."""

import pytest
import torch

from llmscale.config import load_config
from llmscale.errors import ConfigError
from llmscale.instrument.activations import SavedActivations, model_state_tensors
from llmscale.model.config import get_preset
from llmscale.model.transformer import build_model
from llmscale.parallel.activation_offload import Offloaded, apply_activation_offload
from llmscale.plan.activations import Kernels
from llmscale.plan.memory import MemoryOptions
from llmscale.plan.predict import expected_runtime_metrics
from llmscale.train.trainer import lm_loss


def _run(n_offloaded: int, tokens: torch.Tensor):
    model = build_model(get_preset("tiny"), seed=0)
    wrapped = apply_activation_offload(model, n_offloaded)
    with SavedActivations(model_state_tensors(model)) as counter:
        loss = lm_loss(model(tokens[:, :-1]), tokens[:, 1:])
    loss.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    return loss.detach(), grads, counter.bytes, wrapped, model


@pytest.fixture(scope="module")
def results():
    tokens = torch.randint(0, 256, (4, 65), generator=torch.Generator().manual_seed(0))
    return {n: _run(n, tokens) for n in (0, 1, 2)}


def test_loss_and_gradients_are_bit_identical(results) -> None:
    loss0, grads0, *_ = results[0]
    for n in (1, 2):
        loss, grads, *_ = results[n]
        assert torch.equal(loss, loss0)
        for g, g0 in zip(grads, grads0, strict=True):
            assert torch.equal(g, g0)


def test_the_first_blocks_are_wrapped_and_their_names_kept(results) -> None:
    _, _, _, wrapped, model = results[2]
    assert wrapped == ["layers.0", "layers.1"]
    assert isinstance(model.layers["0"], Offloaded)
    assert not isinstance(model.layers["2"], Offloaded)
    names = {n for n, _ in model.named_parameters()}
    assert names == {n for n, _ in build_model(get_preset("tiny"), seed=0).named_parameters()}


def test_each_offloaded_block_takes_one_blocks_saved_bytes_off_the_device(results) -> None:
    saved = {n: r[2] for n, r in results.items()}
    per_block = saved[0] - saved[1]
    assert per_block > 0
    assert saved[1] - saved[2] == per_block


def _cfg(n: int, *extra: str):
    return load_config(
        None,
        [
            "--model.name", "small", "--data.seq_len", "64", "--train.micro_batch_size", "2",
            "--train.global_batch_size", "2", "--train.offload_activations", str(n), *extra,
        ],
    )  # fmt: skip


def test_the_planner_predicts_the_measured_device_activations() -> None:
    """The planner's count equals what autograd leaves on the device, offload or not."""
    tokens = torch.randint(0, 264, (2, 65), generator=torch.Generator().manual_seed(1))
    for n in (0, 2):
        cfg = _cfg(n)
        model = build_model(cfg.model, seed=0)
        apply_activation_offload(model, n)
        with SavedActivations(model_state_tensors(model)) as counter:
            lm_loss(model(tokens[:, :-1]), tokens[:, 1:]).backward()
        options = MemoryOptions(kernels=Kernels.for_runtime(cfg.model, 1, "cpu"))
        want = expected_runtime_metrics(cfg, 0, options)["activation_bytes"]
        assert counter.bytes == pytest.approx(want, rel=0.03), n


@pytest.mark.parametrize(
    ("extra", "key"),
    [
        (("--parallel.pp", "2", "--train.global_batch_size", "4"), "parallel.pp"),
        (("--train.recompute", "full"), "train.recompute"),
    ],
)
def test_megatron_cores_rules(extra, key) -> None:
    with pytest.raises(ConfigError) as err:
        _cfg(2, *extra)
    assert err.value.field == key


def test_fewer_than_the_models_layers() -> None:
    with pytest.raises(ConfigError) as err:
        _cfg(6)  # the small preset has 6 blocks
    assert err.value.field == "train.offload_activations"
    with pytest.raises(ConfigError):
        _cfg(-1)


def test_compiled_blocks_are_refused_by_the_runtime_not_the_planner() -> None:
    from llmscale.parallel.parallelize import check_runtime_support

    cfg = _cfg(2, "--train.compile", "true")  # the config itself is valid: the planner costs it
    with pytest.raises(ConfigError) as err:
        check_runtime_support(cfg, torch.device("cpu"))
    assert err.value.field == "train.compile"
