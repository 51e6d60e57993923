"""The O1 weight-cast cache (docs/design.md, "The weight-cast cache")."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
import torch.nn.functional as F

import amp_patch
import amp_patch.optimizers
from amp_patch import session as amp_session
from amp_patch.patching.cache import WeightCastCache

from _o1_samples import wrapper_path  # noqa: F401  (fixture: both wrapper paths)

HALF = torch.bfloat16


@pytest.fixture
def cache(wrapper_path):
    amp_patch.initialize(torch.nn.Linear(1, 1), opt_level="O1", half_dtype=HALF, verbosity=0)
    return amp_session.current().casts.cache


def test_weight_used_by_many_ops_is_cast_once(cache):
    lin = torch.nn.Linear(4, 4)
    x = torch.randn(2, 4)
    before = cache.casts
    y = x
    for _ in range(5):  # the same weight in 5 ops (tied / repeated use)
        y = F.linear(y.float(), lin.weight, lin.bias)
    assert cache.casts - before == 2  # weight and bias, once each
    y.float().sum().backward()
    assert lin.weight.grad.dtype == torch.float32


def test_cached_cast_gradients_match_a_fresh_cast(cache):
    lin = torch.nn.Linear(4, 3)
    x = torch.randn(2, 4)
    out = F.linear(x, lin.weight) + F.linear(x, lin.weight)
    out.float().sum().backward()
    cached_grad = lin.weight.grad.clone()
    lin.weight.grad = None
    with amp_patch.disable_casts():
        w = lin.weight.to(HALF)
        ref = F.linear(x.to(HALF), w) + F.linear(x.to(HALF), lin.weight.to(HALF))
    ref.float().sum().backward()
    torch.testing.assert_close(cached_grad, lin.weight.grad)


def test_recast_after_optimizer_step_and_in_place_edit(cache):
    lin = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(lin.parameters(), lr=0.1)
    x = torch.randn(2, 4)
    F.linear(x, lin.weight).float().sum().backward()
    n = cache.casts
    F.linear(x, lin.weight)
    assert cache.casts == n
    with amp_patch.disable_casts():
        opt.step()
    out = F.linear(x, lin.weight)
    assert cache.casts == n + 1
    torch.testing.assert_close(out, F.linear(x.to(HALF), lin.weight.detach().to(HALF)))
    with torch.no_grad():
        lin.weight.mul_(2)
    F.linear(x, lin.weight)
    assert cache.casts == n + 2


def test_no_grad_entry_is_remade_when_grad_is_enabled(cache):
    lin = torch.nn.Linear(4, 4)
    x = torch.randn(2, 4)
    with torch.no_grad():
        F.linear(x, lin.weight)
    out = F.linear(x, lin.weight)
    assert out.requires_grad
    out.float().sum().backward()
    assert lin.weight.grad is not None and lin.weight.grad.dtype == torch.float32


def test_grad_entry_is_reused_under_no_grad(cache):
    lin = torch.nn.Linear(4, 4)
    F.linear(torch.randn(2, 4), lin.weight)
    n = cache.casts
    with torch.no_grad():
        F.linear(torch.randn(2, 4), lin.weight)
    assert cache.casts == n


def test_storage_replacement_and_dtype_are_separate_entries():
    cache = WeightCastCache()
    p = torch.nn.Parameter(torch.randn(3))
    a = cache.cast(p, torch.bfloat16)
    assert cache.cast(p, torch.bfloat16) is a
    b = cache.cast(p, torch.float16)
    assert b.dtype == torch.float16 and cache.casts == 2
    p.data = torch.randn(3)  # new storage (as a move to another device would be)
    c = cache.cast(p, torch.bfloat16)
    assert c is not a and torch.equal(c, p.detach().to(torch.bfloat16))


def test_only_fp32_leaves_requiring_grad_are_cached():
    cache = WeightCastCache()
    frozen = torch.randn(3)
    cache.cast(frozen, torch.bfloat16)
    nonleaf = torch.nn.Parameter(torch.randn(3)) * 2
    cache.cast(nonleaf, torch.bfloat16)
    assert len(cache) == 0 and cache.casts == 0


def test_clear_and_scale_loss_exit_drop_entries(cache):
    lin = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(lin.parameters(), lr=0.1)
    amp_patch.deinitialize()
    amp_patch.initialize(lin, opt, opt_level="O1", half_dtype=HALF, verbosity=0)
    casts = amp_session.current().casts.cache
    loss = F.linear(torch.randn(2, 4), lin.weight, lin.bias).float().sum()
    assert len(casts) == 2
    with amp_patch.scale_loss(loss, opt) as scaled:
        scaled.backward()
    assert len(casts) == 0


#: Optimizers whose step writes the params in fused kernels that leave the version counters
#: where they were, and one whose in-place ops move them.
_STEPPERS = {
    "torch-fused-AdamW": lambda params: torch.optim.AdamW(params, lr=0.1, fused=True),
    "amp_patch-FusedAdam": lambda params: amp_patch.optimizers.FusedAdam(params, lr=0.1),
    "torch-fused-SGD": lambda params: torch.optim.SGD(params, lr=0.1, fused=True),
    "torch-SGD": lambda params: torch.optim.SGD(params, lr=0.1),
}


@pytest.mark.parametrize("stepper", sorted(_STEPPERS))
@pytest.mark.parametrize("half_dtype", [torch.bfloat16, torch.float16])
def test_a_step_drops_the_casts_without_a_scale_loss_exit(wrapper_path, half_dtype, stepper):
    """A loop that calls ``backward()`` itself (no scale_loss exit clears the cache) still
    casts the stepped weights anew: each forward equals a fresh cast of the current weights."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(8, 8)
    x = torch.randn(4, 8)
    opt = _STEPPERS[stepper](lin.parameters())
    amp_patch.initialize(lin, opt, opt_level="O1", half_dtype=half_dtype, verbosity=0)
    casts = amp_session.current().casts.cache
    outs = []
    for _ in range(3):
        opt.zero_grad()
        out = lin(x)
        with amp_patch.disable_casts():
            fresh = F.linear(x.to(half_dtype), lin.weight.detach().to(half_dtype),
                             lin.bias.detach().to(half_dtype))
        assert torch.equal(out, fresh)
        outs.append(out.detach())
        out.float().pow(2).mean().backward()
        assert len(casts) == 2  # the backward alone leaves them
        opt.step()
        assert len(casts) == 0
    assert not torch.equal(outs[0], outs[-1])  # the weights did move


