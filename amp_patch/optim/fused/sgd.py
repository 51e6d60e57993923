"""FusedSGD: SGD with momentum in one multi-tensor pass per step (``apex.optimizers.FusedSGD``)."""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import Tensor
from torch.optim.optimizer import required

from amp_patch import ops
from amp_patch.optim.fused._base import FusedOptimizer
from amp_patch.optim.fused.batches import StateLists
from amp_patch.optim.fused.steps import next_step

__all__ = ["FusedSGD"]


class FusedSGD(FusedOptimizer):
    r"""SGD, optionally with momentum and Nesterov, as one fused op call per step.

    A drop-in for ``torch.optim.SGD`` with Apex's constructor. Per element, in fp32:

    .. math::
        g &= \nabla + \lambda p \quad \text{(after the momentum with wd\_after\_momentum)} \\
        b &= \mu b + (1 - \tau) g \quad (b = g \text{ at the first step}), \qquad
        g = b \;\text{or, Nesterov,}\; g + \mu b \\
        p &= p - \eta g

    As in torch and Apex (and unlike Sutskever et al.), the learning rate
    multiplies the velocity rather than the gradient inside it. The momentum
    buffers (``state[p]["momentum_buffer"]``) have the param's dtype; with
    ``momentum=0`` none is made. With a low-precision ``state_format`` they are
    stored in its first code (:mod:`amp_patch.optim.fused.state_format`).

    Args:
        params (iterable): parameters or parameter groups.
        lr (float): learning rate; may be given in every param group instead.
        momentum (float, optional): Default: 0.
        dampening (float, optional): Default: 0.
        weight_decay (float, optional): Default: 0.
        nesterov (bool, optional): Default: False.
        wd_after_momentum (bool, optional): add the weight decay after the
            momentum update rather than before. Default: False.
        materialize_master_grads (bool, optional): accepted for Apex's amp, and ignored:
            under O2, amp_patch makes fp32 master grads only when something asks for them
            (:func:`amp_patch.master_params`, for clipping), and steps from the half grads
            otherwise. Default: True.
        set_grad_none (bool, optional): :meth:`zero_grad` sets grads to None.
            Default: False, as in Apex.
        state_format (str, optional): how the momentum buffers are stored:
            ``"fp32"`` (the param's dtype), ``"bf16"``, ``"int8"`` or ``"fp8"``
            (block-scaled). Default: ``"fp32"``.

    Raises:
        ValueError: a negative ``lr``, ``momentum`` or ``weight_decay``; Nesterov
            without momentum or with dampening; no ``lr`` for a param group.

    Example::

        >>> opt = FusedSGD(model.parameters(), lr=0.1, momentum=0.9, nesterov=True)
        >>> loss_fn(model(x), y).backward()
        >>> opt.step()
    """

    LEAN_STATE = True
    # A buffer's dtype is the format's, which need not be the param's (fp32 buffers of bf16
    # params stepped with stochastic rounding): load_state_dict keeps it as saved, and the
    # next step converts it if the format asks for another (FusedOptimizer.state_in_code).
    _KEEP_SAVED_DTYPE = ("master_param", "momentum_buffer")

    # lr is a float, or torch's ``required`` marker when it is not given.
    def __init__(self, params: Any, lr: Any = required, momentum: float = 0.0,
                 dampening: float = 0.0, weight_decay: float = 0.0, nesterov: bool = False,
                 wd_after_momentum: bool = False, materialize_master_grads: bool = True,
                 set_grad_none: bool = False, state_format: str = "fp32") -> None:
        if lr is not required and lr < 0.0:
            raise ValueError(f"Invalid learning rate: {lr}")
        if momentum < 0.0:
            raise ValueError(f"Invalid momentum value: {momentum}")
        if weight_decay < 0.0:
            raise ValueError(f"Invalid weight_decay value: {weight_decay}")
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ValueError("Nesterov momentum requires a momentum and zero dampening")
        defaults = dict(lr=lr, momentum=momentum, dampening=dampening,
                        weight_decay=weight_decay, nesterov=nesterov)
        super().__init__(params, defaults, set_grad_none=set_grad_none,
                         state_format=state_format)
        self.wd_after_momentum = wd_after_momentum
        self.materialize_master_grads = materialize_master_grads
        # Apex's amp set this to the loss scale when it left the model grads scaled;
        # the next step divides the grads by it, then it returns to 1.
        self.most_recent_scale = 1.0
        self.scale_set_by_backward = False

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        for group in self.param_groups:
            group.setdefault("nesterov", False)

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One SGD step over every param that has a grad.

        Args:
            closure (callable, optional): re-evaluates the model and returns the loss.

        Returns:
            The closure's loss, or None.

        Example::

            >>> opt.step()
        """
        loss = super().step(closure)
        self.most_recent_scale = 1.0
        self.scale_set_by_backward = False
        return loss

    @property
    def READS_FOUND_INF(self) -> bool:  # type: ignore[override]  # noqa: N802 (the base's name)
        """False for the fp32-state step, which has no step counter: the kernel's ``noop``
        skips it on the device unread. The low-precision state ops (their rounding bits count
        steps) read it, and so does a group with dampening whose momentum buffers are not all
        made yet: a skipped first step would leave a new buffer at zero, and the next step
        would weigh the grad by ``1 - dampening`` where ``first_run`` takes it whole."""
        if self.state_format.low_precision or self.stochastic_rounding:
            return True
        return any(group["momentum"] != 0 and group["dampening"] != 0 and any(
            "momentum_buffer" not in self.state.get(p, {}) for p in group["params"])
            for group in self.param_groups)

    def _fused_step(self) -> None:
        for group in self.param_groups:
            self._sgd_group(group)

    def _sgd_group(self, group: dict[str, Any]) -> None:
        momentum = group["momentum"]
        # New buffers start as the grad, which the kernel does for a whole call
        # (first_run): params with and without a buffer go in separate calls.
        fresh = (lambda p: "momentum_buffer" not in self.state[p]) if momentum != 0 else None
        fmt = self.state_format
        step = None
        for b in self._batches(group, lambda p: (fresh and fresh(p), fmt.codes(p)),
                               ("momentum_buffer",) if momentum != 0 else ()):
            buf = b.state[0] if b.state else StateLists([], [])
            hyper = dict(lr=group["lr"], weight_decay=group["weight_decay"], momentum=momentum,
                         dampening=group["dampening"], nesterov=group["nesterov"],
                         first_run=bool(b.split[0]), wd_after_momentum=self.wd_after_momentum)
            inv = self._inv_scale(b.inv_scale, b)
            if not b.low_precision:
                ops.multi_tensor_sgd_(b.grads, b.params, buf.codes, b.model_params, b.noop, inv,
                                      **hyper)
                continue
            if step is None:  # the rounding bits' step count, kept only by these steps
                step = next_step(group)
            ops.multi_tensor_sgd_lean_(
                b.grads, b.params, buf.codes, buf.scales, b.model_params, b.noop, inv, **hyper,
                step=step, block_size=b.block_size, seed=self.rounding_seed)

    def _state_codes(self, key: Tensor, stepped: Tensor,
                     low_precision: bool) -> tuple[torch.dtype | None, ...]:
        # Without a low-precision format a buffer has the dtype of the tensor stepped.
        return (self.state_format.codes(key)[0] if low_precision else stepped.dtype,)

    def _inv_scale(self, inv_scale: Tensor | None, batch: Any) -> Tensor | None:
        if self.most_recent_scale == 1.0:
            return inv_scale
        legacy = torch.full((1,), 1.0 / self.most_recent_scale, dtype=torch.float32,
                            device=batch.device)
        return legacy if inv_scale is None else legacy * inv_scale
