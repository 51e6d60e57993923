"""The floating dtypes amp works with: the half dtypes, and the dtypes it casts.

A module of its own, importing nothing from amp_patch, so that every part
(properties, O1's wrappers, model casting, master weights, the fused
optimizers, FSDP2 support, the CPU half detection) can import it without an
import cycle.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["HALF_DTYPES", "CASTABLE_DTYPES", "check_half_dtype"]

#: The half dtypes: what amp computes in, and the parameter dtypes that get an fp32 master.
HALF_DTYPES = frozenset({torch.float16, torch.bfloat16})

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
