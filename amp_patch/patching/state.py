"""The O1 casting state of a session, and :func:`disable_casts`."""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

from amp_patch import session as _session
from amp_patch.patching.cache import WeightCastCache

__all__ = ["CastState", "disable_casts", "active"]


class CastState:
    """What the O1 wrappers read on every call.

    The wrappers close over one instance and read :attr:`enabled` first, so
    turning casting off and on is a flag flip, never a re-patch.

    Args:
        half_dtype (torch.dtype): ``torch.float16`` or ``torch.bfloat16``; what
            the half list casts to.
        allow_banned (bool, optional): run banned functions in fp32 instead of
            raising. Default: False.
        enable_caching (bool, optional): cast each fp32 weight once per
            iteration through :attr:`cache`. Default: True.

    Attributes:
        enabled (bool): False while inside :func:`disable_casts`; the wrappers
            then call the original function untouched.
        cache (WeightCastCache): the weight-cast cache; ``cache.clear()`` ends
            an iteration (``scale_loss`` calls it on exit).
        patches (Patcher or None): the installed O1 patches (set by
            :func:`amp_patch.patching.install`).
    """

    def __init__(self, half_dtype: torch.dtype, allow_banned: bool = False,
                 enable_caching: bool = True) -> None:
        if half_dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(f"half_dtype must be torch.float16 or torch.bfloat16, got {half_dtype!r}")
        self.half_dtype = half_dtype
        self.allow_banned = allow_banned
        self.enabled = True
        self.cache = WeightCastCache(enabled=enable_caching)
        self.patches = None

    def __repr__(self) -> str:
        return (f"CastState(half_dtype={self.half_dtype}, enabled={self.enabled}, "
                f"allow_banned={self.allow_banned}, cached={len(self.cache)})")


def active() -> CastState | None:
    """The live session's :class:`CastState` when O1 patching is installed, else None."""
    live = _session.current()
    return None if live is None else live.casts


@contextlib.contextmanager
def disable_casts() -> Iterator[None]:
    """Run the enclosed code with the O1 casting wrappers passing calls straight through.

    The previous state is restored on exit, also when an exception escapes,
    so the contexts nest. Outside O1 (no live session, or a level that does
    not patch torch) it does nothing.

    .. note::
        The flag belongs to the session, not to a thread: code running in
        other threads at the same time (DataParallel replicas, say) also
        sees casting disabled.

    Example::

        >>> with amp.disable_casts():
        ...     y = torch.mm(a, b)   # no cast: runs in the inputs' dtypes
    """
    state = active()
    if state is None:
        yield
        return
    previous, state.enabled = state.enabled, False
    try:
        yield
    finally:
        state.enabled = previous
