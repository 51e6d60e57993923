"""Apex's fused optimizers, as users import them: ``from amp_patch.optimizers import FusedAdam``.

The classes live in :mod:`amp_patch.optim.fused` (docs/optimizers.md); ``amp-patch run``
serves the same classes as ``apex.optimizers``.

Example:
    >>> import torch
    >>> from amp_patch.optimizers import FusedAdam
    >>> FusedAdam(torch.nn.Linear(2, 2).parameters(), lr=1e-3).defaults["lr"]
    0.001
"""

from amp_patch.optim import fused as _fused
from amp_patch.optim.fused import *  # noqa: F403  (the names of its __all__)

__all__ = list(_fused.__all__)
