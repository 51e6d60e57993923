"""The ``amp_patch`` logger and the mapping from ``verbosity`` to logging levels."""

from __future__ import annotations

import logging
import os

logger = logging.getLogger("amp_patch")

_LEVELS = {0: logging.WARNING, 1: logging.INFO}
_handler: logging.Handler | None = None


def _rank() -> int:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0"))


def configure(verbosity: int) -> None:
    """Set the ``amp_patch`` logger's level from ``verbosity``, on rank 0 only.

    0 shows warnings and errors, 1 also the chosen properties and overflow
    messages, 2 and above debug detail. Ranks other than 0 show warnings only.
    When neither the application nor the root logger has a handler, one
    handler writing to stderr is added so that Apex-style messages are seen.

    Args:
        verbosity (int): 0, 1 or 2.
    """
    global _handler
    level = _LEVELS.get(verbosity, logging.DEBUG) if _rank() == 0 else logging.WARNING
    logger.setLevel(level)
    if _handler is None and not logger.handlers and not logging.getLogger().handlers:
        _handler = logging.StreamHandler()
        _handler.setFormatter(logging.Formatter("amp_patch: %(message)s"))
        logger.addHandler(_handler)
