"""The patched optimizer methods: ``step`` (and skipping it), ``zero_grad`` and ``add_param_group``.

The methods are wrapped on the instance as
``types.MethodType(wrapt.FunctionWrapper(func, wrapper), opt)``. An
``lr_scheduler`` reads ``opt.step.__func__`` and binds it again, which still
reaches the wrapper, so a scheduler made after initialize works; one made
before has already put its own function on the instance, and that function is
wrapped in turn, keeping the scheduler's bookkeeping. Once the record is
inactive (after deinitialize) a wrapper that could not be removed, because a
scheduler wrapped it in turn, passes calls straight through.

Where the step leaves the model to amp (O2 with an optimizer that does not
write the model in its own pass), the master-to-model copy is made by a step
post-hook that amp puts first in the optimizer's registry: every other
post-hook then sees, and may write, the model as it is after the step, as
without amp. A step that runs no hooks gets the copy after it returns.

A step is skipped on the device where the optimizer takes the overflow flag as
a tensor: amp_patch's fused optimizers through their step inputs (their
kernels' ``noop``), torch's fused ones (``_step_supports_amp_scaling``) through
``found_inf`` as ``torch.amp.GradScaler`` hands it. Any other optimizer reads the
flag on the host (one sync) and is skipped by not calling its ``step`` at all.
Either way nothing the optimizer owns changes: parameters, masters, and every
state tensor, including the step counters (docs/design.md, "Host syncs").
"""

from __future__ import annotations

import collections
import logging
import types
from typing import TYPE_CHECKING, Any, Callable, ContextManager, Iterator, Protocol

import torch
import wrapt
from torch import Tensor

from amp_patch.optim.amp.larc import LARC
from amp_patch.optim.amp.master_weights import clear_grads
from amp_patch.optim.fused import FusedStepInputs
from amp_patch.optim.fused.step_entry import (
    grads_to_none,
    labelled,
    run_step_hooks,
    unlabelled_step,
)

if TYPE_CHECKING:
    from amp_patch.optim.amp.grad_state import GradStates
    from amp_patch.optim.amp.master_weights import MasterWeights

__all__ = ["PatchedMethods", "StepRecord", "STEP_INPUTS", "takes_found_inf", "host_reads_per_step"]

logger = logging.getLogger("amp_patch")

#: Name of the optional optimizer method ``fused_step_inputs(inputs)``, a context manager
#: whose ``step()`` calls read their grads and model copies from a
#: :class:`amp_patch.optim.fused.FusedStepInputs` (amp_patch's fused optimizers have it).
STEP_INPUTS = "fused_step_inputs"

_MISSING = object()
#: torch's ``Optimizer.zero_grad``: set to None, amp's wrapper runs its loop without the label.
_TORCH_ZERO_GRAD = torch.optim.Optimizer.zero_grad
_POSITIONS = {"closure": 0, "set_to_none": 0, "param_group": 0}


class StepRecord(Protocol):
    """What :class:`PatchedMethods` reads and writes of its optimizer's record.

    :class:`amp_patch.optim.amp.OptimizerRecord` is the one implementation; the
    methods name only this much of it, so that the record (which installs
    them) and the methods do not import each other.
    """

    active: bool
    masters: MasterWeights
    master_weights: bool
    grads: GradStates

    @property
    def optimizer(self) -> torch.optim.Optimizer: ...
    def optimizer_or_none(self) -> torch.optim.Optimizer | None: ...
    def stepped_params(self) -> Iterator[Tensor]: ...
    def master_pairs(self) -> list[tuple[Tensor, Tensor]]: ...
    def step_inputs(self, found_inf: Tensor | None = None) -> FusedStepInputs | None: ...
    def drop_deferred(self) -> None: ...
    def forget_stashed_grads(self) -> None: ...
    def note_zeroed_grads(self, set_to_none: bool) -> None: ...
    def warn_if_backward_bypassed_amp(self) -> None: ...


