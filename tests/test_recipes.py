"""Training at every level, and the Apex recipes: clipping, accumulation, gradient penalty, many models."""

from __future__ import annotations

import pytest
import torch

import amp_patch as amp
from amp_patch import ops
from amp_patch.settings.levels import NAMES as LEVELS
from training_utils import conv_batch, convnet, mlp, mlp_batch, train, xent

STEPS = 50
#: |mean loss over the last 10 steps - O0's|, bf16 on CPU, 50 steps of Adam.
TOLERANCE = 0.05


def run_level(level, factory, batch_fn, **kw):
    model = factory()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    if level is not None:
        amp.initialize(model, opt, opt_level=level, verbosity=0, **kw)
    losses = train(model, opt, STEPS, batch_fn)
    amp.deinitialize()
    return losses


@pytest.fixture(scope="module")
def o0_losses():
    return {"mlp": run_level("O0", mlp, mlp_batch), "conv": run_level("O0", convnet, conv_batch)}


@pytest.mark.parametrize("net", ["mlp", "conv"])
@pytest.mark.parametrize("level", LEVELS)
def test_each_level_trains_and_o1_o2_track_o0(level, net, o0_losses):
    factory, batch_fn = (mlp, mlp_batch) if net == "mlp" else (convnet, conv_batch)
    losses = run_level(level, factory, batch_fn)
    tail = sum(losses[-10:]) / 10
    assert tail < (0.7 if net == "mlp" else 0.9) * sum(losses[:5]) / 5, losses
    if level in ("O1", "O2"):
        ref = o0_losses[net]
        assert abs(tail - sum(ref[-10:]) / 10) < TOLERANCE


def test_o2_dynamic_scaling_trains():
    losses = run_level("O2", mlp, mlp_batch, loss_scale="dynamic")
    assert sum(losses[-10:]) < 0.7 * sum(losses[:10])


@pytest.mark.parametrize("how", ["clip_grad_norm_", "l2norm"])
@pytest.mark.parametrize("level", ["O1", "O2"])
def test_clip_master_grads_after_scale_loss(level, how):
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    amp.initialize(model, opt, opt_level=level, loss_scale="dynamic", verbosity=0)
    x, y = mlp_batch(0)
    with amp.scale_loss(xent(model(x), y) * 100, opt) as scaled:
        scaled.backward()
    grads = [p.grad for p in amp.master_params(opt)]
    max_norm = 0.5
    if how == "clip_grad_norm_":
        torch.nn.utils.clip_grad_norm_(amp.master_params(opt), max_norm)
    else:
        total, _ = ops.multi_tensor_l2norm(grads)
        torch._foreach_mul_(grads, torch.clamp(max_norm / (total + 1e-6), max=1.0))
    total, _ = ops.multi_tensor_l2norm(grads)
    assert total.item() == pytest.approx(max_norm, rel=1e-3)
    opt.step()


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_gradient_accumulation_with_delay_unscale(level):
    """Four micro-batches accumulated == one step on their mean (up to half rounding)."""
    def accumulate(model, opt, micro):
        for i in range(micro):
            x, y = mlp_batch(i, batch=4)
            loss = xent(model(x), y) / micro
            with amp.scale_loss(loss, opt, delay_unscale=i < micro - 1) as scaled:
                scaled.backward()
        return [p.grad.clone() for p in amp.master_params(opt)]

    a, b = mlp(), mlp()
    opt_a = torch.optim.SGD(a.parameters(), lr=0.1)
    amp.initialize(a, opt_a, opt_level=level, loss_scale="dynamic", verbosity=0)
    acc = accumulate(a, opt_a, 4)
    amp.deinitialize()
    x = torch.cat([mlp_batch(i, batch=4)[0] for i in range(4)])
    y = torch.cat([mlp_batch(i, batch=4)[1] for i in range(4)])
    xent(b(x), y).backward()
    ref = [p.grad for p in b.parameters()]
    for g, r in zip(acc, ref):  # bf16 noise is ~3%; a wrong scale or a lost micro-batch is >= 25%
        assert (g - r).norm() < 0.06 * r.norm()


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_gradient_penalty_through_autograd_grad(level):
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    amp.initialize(model, opt, opt_level=level, loss_scale="dynamic", verbosity=0)
    x, y = mlp_batch(0)
    params = list(model.parameters())
    loss = xent(model(x), y)
    # scaled grads for the penalty: delay_unscale, as nothing lands in .grad here
    with amp.scale_loss(loss, opt, delay_unscale=True) as scaled:
        scaled_grads = torch.autograd.grad(scaled, params, create_graph=True)
    scale = amp.state_dict()["loss_scaler0"]["loss_scale"]
    penalty = sum((g.float() / scale).pow(2).sum() for g in scaled_grads)
    with amp.scale_loss(loss + penalty, opt) as scaled:
        scaled.backward()
    before = [p.clone() for p in params]
    opt.step()
    assert all(not torch.equal(a, b) for a, b in zip(before, params))
    assert all(torch.isfinite(p).all() for p in params)


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_two_models_two_losses_two_optimizers(level):
    gen, disc = mlp(0, d_in=8, d_out=8), mlp(1, d_in=8, d_out=4)
    opt_g = torch.optim.Adam(gen.parameters(), lr=1e-2)
    opt_d = torch.optim.Adam(disc.parameters(), lr=1e-2)
    [gen, disc], [opt_g, opt_d] = amp.initialize([gen, disc], [opt_g, opt_d], opt_level=level,
                                                 num_losses=2, loss_scale="dynamic", verbosity=0)
    first = last = None
    for step in range(20):
        x, y = mlp_batch(step)
        loss_d = xent(disc(gen(x).detach()), y)
        with amp.scale_loss(loss_d, opt_d, loss_id=0) as scaled:
            scaled.backward()
        opt_d.step()
        opt_d.zero_grad()
        loss_g = xent(disc(gen(x)), y)
        with amp.scale_loss(loss_g, opt_g, loss_id=1) as scaled:
            scaled.backward()
        opt_g.step()
        opt_g.zero_grad()
        opt_d.zero_grad()
        first = first if first is not None else loss_g.item()
        last = loss_g.item()
    assert last < first
    assert set(amp.state_dict()) == {"loss_scaler0", "loss_scaler1"}
