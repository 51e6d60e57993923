"""The state of one optimizer's grads between two steps, and its legal moves, checked here.

As ``torch.amp.GradScaler`` keeps an ``OptState`` (READY, UNSCALED, STEPPED)
per optimizer, each :class:`~amp_patch.optim.amp.OptimizerRecord` keeps a
:class:`GradStates`: which :class:`GradState` its grads are in, moved only by
:meth:`GradStates.move`, which refuses a move that is not in :data:`MOVES`
with a :class:`GradStateError` naming both states and the call. The tensors
themselves (the stashed grads, the grads kept for the one-pass step, the
device's overflow flag) are data the record keeps beside the state.

**The verdict outlives its state.** A skip decided at one ``scale_loss`` exit
holds for the next ``step()``, however many blocks (a second loss) or
``zero_grad`` calls come first, as in Apex. So the tracker keeps the verdict
of the iteration's checked exits (:attr:`GradStates.pending_skip`: None,
``SKIP_ON_DEVICE`` with its flag in :attr:`GradStates.found_inf`, or
``SKIP_ON_HOST``) until a step takes it, while :attr:`GradStates.state` goes
on to say where the grads are. docs/design.md, "The grads' states", draws the
machine.
"""

from __future__ import annotations

import contextlib
import enum
from typing import Iterator

import torch
from torch import Tensor

__all__ = ["GradState", "GradStateError", "GradStates", "MOVES"]


class GradState(enum.Enum):
    """Where one optimizer's grads are between two steps."""

    #: Nothing of an iteration yet: the record was just made.
    READY = "ready"
    #: ``zero_grad()`` ran: no grads, or zeros.
    ZEROED = "zeroed"
    #: A ``scale_loss`` block is open: the grads of earlier blocks (unscaled) are stashed aside
    #: and backward writes loss-scaled grads.
    STASHED = "stashed"
    #: The params hold loss-scaled grads: a ``delay_unscale=True`` exit left them for the
    #: window's last exit to unscale (a block entered over them stashes nothing).
    SCALED = "scaled"
    #: An exit checked the grads and left them scaled: the one-pass step unscales them as it
    #: reads them (or :func:`amp_patch.master_params` and the next entry, first).
    DEFERRED = "deferred"
    #: The grads are unscaled on the device (the params' own, or the masters' fp32 grads); this
    #: exit decided no skip (its overflow read on the host was clean, or it did not check).
    UNSCALED = "unscaled"
    #: The exit decided the skip on the device: an overflow flag, unread, that the step takes.
    SKIP_ON_DEVICE = "skip decided on device"
    #: The exit read an overflow on the host: the next step is not called.
    SKIP_ON_HOST = "skip decided on host"
    #: ``step()`` ran, or was skipped.
    STEPPED = "stepped"

    def __str__(self) -> str:
        return self.name


class GradStateError(RuntimeError):
    """A call would move an optimizer's grads between two states with no legal move."""


_S = GradState
#: States with no block open and no scaled grads kept: a block entered here stashes the grads.
_SETTLED = (_S.READY, _S.ZEROED, _S.STEPPED, _S.UNSCALED, _S.SKIP_ON_DEVICE, _S.SKIP_ON_HOST)


def _table() -> dict[tuple[GradState, GradState], str]:
    moves: dict[tuple[GradState, GradState], list[str]] = {}

    def add(call: str, froms: tuple[GradState, ...], to: GradState | None) -> None:
        for old in froms:
            moves.setdefault((old, old if to is None else to), []).append(call)

    add("scale_loss entry", _SETTLED, _S.STASHED)
    add("scale_loss entry over scaled grads", (_S.SCALED,), None)
    add("an exception in the block (back to the state before it)", (_S.STASHED,), None)
    for old in _SETTLED:
        moves.setdefault((_S.STASHED, old), []).append(
            "an exception in the block (back to the state before it)")
    add("an exception in a block over scaled grads", (_S.SCALED,), None)
    add("delay_unscale exit", _SETTLED + (_S.SCALED,), _S.SCALED)
    add("scale_loss exit, unscaling", (_S.STASHED, _S.SCALED), _S.UNSCALED)
    add("scale_loss exit, for the one-pass step", (_S.STASHED, _S.SCALED), _S.DEFERRED)
    add("scale_loss exit, device flag (sync_free)", (_S.UNSCALED, _S.DEFERRED), _S.SKIP_ON_DEVICE)
    add("scale_loss exit, overflow read on the host", (_S.UNSCALED, _S.DEFERRED), _S.SKIP_ON_HOST)
    add("master_params() or the next entry unscales", (_S.DEFERRED,), _S.UNSCALED)
    add("step()", _SETTLED + (_S.DEFERRED,), _S.STEPPED)
    add("step() or zero_grad() inside a block or a delay_unscale window",
        (_S.STASHED, _S.SCALED), None)
    add("zero_grad()", _SETTLED + (_S.DEFERRED,), _S.ZEROED)
    # The exception move back to STASHED is the block's own entry state: not a move.
    moves[(_S.STASHED, _S.STASHED)].remove(
        "an exception in the block (back to the state before it)")
    return {key: "; ".join(calls) for key, calls in moves.items()}


#: Every legal move, ``(from, to)``, with the calls that make it. A call that is not in the
#: table for the current state raises :class:`GradStateError`.
MOVES: dict[tuple[GradState, GradState], str] = _table()
_NEXT: dict[GradState, tuple[GradState, ...]] = {
    s: tuple(to for old, to in MOVES if old is s) for s in GradState}


