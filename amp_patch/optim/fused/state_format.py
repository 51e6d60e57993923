"""How a fused optimizer stores its per-parameter state (``optimizer_state``): fp32, bf16,
block-scaled int8 or fp8.

A :class:`StateFormat` names the code of each kind of state tensor (the first
moment or momentum, and the second moment) and which parameters get it. A
:class:`QuantizedState` is one state tensor as stored: its codes and their
scales, together, with the one encode and decode. The arithmetic of the codes
and of the steps over them is :mod:`amp_patch.ops.lean_state_ops`'.

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
from typing import Any, Mapping, NamedTuple

import torch
from torch import Tensor

from amp_patch.ops.lean_state_ops import BLOCK_SIZE, SCALED_CODES, decode, encode, scale_shape
from amp_patch.settings.dtypes import OPTIMIZER_STATE_NAMES

__all__ = ["QuantizedState", "StateFormat", "STATE_FORMATS", "FORMAT_NAMES", "get", "SCALE_SUFFIX",
           "SCALED_CODES"]

#: A block-scaled ``state[p][key]`` keeps its scales in ``state[p][key + SCALE_SUFFIX]``.
SCALE_SUFFIX = "_scale"


class QuantizedState(NamedTuple):
    """One state tensor as stored: its codes and, for block-scaled codes, their scales.

    A value that knows its own format (as torchao's ``OptimState8bit`` does, without
    a tensor subclass): :meth:`decode` needs nothing else. The scales of block-scaled
    codes (:data:`SCALED_CODES`) are fp32, one per ``block_size`` elements of a row;
    other codes have none. In an optimizer's ``state[p]`` the codes are stored under
    their key and the scales under ``key + SCALE_SUFFIX`` (:meth:`load`, :meth:`store`),
    so a checkpoint holds two plain tensors.

    Args:
        codes (Tensor): the state in its code (float32, bfloat16, int8, uint8, float8_e4m3fn).
        scales (Tensor, optional): fp32 scales of shape ``scale_shape(codes)``; None for
            codes that are values themselves.
        block_size (int, optional): elements per scale. Default: 256.

    Example::

        >>> q = QuantizedState.encode(torch.tensor([0.5, -1.0, 0.25]), torch.int8)
        >>> q.codes, q.scales
        (tensor([  64, -127,   32], dtype=torch.int8), tensor([[1.]]))
        >>> q.decode()
        tensor([ 0.5039, -1.0000,  0.2520])
        >>> q.in_code(torch.bfloat16).scales is None
        True
    """

    codes: Tensor
    scales: Tensor | None = None
    block_size: int = BLOCK_SIZE

    @property
    def dtype(self) -> torch.dtype:
        """The code."""
        return self.codes.dtype

    @classmethod
    def encode(cls, values: Tensor, dtype: torch.dtype,
               block_size: int = BLOCK_SIZE) -> QuantizedState:
        """``values`` (fp32) stored in code ``dtype``."""
        return cls(*encode(values, dtype, block_size), block_size)

    @classmethod
    def zeros(cls, like: Tensor, dtype: torch.dtype,
              block_size: int = BLOCK_SIZE) -> QuantizedState:
        """Zero state of code ``dtype`` shaped like ``like``, and zero scales if scaled.

        Codes that are values keep ``like``'s layout, as torch's optimizers keep
        their state. A DTensor ``like`` (FSDP2's sharded params) gives DTensors
        sharded alike, the scales along dim 0 with their rows, so that
        distributed checkpoints save each rank's shard.
        """
        if dtype not in SCALED_CODES:
            return cls(torch.zeros_like(like, dtype=dtype, memory_format=torch.preserve_format),
                       None, block_size)
        codes = torch.zeros_like(like, dtype=dtype, memory_format=torch.contiguous_format)
        local = _local(like)
        scales = torch.zeros(scale_shape(local, block_size), dtype=torch.float32,
                             device=local.device)
        return cls(codes, _like_sharding(scales, like, block_size), block_size)

    @classmethod
    def load(cls, entry: Mapping[str, Any], key: str,
             block_size: int = BLOCK_SIZE) -> QuantizedState | None:
        """The state stored under ``key`` of an optimizer's ``state[p]``, or None."""
        codes = entry.get(key)
        return None if codes is None else cls(codes, entry.get(key + SCALE_SUFFIX), block_size)

    def store(self, entry: dict[str, Any], key: str) -> None:
        """Store under ``key`` of ``state[p]``: the codes, and the scales beside them (a stale
        scales entry is dropped)."""
        entry[key] = self.codes
        if self.scales is None:
            entry.pop(key + SCALE_SUFFIX, None)
        else:
            entry[key + SCALE_SUFFIX] = self.scales

    def decode(self) -> Tensor:
        """The fp32 values (of the local shard, for a DTensor)."""
        return decode(_local(self.codes), None if self.scales is None else _local(self.scales),
                      self.block_size)

    def is_in(self, dtype: torch.dtype) -> bool:
        """Whether this state is stored in code ``dtype`` (with scales exactly when scaled)."""
        return QuantizedState.stored_in(self.codes, self.scales, dtype)

    @staticmethod
    def stored_in(codes: Tensor, scales: Tensor | None, dtype: torch.dtype) -> bool:
        """Whether ``codes`` and ``scales`` hold a state in code ``dtype`` (:meth:`is_in` of the
        pair, before it is made a :class:`QuantizedState`: the step asks it of every tensor)."""
        return codes.dtype == dtype and (scales is None) == (dtype not in SCALED_CODES)

    def in_code(self, dtype: torch.dtype) -> QuantizedState:
        """This state in code ``dtype``: itself when it is stored so, else decoded and encoded.

        Used when the format changed since the state was made (an optimizer
        stepped before :func:`amp_patch.initialize`, a checkpoint saved under
        another format, :func:`amp_patch.deinitialize`).
        """
        if self.is_in(dtype):
            return self
        codes, scales = encode(self.decode(), dtype, self.block_size)
        like = self.codes
        return QuantizedState(
            _like_sharding(codes, like, None),
            None if scales is None else _like_sharding(scales, like, self.block_size),
            self.block_size)


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
    def low_precision(self) -> bool:
        """True for every format but ``fp32``: the steps take the low-precision state ops."""
        return self.first != torch.float32 or self.second != torch.float32

    def codes(self, p: Tensor) -> tuple[torch.dtype, torch.dtype]:
        """``(first, second)``: the codes of ``p``'s state under this format."""
        scaled = self.first in SCALED_CODES or self.second in SCALED_CODES
        if scaled and (p.dim() < 2 or p.numel() < self.min_numel):
            return torch.float32, torch.float32
        return self.first, self.second


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
