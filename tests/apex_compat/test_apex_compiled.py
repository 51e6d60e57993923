"""Apex's compiled top-level modules and ``apex.contrib``: served with Apex's math, or refused.

``fused_adam_cuda`` is checked bit for bit against a NumPy transcription of
Apex's kernel (IEEE fp32/fp64 scalar arithmetic, one rounding per operation),
which shares no code with the served module.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from torch import nn

from amp_patch.apex_compat import apex_C, fused_adam_cuda, import_hook
from amp_patch.apex_compat.contrib import optimizers as contrib
from amp_patch.apex_compat.contrib.xentropy import SoftmaxCrossEntropyLoss
from conftest import DEVICES


@pytest.fixture
def hook():
    with import_hook.apex_import_hook(shadow_apex=True) as finder:
        yield finder


# ------------------------------------------------------------------ the reference

def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().cpu().to(torch.float64 if t.dtype == torch.float64 else torch.float32).numpy()


def _reference_adam(p, m, v, g, lr, beta1, beta2, eps, grad_scale, step, mode, bias_correction,
                    decay):
    """Apex's ``adam_cuda_kernel`` per element, in NumPy: T is p's dtype, scalars are fp32."""
    f = np.float32
    T = p.dtype.type
    lr, b1, b2, eps, scale, decay = f(lr), f(beta1), f(beta2), f(eps), f(grad_scale), f(decay)
    if bias_correction == 1:
        bc1 = f(1.0 - np.float64(b1) ** step)
        bc2 = f(1.0 - np.float64(b2) ** step)
        step_size = f(f(lr * np.sqrt(bc2)) / bc1)
    else:
        step_size = lr
    p, m, v = p.copy(), m.copy(), v.copy()
    sg = g.astype(T) / T(scale)
    m = T(b1) * m + T(f(1) - b1) * sg
    v = T(b2) * v + T(f(1) - b2) * sg * sg
    if mode == 0:
        denom = np.sqrt((v + T(eps)).astype(f))
    else:
        denom = np.sqrt(v.astype(f)) + eps
    update = (m / denom.astype(T) + T(decay) * p).astype(f)
    p = p - (step_size * update).astype(T)
    return p, m, v


def _state(n, dtype, device, seed):
    gen = torch.Generator().manual_seed(seed)
    p = torch.randn(n, generator=gen, dtype=torch.float64).to(dtype)
    m = (0.1 * torch.randn(n, generator=gen, dtype=torch.float64)).to(dtype)
    v = torch.rand(n, generator=gen, dtype=torch.float64).to(dtype) * 1e-3
    return p.to(device), m.to(device), v.to(device)


ARGS = [  # lr, beta1, beta2, eps, grad_scale, step, mode, bias_correction, decay
    (1e-3, 0.9, 0.999, 1e-8, 1.0, 1, 1, 1, 0.0),
    (2e-3, 0.9, 0.98, 1e-9, 65536.0, 7, 0, 1, 0.01),
    (0.5, 0.8, 0.99, 1e-6, 3.0, 1000, 1, 0, 1e-4),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("p_dtype, g_dtype", [
    (torch.float32, torch.float32), (torch.float32, torch.float16),
    (torch.float32, torch.bfloat16), (torch.float64, torch.float64)])
@pytest.mark.parametrize("args", ARGS)
def test_adam_is_apexs_kernel_bit_for_bit(device, p_dtype, g_dtype, args):
    n = 1037
    p, m, v = _state(n, p_dtype, device, seed=args[5])
    g = (torch.randn(n, generator=torch.Generator().manual_seed(3)) * args[4] / 8).to(g_dtype)
    g = g.to(device)
    half = g_dtype in (torch.float16, torch.bfloat16)
    p_copy = torch.empty(n, dtype=g_dtype, device=device) if half else torch.empty(0)
    want_p, want_m, want_v = _reference_adam(_np(p), _np(m), _np(v), _np(g), *args)
    fused_adam_cuda.adam(p, p_copy, m, v, g, *args)
    for got, want in ((p, want_p), (m, want_m), (v, want_v)):
        assert got.dtype == p_dtype
        np.testing.assert_array_equal(_np(got), want)
    if half:  # the half model param receives the update rounded, as Apex's kernel wrote it
        assert torch.equal(p_copy, p.to(g_dtype))


def test_adam_writes_no_copy_for_full_precision_grads():
    p, m, v = _state(8, torch.float32, "cpu", 0)
    p_copy = torch.full((8,), 7.0)
    fused_adam_cuda.adam(p, p_copy, m, v, torch.ones(8), *ARGS[0][:5], 1, 1, 1, 0.0)
    assert torch.equal(p_copy, torch.full((8,), 7.0))  # "wasted write" in Apex's words


@pytest.mark.parametrize("device", DEVICES)
def test_adam_mt_matches_adam_per_tensor(device):
    sizes = (5, 300, 1)
    rows, expected = [], []
    for i, n in enumerate(sizes):
        p, m, v = _state(n, torch.float32, device, seed=i)
        g = torch.randn(n, generator=torch.Generator().manual_seed(10 + i)).half().to(device)
        rows.append([p, m, v, g, torch.empty(n, dtype=torch.float16, device=device)])
        ref = [t.clone() for t in (p, m, v)] + [g, torch.empty(n, dtype=torch.float16,
                                                               device=device)]
        fused_adam_cuda.adam(ref[0], ref[4], ref[1], ref[2], ref[3], *ARGS[1])
        expected.append(ref)
    fused_adam_cuda.adam_mt(65536, torch.zeros(1, dtype=torch.int32), [list(c) for c in zip(*rows)],
                            *ARGS[1])
    for row, ref in zip(rows, expected):
        for got, want in zip(row[:3] + row[4:], ref[:3] + ref[4:]):
            assert torch.equal(got, want)


@pytest.mark.parametrize("call, message", [
    (lambda p, m, v, g: fused_adam_cuda.adam(p, torch.empty(0), m[:3], v, g, *ARGS[0]),
     "number of elements in m and p"),
    (lambda p, m, v, g: fused_adam_cuda.adam(p, torch.empty(2), m, v, g, *ARGS[0]),
     "p_copy should be empty"),
    (lambda p, m, v, g: fused_adam_cuda.adam(p.half(), torch.empty(0), m.half(), v.half(),
                                             g.half(), *ARGS[0]),
     "expected parameter to be of float type"),
    (lambda p, m, v, g: fused_adam_cuda.adam_mt(1, torch.zeros(1), [[p], [m], [v]], *ARGS[0]),
     "expected tensor lists of size 4 or 5"),
])
def test_bad_arguments_fail_as_apexs_checks(call, message):
    p, m, v = _state(4, torch.float32, "cpu", 0)
    with pytest.raises(RuntimeError, match=message):
        call(p, m, v, torch.ones(4))


def test_apex_c_flatten_unflatten():
    ts = [torch.arange(3.0), torch.ones(2, 2)]
    flat = apex_C.flatten(ts)
    assert torch.equal(flat, torch.tensor([0.0, 1, 2, 1, 1, 1, 1]))
    back = apex_C.unflatten(flat, ts)
    assert [t.shape for t in back] == [t.shape for t in ts]
    assert all(torch.equal(a, b) for a, b in zip(back, ts))


# ------------------------------------------------------------------ the import hook

def test_every_compiled_module_of_apex_is_served_or_refused(hook, caplog):
    caplog.set_level(logging.WARNING, logger="amp_patch")
    served, refused = [], []
    for name, hint in import_hook.COMPILED_MODULES.items():
        try:
            __import__(name)
            served.append(name)
            assert hint is None
        except ImportError as exc:
            assert isinstance(exc, import_hook.ApexUnsupportedError)
            assert hint is not None and f"Use instead: {hint}" in str(exc)
            refused.append(name)
    assert served == ["amp_C", "apex_C", "fused_adam_cuda"]
    assert list(hook.misses) == refused and len(refused) >= 30
    warned = [r.getMessage().split(" ", 1)[0] for r in caplog.records]
    assert warned == refused  # each caught import is still logged, once


def test_unserved_function_of_a_served_module_warns(hook, caplog):
    import fused_adam_cuda as served

    assert served.adam is fused_adam_cuda.adam and served.adam_mt is fused_adam_cuda.adam_mt
    with pytest.raises(AttributeError, match="fused_adam_cuda.maybe_cast is not supported"):
        served.maybe_cast  # noqa: B018
    assert "fused_adam_cuda.maybe_cast" in hook.misses


def test_contrib_names_served_and_refused(hook):
    import apex

    assert apex.contrib.optimizers.FP16_Optimizer is contrib.FP16_Optimizer
    from apex.contrib.optimizers import FusedAdam
    from apex.contrib.optimizers.fp16_optimizer import FP16_Optimizer
    from apex.contrib.xentropy import SoftmaxCrossEntropyLoss as Served
    from apex.contrib.clip_grad import clip_grad_norm_

    assert FusedAdam is contrib.FusedAdam and FP16_Optimizer is contrib.FP16_Optimizer
    assert Served is SoftmaxCrossEntropyLoss and clip_grad_norm_ is nn.utils.clip_grad_norm_
    with pytest.raises(ImportError, match="Use instead: apex.optimizers.FusedLAMB"):
        from apex.contrib.optimizers import FusedLAMB  # noqa: F401
    with pytest.raises(ImportError, match="scaled_dot_product_attention"):
        import apex.contrib.fmha  # noqa: F401


# ------------------------------------------------------------------ apex.contrib

def test_xentropy_is_label_smoothed_cross_entropy():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 11, generator=gen, requires_grad=True)
    labels = torch.tensor([3, 0, 10, 0, 5, 7])
    losses = SoftmaxCrossEntropyLoss.apply(logits, labels, 0.1, 0, False)
    want = nn.functional.cross_entropy(logits, labels, label_smoothing=0.1, reduction="none")
    want = want.masked_fill(labels == 0, 0.0)
    torch.testing.assert_close(losses, want)
    losses.sum().backward()
    assert torch.equal(logits.grad[1], torch.zeros(11))  # padded rows get no gradient
    half = SoftmaxCrossEntropyLoss.apply(logits.detach().half(), labels, 0.0, -1, True)
    assert half.dtype == torch.float32


def _model(dtype=torch.float16, seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).to(dtype)


def _data(i):
    gen = torch.Generator().manual_seed(i)
    return torch.randn(16, 6, generator=gen), torch.randint(0, 3, (16,), generator=gen)


def _train(model, optimizer, steps, start=0, overflow_at=()):
    losses = []
    for i in range(start, start + steps):
        x, y = _data(i)
        loss = nn.functional.cross_entropy(model(x.to(torch.float16)).float(), y)
        if i in overflow_at:
            loss = loss * float("inf")
        optimizer.zero_grad()
        optimizer.backward(loss)
        optimizer.step()
        losses.append(loss.item())
    return losses


class ScriptsOwnFusedAdam(torch.optim.Optimizer):
    """A script's own copy of Apex's FusedAdam (as OpenNMT-py ships) calling fused_adam_cuda."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8):
        import fused_adam_cuda as module  # served by the hook

        self.module = module
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=0.0))

    def step(self, closure=None, grads=None, output_params=None, scale=1.0, grad_norms=None):
        for group, group_grads, outs in zip(self.param_groups, grads, output_params):
            for p, g, out in zip(group["params"], group_grads, outs):
                state = self.state[p]
                if not state:
                    state.update(step=0, exp_avg=torch.zeros_like(p),
                                 exp_avg_sq=torch.zeros_like(p))
                state["step"] += 1
                self.module.adam(p.data, out, state["exp_avg"], state["exp_avg_sq"], g,
                                 group["lr"], *group["betas"], group["eps"], scale,
                                 state["step"], 1, 1, group["weight_decay"])