class PatchedMethods:
    """amp's ``step``, ``zero_grad`` and ``add_param_group`` on one optimizer instance.

    Args:
        record (StepRecord): the record whose flags and masters the methods use
            (an :class:`~amp_patch.optim.amp.OptimizerRecord`).
        step_context (callable): returns the context manager ``step()`` runs in
            (O1's casts are disabled there).

    .. note::
        An optimizer with a ``fused_step_inputs(inputs)`` context manager (see
        :class:`amp_patch.optim.fused.FusedStepInputs`) steps the masters and
        writes the model params in one pass: each ``step()`` runs inside that
        context, with the inputs of :meth:`OptimizerRecord.step_inputs`, and
        amp makes no master-to-model copy. Its grads may be the half model
        grads, still scaled (the one-pass O2 step).
    """

    def __init__(self, record: StepRecord, step_context: Callable[[], ContextManager]) -> None:
        self._record = record
        self._step_context = step_context
        self._saved: dict[str, Any] = {}
        # Set while a step owes the master-to-model copy; the first step post-hook makes it.
        self._copy_pending = False
        self._post_hook: Any = None

    # ------------------------------------------------------------ installing

    def install(self) -> None:
        """Wrap ``step``, ``zero_grad`` and ``add_param_group`` on the instance."""
        self._patch("step", self._step)
        self._patch("zero_grad", self._zero_grad)
        self._patch("add_param_group", self._add_param_group)
        opt = self._record.optimizer
        hooks = getattr(opt, "_optimizer_step_post_hooks", None)
        # Only where masters are copied (torch's registry; a LARC has none).
        if self._record.master_weights and isinstance(hooks, collections.OrderedDict):
            # Runs first among the step post-hooks, so that every hook (an EMA, a weight
            # clamp) sees and writes the model as it is after the step, as without amp.
            self._post_hook = opt.register_step_post_hook(self._copy_to_model)
            hooks.move_to_end(self._post_hook.id, last=False)

    def restore(self) -> None:
        """Put the original methods back, last in first out."""
        if self._post_hook is not None:
            self._post_hook.remove()
            self._post_hook = None
        opt = self._record.optimizer_or_none()
        if opt is None:
            return
        for name in ("add_param_group", "zero_grad", "step"):
            self._unpatch(opt, name)

    def _patch(self, name: str, wrapper: Callable) -> None:
        opt = self._record.optimizer
        own = opt.__dict__.get(name, _MISSING)
        self._saved[name] = own
        if own is _MISSING:
            target = getattr(type(opt), name)
        else:
            # Already replaced on the instance (an lr_scheduler made before
            # initialize). That callable takes no self; adapt it, and copy its
            # attributes (the scheduler's marker) so they stay visible.
            target = _drop_self(own)
        record = self._record
        proxy = wrapt.FunctionWrapper(target, wrapper, enabled=lambda: record.active)
        setattr(opt, name, types.MethodType(proxy, opt))

    def _unpatch(self, opt: torch.optim.Optimizer, name: str) -> None:
        if name not in self._saved:  # never patched (install failed before it)
            return
        now = opt.__dict__.get(name, _MISSING)
        if not (isinstance(now, types.MethodType)
                and isinstance(now.__func__, wrapt.FunctionWrapper) and now.__self__ is opt):
            # Something (a scheduler made after initialize) wrapped ours; it
            # stays, and our wrapper passes calls straight through (inactive record).
            return
        saved = self._saved.pop(name)
        if saved is _MISSING:
            delattr(opt, name)
        else:
            setattr(opt, name, saved)

    # ------------------------------------------------------------- the methods

    def _step(self, wrapped, instance, args, kwargs):
        record = self._record
        opt = record.optimizer
        masters = record.masters
        record.sync_masters_from_model()
        record.warn_if_backward_bypassed_amp()
        skip = record.grads.take_skip("optimizer.step()")
        found_inf = None
        if isinstance(skip, Tensor):
            if takes_found_inf(opt):
                found_inf, skip = skip, False
            else:
                skip = bool(skip.item() != 0.0)  # this optimizer's one host sync
        if skip:
            # Not calling the optimizer at all is what keeps its state (Adam's
            # step counters included) exactly as it was.
            logger.debug("amp_patch: skipped %s.step() after a gradient overflow",
                         type(opt).__name__)
            # A skipped step is still the optimizer's step for an LR scheduler: the flag its
            # wrapper would set, so no "lr_scheduler.step() before optimizer.step()" warning.
            # (A scheduler sits on the optimizer a LARC wraps, so that one gets it too.)
            opt._opt_called = True
            if isinstance(opt, LARC):
                opt.optim._opt_called = True
            masters.release_grads()
            record.drop_deferred()
            return None
        if record.master_weights and _call_arg(instance, args, kwargs, "closure") is not None:
            raise RuntimeError(
                "optimizer.step(closure) is not supported with master weights: the closure's "
                "backward would not reach the fp32 masters. Call scale_loss and step() directly."
            )
        step_inputs = getattr(opt, STEP_INPUTS, None)
        flag_in_inputs = found_inf is not None and callable(step_inputs)
        inputs = record.step_inputs(found_inf if flag_in_inputs else None)
        # The step writes the model itself where its inputs carry the model params; otherwise
        # the masters are copied into the model after it, by the first post-hook if one runs.
        copies = inputs is None or (flag_in_inputs and inputs.model_params is None)
        self._copy_pending = copies and bool(len(masters))
        try:
            out = self._call(wrapped, instance, args, kwargs, inputs, found_inf, step_inputs)
        finally:
            copy_owed, self._copy_pending = self._copy_pending, False
        if len(masters):
            if copy_owed:  # no post-hook ran (a step that runs none, a LARC's)
                masters.copy_to_model(record.stepped_params())
            elif not copies:
                masters.mark_written(record.master_models())  # the step inputs' model params
            masters.release_grads()
        return out

    def _call(self, wrapped, instance, args, kwargs, inputs, found_inf, step_inputs):
        """The optimizer's own step, in the step context, with the overflow flag and the step
        inputs (``step_inputs``: the optimizer's context for them, or None) where it takes
        them."""
        opt = self._record.optimizer
        with self._step_context():
            if found_inf is not None and callable(step_inputs):
                with step_inputs(inputs or FusedStepInputs(found_inf=found_inf)):
                    out = wrapped(*args, **kwargs)
            elif found_inf is not None:
                out = _step_with_found_inf(opt, found_inf, wrapped, args, kwargs)
            elif inputs is None:
                out = _call_step(wrapped, instance, args, kwargs)
            else:
                with step_inputs(inputs):
                    out = wrapped(*args, **kwargs)
        return out

    def _copy_to_model(self, opt: Any, args: tuple, kwargs: dict) -> None:
        """The first step post-hook: the master-to-model copy a step owes, before any other
        hook runs."""
        if self._copy_pending:
            self._copy_pending = False
            self._record.masters.copy_to_model(self._record.stepped_params())

    def _zero_grad(self, wrapped, instance, args, kwargs):
        record = self._record
        set_to_none = _call_arg(instance, args, kwargs, "set_to_none", default=True)
        if set_to_none and _is_torch_zero_grad(wrapped, instance) and not labelled():
            out = grads_to_none(record.optimizer)  # torch's loop without its label (step_entry)
        else:
            out = wrapped(*args, **kwargs)
        # Master grads are amp's, not the caller's: released whichever way, as in Apex.
        record.masters.release_grads()
        clear_grads(record.master_models(), set_to_none)
        record.forget_stashed_grads()
        record.note_zeroed_grads(set_to_none)
        return out

    def _add_param_group(self, wrapped, instance, args, kwargs):
        record = self._record
        group = _call_arg(instance, args, kwargs, "param_group")
        params = group.get("params") if isinstance(group, dict) else None
        if params is not None and not isinstance(params, set):
            # A generator may be read only once. torch stores the caller's dict and makes its
            # params a list in place too; a set, a missing key or a non-dict it refuses itself.
            group["params"] = params = [params] if isinstance(params, Tensor) else list(params)
            if any(record.masters.master_for(p) is not None for p in params):
                # torch's own duplicate check compares with param_groups, which hold the masters.
                raise ValueError("some parameters appear in more than one parameter group")
        out = wrapped(*args, **kwargs)
        if record.master_weights:
            opt = record.optimizer
            record.masters.attach(opt.param_groups[-1], opt.state)
        return out


