"""What amp did to one optimizer, and what ``scale_loss`` does with its grads.

**The one-pass O2 step.** An optimizer that takes step inputs (it has
``fused_step_inputs``, as :mod:`amp_patch.optim.fused` do) is handed, at every
``step()``, the half model params to write in the same pass as the fp32
masters (:meth:`OptimizerRecord.step_inputs`). When, at a ``scale_loss`` exit,
its grads need no accumulating (no master grad yet, nothing stashed), the exit
does not unscale them at all (:meth:`OptimizerRecord.defer_unscale`): a
read-only norm of the grads as stored raises the overflow flag, the scaler's
one host sync decides the skip, and ``step()`` reads the half model grads (and
the fp32 grads of params stepped directly), still scaled, times the inverse
scale of that exit. No fp32 master grad is made. Whatever needs the unscaled
grads before the step, :func:`amp_patch.master_params` (clipping) or a further
``scale_loss`` entry (accumulation), first runs the unscale the exit left out
(:meth:`OptimizerRecord.materialize_grads`); the step then reads the masters'
grads as on the materialized path, to the same bits.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import operator
import weakref
from typing import TYPE_CHECKING, Any, Callable, ContextManager, Iterator

import torch
from torch import Tensor

from amp_patch.helpers.tensors import local_tensor, local_tensors, none_has_grad, version_of
from amp_patch.optim.amp.grad_state import GradState, GradStates
from amp_patch.optim.amp.master_weights import MasterWeights, match_state_to_params
from amp_patch.optim.amp.patched_methods import STEP_INPUTS, PatchedMethods
from amp_patch.optim.amp.state_dict_hooks import install_optimizer_hooks
from amp_patch.optim.fused import FusedStepInputs
from amp_patch.scaler import unscale_grads

if TYPE_CHECKING:
    from amp_patch.scaler import AmpScaler, _DeviceTensors

__all__ = ["OptimizerRecord", "process"]

logger = logging.getLogger("amp_patch")


@dataclasses.dataclass
class _DeferredGrads:
    """Grads a ``scale_loss`` exit left scaled, for the one-pass step to read.

    Attributes:
        grads (dict): stepped tensor (a master, or a param stepped directly)
            to its grad as stored (the half model grad, for a master).
        tensors (dict): device to the exit's ``inv_scale`` (a copy: the scaler's update
            may change its own) and the flag the deferred passes raise, which nothing reads
            (:meth:`AmpScaler.snapshot`).
        norms (dict or None): device to the L2 norm of ``grads`` there, from the check; None
            for sharded grads (the check reads only this rank's shards).
        versions (list): each grad's version counter at the exit, in ``grads``' order,
            to notice a grad written before the step.
    """

    grads: dict[Tensor, Tensor]
    tensors: dict[torch.device, "_DeviceTensors"]
    norms: dict[torch.device, Tensor] | None
    versions: list[int]


class OptimizerRecord:
    """What amp did to one optimizer, and the per-iteration flags that drive it.

    Made by :func:`process`; the session keeps one per optimizer passed to
    :func:`amp_patch.initialize`.

    Args:
        optimizer (torch.optim.Optimizer): the optimizer.
        master_weights (bool or torch.dtype): step half params through masters:
            fp32 ones (True, or ``torch.float32``), or bf16 ones
            (``torch.bfloat16``: a bf16 param is its own master).
        step_context (callable, optional): returns the context manager that
            ``step()`` runs in. Default: none.

    Attributes:
        master_weights (bool): whether half params are stepped through fp32 masters.
        masters (MasterWeights): the masters (empty without master weights).
        grads (GradStates): which :class:`~amp_patch.optim.amp.grad_state.GradState`
            the grads are in, moved only through it, and the skip the exits decided
            (:meth:`schedule_skip`): an overflow read on the host, or the device flag
            of a sync-free exit, which the next ``step()`` takes (on the device where
            the optimizer takes the flag).
        takes_step_inputs (bool): the optimizer steps the masters through step
            inputs (``fused_step_inputs``): it writes the model params itself,
            and takes the one-pass step.
        active (bool): False once :meth:`restore` ran; a wrapper that stayed
            on the optimizer then passes calls straight through.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, master_weights: bool | torch.dtype | None,
                 step_context: Callable[[], ContextManager] = contextlib.nullcontext) -> None:
        # The optimizer is held weakly: an LR scheduler made after initialize keeps our
        # (then inactive) step wrapper, and with it this record, after deinitialize.
        self._optimizer_ref = weakref.ref(optimizer)
        self.master_weights = bool(master_weights)
        master_dtype = master_weights if isinstance(master_weights, torch.dtype) else torch.float32
        self.masters = MasterWeights(master_dtype)
        self.grads = GradStates(type(optimizer).__name__)
        self.takes_step_inputs = self.master_weights and callable(
            getattr(optimizer, STEP_INPUTS, None))
        self.active = True
        # The tensors of the states (GradState): in STASHED, the unscaled grads taken out of
        # params stepped directly at entry (id -> grad); from DEFERRED until the step or the
        # unscale, the grads left scaled for the one-pass step.
        self._stashed: dict[int, Tensor] = {}
        self._deferred_grads: _DeferredGrads | None = None
        self._warned_grad_write = False
        # Grads that zero_grad left as zeros, id -> (grad, version): of params stepped directly
        # (for begin_backward) and of the half params behind the masters (for
        # warn_if_backward_bypassed_amp).
        self._zeroed_grads: dict[int, tuple[Tensor, int]] = {}
        self._warned_bypass = False
        # _pairs()'s lists, and what they were made from.
        self._pairs_version = -1  # the masters' version the lists were made at
        self._pairs_params: list[list[Tensor]] = []  # each group's params, as they were
        self._pairs_kept: list[tuple[Tensor, Tensor]] = []
        self._master_pairs_kept: list[tuple[Tensor, Tensor]] = []
        self._model_params_kept: dict[Tensor, Tensor] = {}  # master -> model param
        self._model_list_kept: list[Tensor] = []  # the pairs' model params, in order
        self._direct_list_kept: list[Tensor] = []  # the params stepped directly (no master)
        self._master_models_kept: list[Tensor] = []  # the model params behind the masters
        self._methods = PatchedMethods(self, step_context)
        self._hook_handles: list[Any] = []

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The optimizer (held weakly)."""
        opt = self._optimizer_ref()
        if opt is None:
            raise RuntimeError("the optimizer of this amp record was garbage collected")
        return opt

    def optimizer_or_none(self) -> torch.optim.Optimizer | None:
        """The optimizer, or None once it was garbage collected."""
        return self._optimizer_ref()

    # ----------------------------------------------------------------- params

    def stepped_params(self) -> Iterator[Tensor]:
        """The tensors the optimizer steps: fp32 masters for half params, else the params."""
        for group in self.optimizer.param_groups:
            yield from group["params"]

    def model_param(self, stepped: Tensor) -> Tensor:
        """The model parameter behind a stepped tensor (itself when it has no master)."""
        return self.masters.model_param(stepped)

    def master_models(self) -> list[Tensor]:
        """The model params behind the masters, in ``param_groups`` order (a list kept between
        calls: read it, do not change it)."""
        self._pairs()
        return self._master_models_kept

    def master_pairs(self) -> list[tuple[Tensor, Tensor]]:
        """``(model param, fp32 master)`` for each master, in ``param_groups`` order (a list kept
        between calls: read it, do not change it)."""
        self._pairs()
        return self._master_pairs_kept

    def sync_masters_from_model(self) -> None:
        """Refresh masters whose half param was written from outside
        (see :meth:`MasterWeights.sync_from_model`)."""
        if len(self.masters):  # O1, O3: no master, nothing to walk
            self.masters.sync_pairs(self.master_pairs(), self._master_models_kept)

    def _pairs(self) -> list[tuple[Tensor, Tensor]]:
        """(model param, stepped tensor) for everything the optimizer steps, in ``param_groups``
        order.

        Several calls of every iteration walk these; the list is made again only
        when the masters or the groups' param lists changed: the kept lists are
        compared with the groups' element by element, by identity (in C).
        """
        groups = self.optimizer.param_groups
        if self._pairs_version != self.masters.version or not _same_params(
                groups, self._pairs_params):
            model_param = self.masters.model_param
            self._pairs_kept = [(model_param(p), p) for g in groups for p in g["params"]]
            self._master_pairs_kept = [(m, p) for m, p in self._pairs_kept if m is not p]
            self._model_params_kept = {master: m for m, master in self._master_pairs_kept}
            self._model_list_kept = [m for m, _ in self._pairs_kept]
            self._direct_list_kept = [p for m, p in self._pairs_kept if m is p]
            self._master_models_kept = [m for m, _ in self._master_pairs_kept]
            self._pairs_version = self.masters.version
            self._pairs_params = [list(g["params"]) for g in groups]
        return self._pairs_kept

    # ------------------------------------------------------- scale_loss hooks

    def schedule_skip(self, overflow: bool | Tensor) -> None:
        """Make the next ``step()`` skip on ``overflow``: True (read on the host), or a device
        flag (one-element fp32), combined on the device with any flag already scheduled.

        Args:
            overflow (bool or Tensor): the overflow of a ``scale_loss`` exit.

        Example::

            >>> model, optimizer = amp.initialize(model, optimizer, opt_level="O1",
            ...                                   half_dtype=torch.float16, verbosity=0)
            >>> record = amp_patch.session.current().record_for(optimizer)
            >>> with amp.scale_loss(loss_fn(model(x), y), optimizer) as scaled_loss:
            ...     scaled_loss.backward()                 # the exit calls schedule_skip
            >>> record.grads.state, record.grads.found_inf  # sync-free: the flag, unread
            (<GradState.SKIP_ON_DEVICE: 'skip decided on device'>, tensor([0.]))
            >>> amp.deinitialize()
        """
        self.grads.decide(overflow, "scale_loss exit")

    def begin_backward(self, delay_unscale: bool) -> None:
        """At ``scale_loss`` entry: the grads go to ``STASHED``, already-unscaled ones aside.

        Grads an earlier exit left for the one-pass step are unscaled first
        (:meth:`materialize_grads`). Then, unless ``delay_unscale``, unscaled
        grads are taken aside so backward starts clean: without this, a second
        loss (or an accumulation step) would add scaled grads onto unscaled
        ones. Params without masters hand their grad to a stash; half params
        with masters drop their (already consumed) model grad, the master grad
        staying as the accumulator. Nothing is taken aside from ``SCALED``
        (a ``delay_unscale`` exit left scaled grads in place). A grad that the
        optimizer's ``zero_grad`` zeroed and nothing wrote since stays where it
        is: backward adds onto zeros, and the exit finds a fresh grad (which
        the one-pass step can take).
        """
        self.materialize_grads()
        if delay_unscale:  # its exit moves the grads to SCALED
            return
        zeroed, self._zeroed_grads = self._zeroed_grads, {}
        if not self.grads.enter_block(delay_unscale):
            return
        pairs = self._pairs()
        if none_has_grad(self._model_list_kept):
            return  # no grad anywhere (zero_grad set them to None): nothing to move
        for model_p, stepped in pairs:
            if model_p is stepped:
                grad = stepped.grad
                if grad is not None and not _still_zero(zeroed.get(id(stepped)), grad):
                    self._stashed[id(stepped)] = grad
                    stepped.grad = None
            elif model_p.grad is not None:  # reading .grad costs less than setting it
                model_p.grad = None

    def note_zeroed_grads(self, set_to_none: bool) -> None:
        """After the optimizer's ``zero_grad``: the grads its params stepped directly still hold
        are zeros (``set_to_none=False``); remember them, with their version counters, so that
        :meth:`begin_backward` need not stash them (only for optimizers that take step inputs,
        whose ``zero_grad`` is torch's), and those of the half params behind the masters, so
        that :meth:`warn_if_backward_bypassed_amp` does not take zeros for a backward's grads.

        Args:
            set_to_none (bool): how amp cleared the half params' grads (None: nothing to keep).
        """
        if set_to_none and not self.takes_step_inputs:
            self._zeroed_grads = {}
            return
        self._pairs()
        zeroed = [] if set_to_none else self._master_models_kept
        if self.takes_step_inputs:
            zeroed = zeroed + self._direct_list_kept
        self._zeroed_grads = {id(p): (p.grad, p.grad._version) for p in zeroed
                              if p.grad is not None}

    def collect_unscale(self, in_place: list, copy: tuple[list, list],
                        accumulate: tuple[list, list]) -> None:
        """At ``scale_loss`` exit: sort each fresh grad into the fused pass that unscales it.

        ``in_place`` (no master, nothing stashed), ``copy`` (half grad into the
        master's fp32 grad storage, see :meth:`MasterWeights.grad_storage`) or
        ``accumulate`` (``y = x / scale + y`` into the stashed grad or the
        existing master grad).
        """
        prior = self._stashed
        for model_p, stepped in self._pairs():
            grad = model_p.grad
            if model_p is stepped:
                old = prior.pop(id(stepped), None)
                if grad is None:
                    if old is not None:
                        stepped.grad = old
                elif old is None:
                    in_place.append(grad)
                else:
                    accumulate[0].append(grad)
                    accumulate[1].append(old)
                    stepped.grad = old
            elif grad is not None:
                if stepped.grad is None:
                    stepped.grad = self.masters.grad_storage(stepped)
                    copy[0].append(grad)
                    copy[1].append(stepped.grad)
                else:
                    accumulate[0].append(grad)
                    accumulate[1].append(stepped.grad)
        prior.clear()
        self.grads.move(GradState.UNSCALED, "scale_loss exit, unscaling")

    def end_backward_scaled(self) -> None:
        """At a ``delay_unscale=True`` exit: the grads stay loss-scaled in the params."""
        self.grads.move(GradState.SCALED, "delay_unscale exit")

    def defer_unscale(self, scaler: "AmpScaler", losses: list[Tensor] | None = None) -> bool:
        """At ``scale_loss`` exit: leave the fresh grads scaled for the one-pass step, if it can.

        It applies when the optimizer takes step inputs and nothing is to be
        accumulated (no master grad, nothing stashed at entry). The grads are
        then only read, by the scaler's check, which raises the overflow flag;
        they stay as they are, in the params, until ``step()``.

        Args:
            scaler (AmpScaler): the exit's scaler; its inverse scale is kept.
            losses (list of Tensor, optional): losses still to check, handed to the scaler's
                check (:meth:`AmpScaler.check`), which takes out those it checked.

        Returns:
            bool: True when deferred; False leaves them to :meth:`collect_unscale`.
        """
        if not self.takes_step_inputs or self._stashed:
            return False
        grads = {}
        for model_p, stepped in self._pairs():
            if model_p is not stepped and stepped.grad is not None:
                return False  # a master grad to accumulate into
            grad = model_p.grad
            if grad is not None:
                grads[stepped] = grad
        values = list(grads.values())
        local = local_tensors(values)
        norms = scaler.check(local, losses)
        # The check's norms of sharded grads are this rank's part, not the whole's.
        sharded = local is not values and any(shard is not g for shard, g in zip(local, values))
        self._deferred_grads = _DeferredGrads(
            grads, {dev: scaler.snapshot(dev) for dev in norms}, None if sharded else norms,
            list(map(version_of, values)))
        self.grads.move(GradState.DEFERRED, "scale_loss exit, for the one-pass step")
        return True

    def materialize_grads(self) -> None:
        """Run the unscale that :meth:`defer_unscale` left out: half grads into the masters' fp32
        grads, grads of params stepped directly in place, by the exit's inverse scale.

        Called before anything that needs the unscaled grads: :func:`amp_patch.master_params`
        (clipping) and the next ``scale_loss`` entry (accumulating). Nothing to do otherwise.
        The overflow was decided at the exit: these passes raise a flag of their own.
        """
        deferred, self._deferred_grads = self._deferred_grads, None
        if deferred is None:
            return
        if self.grads.state is GradState.DEFERRED:  # after the exit's verdict, the state stays
            self.grads.move(GradState.UNSCALED, "master_params() or the next entry unscales")
        in_place: list[Tensor] = []
        copy: tuple[list[Tensor], list[Tensor]] = ([], [])
        for model_p, stepped in self._pairs():
            grad = deferred.grads.get(stepped)
            if grad is None:
                continue
            if model_p is stepped:
                in_place.append(grad)
            else:
                stepped.grad = self.masters.grad_storage(stepped)
                copy[0].append(grad)
                copy[1].append(stepped.grad)
        unscale_grads(in_place, copy, deferred.tensors.__getitem__)

    def drop_deferred(self) -> None:
        """Forget deferred grads whose step was skipped (an overflow)."""
        self._deferred_grads = None

    def step_inputs(self, found_inf: Tensor | None = None) -> FusedStepInputs | None:
        """What ``step()`` of an optimizer that takes step inputs reads, and writes besides params.

        The half model params, written in the same pass as their masters (a
        mapping kept from step to step while the pairs stay, to be read, not
        changed); with deferred grads, also those grads, the exit's inverse
        scale and the check's norms; and ``found_inf``, the device flag the
        step skips on. None for other optimizers.
        """
        if not self.takes_step_inputs:
            return None
        self._pairs()
        model_params = self._model_params_kept
        deferred, self._deferred_grads = self._deferred_grads, None
        if deferred is None:
            return FusedStepInputs(model_params=model_params, found_inf=found_inf)
        self._warn_if_grads_written(deferred)
        first = next(iter(deferred.tensors.values()), None)
        return FusedStepInputs(grads=deferred.grads, model_params=model_params,
                               inv_scale=None if first is None else first.inv_scale,
                               found_inf=found_inf, grad_norms=deferred.norms)

    def warn_if_backward_bypassed_amp(self) -> None:
        """At ``step()``: warn, once, when half params behind masters hold grads that no
        ``scale_loss`` exit took: a backward run outside ``scale_loss``.

        Such a step goes over the fp32 masters, which got no grads, so it changes
        nothing (as in Apex, which said nothing either). Only a step taken before
        any exit (just after ``initialize``) or right after the optimizer's
        ``zero_grad`` is looked at: after an exit the half grads are taken
        (consumed) ones, and the check costs nothing on that path. Grads that
        ``zero_grad(set_to_none=False)`` zeroed and nothing wrote since are not
        counted.
        """
        if (self._warned_bypass or not len(self.masters)
                or self.grads.state not in (GradState.READY, GradState.ZEROED)):
            return
        models = self.master_models()
        if none_has_grad(models):
            return
        zeroed = self._zeroed_grads
        if all(m.grad is None or _still_zero(zeroed.get(id(m)), m.grad) for m in models):
            return
        self._warned_bypass = True
        logger.warning(
            "amp_patch: %s.step() found grads on the model's half params that no "
            "amp.scale_loss exit took: backward ran outside scale_loss. The optimizer steps the "
            "fp32 master weights, which have no grads, so this step changes nothing. Run the "
            "backward as `with amp.scale_loss(loss, optimizer) as scaled_loss: "
            "scaled_loss.backward()` (with bf16 too: it is what hands the grads to the masters).",
            type(self.optimizer).__name__)

    def _warn_if_grads_written(self, deferred: _DeferredGrads) -> None:
        if self._warned_grad_write or (
                list(map(version_of, deferred.grads.values())) == deferred.versions):
            return
        self._warned_grad_write = True
        logger.warning(
            "amp_patch: the model's grads were written between scale_loss and %s.step(). "
            "Under O2 with a fused optimizer, step() reads them as they are (scaled by the loss "
            "scale); to clip, clip amp.master_params(optimizer), which holds the unscaled fp32 "
            "grads.", type(self.optimizer).__name__)

    def abandon_backward(self, delay_unscale: bool) -> None:
        """An exception left ``scale_loss`` after :meth:`begin_backward`.

        Under ``delay_unscale`` nothing was taken aside: the grads go back to
        the state they had. Else the partial, still scaled grads are dropped
        and the stashed unscaled ones put back (None where there were none), so
        that the next iteration never mistakes scaled grads for unscaled ones.
        """
        if delay_unscale:  # its entry moved nothing
            return
        for model_p, stepped in self._pairs():
            old = self._stashed.pop(id(stepped), None)
            if model_p is stepped:
                stepped.grad = old
            else:
                model_p.grad = None
        self._stashed.clear()
        self.grads.leave_block()

    def forget_stashed_grads(self) -> None:
        """``zero_grad()``: drop the grads :meth:`begin_backward` took aside (inside the block),
        and any deferred ones (:meth:`GradStates.zeroed` makes the move)."""
        self._stashed.clear()
        self._deferred_grads = None
        self.grads.zeroed()

    def nonfinite_grad_names(self, names: dict[int, str]) -> list[str]:
        """Names of params whose (model) grads hold inf/NaN; syncs, for error messages only."""
        out = []
        for gi, group in enumerate(self.optimizer.param_groups):
            for pi, stepped in enumerate(group["params"]):
                model_p = self.masters.model_param(stepped)
                grad = model_p.grad if model_p.grad is not None else stepped.grad
                # This rank's shard of a sharded grad: a DTensor's all() would be a collective.
                if grad is not None and not bool(torch.isfinite(local_tensor(grad)).all()):
                    out.append(names.get(id(model_p), f"param_groups[{gi}]['params'][{pi}]"))
        return out

    # ------------------------------------------------------------ install/undo

    def install(self) -> None:
        """Make the masters, register the checkpoint hooks, and patch the methods."""
        opt = self.optimizer
        if self.master_weights:
            for group in opt.param_groups:
                self.masters.attach(group, opt.state)
            self._hook_handles += install_optimizer_hooks(opt, self.masters,
                                                          self.sync_masters_from_model)
        # State made before a cast (or by an earlier session) follows its param's dtype.
        match_state_to_params(opt, (p for p in self.stepped_params()
                                    if not self.masters.is_master(p)))
        self._methods.install()

    def _forget_pairs(self) -> None:
        """Drop :meth:`_pairs`'s lists (and their references to the params)."""
        self._pairs_version, self._pairs_params = -1, []
        self._pairs_kept, self._master_pairs_kept = [], []
        self._model_params_kept, self._model_list_kept = {}, []
        self._direct_list_kept, self._master_models_kept = [], []

    def restore(self) -> None:
        """Undo :meth:`install`: original methods back, hooks removed, model params back in
        ``param_groups``.

        The optimizer state of each master moves to its model parameter, cast
        to that parameter's dtype except ``step`` counters. Values are not
        changed: after every step the model already equals its masters.
        """
        self._uninstall()
        opt = self._optimizer_ref()
        if opt is not None and len(self.masters):
            self.masters.detach(opt)

    def abort(self, groups: list[list[Tensor]], state: dict) -> None:
        """Undo a :meth:`install` of a failed initialize: as :meth:`restore`, but the param
        lists and the state entries go back to the very objects of before (see :func:`process`)."""
        self._uninstall()
        opt = self._optimizer_ref()
        if opt is None:
            return
        for group, params in zip(opt.param_groups, groups):
            for p in group["params"]:
                if self.masters.is_master(p):
                    opt.state.pop(p, None)
            group["params"][:] = params
        opt.state.update(state)
        self.masters.detach(opt)

    def _uninstall(self) -> None:
        self.active = False
        for handle in self._hook_handles:
            handle.remove()
        self._hook_handles.clear()
        self._methods.restore()
        self._stashed.clear()
        self._deferred_grads = None
        self._forget_pairs()
        self.grads.reset()


def _still_zero(zeroed: tuple[Tensor, int] | None, grad: Tensor) -> bool:
    """Whether ``grad`` is the very tensor ``zero_grad`` zeroed, unwritten since."""
    return zeroed is not None and zeroed[0] is grad and zeroed[1] == grad._version


def _same_params(groups: list[dict[str, Any]], kept: list[list[Tensor]]) -> bool:
    """Whether each group's params are the very tensors of ``kept``, in order (compared in C)."""
    return len(groups) == len(kept) and all(
        len(g["params"]) == len(params) and all(map(operator.is_, g["params"], params))
        for g, params in zip(groups, kept))


def process(optimizer: torch.optim.Optimizer, master_weights: bool | torch.dtype | None,
            on_close: Callable[..., None],
            step_context: Callable[[], ContextManager] = contextlib.nullcontext,
            optimizer_state: str = "fp32") -> OptimizerRecord:
    """Make ``optimizer`` an amp optimizer.

    Creates the fp32 masters when ``master_weights`` is set and wraps
    ``step``, ``zero_grad`` and ``add_param_group``. Registers the undo
    (:meth:`OptimizerRecord.restore`, or :meth:`OptimizerRecord.abort` when
    initialize fails) with ``on_close`` first, so that it runs even when
    installing fails half-way.

    Args:
        optimizer (torch.optim.Optimizer): built over the (already cast) model's params.
        master_weights (bool or torch.dtype): keep masters of the half params:
            fp32 (True, ``torch.float32``) or bf16 (``torch.bfloat16``, with
            stochastic rounding; a bf16 param is its own master).
        on_close (callable): ``on_close(what, undo, abort=...)`` registers an undo with
            the session.
        step_context (callable, optional): returns the context manager that
            ``step()`` runs in. Default: none.
        optimizer_state (str, optional): the optimizer's state format (see
            :mod:`amp_patch.optim.fused.state_format`). Default: ``"fp32"``.

    Returns:
        OptimizerRecord: the record, for the session to keep.

    Raises:
        ValueError: a low-precision ``optimizer_state`` or bf16 masters for an
            optimizer that cannot keep them (anything but FusedAdam, FusedSGD, FusedLAMB).

    Example::

        >>> undos = []
        >>> on_close = lambda what, undo, abort=None: undos.append(undo)  # the session's on_close
        >>> record = process(optimizer, True, on_close, amp.disable_casts)
        >>> all(p.dtype == torch.float32 for p in record.stepped_params())
        True
    """
    lean = optimizer_state != "fp32" or master_weights == torch.bfloat16
    if lean:
        _check_lean(optimizer, optimizer_state, master_weights)
    record = OptimizerRecord(optimizer, master_weights, step_context)
    if lean:
        fused = _fused(optimizer)
        previous = (fused.state_format, fused.stochastic_rounding)
        on_close(f"{type(fused).__name__}'s state format",
                 lambda: fused.set_state_format(*previous))
        fused.set_state_format(optimizer_state,
                               stochastic_rounding=master_weights == torch.bfloat16)
    # What a failed initialize puts back: the param lists and state entries themselves.
    groups = [list(group["params"]) for group in optimizer.param_groups]
    state = {p: optimizer.state[p] for params in groups for p in params if p in optimizer.state}
    on_close(f"{type(optimizer).__name__} methods and masters", record.restore,
             abort=lambda: record.abort(groups, state))
    record.install()
    return record


def _fused(optimizer: torch.optim.Optimizer) -> Any:
    """The optimizer that keeps the state: the one a LARC wraps, else itself."""
    return getattr(optimizer, "optim", optimizer)


def _check_lean(optimizer: torch.optim.Optimizer, optimizer_state: str,
                master_weights: bool | torch.dtype | None) -> None:
    fused = _fused(optimizer)
    if getattr(fused, "LEAN_STATE", False):
        return
    asked = " and ".join(
        ([f"optimizer_state={optimizer_state!r}"] if optimizer_state != "fp32" else [])
        + (["master_weights='bf16'"] if master_weights == torch.bfloat16 else []))
    raise ValueError(
        f"{asked} needs an optimizer that keeps low-precision state and rounds bf16 params "
        f"stochastically: amp_patch.optim.fused.FusedAdam, FusedSGD or FusedLAMB. "
        f"{type(fused).__name__} "
        "keeps its own fp32 state; build the optimizer as FusedAdam(params, ...) (the same "
        "arguments as torch.optim.AdamW) or FusedSGD, or leave optimizer_state at 'fp32'.")
