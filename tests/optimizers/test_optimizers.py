"""amp_patch.optim.fused against a plain float64 reference of Apex's math, and their contracts.

The references below are written per parameter from Apex's kernels
(csrc/multi_tensor_{adam,lamb,sgd_kernel,novograd,adagrad}.cu), independently
of the ops' reference bodies. Each optimizer runs 50 steps on fixed
pseudo-random grads, with fp32 params, with fp32 masters fed from half grads
through :class:`FusedStepInputs` (amp's O2 seam), and with the optimizers' own
master weights; it must stay within fp32 rounding of the reference.
"""

from __future__ import annotations

import copy
import math
import warnings

import pytest
import torch
from conftest import DEVICES
from test_ops import assert_bitwise

import amp_patch
from amp_patch.optim.fused import (
    FusedAdagrad,
    FusedAdam,
    FusedLAMB,
    FusedMixedPrecisionLamb,
    FusedNovoGrad,
    FusedSGD,
    FusedStepInputs,
)

SHAPES = [(17, 9), (33,), (2, 3, 5), ()]
STEPS = 50
SCALE = 1024.0  # the loss scale of the half-grad runs (a power of two: unscaling is exact)


# ------------------------------------------------------------ float64 references of Apex's math

class _Ref:
    """One optimizer's math on float64 tensors; state per parameter index."""

    def __init__(self, **hp):
        self.hp = hp
        self.state: dict[int, dict] = {}
        self.t = 0

    def step(self, params, grads):
        self.t += 1
        self.prepare(grads)
        for i, (p, g) in enumerate(zip(params, grads)):
            self.update(i, p, g, self.state.setdefault(i, {}))

    def prepare(self, grads):
        pass


class RefAdam(_Ref):
    def update(self, i, p, g, s):
        h = self.hp
        b1, b2 = h["betas"]
        if not h["adam_w_mode"]:
            g = g + h["weight_decay"] * p
        m = s["m"] = b1 * s.get("m", torch.zeros_like(p)) + (1 - b1) * g
        v = s["v"] = b2 * s.get("v", torch.zeros_like(p)) + (1 - b2) * g * g
        bc1, bc2 = (1 - b1 ** self.t, 1 - b2 ** self.t) if h["bias_correction"] else (1.0, 1.0)
        update = (m / bc1) / ((v / bc2).sqrt() + h["eps"])
        if h["adam_w_mode"]:
            update = update + h["weight_decay"] * p
        p -= h["lr"] * update


class RefLamb(_Ref):
    def prepare(self, grads):
        norm = math.sqrt(sum(float(g.square().sum()) for g in grads))
        mx = self.hp["max_grad_norm"]
        self.clip = norm / mx if mx and norm > mx else 1.0

    def update(self, i, p, g, s):
        h = self.hp
        b1, b2 = h["betas"]
        b3 = 1 - b1 if h["grad_averaging"] else 1.0
        g = g / self.clip
        if not h["adam_w_mode"]:
            g = g + h["weight_decay"] * p
        m = s["m"] = b1 * s.get("m", torch.zeros_like(p)) + b3 * g
        v = s["v"] = b2 * s.get("v", torch.zeros_like(p)) + (1 - b2) * g * g
        bc1, bc2 = (1 - b1 ** self.t, 1 - b2 ** self.t) if h["bias_correction"] else (1.0, 1.0)
        u = (m / bc1) / ((v / bc2).sqrt() + h["eps"])
        if h["adam_w_mode"]:
            u = u + h["weight_decay"] * p
        ratio = 1.0
        if h["use_nvlamb"] or h["weight_decay"] != 0:
            pn, un = float(p.norm()), float(u.norm())
            if pn != 0 and un != 0:
                ratio = pn / un
        p -= h["lr"] * ratio * u


class RefSGD(_Ref):
    def update(self, i, p, g, s):
        h = self.hp
        wd, mu = h["weight_decay"], h["momentum"]
        if not h["wd_after_momentum"]:
            g = g + wd * p
        if mu != 0:
            buf = s["buf"] = g.clone() if "buf" not in s else mu * s["buf"] + (1 - h["dampening"]) * g
            g = g + mu * buf if h["nesterov"] else buf
        if h["wd_after_momentum"]:
            g = g + wd * p
        p -= h["lr"] * g


