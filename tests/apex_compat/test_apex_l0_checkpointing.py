"""Apex's L0 ``test_checkpointing.test_restoring``, run sequentially: a restore replays bit for bit.

Apex's test trains a reference for 10 epochs and, after epoch 5, restores its
checkpoint into a second model and optimizer (``amp.initialize`` before or
after the loads, one or two losses) and trains both on the same batches,
comparing their state dicts after each step. amp_patch has one session at a
time, so the replay comes after the reference's run; at epoch 5 the
reference's loss scalers are reset, as Apex's second ``amp.initialize`` reset
them in its interleaved test. With ``initialize`` after the loads, the half
cast rounds the fp32 weights the model loaded; the masters then come from the
checkpoint's exact fp32 values that the optimizer's param groups carry
(``optim.checkpoints``), where they used to come from the rounded half
params, 1 ulp off at O2 with two losses.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import amp_patch as amp

pytestmark = pytest.mark.slow  # 6 x 4 trainings of 10 + 5 steps, fp16 on the CPU

EPOCHS, RESTORE = 10, 5


class MyModel(nn.Module):
    """Apex's model of the test."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 6, 3, 1, 1)
        self.bn1 = nn.BatchNorm2d(6)
        self.param = nn.Parameter(torch.randn(1))

    def forward(self, x):
        return self.bn1(F.relu(self.conv1(x * self.param)))


def _train_step(model, optimizer, data, loss_ids):
    optimizer.zero_grad()
    output = model(data)
    for idx in loss_ids:
        with amp.scale_loss(output.mean(), optimizer, loss_id=idx) as scaled_loss:
            scaled_loss.backward(retain_graph=True)
    optimizer.step()
    return output.detach().clone()


def _initialize(model, optimizer, level, num_losses, half):
    return amp.initialize(model, optimizer, opt_level=level, num_losses=num_losses * 2,
                          verbosity=0, half_dtype=half)


def _restoring(level, amp_before_load, num_losses, half):
    torch.manual_seed(2809)
    model = MyModel()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    model, optimizer = _initialize(model, optimizer, level, num_losses, half)
    fresh_scalers = copy.deepcopy(amp.state_dict())
    batches, outputs, checkpoint = [], [], None
    for epoch in range(EPOCHS):
        if epoch == RESTORE:
            amp.load_state_dict(fresh_scalers)
        x = torch.randn(16, 3, 24, 24)
        batches.append(x)
        outputs.append(_train_step(model, optimizer, x, range(num_losses)))
        if epoch == RESTORE - 1:
            checkpoint = copy.deepcopy({"model": model.state_dict(),
                                        "optimizer": optimizer.state_dict()})
            for value in checkpoint["model"].values():
                assert not value.is_floating_point() or value.dtype == torch.float32
        if epoch >= RESTORE:
            outputs[-1] = (outputs[-1], copy.deepcopy(model.state_dict()))
    amp.deinitialize()

    restore_model = MyModel()
    restore_optimizer = torch.optim.SGD(restore_model.parameters(), lr=1e-3)
    if amp_before_load:
        restore_model, restore_optimizer = _initialize(restore_model, restore_optimizer, level,
                                                       num_losses, half)
    restore_model.load_state_dict(checkpoint["model"])
    restore_optimizer.load_state_dict(checkpoint["optimizer"])
    if not amp_before_load:
        restore_model, restore_optimizer = _initialize(restore_model, restore_optimizer, level,
                                                       num_losses, half)
    for epoch in range(RESTORE, EPOCHS):
        output = _train_step(restore_model, restore_optimizer, batches[epoch],
                             range(num_losses, num_losses * 2))
        want_output, want_state = outputs[epoch]
        assert torch.allclose(output.float(), want_output.float())
        state = restore_model.state_dict()
        assert state.keys() == want_state.keys()
        for key, value in want_state.items():
            assert torch.equal(value, state[key]), (
                f"epoch {epoch}: {key} differs by {(value - state[key]).abs().max()}")
    amp.deinitialize()


# bf16 at O0 (no cast) and O1 (no masters) would repeat the fp16 cases.
@pytest.mark.parametrize("level, half", [
    ("O0", torch.float16), ("O1", torch.float16), ("O2", torch.float16), ("O3", torch.float16),
    ("O2", torch.bfloat16), ("O3", torch.bfloat16)], ids=["O0", "O1", "O2", "O3", "O2-bf16",
                                                          "O3-bf16"])
def test_restoring_replays_bit_for_bit(level, half):
    for amp_before_load in (True, False):
        for num_losses in (1, 2):
            _restoring(level, amp_before_load, num_losses, half)


def test_group_masters_of_a_checkpoint_are_used_only_for_the_model_loaded_from_it():
    """A plain optimizer that loaded an O2 checkpoint keeps the masters in its groups; at
    initialize they become the masters only where the model's half value is their rounding."""
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O2", half_dtype=torch.bfloat16,
                                verbosity=0)
    with torch.no_grad():  # masters that half precision cannot hold
        for master in amp.master_params(opt):
            master.add_(1e-4)
    sd = copy.deepcopy({"model": model.state_dict(), "opt": opt.state_dict()})
    masters = [m.detach().clone() for m in amp.master_params(opt)]
    amp.deinitialize()
    assert all(m is None or m.dtype == torch.float32
               for g in sd["opt"]["param_groups"] for m in g["amp_group_masters"])

    loaded, fresh = nn.Linear(4, 3), nn.Linear(4, 3)
    loaded.load_state_dict(sd["model"])
    for net in (loaded, fresh):
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        opt.load_state_dict(sd["opt"])
        net, opt = amp.initialize(net, opt, opt_level="O2", half_dtype=torch.bfloat16,
                                  verbosity=0)
        got = list(amp.master_params(opt))
        assert all("amp_group_masters" not in g for g in opt.param_groups)
        if net is loaded:
            assert all(torch.equal(a, b) for a, b in zip(got, masters))
        else:  # not the checkpoint's model: masters from its own half params, as Apex
            assert all(torch.equal(a, p.float()) for a, p in zip(got, net.parameters()))
        amp.deinitialize()
