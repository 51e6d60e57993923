"""Apex's manual mixed-precision classes: ``FP16_Optimizer``, ``LossScaler``, ``DynamicLossScaler``.

Before ``amp``, Apex trained half models by hand: the script called
``model.half()``, wrapped its optimizer in :class:`FP16_Optimizer` (fp32
master weights, loss scaling, skipped steps) and called
``optimizer.backward(loss)`` instead of ``loss.backward()``. BERT fine-tuning
scripts and many trainers of 2018-2020 do exactly that. The classes here keep
Apex's signatures and behaviour, built on amp_patch's parts:
:class:`amp_patch.scaler.AmpScaler` for the scale and the overflow flag (one
host sync per step) and the fused ops of :mod:`amp_patch.ops` for unscaling
into the masters, the gradient norm and the copy back into the model.

"Half" means float16 or bfloat16 parameters, on any device.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Iterable

import torch
from torch import Tensor

from amp_patch import scaler as _scaler
from amp_patch.apex_compat.amp_state import LossScalerView
from amp_patch.frontend.clip import clip_grad_norm_
from amp_patch.optim.amp.master_weights import MasterWeights, clear_grads
from amp_patch.settings.dtypes import HALF_DTYPES

__all__ = ["FP16_Optimizer", "LossScaler", "DynamicLossScaler"]

logger = logging.getLogger("amp_patch")

#: ``dynamic_loss_args`` keys and defaults: those of Apex's ``apex.amp.scaler.LossScaler``.
_DYNAMIC_DEFAULTS = {"init_scale": 2.0**16, "scale_factor": 2.0, "scale_window": 2000,
                     "min_loss_scale": None, "max_loss_scale": 2.0**24}


def _any_nonfinite(tensors: Iterable[Tensor]) -> bool:
    """Whether any tensor holds an inf or NaN, with one host sync for all of them."""
    flags: dict[torch.device, Tensor] = {}
    for t in tensors:
        flag = flags.get(t.device)
        if flag is None:
            flag = flags[t.device] = torch.zeros((), dtype=torch.bool, device=t.device)
        flag |= ~torch.isfinite(t).all()
    return any(bool(f) for f in flags.values())  # a host sync per device, usually one


class _ManualScaler:
    """What Apex's two manual scalers share: the scale, and scaling a loss or a gradient."""

    cur_scale: float

    @property
    def loss_scale(self) -> float:
        """The current scale."""
        return self.cur_scale

    def scale_gradient(self, module, grad_in, grad_out):
        """A backward hook that multiplies the incoming gradients by the scale."""
        return tuple(self.loss_scale * g for g in grad_in)

    def backward(self, loss: Tensor, retain_graph: bool = False) -> None:
        """Backpropagate ``loss * loss_scale``."""
        (loss * self.loss_scale).backward(retain_graph=retain_graph)


class LossScaler(_ManualScaler):
    """Apex's static loss scaler for hand-written fp16 loops (``apex.fp16_utils``).

    It never reports an overflow and never changes the scale.

    Args:
        scale (float, optional): the loss scale. Default: 1.

    Example::

        >>> scaler = LossScaler(128.0)
        >>> scaler.backward(loss)          # grads are 128 times the true ones
    """

    def __init__(self, scale: float = 1) -> None:
        self.cur_scale = scale

    def has_overflow(self, params: Iterable[Tensor]) -> bool:
        """Always False: a static scaler does not look."""
        return False

    @staticmethod
    def _has_inf_or_nan(x: Tensor) -> bool:
        return False

    def update_scale(self, overflow: bool) -> None:
        """Nothing to update for a static scale."""


