"""The live :class:`AmpSession`, if any: the one global pointer to what ``initialize`` built.

Everything a session creates hangs off that object and goes with it. Beside the
pointer, a weak table here remembers which optimizers closed sessions had, only
to word the error when a script goes on using one. Other module-level state in
amp_patch is not a session's: the O1 registrations waiting for the next
``initialize`` (:mod:`amp_patch.patching.registry`), the cached CPU half
detection and its overrides (:mod:`amp_patch.patching.cpu_half`), torch.compile's
snapshot of the patched functions (:mod:`amp_patch.patching.dynamo`). The
``amp_patch`` logger's level (and the stderr handler added when none was
found) is set for a session and put back when it closes.
"""

from __future__ import annotations

import itertools
import logging
import weakref
from typing import TYPE_CHECKING, Any, Callable

import torch

if TYPE_CHECKING:
    from amp_patch.casting.fp8 import Fp8Conversion
    from amp_patch.casting.fsdp import ShardingPlan
    from amp_patch.optim.amp import OptimizerRecord
    from amp_patch.patching.cpu_half import CpuHalfPlan
    from amp_patch.patching.state import CastState
    from amp_patch.scaler import AmpScaler
    from amp_patch.settings.properties import Properties

__all__ = ["AmpSession", "current", "require", "activate", "check_none_live", "reset"]

logger = logging.getLogger("amp_patch")


class AmpSession:
    """Everything that one :func:`amp_patch.initialize` call created.

    :func:`amp_patch.initialize` fills it in data-flow order: model casting
    and hooks, O1 patches, optimizer records, loss scalers. Each step registers
    its undo with :meth:`on_close`. :meth:`close` runs the undos last in,
    first out, which is what :func:`amp_patch.deinitialize` does.

    Args:
        props (Properties): the resolved settings.
        models (list of torch.nn.Module): the models passed to initialize.
        optimizers (list of torch.optim.Optimizer): the optimizers passed to it.

    Attributes:
        casts (CastState or None): O1 casting state (flag, half dtype, weight
            cache); None when torch is not patched.
        optimizer_records (dict): ``id(optimizer)`` to its
            :class:`~amp_patch.optim.amp.OptimizerRecord`.
        scalers (list of AmpScaler): one per ``loss_id``.
        scale_loss_open (bool): True inside a :func:`amp_patch.scale_loss` block
            (they cannot be nested).
        serial (int): this session's number in the process, for messages.
        cpu_half (CpuHalfPlan or None): how half matmuls run on the CPU
            (:mod:`amp_patch.patching.cpu_half`); None when nothing computes in half there.
        sharding (ShardingPlan or None): what amp changed in the FSDP2 states of
            the models (:mod:`amp_patch.casting.fsdp`); None when none is sharded.
        fp8 (Fp8Conversion or None): the layers ``fp8=`` converted, their plan
            and delayed states (:mod:`amp_patch.casting.fp8`); None without FP8.
        rank_check (RankCheck or None): the cross-rank check of each step's
            decisions (``AMP_PATCH_DEBUG_RANKS=1``, :mod:`amp_patch.frontend.debug`);
            None when off.
    """

    def __init__(self, props: "Properties", models: list[torch.nn.Module],
                 optimizers: list[torch.optim.Optimizer]) -> None:
        self.props = props
        self.models = models
        self.optimizers = optimizers
        self.casts: CastState | None = None
        self.optimizer_records: dict[int, OptimizerRecord] = {}
        self.scalers: list[AmpScaler] = []
        self.scale_loss_open = False
        self.serial = next(_serials)
        self.cpu_half: CpuHalfPlan | None = None
        self.sharding: ShardingPlan | None = None
        self.fp8: Fp8Conversion | None = None
        # A RankCheck (amp_patch.frontend.debug, a layer above): typed loosely, no import.
        self.rank_check: Any = None
        # (what, undo, abort-only undo or None): see on_close.
        self._undo: list[tuple[str, Callable[[], None] | None, Callable[[], None] | None]] = []
        self.closed = False

    def on_close(self, what: str, undo: Callable[[], None] | None,
                 abort: Callable[[], None] | None = None) -> None:
        """Register ``undo`` to run at :meth:`close`, before everything registered earlier.

        Args:
            what (str): a short description, used in error messages.
            undo (callable or None): takes no arguments; None for nothing.
            abort (callable, optional): run instead of ``undo`` when the
                :func:`amp_patch.initialize` that builds this session fails
                (``close(abort=True)``), to put back what a finished session
                keeps (the model's dtypes, say). Dropped by :meth:`commit`.
        """
        self._undo.append((what, undo, abort))

    def commit(self) -> None:
        """initialize succeeded: forget the abort-only undos (and what they held on to)."""
        self._undo = [(what, undo, None) for what, undo, _ in self._undo]

    def record_for(self, optimizer: torch.optim.Optimizer) -> "OptimizerRecord":
        """The record of an optimizer passed to initialize.

        The table is keyed by ``id()``; the record must also hold this very
        object, so an id recycled by another object never finds it.

        Raises:
            RuntimeError: if the optimizer was not passed to the
                :func:`amp_patch.initialize` of this session (the message says
                when an earlier, deinitialized session had it).
        """
        record = self.optimizer_records.get(id(optimizer))
        if record is not None and record.optimizer_or_none() is optimizer:
            return record
        name = f"optimizer {type(optimizer).__name__} at {id(optimizer):#x}"
        earlier = _retired_optimizers.get(optimizer)
        if earlier is not None:
            raise RuntimeError(
                f"{name} was initialized by an earlier amp_patch session that has been "
                "deinitialized; pass it to initialize() again, with its model, to use it here "
                f"(it belonged to session #{earlier}; the live one is #{self.serial})"
            )
        raise RuntimeError(
            f"{name} was not passed to amp_patch.initialize(); pass every optimizer that "
            "scale_loss will see"
        )

    def master_for(self, param: torch.Tensor) -> torch.Tensor | None:
        """The fp32 master that an optimizer of this session keeps for ``param``, if any.

        The master is first refreshed if ``param`` was written from outside
        since amp last wrote it.
        """
        for record in self.optimizer_records.values():
            master = record.masters.current_master(param)
            if master is not None:
                return master
        return None

    def load_master(self, param: torch.Tensor, value: torch.Tensor) -> None:
        """Set ``param``'s master, if it has one, to exactly ``value`` (a checkpoint's tensor)."""
        for record in self.optimizer_records.values():
            record.masters.load_master(param, value)

    def close(self, abort: bool = False) -> None:
        """Undo everything, last in first out. Every undo runs even if one fails.

        Args:
            abort (bool, optional): the session's initialize failed: run the
                abort undos where given, so that nothing stays half-applied.
                Default: False.

        Raises:
            RuntimeError: after all undos ran, if any of them failed.
        """
        if self.closed:
            return
        self.closed = True
        for optimizer in self.optimizers:
            _retired_optimizers[optimizer] = self.serial
        failures = []
        while self._undo:
            what, undo, on_abort = self._undo.pop()
            if abort and on_abort is not None:
                undo = on_abort
            if undo is None:
                continue
            try:
                undo()
            except Exception as exc:  # keep undoing: a half-undone torch is worse
                logger.exception("amp_patch: undoing %s failed", what)
                failures.append(f"{what}: {exc!r}")
        if failures:
            raise RuntimeError("amp_patch.deinitialize() could not undo: " + "; ".join(failures))


