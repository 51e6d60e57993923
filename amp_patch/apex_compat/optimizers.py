"""``apex.optimizers`` for ``amp-patch run``: FusedAdam and FusedSGD on torch's fused optimizers.

Apex's fused optimizers were CUDA kernels over lists of tensors. torch's own
Adam, AdamW and SGD now have fused (``fused=True``) and multi-tensor
(``foreach=True``) implementations, so these classes are those torch
optimizers with Apex's constructor arguments. ``fused=True`` is used where
torch supports it for the parameters' device, else ``foreach=True``.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

__all__ = ["FusedAdam", "FusedSGD"]

logger = logging.getLogger("amp_patch")


def _fastest_impl(cls: type[torch.optim.Optimizer], self: torch.optim.Optimizer,
                  params: Any, kwargs: dict[str, Any]) -> None:
    # torch validates fused support (device, dtype) in the constructor, so trying it is the check.
    params = list(params)
    try:
        cls.__init__(self, params, fused=True, **kwargs)
    except (RuntimeError, ValueError) as exc:
        logger.debug("fused %s not available here (%s); using foreach", cls.__name__, exc)
        cls.__init__(self, params, foreach=True, **kwargs)


class FusedAdam(torch.optim.Adam):
    """Apex's ``FusedAdam``, as torch's Adam/AdamW with ``fused=True`` (else ``foreach=True``).

    Args:
        params (iterable): parameters or parameter groups.
        lr (float, optional): learning rate. Default: 1e-3.
        bias_correction (bool, optional): only True is supported (torch's Adam
            always corrects bias). Default: True.
        betas (tuple, optional): Default: (0.9, 0.999).
        eps (float, optional): Default: 1e-8.
        adam_w_mode (bool, optional): decoupled weight decay (AdamW) when True,
            L2 added to the gradient (Adam) when False. Default: True.
        weight_decay (float, optional): Default: 0.
        amsgrad (bool, optional): Default: False.
        set_grad_none (bool, optional): :meth:`zero_grad` sets grads to None
            rather than zeroing them. Default: True.
        capturable (bool, optional): passed to torch (CUDA graphs). Default: False.
        master_weights (bool, optional): Apex's in-optimizer fp32 masters are
            not supported; use ``amp.initialize(..., opt_level="O2")``, which
            keeps them. Default: False.

    Raises:
        ValueError: ``bias_correction=False`` or ``master_weights=True``.

    Example::

        >>> from apex.optimizers import FusedAdam   # under amp-patch run
        >>> opt = FusedAdam(model.parameters(), lr=1e-3, weight_decay=0.01)
    """

    def __init__(self, params, lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 adam_w_mode: bool = True, weight_decay: float = 0.0, amsgrad: bool = False,
                 set_grad_none: bool = True, capturable: bool = False,
                 master_weights: bool = False) -> None:
        if not bias_correction:
            raise ValueError("apex.optimizers.FusedAdam(bias_correction=False) is not supported: "
                             "torch's Adam always applies bias correction")
        if master_weights:
            raise ValueError("apex.optimizers.FusedAdam(master_weights=True) is not supported: "
                             "use amp.initialize(..., opt_level='O2'), which keeps fp32 master weights")
        self.set_grad_none = set_grad_none
        _fastest_impl(torch.optim.Adam, self, params, dict(
            lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
            capturable=capturable, decoupled_weight_decay=adam_w_mode))

    def zero_grad(self, set_to_none: bool | None = None) -> None:
        """Clear the grads; to None unless ``set_grad_none=False`` was passed at construction."""
        super().zero_grad(self.set_grad_none if set_to_none is None else set_to_none)


class FusedSGD(torch.optim.SGD):
    """Apex's ``FusedSGD``, as torch's SGD with ``fused=True`` (else ``foreach=True``).

    Args:
        params (iterable): parameters or parameter groups.
        lr (float): learning rate.
        momentum (float, optional): Default: 0.
        dampening (float, optional): Default: 0.
        weight_decay (float, optional): Default: 0.
        nesterov (bool, optional): Default: False.
        wd_after_momentum (bool, optional): only False (torch's order) is supported.
        materialize_master_grads (bool, optional): accepted and ignored:
            amp_patch's O2 always writes fp32 master grads. Default: True.
        set_grad_none (bool, optional): :meth:`zero_grad` sets grads to None.
            Default: False, as in Apex.

    Raises:
        ValueError: ``wd_after_momentum=True``.
    """

    def __init__(self, params, lr: float, momentum: float = 0.0, dampening: float = 0.0,
                 weight_decay: float = 0.0, nesterov: bool = False, wd_after_momentum: bool = False,
                 materialize_master_grads: bool = True, set_grad_none: bool = False) -> None:
        if wd_after_momentum:
            raise ValueError("apex.optimizers.FusedSGD(wd_after_momentum=True) is not supported: "
                             "torch's SGD applies weight decay before momentum")
        self.set_grad_none = set_grad_none
        _fastest_impl(torch.optim.SGD, self, params, dict(
            lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay,
            nesterov=nesterov))

    def zero_grad(self, set_to_none: bool | None = None) -> None:
        """Clear the grads; zeroed unless ``set_grad_none=True`` was passed at construction."""
        super().zero_grad(self.set_grad_none if set_to_none is None else set_to_none)