def test_fp16_optimizer_steps_the_masters_with_apexs_math():
    model = _model()
    halves = list(model.parameters())
    masters0 = [p.detach().float().clone() for p in halves]
    opt = contrib.FP16_Optimizer(contrib.FusedAdam(model.parameters(), lr=1e-2),
                                 dynamic_loss_scale=True)
    assert opt.cur_scale == 2.0 ** 16
    assert [p for g in opt.param_groups for p in g["params"]] == opt.fp32_groups[0]
    x, y = _data(0)
    loss = nn.functional.cross_entropy(model(x.half()).float(), y)
    opt.backward(loss)
    grads = [p.grad.clone() for p in halves]
    opt.step()
    for master, half, p0, g in zip(opt.fp32_groups[0], halves, masters0, grads):
        want, _, _ = _reference_adam(_np(p0), np.zeros_like(_np(p0)), np.zeros_like(_np(p0)),
                                     _np(g), 1e-2, 0.9, 0.999, 1e-8, 2.0 ** 16, 1, 1, 1, 0.0)
        np.testing.assert_array_equal(_np(master), want)
        assert torch.equal(half.detach(), master.half())


def test_fp16_optimizer_dynamic_scale_schedule():
    model = _model()
    opt = contrib.FP16_Optimizer(contrib.FusedAdam(model.parameters()), dynamic_loss_scale=True)
    before = [p.detach().clone() for p in model.parameters()]
    _train(model, opt, 1, overflow_at={0})
    assert opt.overflow and opt.cur_scale == 2.0 ** 15
    assert all(torch.equal(a, b.detach()) for a, b in zip(before, model.parameters()))
    opt.cur_scale = 1.5
    _train(model, opt, 1, start=1, overflow_at={1})
    assert opt.cur_scale == 1  # halved, but not below 1
    opt.scale_window = 3  # Apex's attribute: doubles after that many clean steps
    _train(model, opt, 3, start=2)
    assert opt.cur_scale == 2 and opt.cur_iter == 5
    assert contrib.FP16_Optimizer(contrib.FusedAdam(_model().parameters()),
                                  dynamic_loss_scale=True).scale_window == 1000
    static = contrib.FP16_Optimizer(contrib.FusedAdam(_model().parameters()),
                                    static_loss_scale=128.0)
    _train(_model(), static, 1, overflow_at={0})
    assert static.cur_scale == 128.0


