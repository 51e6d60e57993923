"""``fused_adam_cuda``: Apex's deprecated compiled Adam module, served by amp_patch.

Apex built ``fused_adam_cuda`` (``setup.py --deprecated_fused_adam``) for
``apex.contrib.optimizers.FusedAdam``, the 2019 ``FusedAdam``, and scripts
copied it: OpenNMT-py's own ``FusedAdam`` imports it in its constructor and
calls :func:`adam` once per parameter per step. This module has the two
functions such scripts call, :func:`adam` and :func:`adam_mt`, with Apex's
arguments and Apex's per-element arithmetic in Apex's order, on CPU and CUDA
tensors alike. The rest of what Apex's module exported (``reversible_adam``,
``maybe_adam_undo``, ``maybe_cast``, ``maybe_cast_mt``,
``strided_check_finite``, for its distributed optimizers) is not served: asking
for it is logged as a warning, as for any Apex name amp_patch lacks.

The arithmetic, per element, with ``T`` the parameter's dtype (fp32, or fp64),
every scalar taken as an fp32 value as Apex's ``float`` arguments were, and
``step_size = lr*sqrt(1-beta2**step)/(1-beta1**step)`` (``lr`` without bias
correction), the corrections rounded to fp32 from a double ``pow``::

    g = T(grad) / grad_scale
    m = beta1*m + (1-beta1)*g
    v = beta2*v + (1-beta2)*g*g
    denom = float(sqrt(float(v + eps)))      # mode 0: eps inside the square root
    denom = float(sqrt(float(v))) + eps      # mode 1: eps outside
    update = float(m/denom + decay*p)
    p = p - step_size*update

Every operation rounds as IEEE arithmetic does (the square root correctly
rounded), one at a time; Apex's CUDA build used ``--use_fast_math``, whose
approximate division and contracted multiply-adds may differ from this by an
ulp, which no CPU could reproduce anyway.
"""

from __future__ import annotations

import logging
from typing import Sequence

import torch
from torch import Tensor

__all__ = ["adam", "adam_mt"]

logger = logging.getLogger("amp_patch")

_HALF = (torch.float16, torch.bfloat16)
_FULL = (torch.float32, torch.float64)


def _f32(x: float) -> Tensor:
    """``x`` rounded to fp32, as a 0-dim CPU tensor: a C++ ``float`` argument."""
    return torch.tensor(float(x), dtype=torch.float32)


def step_size(lr: float, beta1: float, beta2: float, step: int, bias_correction: int) -> Tensor:
    """Apex's step size, an fp32 0-dim tensor: ``lr*sqrt(1-beta2**step)/(1-beta1**step)``.

    The corrections are ``1 - pow(beta, step)`` in double, from the fp32 beta,
    rounded to fp32; the rest is fp32 arithmetic.

    Args:
        lr (float): the learning rate.
        beta1 (float): first-moment decay.
        beta2 (float): second-moment decay.
        step (int): the step, from 1.
        bias_correction (int): 1 to correct, 0 to use ``lr`` as it is.

    Returns:
        Tensor: the step size.

    Example::

        >>> float(step_size(1e-3, 0.9, 0.999, 1, 1))   # lr*sqrt(0.001)/0.1, in fp32 steps
        0.0003162256...
    """
    lr32 = _f32(lr)
    if bias_correction != 1:
        return lr32
    bc1 = _f32(1.0 - float(_f32(beta1)) ** step)
    bc2 = _f32(1.0 - float(_f32(beta2)) ** step)
    return lr32 * _sqrt_rn(bc2) / bc1


def _sqrt_rn(x: Tensor) -> Tensor:
    # sqrtf, correctly rounded: a float64 square root rounded to fp32 is, for every fp32 input
    # (torch's fp32 sqrt on the CPU is not always).
    return x.double().sqrt().float()


def _check(p: Tensor, m: Tensor, v: Tensor, g: Tensor, p_copy: Tensor | None) -> None:
    n = p.numel()
    for name, t in (("m", m), ("v", v), ("g", g)):
        if t.numel() != n:
            raise RuntimeError(f"fused_adam_cuda: number of elements in {name} and p tensors "
                               "should be equal")
    if p_copy is not None and p_copy.numel() not in (0, n):
        raise RuntimeError("fused_adam_cuda: number of elements in p_copy and p tensors should be "
                           "equal, or p_copy should be empty")
    for name, t in (("p", p), ("m", m), ("v", v), ("g", g)):
        if not t.is_contiguous():
            raise RuntimeError(f"fused_adam_cuda: {name} must be contiguous")
    if g.dtype in _HALF:
        if p.dtype != torch.float32:
            raise RuntimeError("fused_adam_cuda: expected parameter to be of float type (half "
                               "gradients update fp32 parameters)")
    elif g.dtype not in _FULL or p.dtype != g.dtype:
        raise RuntimeError(f"fused_adam_cuda: unsupported dtypes: p {p.dtype}, g {g.dtype} "
                           "(fp32/fp64 grads of params of the same dtype, or fp16/bf16 grads of "
                           "fp32 params)")
    for name, t in (("m", m), ("v", v)):
        if t.dtype != p.dtype:
            raise RuntimeError(f"fused_adam_cuda: {name} must have the parameter's dtype "
                               f"{p.dtype}, got {t.dtype}")