class RefNovoGrad(_Ref):
    def update(self, i, p, g, s):
        h = self.hp
        b1, b2 = h["betas"]
        b3 = 1 - b1 if h["grad_averaging"] else 1.0
        n = float(g.abs().max()) if h["norm_type"] == 0 else float(g.norm())
        if "v" not in s:
            s["v"] = 0.0 if h["init_zero"] else n
        if h["norm_type"] == 0:
            s["v"] = b2 * s["v"] + (1 - b2) * n
        else:
            s["v"] = math.sqrt(b2 * s["v"] ** 2 + (1 - b2) * n * n)
        bc1, bc2 = (1 - b1 ** self.t, math.sqrt(1 - b2 ** self.t)) if h["bias_correction"] else (1.0, 1.0)
        denom = s["v"] / bc2 + h["eps"]
        m = s.get("m", torch.zeros_like(p))
        if h["reg_inside_moment"]:
            m = s["m"] = b1 * m + b3 * (g / denom + h["weight_decay"] * p)
            p -= h["lr"] * (m / bc1)
        else:
            m = s["m"] = b1 * m + b3 * g
            p -= h["lr"] * ((m / bc1) / denom + h["weight_decay"] * p)


class RefAdagrad(_Ref):
    def update(self, i, p, g, s):
        h = self.hp
        if not h["adagrad_w_mode"]:
            g = g + h["weight_decay"] * p
        acc = s["sum"] = s.get("sum", torch.zeros_like(p)) + g * g
        update = g / (acc.sqrt() + h["eps"])
        if h["adagrad_w_mode"]:
            update = update + h["weight_decay"] * p
        p -= h["lr"] * update


ADAM = dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, adam_w_mode=True,
            bias_correction=True)
LAMB = dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.01, adam_w_mode=True,
            bias_correction=True, grad_averaging=True, max_grad_norm=1.0, use_nvlamb=False)
SGD = dict(lr=0.05, momentum=0.9, dampening=0.0, weight_decay=0.0, nesterov=False,
           wd_after_momentum=False)
NOVO = dict(lr=1e-2, betas=(0.95, 0.98), eps=1e-8, weight_decay=0.0, bias_correction=True,
            grad_averaging=True, reg_inside_moment=False, norm_type=2, init_zero=False)
ADAGRAD = dict(lr=5e-2, eps=1e-10, weight_decay=0.0, adagrad_w_mode=False)

# (optimizer, its reference, base options, variants)
CONFIGS = {
    "adam": (FusedAdam, RefAdam, ADAM, [
        {}, {"weight_decay": 0.05}, {"weight_decay": 0.05, "adam_w_mode": False},
        {"bias_correction": False, "weight_decay": 0.01}]),
    "lamb": (FusedLAMB, RefLamb, LAMB, [
        {}, {"adam_w_mode": False}, {"weight_decay": 0.0}, {"weight_decay": 0.0, "use_nvlamb": True},
        {"max_grad_norm": 100.0, "bias_correction": False}, {"max_grad_norm": 0.0, "grad_averaging": False}]),
    "mp_lamb": (FusedMixedPrecisionLamb, RefLamb, LAMB, [
        {}, {"adam_w_mode": False, "use_nvlamb": True}, {"max_grad_norm": 0.0}]),
    "sgd": (FusedSGD, RefSGD, SGD, [
        {}, {"momentum": 0.0, "weight_decay": 1e-2}, {"nesterov": True, "weight_decay": 1e-2},
        {"dampening": 0.3, "weight_decay": 1e-2, "wd_after_momentum": True}]),
    "novograd": (FusedNovoGrad, RefNovoGrad, NOVO, [
        {}, {"weight_decay": 1e-2}, {"reg_inside_moment": True, "weight_decay": 1e-2},
        {"norm_type": 0, "init_zero": True, "grad_averaging": False},
        {"bias_correction": False, "init_zero": True}]),
    "adagrad": (FusedAdagrad, RefAdagrad, ADAGRAD, [
        {}, {"weight_decay": 1e-2}, {"weight_decay": 1e-2, "adagrad_w_mode": True}]),
}
CASES = [(name, i) for name, (_, _, _, variants) in CONFIGS.items() for i in range(len(variants))]
CASE_IDS = [f"{name}-{i}" for name, i in CASES]


def _options(name, variant):
    """(optimizer class, its float64 reference, the options both take)."""
    cls, ref_cls, base, variants = CONFIGS[name]
    hp = {**base, **variants[variant]}
    return cls, ref_cls(**hp), hp


def _initial(device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=gen).to(device) for s in SHAPES]


def _grads(t, device):
    gen = torch.Generator().manual_seed(1000 + t)
    return [(torch.randn(s, generator=gen) * 2.0).to(device) for s in SHAPES]


