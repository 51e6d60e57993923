"""``apex.fp16_utils.FP16_Optimizer`` and the old loss scalers against a plain-PyTorch reference.

The reference is Apex's math written out with torch alone: fp32 masters made
from the half params, grads unscaled into them (``float(grad) * (1 / scale)``),
a step skipped on any inf/NaN, the masters rounded back into the model, and
the dynamic schedule of Apex's amp scaler (halve on overflow, double after
``scale_window`` clean steps, capped). One difference from Apex is kept on
purpose and tested: at a static scale, an overflowing step is skipped too.
"""

from __future__ import annotations

import copy
import io
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from amp_patch.apex_compat.fp16_utils import DynamicLossScaler, FP16_Optimizer, LossScaler
from training_utils import assert_same_leaves, count_host_syncs

STEPS = 50
OVERFLOW_AT = {3, 4, 17, 30}


def _model(dtype: torch.dtype, device: str = "cpu") -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3)).to(device, dtype)


def _batch(step: int, dtype: torch.dtype, device: str = "cpu"):
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randn(16, 6, generator=g)
    return x.to(device, dtype), (x[:, 0] > 0).long().to(device) + (x[:, 1] > 0).long().to(device)


def _loss(model: nn.Module, step: int, dtype: torch.dtype, device: str = "cpu") -> torch.Tensor:
    x, y = _batch(step, dtype, device)
    loss = F.cross_entropy(model(x).float(), y)
    return loss * math.inf if step in OVERFLOW_AT else loss


class ReferenceFP16:
    """Apex's FP16_Optimizer math with torch alone (SGD with momentum on fp32 masters)."""

    def __init__(self, model: nn.Module, dynamic: bool, scale: float, window: int = 2000,
                 max_scale: float = 2.0**24) -> None:
        self.params = list(model.parameters())
        self.masters = [p.detach().clone().float().requires_grad_() for p in self.params]
        self.opt = torch.optim.SGD(self.masters, lr=0.05, momentum=0.9)
        self.dynamic, self.scale, self.window, self.max_scale = dynamic, scale, window, max_scale
        self.unskipped = 0

    def iteration(self, loss: torch.Tensor) -> bool:
        for p in self.params + self.masters:
            p.grad = None
        (loss.float() * self.scale).backward()
        overflow = any(not torch.isfinite(p.grad).all() for p in self.params)
        for p, m in zip(self.params, self.masters):
            m.grad = p.grad.float() * (1.0 / self.scale)
        if overflow:
            self.unskipped = 0
            if self.dynamic:
                self.scale /= 2.0
        else:
            self.unskipped += 1
            if self.dynamic and self.unskipped == self.window:
                self.scale, self.unskipped = min(self.max_scale, self.scale * 2.0), 0
            self.opt.step()
            with torch.no_grad():
                for p, m in zip(self.params, self.masters):
                    p.copy_(m)
        return overflow


def _wrapped(model: nn.Module, **kwargs) -> FP16_Optimizer:
    return FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), **kwargs)


def _iteration(opt: FP16_Optimizer, model: nn.Module, step: int, dtype: torch.dtype,
               device: str = "cpu") -> None:
    opt.zero_grad(set_grads_to_None=True)
    opt.backward(_loss(model, step, dtype, device))
    opt.step()


def _assert_same(opt: FP16_Optimizer, model: nn.Module, ref: ReferenceFP16) -> None:
    for a, b in zip(opt.all_fp32_from_fp16_params, ref.masters):
        assert torch.equal(a, b)
    for a, b in zip(model.parameters(), ref.params):
        assert a.dtype == b.dtype and torch.equal(a, b)
    for a, b in zip(opt.all_fp32_from_fp16_params, ref.masters):
        assert torch.equal(opt.state[a]["momentum_buffer"], ref.opt.state[b]["momentum_buffer"])


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("scaling", ["dynamic", "static"])
def test_matches_reference_over_50_steps(device, dtype, scaling):
    model, ref_model = _model(dtype, device), _model(dtype, device)
    if scaling == "dynamic":
        opt = _wrapped(model, dynamic_loss_scale=True,
                       dynamic_loss_args={"init_scale": 2.0**10, "scale_window": 5,
                                          "max_loss_scale": 2.0**12})
        ref = ReferenceFP16(ref_model, dynamic=True, scale=2.0**10, window=5, max_scale=2.0**12)
    else:
        opt = _wrapped(model, static_loss_scale=128.0)
        ref = ReferenceFP16(ref_model, dynamic=False, scale=128.0)
    scales, ref_scales = [], []
    for step in range(STEPS):
        _iteration(opt, model, step, dtype, device)
        overflow = ref.iteration(_loss(ref_model, step, dtype, device))
        assert opt.overflow == overflow == (step in OVERFLOW_AT)
        scales.append(opt.loss_scale)
        ref_scales.append(ref.scale)
        _assert_same(opt, model, ref)
    assert scales == ref_scales
    if scaling == "dynamic":
        # The schedule really moved: halvings at the overflows, doublings up to the cap.
        assert min(scales) == 2.0**8 and max(scales) == 2.0**12
    else:
        assert set(scales) == {128.0}


