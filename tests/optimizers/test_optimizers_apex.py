"""Apex's optimizer tests (tests/L0/run_optimizers), translated to amp_patch and the CPU.

What changed in translation: tensors are smaller (CPU time), ``cuda`` becomes the
device fixture, autocast and GradScaler run for the device (bf16 on the CPU),
multi-GPU cases are left out, and each test gives the reference and the fused
optimizer their own grad tensors (Apex's NovoGrad test let the reference divide
the grads it shared with the fused one). Tolerances are Apex's.
"""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import DEVICES
from torch import nn

from amp_patch.optim.fused import FusedAdagrad, FusedAdam, FusedLAMB, FusedNovoGrad, FusedSGD
from amp_patch.optim.fused import FusedMixedPrecisionLamb

@pytest.fixture(autouse=True)
def _seed():
    """Apex's setUp seeded every test (torch.manual_seed(9876)); the grads are drawn from it."""
    torch.manual_seed(9876)


MAX_ABS_DIFF = 1e-3
MAX_REL_DIFF = 1.0
ITERS = 7
NELEM = 27_801  # Apex: 278011
MULTI_SIZES = [[256, 64], [256], [256, 128], [2020, 64], [1]]  # Apex: [4096, 1024], ...


def _param_pair(tensors, ref_cls, ref_options, tst_cls, tst_options, ref_dtype=None):
    ref = [nn.Parameter(t.to(ref_dtype or t.dtype, copy=True)) for t in tensors]
    tst = [nn.Parameter(t.clone()) for t in tensors]
    return ref, tst, ref_cls(ref, **ref_options), tst_cls(tst, **tst_options)


def _gen_grad(ref, tst):
    for p, q in zip(ref, tst):
        q.grad = torch.rand_like(q)
        p.grad = q.grad.to(p.dtype, copy=True)


def _max_diff(ref, tst):
    abs_diff = rel_diff = 0.0
    for p, q in zip(ref, tst):
        q = q.to(p.dtype)
        abs_diff = max(abs_diff, (p - q).abs().max().item())
        rel_diff = max(rel_diff, ((p - q) / p).abs().max().item())
    return abs_diff, rel_diff


def _run(tensors, ref_cls, ref_options, tst_cls, tst_options, iters=ITERS, ref_dtype=None):
    ref, tst, ref_opt, tst_opt = _param_pair(tensors, ref_cls, ref_options, tst_cls, tst_options,
                                             ref_dtype)
    for _ in range(iters):
        _gen_grad(ref, tst)
        ref_opt.step()
        if ref_dtype is not None:
            _round_storage(ref_opt, tensors[0].dtype)
        tst_opt.step()
        abs_diff, rel_diff = _max_diff(ref, tst)
        assert abs_diff <= MAX_ABS_DIFF and rel_diff <= MAX_REL_DIFF
    return ref, tst, tst_opt


# ------------------------------------------------------------ test_fused_optimizer.py

