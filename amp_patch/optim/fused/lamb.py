"""FusedLAMB and FusedMixedPrecisionLamb (``apex.optimizers``): LAMB in two fused passes.

LAMB (You et al., *Large Batch Optimization for Deep Learning: Training BERT
in 76 minutes*) is Adam whose step for each tensor is rescaled by a trust
ratio ``||p|| / ||u||``. That ratio needs the norm of the whole tensor's update
``u`` before any element of ``p`` may move, so a step is two passes:

1. :func:`amp_patch.ops.multi_tensor_lamb_stage1_` reads the grads (divided by
   the global grad-norm clipping factor), updates the moments, and returns each
   tensor's ``||p||`` and ``||u||``;
2. :func:`amp_patch.ops.multi_tensor_lamb_stage2_` recomputes ``u`` from the
   stored moments and applies ``p -= lr * ratio * u``.

Before them, one :func:`amp_patch.ops.multi_tensor_l2norm` over every grad of
the optimizer gives the global norm for clipping (``max_grad_norm``); in amp's
one-pass O2 step it comes with the step inputs, from the overflow check.

On FSDP2's shards (DTensors) the ops step each rank's local shards, and both
kinds of norm are those of the whole tensors: the squares of the shards' norms
are summed over the shards' process group, one all-reduce for the grad norm and
one for the trust-ratio norms per step (docs/distributed.md).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from amp_patch import ops
from amp_patch.ops.optim_reference import lamb_uses_ratio
from amp_patch.optim.fused._base import FusedOptimizer
from amp_patch.optim.fused.batches import Batch
from amp_patch.optim.fused.norms import whole_tensor_norms
from amp_patch.optim.fused.steps import as_float, next_step

__all__ = ["FusedLAMB", "FusedMixedPrecisionLamb"]


class _LambBase(FusedOptimizer):
    """The LAMB step shared by both classes; they differ in state layout and masters."""

    adam_w_mode: int
    use_nvlamb: bool

    def _fused_step(self) -> None:
        # One call per pair of codes: the low-precision ops take one scales list per moment.
        batches = [self._batches(group, self.state_format.codes, ("exp_avg", "exp_avg_sq"))
                   for group in self.param_groups]
        norms = self._grad_norms()
        max_grad_norm = as_float(self.defaults["max_grad_norm"] or 0.0)
        for group, group_batches in zip(self.param_groups, batches):
            if not group["params"]:
                continue
            step = next_step(group)
            lr = as_float(group["lr"])  # a host read when it is a tensor: once per group
            beta1, beta2 = group["betas"]
            hyper = dict(beta1=beta1, beta2=beta2, eps=group["eps"],
                         weight_decay=group["weight_decay"], step=step,
                         bias_correction=bool(group["bias_correction"]),
                         adam_w_mode=bool(self.adam_w_mode), use_nvlamb=bool(self.use_nvlamb))
            stage1 = dict(max_grad_norm=max_grad_norm,
                          grad_averaging=bool(group["grad_averaging"]), **hyper)
            for b in group_batches:
                if b.low_precision:
                    self._low_precision_batch(b, norms[b.device], lr, stage1)
                    continue
                m, v = b.state[0].codes, b.state[1].codes
                # The trust ratio's norms of FSDP2's shards are summed over the shards.
                local_norms = ops.multi_tensor_lamb_stage1_(
                    b.grads, b.params, m, v, b.noop, b.inv_scale, norms[b.device], **stage1)
                param_norms, update_norms = whole_tensor_norms(b.stepped, *local_norms)
                ops.multi_tensor_lamb_stage2_(b.params, m, v, param_norms, update_norms,
                                              b.model_params, b.noop, lr=lr, **hyper)

    @staticmethod
    def _trust_ratio(hyper: dict[str, Any]) -> bool:
        """Whether a group's steps scale by the trust ratio, and so need stage 1's norms."""
        return lamb_uses_ratio(hyper["weight_decay"], hyper["use_nvlamb"])

    def _low_precision_batch(self, b: Batch, norm: Tensor, lr: float,
                             stage1: dict[str, Any]) -> None:
        """LAMB over low-precision state (or bf16 params): the two stages of the low-precision
        ops. Stage 1 reads the moments' codes for the norms and writes nothing; stage 2 computes
        the same new moments again, steps, encodes them and writes the params (a bf16 master
        rounded stochastically) and the model copies. No fp32 copy of the state outlives a
        call."""
        (m, m_scales), (v, v_scales) = b.state
        lists = (b.grads, b.params, m, m_scales, v, v_scales)
        if self._trust_ratio(stage1):
            local_norms = ops.multi_tensor_lamb_lean_stage1_(
                *lists, b.noop, b.inv_scale, norm, **stage1, block_size=b.block_size)
            param_norms, update_norms = whole_tensor_norms(b.stepped, *local_norms)
        else:
            # No trust ratio (no weight decay, no NVLAMB): stage 2 steps by lr alone and stage 1,
            # which writes nothing, would only compute norms that go unused. The same on every
            # rank, since it follows from the group's settings.
            param_norms = update_norms = torch.zeros(len(b.params), device=b.device)
        ops.multi_tensor_lamb_lean_stage2_(
            *lists, param_norms, update_norms, b.model_params, b.noop, b.inv_scale, norm,
            **stage1, lr=lr, block_size=b.block_size, seed=self.rounding_seed)


class FusedLAMB(_LambBase):
    r"""LAMB with Apex's two-stage trust ratio and global grad-norm clipping, fused.

    Per element, in fp32, with ``t`` the group's step and :math:`c` the clipping
    divisor (``||grad||_global / max_grad_norm`` when that exceeds 1, else 1):

    .. math::
        g &= \nabla / c \; (+\, \lambda p \text{ with adam\_w\_mode=False}) \\
        m &= \beta_1 m + \beta_3 g, \qquad v = \beta_2 v + (1 - \beta_2) g^2 \\
        u &= \frac{m / (1 - \beta_1^t)}{\sqrt{v / (1 - \beta_2^t)} + \epsilon}
             \; (+\, \lambda p \text{ with adam\_w\_mode=True}) \\
        p &= p - \eta \, r \, u, \qquad r = \|p\| / \|u\| \text{ per tensor}

    :math:`\beta_3` is :math:`1 - \beta_1` with ``grad_averaging``, else 1. The
    trust ratio :math:`r` applies to tensors with non-zero weight decay (all of
    them with ``use_nvlamb``) when both norms are non-zero; otherwise
    :math:`r = 1`. The global norm is taken over every grad of the optimizer, and
    clipping uses the constructor's ``max_grad_norm`` for all groups, as in Apex.
    State (``exp_avg``, ``exp_avg_sq``) has each param's dtype, or the codes of
    a low-precision ``state_format`` (set by ``initialize(optimizer_state=...)``;
    see :mod:`amp_patch.optim.fused.state_format`): then the two stages are
    :func:`~amp_patch.ops.multi_tensor_lamb_lean_stage1_` and
    :func:`~amp_patch.ops.multi_tensor_lamb_lean_stage2_`, which decode the
    codes as they go (stage 2 computes stage 1's new moments again and encodes
    them), and a bf16 param is written with stochastic rounding.

    Args:
        params (iterable): parameters or parameter groups.
        lr (float, optional): learning rate. Default: 1e-3.
        bias_correction (bool, optional): Default: True.
        betas (tuple of float, optional): Default: (0.9, 0.999).
        eps (float, optional): Default: 1e-6.
        weight_decay (float, optional): Default: 0.01.
        amsgrad (bool, optional): not supported, as in Apex. Default: False.
        adam_w_mode (bool, optional): decoupled weight decay; False adds it to
            the grad (L2). Default: True.
        grad_averaging (bool, optional): scale the grad by ``1 - beta1`` in the
            first moment. Default: True.
        set_grad_none (bool, optional): :meth:`zero_grad` sets grads to None.
            Default: True.
        max_grad_norm (float, optional): global grad-norm clipping threshold;
            0 or None turns clipping off. Default: 1.0.
        use_nvlamb (bool, optional): apply the trust ratio to parameters without
            weight decay too. Default: False.
        state_format (str, optional): ``"fp32"`` (each param's dtype),
            ``"bf16"``, ``"int8"`` or ``"fp8"``. Default: ``"fp32"``.

    Raises:
        RuntimeError: ``amsgrad=True``.

    Example::

        >>> opt = FusedLAMB(model.parameters(), lr=1e-3, weight_decay=0.01, max_grad_norm=1.0)
        >>> loss_fn(model(x), y).backward()
        >>> opt.step()
    """

    LEAN_STATE = True
    # Under a low-precision format the moments' dtype is the format's, not the param's (fp32
    # moments of bf16 params rounded stochastically): load_state_dict keeps them as saved, and
    # the next step converts them if the format asks for another (FusedOptimizer.state_in_code).
    _KEEP_SAVED_DTYPE = ("master_param", "exp_avg", "exp_avg_sq")

    def __init__(self, params: Any, lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-6,
                 weight_decay: float = 0.01, amsgrad: bool = False, adam_w_mode: bool = True,
                 grad_averaging: bool = True, set_grad_none: bool = True,
                 max_grad_norm: float = 1.0, use_nvlamb: bool = False,
                 state_format: str = "fp32") -> None:
        if amsgrad:
            raise RuntimeError("FusedLAMB does not support the AMSGrad variant.")
        defaults = dict(lr=lr, bias_correction=bias_correction, betas=betas, eps=eps,
                        weight_decay=weight_decay, grad_averaging=grad_averaging,
                        max_grad_norm=max_grad_norm)
        super().__init__(params, defaults, set_grad_none=set_grad_none,
                         state_format=state_format)
        self.adam_w_mode = 1 if adam_w_mode else 0
        self.use_nvlamb = use_nvlamb


class FusedMixedPrecisionLamb(_LambBase):
    r"""LAMB for reduced-precision models: fp32 masters and state for params of one half dtype.

    The math is :class:`FusedLAMB`'s. Params whose dtype is
    ``reduced_precision_dtype`` get an fp32 master (``state[p]["master_param"]``,
    made at the param's first step, so after any DDP broadcast) and fp32 moments;
    each step reads their half grads, updates the masters and writes the rounded
    masters back into the params, in the same two passes. Other params are
    stepped directly with state of their own dtype. As in Apex, ``lr`` and the
    step counter are tensors on the params' device, and ``torch.amp.GradScaler``
    hands the optimizer its scale and overflow flag rather than unscaling the
    grads: the kernels read them unscaled (``.grad`` stays scaled), and a step
    with an overflow changes nothing. Apex's ``step(grad_scaler=...)`` argument
    is gone: torch now passes these as the attributes ``grad_scale`` and
    ``found_inf``, which also handle grads already unscaled for clipping.

    Args:
        params (iterable): parameters or parameter groups.
        lr (float, optional): Default: 1e-3.
        step (int, optional): the initial step count. Default: 0.
        bias_correction (bool, optional): Default: True.
        betas (tuple of float, optional): Default: (0.9, 0.999).
        eps (float, optional): Default: 1e-6.
        weight_decay (float, optional): Default: 0.01.
        amsgrad (bool, optional): not supported. Default: False.
        adam_w_mode (bool, optional): Default: True.
        grad_averaging (bool, optional): Default: True.
        max_grad_norm (float, optional): clipping threshold on the unscaled
            global grad norm; 0 or None turns it off. Default: 1.0.
        use_nvlamb (bool, optional): Default: False.
        reduced_precision_dtype (torch.dtype, optional): the half dtype whose params
            get fp32 masters (``torch.float16`` or ``torch.bfloat16``). Default: None.

    Raises:
        RuntimeError: ``amsgrad=True``.

    Example::

        >>> model = model.bfloat16()
        >>> opt = FusedMixedPrecisionLamb(model.parameters(), lr=1e-3,
        ...                               reduced_precision_dtype=torch.bfloat16)
        >>> loss_fn(model(x.bfloat16()).float(), y).backward()
        >>> opt.step()    # fp32 masters stepped, bf16 params rewritten
    """

    _KEEP_SAVED_DTYPE = ("master_param", "exp_avg", "exp_avg_sq")

    def __init__(self, params: Any, lr: float = 1e-3, step: int = 0, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-6,
                 weight_decay: float = 0.01, amsgrad: bool = False, adam_w_mode: bool = True,
                 grad_averaging: bool = True, max_grad_norm: float = 1.0, use_nvlamb: bool = False,
                 reduced_precision_dtype: torch.dtype | None = None) -> None:
        if amsgrad:
            raise RuntimeError("FusedMixedPrecisionLamb does not support the AMSGrad variant.")
        defaults = dict(lr=torch.tensor(lr, dtype=torch.float32),
                        step=torch.tensor([step], dtype=torch.int32),
                        bias_correction=bias_correction, betas=betas, eps=eps,
                        weight_decay=weight_decay, grad_averaging=grad_averaging,
                        max_grad_norm=max_grad_norm)
        super().__init__(params, defaults, set_grad_none=True, master_weights=True)
        self.reduced_precision_dtype = reduced_precision_dtype
        self.adam_w_mode = 1 if adam_w_mode else 0
        self.use_nvlamb = use_nvlamb
        self._step_supports_amp_scaling = True

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a param group with its own ``lr`` and ``step`` tensors on its params' device.

        Args:
            param_group (dict): as for ``torch.optim.Optimizer.add_param_group``;
                an ``lr`` given as a float becomes a tensor.

        Example::

            >>> opt = FusedMixedPrecisionLamb(model.parameters(), lr=1e-3)
            >>> head = nn.Linear(2, 2)
            >>> opt.add_param_group({"params": head.parameters(), "lr": 1e-4})
            >>> opt.param_groups[-1]["lr"]
            tensor(1.0000e-04)
        """
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        device = group["params"][0].device if group["params"] else None
        for name in ("lr", "step"):
            value = group[name]
            # The defaults are tensors; a group must not share them with another.
            value = value.clone() if isinstance(value, Tensor) else torch.tensor(
                value, dtype=self.defaults[name].dtype)
            group[name] = value.to(device) if device is not None else value

    def _uses_master(self, p: Tensor) -> bool:
        dtype = getattr(self, "reduced_precision_dtype", None)
        return dtype is not None and p.dtype == dtype
