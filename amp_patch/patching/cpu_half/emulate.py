"""The emulating wrappers: matmul-class ops computed on fp32 copies of their half inputs.
"""

from __future__ import annotations

import functools
import logging
from typing import Any, Callable

import torch
import torch.nn.functional as F

# The settings own the modes; the names here stay public.

logger = logging.getLogger("amp_patch")


#: Matmul-class ops by namespace. Tensor.__rmatmul__ is absent: it calls torch.matmul.
_MATMUL = (
    (torch, "torch", ("matmul", "mm", "bmm", "addmm", "baddbmm", "addbmm", "mv", "addmv", "dot",
                      "einsum", "linalg.matmul", "linalg.multi_dot")),
    (F, "torch.nn.functional", ("linear", "scaled_dot_product_attention")),
    (torch.Tensor, "torch.Tensor", ("matmul", "__matmul__", "mm", "bmm", "addmm", "baddbmm",
                                    "addbmm", "mv", "addmv", "dot",
                                    "addmm_", "baddbmm_", "addbmm_", "addmv_")),
)
_CONV_NAMES = ("conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d",
               "conv_transpose3d", "conv_tbc")
_CONV = (
    (torch, "torch", _CONV_NAMES + ("convolution",)),
    (F, "torch.nn.functional", _CONV_NAMES),
)


def targets(matmul: bool = True, conv: bool = True) -> list[tuple[Any, str, str]]:
    """The attributes that emulation patches: ``(namespace, printable prefix, name)``.

    Names ending in ``_`` are in-place Tensor methods. Names the installed
    torch lacks are skipped when patching.

    Args:
        matmul (bool, optional): include the matmul-class ops. Default: True.
        conv (bool, optional): include the convolutions. Default: True.
    """
    groups = (_MATMUL if matmul else ()) + (_CONV if conv else ())
    return [(ns, prefix, name) for ns, prefix, names in groups for name in names]


_Tensor = torch.Tensor
_FP32 = torch.float32
_SEQUENCES = (list, tuple)
# TensorBase's own methods: never a patched version, and no argument parsing.
_widen_one = torch._C.TensorBase.float
_copy = torch._C.TensorBase.copy_
_NARROW = {torch.bfloat16: torch._C.TensorBase.bfloat16, torch.float16: torch._C.TensorBase.half}


def _scan(items, dtype: torch.dtype) -> int:
    """1 when ``items`` (lists and tuples inside too) hold a CPU ``dtype`` tensor and no other
    floating or complex tensor; -1 when they hold another one; 0 when no floating tensor.

    The emulating wrappers' pre-check: it allocates nothing.
    """
    found = 0
    for a in items:
        if isinstance(a, _Tensor):
            d = a.dtype
            if d is dtype and a.is_cpu:
                found = 1
            elif d is dtype or d.is_floating_point or d.is_complex:
                return -1
        elif isinstance(a, _SEQUENCES):
            inner = _scan(a, dtype)
            if inner < 0:
                return -1
            found |= inner
    return found


def _widen(items, dtype: torch.dtype) -> list:
    """``items`` with every ``dtype`` tensor replaced by an fp32 copy (lists and tuples
    inside too)."""
    out: list[Any] = []
    for a in items:
        if isinstance(a, _Tensor):
            out.append(_widen_one(a) if a.dtype is dtype else a)
        elif isinstance(a, _SEQUENCES):
            out.append(type(a)(_widen(a, dtype)))
        else:
            out.append(a)
    return out


def _emulator(original: Callable, dtype: torch.dtype, name: str) -> Callable:
    """A wrapper that runs ``original`` on fp32 copies of its CPU ``dtype`` inputs and rounds
    the output to ``dtype``; any other call (CUDA, fp32, mixed dtypes) goes straight through.

    ``out=`` receives the rounded result. An in-place method (``name`` ending
    in ``_``) works on an fp32 copy of ``self`` and copies it back, rounding once.
    """
    narrow = _NARROW[dtype]
    in_place = name.endswith("_") and not name.endswith("__")

    def emulated(*args, **kwargs):
        found = _scan(args, dtype)
        if kwargs and found >= 0:
            in_kwargs = _scan(kwargs.values(), dtype)
            found = -1 if in_kwargs < 0 else found | in_kwargs
        if found <= 0 or (in_place and args[0].dtype is not dtype):
            return original(*args, **kwargs)
        wide = _widen(args, dtype)
        dest = None
        if kwargs:
            dest = kwargs.get("out")
            keys = [k for k in kwargs if k != "out"]
            kwargs = dict(zip(keys, _widen([kwargs[k] for k in keys], dtype)))
        if in_place:
            original(*wide, **kwargs)
            return _copy(args[0], wide[0])
        result = original(*wide, **kwargs)
        if dest is not None:
            return _copy(dest, result)
        if isinstance(result, _Tensor) and result.dtype is _FP32:
            return narrow(result)
        return result

    functools.update_wrapper(emulated, original)  # every target is a named torch callable
    emulated._amp_patch_cpu_half = dtype  # type: ignore[attr-defined]  # marks our wrappers
    return emulated
