"""The floating dtypes amp works with: the half dtypes, and the dtypes it casts.

A module of its own, importing nothing from amp_patch, so that every part
(properties, O1's wrappers, model casting, master weights, the fused
optimizers, FSDP2 support, the CPU half detection) can import it without an
import cycle.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

import torch

__all__ = ["OPTIMIZER_STATE_NAMES", "MASTER_WEIGHT_DTYPES",
           "HALF_DTYPES", "HALF_DTYPE_NAMES", "HALF_DTYPE_SPELLINGS", "CASTABLE_DTYPES",
           "check_half_dtype", "half_dtype_name", "parse_half_dtype"]

#: The half dtypes by their short names (the CLI's ``--half-dtype``, reports, JSON, test
#: ids), bf16 first: the order tools list them in.
HALF_DTYPE_NAMES: Mapping[str, torch.dtype] = MappingProxyType(
    {"bf16": torch.bfloat16, "fp16": torch.float16})

#: The half dtypes: what amp computes in, and the parameter dtypes that get an fp32 master.
HALF_DTYPES = frozenset(HALF_DTYPE_NAMES.values())

#: The precisions ``initialize(optimizer_state=...)`` takes, from the widest; each is a
#: :class:`amp_patch.optim.fused.state_format.StateFormat` of that name.
OPTIMIZER_STATE_NAMES = ("fp32", "bf16", "int8", "fp8")
#: ``initialize(master_weights=...)``'s values besides True/False: the masters' dtype by name.
MASTER_WEIGHT_DTYPES: Mapping[str, torch.dtype] = MappingProxyType({"bf16": torch.bfloat16})

#: Every name :func:`parse_half_dtype` takes: the short names, torch's names, and "half".
HALF_DTYPE_SPELLINGS: Mapping[str, torch.dtype] = MappingProxyType({
    **HALF_DTYPE_NAMES, "bfloat16": torch.bfloat16, "float16": torch.float16,
    "half": torch.float16})

_SHORT_NAMES = {dtype: name for name, dtype in HALF_DTYPE_NAMES.items()}

#: The floating dtypes amp casts, from and to (O1's wrappers, the model cast, inputs and
#: outputs); float64 is left as the caller made it.
CASTABLE_DTYPES = HALF_DTYPES | {torch.float32}


def check_half_dtype(value: Any, name: str = "half_dtype") -> torch.dtype:
    """Return ``value`` if it is a half dtype, else raise ValueError naming what was expected.

    Args:
        value: the dtype given.
        name (str, optional): the argument's name, for the message. Default: ``"half_dtype"``.

    Returns:
        torch.dtype: ``value``.

    Example::

        >>> check_half_dtype(torch.bfloat16)
        torch.bfloat16
        >>> check_half_dtype(torch.float32)
        Traceback (most recent call last):
        ValueError: half_dtype must be torch.float16 or torch.bfloat16, got torch.float32
    """
    if not (isinstance(value, torch.dtype) and value in HALF_DTYPES):
        raise ValueError(f"{name} must be torch.float16 or torch.bfloat16, got {value!r}")
    return value


def half_dtype_name(dtype: torch.dtype) -> str:
    """The short name of a half dtype: ``"bf16"`` or ``"fp16"``.

    Raises:
        ValueError: if ``dtype`` is not a half dtype.

    Example::

        >>> half_dtype_name(torch.float16)
        'fp16'
    """
    return _SHORT_NAMES[check_half_dtype(dtype, "dtype")]


def parse_half_dtype(name: str) -> torch.dtype:
    """The half dtype a name spells (any of :data:`HALF_DTYPE_SPELLINGS`, any case).

    Raises:
        ValueError: for any other name, listing the names.

    Example::

        >>> parse_half_dtype("BF16")
        torch.bfloat16
    """
    dtype = HALF_DTYPE_SPELLINGS.get(name.strip().lower()) if isinstance(name, str) else None
    if dtype is None:
        raise ValueError(f"unknown half dtype {name!r}; choose from "
                         f"{', '.join(HALF_DTYPE_SPELLINGS)}")
    return dtype