def test_fp16_optimizer_wraps_a_scripts_own_fused_adam_bit_for_bit(hook):
    served = _model()
    ours = contrib.FP16_Optimizer(contrib.FusedAdam(served.parameters(), lr=1e-2),
                                  dynamic_loss_scale=True)
    own = _model()
    theirs = contrib.FP16_Optimizer(ScriptsOwnFusedAdam(own.parameters(), lr=1e-2),
                                    dynamic_loss_scale=True)
    assert _train(served, ours, 6, overflow_at={2}) == _train(own, theirs, 6, overflow_at={2})
    for a, b in zip(served.parameters(), own.parameters()):
        assert torch.equal(a, b)


def test_fp16_optimizer_resumes_exactly(tmp_path):
    full_model = _model()
    full = contrib.FP16_Optimizer(contrib.FusedAdam(full_model.parameters(), lr=1e-2),
                                  dynamic_loss_scale=True)
    expected = _train(full_model, full, 8, overflow_at={1})
    model = _model()
    opt = contrib.FP16_Optimizer(contrib.FusedAdam(model.parameters(), lr=1e-2),
                                 dynamic_loss_scale=True)
    _train(model, opt, 4, overflow_at={1})
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, tmp_path / "ckpt.pt")
    ckpt = torch.load(tmp_path / "ckpt.pt")
    model = _model(seed=5)
    opt = contrib.FP16_Optimizer(contrib.FusedAdam(model.parameters(), lr=1e-2),
                                 dynamic_loss_scale=True)
    model.load_state_dict(ckpt["model"])
    opt.load_state_dict(ckpt["opt"])
    assert opt.cur_scale == full.cur_scale or opt.cur_iter == 4
    assert _train(model, opt, 4, start=4) == expected[4:]
    for a, b in zip(model.parameters(), full_model.parameters()):
        assert torch.equal(a, b)