ADAM = {"lr": 5e-4, "betas": (0.9, 0.999), "eps": 1e-08, "weight_decay": 0, "amsgrad": False}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_fused_adam_single_type(device, dtype):
    tensor = torch.rand(NELEM, dtype=dtype, device=device)
    if dtype == torch.float32:
        _run([tensor], torch.optim.Adam, ADAM, FusedAdam, ADAM)
        return
    # Apex ran fp16/bf16 without asserting (torch's Adam is not exact in half). FusedAdam keeps
    # its state in fp32, computes in fp32 and stores the param in half, so the reference is
    # torch's Adam in fp32 with its param rounded to half after each step. Tolerance: the half
    # type's eps relative (at most two ulps); on the CPU they agree bit for bit.
    ref, tst, ref_opt, tst_opt = _param_pair([tensor], torch.optim.Adam, ADAM, FusedAdam, ADAM,
                                             ref_dtype=torch.float32)
    for _ in range(ITERS):
        _gen_grad(ref, tst)
        ref_opt.step()
        with torch.no_grad():
            ref[0].copy_(ref[0].to(dtype))
        tst_opt.step()
        torch.testing.assert_close(tst[0], ref[0].to(dtype), rtol=torch.finfo(dtype).eps, atol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_fused_adam_multi_params(device):
    # Apex skipped this one ("until adam/adamw upstream picked"); it passes here.
    tensors = [torch.rand(s, device=device) for s in MULTI_SIZES]
    _run(tensors, torch.optim.Adam, ADAM, FusedAdam, ADAM)


@pytest.mark.parametrize("device", DEVICES)
def test_fused_adam_option(device):
    option = {"lr": 0.01, "betas": (0.6, 0.9), "eps": 3e-06, "weight_decay": 0, "amsgrad": False}
    _run([torch.rand(1, device=device)], torch.optim.Adam, option, FusedAdam, option)


@pytest.mark.parametrize("device", DEVICES)
def test_fused_adam_frozen_model(device):
    option = {"lr": 0.01, "betas": (0.6, 0.9), "eps": 3e-06, "weight_decay": 0, "amsgrad": False}
    ref, tst, ref_opt, tst_opt = _param_pair([torch.rand(1, device=device)], torch.optim.Adam, option,
                                             FusedAdam, option)
    tst_opt.add_param_group({"params": []})  # an empty group, as pipeline-parallel p-tuning makes
    for _ in range(ITERS):
        _gen_grad(ref, tst)
        ref_opt.step()
        tst_opt.step()
        assert _max_diff(ref, tst)[0] <= MAX_ABS_DIFF


ADAGRAD = {"lr": 5e-4, "eps": 1e-08, "weight_decay": 1.0e-5}


@pytest.mark.parametrize("device", DEVICES)
def test_fused_adagrad_float(device):
    _run([torch.rand(NELEM, device=device)], torch.optim.Adagrad, ADAGRAD, FusedAdagrad, ADAGRAD)


@pytest.mark.parametrize("device", DEVICES)
def test_fused_adagrad_multi_params(device):
    option = {"lr": 5e-4, "eps": 1e-08, "weight_decay": 0}
    tensors = [torch.rand(s, device=device) for s in MULTI_SIZES]
    _run(tensors, torch.optim.Adagrad, option, FusedAdagrad, option)


@pytest.mark.parametrize("device", DEVICES)
def test_fused_adagrad_option(device):
    option = {"lr": 0.01, "eps": 3e-06, "weight_decay": 0}
    _run([torch.rand(1, device=device)], torch.optim.Adagrad, option, FusedAdagrad, option)


def _half_reference_dtype(device, dtype):
    # On CUDA torch computes half optimizers in fp32 ("opmath") and stores half, as the fused
    # kernels do; on the CPU its half ops round every step to half. There the reference runs
    # in fp32 and its params and state are rounded to half after each step (_round_storage).
    return torch.float32 if device == "cpu" and dtype == torch.float16 else None


@torch.no_grad()
def _round_storage(opt, dtype):
    for group in opt.param_groups:
        for p in group["params"]:
            p.copy_(p.to(dtype))
            for v in opt.state[p].values():
                if isinstance(v, torch.Tensor) and v.dim() > 0:
                    v.copy_(v.to(dtype))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fused_sgd(device, dtype):
    option = {"lr": 0.25, "momentum": 0.125}
    # fp16 on either device: torch's SGD rounds buf * momentum to half before it adds the grad
    # (on CUDA too: its foreach ops round after each op), FusedSGD only the stored results, as
    # Apex's kernel did. Seven such roundings drift past 1e-3 (seen on an H200: 1.22e-3).
    _run([torch.rand(NELEM, dtype=dtype, device=device)], torch.optim.SGD, option, FusedSGD, option,
         ref_dtype=torch.float32 if dtype == torch.float16 else None)


# ------------------------------------------------------------ test_lamb.py

class RefLAMB(torch.optim.Optimizer):
    """Apex's test reference: LAMB with the grads clipped to a global norm of 1 and the trust ratio
    on every tensor."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.01):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self):
        grads = [p.grad for g in self.param_groups for p in g["params"] if p.grad is not None]
        global_norm = torch.linalg.vector_norm(torch.stack([g.float().norm() for g in grads]))
        max_grad_norm = 1.0
        clipped_ratio = max_grad_norm / max(global_norm.item(), max_grad_norm)
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                p.grad *= clipped_ratio
                grad = p.grad
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["m"] = torch.zeros_like(p)
                    state["v"] = torch.zeros_like(p)
                m_t, v_t = state["m"], state["v"]
                beta1, beta2 = group["betas"]
                state["step"] += 1
                m_t.mul_(beta1).add_(grad, alpha=1 - beta1)
                if any(g.dtype == torch.float16 for g in grads):
                    # Apex's reference: with fp16 grads, this step's v in fp32 (and the stored v
                    # never accumulates, which its one-step fp16 test does not notice).
                    v_t.mul_(beta2)
                    v_t = v_t.float().addcmul_(grad.float(), grad.float(), value=1 - beta2)
                else:
                    v_t.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                m_hat = m_t / (1.0 - beta1 ** state["step"])
                v_hat = v_t / (1.0 - beta2 ** state["step"])
                update = m_hat / v_hat.sqrt().add(group["eps"])
                if group["weight_decay"] != 0:
                    update.add_(p, alpha=group["weight_decay"])
                trust_ratio = 1.0
                w_norm = p.float().pow(2).sum().sqrt()
                g_norm = update.pow(2).sum().sqrt()
                if w_norm > 0 and g_norm > 0:
                    trust_ratio = (w_norm / g_norm).item()
                p.add_(update, alpha=-group["lr"] * trust_ratio)


def _lamb_run(tensors, tst_cls, lamb_option, iters=ITERS, reduced_dtype=None):
    ref = [nn.Parameter(t.clone()) for t in tensors]
    tst = [nn.Parameter(t.clone()) for t in tensors]
    ref_opt = RefLAMB(ref, **lamb_option)
    tst_opt = tst_cls(tst, use_nvlamb=True, **lamb_option)
    if reduced_dtype is not None:
        # Apex's test sets it after construction; it only has to precede the first step.
        tst_opt.reduced_precision_dtype = reduced_dtype
    for _ in range(iters):
        _gen_grad(ref, tst)
        ref_opt.step()
        tst_opt.step()
        torch.testing.assert_close(tst, ref)


LAMB_CLASSES = [FusedLAMB, FusedMixedPrecisionLamb]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("cls", LAMB_CLASSES)
@pytest.mark.parametrize("wd", [0, 0.01])
def test_lamb_float(device, cls, wd):
    lamb_option = {"lr": 5e-4, "betas": (0.9, 0.999), "eps": 1e-08, "weight_decay": wd}
    _lamb_run([torch.rand(18011, device=device)], cls, lamb_option)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype,iters", [(torch.bfloat16, 4), (torch.float16, 1)], ids=["bf16", "fp16"])
@pytest.mark.parametrize("wd", [0, 0.01])
def test_mixed_precision_lamb_half(device, dtype, iters, wd):
    lamb_option = {"lr": 5e-4, "betas": (0.9, 0.999), "eps": 1e-08, "weight_decay": wd}
    _lamb_run([torch.rand(18011, dtype=dtype, device=device)], FusedMixedPrecisionLamb, lamb_option,
              iters=iters, reduced_dtype=dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("cls", LAMB_CLASSES)
@pytest.mark.parametrize("wd", [0, 0.01])
def test_lamb_multi_params(device, cls, wd):
    lamb_option = {"lr": 5e-4, "betas": (0.9, 0.999), "eps": 1e-08, "weight_decay": wd}
    _lamb_run([torch.rand(s, device=device) for s in MULTI_SIZES], cls, lamb_option)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("cls", LAMB_CLASSES)
@pytest.mark.parametrize("wd", [0, 0.01])
def test_lamb_option(device, cls, wd):
    lamb_option = {"lr": 0.01, "betas": (0.6, 0.9), "eps": 3e-06, "weight_decay": wd}
    _lamb_run([torch.rand(1, device=device)], cls, lamb_option)


# ------------------------------------------------------------ test_fused_novograd.py

class RefNovograd(torch.optim.Optimizer):
    """Apex's test reference (Novograd with the second moment as a squared norm)."""

    def __init__(self, params, lr=1e-3, betas=(0.95, 0), eps=1e-8, weight_decay=0,
                 grad_averaging=False, amsgrad=False):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                                      grad_averaging=grad_averaging))

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad = p.grad.clone()
                state = self.state[p]
                if not state:
                    state["exp_avg"] = torch.zeros_like(p)
                    state["exp_avg_sq"] = torch.zeros([], device=p.device)
                exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
                beta1, beta2 = group["betas"]
                norm = torch.sum(torch.pow(grad.float(), 2))
                if exp_avg_sq == 0:
                    exp_avg_sq.copy_(norm)
                else:
                    exp_avg_sq.mul_(beta2).add_(norm, alpha=1 - beta2)
                grad.div_(exp_avg_sq.sqrt().add_(group["eps"]))
                if group["weight_decay"] != 0:
                    grad.add_(p, alpha=group["weight_decay"])
                if group["grad_averaging"]:
                    grad.mul_(1 - beta1)
                exp_avg.mul_(beta1).add_(grad)
                p.add_(exp_avg, alpha=-group["lr"])