def _assert_close_to_ref(stepped, ref):
    # fp32 rounding, accumulated over the steps: relative to the tensor's largest magnitude,
    # since an element near zero carries the rounding of the larger terms that cancelled.
    for a, b in zip(stepped, ref):
        atol = 1e-5 * max(1.0, float(b.abs().max()))
        torch.testing.assert_close(a.detach().double().cpu(), b.cpu(), rtol=1e-5, atol=atol)


# ------------------------------------------------------------ 50 steps against the references

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name,variant", CASES, ids=CASE_IDS)
def test_fp32_params_match_reference(device, name, variant):
    cls, ref, options = _options(name, variant)
    params = [torch.nn.Parameter(t) for t in _initial(device)]
    ref_params = [t.detach().double() for t in params]
    opt = cls(params, **options)
    for t in range(STEPS):
        grads = _grads(t, device)
        for p, g in zip(params, grads):
            p.grad = g
        opt.step()
        ref.step(ref_params, [g.double() for g in grads])
    _assert_close_to_ref(params, ref_params)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("half", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("name,variant", CASES, ids=CASE_IDS)
def test_masters_from_half_grads_match_reference(device, half, name, variant):
    """The one-pass O2 seam: fp32 masters stepped from scaled half grads, half model written."""
    cls, ref, options = _options(name, variant)
    model = [torch.nn.Parameter(t.to(half)) for t in _initial(device)]
    masters = [torch.nn.Parameter(p.detach().float()) for p in model]
    ref_params = [m.detach().double() for m in masters]
    opt = cls(masters, **options)
    inv_scale = torch.full((1,), 1.0 / SCALE, device=device)
    found_inf = torch.zeros(1, device=device)
    for t in range(STEPS):
        half_grads = [(g * SCALE).to(half) for g in _grads(t, device)]
        inputs = FusedStepInputs(grads=dict(zip(masters, half_grads)),
                                 model_params=dict(zip(masters, model)),
                                 inv_scale=inv_scale, found_inf=found_inf)
        with opt.fused_step_inputs(inputs):
            opt.step()
        ref.step(ref_params, [g.double() / SCALE for g in half_grads])
    _assert_close_to_ref(masters, ref_params)
    assert_bitwise([p.detach() for p in model], [m.detach().to(half) for m in masters])
    assert all(m.grad is None for m in masters)


MASTER_OPTIMIZERS = {
    "adam": lambda params, **kw: FusedAdam(params, master_weights=True, **kw),
    "mp_lamb": lambda params, **kw: FusedMixedPrecisionLamb(
        params, reduced_precision_dtype=params[0].dtype, **kw),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name,variant", [c for c in CASES if c[0] in MASTER_OPTIMIZERS],
                         ids=[i for c, i in zip(CASES, CASE_IDS) if c[0] in MASTER_OPTIMIZERS])
def test_own_master_weights_match_reference(device, name, variant):
    """FusedAdam(master_weights=True) and FusedMixedPrecisionLamb on a bf16 model."""
    _, ref, options = _options(name, variant)
    model = [torch.nn.Parameter(t.bfloat16()) for t in _initial(device)]
    ref_params = [p.detach().double() for p in model]
    opt = MASTER_OPTIMIZERS[name](model, **options)
    for t in range(STEPS):
        grads = [g.bfloat16() for g in _grads(t, device)]
        for p, g in zip(model, grads):
            p.grad = g
        opt.step()
        ref.step(ref_params, [g.double() for g in grads])
    masters = [opt.state[p]["master_param"] for p in model]
    assert all(m.dtype == torch.float32 for m in masters)
    assert all(opt.state[p]["exp_avg"].dtype == torch.float32 for p in model)
    _assert_close_to_ref(masters, ref_params)
    assert_bitwise([p.detach() for p in model], [m.to(torch.bfloat16) for m in masters])


# ------------------------------------------------------------ skipped steps

def _snapshot(opt, extra=()):
    return copy.deepcopy(opt.state_dict()), [t.detach().clone() for t in extra]


def _assert_same_value(a, b):
    if isinstance(a, torch.Tensor) and a.is_floating_point():
        assert_bitwise([a], [b])
    elif isinstance(a, torch.Tensor):
        assert torch.equal(a, b)
    else:
        assert a == b


def _assert_same_snapshot(a, b):
    (sd_a, t_a), (sd_b, t_b) = a, b
    for group_a, group_b in zip(sd_a["param_groups"], sd_b["param_groups"], strict=True):
        assert group_a.keys() == group_b.keys()
        for key in group_a:
            _assert_same_value(group_a[key], group_b[key])
    assert sd_a["state"].keys() == sd_b["state"].keys()
    for k in sd_a["state"]:
        for key, v in sd_a["state"][k].items():
            _assert_same_value(v, sd_b["state"][k][key])
    assert_bitwise(t_a, t_b)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", list(CONFIGS))
def test_skipped_step_changes_nothing(device, name):
    """found_inf set: params, masters, model copies, state and step counters keep their bits."""
    cls, _, options = _options(name, 0)
    model = [torch.nn.Parameter(t.bfloat16()) for t in _initial(device)]
    masters = [torch.nn.Parameter(p.detach().float()) for p in model]
    opt = cls(masters, **options)
    flag = torch.zeros(1, device=device)

    def step(t):
        grads = [(g * SCALE).bfloat16() for g in _grads(t, device)]
        inputs = FusedStepInputs(grads=dict(zip(masters, grads)), model_params=dict(zip(masters, model)),
                                 inv_scale=torch.full((1,), 1 / SCALE, device=device), found_inf=flag)
        with opt.fused_step_inputs(inputs):
            opt.step()

    for t in range(3):
        step(t)
    before = _snapshot(opt, masters + model)
    flag.fill_(1.0)
    step(3)
    _assert_same_snapshot(before, _snapshot(opt, masters + model))
    # The run resumes as if the skipped step had never been offered.
    flag.fill_(0.0)
    step(4)
    twin = cls([torch.nn.Parameter(t) for t in before[1][:len(masters)]], **options)
    twin.load_state_dict(before[0])
    twin_model = [t.clone() for t in before[1][len(masters):]]
    grads = [(g * SCALE).bfloat16() for g in _grads(4, device)]
    twin_masters = [p for g in twin.param_groups for p in g["params"]]
    with twin.fused_step_inputs(FusedStepInputs(
            grads=dict(zip(twin_masters, grads)), model_params=dict(zip(twin_masters, twin_model)),
            inv_scale=torch.full((1,), 1 / SCALE, device=device))):
        twin.step()
    assert_bitwise([m.detach() for m in masters], [m.detach() for m in twin_masters])
    assert_bitwise([m.detach() for m in model], twin_model)


@pytest.mark.parametrize("device", DEVICES)
def test_grad_scaler_overflow_skips_capturable_adam_and_mp_lamb(device):
    """torch.amp.GradScaler hands grad_scale and found_inf to the optimizer: an inf grad changes nothing."""
    for make in (lambda ps: FusedAdam(ps, lr=1e-2, capturable=True),
                 lambda ps: FusedMixedPrecisionLamb(ps, lr=1e-2)):
        params = [torch.nn.Parameter(t) for t in _initial(device)]
        opt = make(params)
        scaler = torch.amp.GradScaler(device, init_scale=SCALE)

        def iteration(grads):
            # d(sum(p * g))/dp = g, times the scale.
            scaler.scale(sum((p * g).sum() for p, g in zip(params, grads))).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()

        for t in range(2):
            iteration(_grads(t, device))
        before = _snapshot(opt, params)
        grads = _grads(2, device)
        grads[1][3] = float("inf")
        iteration(grads)
        _assert_same_snapshot(before, _snapshot(opt, params))
        assert scaler.get_scale() == SCALE / 2


# ------------------------------------------------------------ construction, state, integration

def test_sgd_lr_given_only_in_param_groups():
    a, b = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2))
    opt = FusedSGD([{"params": [a], "lr": 0.5}, {"params": [b], "lr": 0.25}], momentum=0.9)
    a.grad, b.grad = torch.ones(3), torch.ones(2)
    opt.step()
    assert torch.equal(a.detach(), torch.full((3,), 0.5)) and torch.equal(b.detach(), torch.full((2,), 0.75))
    with pytest.raises(ValueError, match="lr"):
        FusedSGD([{"params": [a]}])