_current: AmpSession | None = None
_serials = itertools.count(1)
#: Optimizers of closed sessions and the session's serial, to word the error when a script
#: goes on using one (weak keys: nothing is kept alive).
_retired_optimizers: "weakref.WeakKeyDictionary[Any, int]" = weakref.WeakKeyDictionary()


def current() -> AmpSession | None:
    """The live session, or None."""
    return _current


def require(what: str = "this") -> AmpSession:
    """The live session.

    Args:
        what (str, optional): the caller's name, for the error message.

    Raises:
        RuntimeError: if :func:`amp_patch.initialize` has not been called.
    """
    if _current is None:
        raise RuntimeError(f"amp_patch.initialize() must be called before {what}")
    return _current


def activate(session: AmpSession) -> None:
    """Make ``session`` the live one.

    Raises:
        RuntimeError: if another session is live.
    """
    global _current
    check_none_live()
    _current = session


def check_none_live() -> None:
    """Raise if a session is live: ``initialize`` checks this before anything else it checks.

    Raises:
        RuntimeError: if a session is live.
    """
    if _current is not None:
        raise RuntimeError(
            "amp_patch.initialize() was already called and is still in effect; call "
            "amp_patch.deinitialize() before initializing again"
        )


def reset(abort: bool = False) -> None:
    """Close the live session, if any, and forget it. Torch ends up unpatched even on failure.

    Args:
        abort (bool, optional): the session's initialize failed (see
            :meth:`AmpSession.close`). Default: False.
    """
    global _current
    session, _current = _current, None
    if session is not None:
        session.close(abort=abort)