NOVOGRAD_REF = {"lr": 1e-3, "betas": (0.95, 0), "eps": 1e-8, "weight_decay": 0,
                "grad_averaging": False, "amsgrad": False}
NOVOGRAD_TST = {**NOVOGRAD_REF, "bias_correction": False, "reg_inside_moment": True, "norm_type": 2,
                "init_zero": False, "set_grad_none": True}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fused_novograd_single_type(device, dtype):
    _run([torch.rand(NELEM, dtype=dtype, device=device)], RefNovograd, NOVOGRAD_REF, FusedNovoGrad,
         NOVOGRAD_TST, ref_dtype=_half_reference_dtype(device, dtype))


@pytest.mark.parametrize("device", DEVICES)
def test_fused_novograd_multi_params(device):
    tensors = [torch.rand(s, device=device) for s in MULTI_SIZES]
    _run(tensors, RefNovograd, NOVOGRAD_REF, FusedNovoGrad, NOVOGRAD_TST)


# ------------------------------------------------------------ test_adam.py

class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 6, 5)
        self.conv2 = nn.Conv2d(6, 16, 5)
        self.fc1 = nn.Linear(256, 120)
        self.fc2 = nn.Linear(120, 84)
        self.fc3 = nn.Linear(84, 10)

    def forward(self, x):
        y = torch.max_pool2d(torch.relu(self.conv1(x)), 2)
        y = torch.max_pool2d(torch.relu(self.conv2(y)), 2)
        y = y.reshape(y.shape[0], -1)
        y = torch.relu(self.fc1(y))
        y = torch.relu(self.fc2(y))
        return torch.relu(self.fc3(y))


