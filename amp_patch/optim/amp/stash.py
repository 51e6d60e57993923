"""Apex's optimizer marker, ``optimizer._amp_stash``, as a view of what amp_patch did.

Apex's ``initialize`` hung an ``_amp_stash`` object on every optimizer it
processed, and refused an optimizer that already had one. Code outside Apex
reads it: trainers call ``initialize`` lazily, on the first iteration, while
``hasattr(optimizer, "_amp_stash")`` is false; checkpoint code tests its
``lazy_init_called`` and calls ``_lazy_init_maybe_master_weights()``; code that
needs the fp16/fp32 pairs reads ``all_fp16_params`` and
``all_fp32_from_fp16_params``. :class:`AmpStash` answers those reads from the
optimizer's record (its flags and :class:`~amp_patch.optim.amp.MasterWeights`),
never from a copy: the lists hold the very model params and masters, made
afresh at each read, so they follow ``add_param_group``.

:func:`install` sets the marker and Apex's two lazy-init methods (no-ops:
amp_patch makes its masters at ``initialize``) and registers their removal
with the session, so ``deinitialize`` takes them away. The marker lives in the
instance's ``__dict__``: ``state_dict()``, ``load_state_dict()`` and LR
schedulers neither see nor drop it. docs/migration.md, "Trainers and
libraries", says which attributes there are.
"""

from __future__ import annotations

import types
from typing import Any, Callable, Iterator, Protocol

from torch import Tensor

from amp_patch.optim.amp.grad_state import GradState, GradStates
from amp_patch.optim.amp.master_weights import MasterWeights
from amp_patch.settings.dtypes import HALF_DTYPES

__all__ = ["AmpStash", "STASH", "ALREADY_INITIALIZED", "install", "check_not_stashed"]

#: The attribute Apex's ``initialize`` set on each optimizer.
STASH = "_amp_stash"
#: Apex's own message for an optimizer passed to ``initialize`` a second time (kept word for
#: word: code and users search for it).
ALREADY_INITIALIZED = "A given optimizer should only be passed through amp.initialize once."
#: Apex's lazy-init methods, which checkpoint code calls before loading an optimizer's state.
_LAZY_INIT_METHODS = ("_lazy_init_maybe_master_weights", "_amp_lazy_init")


class StashRecord(Protocol):
    """What :class:`AmpStash` reads of an optimizer's record
    (:class:`~amp_patch.optim.amp.OptimizerRecord` is the one implementation)."""

    # Read-only here, so that a record may keep a flag as a device tensor.
    @property
    def master_weights(self) -> bool: ...

    @property
    def masters(self) -> MasterWeights: ...

    @property
    def grads(self) -> GradStates: ...

    @property
    def optimizer(self) -> Any: ...


