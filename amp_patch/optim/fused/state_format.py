"""How a fused optimizer stores its per-parameter state: fp32, bf16, block-scaled int8 or fp8.

A :class:`StateFormat` names the code of each kind of state tensor (the first
moment or momentum, and the second moment) and which parameters get it. The
codes themselves, and the arithmetic of the steps over them, are
:mod:`amp_patch.ops.lean_state_ops`'.

=========  ==========================  ==========================  =================
name       first moment / momentum     second moment               bytes per param
=========  ==========================  ==========================  =================
``fp32``   float32                     float32                     8 (Adam), 4 (SGD)
``bf16``   bfloat16                    bfloat16                    4, 2
``int8``   int8, linear, block-scaled  uint8 of sqrt(v), linear    2.03, 1.02
``fp8``    float8_e4m3fn, block-scaled bfloat16                    3.02, 1.02
=========  ==========================  ==========================  =================

Block-scaled codes keep one fp32 scale per :data:`~amp_patch.ops.lean_state_ops.BLOCK_SIZE`
(256) elements of a row. As in bitsandbytes, they apply only to tensors of
two or more dimensions with at least :attr:`StateFormat.min_numel` (4096)
elements; the others (biases, norms: a small share of the parameters) keep
fp32 state, which costs little and spares the tensors whose blocks would be
one row of a few elements. ``fp8`` keeps the second moment in bf16: the
square of a gradient spans more binades than e4m3 holds beside one block
scale (2**17), and Adam divides by its square root, so an element that
underflows to 0 would take a step of ``lr * m / eps``; the ``int8`` code
avoids that with its square-root code, which never reads back 0 in a block
that is not all zero.

Example::

    >>> fmt = STATE_FORMATS["int8"]
    >>> fmt.codes(torch.empty(512, 512))
    (torch.int8, torch.uint8)
    >>> fmt.codes(torch.empty(512))          # 1-D: fp32 state
    (torch.float32, torch.float32)
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from amp_patch.ops.lean_state_ops import BLOCK_SIZE, SCALED_CODES, decode, encode, scale_shape
from amp_patch.settings.dtypes import OPTIMIZER_STATE_NAMES

__all__ = ["StateFormat", "STATE_FORMATS", "FORMAT_NAMES", "get", "SCALE_SUFFIX", "SCALED_CODES"]

#: A block-scaled ``state[p][key]`` keeps its scales in ``state[p][key + SCALE_SUFFIX]``.
SCALE_SUFFIX = "_scale"


@dataclasses.dataclass(frozen=True)
class StateFormat:
    """The codes of an optimizer's state tensors.

    Args:
        name (str): the name :func:`amp_patch.initialize` takes (``optimizer_state=``).
        first (torch.dtype): code of the first moment (Adam) and momentum (SGD).
        second (torch.dtype): code of the second moment (Adam).
        block_size (int): elements per scale of the block-scaled codes.
        min_numel (int): the smallest tensor (of two or more dimensions) that
            takes block-scaled codes; smaller ones keep fp32 state.
    """

    name: str
    first: torch.dtype
    second: torch.dtype
    block_size: int = BLOCK_SIZE
    min_numel: int = 4096

    @property
    def is_lean(self) -> bool:
        """True for every format but ``fp32``."""
        return self.first != torch.float32 or self.second != torch.float32

    def codes(self, p: Tensor) -> tuple[torch.dtype, torch.dtype]:
        """``(first, second)``: the codes of ``p``'s state under this format."""
        scaled = self.first in SCALED_CODES or self.second in SCALED_CODES
        if scaled and (p.dim() < 2 or p.numel() < self.min_numel):
            return torch.float32, torch.float32
        return self.first, self.second

    def zeros(self, like: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor | None]:
        """New state of code ``dtype`` shaped like ``like``: zeros, and zero scales if scaled.

        A DTensor ``like`` (FSDP2's sharded params) gives DTensors sharded alike,
        the scales along dim 0 with their rows, so that distributed checkpoints
        save each rank's shard.
        """
        if dtype not in SCALED_CODES:  # the param's layout, as torch's optimizers keep it
            return torch.zeros_like(like, dtype=dtype, memory_format=torch.preserve_format), None
        codes = torch.zeros_like(like, dtype=dtype, memory_format=torch.contiguous_format)
        local = _local(like)
        scales = torch.zeros(scale_shape(local, self.block_size), dtype=torch.float32,
                             device=local.device)
        return codes, _like_sharding(scales, like, self.block_size)

    def convert(self, codes: Tensor, scales: Tensor | None, dtype: torch.dtype,
                ) -> tuple[Tensor, Tensor | None]:
        """State stored as ``codes`` (and ``scales``) in code ``dtype``: decoded, then encoded.

        Used when the format changed since the state was made (an optimizer
        stepped before :func:`amp_patch.initialize`, a checkpoint saved under
        another format, :func:`amp_patch.deinitialize`).
        """
        local_codes = _local(codes)
        values = decode(local_codes, None if scales is None else _local(scales), self.block_size)
        new_codes, new_scales = encode(values, dtype, self.block_size)
        return (_like_sharding(new_codes, codes, None),
                None if new_scales is None else _like_sharding(new_scales, codes, self.block_size))


STATE_FORMATS: dict[str, StateFormat] = {
    f.name: f for f in (
        StateFormat("fp32", torch.float32, torch.float32),
        StateFormat("bf16", torch.bfloat16, torch.bfloat16),
        StateFormat("int8", torch.int8, torch.uint8),
        StateFormat("fp8", torch.float8_e4m3fn, torch.bfloat16),
    )
}
#: The names, in order of bytes saved.
FORMAT_NAMES = tuple(STATE_FORMATS)
if FORMAT_NAMES != OPTIMIZER_STATE_NAMES:  # the settings layer validates these names
    raise RuntimeError(f"state formats {FORMAT_NAMES} differ from amp_patch.settings.dtypes."
                       f"OPTIMIZER_STATE_NAMES {OPTIMIZER_STATE_NAMES}")


def get(name: str | StateFormat) -> StateFormat:
    """The format called ``name`` (a :class:`StateFormat` is returned as it is).

    Raises:
        ValueError: an unknown name, listing the known ones.

    Example::

        >>> get("fp8").first
        torch.float8_e4m3fn
    """
    if isinstance(name, StateFormat):
        return name
    try:
        return STATE_FORMATS[name]
    except (KeyError, TypeError):
        raise ValueError(f"optimizer_state must be one of {', '.join(map(repr, FORMAT_NAMES))}, "
                         f"got {name!r}") from None


def _local(t: Tensor) -> Tensor:
    from amp_patch.helpers.tensors import local_tensor

    return local_tensor(t)


def _like_sharding(local: Tensor, like: Tensor, block_size: int | None) -> Tensor:
    """``local`` as a DTensor sharded as ``like`` is (rows along dim 0), when ``like`` is one."""
    if _local(like) is like:
        return local
    from torch.distributed.tensor import DTensor

    if block_size is None:  # same shape as like
        shape, stride = like.shape, like.stride()
    else:
        rows = like.shape[0] if like.dim() >= 2 else 1
        blocks = scale_shape(like.shape, block_size)[1]
        shape, stride = torch.Size((rows, blocks)), (blocks, 1)
    return DTensor.from_local(local, like.device_mesh, like.placements,  # type: ignore[attr-defined]
                              run_check=False,
                              shape=shape, stride=stride)