ADAM_ITERS = 5  # Apex: 100
LR = 1e-5


def _adam_models(device):
    torch.manual_seed(0)
    ref = Model().to(device)
    dut = Model().to(device)
    dut.load_state_dict(copy.deepcopy(ref.state_dict()))
    return ref, dut


def _compare_modules(ref, dut, grads=True):
    for m, m_ in zip(ref.modules(), dut.modules()):
        if isinstance(m, (nn.Conv2d, nn.Linear)):
            torch.testing.assert_close(m.weight, m_.weight.float(), atol=1e-3, rtol=1e-3, equal_nan=True)
            if grads:
                torch.testing.assert_close(m.weight.grad, m_.weight.grad.float(), atol=1e-3, rtol=1e-3,
                                           equal_nan=True)


def _inputs(device):
    x = torch.rand([16, 1, 28, 28], device=device).to(memory_format=torch.channels_last)  # Apex: 32
    return x, torch.rand([16, 10], device=device)


@pytest.mark.parametrize("device", DEVICES)
def test_adam_native(device):
    ref, dut = _adam_models(device)
    opt = torch.optim.Adam(ref.parameters(), lr=LR)
    opt_ = FusedAdam(dut.parameters(), lr=LR, capturable=False)
    for _ in range(ADAM_ITERS):
        x, gt = _inputs(device)
        ((gt - ref(x)) ** 2).mean().backward()
        opt.step()
        ((gt - dut(x)) ** 2).mean().backward()
        opt_.step()
        _compare_modules(ref, dut)
        opt.zero_grad()
        opt_.zero_grad()
        dut.load_state_dict(copy.deepcopy(ref.state_dict()))


