"""Master grads never carry over between iterations, however the grads are cleared
(docs/design.md, "Model casting and master weights").

Apex released the fp32 master grads after every ``step()`` and every skipped
step, because ``model.zero_grad()`` cannot reach them. Training must therefore
be bit-identical whichever way a script clears its grads: through the
optimizer or the model, to None or to zero, or by hand.
"""

from __future__ import annotations

import pytest
import torch

import amp_patch as amp
from amp_patch.settings.levels import NAMES as LEVELS
from training_utils import (assert_identical, conv_batch, convnet, mlp, mlp_batch, single_thread,
                            snapshot, xent)

STEPS = 4


@pytest.fixture(autouse=True)
def _one_thread():
    with single_thread():
        yield


def _by_hand_to_none(model, opt):
    for p in model.parameters():
        p.grad = None


def _by_hand_zero(model, opt):
    for p in model.parameters():
        if p.grad is not None:
            p.grad.zero_()


CLEARERS = {
    "optimizer": lambda model, opt: opt.zero_grad(),
    "optimizer_to_zero": lambda model, opt: opt.zero_grad(set_to_none=False),
    "model": lambda model, opt: model.zero_grad(),
    "model_to_zero": lambda model, opt: model.zero_grad(set_to_none=False),
    "by_hand_to_none": _by_hand_to_none,
    "by_hand_zero": _by_hand_zero,
}


def _train(level, num_losses, loss_scale, accumulate, clear, device="cpu", steps=STEPS):
    model = convnet().to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    amp.initialize(model, opt, opt_level=level, num_losses=num_losses, loss_scale=loss_scale,
                   verbosity=0)
    micro = 2 if accumulate else 1
    for step in range(steps):
        clear(model, opt)
        for m in range(micro):
            x, y = conv_batch(step * micro + m)
            out = model(x.to(device))
            y = y.to(device)
            losses = [xent(out, y), out.float().pow(2).mean()][:num_losses]
            for loss_id, loss in enumerate(losses):
                last = loss_id == num_losses - 1
                # delay_unscale on every backward of the window but its last one
                delay = accumulate and not (m == micro - 1 and last)
                with amp.scale_loss(loss / micro, opt, loss_id=loss_id,
                                    delay_unscale=delay) as scaled:
                    scaled.backward(retain_graph=not last)
        opt.step()
    out = snapshot([model], [opt])
    amp.deinitialize()
    return out


@pytest.mark.parametrize("accumulate", [False, True], ids=["plain", "accumulate"])
@pytest.mark.parametrize("loss_scale", [None, "dynamic"], ids=["default", "dynamic"])
@pytest.mark.parametrize("num_losses", [1, 2])
@pytest.mark.parametrize("level", LEVELS)
def test_training_identical_whichever_way_grads_are_cleared(level, num_losses, loss_scale,
                                                             accumulate, device):
    ref = _train(level, num_losses, loss_scale, accumulate, CLEARERS["optimizer"], device)
    for name, clear in CLEARERS.items():
        if name != "optimizer":
            try:
                assert_identical(ref, _train(level, num_losses, loss_scale, accumulate, clear,
                                             device))
            except AssertionError as exc:
                raise AssertionError(f"clearing by {name}: {exc}") from None


@pytest.mark.parametrize("skip", [False, True], ids=["step", "skipped_step"])
def test_o2_master_grads_released_after_step_and_skipped_step(skip):
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    amp.initialize(model, opt, opt_level="O2", loss_scale="dynamic", verbosity=0)
    x, y = mlp_batch(0)
    loss = xent(model(x), y)
    with amp.scale_loss(loss * float("inf") if skip else loss, opt) as scaled:
        scaled.backward()
    assert all(m.grad is not None for m in amp.master_params(opt))
    opt.step()
    assert all(m.grad is None for m in amp.master_params(opt))


