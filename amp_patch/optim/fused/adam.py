"""FusedAdam: Adam and AdamW in one multi-tensor pass per step (``apex.optimizers.FusedAdam``)."""

from __future__ import annotations

from typing import Any, Callable

import torch

from amp_patch import ops
from amp_patch.optim.fused._base import FusedOptimizer
from amp_patch.optim.fused.batches import to_device
from amp_patch.optim.fused.steps import as_float, device_counter, next_step

__all__ = ["FusedAdam"]


class FusedAdam(FusedOptimizer):
    r"""Adam, or AdamW (``adam_w_mode=True``, the default), as one fused op call per step.

    A drop-in for ``torch.optim.AdamW``, or ``torch.optim.Adam`` with
    ``adam_w_mode=False``, with Apex's constructor. Every param of a group that
    has a grad is updated by one call of :func:`amp_patch.ops.multi_tensor_adam_`
    (per device): each grad, param and moment is read once and written once.
    The moments are kept in fp32 whatever the param dtype.

    The update, per element, in fp32 (``t`` is the group's step, from 1):

    .. math::
        g &= \nabla + \lambda p \quad \text{(only with adam\_w\_mode=False)} \\
        m &= \beta_1 m + (1 - \beta_1) g, \qquad v = \beta_2 v + (1 - \beta_2) g^2 \\
        u &= \frac{m / (1 - \beta_1^t)}{\sqrt{v / (1 - \beta_2^t)} + \epsilon}
             \; (+\, \lambda p \text{ with adam\_w\_mode=True}), \qquad p = p - \eta u

    Args:
        params (iterable): parameters or parameter groups.
        lr (float, optional): learning rate. Default: 1e-3.
        bias_correction (bool, optional): divide the moments by ``1 - beta**t``.
            Default: True.
        betas (tuple of float, optional): the moments' decay rates. Default: (0.9, 0.999).
        eps (float, optional): added to the denominator. Default: 1e-8.
        adam_w_mode (bool, optional): decoupled weight decay (AdamW); False adds
            ``weight_decay * p`` to the grad (Adam's L2). Default: True.
        weight_decay (float, optional): Default: 0.
        amsgrad (bool, optional): not supported, as in Apex. Default: False.
        set_grad_none (bool, optional): :meth:`zero_grad` sets grads to None.
            Default: True.
        capturable (bool, optional): Apex's CUDA-graph variant: ``lr`` and the
            step counter are kept as tensors on the params' device, and
            ``torch.amp.GradScaler.step`` hands the optimizer its scale and
            overflow flag (``grad_scale``, ``found_inf``) instead of unscaling the
            grads itself: the kernel reads them unscaled, ``.grad`` stays scaled.
            ``step()`` reads the flag, ``lr`` and the step on the host, so unlike
            Apex's it cannot be captured in a CUDA graph. Default: False.
        master_weights (bool, optional): keep an fp32 master of every fp16/bf16
            param (``state[p]["master_param"]``, made at the param's first step)
            and step it from the half grad; the half param receives the rounded
            master in the same pass. Apex allowed it with ``capturable`` only;
            here it works either way. Default: False.
        state_format (str, optional): how the moments are stored: ``"fp32"``,
            ``"bf16"``, ``"int8"`` (block-scaled) or ``"fp8"`` (see
            :mod:`amp_patch.optim.fused.state_format`); amp sets it from
            ``initialize(optimizer_state=...)``. Default: ``"fp32"``.

    Raises:
        RuntimeError: ``amsgrad=True``.

    Example::

        >>> opt = FusedAdam(model.parameters(), lr=1e-3, weight_decay=0.01)
        >>> loss_fn(model(x), y).backward()
        >>> opt.step()
        >>> opt.zero_grad()
    """

    _KEEP_SAVED_DTYPE = ("master_param", "exp_avg", "exp_avg_sq")
    _MADE_ANEW = {**FusedOptimizer._MADE_ANEW, "_device_betas": dict}
    LEAN_STATE = True

    def __init__(self, params: Any, lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 adam_w_mode: bool = True, weight_decay: float = 0.0, amsgrad: bool = False,
                 set_grad_none: bool = True, capturable: bool = False,
                 master_weights: bool = False, state_format: str = "fp32") -> None:
        if amsgrad:
            raise RuntimeError("FusedAdam does not support the AMSGrad variant.")
        defaults = dict(lr=torch.tensor(lr, dtype=torch.float32) if capturable else lr,
                        bias_correction=bias_correction, betas=betas, eps=eps,
                        weight_decay=weight_decay)
        super().__init__(params, defaults, set_grad_none=set_grad_none,
                         master_weights=master_weights, state_format=state_format)
        self.adam_w_mode = 1 if adam_w_mode else 0
        self.capturable = capturable
        self._device_betas: dict[tuple[float, float, torch.device], torch.Tensor] = {}
        if capturable:
            for group in self.param_groups:
                _tensors_to_device(group)
            self._step_supports_amp_scaling = True

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a param group; with ``capturable``, its ``lr`` is a tensor of its own.

        Args:
            param_group (dict): as for ``torch.optim.Optimizer.add_param_group``.

        Example::

            >>> opt = FusedAdam(model.parameters(), lr=1e-3)
            >>> head = nn.Linear(2, 2)
            >>> opt.add_param_group({"params": head.parameters(), "lr": 1e-4})
        """
        super().add_param_group(param_group)
        if getattr(self, "capturable", False):
            _tensors_to_device(self.param_groups[-1])

    def step(self, closure: Callable[[], Any] | None = None, grads: Any = None,
             output_params: Any = None, scale: Any = None, grad_norms: Any = None) -> Any:
        """One Adam step over every param that has a grad.

        Args:
            closure (callable, optional): re-evaluates the model and returns the loss.
            grads, output_params, scale, grad_norms: Apex's long-removed
                arguments; passing any raises, as in Apex.

        Returns:
            The closure's loss, or None.

        Example::

            >>> opt.step()
        """
        if any(a is not None for a in (grads, output_params, scale, grad_norms)):
            raise RuntimeError("FusedAdam has been updated. Simply initialize it identically to "
                               "torch.optim.Adam, and call step() with no arguments.")
        return super().step(closure)

    @property
    def READS_FOUND_INF(self) -> bool:  # type: ignore[override]  # noqa: N802 (the base's name)
        """False for the fp32-state step: it keeps its step counters on the device and takes
        its bias corrections from there, so a skip decided on the device is never read.
        The low-precision state ops (or stochastic rounding) and ``capturable`` (whose
        ``lr`` is read) still read the flag on the host."""
        return self.capturable or self.state_format.low_precision or self.stochastic_rounding

    def _fused_step(self) -> None:
        on_device = self._skips_on_device()
        for group in self.param_groups:
            if not group["params"]:
                continue
            hyper = dict(lr=as_float(group["lr"]), eps=group["eps"],
                         weight_decay=group["weight_decay"],
                         bias_correction=bool(group["bias_correction"]))
            if on_device:
                assert self._inputs is not None and self._inputs.found_inf is not None
                beta1, beta2 = group["betas"]
                step = device_counter(group)
                corrections = ops.adam_device_step_(
                    step, to_device(self._inputs.found_inf, step.device),
                    self._betas_on(beta1, beta2, step.device), hyper["bias_correction"])
                self._adam_group(group, 0, **hyper, bias_corrections=corrections)
            else:
                self._adam_group(group, next_step(group), **hyper)

    def _betas_on(self, beta1: float, beta2: float, device: torch.device) -> torch.Tensor:
        """The fp32 betas on ``device``, made once per value: a copy from the host at every
        step would keep the step out of a CUDA graph."""
        key = (beta1, beta2, device)
        if key not in self._device_betas:
            self._device_betas[key] = ops.fp32_betas(beta1, beta2, device)
        return self._device_betas[key]

    def _state_codes(self, key: torch.Tensor, stepped: torch.Tensor,
                     low_precision: bool) -> tuple[torch.dtype | None, ...]:
        return self.state_format.codes(key)  # fp32 moments whatever the param dtype

    def _adam_group(self, group: dict[str, Any], step: int, *, lr: float, eps: float,
                    weight_decay: float, bias_correction: bool,
                    inv_scale: torch.Tensor | None = None,
                    bias_corrections: torch.Tensor | None = None) -> None:
        """The op calls of one group's step, one per batch, with these hyper-parameters.

        ``inv_scale``, when given, replaces the step inputs' own (a clipping
        factor folded in, say); ``bias_corrections`` (on the params' device)
        replace those of ``step`` (the fp32-state op only).
        """
        beta1, beta2 = group["betas"]
        hyper = dict(lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay,
                     step=step, adam_w_mode=bool(self.adam_w_mode),
                     bias_correction=bias_correction)
        # One call per pair of codes: the op takes one scales list per moment.
        for b in self._batches(group, self.state_format.codes, ("exp_avg", "exp_avg_sq")):
            inv = b.inv_scale if inv_scale is None else to_device(inv_scale, b.device)
            m, v = b.state
            if b.low_precision:
                ops.multi_tensor_adam_lean_(
                    b.grads, b.params, m.codes, m.scales, v.codes, v.scales, b.model_params,
                    b.noop, inv, **hyper, block_size=b.block_size, seed=self.rounding_seed)
            else:
                ops.multi_tensor_adam_(b.grads, b.params, m.codes, v.codes, b.model_params,
                                       b.noop, inv, **hyper,
                                       bias_corrections=to_device(bias_corrections, b.device))


def _tensors_to_device(group: dict[str, Any]) -> None:
    """Apex's capturable layout: ``lr`` (float32) and ``step`` (int32) as tensors of the group,
    on its params' device."""
    if not group["params"]:
        return
    device = group["params"][0].device
    lr = group["lr"]
    group["lr"] = (lr.detach().clone() if isinstance(lr, torch.Tensor)
                   else torch.tensor(lr, dtype=torch.float32)).to(device)
    group.setdefault("step", torch.zeros((1,), dtype=torch.int32, device=device))
