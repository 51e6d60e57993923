"""The one piece of global state: the live :class:`AmpSession`, if any."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Callable

import torch

if TYPE_CHECKING:
    from amp_patch.cpu_half import CpuHalfPlan
    from amp_patch.optim import OptimizerRecord
    from amp_patch.patching.state import CastState
    from amp_patch.properties import Properties
    from amp_patch.scaler import LossScaler

__all__ = ["AmpSession", "current", "require", "activate", "reset"]

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
            :class:`~amp_patch.optim.OptimizerRecord`.
        scalers (list of LossScaler): one per ``loss_id``.
        cpu_half (CpuHalfPlan or None): how half matmuls run on the CPU
            (:mod:`amp_patch.cpu_half`); None when nothing computes in half there.
    """

    def __init__(self, props: "Properties", models: list[torch.nn.Module],
                 optimizers: list[torch.optim.Optimizer]) -> None:
        self.props = props
        self.models = models
        self.optimizers = optimizers
        self.casts: CastState | None = None
        self.optimizer_records: dict[int, OptimizerRecord] = {}
        self.scalers: list[LossScaler] = []
        self.cpu_half: CpuHalfPlan | None = None
        self._undo: list[tuple[str, Callable[[], None]]] = []
        self.closed = False

    def on_close(self, what: str, undo: Callable[[], None]) -> None:
        """Register ``undo`` to run at :meth:`close`, before everything registered earlier.

        Args:
            what (str): a short description, used in error messages.
            undo (callable): takes no arguments.
        """
        self._undo.append((what, undo))

    def record_for(self, optimizer: torch.optim.Optimizer) -> "OptimizerRecord":
        """The record of an optimizer passed to initialize.

        Raises:
            RuntimeError: if the optimizer was not passed to :func:`amp_patch.initialize`.
        """
        try:
            return self.optimizer_records[id(optimizer)]
        except KeyError:
            raise RuntimeError(
                f"optimizer {type(optimizer).__name__} at {id(optimizer):#x} was not passed to "
                "amp_patch.initialize(); pass every optimizer that scale_loss will see"
            ) from None

    def close(self) -> None:
        """Undo everything, last in first out. Every undo runs even if one fails.

        Raises:
            RuntimeError: after all undos ran, if any of them failed.
        """
        if self.closed:
            return
        self.closed = True
        failures = []
        while self._undo:
            what, undo = self._undo.pop()
            try:
                undo()
            except Exception as exc:  # keep undoing: a half-undone torch is worse
                logger.exception("amp_patch: undoing %s failed", what)
                failures.append(f"{what}: {exc!r}")
        if failures:
            raise RuntimeError("amp_patch.deinitialize() could not undo: " + "; ".join(failures))


_current: AmpSession | None = None


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
    if _current is not None:
        raise RuntimeError(
            "amp_patch.initialize() was already called and is still in effect; call "
            "amp_patch.deinitialize() before initializing again"
        )
    _current = session


def reset() -> None:
    """Close the live session, if any, and forget it. Torch ends up unpatched even on failure."""
    global _current
    session, _current = _current, None
    if session is not None:
        session.close()