@pytest.mark.parametrize("level", LEVELS)
def test_no_clearing_at_all_follows_apex(level):
    """Without any clearing, Apex started each iteration's half grads afresh under master
    weights (the model's half grads are dropped at ``scale_loss`` entry and the master
    grads were released by ``step()``), while every param stepped directly, fp32 batch
    norm under O2 included, accumulates as in plain PyTorch."""
    model = convnet()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    amp.initialize(model, opt, opt_level=level, loss_scale="dynamic", verbosity=0)
    record = amp.session.current().record_for(opt)
    x, y = conv_batch(0)
    grads = []
    for _ in range(2):
        with amp.scale_loss(xent(model(x), y), opt) as scaled:
            scaled.backward()
        grads.append([m.grad.clone() for m in amp.master_params(opt)])
        opt.step()
    for master, first, second in zip(amp.master_params(opt), *grads):
        has_master = record.model_param(master) is not master
        # lr 0 and batch norm in train mode with the same batch: the same grads twice
        assert torch.equal(second, first if has_master else 2 * first)


def test_o2_master_grads_keep_the_params_memory_format():
    model = convnet().to(memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    amp.initialize(model, opt, opt_level="O2", verbosity=0)
    x, y = conv_batch(0)
    for _ in range(2):
        with amp.scale_loss(xent(model(x.to(memory_format=torch.channels_last)), y), opt) as s:
            s.backward()
        record = amp.session.current().record_for(opt)
        for master in amp.master_params(opt):
            model_p = record.model_param(master)
            assert master.stride() == model_p.stride()
            assert master.grad.stride() == model_p.stride()
        opt.step()


class _TwoHeads(torch.nn.Module):
    """A trunk and two heads, one per step in turn: each head misses every other backward."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = torch.nn.Linear(8, 16)
        self.heads = torch.nn.ModuleList([torch.nn.Linear(16, 4), torch.nn.Linear(16, 4)])

    def forward(self, x: torch.Tensor, step: int) -> torch.Tensor:
        return self.heads[step % 2](torch.relu(self.trunk(x)))


@pytest.mark.parametrize("larc", [False, True], ids=["FusedSGD", "LARC(FusedSGD)"])
@pytest.mark.parametrize("set_grad_none", [False, True])
@pytest.mark.parametrize("level", ["O0", "O1", "O2"])
def test_a_layer_a_backward_misses_steps_as_in_apex(level, set_grad_none, larc):
    """FusedSGD zeroes grads by default (``set_grad_none=False``, Apex's), and a LARC around it
    clears by its default too. At O0 and O1 the head a backward misses then steps on a zero grad
    (its momentum moves it). At O2 the ``scale_loss`` entry drops the half grads, as Apex's O2
    did, so that head gets no master grad and stands still; with ``set_grad_none=True`` it
    stands still at every level."""
    from amp_patch.optim.amp.larc import LARC
    from amp_patch.optimizers import FusedSGD

    torch.manual_seed(0)
    model = _TwoHeads()
    opt = FusedSGD(model.parameters(), lr=0.1, momentum=0.9, set_grad_none=set_grad_none)
    if larc:
        opt = LARC(opt)
    amp.initialize(model, opt, opt_level=level, half_dtype=torch.bfloat16, verbosity=0)
    x, y = torch.randn(16, 8), torch.randint(0, 4, (16,))
    moved = []
    for step in range(6):
        opt.zero_grad()
        if level != "O2":  # the optimizer's own default: zeros once a grad exists
            grad = model.heads[1].weight.grad
            assert (grad is None) if set_grad_none or step <= 1 else not grad.any()
        before = model.heads[1].weight.detach().clone()
        with amp.scale_loss(xent(model(x, step), y), opt) as scaled:
            scaled.backward()
        opt.step()
        moved.append(not torch.equal(before, model.heads[1].weight))
    # Even steps miss head 1: the first leaves it (no grad yet); the later ones move it by its
    # momentum where a zero grad reaches the optimizer.
    on_zeros = not set_grad_none and level != "O2"
    assert moved == [False, True, on_zeros, True, on_zeros, True]
