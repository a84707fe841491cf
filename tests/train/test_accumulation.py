"""k micro-steps of b equal one step of k*b."""

import torch

from llmscale.train.trainer import Trainer


def _grads(t: Trainer) -> list[torch.Tensor]:
    return [p.grad.clone() for p in t.model.parameters()]


def test_four_micro_steps_of_two_equal_one_step_of_eight(cfg_factory) -> None:
    common = ("--train.global_batch_size", "8", "--train.max_grad_norm", "0")
    accum = Trainer(cfg_factory(*common, "--train.micro_batch_size", "2", run="a"))
    whole = Trainer(cfg_factory(*common, "--train.micro_batch_size", "8", run="b"))
    assert accum.cfg.n_microbatches == 4 and whole.cfg.n_microbatches == 1
    batch = accum.train_stream.next_batch(8)
    assert torch.equal(batch, whole.train_stream.next_batch(8))
    loss_a, _ = accum.forward_backward(batch)
    loss_w, _ = whole.forward_backward(batch)
    torch.testing.assert_close(loss_a, loss_w, rtol=1e-6, atol=0)
    for ga, gw in zip(_grads(accum), _grads(whole), strict=True):
        rel = (ga - gw).norm() / gw.norm()
        assert rel < 1e-6, rel


def test_parameters_equal_after_three_optimizer_steps(cfg_factory) -> None:
    common = ("--train.global_batch_size", "8", "--train.steps", "3")
    accum = Trainer(cfg_factory(*common, "--train.micro_batch_size", "2", run="a"))
    whole = Trainer(cfg_factory(*common, "--train.micro_batch_size", "8", run="b"))
    ra, rw = accum.fit(), whole.fit()
    assert ra.steps_done == rw.steps_done == 3
    # The whole model's parameters to 1e-6 relative (the gradients' bound). Per tensor a few
    # 1e-6 are allowed: Adam divides every element by its own gradient RMS, so an element whose
    # gradient is near zero turns the summation-order rounding of its gradient into a step of
    # full size, and one such element can move a small tensor's relative error past 1e-6.
    diff2 = norm2 = 0.0
    for (name, pa), pw in zip(
        accum.model.named_parameters(), whole.model.parameters(), strict=True
    ):
        d, n = (pa - pw).norm().item(), pw.norm().item()
        assert d / n < 1e-5, (name, d / n)
        diff2, norm2 = diff2 + d * d, norm2 + n * n
    assert (diff2 / norm2) ** 0.5 < 1e-6
    assert all(abs(a - w) < 1e-5 for a, w in zip(ra.losses, rw.losses, strict=True))
