"""Performance regression guards that cannot flake: they count, they do not time.

On a small transformer LM (tests/training_utils.TinyLM), one training iteration at O1 and O2
with dynamic loss scaling makes exactly one host sync (the scaler's skip
decision), the fast path makes none, and O1 casts each weight at most once per
iteration per dtype however many ops use it.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import amp_patch as amp
from amp_patch import session as amp_session
from training_utils import count_host_syncs, tiny_lm


def _lm():
    model, batch_fn, loss_fn = tiny_lm(batch=2)
    # SGD: AdamW's single-tensor path reads its step counters with .item(), which
    # would be counted here although it is the optimizer's, not amp's.
    return model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9), batch_fn, loss_fn


def _iteration(model, opt, batch, loss_fn):
    loss = loss_fn(model, batch)
    with amp.scale_loss(loss, opt) as scaled:
        scaled.backward()
    opt.step()
    opt.zero_grad()


@pytest.mark.slow
@pytest.mark.parametrize("level", ["O1", "O2"])
@pytest.mark.parametrize("half_dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("loss_scale, syncs", [("dynamic", 1), (128.0, 1), (None, None)])
def test_host_syncs_per_iteration(level, half_dtype, loss_scale, syncs):
    model, opt, batch_fn, loss_fn = _lm()
    amp.initialize(model, opt, opt_level=level, half_dtype=half_dtype, loss_scale=loss_scale,
                   verbosity=0)
    if syncs is None:
        # The level's default: the bf16 fast path (static 1.0, no masters) checks nothing;
        # anything else makes the one skip decision.
        props = amp_session.current().props
        syncs = 0 if props.skips_unscale else 1
    for step in range(3):
        batch = batch_fn(step)
        with count_host_syncs() as counted:
            _iteration(model, opt, batch, loss_fn)
        assert counted["n"] == syncs, f"iteration {step}: {counted['n']} host syncs"


@pytest.mark.parametrize("half_dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_o1_casts_each_weight_once_per_iteration(half_dtype):
    model, opt, batch_fn, loss_fn = _lm()
    amp.initialize(model, opt, opt_level="O1", half_dtype=half_dtype, verbosity=0)
    cache = amp_session.current().casts.cache
    # The half ops of this model are its Linear layers (attention output and MLP
    # projections, the output head) and the attention's packed input projection;
    # embeddings and LayerNorm keep their fp32 weights uncast.
    linear_params = sum(1 for m in model.modules() if isinstance(m, nn.Linear)
                        for _ in m.parameters())
    linear_params += sum(1 for m in model.modules() if isinstance(m, nn.MultiheadAttention)
                         for p in (m.in_proj_weight, m.in_proj_bias) if p is not None)
    for step in range(3):
        before = cache.casts
        _iteration(model, opt, batch_fn(step), loss_fn)
        assert cache.casts - before == linear_params, f"iteration {step}"
        assert len(cache) == 0  # scale_loss ended the iteration


def test_o2_master_grads_reuse_their_storage_across_iterations():
    model, opt, batch_fn, loss_fn = _lm()
    amp.initialize(model, opt, opt_level="O2", half_dtype=torch.bfloat16, verbosity=0)
    seen = None
    for step in range(3):
        loss = loss_fn(model, batch_fn(step))
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        ptrs = [m.grad.data_ptr() for m in amp.master_params(opt)]
        assert seen is None or ptrs == seen, f"iteration {step} allocated new master grads"
        seen = ptrs
        opt.step()
        opt.zero_grad()
        assert all(m.grad is None for m in amp.master_params(opt))


def test_o2_steady_state_step_compares_no_masters(monkeypatch):
    """The check for weights loaded from outside costs a version look-up per param, no
    comparison (on CUDA torch.equal would be a host sync of its own)."""
    model, opt, batch_fn, loss_fn = _lm()
    amp.initialize(model, opt, opt_level="O2", half_dtype=torch.bfloat16, verbosity=0)
    compared = []
    real_equal = torch.equal
    monkeypatch.setattr(torch, "equal", lambda a, b: compared.append(1) or real_equal(a, b))
    for step in range(3):
        _iteration(model, opt, batch_fn(step), loss_fn)
    assert not compared