def test_overflow_step_changes_nothing_but_the_scale():
    model = _model(torch.bfloat16)
    opt = _wrapped(model, dynamic_loss_scale=True)
    for step in range(3):
        _iteration(opt, model, step, torch.bfloat16)
    params = [p.detach().clone() for p in model.parameters()]
    masters = [m.detach().clone() for m in opt.all_fp32_from_fp16_params]
    state = copy.deepcopy(opt.optimizer.state_dict())
    scale = opt.loss_scale
    _iteration(opt, model, min(OVERFLOW_AT), torch.bfloat16)  # an overflow step
    assert opt.overflow and opt.loss_scale == scale / 2
    assert opt.clip_master_grads(1.0) == -1
    assert opt.inspect_master_grad_data() is None
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), params))
    assert all(torch.equal(a, b) for a, b in zip(opt.all_fp32_from_fp16_params, masters))
    after = opt.optimizer.state_dict()
    for i, s in state["state"].items():
        assert torch.equal(s["momentum_buffer"], after["state"][i]["momentum_buffer"])


def test_one_host_sync_per_step(device, half_dtype):
    model = _model(half_dtype, device)
    opt = _wrapped(model, dynamic_loss_scale=True)
    _iteration(opt, model, 0, half_dtype, device)
    for step in (1, 2):
        x, y = _batch(step, half_dtype, device)
        loss = F.cross_entropy(model(x).float(), y)
        with count_host_syncs() as counted:
            opt.zero_grad()
            opt.backward(loss)
            opt.clip_master_grads(1.0)
            opt.step()
        assert counted["n"] == 1


def test_clip_master_grads_matches_torch():
    model = _model(torch.bfloat16)
    opt = _wrapped(model, static_loss_scale=64.0)
    opt.backward(_loss(model, 0, torch.bfloat16))
    masters = opt.all_fp32_from_fp16_params
    expected_grads = [m.grad.clone() for m in masters]
    holders = [torch.zeros_like(m).requires_grad_() for m in masters]
    for h, g in zip(holders, expected_grads):
        h.grad = g.clone()
    expected = nn.utils.clip_grad_norm_(holders, 0.1)
    norm = opt.clip_master_grads(0.1)
    assert isinstance(norm, torch.Tensor) and norm.dim() == 0
    torch.testing.assert_close(norm, expected, rtol=1e-6, atol=0)
    assert float(norm) > 0.1  # it clipped
    for m, h in zip(masters, holders):
        torch.testing.assert_close(m.grad, h.grad, rtol=1e-6, atol=0)
    # Another norm type goes through torch's own function.
    assert float(opt.clip_master_grads(10.0, norm_type=float("inf"))) > 0


def _save(obj) -> dict:
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


