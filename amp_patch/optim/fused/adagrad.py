"""FusedAdagrad: Adagrad in one multi-tensor pass per step (``apex.optimizers.FusedAdagrad``)."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from amp_patch import ops
from amp_patch.optim.fused._base import FusedOptimizer

__all__ = ["FusedAdagrad"]


class FusedAdagrad(FusedOptimizer):
    r"""Adagrad as one fused op call per step.

    Per element, in fp32, with the running sum :math:`h` (``state[p]["sum"]``,
    the param's dtype, starting at 0):

    .. math::
        g &= \nabla + \lambda p \quad \text{(only with adagrad\_w\_mode=False)} \\
        h &= h + g^2, \qquad
        p = p - \eta \left(\frac{g}{\sqrt{h} + \epsilon}
            \;(+\, \lambda p \text{ with adagrad\_w\_mode=True})\right)

    With ``adagrad_w_mode=False`` this is ``torch.optim.Adagrad`` without
    ``lr_decay`` and with ``initial_accumulator_value=0``.

    Args:
        params (iterable): parameters or parameter groups.
        lr (float, optional): learning rate. Default: 1e-2.
        eps (float, optional): added to the denominator. Default: 1e-10.
        weight_decay (float, optional): Default: 0.
        set_grad_none (bool, optional): :meth:`zero_grad` sets grads to None.
            Default: True.
        adagrad_w_mode (bool, optional): decoupled weight decay (as in AdamW)
            rather than L2 added to the grad. Default: False.

    Example::

        >>> opt = FusedAdagrad(model.parameters(), lr=1e-2)
        >>> loss_fn(model(x), y).backward()
        >>> opt.step()
    """

    def __init__(self, params: Any, lr: float = 1e-2, eps: float = 1e-10,
                 weight_decay: float = 0.0, set_grad_none: bool = True,
                 adagrad_w_mode: bool = False) -> None:
        defaults = dict(lr=lr, eps=eps, weight_decay=weight_decay)
        super().__init__(params, defaults, set_grad_none=set_grad_none)
        self.adagrad_w_mode = 1 if adagrad_w_mode else 0

    def _fused_step(self) -> None:
        for group in self.param_groups:
            for b in self._batches(group, state=("sum",)):
                ops.multi_tensor_adagrad_(
                    b.grads, b.params, b.state[0].codes, b.model_params, b.noop, b.inv_scale,
                    lr=group["lr"], eps=group["eps"], weight_decay=group["weight_decay"],
                    adagrad_w_mode=bool(self.adagrad_w_mode))

    def _state_codes(self, key: Tensor, stepped: Tensor,
                     low_precision: bool) -> tuple[torch.dtype | None, ...]:
        return (None,)  # as stored: the state never changes code
