"""Apex's ``apex.multi_tensor_apply``: the launcher object that ``amp_C`` kernels are called through.

Apex scripts call fused kernels as::

    from apex.multi_tensor_apply import multi_tensor_applier
    import amp_C

    multi_tensor_applier(amp_C.multi_tensor_scale, noop_flag, [src, dst], 1.0 / scale)

The applier only prepends its chunk size to the arguments; the chunking itself
is done inside amp_patch's kernels (see :mod:`amp_patch.ops`), so the chunk
size is accepted for compatibility and otherwise ignored.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

from torch import Tensor

__all__ = ["MultiTensorApply", "multi_tensor_applier"]


class MultiTensorApply:
    """Calls ``op(chunk_size, noop_flag, tensor_lists, *args)``, as Apex's class of the same name.

    Args:
        chunk_size (int): elements per chunk, passed to the op first.

    Example::

        >>> applier = MultiTensorApply(2048 * 32)
        >>> applier(amp_patch.apex_compat.amp_C.multi_tensor_scale, noop, [src, dst], 0.5)
    """

    #: Apex's flag that the fused kernels were built; amp_patch always has them
    #: (compiled, or the reference ops when the extension is absent).
    available = True
    warned = False

    def __init__(self, chunk_size: int) -> None:
        self.chunk_size = chunk_size

    @staticmethod
    def check_avail() -> None:
        """Apex raised here when its extension was missing; amp_patch's kernels always exist."""

    def __call__(
        self,
        op: Callable[..., Any],
        noop_flag_buffer: Tensor,
        tensor_lists: Sequence[Sequence[Tensor]],
        *args: Any,
    ) -> Any:
        return op(self.chunk_size, noop_flag_buffer, tensor_lists, *args)


#: The applier Apex scripts import, with Apex's default chunk size.
multi_tensor_applier = MultiTensorApply(2048 * 32)
