"""The reference math that the optimizer ops share: rounding, the update rules, the checks.

The reference bodies of :mod:`amp_patch.ops.optimizer_ops` (fp32 state) and
:mod:`amp_patch.ops.lean_state_ops` (low-bit state) are built from these, so
an update rule is written once on the Python side as it is once in
the kernels' ``optim_math.h``. Each function computes in fp32 with the kernels' order
of operations and roundings: hyper-parameters rounded to fp32 once
(:func:`f32`), true divisions (:func:`div_rn`), correctly rounded square
roots (:func:`sqrt_rn`). They are reference code: plain tensor ops, one
tensor at a time, never fast.

Example::

    >>> b1, b2, c1, c2, bc1, bc2, lr, eps, wd = adam_constants(0.9, 0.999, 1e-3, 1e-8, 0.0,
    ...                                                        step=1, bias_correction=True)
    >>> m, v, u = adam_moments(torch.ones(2), None, torch.zeros(2), torch.zeros(2), b1, b2,
    ...                        c1, c2, bc1, bc2, eps, wd, adam_w_mode=True)
    >>> u
    tensor([1., 1.])
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from amp_patch.ops._library import _check_rows

__all__ = [
    "f32", "one_minus", "bias_corr", "div_rn", "sqrt_rn", "skip_mask", "commit",
    "grad32", "adam_direction", "adam_new_moments", "adam_moments", "adam_constants",
    "check_sgd_lists", "sgd_update", "lamb_uses_ratio", "lamb_norms_fake",
]


def f32(x: float) -> float:
    """``x`` rounded to the nearest float32, as the kernels take their scalars."""
    return torch.tensor(x, dtype=torch.float32).item()


def one_minus(x: float) -> float:
    """``1 - x`` computed in float32 (x already a float32 value)."""
    return (torch.ones((), dtype=torch.float32) - x).item()


def bias_corr(beta: float, step: int, enabled: bool) -> float:
    """``1 - beta**step`` in float64 rounded once to float32 (Apex's host code); 1 when not
    ``enabled``."""
    return f32(1.0 - beta ** step) if enabled else 1.0


def div_rn(x: Tensor, c: float) -> Tensor:
    """``x / c``, a true division as the kernels divide."""
    # A tensor divisor: CUDA turns division by a Python scalar into a multiply by
    # its reciprocal, which the kernels (true division) would not match.
    return x / torch.full((), c, dtype=torch.float32, device=x.device)


def sqrt_rn(x: Tensor) -> Tensor:
    """The correctly rounded float32 square root of ``x``."""
    # torch.sqrt on CPU is not correctly rounded for float32; a float64 sqrt
    # (error < 1 ulp) rounded to float32 is, for every float32 input.
    return x.double().sqrt().float()


def skip_mask(noop: Tensor | None) -> Tensor | None:
    """A 0-dim bool that is True when the step must leave everything as it is."""
    return None if noop is None else noop.reshape(()) != 0


def commit(skip: Tensor | None, *pairs: tuple[Tensor, Tensor]) -> None:
    """Write each new value into its tensor; under ``skip`` (:func:`skip_mask`), write the old
    bits back."""
    for dst, value in pairs:
        value = value.to(dst.dtype)
        dst.copy_(value if skip is None else torch.where(skip, dst, value))


def grad32(g: Tensor, inv_scale: Tensor | None) -> Tensor:
    """A grad as the kernels read it: ``float(g) * inv_scale``."""
    g = g.float()
    return g if inv_scale is None else g * inv_scale.reshape(()).to(g.device)


def adam_direction(m: Tensor, v: Tensor, p: Tensor | None, bc1: float, bc2: float, eps: float,
                   wd: float, adam_w_mode: bool) -> Tensor:
    """Adam's update direction from the moments, with AdamW's decay term (LAMB's too)."""
    u = div_rn(m, bc1) / (sqrt_rn(div_rn(v, bc2)) + eps)
    if adam_w_mode and wd != 0.0:
        u = u + wd * p  # type: ignore[operator]  # LAMB and AdamW always pass p
    return u


def adam_new_moments(g: Tensor, p: Tensor | None, m: Tensor, v: Tensor, b1: float, b2: float,
                     c1: float, c2: float, wd: float, adam_w_mode: bool) -> tuple[Tensor, Tensor]:
    """New moments from an unscaled grad, with L2 decay outside AdamW mode (LAMB: c1 is beta3)."""
    if not adam_w_mode and wd != 0.0:
        g = g + wd * p  # type: ignore[operator]  # p is given whenever decay applies
    return b1 * m.float() + c1 * g, b2 * v.float() + c2 * g * g


def adam_moments(g: Tensor, p: Tensor | None, m: Tensor, v: Tensor, b1: float, b2: float,
                 c1: float, c2: float, bc1: float, bc2: float, eps: float, wd: float,
                 adam_w_mode: bool) -> tuple[Tensor, Tensor, Tensor]:
    """New moments from an unscaled grad, and the direction (LAMB: c1 is beta3)."""
    m, v = adam_new_moments(g, p, m, v, b1, b2, c1, c2, wd, adam_w_mode)
    return m, v, adam_direction(m, v, p, bc1, bc2, eps, wd, adam_w_mode)


def adam_constants(beta1: float, beta2: float, lr: float, eps: float, weight_decay: float,
                   step: int, bias_correction: bool) -> tuple[float, ...]:
    """Adam's hyper-parameters as the kernels take them: ``(b1, b2, 1-b1, 1-b2, bc1, bc2, lr,
    eps, wd)``, each rounded to fp32 once."""
    b1, b2 = f32(beta1), f32(beta2)
    return (b1, b2, one_minus(b1), one_minus(b2), bias_corr(b1, step, bias_correction),
            bias_corr(b2, step, bias_correction), f32(lr), f32(eps), f32(weight_decay))


def check_sgd_lists(op: str, grads, params, momentum_buffers, model_params,
                    momentum: float) -> None:
    """The list checks of the SGD ops: one buffer per grad when there is momentum."""
    if momentum != 0.0 and len(momentum_buffers) != len(grads):
        raise RuntimeError(f"amp_patch::{op}: momentum is {momentum} but momentum_buffers has "
                           f"{len(momentum_buffers)} tensors for {len(grads)} grads")
    _check_rows(op, grads=grads, params=params,
                momentum_buffers=momentum_buffers if momentum != 0.0 else None,
                model_params=model_params or None)


def sgd_update(g: Tensor, p: Tensor, old_buf: Callable[[], Tensor], lr: float, wd: float,
               mu: float, c_damp: float, nesterov: bool, first_run: bool,
               wd_after_momentum: bool) -> tuple[Tensor, Tensor | None]:
    """Apex's SGD rule in fp32: the new param, and the new momentum buffer (None without
    momentum). ``old_buf()`` reads the old buffer as fp32; a first run does not call it."""
    if wd != 0.0 and not wd_after_momentum:
        g = g + wd * p
    buf = None
    if mu != 0.0:
        buf = g if first_run else mu * old_buf() + c_damp * g
        g = g + mu * buf if nesterov else buf
    if wd != 0.0 and wd_after_momentum:
        g = g + wd * p
    return p - lr * g, buf


def lamb_uses_ratio(weight_decay: float, use_nvlamb: bool) -> bool:
    """Whether LAMB scales a step by the trust ratio (and so needs stage 1's norms): with weight
    decay, or for every tensor with NVLAMB. The kernels decide it alike (lamb_needs_norms)."""
    return bool(use_nvlamb) or weight_decay != 0.0


def lamb_norms_fake(grads, *args) -> tuple[Tensor, Tensor]:
    """The fake (meta) body of LAMB's first stages: two fp32 norms per tensor."""
    device = grads[0].device if grads else torch.device("cpu")
    return (torch.empty(len(grads), dtype=torch.float32, device=device),
            torch.empty(len(grads), dtype=torch.float32, device=device))
