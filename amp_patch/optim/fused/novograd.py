"""FusedNovoGrad: NovoGrad with per-tensor second moments (``apex.optimizers.FusedNovoGrad``)."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from amp_patch import ops
from amp_patch.optim.fused._base import FusedOptimizer
from amp_patch.optim.fused.batches import Batch
from amp_patch.optim.fused.norms import whole_tensor_norms
from amp_patch.optim.fused.steps import next_step

__all__ = ["FusedNovoGrad"]


class FusedNovoGrad(FusedOptimizer):
    r"""NovoGrad (Ginsburg et al., used for Jasper): Adam-like, with one second moment per tensor.

    Each step first blends every tensor's grad norm :math:`n` into its second
    moment :math:`s` (``state[p]["exp_avg_sq"]``, a 0-dim fp32 tensor; on a
    param's first step :math:`s` starts at :math:`n`, or at 0 with ``init_zero``):

    .. math::
        s = \sqrt{\beta_2 s^2 + (1 - \beta_2) n^2} \quad (\text{L2, norm\_type=2}), \qquad
        s = \beta_2 s + (1 - \beta_2) n \quad (\text{max, norm\_type=0})

    then, per element in fp32, with :math:`d = s / \sqrt{1 - \beta_2^t} + \epsilon`
    and :math:`\beta_3 = 1 - \beta_1` with ``grad_averaging`` (else 1):

    .. math::
        m &= \beta_1 m + \beta_3 g, \qquad
        p = p - \eta \left(\frac{m / (1 - \beta_1^t)}{d} + \lambda p\right)
        \quad \text{(default)} \\
        m &= \beta_1 m + \beta_3 \left(\frac{g}{d} + \lambda p\right), \qquad
        p = p - \eta \, \frac{m}{1 - \beta_1^t} \quad \text{(reg\_inside\_moment=True)}

    The norms come from one :func:`amp_patch.ops.multi_tensor_l2norm` (or a
    foreach max-norm) over the grads; the element step is one
    :func:`amp_patch.ops.multi_tensor_novograd_` call.

    Args:
        params (iterable): parameters or parameter groups.
        lr (float, optional): Default: 1e-3.
        bias_correction (bool, optional): Default: True.
        betas (tuple of float, optional): Default: (0.9, 0.999).
        eps (float, optional): Default: 1e-8.
        weight_decay (float, optional): Default: 0.
        amsgrad (bool, optional): not supported, as in Apex. Default: False.
        reg_inside_moment (bool, optional): apply the normalisation and weight
            decay inside the moment (the paper's form). Default: False.
        grad_averaging (bool, optional): Default: True.
        norm_type (int, optional): 2 (L2) or 0 (max norm). Default: 2.
        init_zero (bool, optional): start the second moments at 0 rather than at
            the first step's norms. Default: False.
        set_grad_none (bool, optional): :meth:`zero_grad` sets grads to None.
            Default: True.

    Raises:
        RuntimeError: ``amsgrad=True``, or a ``norm_type`` other than 0 and 2 (at the step).

    Example::

        >>> opt = FusedNovoGrad(model.parameters(), lr=1e-2, betas=(0.95, 0.98), weight_decay=1e-3)
        >>> loss_fn(model(x), y).backward()
        >>> opt.step()
    """

    _KEEP_SAVED_DTYPE = ("master_param", "exp_avg_sq")

    def __init__(self, params: Any, lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, amsgrad: bool = False, reg_inside_moment: bool = False,
                 grad_averaging: bool = True, norm_type: int = 2, init_zero: bool = False,
                 set_grad_none: bool = True) -> None:
        if amsgrad:
            raise RuntimeError("FusedNovoGrad does not support the AMSGrad variant.")
        defaults = dict(lr=lr, bias_correction=bias_correction, betas=betas, eps=eps,
                        weight_decay=weight_decay, grad_averaging=grad_averaging,
                        norm_type=norm_type, init_zero=init_zero)
        super().__init__(params, defaults, set_grad_none=set_grad_none)
        self.moment_mode = 0 if reg_inside_moment else 1

    def _fused_step(self) -> None:
        for group in self.param_groups:
            if group["norm_type"] not in (0, 2):
                raise RuntimeError("FusedNovoGrad only supports the L2 (norm_type=2) and max "
                                   f"(norm_type=0) norms, got norm_type={group['norm_type']}")
            if not group["params"]:
                continue
            step = next_step(group)
            beta1, beta2 = group["betas"]
            for b in self._batches(group, state=("exp_avg",)):
                ops.multi_tensor_novograd_(
                    b.grads, b.params, b.state[0].codes, self._blend_norms(group, b),
                    b.model_params, b.noop, b.inv_scale, lr=group["lr"], beta1=beta1, beta2=beta2,
                    eps=group["eps"], weight_decay=group["weight_decay"], step=step,
                    bias_correction=bool(group["bias_correction"]),
                    grad_averaging=bool(group["grad_averaging"]),
                    reg_inside_moment=self.moment_mode == 0)

    def _state_codes(self, key: Tensor, stepped: Tensor,
                     low_precision: bool) -> tuple[torch.dtype | None, ...]:
        return (None,)  # as stored: the state never changes code

    def _blend_norms(self, group: dict[str, Any], b: Batch) -> Tensor:
        """Blend this step's grad norms into the batch's second moments; return them stacked.

        The norms are those of the whole grads (of FSDP2's DTensors too)."""
        if group["norm_type"] == 2:
            local = ops.multi_tensor_l2norm(b.grads, per_tensor=True)[1]
        else:
            local = torch.stack([n.float() for n in torch._foreach_norm(b.grads, float("inf"))])
        (norms,) = whole_tensor_norms(b.stepped_grads, local,
                                      op="l2" if group["norm_type"] == 2 else "max")
        if b.inv_scale is not None:
            norms = norms * b.inv_scale.reshape(())
        beta2 = group["betas"][1]
        old = []
        for p, n in zip(b.keys, norms.unbind(0)):
            state = self.state[p]
            if "exp_avg_sq" not in state:
                # Apex: start at this step's norm (the first blend then keeps it), or at 0.
                state["exp_avg_sq"] = torch.zeros((), dtype=torch.float32, device=b.device)
                if not group["init_zero"]:
                    state["exp_avg_sq"].copy_(n)
            old.append(state["exp_avg_sq"])
        s = torch.stack(old)
        if group["norm_type"] == 2:
            s = torch.sqrt(beta2 * s * s + (1.0 - beta2) * norms * norms)
        else:
            s = beta2 * s + (1.0 - beta2) * norms
        torch._foreach_copy_(old, list(s.unbind(0)))
        return s
