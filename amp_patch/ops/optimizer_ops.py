"""The fused optimizer ops (behind :mod:`amp_patch.optim.fused`): schemas, reference bodies, wrappers.

Fused optimizer ops (amp_patch.optim.fused). Each takes the lists of one
optimizer step, updates params and state in place, and never syncs:

- `noop` (optional, one-element float32 or int32: amp_patch's found_inf or
  Apex's noop buffer): when non-zero the op writes nothing at all, so a step
  whose overflow was found earlier is skipped whole, never half-applied.
- `inv_scale` (optional, one-element float32): grads are read as
  ``float(grad) * inv_scale``, so half grads of a scaled loss need no
  separate unscale pass and are left untouched.
- `model_params` (may be empty): after the update each params[i] (an fp32
  master) is also written, rounded, into model_params[i] (the half model
  param), in the same pass.

Arithmetic is fp32 in the order of csrc/optim_math.h, one rounding per
operation; hyper-parameters are rounded to fp32 once and bias corrections are
1 - beta**step in float64 rounded once, as Apex's host code does.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Sequence

import torch
from torch import Tensor

from amp_patch.ops import optim_reference as ref
from amp_patch.ops._library import _check_rows, _ops, register

__all__ = [
    "adam_bias_corrections",
    "adam_device_step_",
    "fp32_betas",
    "multi_tensor_adam_",
    "multi_tensor_sgd_",
    "multi_tensor_adagrad_",
    "multi_tensor_novograd_",
    "multi_tensor_lamb_stage1_",
    "multi_tensor_lamb_stage2_",
]

_OPTIM_SCHEMAS = {
    "multi_tensor_adam_": (
        "multi_tensor_adam_(Tensor[] grads, Tensor(a!)[] params, Tensor(b!)[] exp_avgs, "
        "Tensor(c!)[] exp_avg_sqs, Tensor(d!)[] model_params, Tensor? noop, Tensor? inv_scale, "
        "float lr, float beta1, float beta2, float eps, float weight_decay, int step, "
        "bool adam_w_mode, bool bias_correction, Tensor? bias_corrections=None) -> ()"
    ),
    "multi_tensor_sgd_": (
        "multi_tensor_sgd_(Tensor[] grads, Tensor(a!)[] params, Tensor(b!)[] momentum_buffers, "
        "Tensor(c!)[] model_params, Tensor? noop, Tensor? inv_scale, float lr, float weight_decay, "
        "float momentum, float dampening, bool nesterov, bool first_run, bool wd_after_momentum) -> ()"
    ),
    "multi_tensor_adagrad_": (
        "multi_tensor_adagrad_(Tensor[] grads, Tensor(a!)[] params, Tensor(b!)[] state_sums, "
        "Tensor(c!)[] model_params, Tensor? noop, Tensor? inv_scale, float lr, float eps, "
        "float weight_decay, bool adagrad_w_mode) -> ()"
    ),
    "multi_tensor_novograd_": (
        "multi_tensor_novograd_(Tensor[] grads, Tensor(a!)[] params, Tensor(b!)[] exp_avgs, "
        "Tensor grad_norms, Tensor(c!)[] model_params, Tensor? noop, Tensor? inv_scale, float lr, "
        "float beta1, float beta2, float eps, float weight_decay, int step, bool bias_correction, "
        "bool grad_averaging, bool reg_inside_moment) -> ()"
    ),
    "multi_tensor_lamb_stage1_": (
        "multi_tensor_lamb_stage1_(Tensor[] grads, Tensor[] params, Tensor(a!)[] exp_avgs, "
        "Tensor(b!)[] exp_avg_sqs, Tensor? noop, Tensor? inv_scale, Tensor global_grad_norm, "
        "float max_grad_norm, float beta1, float beta2, float eps, float weight_decay, int step, "
        "bool bias_correction, bool grad_averaging, bool adam_w_mode, bool use_nvlamb) "
        "-> (Tensor param_norms, Tensor update_norms)"
    ),
    "multi_tensor_lamb_stage2_": (
        "multi_tensor_lamb_stage2_(Tensor(a!)[] params, Tensor[] exp_avgs, Tensor[] exp_avg_sqs, "
        "Tensor param_norms, Tensor update_norms, Tensor(b!)[] model_params, Tensor? noop, float lr, "
        "float beta1, float beta2, float eps, float weight_decay, int step, bool bias_correction, "
        "bool adam_w_mode, bool use_nvlamb) -> ()"
    ),
    "adam_device_step_": (
        "adam_device_step_(Tensor(a!) step, Tensor found_inf, Tensor betas, bool bias_correction) "
        "-> Tensor"
    ),
}


def _out(model_params: Sequence[Tensor], i: int, p: Tensor) -> list[tuple[Tensor, Tensor]]:
    return [(model_params[i], p)] if model_params else []


def _adam_ref(grads, params, exp_avgs, exp_avg_sqs, model_params, noop, inv_scale, lr, beta1,
              beta2, eps, weight_decay, step, adam_w_mode, bias_correction,
              bias_corrections=None) -> None:
    _check_rows("multi_tensor_adam_", grads=grads, params=params, exp_avgs=exp_avgs,
                exp_avg_sqs=exp_avg_sqs, model_params=model_params or None)
    skip = ref.skip_mask(noop)
    b1, b2, c1, c2, bc1, bc2, lr, eps, wd = ref.adam_constants(
        beta1, beta2, lr, eps, weight_decay, step, bias_correction)
    if bias_corrections is not None:
        _check_bias_corrections(bias_corrections, params)
        bc1, bc2 = bias_corrections.tolist()  # the reference reads them on the host
    for i, grad in enumerate(grads):
        if grad.numel() == 0:
            continue
        p = params[i].float()
        m, v, u = ref.adam_moments(ref.grad32(grad, inv_scale), p, exp_avgs[i], exp_avg_sqs[i],
                                   b1, b2, c1, c2, bc1, bc2, eps, wd, adam_w_mode)
        p = p - lr * u
        ref.commit(skip, (params[i], p), (exp_avgs[i], m), (exp_avg_sqs[i], v),
                   *_out(model_params, i, p))


def _check_bias_corrections(bc: Tensor, params: Sequence[Tensor]) -> None:
    if bc.dtype != torch.float32 or bc.numel() != 2:
        raise RuntimeError("amp_patch::multi_tensor_adam_: bias_corrections must be a contiguous "
                           f"float32 tensor of 2 elements (bc1, bc2), got {bc.dtype} with "
                           f"{bc.numel()} elements")
    if params and params[0].device != bc.device:
        raise RuntimeError(f"amp_patch::multi_tensor_adam_: bias_corrections is on {bc.device} "
                           f"but params are on {params[0].device}")


def adam_bias_corrections(beta1: float, beta2: float, step: Tensor, enabled: bool,
                          betas: Tensor | None = None) -> Tensor:
    """Adam's two bias corrections ``1 - beta**step`` from a step counter kept on the device.

    Computed as the kernels compute them from a host step (float64, the betas
    rounded to fp32 first, then rounded once to fp32), with tensor ops on the
    counter's device, so that nothing is read back to the host.

    Args:
        beta1 (float): the first moment's decay.
        beta2 (float): the second moment's decay.
        step (Tensor): the step number (from 1), one element, any dtype.
        enabled (bool): False gives ``(1, 1)``.
        betas (Tensor, optional): ``(beta1, beta2)`` rounded to fp32, as float64 on
            ``step``'s device, made once by the caller: then nothing is copied from the
            host, and the call can be captured in a CUDA graph. Default: made here.

    Returns:
        Tensor: float32, ``(bc1, bc2)``, on ``step``'s device.

    Example::

        >>> adam_bias_corrections(0.9, 0.999, torch.tensor([1]), True)
        tensor([0.1000, 0.0010])
    """
    if not enabled:
        return torch.ones(2, dtype=torch.float32, device=step.device)
    if betas is None:
        betas = fp32_betas(beta1, beta2, step.device)
    # pow takes the counter as it is (float64 base: the power is float64), and broadcasts it:
    # three ops, the fewest for a step that may run captured or launch-bound.
    exponent = step if step.dim() <= 1 else step.reshape(1)
    return torch.rsub(betas.pow(exponent), 1.0).to(torch.float32)


def _adam_device_step_ref(step: Tensor, found_inf: Tensor, betas: Tensor,
                          bias_correction: bool) -> Tensor:
    if step.numel() != 1 or found_inf.numel() != 1:
        raise RuntimeError("amp_patch::adam_device_step_: step and found_inf must have one element "
                           f"each, got {step.numel()} and {found_inf.numel()}")
    if betas.dtype != torch.float64 or betas.numel() != 2:
        raise RuntimeError("amp_patch::adam_device_step_: betas must be float64 with 2 elements, "
                           f"got {betas.dtype} with {betas.numel()}")
    step.add_(found_inf.reshape(step.shape) == 0)
    return adam_bias_corrections(0.0, 0.0, step, bias_correction, betas)


def _adam_device_step_fake(step: Tensor, found_inf: Tensor, betas: Tensor,
                           bias_correction: bool) -> Tensor:
    return torch.empty(2, dtype=torch.float32, device=step.device)


def adam_device_step_(step: Tensor, found_inf: Tensor, betas: Tensor,
                      bias_correction: bool) -> Tensor:
    """Advance a step counter kept on the device unless ``found_inf`` is set, and return Adam's
    bias corrections of the new count: one op, nothing read back to the host.

    The same as ``step.add_(found_inf == 0)`` followed by :func:`adam_bias_corrections`
    (the reference body), in one kernel on the CPU and on CUDA.

    Args:
        step (Tensor): the counter, one element of any real dtype; incremented in place.
        found_inf (Tensor): one-element float32 flag on ``step``'s device; non-zero (NaN
            included) leaves the counter as it is.
        betas (Tensor): ``(beta1, beta2)`` rounded to fp32, as float64
            (:func:`fp32_betas`), on ``step``'s device.
        bias_correction (bool): False gives ``(1, 1)``.

    Returns:
        Tensor: float32, ``(bc1, bc2)``, on ``step``'s device.

    Example::

        >>> step = torch.zeros(1, dtype=torch.int32)
        >>> adam_device_step_(step, torch.zeros(1), fp32_betas(0.9, 0.999, step.device), True)
        tensor([0.1000, 0.0010])
        >>> adam_device_step_(step, torch.ones(1), fp32_betas(0.9, 0.999, step.device), True), step
        (tensor([0.1000, 0.0010]), tensor([1], dtype=torch.int32))
    """
    return _ops.adam_device_step_(step, found_inf, betas, bias_correction)


def fp32_betas(beta1: float, beta2: float, device: torch.device) -> Tensor:
    """``(beta1, beta2)`` rounded to fp32, as float64 on ``device`` (for
    :func:`adam_bias_corrections`); rounded by the tensor itself, with no host read.

    Example::

        >>> fp32_betas(0.9, 0.999, torch.device("cpu")).dtype
        torch.float64
    """
    return torch.tensor([beta1, beta2], dtype=torch.float32).double().to(device, non_blocking=True)


def _sgd_ref(grads, params, momentum_buffers, model_params, noop, inv_scale, lr, weight_decay,
             momentum, dampening, nesterov, first_run, wd_after_momentum) -> None:
    ref.check_sgd_lists("multi_tensor_sgd_", grads, params, momentum_buffers, model_params,
                        momentum)
    skip = ref.skip_mask(noop)
    lr, wd, mu = ref.f32(lr), ref.f32(weight_decay), ref.f32(momentum)
    c_damp = ref.one_minus(ref.f32(dampening))
    for i, grad in enumerate(grads):
        if grad.numel() == 0:
            continue
        def old(i: int = i) -> Tensor:
            return momentum_buffers[i].float()

        p, buf = ref.sgd_update(ref.grad32(grad, inv_scale), params[i].float(), old, lr, wd, mu,
                                c_damp, nesterov, first_run, wd_after_momentum)
        state = [] if buf is None else [(momentum_buffers[i], buf)]
        ref.commit(skip, (params[i], p), *state, *_out(model_params, i, p))


def _adagrad_ref(grads, params, state_sums, model_params, noop, inv_scale, lr, eps, weight_decay,
                 adagrad_w_mode) -> None:
    _check_rows("multi_tensor_adagrad_", grads=grads, params=params, state_sums=state_sums,
                model_params=model_params or None)
    skip = ref.skip_mask(noop)
    lr, eps, wd = ref.f32(lr), ref.f32(eps), ref.f32(weight_decay)
    for i, grad in enumerate(grads):
        if grad.numel() == 0:
            continue
        g, p = ref.grad32(grad, inv_scale), params[i].float()
        if not adagrad_w_mode and wd != 0.0:
            g = g + wd * p
        h = state_sums[i].float() + g * g
        update = g / (ref.sqrt_rn(h) + eps)
        if adagrad_w_mode and wd != 0.0:
            update = update + wd * p
        p = p - lr * update
        ref.commit(skip, (params[i], p), (state_sums[i], h), *_out(model_params, i, p))


def _novograd_ref(grads, params, exp_avgs, grad_norms, model_params, noop, inv_scale, lr, beta1,
                  beta2, eps, weight_decay, step, bias_correction, grad_averaging,
                  reg_inside_moment) -> None:
    op = "multi_tensor_novograd_"
    _check_rows(op, grads=grads, params=params, exp_avgs=exp_avgs, model_params=model_params or None)
    if grad_norms.shape != (len(grads),):
        raise RuntimeError(f"amp_patch::{op}: grad_norms must have one element per tensor "
                           f"({len(grads)}), got shape {tuple(grad_norms.shape)}")
    skip = ref.skip_mask(noop)
    b1, lr, eps, wd = ref.f32(beta1), ref.f32(lr), ref.f32(eps), ref.f32(weight_decay)
    b3 = ref.one_minus(b1) if grad_averaging else 1.0
    bc1 = ref.bias_corr(b1, step, bias_correction)
    # The second moment is a norm, so its correction is a square root.
    bc2 = ref.f32(math.sqrt(1.0 - ref.f32(beta2) ** step)) if bias_correction else 1.0
    for i, grad in enumerate(grads):
        if grad.numel() == 0:
            continue
        denom = ref.div_rn(grad_norms[i].float(), bc2) + eps
        g, p = ref.grad32(grad, inv_scale), params[i].float()
        if reg_inside_moment:
            g = g / denom
            if wd != 0.0:
                g = g + wd * p
            m = b1 * exp_avgs[i].float() + b3 * g
            p = p - lr * ref.div_rn(m, bc1)
        else:
            m = b1 * exp_avgs[i].float() + b3 * g
            update = ref.div_rn(m, bc1) / denom
            if wd != 0.0:
                update = update + wd * p
            p = p - lr * update
        ref.commit(skip, (params[i], p), (exp_avgs[i], m), *_out(model_params, i, p))


def _lamb_stage1_ref(grads, params, exp_avgs, exp_avg_sqs, noop, inv_scale, global_grad_norm,
                     max_grad_norm, beta1, beta2, eps, weight_decay, step, bias_correction,
                     grad_averaging, adam_w_mode, use_nvlamb) -> tuple[Tensor, Tensor]:
    _check_rows("multi_tensor_lamb_stage1_", grads=grads, params=params, exp_avgs=exp_avgs,
                exp_avg_sqs=exp_avg_sqs)
    skip = ref.skip_mask(noop)
    b1, b2, eps, wd = ref.f32(beta1), ref.f32(beta2), ref.f32(eps), ref.f32(weight_decay)
    b3 = ref.one_minus(b1) if grad_averaging else 1.0
    c2 = ref.one_minus(b2)
    bc1 = ref.bias_corr(b1, step, bias_correction)
    bc2 = ref.bias_corr(b2, step, bias_correction)
    norms_wanted = ref.lamb_uses_ratio(weight_decay, use_nvlamb)
    device = grads[0].device if grads else torch.device("cpu")
    norm = ref.grad32(global_grad_norm.reshape(()), inv_scale)
    max_norm = ref.f32(max_grad_norm)
    clip = torch.ones((), device=norm.device)
    if max_norm > 0.0:
        clip = torch.where(norm > max_norm, ref.div_rn(norm, max_norm), clip)
    sums = torch.zeros(2, len(grads), dtype=torch.float64, device=device)
    for i, grad in enumerate(grads):
        if grad.numel() == 0:
            continue
        p = params[i].float() if norms_wanted else None
        m, v, u = ref.adam_moments(ref.grad32(grad, inv_scale) / clip, p, exp_avgs[i],
                                   exp_avg_sqs[i], b1, b2, b3, c2, bc1, bc2, eps, wd, adam_w_mode)
        if norms_wanted:
            sums[0, i] = p.double().square().sum()  # type: ignore[union-attr]  # norms_wanted
        sums[1, i] = u.double().square().sum()
        ref.commit(skip, (exp_avgs[i], m), (exp_avg_sqs[i], v))
    norms = sums.sqrt().float()
    if skip is not None:
        norms = torch.where(skip, torch.zeros_like(norms), norms)
    return norms[0].clone(), norms[1].clone()


def _lamb_stage2_ref(params, exp_avgs, exp_avg_sqs, param_norms, update_norms, model_params, noop,
                     lr, beta1, beta2, eps, weight_decay, step, bias_correction, adam_w_mode,
                     use_nvlamb) -> None:
    op = "multi_tensor_lamb_stage2_"
    _check_rows(op, params=params, exp_avgs=exp_avgs, exp_avg_sqs=exp_avg_sqs,
                model_params=model_params or None)
    for name, t in (("param_norms", param_norms), ("update_norms", update_norms)):
        if t.shape != (len(params),):
            raise RuntimeError(f"amp_patch::{op}: {name} must have one element per tensor "
                               f"({len(params)}), got shape {tuple(t.shape)}")
    skip = ref.skip_mask(noop)
    b1, b2, lr, eps = ref.f32(beta1), ref.f32(beta2), ref.f32(lr), ref.f32(eps)
    wd = ref.f32(weight_decay)
    bc1 = ref.bias_corr(b1, step, bias_correction)
    bc2 = ref.bias_corr(b2, step, bias_correction)
    for i, param in enumerate(params):
        if param.numel() == 0:
            continue
        ratio = torch.full((), lr, dtype=torch.float32, device=param.device)
        if ref.lamb_uses_ratio(weight_decay, use_nvlamb):
            pn, un = param_norms[i], update_norms[i]
            ratio = torch.where((pn != 0) & (un != 0), lr * (pn / un), ratio)
        p = param.float()
        u = ref.adam_direction(exp_avgs[i].float(), exp_avg_sqs[i].float(), p, bc1, bc2, eps, wd,
                               adam_w_mode)
        p = p - ratio * u
        ref.commit(skip, (params[i], p), *_out(model_params, i, p))


_OPTIM_REFERENCE: dict[str, Callable[..., Any]] = {
    "multi_tensor_adam_": _adam_ref,
    "multi_tensor_sgd_": _sgd_ref,
    "multi_tensor_adagrad_": _adagrad_ref,
    "multi_tensor_novograd_": _novograd_ref,
    "multi_tensor_lamb_stage1_": _lamb_stage1_ref,
    "multi_tensor_lamb_stage2_": _lamb_stage2_ref,
    "adam_device_step_": _adam_device_step_ref,
}
_OPTIM_FAKES: dict[str, Callable[..., Any]] = {"multi_tensor_lamb_stage1_": ref.lamb_norms_fake,
                                               "adam_device_step_": _adam_device_step_fake}
register(_OPTIM_SCHEMAS, _OPTIM_REFERENCE, _OPTIM_FAKES)


def multi_tensor_adam_(
    grads: list[Tensor], params: list[Tensor], exp_avgs: list[Tensor], exp_avg_sqs: list[Tensor],
    model_params: list[Tensor], noop: Tensor | None, inv_scale: Tensor | None, *, lr: float,
    beta1: float, beta2: float, eps: float, weight_decay: float, step: int, adam_w_mode: bool = True,
    bias_correction: bool = True, bias_corrections: Tensor | None = None,
) -> None:
    """One Adam / AdamW step over lists of tensors, in one pass (Apex's ``multi_tensor_adam``).

    Per element, in fp32: ``g = grad * inv_scale`` (plus ``weight_decay * p`` in
    L2 mode), ``m = beta1*m + (1-beta1)*g``, ``v = beta2*v + (1-beta2)*g*g``,
    ``update = (m/bc1) / (sqrt(v/bc2) + eps)`` (plus ``weight_decay * p`` in
    AdamW mode), ``p = p - lr*update``, with ``bc = 1 - beta**step``.

    Args:
        grads (list of Tensor): gradients (fp32, fp16 or bf16), read only.
        params (list of Tensor): parameters or fp32 masters, updated in place.
        exp_avgs (list of Tensor): first moments, updated in place.
        exp_avg_sqs (list of Tensor): second moments, updated in place.
        model_params (list of Tensor): empty, or one tensor per param that receives
            the updated param rounded to its dtype (the half model copy).
        noop (Tensor, optional): one-element flag; non-zero skips the whole step.
        inv_scale (Tensor, optional): one-element fp32 multiplier of the grads.
        lr (float): learning rate.
        beta1 (float): first-moment decay.
        beta2 (float): second-moment decay.
        eps (float): added to the denominator.
        weight_decay (float): weight decay.
        step (int): the step number, from 1, for the bias corrections.
        adam_w_mode (bool, optional): decoupled weight decay (AdamW) rather than L2.
            Default: True.
        bias_correction (bool, optional): Default: True.
        bias_corrections (Tensor, optional): ``(bc1, bc2)`` as a float32 tensor on the
            params' device, in place of those of ``step``
            (:func:`adam_bias_corrections` of a step counter kept on the device):
            the kernels read them on the device, so a step whose counter must not
            be read on the host (a skip decided on the device) needs no sync.
            Default: None.

    Example::

        >>> ops.multi_tensor_adam_(half_grads, masters, m, v, half_params, found_inf, inv_scale,
        ...                        lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, step=1)
    """
    _ops.multi_tensor_adam_(grads, params, exp_avgs, exp_avg_sqs, model_params, noop, inv_scale,
                            lr, beta1, beta2, eps, weight_decay, step, adam_w_mode, bias_correction,
                            bias_corrections)


def multi_tensor_sgd_(
    grads: list[Tensor], params: list[Tensor], momentum_buffers: list[Tensor],
    model_params: list[Tensor], noop: Tensor | None, inv_scale: Tensor | None, *, lr: float,
    weight_decay: float = 0.0, momentum: float = 0.0, dampening: float = 0.0,
    nesterov: bool = False, first_run: bool = False, wd_after_momentum: bool = False,
) -> None:
    """One SGD step over lists of tensors, with Apex's momentum rule (``multi_tensor_sgd``).

    ``g = grad * inv_scale`` (+ ``weight_decay * p`` before or after momentum);
    with momentum, ``buf = g`` on the first run, else ``momentum*buf + (1-dampening)*g``,
    then ``g = buf`` (Nesterov: ``g + momentum*buf``); ``p = p - lr*g``.

    Args:
        grads (list of Tensor): gradients, read only.
        params (list of Tensor): parameters or fp32 masters, updated in place.
        momentum_buffers (list of Tensor): one per param when ``momentum != 0``
            (ignored otherwise; may be empty).
        model_params (list of Tensor): empty, or the half copies to write.
        noop (Tensor, optional): non-zero skips the whole step.
        inv_scale (Tensor, optional): one-element fp32 multiplier of the grads.
        lr (float): learning rate.
        weight_decay (float, optional): Default: 0.
        momentum (float, optional): Default: 0.
        dampening (float, optional): Default: 0.
        nesterov (bool, optional): Default: False.
        first_run (bool, optional): the buffers are new: set them to the grad.
            Default: False.
        wd_after_momentum (bool, optional): add weight decay after the momentum.
            Default: False.

    Example::

        >>> params = [torch.ones(3), torch.ones(2)]
        >>> grads = [torch.full((3,), 0.5), torch.full((2,), 0.5)]
        >>> bufs = [torch.zeros(3), torch.zeros(2)]
        >>> ops.multi_tensor_sgd_(grads, params, bufs, [], None, None, lr=0.1, momentum=0.9)
        >>> params[0]
        tensor([0.9500, 0.9500, 0.9500])
    """
    _ops.multi_tensor_sgd_(grads, params, momentum_buffers, model_params, noop, inv_scale, lr,
                           weight_decay, momentum, dampening, nesterov, first_run, wd_after_momentum)


def multi_tensor_adagrad_(
    grads: list[Tensor], params: list[Tensor], state_sums: list[Tensor], model_params: list[Tensor],
    noop: Tensor | None, inv_scale: Tensor | None, *, lr: float, eps: float,
    weight_decay: float = 0.0, adagrad_w_mode: bool = False,
) -> None:
    """One Adagrad step over lists of tensors (Apex's ``multi_tensor_adagrad``).

    ``g = grad * inv_scale`` (+ ``weight_decay * p`` in L2 mode), ``sum += g*g``,
    ``p = p - lr * (g / (sqrt(sum) + eps) [+ weight_decay * p in w mode])``.

    Args:
        grads (list of Tensor): gradients, read only.
        params (list of Tensor): parameters or fp32 masters, updated in place.
        state_sums (list of Tensor): the sums of squared grads, updated in place.
        model_params (list of Tensor): empty, or the half copies to write.
        noop (Tensor, optional): non-zero skips the whole step.
        inv_scale (Tensor, optional): one-element fp32 multiplier of the grads.
        lr (float): learning rate.
        eps (float): added to the denominator.
        weight_decay (float, optional): Default: 0.
        adagrad_w_mode (bool, optional): decoupled weight decay. Default: False.

    Example::

        >>> ops.multi_tensor_adagrad_(grads, params, sums, [], None, None, lr=1e-2, eps=1e-10)
    """
    _ops.multi_tensor_adagrad_(grads, params, state_sums, model_params, noop, inv_scale, lr, eps,
                               weight_decay, adagrad_w_mode)


def multi_tensor_novograd_(
    grads: list[Tensor], params: list[Tensor], exp_avgs: list[Tensor], grad_norms: Tensor,
    model_params: list[Tensor], noop: Tensor | None, inv_scale: Tensor | None, *, lr: float,
    beta1: float, beta2: float, eps: float, weight_decay: float, step: int,
    bias_correction: bool = True, grad_averaging: bool = True, reg_inside_moment: bool = False,
) -> None:
    """NovoGrad's element step over lists of tensors (Apex's ``multi_tensor_novograd``).

    ``grad_norms[i]`` is tensor i's second moment: its blended grad norm, which
    the caller updates first (:class:`amp_patch.optim.fused.FusedNovoGrad` does).
    With ``denom = grad_norms[i] / sqrt(1 - beta2**step) + eps``: by default
    ``m = beta1*m + beta3*g``, ``p = p - lr * ((m/bc1)/denom + weight_decay*p)``;
    with ``reg_inside_moment`` the grad is normalised (and decayed) before the
    moment: ``m = beta1*m + beta3*(g/denom + weight_decay*p)``, ``p = p - lr*m/bc1``.
    ``beta3`` is ``1 - beta1`` with ``grad_averaging``, else 1.

    Args:
        grads (list of Tensor): gradients, read only.
        params (list of Tensor): parameters or fp32 masters, updated in place.
        exp_avgs (list of Tensor): first moments, updated in place.
        grad_norms (Tensor): 1-D fp32, one blended norm per tensor.
        model_params (list of Tensor): empty, or the half copies to write.
        noop (Tensor, optional): non-zero skips the whole step.
        inv_scale (Tensor, optional): one-element fp32 multiplier of the grads.
        lr (float): learning rate.
        beta1 (float): first-moment decay.
        beta2 (float): norm decay (for the bias correction).
        eps (float): added to the denominator.
        weight_decay (float): weight decay.
        step (int): the step number, from 1.
        bias_correction (bool, optional): Default: True.
        grad_averaging (bool, optional): Default: True.
        reg_inside_moment (bool, optional): Default: False.

    Example::

        >>> ops.multi_tensor_novograd_(grads, params, m, norms, [], None, None, lr=1e-3,
        ...                            beta1=0.95, beta2=0.98, eps=1e-8, weight_decay=0.0, step=1)
    """
    _ops.multi_tensor_novograd_(grads, params, exp_avgs, grad_norms, model_params, noop, inv_scale,
                                lr, beta1, beta2, eps, weight_decay, step, bias_correction,
                                grad_averaging, reg_inside_moment)


def multi_tensor_lamb_stage1_(
    grads: list[Tensor], params: list[Tensor], exp_avgs: list[Tensor], exp_avg_sqs: list[Tensor],
    noop: Tensor | None, inv_scale: Tensor | None, global_grad_norm: Tensor, *,
    max_grad_norm: float, beta1: float, beta2: float, eps: float, weight_decay: float, step: int,
    bias_correction: bool = True, grad_averaging: bool = True, adam_w_mode: bool = True,
    use_nvlamb: bool = False,
) -> tuple[Tensor, Tensor]:
    """LAMB's first stage: the moments, and the norms that the trust ratio needs.

    ``g = grad * inv_scale / clip``, where ``clip = n / max_grad_norm`` when the
    unscaled global norm ``n = global_grad_norm * inv_scale`` exceeds
    ``max_grad_norm > 0``, else 1. Then (L2 mode adds ``weight_decay * p`` to g)
    ``m = m*beta1 + beta3*g``, ``v = v*beta2 + (1-beta2)*g*g``, and the update
    direction ``u = (m/bc1) / (sqrt(v/bc2) + eps)`` (+ ``weight_decay * p`` in
    AdamW mode). ``u`` is not stored: stage 2 recomputes it from ``m`` and ``v``.

    Args:
        grads (list of Tensor): gradients, read only.
        params (list of Tensor): parameters or fp32 masters, read only (read
            only with weight decay or ``use_nvlamb``).
        exp_avgs (list of Tensor): first moments, updated in place.
        exp_avg_sqs (list of Tensor): second moments, updated in place.
        noop (Tensor, optional): non-zero skips the step (both norms are then 0).
        inv_scale (Tensor, optional): one-element fp32 multiplier of the grads.
        global_grad_norm (Tensor): one-element fp32, the L2 norm of all the
            optimizer's grads as stored (scaled), e.g. from :func:`multi_tensor_l2norm`.
        max_grad_norm (float): clipping threshold; 0 or less turns clipping off.
        beta1 (float): first-moment decay.
        beta2 (float): second-moment decay.
        eps (float): added to the denominator.
        weight_decay (float): weight decay.
        step (int): the step number, from 1.
        bias_correction (bool, optional): Default: True.
        grad_averaging (bool, optional): ``beta3 = 1 - beta1`` (else 1). Default: True.
        adam_w_mode (bool, optional): decoupled weight decay. Default: True.
        use_nvlamb (bool, optional): the trust ratio for every tensor, not only
            those with weight decay (then the param norms are computed). Default: False.

    Returns:
        tuple of Tensor: ``(param_norms, update_norms)``, fp32, one per tensor
        (``param_norms`` are 0 when not needed).

    Example::

        >>> total, _ = ops.multi_tensor_l2norm(grads)
        >>> pn, un = ops.multi_tensor_lamb_stage1_(grads, params, m, v, None, None, total,
        ...     max_grad_norm=1.0, beta1=0.9, beta2=0.999, eps=1e-6, weight_decay=0.01, step=1)
        >>> ops.multi_tensor_lamb_stage2_(params, m, v, pn, un, [], None, lr=1e-3, beta1=0.9,
        ...     beta2=0.999, eps=1e-6, weight_decay=0.01, step=1)
    """
    return _ops.multi_tensor_lamb_stage1_(grads, params, exp_avgs, exp_avg_sqs, noop, inv_scale,
                                          global_grad_norm, max_grad_norm, beta1, beta2, eps,
                                          weight_decay, step, bias_correction, grad_averaging,
                                          adam_w_mode, use_nvlamb)


def multi_tensor_lamb_stage2_(
    params: list[Tensor], exp_avgs: list[Tensor], exp_avg_sqs: list[Tensor], param_norms: Tensor,
    update_norms: Tensor, model_params: list[Tensor], noop: Tensor | None, *, lr: float,
    beta1: float, beta2: float, eps: float, weight_decay: float, step: int,
    bias_correction: bool = True, adam_w_mode: bool = True, use_nvlamb: bool = False,
) -> None:
    """LAMB's second stage: ``p = p - ratio * u``, with the per-tensor trust ratio.

    ``u`` is recomputed from the moments stage 1 stored. ``ratio`` is
    ``lr * param_norm / update_norm`` for tensors with weight decay (all of them
    with ``use_nvlamb``) when both norms are non-zero, else ``lr``.

    Args:
        params (list of Tensor): parameters or fp32 masters, updated in place.
        exp_avgs (list of Tensor): first moments from stage 1, read only.
        exp_avg_sqs (list of Tensor): second moments from stage 1, read only.
        param_norms (Tensor): stage 1's first result.
        update_norms (Tensor): stage 1's second result.
        model_params (list of Tensor): empty, or the half copies to write.
        noop (Tensor, optional): non-zero skips the step.
        lr (float): learning rate.
        beta1 (float): as in stage 1.
        beta2 (float): as in stage 1.
        eps (float): as in stage 1.
        weight_decay (float): as in stage 1.
        step (int): as in stage 1.
        bias_correction (bool, optional): Default: True.
        adam_w_mode (bool, optional): Default: True.
        use_nvlamb (bool, optional): Default: False.

    Example::

        >>> ops.multi_tensor_lamb_stage2_(params, m, v, pn, un, half_params, found_inf, lr=1e-3,
        ...     beta1=0.9, beta2=0.999, eps=1e-6, weight_decay=0.01, step=1)
    """
    _ops.multi_tensor_lamb_stage2_(params, exp_avgs, exp_avg_sqs, param_norms, update_norms,
                                   model_params, noop, lr, beta1, beta2, eps, weight_decay, step,
                                   bias_correction, adam_w_mode, use_nvlamb)
