"""The ``amp_patch`` logger and the mapping from ``verbosity`` to logging levels."""

from __future__ import annotations

import logging
import os
from typing import Callable

logger = logging.getLogger("amp_patch")

_LEVELS = {0: logging.WARNING, 1: logging.INFO}


def _rank() -> int:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0"))


def configure(verbosity: int) -> Callable[[], None]:
    """Set the ``amp_patch`` logger's level from ``verbosity``, on rank 0 only.

    0 shows warnings and errors, 1 also the chosen properties and overflow
    messages, 2 and above debug detail. Ranks other than 0 show warnings only.
    When neither the application nor the root logger has a handler, one
    handler writing to stderr is added so that Apex-style messages are seen.

    Args:
        verbosity (int): 0, 1 or 2.

    Returns:
        callable: puts back the logger's level and propagate flag as they were
        before this call, and takes out the handler it added (the logger's
        ``handlers`` list stays the same list object). A session registers it
        with :meth:`~amp_patch.session.AmpSession.on_close`.

    Example::

        >>> restore = configure(2)
        >>> logging.getLogger("amp_patch").level == logging.DEBUG
        True
        >>> restore()
    """
    level, propagate = logger.level, logger.propagate
    added = None
    logger.setLevel(_LEVELS.get(verbosity, logging.DEBUG) if _rank() == 0 else logging.WARNING)
    if not logger.handlers and not logging.getLogger().handlers:
        added = logging.StreamHandler()
        added.setFormatter(logging.Formatter("amp_patch: %(message)s"))
        logger.addHandler(added)

    def restore() -> None:
        if added is not None:
            logger.removeHandler(added)
        logger.propagate = propagate
        logger.setLevel(level)

    return restore