class AmpStash:
    """Apex's ``optimizer._amp_stash``: the amp state of one optimizer, read live.

    Attributes that Apex had at every level:

    - ``lazy_init_called`` (bool): True. Apex built its param lists on first
      use; amp_patch builds its masters at ``initialize``, so the lists are
      always there. Writable, as checkpoint code sets it.
    - ``already_patched`` (bool, read-only): an overflow was found and the
      next ``step()`` will be skipped (Apex patched ``step`` for that).
    - ``params_have_scaled_gradients`` (bool, read-only): a
      ``scale_loss(..., delay_unscale=True)`` left scaled grads in the params.
    - ``all_fp16_params`` (list of Tensor): the half model params.

    With master weights (O2), as in Apex, also ``all_fp32_from_fp16_params``
    (the fp32 masters, paired by position with ``all_fp16_params``),
    ``all_fp32_from_fp32_params`` (fp32 params stepped directly) and the same
    three per param group, ``fp16_groups``, ``fp32_from_fp16_groups``,
    ``fp32_from_fp32_groups``. Without master weights, ``all_fp32_params``
    instead; ``hasattr(stash, "all_fp32_from_fp16_params")`` tells the two
    apart, as Apex's own code did. Other attributes may be set freely.

    Args:
        record (StashRecord or None): the optimizer's record; None for a
            session made with ``enabled=False``, where nothing is half and
            nothing is pending.
        optimizer (torch.optim.Optimizer): the optimizer, for the param lists
            when ``record`` is None.

    Example::

        >>> model, optimizer = amp.initialize(model, optimizer, opt_level="O2")
        >>> stash = optimizer._amp_stash
        >>> stash.all_fp32_from_fp16_params[0] is list(amp.master_params(optimizer))[0]
        True
    """

    _record: StashRecord | None
    _optimizer: Any

    def __init__(self, record: StashRecord | None, optimizer: Any) -> None:
        object.__setattr__(self, "_record", record)
        object.__setattr__(self, "_optimizer", optimizer if record is None else None)
        self.lazy_init_called = True

    def __setattr__(self, name: str, value: Any) -> None:
        if isinstance(getattr(type(self), name, None), property):
            raise AttributeError(
                f"optimizer._amp_stash.{name} is read from amp_patch's own state and cannot be "
                "set; amp_patch.scale_loss and step() keep it")
        object.__setattr__(self, name, value)

    def __repr__(self) -> str:
        return (f"<amp_patch view of Apex's _amp_stash: master_weights={self._master_weights}, "
                f"already_patched={self.already_patched}, "
                f"params_have_scaled_gradients={self.params_have_scaled_gradients}>")

    # ------------------------------------------------------------------ flags

    # bool() of a flag kept on the device reads it on the host: only when someone asks.
    @property
    def already_patched(self) -> bool:
        return self._record is not None and self._record.grads.skip_pending

    @property
    def params_have_scaled_gradients(self) -> bool:
        return self._record is not None and self._record.grads.state is GradState.SCALED

    # ------------------------------------------------------------------ param lists

    @property
    def _master_weights(self) -> bool:
        return self._record is not None and self._record.master_weights

    def _groups(self) -> Iterator[list[Tensor]]:
        opt = self._optimizer if self._record is None else self._record.optimizer
        for group in opt.param_groups:
            yield group["params"]

    def _masters_only(self, what: str) -> MasterWeights:
        if not self._master_weights or self._record is None:
            raise AttributeError(f"'_amp_stash' has no attribute {what!r} without master weights "
                                 "(as in Apex: only O2 keeps fp32 masters)")
        return self._record.masters

    @property
    def fp16_groups(self) -> list[list[Tensor]]:
        masters = self._masters_only("fp16_groups")
        return [[masters.model_param(p) for p in g if masters.is_master(p)] for g in self._groups()]

    @property
    def fp32_from_fp16_groups(self) -> list[list[Tensor]]:
        masters = self._masters_only("fp32_from_fp16_groups")
        return [[p for p in g if masters.is_master(p)] for g in self._groups()]

    @property
    def fp32_from_fp32_groups(self) -> list[list[Tensor]]:
        masters = self._masters_only("fp32_from_fp32_groups")
        return [[p for p in g if not masters.is_master(p)] for g in self._groups()]

    @property
    def all_fp32_from_fp16_params(self) -> list[Tensor]:
        return [p for g in self.fp32_from_fp16_groups for p in g]

    @property
    def all_fp32_from_fp32_params(self) -> list[Tensor]:
        return [p for g in self.fp32_from_fp32_groups for p in g]

    @property
    def all_fp16_params(self) -> list[Tensor]:
        if self._master_weights:
            return [p for g in self.fp16_groups for p in g]
        return [p for g in self._groups() for p in g if p.dtype in HALF_DTYPES]

    @property
    def all_fp32_params(self) -> list[Tensor]:
        if self._master_weights:
            raise AttributeError("'_amp_stash' has no attribute 'all_fp32_params' with master "
                                 "weights (as in Apex): read all_fp32_from_fp32_params")
        return [p for g in self._groups() for p in g if p.dtype not in HALF_DTYPES]


def check_not_stashed(optimizers: list[Any], underlying: Callable[[Any], Any],
                      live: list[Any]) -> None:
    """Refuse optimizers that already went through ``initialize``, with Apex's message.

    Args:
        optimizers (list): the optimizers passed to ``initialize``.
        underlying (callable): maps an optimizer to the torch optimizer itself
            (the one a LARC wraps): a LARC and its optimizer are one optimizer.
        live (list): the optimizers of the live session, if any.

    Raises:
        RuntimeError: an optimizer carries ``_amp_stash``, or it (or the one
            inside it) belongs to the live session.
    """
    taken = {id(underlying(opt)) for opt in live}
    for opt in optimizers:
        if STASH in vars(opt) or id(underlying(opt)) in taken:
            raise RuntimeError(
                f"{ALREADY_INITIALIZED} This {type(opt).__name__} is still in the live amp "
                "session: keep using it as it is (a trainer initializes lazily while "
                f"not hasattr(optimizer, {STASH!r})), or call amp.deinitialize() first to "
                "initialize it again.")


def install(optimizer: Any, record: StashRecord | None,
            on_close: Callable[..., None]) -> AmpStash:
    """Set Apex's marker and lazy-init methods on ``optimizer``; ``on_close`` removes them.

    Args:
        optimizer (torch.optim.Optimizer or LARC): the optimizer as passed to ``initialize``.
        record (StashRecord or None): its record; None when the session is disabled.
        on_close (callable): ``on_close(what, undo)`` registers the removal with the session.

    Returns:
        AmpStash: the marker.

    Example::

        >>> undos = []
        >>> stash = install(optimizer, None, lambda what, undo: undos.append(undo))
        >>> optimizer._amp_stash is stash
        True
        >>> undos[0]()   # what deinitialize does
        >>> hasattr(optimizer, "_amp_stash")
        False
    """
    stash = AmpStash(record, optimizer)
    added: dict[str, Any] = {STASH: stash}
    for name in _LAZY_INIT_METHODS:
        # Masters are made at initialize: there is nothing left to do lazily.
        added[name] = types.MethodType(_nothing_to_do, optimizer)
    on_close(f"{type(optimizer).__name__}'s {STASH}", lambda: _remove(optimizer, added))
    for name, value in added.items():
        setattr(optimizer, name, value)
    return stash


def _nothing_to_do(optimizer: Any) -> None:
    """Apex's ``_lazy_init_maybe_master_weights`` / ``_amp_lazy_init``: amp_patch has none."""


def _remove(optimizer: Any, added: dict[str, Any]) -> None:
    own = vars(optimizer)
    for name, value in added.items():
        if own.get(name) is value:
            del own[name]
