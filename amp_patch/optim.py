"""Optimizer processing: fp32 master weights, the patched methods, and step skipping.

:func:`process` turns an optimizer into an amp one and returns the
:class:`OptimizerRecord` that holds everything about it:

- With master weights, every half (fp16/bf16) parameter in ``param_groups``
  is replaced by an fp32 master made at once (so ``step()`` before any
  backward works). fp32 parameters stay and are stepped directly. The
  optimizer therefore makes its state in fp32. After each step the masters
  are copied into the model in one fused ``multi_tensor_copy_`` per
  (device, dtype).
- ``step``, ``zero_grad`` and ``add_param_group`` are wrapped on the
  instance as ``types.MethodType(wrapt.FunctionWrapper(func, wrapper), opt)``.
  An ``lr_scheduler`` reads ``opt.step.__func__`` and binds it again, which
  still reaches the wrapper, so a scheduler made after :func:`process` works;
  one made before has already put its own function on the instance, and that
  function is wrapped in turn, keeping the scheduler's bookkeeping.
- A step is skipped by not calling the optimizer's ``step`` at all. Nothing
  the optimizer owns is touched: parameters, masters, and every state tensor,
  including Adam's ``state["step"]`` counters.
- Checkpoints: ``optimizer.state_dict()`` gains ``"amp_master_params"`` (the
  fp32 masters, by the same flat index as ``state``), and
  ``load_state_dict`` restores them, so training resumes bit-exactly.

After :meth:`OptimizerRecord.restore` (run by :func:`amp_patch.deinitialize`)
the optimizer again steps the model's own parameters: each master in
``param_groups`` is replaced by its model parameter, and the state kept for
the master moves to the parameter, cast to the parameter's dtype as
``Optimizer.load_state_dict`` would (``step`` counters unchanged). The model
keeps its current (half) values.
"""

from __future__ import annotations

import logging
import types
import weakref
from typing import Any, Callable, Iterator

import torch
import wrapt
from torch import Tensor, nn

from amp_patch import ops
from amp_patch.patching.state import disable_casts
from amp_patch.scaler import group_by_device_and_dtype
from amp_patch.session import AmpSession

__all__ = ["process", "OptimizerRecord", "master_params"]

logger = logging.getLogger("amp_patch")

_HALF = (torch.float16, torch.bfloat16)
_MASTERS_KEY = "amp_master_params"
_MISSING = object()