@pytest.mark.parametrize("cls,kwargs,match", [
    (FusedAdam, {"amsgrad": True}, "AMSGrad"),
    (FusedLAMB, {"amsgrad": True}, "AMSGrad"),
    (FusedNovoGrad, {"amsgrad": True}, "AMSGrad"),
    (FusedMixedPrecisionLamb, {"amsgrad": True}, "AMSGrad"),
    (FusedSGD, {"lr": 0.1, "nesterov": True}, "Nesterov"),
    (FusedSGD, {"lr": -1.0}, "learning rate"),
])
def test_invalid_options_raise(cls, kwargs, match):
    with pytest.raises((RuntimeError, ValueError), match=match):
        cls([torch.nn.Parameter(torch.ones(2))], **kwargs)


def test_apex_removed_step_arguments_raise():
    p = torch.nn.Parameter(torch.ones(2))
    with pytest.raises(RuntimeError, match="call step\\(\\) with no arguments"):
        FusedAdam([p]).step(scale=2.0)


def test_novograd_rejects_other_norms():
    p = torch.nn.Parameter(torch.ones(2))
    p.grad = torch.ones(2)
    with pytest.raises(RuntimeError, match="norm_type=1"):
        FusedNovoGrad([p], norm_type=1).step()


def test_zero_grad_follows_set_grad_none():
    p = torch.nn.Parameter(torch.ones(2))
    p.grad = torch.ones(2)
    FusedSGD([p], lr=0.1).zero_grad()  # Apex's FusedSGD default: zero the grads
    assert p.grad is not None and not p.grad.any()
    FusedAdam([p]).zero_grad()
    assert p.grad is None
    p.grad = torch.ones(2)
    FusedAdam([p]).zero_grad(set_to_none=False)
    assert p.grad is not None


