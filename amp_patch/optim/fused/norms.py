"""Grad norms for the fused optimizers: the global norm of a step's grads, and per-tensor norms
of whole tensors from those of their shards (FSDP2's DTensors)."""

from __future__ import annotations

from typing import Any, Iterable, Mapping

import torch
from torch import Tensor

from amp_patch import ops
from amp_patch.helpers.tensors import local_tensors, shard_groups, sum_over_shards

__all__ = ["grad_norms", "whole_tensor_norms"]


def grad_norms(grads: Iterable[tuple[torch.device, Tensor]],
               given: Mapping[torch.device, Tensor] | None = None) -> dict[torch.device, Tensor]:
    """The L2 norm of ``grads`` per device of their params (global across devices when there
    are several).

    ``grads`` are ``(device of the param, grad)`` in ``param_groups`` order. The
    norms come from ``given`` (the step inputs' ``grad_norms``) when they are
    given and no grad is sharded, else from one
    :func:`amp_patch.ops.multi_tensor_l2norm` per device. The grads are as
    stored: ``inv_scale`` is applied by the kernel that uses the norm. Sharded
    grads (FSDP2's DTensors) give the norm of the whole grads: each rank's
    squared norm of its shards, summed over their process groups
    (:func:`~amp_patch.helpers.tensors.sum_over_shards`), on every rank alike.

    Args:
        grads (iterable): ``(device, grad)`` pairs.
        given (Mapping, optional): device -> a norm already computed.

    Returns:
        dict: device -> 0-dim fp32 norm.

    Example::

        >>> grad_norms([(torch.device("cpu"), torch.full((4,), 2.0))])
        {device(type='cpu'): tensor(4.)}
    """
    # device -> shard groups (() for whole grads) -> grads, in param_groups order.
    per_device: dict[torch.device, dict[tuple[Any, ...], list[Tensor]]] = {}
    for device, grad in grads:
        by_groups = per_device.setdefault(device, {})
        by_groups.setdefault(shard_groups(grad), []).append(grad)
    sharded = any(key for by_groups in per_device.values() for key in by_groups)
    if given is not None and not sharded:  # the check's norms are each rank's own
        norms = dict(given)
    else:
        norms = {dev: _grad_norm(by_groups) for dev, by_groups in per_device.items()}
    if len(norms) > 1:
        first = next(iter(norms))
        total = torch.linalg.vector_norm(torch.stack([n.to(first) for n in norms.values()]))
        norms = {dev: total.to(dev) for dev in norms}
    return norms


def _grad_norm(by_groups: dict[tuple[Any, ...], list[Tensor]]) -> Tensor:
    """The L2 norm of one device's grads, keyed by their shard groups: of the whole grads.

    Whole grads alone take one multi_tensor_l2norm; sharded ones add their squared norm
    summed over their shards' groups (:func:`~amp_patch.helpers.tensors.sum_over_shards`).
    """
    if list(by_groups) == [()]:
        return ops.multi_tensor_l2norm(by_groups[()])[0]
    total = None
    for groups, members in by_groups.items():
        part = ops.multi_tensor_l2norm(local_tensors(members))[0].float().square()
        sum_over_shards(part, groups)
        total = part if total is None else total + part
    return total.sqrt()  # type: ignore[union-attr]


def whole_tensor_norms(tensors: list[Tensor], *norms: Tensor, op: str = "l2",
                       ) -> tuple[Tensor, ...]:
    """Per-tensor norms of whole tensors from those of this rank's shards.

    ``n[i]`` of each of ``norms`` is the norm of ``tensors[i]``'s local shard (FSDP2's
    DTensors; a whole tensor is its own shard). For each sharded tensor the squares of its
    shards' L2 norms are summed over its process groups (``op="max"``: the maxima taken),
    all of ``norms`` in one all-reduce per set of groups. Whole tensors keep their norms,
    and with no sharded tensor ``norms`` come back as they are.

    Args:
        tensors (list of Tensor): the tensors.
        *norms (Tensor): fp32, one norm per tensor each.
        op (str, optional): ``"l2"`` or ``"max"``. Default: ``"l2"``.

    Returns:
        tuple of Tensor: the whole tensors' norms, one per tensor of ``norms``.

    Example::

        >>> whole_tensor_norms([torch.ones(2), torch.ones(3)], torch.tensor([3.0, 4.0]))
        (tensor([3., 4.]),)
    """
    by_groups: dict[tuple[Any, ...], list[int]] = {}
    for i, t in enumerate(tensors):
        groups = shard_groups(t)
        if groups:
            by_groups.setdefault(groups, []).append(i)
    if not by_groups:
        return norms
    out = torch.stack(norms)
    for groups, members in by_groups.items():
        index = torch.tensor(members, device=out.device)
        part = out.index_select(-1, index)
        if op == "max":
            out.index_copy_(-1, index, sum_over_shards(part, groups, "max"))
        else:
            out.index_copy_(-1, index, sum_over_shards(part.square(), groups).sqrt())
    return tuple(out.unbind(0))