class OptimizerRecord:
    """What amp did to one optimizer, and the per-iteration flags that drive it.

    Made by :func:`process`; ``session.optimizer_records`` maps ``id(optimizer)``
    to it.

    Args:
        optimizer (torch.optim.Optimizer): the optimizer.
        session (AmpSession): the live session.

    Attributes:
        master_weights (bool): whether half params are stepped through fp32 masters.
        skip_next_step (bool): set by :func:`amp_patch.scale_loss` on overflow;
            the next ``step()`` does nothing and clears it.
        scaled_grads_pending (bool): a ``delay_unscale=True`` exit left scaled
            grads in the params; the next ``scale_loss`` must not stash them.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, session: AmpSession) -> None:
        # Neither the optimizer nor the session is held strongly: an LR scheduler made
        # after initialize keeps our (then inactive) step wrapper, and with it this record,
        # after deinitialize.
        self._optimizer_ref = weakref.ref(optimizer)
        self.master_weights = bool(session.props.master_weights)
        self.skip_next_step = False
        self.scaled_grads_pending = False
        self.active = True
        # id(master) -> model param, and the reverse: the only link between the two.
        self._model_of: dict[int, nn.Parameter] = {}
        self._master_of: dict[int, Tensor] = {}
        # Unscaled grads taken out of stepped params at scale_loss entry (id -> grad).
        self._prior: dict[int, Tensor] = {}
        # id(master) -> the storage its fp32 grad is unscaled into, reused every iteration.
        self._grad_buffers: dict[int, Tensor] = {}
        # id(model param) -> its version counter right after amp last wrote it.
        self._written_version: dict[int, int] = {}
        self._hook_handles: list[Any] = []
        self._saved_methods: dict[str, Any] = {}

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The optimizer (held weakly)."""
        opt = self._optimizer_ref()
        if opt is None:
            raise RuntimeError("the optimizer of this amp record was garbage collected")
        return opt

    # ----------------------------------------------------------------- params

    def stepped_params(self) -> Iterator[Tensor]:
        """The tensors the optimizer steps: fp32 masters for half params, else the params."""
        for group in self.optimizer.param_groups:
            yield from group["params"]

    def model_param(self, stepped: Tensor) -> Tensor:
        """The model parameter behind a stepped tensor (itself when it has no master)."""
        return self._model_of.get(id(stepped), stepped)

    def _attach_masters(self, group: dict) -> None:
        state = self.optimizer.state
        params = group["params"]
        for i, p in enumerate(params):
            if p.dtype not in _HALF or id(p) in self._master_of:
                continue
            master = nn.Parameter(p.detach().float(), requires_grad=p.requires_grad)
            if p.grad is not None:
                master.grad = p.grad.detach().float()
            self._model_of[id(master)] = p
            self._master_of[id(p)] = master
            self._written_version[id(p)] = p._version
            params[i] = master
            if p in state:  # the optimizer stepped before initialize: keep its state, in fp32
                state[master] = {k: _state_to(v, torch.float32, master.device, k)
                                 for k, v in state.pop(p).items()}

    def _pairs(self) -> list[tuple[Tensor, Tensor]]:
        """(model param, stepped tensor) for everything the optimizer steps."""
        return [(self.model_param(p), p) for p in self.stepped_params()]

    # ------------------------------------------------------- scale_loss hooks

    def prepare_backward(self) -> None:
        """At ``scale_loss`` entry: take already-unscaled grads aside so backward starts clean.

        Without this, a second loss (or an accumulation step) would add scaled
        grads onto unscaled ones. Params without masters hand their grad to a
        stash; half params with masters drop their (already consumed) model
        grad, the master grad staying as the accumulator. Skipped while
        ``delay_unscale`` has left scaled grads in place.
        """
        if self.scaled_grads_pending:
            return
        for model_p, stepped in self._pairs():
            if model_p is stepped:
                if stepped.grad is not None:
                    self._prior[id(stepped)] = stepped.grad
                    stepped.grad = None
            else:
                model_p.grad = None

    def collect_unscale(self, in_place: list, copy: tuple[list, list],
                        accumulate: tuple[list, list]) -> None:
        """At ``scale_loss`` exit: sort each fresh grad into the fused pass that unscales it.

        ``in_place`` (no master, nothing stashed), ``copy`` (half grad into the
        master's fp32 grad storage, see :meth:`_master_grad_storage`) or ``accumulate`` (``y = x / scale + y`` into the
        stashed grad or the existing master grad).
        """
        prior = self._prior
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
                    stepped.grad = self._master_grad_storage(stepped)
                    copy[0].append(grad)
                    copy[1].append(stepped.grad)
                else:
                    accumulate[0].append(grad)
                    accumulate[1].append(stepped.grad)
        prior.clear()
        self.scaled_grads_pending = False

    def _master_grad_storage(self, master: Tensor) -> Tensor:
        """The fp32 tensor a master's grad is written into, kept from one iteration to the next.

        A fresh ``empty_like`` per master per iteration (tens of MB for a
        model of 20 M params) lands on newly mapped pages, and faulting them in
        costs several times the unscale pass itself. So each master keeps one
        buffer, as ``zero_grad(set_to_none=False)`` would keep its grad;
        ``.grad`` itself is still released (see :meth:`release_master_grads`),
        and the next ``scale_loss`` refills the same storage. A grad tensor
        kept by the caller across iterations therefore sees the next
        iteration's values.
        """
        buf = self._grad_buffers.get(id(master))
        if buf is None or buf.shape != master.shape or buf.stride() != master.stride() \
                or buf.device != master.device:
            # The master's layout is its param's (channels-last stays channels-last), so the
            # unscale pass reads the half grad and writes this buffer as two dense runs.
            buf = torch.empty_like(master)
            self._grad_buffers[id(master)] = buf
        return buf

    def abandon_backward(self) -> None:
        """An exception left ``scale_loss`` after :meth:`prepare_backward`: drop the partial,
        still scaled grads and put the stashed unscaled ones back (None where there were none),
        so that the next iteration never mistakes scaled grads for unscaled ones."""
        for model_p, stepped in self._pairs():
            old = self._prior.pop(id(stepped), None)
            if model_p is stepped:
                stepped.grad = old
            else:
                model_p.grad = None
        self._prior.clear()

    def nonfinite_grad_names(self, names: dict[int, str]) -> list[str]:
        """Names of params whose (model) grads hold inf/NaN; syncs, for error messages only."""
        out = []
        for gi, group in enumerate(self.optimizer.param_groups):
            for pi, stepped in enumerate(group["params"]):
                model_p = self.model_param(stepped)
                grad = model_p.grad if model_p.grad is not None else stepped.grad
                if grad is not None and not bool(torch.isfinite(grad).all()):
                    out.append(names.get(id(model_p), f"param_groups[{gi}]['params'][{pi}]"))
        return out

    # --------------------------------------------------------- patched methods

    def _step(self, wrapped, instance, args, kwargs):
        self.sync_masters_from_model()
        if self.skip_next_step:
            # Not calling the optimizer at all is what keeps its state (Adam's
            # step counters included) exactly as it was.
            self.skip_next_step = False
            logger.debug("amp_patch: skipped %s.step() after a gradient overflow",
                         type(self.optimizer).__name__)
            # A skipped step is still the optimizer's step for an LR scheduler: the flag its
            # wrapper would set, so no "lr_scheduler.step() before optimizer.step()" warning.
            self.optimizer._opt_called = True
            self.release_master_grads()
            return None
        if self.master_weights and _call_arg(instance, args, kwargs, "closure") is not None:
            raise RuntimeError(
                "optimizer.step(closure) is not supported with master weights: the closure's "
                "backward would not reach the fp32 masters. Call scale_loss and step() directly."
            )
        with disable_casts():
            out = wrapped(*args, **kwargs)
        if self._model_of:
            self._copy_masters_to_model()
            self.release_master_grads()
        return out

    def release_master_grads(self) -> None:
        """Set every master's ``.grad`` to None, as Apex did after each step and skipped step.

        ``model.zero_grad()`` (or clearing the model's grads by hand) cannot
        reach the masters, so without this the next iteration would add onto
        this one's master grads. The storage itself is kept for the next
        iteration (see :meth:`_master_grad_storage`).
        """
        for master in self._master_of.values():
            master.grad = None

    @torch.no_grad()
    def _copy_masters_to_model(self) -> None:
        models, masters = [], []
        for p in self.stepped_params():
            model_p = self._model_of.get(id(p))
            if model_p is not None:
                models.append(model_p)
                masters.append(p)
        for (_, _), (dst, src) in group_by_device_and_dtype(models, masters).items():
            ops.multi_tensor_copy_(src, dst)
        for model_p in models:
            self._written_version[id(model_p)] = model_p._version

    @torch.no_grad()
    def sync_masters_from_model(self) -> None:
        """Refresh masters whose model param was changed from outside since amp last wrote it.

        ``model.load_state_dict(...)`` after :func:`amp_patch.initialize` (fine-tuning
        from pretrained weights) writes the half params only; stepping the stale
        masters would copy the old weights back. A master is refreshed only when
        its param no longer equals the master rounded to the param's dtype, so
        loading a consistent checkpoint keeps the exact fp32 masters.
        """
        for stepped in self.stepped_params():
            model_p = self._model_of.get(id(stepped))
            if model_p is None or self._written_version.get(id(model_p)) == model_p._version:
                continue
            if not torch.equal(model_p, stepped.to(model_p.dtype)):
                stepped.copy_(model_p)
            self._written_version[id(model_p)] = model_p._version

    def _zero_grad(self, wrapped, instance, args, kwargs):
        out = wrapped(*args, **kwargs)
        set_to_none = _call_arg(instance, args, kwargs, "set_to_none", default=True)
        # Master grads are amp's, not the caller's: released whichever way, as in Apex.
        self.release_master_grads()
        for p in self.stepped_params():
            model_p = self._model_of.get(id(p))
            if model_p is not None and model_p.grad is not None:
                if set_to_none:
                    model_p.grad = None
                else:
                    if model_p.grad.grad_fn is not None:
                        model_p.grad.detach_()
                    else:
                        model_p.grad.requires_grad_(False)
                    model_p.grad.zero_()
        self._prior.clear()
        return out

    def _add_param_group(self, wrapped, instance, args, kwargs):
        group = _call_arg(instance, args, kwargs, "param_group")
        params = group.get("params", ()) if isinstance(group, dict) else ()
        params = [params] if isinstance(params, Tensor) else list(params)
        if any(id(p) in self._master_of for p in params):
            # torch's own duplicate check compares with param_groups, which hold the masters.
            raise ValueError("some parameters appear in more than one parameter group")
        if isinstance(group, dict):
            group = dict(group, params=params)  # a generator may be read only once
            if "param_group" in kwargs:
                kwargs = dict(kwargs, param_group=group)
            else:
                args = args[:len(args) - 1] + (group,)
        out = wrapped(*args, **kwargs)
        if self.master_weights:
            self._attach_masters(self.optimizer.param_groups[-1])
        return out

    def _patch(self, name: str, wrapper: Callable) -> None:
        opt = self.optimizer
        own = opt.__dict__.get(name, _MISSING)
        self._saved_methods[name] = own
        if own is _MISSING:
            target = getattr(type(opt), name)
        else:
            # Already replaced on the instance (an lr_scheduler made before
            # initialize). That callable takes no self; adapt it, and copy its
            # attributes (the scheduler's marker) so they stay visible.
            target = _drop_self(own)
        proxy = wrapt.FunctionWrapper(target, wrapper, enabled=lambda: self.active)
        setattr(opt, name, types.MethodType(proxy, opt))

    def _unpatch(self, name: str) -> None:
        opt = self._optimizer_ref()
        if opt is None:
            return
        now = opt.__dict__.get(name, _MISSING)
        if not (isinstance(now, types.MethodType) and isinstance(now.__func__, wrapt.FunctionWrapper)
                and now.__self__ is opt):
            # Something (a scheduler made after initialize) wrapped ours; it
            # stays, and our wrapper passes calls straight through (active=False).
            return
        saved = self._saved_methods.pop(name)
        if saved is _MISSING:
            delattr(opt, name)
        else:
            setattr(opt, name, saved)

    def install(self) -> None:
        """Make the masters, patch the methods, and register the checkpoint hooks."""
        opt = self.optimizer
        if self.master_weights:
            for group in opt.param_groups:
                self._attach_masters(group)
            self._hook_handles += [
                opt.register_state_dict_post_hook(self._state_dict_post_hook),
                opt.register_load_state_dict_pre_hook(self._load_state_dict_pre_hook),
            ]
        self._patch("step", self._step)
        self._patch("zero_grad", self._zero_grad)
        self._patch("add_param_group", self._add_param_group)

    def restore(self) -> None:
        """Undo :meth:`install`: original methods back, hooks removed, model params back in ``param_groups``.

        The optimizer state of each master moves to its model parameter, cast
        to that parameter's dtype except ``step`` counters. Values are not
        changed: after every step the model already equals its masters.
        """
        self.active = False
        for handle in self._hook_handles:
            handle.remove()
        self._hook_handles.clear()
        for name in ("add_param_group", "zero_grad", "step"):
            self._unpatch(name)
        opt = self._optimizer_ref()
        if opt is None or not self._model_of:
            return
        for group in opt.param_groups:
            params = group["params"]
            for i, p in enumerate(params):
                model_p = self._model_of.get(id(p))
                if model_p is None:
                    continue
                params[i] = model_p
                if p in opt.state:
                    opt.state[model_p] = {k: _state_to(v, model_p.dtype, model_p.device, k)
                                          for k, v in opt.state.pop(p).items()}
        self._model_of.clear()
        self._master_of.clear()
        self._prior.clear()
        self._grad_buffers.clear()
        self._written_version.clear()

    # ------------------------------------------------------------ checkpoints

    def _state_dict_post_hook(self, optimizer, state_dict: dict) -> dict:
        self.sync_masters_from_model()
        flat = [p for group in optimizer.param_groups for p in group["params"]]
        state_dict[_MASTERS_KEY] = {i: p for i, p in enumerate(flat) if id(p) in self._model_of}
        return state_dict

    @torch.no_grad()
    def _load_state_dict_pre_hook(self, optimizer, state_dict: dict) -> dict:
        state_dict = dict(state_dict)
        saved = state_dict.pop(_MASTERS_KEY, None)
        flat = [p for group in optimizer.param_groups for p in group["params"]]
        if saved is None:
            # A checkpoint without masters (another opt level): the masters
            # start again from the model, which should be loaded first.
            for p in flat:
                model_p = self._model_of.get(id(p))
                if model_p is not None:
                    p.copy_(model_p)
            return state_dict
        for i, value in saved.items():
            if not (0 <= int(i) < len(flat)) or id(flat[int(i)]) not in self._model_of:
                raise ValueError(
                    f"the checkpoint has an fp32 master for parameter {i}, which is not a half "
                    "parameter of this optimizer; was it saved with the same model and opt level?"
                )
            master = flat[int(i)]
            if master.shape != value.shape:
                raise ValueError(
                    f"master weight {i}: checkpoint shape {tuple(value.shape)} differs from "
                    f"{tuple(master.shape)}"
                )
            master.copy_(value)
        return state_dict


