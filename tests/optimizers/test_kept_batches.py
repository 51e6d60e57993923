"""The fused optimizers keep the batches of a group's last step (``KeptBatches``).

A step then makes its op calls from the kept lists and its new grads, instead
of building them from the param group again. Every test compares with an
optimizer that builds at every step: the same bits, and the same tensors
stepped, also after whatever should make the kept batches stale.
"""

from __future__ import annotations

import pytest
import torch
from conftest import DEVICES

import amp_patch
from amp_patch.optim.fused import (
    FusedAdagrad,
    FusedAdam,
    FusedLAMB,
    FusedNovoGrad,
    FusedSGD,
)
from amp_patch.optim.fused.batches import build_batches

OPTIMIZERS = {
    "adam": lambda ps: FusedAdam(ps, lr=1e-2, weight_decay=0.01),
    "adam-int8": lambda ps: FusedAdam(ps, lr=1e-2, state_format="int8"),
    "lamb": lambda ps: FusedLAMB(ps, lr=1e-2, weight_decay=0.01),
    "sgd": lambda ps: FusedSGD(ps, lr=1e-2, momentum=0.9),
    "novograd": lambda ps: FusedNovoGrad(ps, lr=1e-2),
    "adagrad": lambda ps: FusedAdagrad(ps, lr=1e-2),
}
SHAPES = [(7, 5), (300,), (3, 4, 2), ()]


def _params(device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=gen).to(device)) for s in SHAPES]


def _always_built(opt):
    """Make ``opt`` build its batches at every step, as before batches were kept."""
    opt._batches = lambda group, split=None, state=(): build_batches(opt, group, split, state)
    return opt


def _set_grads(params, step, skip=()):
    gen = torch.Generator().manual_seed(1000 + step)
    for i, p in enumerate(params):
        g = torch.randn(p.shape, generator=gen).to(p.device)
        p.grad = None if i in skip else g


def _pair(device, name):
    kept_params, built_params = _params(device), _params(device)
    return (kept_params, OPTIMIZERS[name](kept_params),
            built_params, _always_built(OPTIMIZERS[name](built_params)))


def _assert_same(opt_a, params_a, opt_b, params_b):
    for a, b in zip(params_a, params_b):
        assert torch.equal(a, b)
        sa, sb = opt_a.state[a], opt_b.state[b]
        assert sorted(sa) == sorted(sb)
        for key in sa:
            if isinstance(sa[key], torch.Tensor):
                assert torch.equal(sa[key], sb[key]), key


def _step_both(kept, opt_k, built, opt_b, step, skip=()):
    _set_grads(kept, step, skip)
    _set_grads(built, step, skip)
    opt_k.step()
    opt_b.step()
    _assert_same(opt_k, kept, opt_b, built)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_kept_batches_step_as_built_ones(device, name):
    kept, opt_k, built, opt_b = _pair(device, name)
    for step in range(6):
        _step_both(kept, opt_k, built, opt_b, step)
    if name != "sgd":  # SGD's split is made anew at every step: never kept
        assert opt_k._kept_batches, "the batches were not kept"


@pytest.mark.parametrize("device", DEVICES)
def test_a_param_without_grad_is_left_alone(device):
    kept, opt_k, built, opt_b = _pair(device, "adam")
    _step_both(kept, opt_k, built, opt_b, 0)
    before = kept[1].detach().clone()
    _step_both(kept, opt_k, built, opt_b, 1, skip=(1,))
    assert torch.equal(kept[1], before)
    _step_both(kept, opt_k, built, opt_b, 2)


@pytest.mark.parametrize("device", DEVICES)
def test_replaced_state_tensor_is_the_one_stepped(device):
    kept, opt_k, built, opt_b = _pair(device, "adam")
    _step_both(kept, opt_k, built, opt_b, 0)
    _step_both(kept, opt_k, built, opt_b, 1)
    for opt, params in ((opt_k, kept), (opt_b, built)):
        opt.state[params[0]]["exp_avg"] = torch.zeros_like(params[0])
    fresh = opt_k.state[kept[0]]["exp_avg"]
    _step_both(kept, opt_k, built, opt_b, 2)
    assert opt_k.state[kept[0]]["exp_avg"] is fresh and bool(fresh.abs().sum() > 0)
    for opt, params in ((opt_k, kept), (opt_b, built)):  # a whole entry replaced
        opt.state[params[2]] = {k: v.clone() for k, v in opt.state[params[2]].items()}
    _step_both(kept, opt_k, built, opt_b, 3)


@pytest.mark.parametrize("device", DEVICES)
def test_replaced_param_in_the_group_is_the_one_stepped(device):
    kept, opt_k, built, opt_b = _pair(device, "adam")
    _step_both(kept, opt_k, built, opt_b, 0)
    for params, opt in ((kept, opt_k), (built, opt_b)):
        params[3] = torch.nn.Parameter(torch.full((), 2.0, device=device))
        opt.param_groups[0]["params"][3] = params[3]
    _step_both(kept, opt_k, built, opt_b, 1)
    assert float(kept[3]) != 2.0


@pytest.mark.parametrize("device", DEVICES)
def test_state_format_change_and_reload_step_as_built(device):
    kept, opt_k, built, opt_b = _pair(device, "adam")
    _step_both(kept, opt_k, built, opt_b, 0)
    opt_k.set_state_format("bf16")
    opt_b.set_state_format("bf16")
    _step_both(kept, opt_k, built, opt_b, 1)
    saved = opt_b.state_dict()
    opt_k.load_state_dict(saved)
    opt_b.load_state_dict(saved)
    assert not opt_k._kept_batches
    _step_both(kept, opt_k, built, opt_b, 2)
    _step_both(kept, opt_k, built, opt_b, 3)


def test_deinitialize_lets_go_of_the_masters():
    model = torch.nn.Linear(8, 4)
    opt = FusedAdam(model.parameters(), lr=1e-3)
    model, opt = amp_patch.initialize(model, opt, opt_level="O2", verbosity=0)
    for _ in range(2):
        loss = model(torch.randn(3, 8, dtype=torch.bfloat16)).float().sum()
        with amp_patch.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()
        opt.zero_grad()
    assert opt._kept_batches
    amp_patch.deinitialize()
    assert not opt._kept_batches