@pytest.mark.parametrize("half_dtype", [torch.bfloat16, torch.float16])
def test_backward_frees_each_cast_before_the_exit(wrapper_path, half_dtype):
    """scale_loss's entry drops the cache, so a cast lives only as long as the graph needs it
    (as autocast's casts do), not until the exit: the backward's peak does not hold them all."""
    lin = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(lin.parameters(), lr=0.1)
    amp_patch.initialize(lin, opt, opt_level="O1", half_dtype=half_dtype, verbosity=0)
    casts = amp_session.current().casts.cache
    loss = lin(torch.randn(2, 4)).float().sum()
    alive = [weakref.ref(e.cast) for e in casts._entries.values()]
    assert len(alive) == 2
    with amp_patch.scale_loss(loss, opt) as scaled:
        assert len(casts) == 0
        del loss
        scaled.backward()
        gc.collect()
        assert all(ref() is None for ref in alive)
    # The same grads as with the cache kept: the cast is an exact function of the weight.
    assert lin.weight.grad is not None and lin.weight.grad.dtype == torch.float32


def test_no_leak_when_the_model_is_deleted(cache):
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    model(torch.randn(2, 4)).float().sum().backward()
    cache.clear()  # what scale_loss does at the end of the iteration
    with torch.no_grad():  # an eval pass fills the cache again
        model(torch.randn(2, 4))
    assert len(cache) == 4
    ref = weakref.ref(model[0].weight)
    del model
    gc.collect()
    assert ref() is None
    assert len(cache) == 0