def test_sparse_grads_raise():
    p = torch.nn.Parameter(torch.ones(4))
    p.grad = torch.ones(4).to_sparse()
    with pytest.raises(RuntimeError, match="sparse"):
        FusedAdam([p]).step()


@pytest.mark.parametrize("name", list(CONFIGS))
def test_checkpoint_resumes_bit_exactly(name):
    """state_dict / load_state_dict mid-run; fp32 state of half params stays fp32 when loaded."""
    cls, _, options = _options(name, 0)
    make = MASTER_OPTIMIZERS.get(name, cls)

    def fresh():
        params = [torch.nn.Parameter(t.bfloat16()) for t in _initial("cpu")]
        return params, make(params, **options)

    def run(params, opt, steps):
        for t in steps:
            for p, g in zip(params, _grads(t, "cpu")):
                p.grad = g.bfloat16()
            opt.step()

    params, opt = fresh()
    run(params, opt, range(3))
    saved, saved_params = copy.deepcopy(opt.state_dict()), [p.detach().clone() for p in params]
    run(params, opt, range(3, 6))
    params2, opt2 = fresh()
    with torch.no_grad():
        for p, v in zip(params2, saved_params):
            p.copy_(v)
    opt2.load_state_dict(saved)
    for p, p2 in zip(params, params2):
        for key, v in opt.state[p].items():
            if isinstance(v, torch.Tensor):
                assert opt2.state[p2][key].dtype == v.dtype, key
    run(params2, opt2, range(3, 6))
    assert_bitwise([p.detach() for p in params2], [p.detach() for p in params])


@pytest.mark.parametrize("name", list(CONFIGS))
def test_lr_scheduler_drives_the_fused_step(name):
    cls, _, options = _options(name, 0)
    p = torch.nn.Parameter(torch.ones(4))
    opt = cls([p], **options)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda epoch: 0.0 if epoch >= 1 else 1.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "scheduler.step() before optimizer.step()" warning
        p.grad = torch.ones(4)
        opt.step()
        sched.step()
        moved = p.detach().clone()
        p.grad = torch.ones(4)
        opt.step()  # lr is 0 now
    assert not torch.equal(moved, torch.ones(4))
    assert torch.equal(p.detach(), moved)


def _tiny_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


@pytest.mark.parametrize("level", ["O0", "O1", "O2", "O3"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_amp_initialize_trains_with_each_optimizer(level, name):
    cls, _, options = _options(name, 0)
    model = _tiny_model()
    opt = cls(model.parameters(), **options)
    model, opt = amp_patch.initialize(model, opt, opt_level=level, verbosity=0)
    x, y = torch.randn(32, 8), torch.randn(32, 4)
    losses = []
    for _ in range(5):
        loss = torch.nn.functional.mse_loss(model(x.to(next(model.parameters()).dtype)).float(), y)
        with amp_patch.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert all(math.isfinite(v) for v in losses) and losses[-1] < losses[0], losses
    assert all(p.dtype == torch.float32 for g in opt.param_groups for p in g["params"]) or level == "O3"


def test_adam_matches_torch_adamw():
    """FusedAdam is AdamW's math (rounded differently): close after 50 steps."""
    ours = [torch.nn.Parameter(t) for t in _initial("cpu")]
    theirs = [torch.nn.Parameter(t.detach().clone()) for t in ours]
    a = FusedAdam(ours, lr=1e-2, weight_decay=0.1)
    b = torch.optim.AdamW(theirs, lr=1e-2, weight_decay=0.1)
    for t in range(STEPS):
        for p, q, g in zip(ours, theirs, _grads(t, "cpu")):
            p.grad, q.grad = g, g.clone()
        a.step()
        b.step()
    for p, q in zip(ours, theirs):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