def takes_found_inf(opt: torch.optim.Optimizer) -> bool:
    """Whether ``opt.step()`` can take an overflow flag as a device tensor and skip on the device.

    amp_patch's fused optimizers take it through their step inputs; torch's
    fused Adam, AdamW and SGD (``_step_supports_amp_scaling``) through the
    ``found_inf`` attribute ``torch.amp.GradScaler`` sets, but for a fused SGD
    with momentum until each param has its buffer (its first step would leave
    a skipped buffer uninitialised). A LARC steps the optimizer it wraps with a
    trust ratio of its own, and reads the flag on the host.

    Example::

        >>> takes_found_inf(torch.optim.AdamW(model.parameters(), fused=True))
        True
        >>> takes_found_inf(torch.optim.SGD(model.parameters(), lr=0.1))
        False
    """
    step_inputs = getattr(opt, STEP_INPUTS, _MISSING)
    if isinstance(opt, LARC) or step_inputs is None:  # None: a subclass that opted out of them
        return False
    if callable(step_inputs):
        return True
    if not getattr(opt, "_step_supports_amp_scaling", False):
        return False
    # torch's fused SGD makes a param's momentum buffer uninitialised (empty_like) at its first
    # step and fills it in the kernel, which a raised flag skips: the buffer would stay garbage.
    # Until every buffer exists, its flag is read on the host.
    return not (isinstance(opt, torch.optim.SGD) and any(
        group["momentum"] != 0 and "momentum_buffer" not in opt.state.get(p, {})
        for group in opt.param_groups for p in group["params"]))


