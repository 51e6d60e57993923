"""The O1 weight-cast cache: each fp32 weight is cast at most once per iteration per dtype."""

from __future__ import annotations

import weakref
from typing import NamedTuple

import torch

from amp_patch.settings.dtypes import HALF_DTYPES

__all__ = ["WeightCastCache", "cacheable"]

#: The dtypes an fp32 parameter is cast to (the keys' second half).
_TARGETS = tuple(HALF_DTYPES)
#: TensorBase's own conversions: the same ``aten::_to_copy`` (and autograd edge) as
#: ``param.to(dtype)``, without its argument parsing, on the path that runs once per weight
#: per iteration.
_CONVERT = {torch.float16: torch._C.TensorBase.half, torch.bfloat16: torch._C.TensorBase.bfloat16,
            torch.float32: torch._C.TensorBase.float}


def cacheable(tensor: torch.Tensor) -> bool:
    """True for what the cache holds: fp32 leaf tensors that require grad (parameters).

    Args:
        tensor (torch.Tensor): any tensor.
    """
    return tensor.dtype is torch.float32 and tensor.requires_grad and tensor.is_leaf


class _Entry(NamedTuple):
    # csrc/o1_wrappers.cpp reads entries by position and key (id(param), dtype): keep both.
    cast: torch.Tensor
    version: int
    # The storage address. It changes with ``param.data = ...`` and with a move
    # to another device: a new storage, and under CUDA's unified virtual
    # addressing host and device allocations never share an address. So it
    # also stands for the device check, which would cost more per call.
    data_ptr: int
    made_with_grad: bool


class WeightCastCache:
    """Casts of fp32 parameters to a lower precision, reused within one iteration.

    Keys are the parameters, held weakly: an entry goes away with its
    parameter. An entry is made again when the parameter's version counter
    moved (an optimizer step or an in-place edit), when its storage was
    replaced (``param.data = ...``, a move to another device), or when it
    was made under ``no_grad`` and the current call records gradients.

    A cast made with grad enabled is the output of ``param.to(dtype)`` and
    carries its autograd edge, so gradients reach the fp32 parameter through
    a cached cast exactly as through a fresh one.

    .. note::
        A cast made with grad enabled references its parameter through that
        autograd edge, so until :meth:`clear` runs it keeps the parameter
        alive, as ``torch.autocast``'s cache does until its region exits.
        ``scale_loss`` clears the cache on exit; casts made under
        ``no_grad`` hold no such reference.

    Args:
        enabled (bool, optional): False makes :meth:`cast` a plain cast.
            Default: True.

    Attributes:
        casts (int): casts made through this cache so far (for tests and
            diagnostics).
        digest (int): a running digest of the sizes of those casts, in their
            order, which a cache hit instead of a cast changes (compared across
            ranks by ``AMP_PATCH_DEBUG_RANKS=1``, see
            :mod:`amp_patch.frontend.debug`).

    Example::

        >>> cache = WeightCastCache()
        >>> w16 = cache.cast(linear.weight, torch.bfloat16)
        >>> cache.cast(linear.weight, torch.bfloat16) is w16
        True
    """

    #: The entries' type (the C wrapper makes entries of it too).
    ENTRY = _Entry
    #: :attr:`digest`'s rule: ``digest * DIGEST_MULTIPLIER + numel + 1``, modulo ``DIGEST_MOD``
    #: (which keeps it exact in a float64, and the product within 128 bits in the C wrapper).
    DIGEST_MULTIPLIER = 1_000_003
    DIGEST_MOD = (1 << 47) - 115

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self.casts = 0
        self.digest = 0
        self._entries: dict[tuple[int, torch.dtype], _Entry] = {}
        self._refs: dict[int, weakref.ref] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def cast(self, param: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``param.to(dtype)``, reused while the entry is valid.

        Args:
            param (torch.Tensor): an fp32 leaf that requires grad (see
                :func:`cacheable`); other tensors are cast without caching.
            dtype (torch.dtype): the target dtype.

        Returns:
            torch.Tensor: the cast.
        """
        if not cacheable(param):
            return param.to(dtype)
        return self.lookup(param, dtype)

    def lookup(self, param: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """:meth:`cast` for a ``param`` already known to be :func:`cacheable` (the wrappers' path)."""
        entry = self._entries.get((id(param), dtype))
        # Indexing rather than names: this is the per-call hot path (see _Entry).
        if (entry is not None and entry[1] == param._version and entry[2] == param.data_ptr()
                and (entry[3] or not torch.is_grad_enabled())):
            return entry[0]
        return self._make(param, dtype)

    def _make(self, param: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        convert = _CONVERT.get(dtype)
        cast = param.to(dtype) if convert is None else convert(param)
        if not self.enabled:
            return cast
        self.casts += 1
        self.digest = (self.digest * self.DIGEST_MULTIPLIER + param.numel() + 1) % self.DIGEST_MOD
        pid = id(param)
        if pid not in self._refs:
            self._refs[pid] = weakref.ref(param, self._forget_callback(pid))
        self._entries[(pid, dtype)] = _Entry(cast, param._version, param.data_ptr(),
                                             torch.is_grad_enabled())
        return cast

    def _forget_callback(self, pid: int):
        this = weakref.ref(self)

        def forget(_ref: weakref.ref) -> None:
            cache = this()
            if cache is not None:
                cache._forget(pid)
        return forget

    def _forget(self, pid: int) -> None:
        self._refs.pop(pid, None)
        for key in [k for k in self._entries if k[0] == pid]:
            del self._entries[key]

    def forget(self, params) -> None:
        """Drop every entry of each of ``params``: their next use casts again.

        For parameters whose storage is refilled without a version bump, such
        as FSDP2's unsharded parameters, which every all-gather writes anew
        into a storage freed and reallocated in place: an allocator that hands
        the same address back would otherwise make a stale entry look valid
        (see :mod:`amp_patch.patching.regather`).

        Args:
            params (iterable of torch.Tensor): the parameters.

        Example::

            >>> cache.forget([linear.weight])
            >>> cache.cast(linear.weight, torch.bfloat16)  # cast anew
        """
        entries = self._entries
        if not entries:
            return
        for param in params:
            pid = id(param)
            for dtype in _TARGETS:
                entries.pop((pid, dtype), None)

    def drop_no_grad_entries(self) -> None:
        """Drop the casts made with grad disabled (the O1 hooks do this as an evaluation forward
        starts); casts made with grad enabled stay until :meth:`clear`."""
        for key in [k for k, e in self._entries.items() if not e.made_with_grad]:
            del self._entries[key]

    def clear(self) -> None:
        """Drop every entry: the next use of each weight casts it again (one iteration ended).

        The weak references to the parameters stay: they keep nothing alive, and
        making them anew each iteration (a weakref and its callback per weight)
        was most of the Python work of a cache miss.
        """
        self._entries.clear()