@pytest.mark.parametrize("dynamic", [True, False], ids=["dynamic", "static"])
def test_checkpoint_resumes_exactly(dynamic):
    kwargs = ({"dynamic_loss_scale": True, "dynamic_loss_args": {"scale_window": 3}} if dynamic
              else {"static_loss_scale": 32.0})
    model = _model(torch.bfloat16)
    opt = _wrapped(model, **kwargs)
    for step in range(6):
        _iteration(opt, model, step, torch.bfloat16)
    ckpt = _save({"model": model.state_dict(), "optimizer": opt.state_dict()})
    for step in range(6, 12):
        _iteration(opt, model, step, torch.bfloat16)

    resumed_model = _model(torch.bfloat16)
    resumed = _wrapped(resumed_model, **kwargs)
    resumed_model.load_state_dict(ckpt["model"])
    resumed.load_state_dict(ckpt["optimizer"])
    for step in range(6, 12):
        _iteration(resumed, resumed_model, step, torch.bfloat16)
    assert resumed.loss_scale == opt.loss_scale
    assert resumed.loss_scaler._unskipped == opt.loss_scaler._unskipped
    for a, b in zip(resumed.all_fp32_from_fp16_params, opt.all_fp32_from_fp16_params):
        assert torch.equal(a, b)
    for a, b in zip(resumed_model.parameters(), model.parameters()):
        assert torch.equal(a, b)


def test_load_state_dict_errors_name_the_expected_form():
    model = _model(torch.bfloat16)
    opt = _wrapped(model, dynamic_loss_scale=True)
    with pytest.raises(TypeError, match="FP16_Optimizer.state_dict"):
        opt.load_state_dict({"optimizer": {}})
    static = _wrapped(_model(torch.bfloat16), static_loss_scale=8.0)
    with pytest.raises(ValueError, match="dynamic_loss_scale=False"):
        opt.load_state_dict(static.state_dict())
    with pytest.raises(TypeError, match="expected float16, bfloat16 or float32"):
        FP16_Optimizer(torch.optim.SGD([nn.Parameter(torch.zeros(2, dtype=torch.float64))], lr=1))
    with pytest.raises(TypeError, match="lacks"):
        FP16_Optimizer(object())
    with pytest.raises(TypeError, match="unknown dynamic_loss_args"):
        _wrapped(_model(torch.bfloat16), dynamic_loss_scale=True, dynamic_loss_args={"window": 2})


def _wrapper_bits(opt: FP16_Optimizer, model: nn.Module) -> list:
    """Copies of the model, the masters, the wrapped optimizer's state, the scaler and the flags."""
    return copy.deepcopy([[p.detach() for p in model.parameters()],
                          [m.detach() for m in opt.all_fp32_from_fp16_params],
                          opt.optimizer.state_dict(), opt._scaler.state_dict(), opt.overflow])


def _spoil(kind: str, sd: dict) -> str:
    """Spoil one part of a saved FP16_Optimizer state in place; returns what the error says."""
    if kind == "master dtype":
        sd["fp32_from_fp16"][0][-1] = sd["fp32_from_fp16"][0][-1].bfloat16()
        return r"group 0, master 3: .*torch.bfloat16.*expected torch.float32"
    if kind == "master shape":
        sd["fp32_from_fp16"][0][-1] = torch.zeros(2)
        return r"group 0, master 3: .*shape \(2,\).*expected .*shape \(3,\)"
    if kind == "scaler":
        sd["loss_scaler"]["loss_scale"] = -1.0
        return "loss_scale"
    sd["optimizer_state_dict"]["param_groups"][0]["params"].append(99)
    return "size of optimizer's group"


@pytest.mark.parametrize("kind", ["master dtype", "master shape", "scaler", "optimizer"])
def test_failed_load_changes_nothing(kind):
    """Every part is checked before any is applied: a bad checkpoint changes no value, no flag
    and no scale."""
    model = _model(torch.bfloat16)
    opt = _wrapped(model, dynamic_loss_scale=True)
    for step in range(3):
        _iteration(opt, model, step, torch.bfloat16)
    sd = _save(opt.state_dict())
    sd["loss_scaler"]["loss_scale"] /= 4
    sd["overflow"] = not opt.overflow
    for step in range(3, 5):
        _iteration(opt, model, step, torch.bfloat16)
    before = _wrapper_bits(opt, model)
    with pytest.raises(ValueError, match=_spoil(kind, sd)):
        opt.load_state_dict(sd)
    assert_same_leaves(before, _wrapper_bits(opt, model))