def _update(p: Tensor, m: Tensor, v: Tensor, g: Tensor, p_copy: Tensor | None, beta1: float,
            beta2: float, eps: float, grad_scale: float, size: Tensor, mode: int,
            decay: float) -> None:
    """One tensor's update in place, Apex's kernel's arithmetic; ``p_copy`` receives p rounded."""
    with torch.no_grad():  # a kernel writing into leaves, as Apex's did
        _update_(p, m, v, g, p_copy, beta1, beta2, eps, grad_scale, size, mode, decay)


def _update_(p: Tensor, m: Tensor, v: Tensor, g: Tensor, p_copy: Tensor | None, beta1: float,
             beta2: float, eps: float, grad_scale: float, size: Tensor, mode: int,
             decay: float) -> None:
    if p.numel() == 0:
        return
    dt, dev = p.dtype, p.device
    b1, b2, eps32 = _f32(beta1), _f32(beta2), _f32(eps)

    def s(x: Tensor) -> Tensor:  # an fp32 scalar promoted to T on the device
        return x.to(device=dev, dtype=dt)

    g = g.detach().reshape(p.shape).to(dt) / s(_f32(grad_scale))
    m_new = s(b1) * m + s(1 - b1) * g
    v_new = s(b2) * v + s(1 - b2) * g * g
    m.copy_(m_new)
    v.copy_(v_new)
    if mode == 0:
        denom = _sqrt_rn((v + s(eps32)).float())
    else:
        denom = _sqrt_rn(v.float()) + eps32.to(dev)
    update = (m / denom.to(dt) + s(_f32(decay)) * p).float()
    p.copy_(p - (size.to(dev) * update).to(dt))
    if p_copy is not None:
        p_copy.copy_(p.reshape(p_copy.shape))


def adam(p: Tensor, p_copy: Tensor, m: Tensor, v: Tensor, g: Tensor, lr: float, beta1: float,
         beta2: float, eps: float, grad_scale: float, step: int, mode: int, bias_correction: int,
         decay: float) -> None:
    """One Adam step of one parameter, in place: Apex's ``fused_adam_cuda.adam``.

    Args:
        p (Tensor): the parameter (the fp32 master for half grads), updated.
        p_copy (Tensor): empty, or a tensor that receives the updated ``p`` in
            its own dtype (the half model param); written only when ``g`` is
            half, as Apex's kernel did.
        m (Tensor): the first moment, dtype of ``p``, updated.
        v (Tensor): the second moment, dtype of ``p``, updated.
        g (Tensor): the gradient, divided by ``grad_scale``.
        lr (float): learning rate.
        beta1 (float): first-moment decay.
        beta2 (float): second-moment decay.
        eps (float): added to the denominator.
        grad_scale (float): what ``g`` is divided by (the loss scale).
        step (int): the parameter's step, from 1.
        mode (int): 0: eps inside the square root; 1: outside.
        bias_correction (int): 1 to fold the bias corrections into the step size.
        decay (float): weight decay, added to the update as ``decay*p``.

    Raises:
        RuntimeError: mismatched sizes or dtypes, or non-contiguous tensors
            (Apex's checks).

    Example::

        >>> import fused_adam_cuda                       # under amp-patch run
        >>> fused_adam_cuda.adam(p, torch.tensor([]), m, v, p.grad, 1e-3, 0.9, 0.999, 1e-8,
        ...                      1.0, 1, 1, 1, 0.0)
    """
    _check(p, m, v, g, p_copy)
    out = p_copy if p_copy is not None and p_copy.numel() > 0 and g.dtype in _HALF else None
    _update(p, m, v, g, out, beta1, beta2, eps, grad_scale,
            step_size(lr, beta1, beta2, step, bias_correction), mode, decay)


def adam_mt(chunk_size: int, noop_flag: Tensor, tensor_lists: Sequence[Sequence[Tensor]], lr: float,
            beta1: float, beta2: float, eps: float, grad_scale: float, step: int, mode: int,
            bias_correction: int, decay: float) -> None:
    """One Adam step over lists of tensors: Apex's ``fused_adam_cuda.adam_mt``.

    The same arithmetic as :func:`adam` for each ``(p, m, v, g[, p_copy])``
    row; with a fifth list every ``p_copy`` is written, whatever the grads'
    dtype. As in Apex, ``noop_flag`` is not read and ``chunk_size`` only
    shaped Apex's launch.

    Args:
        chunk_size (int): accepted.
        noop_flag (Tensor): accepted.
        tensor_lists (list of list of Tensor): ``[p, m, v, g]`` or
            ``[p, m, v, g, p_copy]``.
        lr, beta1, beta2, eps, grad_scale, step, mode, bias_correction, decay:
            as for :func:`adam`.

    Raises:
        RuntimeError: not 4 or 5 lists, lists of different lengths, or a row
            :func:`adam` would refuse.

    Example::

        >>> fused_adam_cuda.adam_mt(65536, overflow_buf, [ps, ms, vs, gs], 1e-3, 0.9, 0.999,
        ...                         1e-8, 1.0, 1, 1, 1, 0.0)
    """
    lists = [list(t) for t in tensor_lists]
    if len(lists) not in (4, 5):
        raise RuntimeError("fused_adam_cuda.adam_mt: expected tensor lists of size 4 or 5")
    if len({len(t) for t in lists}) > 1:
        raise RuntimeError("fused_adam_cuda.adam_mt: the tensor lists must have the same length")
    size = step_size(lr, beta1, beta2, step, bias_correction)
    for row in zip(*lists):
        p, m, v, g = row[:4]
        p_copy = row[4] if len(row) == 5 else None
        _check(p, m, v, g, p_copy)
        _update(p, m, v, g, p_copy, beta1, beta2, eps, grad_scale, size, mode, decay)
