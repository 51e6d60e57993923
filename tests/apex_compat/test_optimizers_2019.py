"""The 2019 spelling, ``from apex.optimizers import FP16_Optimizer, FusedAdam``, of BERT scripts.

A tiny BERT-like model made half with ``model.half()``, Apex 2019's
``FusedAdam(..., bias_correction=False, max_grad_norm=1.0)`` over the usual
two weight-decay groups, ``FP16_Optimizer`` with dynamic loss scaling,
``optimizer.backward(loss)``, an lr schedule through ``param_groups`` and
``optimizer.step()``: it trains, skips an overflow without changing a bit,
resumes exactly from a checkpoint, and follows Apex 2019's math.
"""

from __future__ import annotations

import inspect
import io
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from amp_patch import optimizers as fused
from amp_patch.apex_compat import import_hook, optimizers_2019

LR = 5e-3
STEPS = 24


class TinyBert(nn.Module):
    """Embeddings, a LayerNorm, a residual GELU MLP and a classifier over the mean token."""

    def __init__(self, vocab: int = 32, d: int = 16, classes: int = 3) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embeddings = nn.Embedding(vocab, d)
        self.LayerNorm = nn.LayerNorm(d)  # noqa: N815 - BERT's name, which no_decay matches
        self.intermediate = nn.Linear(d, 4 * d)
        self.output = nn.Linear(4 * d, d)
        self.classifier = nn.Linear(d, classes)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.LayerNorm(self.embeddings(ids))
        h = h + self.output(F.gelu(self.intermediate(h)))
        return F.cross_entropy(self.classifier(h.mean(1)).float(), labels)


def _batch(step: int):
    g = torch.Generator().manual_seed(step % 6)
    ids = torch.randint(32, (8, 6), generator=g)
    return ids, ids[:, 0] % 3


def _apex_2019():
    with import_hook.apex_import_hook(shadow_apex=True):
        from apex.optimizers import FP16_Optimizer, FusedAdam
    return FP16_Optimizer, FusedAdam


def _build(bias_correction: bool = False, **fp16_kwargs):
    """The 2019 script's set-up, as written then."""
    FP16_Optimizer, FusedAdam = _apex_2019()  # noqa: N806 - Apex's names
    model = TinyBert().half()
    param_optimizer = list(model.named_parameters())
    no_decay = ["bias", "LayerNorm.bias", "LayerNorm.weight"]
    groups = [
        {"params": [p for n, p in param_optimizer if not any(nd in n for nd in no_decay)],
         "weight_decay": 0.01},
        {"params": [p for n, p in param_optimizer if any(nd in n for nd in no_decay)],
         "weight_decay": 0.0},
    ]
    optimizer = FusedAdam(groups, lr=LR, bias_correction=bias_correction, max_grad_norm=1.0)
    optimizer = FP16_Optimizer(optimizer, **(fp16_kwargs or {"dynamic_loss_scale": True}))
    return model, optimizer


def _trained(model, optimizer) -> list[torch.Tensor]:
    out = [p.detach().clone() for p in model.parameters()]
    for group in optimizer.param_groups:
        for p in group["params"]:
            out.append(p.detach().clone())
            out += [v.detach().clone() for v in optimizer.state[p].values()
                    if isinstance(v, torch.Tensor)]
    return out


def _iteration(model, optimizer, step: int, on_backward=None) -> float:
    ids, labels = _batch(step)
    loss = model(ids, labels)
    optimizer.backward(loss)
    if on_backward is not None:
        on_backward(model)
    lr_this_step = LR * min(1.0, (step + 1) / 4)  # warm-up, set by hand as BERT's scripts did
    for param_group in optimizer.param_groups:
        param_group["lr"] = lr_this_step
    optimizer.step()
    optimizer.zero_grad()
    return loss.item()


def test_old_keywords_select_the_2019_fused_adam():
    _, FusedAdam = _apex_2019()  # noqa: N806
    p = nn.Parameter(torch.randn(3))
    current = FusedAdam([p], lr=1e-3, weight_decay=0.01)
    assert type(current) is FusedAdam and isinstance(current, fused.FusedAdam)
    old = FusedAdam([p], lr=1e-3, bias_correction=False, max_grad_norm=1.0)
    assert type(old) is optimizers_2019.FusedAdam2019 and isinstance(old, FusedAdam)
    assert old.param_groups[0]["max_grad_norm"] == 1.0
    assert type(FusedAdam([p], eps_inside_sqrt=False)) is optimizers_2019.FusedAdam2019
    with pytest.raises(ValueError, match="eps_inside_sqrt"):
        FusedAdam([p], eps_inside_sqrt=True)
    assert list(inspect.signature(FusedAdam).parameters) == list(
        inspect.signature(fused.FusedAdam).parameters)
    assert list(inspect.signature(optimizers_2019.FusedAdam2019).parameters) == [
        "params", "lr", "bias_correction", "betas", "eps", "eps_inside_sqrt", "weight_decay",
        "max_grad_norm", "amsgrad"]


