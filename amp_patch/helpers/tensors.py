"""Leaf helpers over lists of tensors: DTensor local shards, and grouping by (device, dtype).

Every fused op call takes plain tensors of one device. The helpers here turn
what the callers hold (model grads, FSDP2's DTensor parameters, masters) into
such lists. They import nothing from amp_patch, so every layer may use them:
the scaler, the optimizer machinery, FSDP preparation and gradient clipping.
"""

from __future__ import annotations

import functools
import itertools
import operator
import sys
from typing import Any, Iterable, Sequence

import torch
from torch import Tensor, nn

__all__ = ["GroupKey", "local_tensor", "local_tensors", "group_by_device_and_dtype", "shard_groups",
           "sum_over_shards", "device_of", "version_of", "none_has_grad"]

#: The key of one group: the device and dtype of its tensors.
GroupKey = tuple[torch.device, torch.dtype]

#: A tensor's device, and its version counter: ``operator.attrgetter`` s, so that
#: ``map(device_of, tensors)`` reads a whole list in C (every step walks lists of grads).
device_of = operator.attrgetter("device")
version_of = operator.attrgetter("_version")
_grad_of = operator.attrgetter("grad")


def none_has_grad(tensors: Iterable[Tensor]) -> bool:
    """Whether no tensor of ``tensors`` has a ``.grad``: read in C, or in a loop under
    ``torch.compile`` (which cannot trace an ``attrgetter``).

    Example::

        >>> none_has_grad([torch.zeros(2, requires_grad=True)])
        True
    """
    if torch.compiler.is_compiling():
        return all(t.grad is None for t in tensors)
    return all(map(operator.is_, map(_grad_of, tensors), itertools.repeat(None)))

#: The exact types that are never a DTensor: most lists hold nothing else.
_PLAIN = frozenset((Tensor, nn.Parameter))


def local_tensor(t: Tensor) -> Tensor:
    """The local shard of a DTensor (FSDP2's parameters and grads); any other tensor itself.

    The fused ops work on plain tensors, and every rank unscales, checks and
    clips its own shard; what must agree across ranks is combined by one
    collective afterwards.

    Args:
        t (Tensor): a tensor, or a :class:`~torch.distributed.tensor.DTensor`.

    Returns:
        Tensor: ``t._local_tensor`` for a DTensor (a view that writes through), else ``t``.

    Example::

        >>> t = torch.ones(3)
        >>> local_tensor(t) is t
        True
    """
    return local_tensors([t])[0]


def local_tensors(tensors: list[Tensor]) -> list[Tensor]:
    """:func:`local_tensor` of each; ``tensors`` itself (not a copy) when none is a DTensor.

    Args:
        tensors (list of Tensor): any tensors.

    Returns:
        list of Tensor: the local shards of the DTensors among them, the others as they are.
    """
    # No DTensor exists until its module is imported (which costs most of a second), and
    # the fused ops' callers pass every grad of every iteration through here.
    module = sys.modules.get("torch.distributed.tensor")
    if module is None:
        return tensors
    if _PLAIN.issuperset(map(type, tensors)):  # walked in C: the common case costs no loop
        return tensors
    dtensor = module.DTensor
    return [t._local_tensor if type(t) not in _PLAIN and isinstance(t, dtensor) else t
            for t in tensors]


def group_by_device_and_dtype(*lists: Sequence[Tensor]) -> dict[GroupKey, tuple[list[Tensor], ...]]:
    """Split parallel lists of tensors by the (device, dtype) of the first list's tensors.

    Each fused op call takes tensors of one device. The ops do not need the
    split by dtype (they take lists that mix dtypes and run each tensor with
    its dtype's kernel); with it, each call gets one dtype, and a caller that
    reduces per group (a norm) combines one result per (device, dtype). The
    lists are kept parallel: element ``i`` of every list lands in the same
    group, in the original order.
    A DTensor (FSDP2's sharded params and grads) lands as its local shard
    (:func:`local_tensors`): each rank works on its own.

    Args:
        *lists (sequence of Tensor): lists of equal length; the first decides the groups.

    Returns:
        dict: ``(device, dtype)`` to a tuple with one list per input list.

    Raises:
        ValueError: if the lists differ in length.

    Example::

        >>> a = [torch.ones(2), torch.ones(2, dtype=torch.bfloat16), torch.zeros(3)]
        >>> b = [torch.zeros(2), torch.zeros(2), torch.zeros(3)]
        >>> groups = group_by_device_and_dtype(a, b)
        >>> [(dtype, len(src)) for (_, dtype), (src, dst) in groups.items()]
        [(torch.float32, 2), (torch.bfloat16, 1)]
    """
    if not lists:
        return {}
    lists = tuple(local_tensors(list(lst)) for lst in lists)
    n = len(lists[0])
    if any(len(lst) != n for lst in lists):
        raise ValueError("group_by_device_and_dtype: the lists must have equal lengths")
    groups: dict[GroupKey, tuple[list[Tensor], ...]] = {}
    for i, key_tensor in enumerate(lists[0]):
        key = (key_tensor.device, key_tensor.dtype)
        bucket = groups.get(key)
        if bucket is None:
            bucket = groups[key] = tuple([] for _ in lists)
        for out, lst in zip(bucket, lists):
            out.append(lst[i])
    return groups


def shard_groups(t: Tensor) -> tuple[Any, ...]:
    """The process groups over which ``t`` is split: those of its mesh's sharded dims.

    A DTensor of FSDP2 is sharded on its mesh's one dim (two with HSDP, where the
    other replicates); a sum over the whole tensor is the sum of its shards'
    over these groups. Any other tensor (DDP's replicas, a plain model) is whole.

    Args:
        t (Tensor): a tensor, or a :class:`~torch.distributed.tensor.DTensor`.

    Returns:
        tuple of ProcessGroup: one per sharded mesh dim; ``()`` when ``t`` is whole.

    Example::

        >>> shard_groups(torch.ones(3))
        ()
    """
    if local_tensor(t) is t:
        return ()
    return _mesh_groups(t.device_mesh, tuple(t.placements))  # type: ignore[attr-defined]


@functools.lru_cache(maxsize=64)
def _mesh_groups(mesh: Any, placements: tuple[Any, ...]) -> tuple[Any, ...]:
    # Once per (mesh, placements): DeviceMesh.get_group costs about 10 us, and the optimizers
    # ask for every tensor of every step.
    return tuple(mesh.get_group(dim) for dim, placement in enumerate(placements)
                 if placement.is_shard())


def sum_over_shards(parts: Tensor, groups: tuple[Any, ...], op: str = "sum") -> Tensor:
    """``parts`` combined over ``groups`` (:func:`shard_groups`) in place: one all-reduce each.

    Every rank holding shards of the same tensors calls it with the same
    ``groups``, so the collectives match across ranks.

    Args:
        parts (Tensor): this rank's partial results (sums of squares, or maxima).
        groups (tuple of ProcessGroup): the groups to reduce over; ``()`` does nothing.
        op (str, optional): ``"sum"`` or ``"max"``. Default: ``"sum"``.

    Returns:
        Tensor: ``parts``, reduced.

    Example::

        >>> sum_over_shards(torch.ones(2), ())
        tensor([1., 1.])
    """
    if groups:
        import torch.distributed as dist

        reduce_op = dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM
        for group in groups:
            dist.all_reduce(parts, op=reduce_op, group=group)
    return parts