def test_fp32_params_stay_and_half_params_get_masters():
    torch.manual_seed(0)
    half = nn.Linear(4, 4).bfloat16()
    full = nn.Linear(4, 2)
    frozen = nn.Parameter(torch.zeros(3, dtype=torch.bfloat16), requires_grad=False)
    inner = torch.optim.SGD([{"params": list(half.parameters()) + [frozen]},
                             {"params": full.parameters(), "lr": 0.5}], lr=0.1)
    opt = FP16_Optimizer(inner, static_loss_scale=4.0)
    assert [len(g) for g in opt.fp16_groups] == [2, 0]
    assert [len(g) for g in opt.fp32_from_fp32_groups] == [0, 2]
    assert all(m.dtype == torch.float32 for m in opt.all_fp32_from_fp16_params)
    assert opt.param_groups[0]["params"][2] is frozen
    assert opt.param_groups[1]["params"][0] is full.weight
    x = torch.randn(5, 4)
    loss = full(half(x.bfloat16()).float()).square().mean()
    opt.backward(loss)
    expected = full.weight.grad.clone()
    opt.param_groups[1]["lr"] = 0.25  # an lr schedule set through param_groups
    opt.step()
    assert full.weight.grad is not None and torch.equal(full.weight.grad, expected)
    assert opt.loss_scaler.loss_scale() == 4.0
    opt.loss_scale = 16.0
    assert opt.loss_scaler._loss_scale == 16.0 and opt.state is inner.state
    with pytest.raises(RuntimeError, match="state_dict"):
        copy.deepcopy(opt)


def test_state_of_a_stepped_optimizer_moves_to_the_masters_in_fp32():
    model = _model(torch.bfloat16)
    inner = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(3, 6, dtype=torch.bfloat16)).float().sum().backward()
    inner.step()  # momentum buffers in bf16, keyed by the half params
    before = {id(p): inner.state[p]["momentum_buffer"].clone() for p in model.parameters()}
    opt = FP16_Optimizer(inner)
    for half, master in zip(opt.all_fp16_params, opt.all_fp32_from_fp16_params):
        assert half not in inner.state
        buf = inner.state[master]["momentum_buffer"]
        assert buf.dtype == torch.float32 and torch.equal(buf, before[id(half)].float())


def test_wraps_served_fused_adam_and_lbfgs_closure():
    from amp_patch.optim.fused import FusedAdam

    model = _model(torch.bfloat16)
    opt = FP16_Optimizer(FusedAdam(model.parameters(), lr=1e-2), dynamic_loss_scale=True)
    first = None
    for step in range(8):
        opt.zero_grad()
        x, y = _batch(step % 2, torch.bfloat16)
        loss = F.cross_entropy(model(x).float(), y)
        opt.backward(loss)
        opt.step()
        first = first if first is not None else loss.item()
    assert loss.item() < first

    model = _model(torch.bfloat16)
    opt = FP16_Optimizer(torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=4),
                         static_loss_scale=2.0)
    x, y = _batch(0, torch.bfloat16)

    def closure():
        opt.zero_grad()
        loss = F.cross_entropy(model(x).float(), y)
        opt.backward(loss)
        return loss

    before = closure().item()
    opt.step(closure)
    assert F.cross_entropy(model(x).float(), y).item() < before
    assert opt.first_closure_call_this_step


def test_dynamic_loss_scaler_keeps_apex_rule():
    s = DynamicLossScaler(init_scale=2.0**4, scale_factor=4.0, scale_window=3)
    seen = []
    for overflow in [False, False, True, False, False, False, True, True, True, False]:
        s.update_scale(overflow)
        seen.append(s.loss_scale)
    # Grows when (iteration - last overflow) is a multiple of the window; never below 1.
    assert seen == [16.0, 16.0, 4.0, 4.0, 4.0, 16.0, 4.0, 1.0, 1.0, 1.0]
    assert DynamicLossScaler().loss_scale == 2**32
    p = nn.Parameter(torch.ones(3))
    p.grad = torch.tensor([1.0, float("nan"), 0.0])
    q = nn.Parameter(torch.ones(2))
    q.grad = torch.ones(2)
    assert s.has_overflow([q, p]) and not s.has_overflow([q])
    assert DynamicLossScaler._has_inf_or_nan(torch.tensor([float("inf")]))
    static = LossScaler(8.0)
    assert static.loss_scale == 8.0 and not static.has_overflow([p])
    w = nn.Parameter(torch.ones(2))
    static.backward((w * 3).sum())
    assert torch.equal(w.grad, torch.full((2,), 24.0))
    assert static.scale_gradient(None, (torch.ones(1),), None)[0].item() == 8.0