@pytest.mark.slow
def test_2019_script_trains_skips_an_overflow_and_resumes_exactly():
    model, optimizer = _build()
    assert type(optimizer.optimizer) is optimizers_2019.FusedAdam2019
    losses, overflow_at, checkpoint, scales = [], 9, 14, []

    def inject(m):
        m.intermediate.weight.grad[0, 0] = float("inf")

    for step in range(STEPS):
        if step == checkpoint:
            buf = io.BytesIO()
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, buf)
        before = _trained(model, optimizer) if step == overflow_at else None
        losses.append(_iteration(model, optimizer, step,
                                 inject if step == overflow_at else None))
        scales.append(optimizer.cur_scale)
        if before is not None:
            assert optimizer.overflow
            after = _trained(model, optimizer)
            assert all(torch.equal(a, b) for a, b in zip(before, after))
        # No fp32 master grad is ever made: the fused step reads the half grads.
        assert all(p.grad is None for g in optimizer.param_groups for p in g["params"])
    assert scales[overflow_at] == scales[overflow_at - 1] / 2 == 2.0**15
    assert sum(losses[-4:]) / 4 < 0.6 * sum(losses[:4]) / 4
    expected = _trained(model, optimizer)

    model, optimizer = _build()
    buf.seek(0)
    state = torch.load(buf, weights_only=True)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    for step in range(checkpoint, STEPS):
        _iteration(model, optimizer, step, inject if step == overflow_at else None)
    got = _trained(model, optimizer)
    assert len(got) == len(expected)
    assert all(torch.equal(a, b) for a, b in zip(got, expected))


class _Reference:
    """Apex 2019's FusedAdam and FP16_Optimizer step, in plain PyTorch (fp32, per element)."""

    def __init__(self, optimizer, bias_correction: bool):
        self.bias_correction = bias_correction
        self.masters = [[p.detach().clone() for p in g["params"]] for g in optimizer.param_groups]
        self.m = [[torch.zeros_like(p) for p in g] for g in self.masters]
        self.v = [[torch.zeros_like(p) for p in g] for g in self.masters]
        self.t = 0

    def step(self, optimizer, half_groups, scale: float) -> None:
        self.t += 1
        for gi, group in enumerate(optimizer.param_groups):
            grads = [h.grad.float() for h in half_groups[gi]]
            norm = float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g)
                                                               for g in grads])))
            combined = scale
            clip = ((norm / scale) + 1e-6) / group["max_grad_norm"]
            if clip > 1:
                combined = clip * scale
            b1, b2 = group["betas"]
            step_size = group["lr"]
            if self.bias_correction:
                step_size = group["lr"] * math.sqrt(1 - b2**self.t) / (1 - b1**self.t)
            for i, g in enumerate(grads):
                g = g / combined
                m, v, p = self.m[gi][i], self.v[gi][i], self.masters[gi][i]
                m.mul_(b1).add_((1 - b1) * g)
                v.mul_(b2).add_((1 - b2) * g * g)
                update = m / (v.sqrt() + group["eps"]) + group["weight_decay"] * p
                p.sub_(step_size * update)


@pytest.mark.parametrize("bias_correction", [False, True])
def test_2019_math_matches_a_plain_pytorch_reference(bias_correction):
    model, optimizer = _build(bias_correction, static_loss_scale=128.0)
    ref = _Reference(optimizer, bias_correction)
    for step in range(STEPS):
        ids, labels = _batch(step)
        optimizer.backward(model(ids, labels))
        ref.step(optimizer, optimizer.fp16_groups, optimizer.loss_scale)
        optimizer.step()
        optimizer.zero_grad()
        # fp32 rounding apart (the clipping norm is summed in another order, g * (1/s) is not
        # g / s), over 24 steps of lr 5e-3: within 1e-5, a five-hundredth of one step.
        for ours, theirs in zip(optimizer.param_groups, ref.masters):
            for a, b in zip(ours["params"], theirs):
                torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_2019_fp16_optimizer_refuses_what_it_never_did():
    FP16_Optimizer, FusedAdam = _apex_2019()  # noqa: N806
    model = TinyBert().half()
    with pytest.raises(TypeError, match="apex.fp16_utils.FP16_Optimizer"):
        FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(ValueError, match="dynamic_loss_args"):
        FP16_Optimizer(FusedAdam(model.parameters(), max_grad_norm=1.0), dynamic_loss_scale=True,
                       dynamic_loss_args={"scale_window": 10})
    optimizer = FP16_Optimizer(FusedAdam(model.parameters(), max_grad_norm=1.0))
    with pytest.raises(NotImplementedError, match="max_grad_norm"):
        optimizer.clip_master_grads(1.0)
    with pytest.raises(TypeError, match="closure"):
        optimizer.step(lambda: None)
