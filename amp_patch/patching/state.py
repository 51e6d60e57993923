"""The O1 casting state of a session, and :func:`disable_casts`.

:func:`amp_patch.patching.install` makes the live session's
:class:`CastState` the active one (:func:`active`) and registers the undo
that forgets it when the session closes; this module never looks the session
up.
"""

from __future__ import annotations

import contextlib
import threading
from typing import TYPE_CHECKING, Iterator

import torch

from amp_patch.patching.cache import WeightCastCache
from amp_patch.settings.dtypes import check_half_dtype

if TYPE_CHECKING:
    from amp_patch.patching.patcher import Patcher

__all__ = ["CastState", "disable_casts", "optimizer_step", "active", "set_active"]


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
        enabled (bool): False while any :func:`disable_casts` block is open,
            in any thread; the wrappers then call the original function
            untouched. A plain attribute, because the C wrappers read it on
            every call; only :meth:`paused` writes it.
        cache (WeightCastCache): the weight-cast cache; ``cache.clear()`` ends
            an iteration (``scale_loss`` calls it on exit, and
            :func:`optimizer_step` after each step).
        patches (Patcher or None): the installed O1 patches (set by
            :func:`amp_patch.patching.install`).
    """

    def __init__(self, half_dtype: torch.dtype, allow_banned: bool = False,
                 enable_caching: bool = True) -> None:
        self.half_dtype = check_half_dtype(half_dtype)
        self.allow_banned = allow_banned
        self.enabled = True
        # Open disable_casts blocks: a count, not a saved flag, so that blocks
        # ending out of order in different threads still turn casting back on.
        self._paused = 0
        self._closed = False
        self._pause_lock = threading.Lock()
        self.cache = WeightCastCache(enabled=enable_caching)
        self.patches: Patcher | None = None

    def __repr__(self) -> str:
        return (f"CastState(half_dtype={self.half_dtype}, enabled={self.enabled}, "
                f"allow_banned={self.allow_banned}, cached={len(self.cache)})")

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Turn casting off for the block; it is back on when the last open block ends.

        Example::

            >>> state = CastState(torch.bfloat16)
            >>> with state.paused():
            ...     assert not state.enabled
        """
        with self._pause_lock:
            self._paused += 1
            self.enabled = False
        try:
            yield
        finally:
            with self._pause_lock:
                self._paused -= 1
                self.enabled = self._paused == 0 and not self._closed

    def close(self) -> None:
        """Turn casting off for good: the session that made this state has ended.

        Undoing the patches puts torch's functions back, but code that took a
        wrapper while they were installed keeps it (torch's own modules do:
        inductor's kernel table holds ``torch.mm`` as it was when first
        imported). Such a wrapper must then call the function it wraps,
        untouched, as ``disable_casts`` makes it do.

        Example::

            >>> state = CastState(torch.bfloat16)
            >>> state.close()
            >>> with state.paused():
            ...     pass
            >>> state.enabled
            False
        """
        with self._pause_lock:
            self._closed = True
            self.enabled = False


#: The live session's state while its O1 patches are installed (see set_active).
_active: CastState | None = None


def active() -> CastState | None:
    """The live session's :class:`CastState` when O1 patching is installed, else None."""
    return _active


def set_active(state: CastState | None) -> None:
    """Make ``state`` the one :func:`active` returns; None when the session's patches go.

    Only :func:`amp_patch.patching.install` and its undo call it.

    Raises:
        RuntimeError: if another state is active (two sessions never patch at once).
    """
    global _active
    if state is not None and _active is not None and _active is not state:
        raise RuntimeError("amp_patch: another session's O1 patches are still installed")
    _active = state


@contextlib.contextmanager
def disable_casts() -> Iterator[None]:
    """Run the enclosed code with the O1 casting wrappers passing calls straight through.

    Casting is back on when the last open block ends, also when an exception
    escapes, so the blocks nest, in one thread or across threads. Outside O1
    (no live session, or a level that does not patch torch) it does nothing.

    .. note::
        The flag belongs to the session, not to a thread: code running in
        other threads at the same time (DataParallel replicas, say) also
        sees casting disabled.

    Example::

        >>> model, opt = amp.initialize(model, opt, opt_level="O1", half_dtype=torch.bfloat16)
        >>> a = b = torch.ones(2, 2)
        >>> with amp.disable_casts():
        ...     torch.mm(a, b).dtype   # no cast: runs in the inputs' dtypes
        torch.float32
    """
    state = active()
    if state is None:
        yield
        return
    with state.paused():
        yield


@contextlib.contextmanager
def optimizer_step() -> Iterator[None]:
    """The context amp runs an optimizer's ``step()`` in: casts off, the weight casts dropped after.

    Fused optimizer kernels (torch's ``fused=True`` ones and amp_patch's)
    write the parameters in place without moving their version counters, so
    the cache cannot tell that a step made its casts stale; without this, a
    loop that steps without a ``scale_loss`` exit in between (a bf16 O1 loop
    calling ``loss.backward()`` itself) would train on the first iteration's
    casts. The cache is dropped also when the step raises, which may have
    written some parameters. Outside O1 it does nothing.

    Example::

        >>> model, opt = amp.initialize(model, opt, opt_level="O1", half_dtype=torch.bfloat16)
        >>> with optimizer_step():
        ...     opt.step()
        >>> len(active().cache)
        0
    """
    try:
        with disable_casts():
            yield
    finally:
        state = active()
        if state is not None:
            state.cache.clear()
