"""The 2019 ``apex.optimizers``: ``FP16_Optimizer`` and the ``FusedAdam`` it wrapped.

Until October 2019 (Apex 1904e48d moved them to ``apex.contrib``), BERT
fine-tuning scripts did::

    from apex.optimizers import FP16_Optimizer, FusedAdam

    model.half()
    optimizer = FusedAdam(grouped_parameters, lr=lr, bias_correction=False, max_grad_norm=1.0)
    optimizer = FP16_Optimizer(optimizer, dynamic_loss_scale=True)
    ...
    optimizer.backward(loss)
    optimizer.step()

That ``FusedAdam`` had another constructor (``eps_inside_sqrt``,
``max_grad_norm``), other math (the bias corrections folded into the step
size) and another ``step(closure, grads, output_params, scale, grad_norms)``
than the current one, under the same name. Its keywords tell the two apart:
the served ``apex.optimizers.FusedAdam`` (:class:`FusedAdam`) is amp_patch's,
unless it is called with ``max_grad_norm`` or ``eps_inside_sqrt``, which only
the 2019 one had; then it is :class:`FusedAdam2019`. ``FP16_Optimizer``
existed in ``apex.optimizers`` only in 2019, so that name is unambiguous.

Both are built on amp_patch's parts: :class:`FusedAdam2019` is amp_patch's
:class:`~amp_patch.optim.fused.FusedAdam` (the same fused Adam op, with Apex
2019's hyper-parameters mapped onto it), and :class:`FP16_Optimizer` is
:class:`amp_patch.apex_compat.fp16_optimizer.FP16_Optimizer` (masters, scaler,
checkpoints) stepping as the 2019 one did: no fp32 master grads, the fused op
reads the half grads times the inverse scale and writes the half params.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
from typing import Any, Callable, Sequence

import torch
from torch import Tensor

from amp_patch import scaler as _scaler
from amp_patch.apex_compat import fp16_optimizer
from amp_patch.optim import fused as optimizers
from amp_patch.optim.fused import FusedStepInputs
from amp_patch.optim.fused.steps import as_float, next_step

__all__ = ["FusedAdam", "FusedAdam2019", "FP16_Optimizer"]

#: Constructor keywords that only the 2019 FusedAdam had.
KEYWORDS_2019 = frozenset({"max_grad_norm", "eps_inside_sqrt"})
#: Added to the unscaled grad norm before it is compared with ``max_grad_norm``, as in Apex 2019.
_CLIP_EPS = 1e-6


class FusedAdam(optimizers.FusedAdam):
    """``apex.optimizers.FusedAdam`` under ``amp-patch run``: amp_patch's, or the 2019 one.

    Called with a keyword only the 2019 FusedAdam had (``max_grad_norm``,
    ``eps_inside_sqrt``), it makes a :class:`FusedAdam2019`; otherwise it is
    :class:`amp_patch.optim.fused.FusedAdam`, with the same arguments.

    Example::

        >>> from apex.optimizers import FusedAdam       # under amp-patch run
        >>> type(FusedAdam(params, lr=1e-3)).__name__
        'FusedAdam'
        >>> type(FusedAdam(params, lr=1e-3, bias_correction=False, max_grad_norm=1.0)).__name__
        'FusedAdam2019'
    """

    # inspect would report __new__'s (*args, **kwargs) instead of the constructor's.
    __signature__ = inspect.signature(optimizers.FusedAdam)

    def __new__(cls, *args: Any, **kwargs: Any) -> "FusedAdam":
        if cls is FusedAdam and KEYWORDS_2019 & kwargs.keys():
            cls = FusedAdam2019
        return super().__new__(cls)


class FusedAdam2019(FusedAdam):
    r"""Apex's FusedAdam of 2019 (later ``apex.contrib.optimizers.FusedAdam``), on amp_patch's op.

    Per element, in fp32, with ``s`` the combined scale (below), ``t`` the
    group's step and :math:`\eta_t = \eta \sqrt{1-\beta_2^t} / (1-\beta_1^t)`
    (:math:`\eta` without ``bias_correction``):

    .. math::
        g &= \nabla / s, \qquad m = \beta_1 m + (1-\beta_1) g, \qquad
        v = \beta_2 v + (1-\beta_2) g^2 \\
        p &= p - \eta_t \left(\frac{m}{\sqrt{v} + \epsilon} + \lambda p\right)

    This is :class:`amp_patch.optim.fused.FusedAdam`'s AdamW update with
    :math:`\epsilon / \sqrt{1-\beta_2^t}` and
    :math:`\lambda \sqrt{1-\beta_2^t} / (1-\beta_1^t)` for :math:`\epsilon` and
    :math:`\lambda`: one call of the same fused op, equal to Apex's within
    fp32 rounding; with ``bias_correction=False`` (BERT's) the two are the same.

    The scale ``s`` is the loss scale ``step()`` is given, times the clipping
    factor ``(||g|| / scale + 1e-6) / max_grad_norm`` of the group when that
    exceeds 1 (``max_grad_norm > 0``), where ``||g||`` is the norm of the
    group's grads as given (``grad_norms``; computed on the device when not
    given, where Apex failed).

    Args:
        params (iterable): parameters or parameter groups (which may set their
            own ``max_grad_norm``).
        lr (float, optional): Default: 1e-3.
        bias_correction (bool, optional): Default: True.
        betas (tuple of float, optional): Default: (0.9, 0.999).
        eps (float, optional): Default: 1e-8.
        eps_inside_sqrt (bool, optional): only False, the default, is
            supported (amp_patch's op adds eps outside the square root).
        weight_decay (float, optional): Default: 0.
        max_grad_norm (float, optional): per-group grad-norm clipping; 0 turns
            it off. Default: 0.
        amsgrad (bool, optional): not supported, as in Apex. Default: False.

    Raises:
        ValueError: ``eps_inside_sqrt=True``.
        RuntimeError: ``amsgrad=True``.

    Example::

        >>> opt = FusedAdam2019(model.parameters(), lr=5e-5, bias_correction=False,
        ...                     max_grad_norm=1.0)
        >>> opt.step(grads=[[p.grad for p in half_params]], output_params=[half_params],
        ...          scale=1024.0)
    """

    __signature__ = None  # the constructor's own, below

    #: Its step size folds the host step's bias corrections in (eps, decay): it reads the flag.
    READS_FOUND_INF = True

    def __init__(self, params: Any, lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 eps_inside_sqrt: bool = False, weight_decay: float = 0.0,
                 max_grad_norm: float = 0.0, amsgrad: bool = False) -> None:
        if eps_inside_sqrt:
            raise ValueError("FusedAdam(eps_inside_sqrt=True) is not supported: amp_patch's fused "
                             "Adam adds eps outside the square root (eps_inside_sqrt=False, Apex's "
                             "default)")
        super().__init__(params, lr=lr, bias_correction=bias_correction, betas=betas, eps=eps,
                         adam_w_mode=True, weight_decay=weight_decay, amsgrad=amsgrad)
        self.defaults["max_grad_norm"] = max_grad_norm
        for group in self.param_groups:
            group.setdefault("max_grad_norm", max_grad_norm)
        # The per-group grad norms a step(grad_norms=...) call was given.
        self._given_norms: list[Any] | None = None

    def step(self, closure: Callable[[], Any] | None = None, grads: Any = None,
             output_params: Any = None, scale: float = 1.0, grad_norms: Any = None) -> Any:
        """One step, in Apex 2019's protocol.

        Args:
            closure (callable, optional): re-evaluates the model and returns the loss.
            grads (list, optional): per group, the grads to read instead of
                ``param.grad`` (half grads for fp32 params), one per param (None
                skips it); a flat list means one group.
            output_params (list, optional): per group, tensors that receive the
                updated params rounded to their dtype, in the same pass.
            scale (float, optional): the grads are divided by it. Default: 1.
            grad_norms (list, optional): per group, the L2 norm of its grads
                as given, for clipping.

        Returns:
            The closure's loss, or None.

        Example::

            >>> opt.step(grads=[[p.grad for p in half_params]], output_params=[half_params],
            ...          scale=1024.0, grad_norms=[norm_of_those_grads])
        """
        if grads is None and output_params is None and scale == 1.0 and grad_norms is None:
            return optimizers.FusedOptimizer.step(self, closure)
        groups = self.param_groups
        given_grads: dict[Tensor, Tensor] = {}
        given_outputs: dict[Tensor, Tensor] = {}
        for group, group_grads, group_outputs in zip(groups, _per_group(grads, len(groups)),
                                                     _per_group(output_params, len(groups))):
            for i, p in enumerate(group["params"]):
                if group_grads is not None and group_grads[i] is not None:
                    given_grads[p] = group_grads[i]
                if group_outputs is not None and group_outputs[i] is not None:
                    given_outputs[p] = group_outputs[i]
        device = groups[0]["params"][0].device
        inputs = dataclasses.replace(
            self._inputs or FusedStepInputs(), grads=given_grads or None,
            model_params=given_outputs or None,
            inv_scale=torch.full((1,), 1.0 / scale, dtype=torch.float32, device=device))
        self._given_norms = list(grad_norms) if grad_norms is not None else None
        try:
            with self.fused_step_inputs(inputs):
                return optimizers.FusedOptimizer.step(self, closure)
        finally:
            self._given_norms = None

    def _fused_step(self) -> None:
        for index, group in enumerate(self.param_groups):
            if not group["params"]:
                continue
            step = next_step(group)
            eps, weight_decay = group["eps"], group["weight_decay"]
            if group["bias_correction"]:
                # Apex folded the corrections into the step size and left eps and the decay
                # uncorrected: the op's corrected update with these is the same update.
                beta1, beta2 = group["betas"]
                bc1, bc2 = 1.0 - beta1**step, 1.0 - beta2**step
                eps, weight_decay = eps / math.sqrt(bc2), weight_decay * math.sqrt(bc2) / bc1
            self._adam_group(group, step, lr=as_float(group["lr"]), eps=eps,
                             weight_decay=weight_decay,
                             bias_correction=bool(group["bias_correction"]),
                             inv_scale=self._clipped_inv_scale(index, group))

    def _clipped_inv_scale(self, index: int, group: dict[str, Any]) -> Tensor | None:
        """The group's inverse scale with its clipping factor folded in, on the device; None when
        it does not clip (the step inputs' own inverse scale applies)."""
        max_norm = group.get("max_grad_norm") or 0.0
        if max_norm <= 0.0:
            return None
        device = group["params"][0].device
        norm = self._given_norms[index] if self._given_norms is not None else None
        if norm is None:
            norms = self._grad_norms([group])
            if not norms:
                return None
            norm = next(iter(norms.values()))
        norm = torch.as_tensor(norm, dtype=torch.float32, device=device).reshape(())
        inputs = self._inputs
        inv = (inputs.inv_scale.to(device).reshape(()) if inputs is not None
               and inputs.inv_scale is not None else torch.ones((), device=device))
        clip = (norm * inv + _CLIP_EPS) / max_norm
        return torch.where(clip > 1.0, inv / clip, inv).reshape(1)


def _per_group(values: Any, groups: int) -> Sequence[Any]:
    """Apex's reading of ``grads`` and ``output_params``: None, a flat list (one group), or per
    group."""
    if values is None:
        return [None] * groups
    values = list(values)
    if values and not isinstance(values[0], (list, tuple)):
        return [values]
    return values


class FP16_Optimizer(fp16_optimizer.FP16_Optimizer):  # noqa: N801 - Apex's name
    """Apex's 2019 ``apex.optimizers.FP16_Optimizer``: fp32 masters around a fused optimizer.

    Apex's cut-down ``FP16_Optimizer`` that wrapped the 2019 ``FusedAdam``:
    :meth:`backward` scales the loss and backpropagates, nothing more; no fp32
    master grad is ever made. :meth:`step` checks the half grads for inf/NaN
    (one fused L2 norm per device, only reading them), decides the skip with
    the scaler's one host sync, and runs the wrapped optimizer's fused step:
    it reads each half grad times the inverse scale, updates the fp32 master
    and its state, and writes the half param, in one pass. Clipping is the
    optimizer's (``FusedAdam(max_grad_norm=...)``).

    It is :class:`amp_patch.apex_compat.fp16_optimizer.FP16_Optimizer` (the
    ``apex.fp16_utils`` one) for everything else: masters, ``state_dict`` /
    ``load_state_dict`` (plain data, exact resume), ``param_groups``,
    ``state``, ``loss_scale``. Dynamic scaling follows Apex 2019: start at
    2**16, halve on overflow (not below 1), double after 1000 clean steps,
    no ceiling.

    Args:
        init_optimizer (torch.optim.Optimizer): a fused optimizer (one that
            takes step inputs: ``apex.optimizers.FusedAdam``, 2019 or current,
            or any of amp_patch's), built over the half model's params.
        static_loss_scale (float, optional): Default: 1.0.
        dynamic_loss_scale (bool, optional): Default: False.
        dynamic_loss_args (dict, optional): not supported, as in Apex. Default: None.
        verbose (bool, optional): Default: True.

    Raises:
        TypeError: the optimizer is not a fused one.
        ValueError: ``dynamic_loss_args`` is given.

    Example::

        >>> model = model.half()
        >>> optimizer = FusedAdam(groups, lr=5e-5, bias_correction=False, max_grad_norm=1.0)
        >>> optimizer = FP16_Optimizer(optimizer, dynamic_loss_scale=True)
        >>> optimizer.backward(loss)
        >>> optimizer.step()
    """

    def __init__(self, init_optimizer, static_loss_scale: float = 1.0,
                 dynamic_loss_scale: bool = False, dynamic_loss_args: dict | None = None,
                 verbose: bool = True) -> None:
        if not callable(getattr(init_optimizer, "fused_step_inputs", None)):
            raise TypeError(
                f"apex.optimizers.FP16_Optimizer wraps a fused optimizer (apex.optimizers."
                f"FusedAdam), got {type(init_optimizer).__name__}; for any other optimizer use "
                "apex.fp16_utils.FP16_Optimizer")
        if dynamic_loss_args is not None:
            raise ValueError("apex.optimizers.FP16_Optimizer does not take dynamic_loss_args (nor "
                             "did Apex's); apex.fp16_utils.FP16_Optimizer does")
        super().__init__(init_optimizer, static_loss_scale, dynamic_loss_scale, None, verbose)
        # Where each master's update is written: fixed once the masters are made.
        self._model_params = dict(zip(self.all_fp32_from_fp16_params, self.all_fp16_params))

    def _make_scaler(self, static_loss_scale: float,
                     dynamic_loss_args: dict | None) -> _scaler.AmpScaler:
        if not self.dynamic_loss_scale:
            return super()._make_scaler(static_loss_scale, None)
        return _scaler.AmpScaler("dynamic", min_loss_scale=1.0, max_loss_scale=math.inf,
                                  scale_window=1000)

    @property
    def cur_scale(self) -> float:
        """The current loss scale (Apex 2019's attribute name).

        Example::

            >>> logger.info("loss scale %s", optimizer.cur_scale)
        """
        return self.loss_scale

    def zero_grad(self, set_grads_to_None: bool = True) -> None:  # noqa: N803 - Apex's name
        """Clear the half params' grads: to None by default, as Apex 2019 did.

        Args:
            set_grads_to_None (bool, optional): else zero them. Default: True.

        Example::

            >>> optimizer.zero_grad()
        """
        super().zero_grad(set_grads_to_None)

    def backward(self, loss: Tensor) -> None:
        """Backpropagate ``loss.float() * loss_scale`` into the half params' grads.

        Args:
            loss (Tensor): the loss.

        Example::

            >>> optimizer.backward(model(input_ids, labels))   # instead of loss.backward()
        """
        (loss.float() * self._scaler.loss_scale).backward()

    def step(self, closure: None = None) -> Any:
        """Check the grads, then run the fused step from the half grads, or skip it on overflow.

        Args:
            closure (None, optional): not supported, as in Apex.

        Returns:
            What the optimizer's ``step`` returned, or None when skipped.

        Raises:
            TypeError: a closure is given.

        Example::

            >>> optimizer.backward(loss)
            >>> optimizer.step()
            >>> optimizer.overflow        # True when it was skipped
            False
        """
        if closure is not None:
            raise TypeError("apex.optimizers.FP16_Optimizer.step() takes no closure (nor did "
                            "Apex's); apex.fp16_utils.FP16_Optimizer does")
        grads = {master: half.grad for master, half in zip(self.all_fp32_from_fp16_params,
                                                            self.all_fp16_params)
                 if half.grad is not None}
        grads.update((p, p.grad) for p in self.all_fp32_from_fp32_params if p.grad is not None)
        tensors = [self._scaler.snapshot(dev) for dev in self._scaler.check(list(grads.values()))]
        self.overflow = self._scaler.update()
        if self.overflow or not tensors:
            return None
        inputs = FusedStepInputs(
            grads=grads, inv_scale=tensors[0].inv_scale,
            model_params=self._model_params)
        with self.optimizer.fused_step_inputs(inputs):
            return self.optimizer.step()

    def update_master_grads(self) -> None:
        """Not in Apex 2019's FP16_Optimizer, which never makes master grads.

        Raises:
            NotImplementedError: always; use ``apex.fp16_utils.FP16_Optimizer`` for it.
        """
        raise NotImplementedError(_NO_MASTER_GRADS.format("update_master_grads"))

    def clip_master_grads(self, max_norm: float, norm_type: float = 2):
        """Not in Apex 2019's FP16_Optimizer: clip with ``FusedAdam(max_grad_norm=...)``.

        Raises:
            NotImplementedError: always.
        """
        raise NotImplementedError(_NO_MASTER_GRADS.format("clip_master_grads") + "; clip with "
                                  "FusedAdam(max_grad_norm=...)")

    def inspect_master_grad_data(self):
        """Not in Apex 2019's FP16_Optimizer, which never makes master grads.

        Raises:
            NotImplementedError: always.
        """
        raise NotImplementedError(_NO_MASTER_GRADS.format("inspect_master_grad_data"))


_NO_MASTER_GRADS = ("apex.optimizers.FP16_Optimizer (Apex 2019) has no {}: it never makes fp32 "
                    "master grads (apex.fp16_utils.FP16_Optimizer does)")
