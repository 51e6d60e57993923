"""apex.parallel.LARC: Apex's trust-ratio math around any optimizer, accepted at every level."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import amp_patch as amp
from amp_patch.apex_compat.larc import LARC
from amp_patch.settings.levels import NAMES as LEVELS
from training_utils import assert_identical, mlp, mlp_batch, snapshot, train, xent



def apex_larc_step(optim, trust_coefficient=0.02, clip=True, eps=1e-8):
    """Apex's LARC.step, as Apex wrote it (host-side conditionals), for reference."""
    with torch.no_grad():
        weight_decays = []
        for group in optim.param_groups:
            weight_decay = group.get("weight_decay", 0)
            weight_decays.append(weight_decay)
            group["weight_decay"] = 0
            for p in group["params"]:
                if p.grad is None:
                    continue
                param_norm = torch.norm(p.data)
                grad_norm = torch.norm(p.grad.data)
                if param_norm != 0 and grad_norm != 0:
                    adaptive_lr = trust_coefficient * param_norm / (
                        grad_norm + param_norm * weight_decay + eps)
                    if clip:
                        adaptive_lr = min(adaptive_lr / group["lr"], 1)
                    p.grad.data += weight_decay * p.data
                    p.grad.data *= adaptive_lr
    optim.step()
    for group, wd in zip(optim.param_groups, weight_decays):
        group["weight_decay"] = wd


class MyModel(nn.Module):
    """Apex's tests/L0/run_amp/test_larc.py model."""

    def __init__(self, unique):
        super().__init__()
        self.weight0 = nn.Parameter(unique + torch.arange(2, dtype=torch.float32))

    def forward(self, x):
        return (x * self.weight0).sum()


@pytest.mark.parametrize("level", LEVELS)
def test_apex_larc_mixed_precision(level, device):
    """Apex's own LARC test (tests/L0/run_amp/test_larc.py)."""
    model = MyModel(1).to(device)
    optimizer = LARC(torch.optim.SGD([{"params": model.parameters(), "lr": 0.25}], momentum=0.125))
    model, optimizer = amp.initialize(model, optimizer, opt_level=level, verbosity=0)
    assert isinstance(optimizer, LARC)
    before = model.weight0.detach().clone()
    # Two iterations: at O2 on CUDA the model is fp16, and the first backward's grad,
    # 1 x 2**16 (the initial loss scale), overflows fp16, so that step is skipped.
    for _ in range(2):
        optimizer.zero_grad()
        loss = model(torch.ones(2, device=device))
        with amp.scale_loss(loss, optimizer) as scaled_loss:
            scaled_loss.backward()
        optimizer.step()
    assert not torch.equal(before, model.weight0)


@pytest.mark.parametrize("clip", [True, False])
@pytest.mark.parametrize("weight_decay", [0.0, 1e-2])
def test_larc_matches_apex_math(clip, weight_decay):
    a = mlp()
    b = copy.deepcopy(a)
    with torch.no_grad():
        b[0].bias.zero_()  # a zero param norm: left alone, weight decay included
    a.load_state_dict(b.state_dict())
    opt_a = LARC(torch.optim.SGD(a.parameters(), lr=0.1, momentum=0.9, weight_decay=weight_decay),
                 clip=clip)
    opt_b = torch.optim.SGD(b.parameters(), lr=0.1, momentum=0.9, weight_decay=weight_decay)
    for step in range(4):
        for model, opt in ((a, opt_a), (b, opt_b)):
            opt.zero_grad()
            x, y = mlp_batch(step)
            xent(model(x), y).backward()
        opt_a.step()
        apex_larc_step(opt_b, clip=clip)
        assert opt_a.param_groups[0]["weight_decay"] == weight_decay
        for p, q in zip(a.parameters(), b.parameters()):
            assert torch.equal(p, q)


def test_o2_trust_ratio_is_computed_on_the_masters():
    """O2 with LARC equals a hand-written O2: half model, fp32 masters, Apex's LARC on the masters."""
    model = mlp()
    ref_model = copy.deepcopy(model).bfloat16()
    masters = [p.detach().float().requires_grad_(True) for p in ref_model.parameters()]
    ref_opt = torch.optim.SGD(masters, lr=0.1, momentum=0.9, weight_decay=1e-2)
    opt = LARC(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-2))
    model, opt = amp.initialize(model, opt, opt_level="O2", half_dtype=torch.bfloat16, verbosity=0)
    for step in range(4):
        x, y = mlp_batch(step)
        model.zero_grad()
        with amp.scale_loss(xent(model(x), y), opt) as scaled:
            scaled.backward()
        opt.step()
        ref_model.zero_grad()
        xent(ref_model(x.bfloat16()), y).backward()
        for master, p in zip(masters, ref_model.parameters()):
            master.grad = p.grad.float()
        apex_larc_step(ref_opt)
        with torch.no_grad():
            for master, p in zip(masters, ref_model.parameters()):
                p.copy_(master)
        for master, ref in zip(amp.master_params(opt), masters):
            assert master.dtype == torch.float32 and torch.equal(master, ref), step
        for p, ref in zip(model.parameters(), ref_model.parameters()):
            assert torch.equal(p, ref), step


def test_larc_skipped_step_changes_nothing_and_checkpoints_masters():
    model = mlp()
    opt = LARC(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-2))
    amp.initialize(model, opt, opt_level="O2", loss_scale="dynamic", verbosity=0)
    train(model, opt, 2)
    before = snapshot([model], [opt])
    x, y = mlp_batch(5)
    with amp.scale_loss(xent(model(x), y) * float("inf"), opt) as scaled:
        scaled.backward()
    opt.step()
    assert_identical(before, snapshot([model], [opt]))
    assert opt.param_groups[0]["weight_decay"] == 1e-2
    assert "amp_master_params" in opt.state_dict()
    amp.deinitialize()
    assert all(p.dtype == torch.bfloat16 for p in opt.param_groups[0]["params"])
    assert "step" not in vars(opt) and "step" not in vars(opt.optim)


def test_larc_with_its_inner_optimizer_is_the_same_optimizer_twice():
    model = mlp()
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="twice"):
        amp.initialize(model, [LARC(inner), inner], opt_level="O2", verbosity=0)