def _state_to(value: Any, dtype: torch.dtype, device: torch.device, key: str) -> Any:
    # Optimizer.load_state_dict's rule: floating state follows the param, step counters do not.
    if isinstance(value, Tensor) and key != "step" and value.is_floating_point():
        return value.to(dtype=dtype, device=device)
    return value


def _drop_self(bound_or_function: Callable) -> Callable:
    def adapter(self, *args, **kwargs):
        return bound_or_function(*args, **kwargs)

    adapter.__dict__.update(getattr(bound_or_function, "__dict__", {}))
    adapter.__name__ = getattr(bound_or_function, "__name__", "adapter")
    adapter.__qualname__ = getattr(bound_or_function, "__qualname__", adapter.__name__)
    adapter.__doc__ = getattr(bound_or_function, "__doc__", None)
    return adapter


_POSITIONS = {"closure": 0, "set_to_none": 0, "param_group": 0}


def _call_arg(instance, args: tuple, kwargs: dict, name: str, default: Any = None) -> Any:
    """An argument of ``step``/``zero_grad``, however the wrapper was reached.

    Called through the instance's MethodType, ``args`` starts with the
    optimizer (``instance`` is None); bound again by a scheduler, it does not.
    """
    if name in kwargs:
        return kwargs[name]
    positional = args if instance is not None else args[1:]
    pos = _POSITIONS[name]
    return positional[pos] if len(positional) > pos else default


