"""``clip_grad_norm_``: gradient-norm clipping with the fused kernels, over shards or not."""

from __future__ import annotations

import math
from typing import Iterable

import torch
from torch import Tensor

from amp_patch import ops, session as _session
from amp_patch.frontend.loss_scaling import master_params
from amp_patch.helpers.tensors import (
    group_by_device_and_dtype,
    local_tensor,
    shard_groups,
    sum_over_shards,
)
from amp_patch.optim.amp import OPTIMIZER_TYPES, underlying_optimizer

__all__ = ["clip_grad_norm_"]


def clip_grad_norm_(optimizer_or_params, max_norm: float, norm_type: float = 2.0) -> Tensor:
    """Scale the gradients so that their total norm is at most ``max_norm``; return that norm.

    The same computation as :func:`torch.nn.utils.clip_grad_norm_`:
    ``coef = min(1, max_norm / (norm + 1e-6))``, then every gradient times
    ``coef``. With ``norm_type=2`` the norm is one fused
    :func:`~amp_patch.ops.multi_tensor_l2norm` per (device, dtype) and the
    scaling one fused pass per (device, dtype). Sharded gradients (FSDP2's
    DTensors) contribute their local shards, and the squared norm is summed
    over the shards' process group by one all-reduce, so every rank gets the
    norm of the whole, unsharded gradient and the same ``coef``. Nothing
    syncs with the host.

    Args:
        optimizer_or_params (torch.optim.Optimizer, Tensor or iterable of Tensor):
            an optimizer, whose stepped tensors are clipped (the fp32 masters
            under O2, see :func:`amp_patch.master_params`), or parameters.
        max_norm (float): the largest total norm allowed.
        norm_type (float, optional): the p of the p-norm: a positive number
            or ``inf``. Default: 2.0.

    Returns:
        Tensor: the total norm before clipping, a 0-dim fp32 tensor on the
        gradients' (first) device; 0 when there is no gradient.

    Raises:
        ValueError: ``norm_type`` is not positive, or a parameter passed has
            an amp fp32 master (pass the optimizer: its masters hold the
            unscaled gradients).
        TypeError: ``optimizer_or_params`` is neither an optimizer nor tensors.

    .. note::
        Call it after the :func:`amp_patch.scale_loss` block (the gradients
        are unscaled then) and before ``optimizer.step()``. A non-finite
        gradient makes the norm non-finite, as with torch's.

    Example::

        >>> with amp.scale_loss(loss, optimizer) as scaled_loss:
        ...     scaled_loss.backward()
        >>> total_norm = amp.clip_grad_norm_(optimizer, max_norm=1.0)
        >>> optimizer.step()
    """
    norm_type = float(norm_type)
    if not norm_type > 0:
        raise ValueError(f"clip_grad_norm_: norm_type must be a positive number or inf, got "
                         f"{norm_type}")
    grads = [p.grad for p in _tensors(optimizer_or_params) if p.grad is not None]
    if not grads:
        return torch.zeros(())
    # Shards of one placement are summed over their process groups; a replicated
    # gradient (DDP, or none at all) counts once.
    by_groups: dict[tuple, list[Tensor]] = {}
    for g in grads:
        by_groups.setdefault(shard_groups(g), []).append(g)
    device = local_tensor(grads[0]).device
    inf = math.isinf(norm_type)
    total = None
    for groups, members in by_groups.items():
        part = _partial(members, norm_type).to(device)  # sum of |g|**p, or max |g| for inf
        sum_over_shards(part, groups, "max" if inf else "sum")
        total = part if total is None else (torch.maximum(total, part) if inf else total + part)
    # sqrt(fl(x * x)) is x again in binary floating point: one unsharded group loses nothing.
    total_norm = total if inf else total.sqrt() if norm_type == 2.0 else total.pow(1.0 / norm_type)
    coef = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0).reshape(1)
    for (dev, _), (local,) in group_by_device_and_dtype(grads).items():
        scratch = torch.zeros(1, device=dev)  # the kernel's overflow flag; the norm tells already
        ops.multi_tensor_unscale_(local, scratch, coef.to(dev))
    return total_norm


def _tensors(optimizer_or_params) -> list[Tensor]:
    if isinstance(optimizer_or_params, OPTIMIZER_TYPES):
        return list(master_params(underlying_optimizer(optimizer_or_params)))
    if isinstance(optimizer_or_params, Tensor):
        params = [optimizer_or_params]
    elif isinstance(optimizer_or_params, Iterable):
        params = list(optimizer_or_params)
        bad = [type(p).__name__ for p in params if not isinstance(p, Tensor)]
        if bad:
            raise TypeError(f"clip_grad_norm_ takes an optimizer or tensors; got {bad[0]} among "
                            "the parameters")
    else:
        raise TypeError("clip_grad_norm_ takes an optimizer or parameters (a tensor or an "
                        f"iterable of tensors); got {type(optimizer_or_params).__name__}")
    session = _session.current()
    if session is not None:
        for record in session.optimizer_records.values():
            if any(record.masters.master_for(p) is not None for p in params):
                raise ValueError(
                    "clip_grad_norm_: these parameters have fp32 master weights (O2), whose grads "
                    "hold the unscaled gradients; pass the optimizer "
                    "(amp.clip_grad_norm_(optimizer, max_norm)) or amp.master_params(optimizer)")
    return params


def _partial(grads: list[Tensor], norm_type: float) -> Tensor:
    """This rank's part of the norm of ``grads``: the sum of ``|g|**p`` (the max for inf), fp32."""
    parts = []
    for (_, _), (local,) in group_by_device_and_dtype(grads).items():
        if norm_type == 2.0:
            norm, _ = ops.multi_tensor_l2norm(local)
            parts.append(norm.float().square())
        elif math.isinf(norm_type):
            parts.append(torch.stack(torch._foreach_norm(local, norm_type)).float().amax())
        else:
            norms = torch.stack(torch._foreach_norm(local, norm_type)).float()
            parts.append(norms.pow(norm_type).sum())
    devices = [p.to(parts[0].device) for p in parts]
    stacked = torch.stack(devices)
    return stacked.amax() if math.isinf(norm_type) else stacked.sum()