class DynamicLossScaler(_ManualScaler):
    """Apex's dynamic loss scaler for hand-written fp16 loops (``apex.fp16_utils``).

    Apex's rule: on an overflow the scale is divided by ``scale_factor`` (not
    below 1); after ``scale_window`` iterations without one it is multiplied
    by ``scale_factor``, with no ceiling.

    Args:
        init_scale (float, optional): the first scale. Default: 2**32.
        scale_factor (float, optional): Default: 2.
        scale_window (int, optional): clean iterations before the scale grows. Default: 1000.

    Example::

        >>> scaler = DynamicLossScaler()
        >>> scaler.backward(loss)
        >>> overflow = scaler.has_overflow(model.parameters())
        >>> if not overflow:
        ...     optimizer.step()      # after dividing the grads by scaler.loss_scale
        >>> scaler.update_scale(overflow)
    """

    def __init__(self, init_scale: float = 2**32, scale_factor: float = 2.0,
                 scale_window: int = 1000) -> None:
        self.cur_scale = init_scale
        self.cur_iter = 0
        self.last_overflow_iter = -1
        self.scale_factor = scale_factor
        self.scale_window = scale_window

    def has_overflow(self, params: Iterable[Tensor]) -> bool:
        """Whether any param's grad holds an inf or NaN (one host sync for all of them)."""
        return _any_nonfinite(p.grad for p in params if p.grad is not None)

    @staticmethod
    def _has_inf_or_nan(x: Tensor) -> bool:
        return _any_nonfinite([x])

    def update_scale(self, overflow: bool) -> None:
        """Apply Apex's rule for one iteration that did (or did not) overflow."""
        if overflow:
            self.cur_scale = max(self.cur_scale / self.scale_factor, 1)
            self.last_overflow_iter = self.cur_iter
        elif (self.cur_iter - self.last_overflow_iter) % self.scale_window == 0:
            self.cur_scale *= self.scale_factor
        self.cur_iter += 1