def _autocast_dtype(device):
    return torch.float16 if device == "cuda" else torch.bfloat16


def _grad_scaler_run(device, ref, dut, opt_, grads_stay_scaled):
    """Apex's GradScaler loop: torch's Adam and the fused one under autocast, compared each step.

    When the fused optimizer takes the scaler's flags, ``.grad`` stays scaled (Apex's kernel
    rewrote it unscaled): the grads are unscaled before the comparison.
    """
    half = _autocast_dtype(device)
    opt = torch.optim.Adam(ref.parameters(), lr=LR)
    scaler = torch.amp.GradScaler(device)
    scaler_ = torch.amp.GradScaler(device)
    for _ in range(ADAM_ITERS):
        x, gt = _inputs(device)
        for model, optimizer, grad_scaler in ((ref, opt, scaler), (dut, opt_, scaler_)):
            with torch.autocast(device, dtype=half):
                loss = ((gt - model(x)) ** 2).mean()
            grad_scaler.scale(loss).backward()
            scale = grad_scaler.get_scale()
            grad_scaler.step(optimizer)
            grad_scaler.update()
        if grads_stay_scaled:
            for p in dut.parameters():
                p.grad.div_(scale)
        _compare_modules(ref, dut)
        opt.zero_grad()
        opt_.zero_grad()
        dut.load_state_dict(copy.deepcopy(ref.state_dict()))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("capturable", [False, True])
def test_adam_grad_scaler(device, capturable):
    """Apex's testGradScaler and testGradScalerCapturable."""
    ref, dut = _adam_models(device)
    opt_ = FusedAdam(dut.parameters(), lr=LR, capturable=capturable)
    _grad_scaler_run(device, ref, dut, opt_, grads_stay_scaled=capturable)


@pytest.mark.parametrize("device", DEVICES)
def test_adam_grad_scaler_capturable_master(device):
    """Apex's testGradScalerCapturableMaster: the conv layers in half, fp32 masters inside FusedAdam."""
    ref, dut = _adam_models(device)
    for m in dut.modules():
        if isinstance(m, nn.Conv2d):
            m.to(_autocast_dtype(device))
    opt_ = FusedAdam(dut.parameters(), lr=LR, capturable=True, master_weights=True)
    _grad_scaler_run(device, ref, dut, opt_, grads_stay_scaled=True)


@pytest.mark.parametrize("device", DEVICES)
def test_capturable_adam_with_unscale_before_step(device):
    """scaler.unscale_(opt) for clipping, then scaler.step(opt): the grads are not unscaled twice."""
    results = []
    for unscale_first in (False, True):
        ref, dut = _adam_models(device)
        opt_ = FusedAdam(dut.parameters(), lr=1e-3, capturable=True)
        scaler_ = torch.amp.GradScaler(device, init_scale=256.0)
        torch.manual_seed(1)
        x, gt = _inputs(device)
        scaler_.scale(((gt - dut(x)) ** 2).mean()).backward()
        if unscale_first:
            scaler_.unscale_(opt_)
        scaler_.step(opt_)
        scaler_.update()
        results.append([p.detach().clone() for p in dut.parameters()])
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