def host_reads_per_step(opt: torch.optim.Optimizer) -> int:
    """How many times a sync-free ``step()`` of ``opt`` reads the overflow flag on the host.

    0 for an optimizer that takes the flag and skips on the device without
    reading it (torch's fused Adam, AdamW and SGD; amp_patch's FusedAdam and
    FusedSGD with fp32 state); 1 for one that takes it but reads it for its
    host step counters (amp_patch's other fused optimizers,
    ``READS_FOUND_INF``), and for any other optimizer, which is skipped by not
    being called.

    Example::

        >>> host_reads_per_step(torch.optim.AdamW(model.parameters(), fused=True))
        0
        >>> host_reads_per_step(torch.optim.SGD(model.parameters(), lr=0.1))
        1
    """
    return int(not takes_found_inf(opt) or getattr(opt, "READS_FOUND_INF", False))


def _step_with_found_inf(opt: torch.optim.Optimizer, found_inf: Tensor, wrapped: Callable,
                         args: tuple, kwargs: dict) -> Any:
    """Call torch's fused step with the flag as ``torch.amp.GradScaler.step`` hands it: grads
    already unscaled (``grad_scale`` None), ``found_inf`` on the params' device."""
    device = next((p.device for g in opt.param_groups for p in g["params"]), found_inf.device)
    opt.grad_scale = None  # type: ignore[attr-defined]
    # 0-dim, as torch's scaler makes it: its fused kernels broadcast the flag into one.
    opt.found_inf = found_inf.to(device, non_blocking=True).reshape(())  # type: ignore[attr-defined]
    try:
        return wrapped(*args, **kwargs)
    finally:
        del opt.grad_scale, opt.found_inf  # type: ignore[attr-defined]


def _call_step(wrapped: Callable, instance: Any, args: tuple, kwargs: dict) -> Any:
    """Call a torch optimizer's ``step`` as torch's wrapper would, but without its label when
    no profiler runs (:func:`~amp_patch.optim.fused.step_entry.unlabelled_step`): the hooks and
    the profiler's look run all the same.

    Reached through the instance's MethodType, ``wrapped`` is the class's function and
    ``args`` starts with the optimizer; bound again (an LR scheduler made after
    initialize), ``wrapped`` is a bound method and ``instance`` the optimizer.
    """
    if instance is None:
        body, full_args = unlabelled_step(wrapped), args
    else:
        body, full_args = unlabelled_step(getattr(wrapped, "__func__", None)), (instance, *args)
    if body is None:
        return wrapped(*args, **kwargs)
    return run_step_hooks(full_args[0], body, full_args, kwargs)


def _is_torch_zero_grad(wrapped: Callable, instance: Any) -> bool:
    """Whether ``wrapped`` is torch's own ``Optimizer.zero_grad`` (as a function or bound)."""
    return (wrapped if instance is None else getattr(wrapped, "__func__", None)) is _TORCH_ZERO_GRAD


def _drop_self(bound_or_function: Callable) -> Callable:
    def adapter(self, *args, **kwargs):
        return bound_or_function(*args, **kwargs)

    adapter.__dict__.update(getattr(bound_or_function, "__dict__", {}))
    adapter.__name__ = getattr(bound_or_function, "__name__", "adapter")
    adapter.__qualname__ = getattr(bound_or_function, "__qualname__", adapter.__name__)
    adapter.__doc__ = getattr(bound_or_function, "__doc__", None)
    return adapter


def _call_arg(instance, args: tuple, kwargs: dict, name: str, default: Any = None) -> Any:
    """An argument of ``step``/``zero_grad``/``add_param_group``, however the wrapper was reached.

    Called through the instance's MethodType, ``args`` starts with the
    optimizer (``instance`` is None); bound again by a scheduler, it does not.
    """
    if name in kwargs:
        return kwargs[name]
    positional = args if instance is not None else args[1:]
    pos = _POSITIONS[name]
    return positional[pos] if len(positional) > pos else default