class FP16_Optimizer:  # noqa: N801 - Apex's name
    """Apex's ``FP16_Optimizer``: fp32 master weights and loss scaling around any optimizer.

    Every half (fp16 or bf16) parameter of ``init_optimizer`` that requires a
    gradient is replaced, in its param group, by an fp32 master copy, so the
    wrapped optimizer steps (and keeps its state in) fp32. fp32 parameters
    stay as they are. The training loop becomes::

        optimizer.zero_grad()
        loss = criterion(model(x), y)
        optimizer.backward(loss)            # instead of loss.backward()
        optimizer.clip_master_grads(1.0)    # optional
        optimizer.step()                    # skipped after an overflow

    :meth:`backward` scales the loss, backpropagates, and unscales the half
    gradients into the masters' fp32 gradients with one fused kernel call
    per device, checking them for inf/NaN on the device; the scaler then reads
    that flag (the one host sync of a step) and updates the scale.
    :meth:`step` steps the optimizer and copies the masters back into the
    model, or does nothing at all after an overflow.

    Dynamic scaling follows Apex's ``amp`` scaler (which Apex's last
    ``FP16_Optimizer`` used): start at ``min(init_scale, max_loss_scale)``,
    halve on overflow, double after ``scale_window`` clean steps, up to
    ``max_loss_scale``. A static scale never changes; unlike Apex, a step
    whose gradients overflow at a static scale is skipped too, rather than
    writing inf/NaN into the weights.

    Args:
        init_optimizer (torch.optim.Optimizer): the optimizer to wrap, built
            over the half model's parameters (any optimizer with ``param_groups``,
            ``step``, ``state_dict`` and ``load_state_dict``).
        static_loss_scale (float, optional): the scale when not dynamic. Default: 1.0.
        dynamic_loss_scale (bool, optional): use dynamic loss scaling. Default: False.
        dynamic_loss_args (dict, optional): ``init_scale`` (default 2**16),
            ``scale_window`` (2000), ``min_loss_scale`` (None),
            ``max_loss_scale`` (2**24) and ``scale_factor`` (only 2 is
            used, as in Apex). Default: None.
        verbose (bool, optional): log the params found, at debug level. Default: True.

    Attributes:
        optimizer: the wrapped optimizer.
        loss_scaler: a view of the scaler with Apex's attributes
            (``loss_scale()``, a settable ``_loss_scale``, ``_unskipped``, ...).
        overflow (bool): the last :meth:`backward` (or :meth:`update_master_grads`)
            found an inf/NaN; the next :meth:`step` is skipped.
        fp16_groups, fp32_from_fp16_groups, fp32_from_fp32_groups (list of lists):
            per param group, the half params, their masters, and the fp32 params.

    Raises:
        TypeError: ``init_optimizer`` is not an optimizer, or has a parameter
            that is neither half nor fp32.

    Example::

        >>> model = model.half()
        >>> optimizer = FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.1),
        ...                            dynamic_loss_scale=True)
        >>> optimizer.backward(loss)
        >>> optimizer.step()
    """

    def __init__(self, init_optimizer, static_loss_scale: float = 1.0,
                 dynamic_loss_scale: bool = False, dynamic_loss_args: dict | None = None,
                 verbose: bool = True) -> None:
        missing = [m for m in ("param_groups", "step", "state_dict", "load_state_dict")
                   if not hasattr(init_optimizer, m)]
        if missing:
            raise TypeError(f"FP16_Optimizer wraps an optimizer (param_groups, step, state_dict, "
                            f"load_state_dict); {type(init_optimizer).__name__} lacks "
                            f"{', '.join(missing)}")
        self.verbose = verbose
        self.optimizer = init_optimizer
        # The masters are made, and a resumed optimizer's half state moved to them in fp32, as
        # amp's O2 does; only params that require a grad get one, as in Apex.
        self._masters = MasterWeights()
        self.fp16_groups: list[list[Tensor]] = []
        self.fp32_from_fp16_groups: list[list[Tensor]] = []
        self.fp32_from_fp32_groups: list[list[Tensor]] = []
        for gi, group in enumerate(self.optimizer.param_groups):
            trainable = [p for p in group["params"] if p.requires_grad]
            for param in trainable:
                if param.dtype not in HALF_DTYPES and param.dtype != torch.float32:
                    raise TypeError(f"FP16_Optimizer: param group {gi} holds a {param.dtype} "
                                    f"parameter of shape {tuple(param.shape)}; expected "
                                    "float16, bfloat16 or float32")
            half = [p for p in trainable if p.dtype in HALF_DTYPES]
            self._masters.attach({"params": list(half)}, self.optimizer.state)
            masters = [self._masters.master_for(p) for p in half]
            params = group["params"]
            for i, param in enumerate(params):
                master = self._masters.master_for(param)
                if master is not None:
                    params[i] = master
            fp32 = [p for p in trainable if p.dtype == torch.float32]
            if verbose:
                logger.debug("FP16_Optimizer param group %d: %d half params (fp32 masters made), "
                             "%d fp32 params", gi, len(half), len(fp32))
            self.fp16_groups.append(half)
            self.fp32_from_fp16_groups.append(masters)
            self.fp32_from_fp32_groups.append(fp32)
        self.all_fp16_params = [p for g in self.fp16_groups for p in g]
        self.all_fp32_from_fp16_params = [p for g in self.fp32_from_fp16_groups for p in g]
        self.all_fp32_from_fp32_params = [p for g in self.fp32_from_fp32_groups for p in g]

        self.dynamic_loss_scale = bool(dynamic_loss_scale)
        self._scaler = self._make_scaler(static_loss_scale, dynamic_loss_args)
        self.loss_scaler = LossScalerView(self._scaler)
        self.overflow = False
        self.first_closure_call_this_step = True

    def _make_scaler(self, static_loss_scale: float,
                     dynamic_loss_args: dict | None) -> _scaler.AmpScaler:
        if not self.dynamic_loss_scale:
            return _scaler.AmpScaler(float(static_loss_scale))
        args = dict(_DYNAMIC_DEFAULTS)
        unknown = sorted(set(dynamic_loss_args or {}) - set(args))
        if unknown:
            raise TypeError(f"FP16_Optimizer: unknown dynamic_loss_args {unknown}; expected some "
                            f"of {sorted(args)}")
        args.update(dynamic_loss_args or {})
        if args["scale_factor"] != 2.0:
            logger.warning("FP16_Optimizer: dynamic_loss_args scale_factor=%s is ignored, as in "
                           "Apex: the scale halves on overflow and doubles after scale_window "
                           "clean steps", args["scale_factor"])
        scaler = _scaler.AmpScaler("dynamic", min_loss_scale=args["min_loss_scale"],
                                    max_loss_scale=args["max_loss_scale"],
                                    scale_window=args["scale_window"])
        scaler.loss_scale = min(args["max_loss_scale"], args["init_scale"])
        return scaler

    def __getstate__(self):
        raise RuntimeError("FP16_Optimizer should be serialized using state_dict().")

    def __setstate__(self, state):
        raise RuntimeError("FP16_Optimizer should be deserialized using load_state_dict().")

    def __repr__(self) -> str:
        kind = "dynamic" if self.dynamic_loss_scale else "static"
        return (f"FP16_Optimizer({type(self.optimizer).__name__}, {kind} loss scale "
                f"{self.loss_scale}, {len(self.all_fp16_params)} half params)")

    # ------------------------------------------------------------------ the loop

    def zero_grad(self, set_grads_to_None: bool = False) -> None:  # noqa: N803 - Apex's name
        """Clear the grads of the stepped tensors (masters, fp32 params) and of the half params.

        Args:
            set_grads_to_None (bool, optional): set them to None rather than
                zeroing them. Default: False.
        """
        stepped = [p for group in self.optimizer.param_groups for p in group["params"]]
        clear_grads(stepped + self.all_fp16_params, set_grads_to_None)

    def backward(self, loss: Tensor, update_master_grads: bool = True,
                 retain_graph: bool = False) -> None:
        """Backpropagate ``loss.float() * loss_scale``, then (by default) update the master grads.

        Args:
            loss (Tensor): the loss, half or float.
            update_master_grads (bool, optional): unscale into the masters now.
                Pass False for all but the last of several backward passes
                in one iteration, then call :meth:`update_master_grads`. Default: True.
            retain_graph (bool, optional): passed to ``backward``. Default: False.
        """
        (loss.float() * self._scaler.loss_scale).backward(retain_graph=retain_graph)
        if update_master_grads:
            self.update_master_grads()

    def update_master_grads(self) -> None:
        """Unscale the model's grads into the masters' fp32 grads, check them, update the scale.

        Half grads are written, unscaled, into the masters' grads (one fused
        ``multi_tensor_unscale_copy_`` per device); fp32 params' grads are
        unscaled in place. Any inf/NaN sets :attr:`overflow`, which makes the
        next :meth:`step` a no-op; a dynamic scale then halves. This is the
        one host sync of an iteration. A master whose model param got no
        grad keeps the grad it had.
        """
        model_grads, master_grads = [], []
        for model_p, master in zip(self.all_fp16_params, self.all_fp32_from_fp16_params):
            if model_p.grad is not None:
                if master.grad is None:
                    master.grad = torch.empty_like(master)
                model_grads.append(model_p.grad)
                master_grads.append(master.grad)
        fp32_grads = [p.grad for p in self.all_fp32_from_fp32_params if p.grad is not None]
        self._scaler.unscale(in_place=fp32_grads, copy=(model_grads, master_grads))
        self.overflow = self._scaler.update()

    def clip_master_grads(self, max_norm: float, norm_type: float = 2):
        """Clip the fp32 grads the optimizer steps by their total norm, as ``clip_grad_norm_`` does.

        It is :func:`amp_patch.clip_grad_norm_` over the stepped tensors: for
        the 2-norm one fused ``multi_tensor_l2norm`` per device and dtype, and
        the grads are scaled on the device, with no host sync.

        Args:
            max_norm (float): the largest total norm allowed.
            norm_type (float, optional): the p of the p-norm; ``"inf"`` for the
                max norm. Default: 2.

        Returns:
            Tensor or int: the total norm before clipping (a 0-dim tensor), or
            -1 if the last backward overflowed (nothing is clipped then).
        """
        if self.overflow:
            return -1
        stepped = [p for group in self.optimizer.param_groups for p in group["params"]]
        return clip_grad_norm_(stepped, max_norm, norm_type)

    def step(self, closure: Callable[[], Any] | None = None):
        """Step the optimizer and copy the masters into the model, unless the grads overflowed.

        Args:
            closure (callable, optional): re-evaluates the model and calls
                :meth:`backward` (not ``loss.backward()``); it is called again
                while the gradients overflow. Default: None.

        Returns:
            What the wrapped optimizer's ``step`` returned, or None when skipped.
        """
        if self.overflow:
            logger.debug("FP16_Optimizer: step skipped after a gradient overflow "
                         "(loss scale now %s)", self.loss_scale)
            return None
        if closure is not None:
            out = self._step_with_closure(closure)
        else:
            out = self.optimizer.step()
        self._master_params_to_model_params()
        return out

    def _step_with_closure(self, closure: Callable[[], Any]):
        def wrapped_closure():
            if self.first_closure_call_this_step:
                # The model holds the masters' values on the first call of a step.
                self.first_closure_call_this_step = False
            else:
                # The optimizer may have changed the masters between calls (LBFGS does).
                self._master_params_to_model_params()
            loss = closure()
            while self.overflow:
                logger.info("FP16_Optimizer: gradient overflow inside the closure; trying again "
                            "at loss scale %s", self.loss_scale)
                loss = closure()
            return loss

        out = self.optimizer.step(wrapped_closure)
        self.first_closure_call_this_step = True
        return out

    def _master_params_to_model_params(self) -> None:
        self._masters.copy_to_model(self.all_fp32_from_fp16_params)

    def inspect_master_grad_data(self) -> list[list[Tensor | None]] | None:
        """The stepped tensors' grads, per param group (None after an overflow)."""
        if self.overflow:
            logger.warning("FP16_Optimizer.inspect_master_grad_data: the last backward overflowed; "
                           "the gradients are not valid")
            return None
        return [[p.grad if p.grad is not None else None for p in group["params"]]
                for group in self.optimizer.param_groups]

    # ------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict[str, Any]:
        """The wrapper's state, the wrapped optimizer's, and the fp32 masters; plain data.

        The result loads with ``torch.load(weights_only=True)``.

        Returns:
            dict: ``loss_scaler`` (the scaler's state dict), ``dynamic_loss_scale``,
            ``overflow``, ``first_closure_call_this_step``, ``optimizer_state_dict``
            and ``fp32_from_fp16`` (the masters, per param group).
        """
        return {
            "loss_scaler": self._scaler.state_dict(),
            "dynamic_loss_scale": self.dynamic_loss_scale,
            "overflow": self.overflow,
            "first_closure_call_this_step": self.first_closure_call_this_step,
            "optimizer_state_dict": self.optimizer.state_dict(),
            "fp32_from_fp16": self.fp32_from_fp16_groups,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` saved; the masters get the saved fp32 values exactly.

        Load the model's state first (``model.load_state_dict``), as with Apex.

        Args:
            state_dict (dict): from :meth:`state_dict` of an FP16_Optimizer
                built the same way (same params, same kind of scaling).

        Raises:
            TypeError: ``state_dict`` is not such a dict.
            ValueError: it was saved with the other kind of scaling, or for
                other parameters.
        """
        keys = ("loss_scaler", "dynamic_loss_scale", "overflow", "optimizer_state_dict",
                "fp32_from_fp16")
        if not isinstance(state_dict, dict) or any(k not in state_dict for k in keys):
            raise TypeError(f"FP16_Optimizer.load_state_dict expects the dict from "
                            f"FP16_Optimizer.state_dict() (keys {', '.join(keys)}), got "
                            f"{type(state_dict).__name__}"
                            + (f" with keys {sorted(state_dict)}"
                               if isinstance(state_dict, dict) else ""))
        if not isinstance(state_dict["loss_scaler"], dict):
            raise TypeError("FP16_Optimizer.load_state_dict: 'loss_scaler' must be the scaler's "
                            f"state dict, got {type(state_dict['loss_scaler']).__name__} (a "
                            "checkpoint pickled by Apex itself cannot be read)")
        if bool(state_dict["dynamic_loss_scale"]) != self.dynamic_loss_scale:
            raise ValueError(f"FP16_Optimizer.load_state_dict: the checkpoint was saved with "
                             f"dynamic_loss_scale={bool(state_dict['dynamic_loss_scale'])}; this "
                             f"FP16_Optimizer was built with {self.dynamic_loss_scale}")
        saved = state_dict["fp32_from_fp16"]
        self._check_saved_masters(saved)
        scale_state = state_dict["loss_scaler"]
        self._scaler.check_state_dict(scale_state)
        # Everything else is checked: the wrapped optimizer's load is the one step left that can
        # fail, and torch's checks its input before it changes anything.
        self.optimizer.load_state_dict(state_dict["optimizer_state_dict"])
        self._scaler.load_state_dict(scale_state)
        self.overflow = bool(state_dict["overflow"])
        self.first_closure_call_this_step = bool(
            state_dict.get("first_closure_call_this_step", True))
        with torch.no_grad():
            for current_group, saved_group in zip(self.fp32_from_fp16_groups, saved):
                for current, value in zip(current_group, saved_group):
                    current.copy_(value)

    def _check_saved_masters(self, saved: Any) -> None:
        """Raise ValueError, naming what was expected, unless ``saved`` matches the masters."""
        counts = [len(g) for g in self.fp32_from_fp16_groups]
        if not isinstance(saved, (list, tuple)) or [
                len(g) if isinstance(g, (list, tuple)) else None for g in saved] != counts:
            raise ValueError("FP16_Optimizer.load_state_dict: the saved masters do not match this "
                             f"optimizer's half params: expected {len(counts)} groups of "
                             f"{counts} fp32 tensors (its param groups' half params)")
        for gi, (current_group, saved_group) in enumerate(zip(self.fp32_from_fp16_groups, saved)):
            for i, (current, value) in enumerate(zip(current_group, saved_group)):
                if not isinstance(value, Tensor) or value.shape != current.shape \
                        or value.dtype != current.dtype:
                    got = (f"a {value.dtype} tensor of shape {tuple(value.shape)}"
                           if isinstance(value, Tensor) else type(value).__name__)
                    raise ValueError(f"FP16_Optimizer.load_state_dict: saved fp32_from_fp16 group "
                                     f"{gi}, master {i}: {got}; expected {current.dtype} of "
                                     f"shape {tuple(current.shape)}")

    # ------------------------------------------------------------- properties

    @property
    def loss_scale(self) -> float:
        """The current loss scale; setting it changes the scale of the next backward."""
        return self._scaler.loss_scale

    @loss_scale.setter
    def loss_scale(self, value: float) -> None:
        self._scaler.loss_scale = value

    @property
    def state(self):
        """The wrapped optimizer's ``state``."""
        return self.optimizer.state

    @state.setter
    def state(self, value) -> None:
        self.optimizer.state = value

    @property
    def param_groups(self) -> list[dict]:
        """The wrapped optimizer's ``param_groups`` (set ``lr`` here); they hold the masters."""
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict]) -> None:
        self.optimizer.param_groups = value