def process(optimizer: torch.optim.Optimizer, session: AmpSession) -> OptimizerRecord:
    """Make ``optimizer`` an amp optimizer for ``session``.

    Creates the fp32 masters when ``props.master_weights`` is set and wraps
    ``step``, ``zero_grad`` and ``add_param_group``. Registers the undo
    (:meth:`OptimizerRecord.restore`) with ``session.on_close``.

    Args:
        optimizer (torch.optim.Optimizer): built over the (already cast) model's params.
        session (AmpSession): the session being built.

    Returns:
        OptimizerRecord: the record, to be stored in ``session.optimizer_records``.

    Example::

        >>> record = process(optimizer, session)
        >>> all(p.dtype == torch.float32 for p in record.stepped_params())
        True
    """
    record = OptimizerRecord(optimizer, session)
    session.on_close(f"{type(optimizer).__name__} methods and masters", record.restore)
    record.install()
    return record


def master_params(optimizer: torch.optim.Optimizer) -> Iterator[Tensor]:
    """Iterate over the tensors ``optimizer`` steps: the fp32 masters under O2, else its params.

    Clip gradients on these after :func:`amp_patch.scale_loss` exits: they
    hold the unscaled gradients.

    Args:
        optimizer (torch.optim.Optimizer): an optimizer passed to :func:`amp_patch.initialize`
            (any optimizer works; without amp it yields its params).

    Yields:
        Tensor: each param of each param group, in order.

    Example::

        >>> with amp.scale_loss(loss, optimizer) as scaled_loss:
        ...     scaled_loss.backward()
        >>> torch.nn.utils.clip_grad_norm_(amp.master_params(optimizer), max_norm=1.0)
        >>> optimizer.step()
    """
    for group in optimizer.param_groups:
        yield from group["params"]