class GradStates:
    """One optimizer's :class:`GradState`, its pending skip, and the one place that moves them.

    Args:
        owner (str): names the optimizer in error messages.

    Attributes:
        state (GradState): where the grads are.
        pending_skip (GradState or None): the verdict of the checked exits since the last
            step: None (step), ``SKIP_ON_DEVICE`` (the flag in :attr:`found_inf` decides) or
            ``SKIP_ON_HOST`` (skip).
        found_inf (Tensor or None): the device flag of a ``SKIP_ON_DEVICE`` verdict
            (one-element fp32, 1.0 on overflow), the exits' flags combined on the device.

    Example::

        >>> grads = GradStates("SGD")
        >>> grads.move(GradState.STASHED, "scale_loss entry")
        >>> grads.move(GradState.UNSCALED, "scale_loss exit")
        >>> grads.decide(torch.zeros(1), "scale_loss exit")
        >>> grads.state, grads.take_skip("step()")
        (<GradState.SKIP_ON_DEVICE: 'skip decided on device'>, tensor([0.]))
        >>> try:
        ...     grads.move(GradState.SKIP_ON_DEVICE, "scale_loss exit")
        ... except GradStateError as e:
        ...     print(e)
        SGD's grads cannot move from STEPPED to SKIP_ON_DEVICE (scale_loss exit)
    """

    __slots__ = ("owner", "state", "pending_skip", "found_inf", "_before_block")

    def __init__(self, owner: str) -> None:
        self.owner = owner
        self.state = GradState.READY
        self.pending_skip: GradState | None = None
        self.found_inf: Tensor | None = None
        self._before_block = GradState.READY

    def move(self, to: GradState, why: str) -> None:
        """Move to ``to``, for ``why`` (the call); raise :class:`GradStateError` if illegal."""
        if to not in _NEXT[self.state]:
            raise GradStateError(
                f"{self.owner}'s grads cannot move from {self.state} to {to} ({why})")
        if to is GradState.STASHED and self.state is not GradState.STASHED:
            self._before_block = self.state
        self.state = to

    def enter_block(self, delay_unscale: bool) -> bool:
        """At ``scale_loss`` entry: whether the grads are to be stashed (the move made).

        A ``delay_unscale`` entry moves nothing: its exit does. A block over
        scaled grads stashes nothing either.
        """
        if delay_unscale:
            return False
        if self.state is GradState.SCALED:
            self.move(GradState.SCALED, "scale_loss entry over scaled grads")
            return False
        self.move(GradState.STASHED, "scale_loss entry")
        return True

    def leave_block(self) -> None:
        """An exception left the (not delayed) block: back to the state before it."""
        if self.state is GradState.STASHED:
            self.move(self._before_block, "an exception in the block")
        else:
            self.move(GradState.SCALED, "an exception in a block over scaled grads")

    def decide(self, overflow: bool | Tensor, why: str) -> None:
        """Record an exit's verdict: True (an overflow read on the host), or a device flag
        (combined on the device with a flag already pending). False records nothing."""
        if overflow is False:
            return
        if overflow is True or self.pending_skip is GradState.SKIP_ON_HOST:
            # A host verdict takes any flag with it: the step is not called either way.
            self.move(GradState.SKIP_ON_HOST, why)
            self.pending_skip, self.found_inf = GradState.SKIP_ON_HOST, None
            return
        self.move(GradState.SKIP_ON_DEVICE, why)
        pending = self.found_inf
        self.found_inf = overflow if pending is None else torch.maximum(
            pending, overflow.to(pending.device))
        self.pending_skip = GradState.SKIP_ON_DEVICE

    def take_skip(self, why: str) -> bool | Tensor:
        """At ``step()``: the pending verdict (False, True, or the device flag), now taken.

        The grads move to ``STEPPED``, but inside a block or a ``delay_unscale``
        window, where they stay scaled.
        """
        inside = self.state is GradState.STASHED or self.state is GradState.SCALED
        self.move(self.state if inside else GradState.STEPPED, why)
        flag, host = self.found_inf, self.pending_skip is GradState.SKIP_ON_HOST
        self.pending_skip, self.found_inf = None, None
        return flag if flag is not None and not host else host

    def zeroed(self) -> None:
        """After ``zero_grad()``: ``ZEROED``, but inside a block or a ``delay_unscale`` window
        (zeros are scaled grads too). The pending verdict stays, as in Apex."""
        if self.state in (GradState.STASHED, GradState.SCALED):
            self.move(self.state, "zero_grad() inside a block or a delay_unscale window")
        else:
            self.move(GradState.ZEROED, "zero_grad()")

    @property
    def skip_pending(self) -> bool:
        """Whether the next step will be skipped (reads a device flag on the host: one sync)."""
        if self.pending_skip is GradState.SKIP_ON_DEVICE and self.found_inf is not None:
            return bool(self.found_inf.item() != 0.0)
        return self.pending_skip is GradState.SKIP_ON_HOST

    @contextlib.contextmanager
    def skip_held_back(self) -> Iterator[None]:
        """Keep the pending verdict from the steps inside (a checkpoint's state-making step)."""
        held = self.pending_skip, self.found_inf
        self.pending_skip, self.found_inf = None, None
        try:
            yield
        finally:
            self.pending_skip, self.found_inf = held

    def reset(self) -> None:
        """Start afresh (deinitialize): ``READY``, nothing pending."""
        self.state = GradState.READY
        self.pending_skip, self.found_inf = None, None

    def __repr__(self) -> str:
        return f"GradStates({self.owner}: {self.state}, pending skip: {self.pending_skip})"
