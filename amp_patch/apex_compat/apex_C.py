"""``apex_C``: Apex's compiled flatten/unflatten helpers, served by amp_patch.

Apex's ``setup.py`` built ``apex_C`` (``csrc/flatten_unflatten.cpp``) for its
old ``DistributedDataParallel`` and ``fp16_utils``; scripts of that era import
it to pack gradients into one buffer for a single all-reduce. Both functions
are torch's own dense flatten and unflatten, which is what Apex's C++ called.
"""

from __future__ import annotations

from typing import Sequence

from torch import Tensor
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

__all__ = ["flatten", "unflatten"]


def flatten(tensors: Sequence[Tensor]) -> Tensor:
    """The tensors, concatenated flat into one new contiguous 1-D tensor.

    Args:
        tensors (sequence of Tensor): dense tensors of one dtype and device.

    Returns:
        Tensor: their elements, in order.

    Example::

        >>> import apex_C                                   # under amp-patch run
        >>> apex_C.flatten([torch.ones(2), torch.zeros(1, 2)])
        tensor([1., 1., 0., 0.])
    """
    return _flatten_dense_tensors(list(tensors))


def unflatten(flat: Tensor, tensors: Sequence[Tensor]) -> list[Tensor]:
    """Views of ``flat`` shaped like each of ``tensors`` in turn (the inverse of :func:`flatten`).

    Args:
        flat (Tensor): a 1-D tensor with as many elements as ``tensors`` together.
        tensors (sequence of Tensor): the tensors whose shapes to take.

    Returns:
        list of Tensor: one view per tensor.

    Example::

        >>> ts = [torch.ones(2), torch.zeros(1, 2)]
        >>> [t.shape for t in apex_C.unflatten(apex_C.flatten(ts), ts)]
        [torch.Size([2]), torch.Size([1, 2])]
    """
    return list(_unflatten_dense_tensors(flat, list(tensors)))