def test_fp16_optimizer_refuses_an_optimizer_without_the_protocol():
    with pytest.raises(TypeError, match="apex.fp16_utils.FP16_Optimizer"):
        contrib.FP16_Optimizer(torch.optim.SGD(_model().parameters(), lr=0.1))
    with pytest.raises(ValueError, match="dynamic_loss_args"):
        contrib.FP16_Optimizer(contrib.FusedAdam(_model().parameters()), dynamic_loss_args={})
    assert not hasattr(contrib.FP16_Optimizer, "update_master_grads")  # OpenNMT probes it


def test_contrib_fused_adam_use_mt_and_clipping_match_the_kernel():
    torch.manual_seed(0)
    a = nn.Linear(5, 4)
    b = nn.Linear(5, 4)
    b.load_state_dict(a.state_dict())
    opt_a = contrib.FusedAdam(a.parameters(), lr=1e-2, eps_inside_sqrt=True, weight_decay=0.1)
    opt_b = contrib.FusedAdam(b.parameters(), lr=1e-2, eps_inside_sqrt=True, weight_decay=0.1,
                              use_mt=True)
    for i in range(3):
        x, _ = _data(i)
        for model, opt in ((a, opt_a), (b, opt_b)):
            opt.zero_grad()
            model(x[:, :5]).sum().backward()
            opt.step()
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)
    # Clipping: a group norm above max_grad_norm divides the grads by (norm/scale + 1e-6)/max.
    p = nn.Parameter(torch.ones(4))
    q = nn.Parameter(torch.ones(4))
    clipped = contrib.FusedAdam([p], lr=0.1, max_grad_norm=1.0)
    plain = contrib.FusedAdam([q], lr=0.1)
    g = torch.full((4,), 8.0)
    clipped.step(grads=[g], scale=2.0, grad_norms=[torch.tensor(16.0)])
    plain.step(grads=[g], scale=2.0 * (8.0 + 1e-6))
    assert torch.equal(p, q)
