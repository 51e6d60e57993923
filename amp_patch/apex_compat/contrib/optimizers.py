"""``apex.contrib.optimizers``: ``FP16_Optimizer`` and the ``FusedAdam`` it was made for.

When Apex moved its 2019 ``FusedAdam`` and the cut-down ``FP16_Optimizer``
out of ``apex.optimizers``, they went to ``apex.contrib.optimizers``, and
trainers kept using them for "legacy" fp16 training, OpenNMT-py among them::

    optimizer = FusedAdam(params, lr=lr, betas=betas)     # Apex's, or the script's own copy
    optimizer = apex.contrib.optimizers.FP16_Optimizer(optimizer, dynamic_loss_scale=True)
    optimizer.backward(loss)
    optimizer.step()

The protocol between the two is the wrapped optimizer's
``step(grads=, output_params=, scale=, grad_norms=)``: :class:`FP16_Optimizer`
keeps fp32 masters in the optimizer's param groups and never makes fp32
grads; each step it hands the half grads, the half params to write, the loss
scale and each group's grad norm to the optimizer, which divides by the
scale and writes both copies. Any optimizer with that ``step`` can be
wrapped: :class:`FusedAdam` here, amp_patch's 2019 ``apex.optimizers.FusedAdam``,
or a script's own class that calls ``fused_adam_cuda.adam``
(:mod:`amp_patch.apex_compat.fused_adam_cuda` serves that).
"""

from __future__ import annotations

import inspect
import logging
import types
from typing import Any, Callable

import torch
from torch import Tensor

from amp_patch.apex_compat import fused_adam_cuda
from amp_patch.apex_compat.amp_C import multi_tensor_l2norm

__all__ = ["FP16_Optimizer", "FusedAdam"]

logger = logging.getLogger("amp_patch")

_PROTOCOL = ("grads", "output_params", "scale", "grad_norms")
_CLIP_EPS = 1e-6  # added to the unscaled norm before it is compared with max_grad_norm, as Apex


def _takes_protocol(step: Callable[..., Any]) -> bool:
    try:
        params = inspect.signature(step).parameters
    except (TypeError, ValueError):
        return False
    return (all(n in params for n in _PROTOCOL)
            or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()))


class FP16_Optimizer:  # noqa: N801 - Apex's name
    """Apex's ``apex.contrib.optimizers.FP16_Optimizer``: fp32 masters around a fused optimizer.

    On construction each param of the wrapped optimizer is replaced, in its
    param group, by an fp32 master copy (the half params stay the model's).
    :meth:`backward` backpropagates ``loss.float() * cur_scale``. :meth:`step`
    computes the L2 norm of each group's half grads, which also detects
    inf/NaN; on overflow it skips the step, otherwise it calls
    ``optimizer.step(grads=half_grads, output_params=half_params,
    scale=cur_scale, grad_norms=norms)``.

    Dynamic loss scaling, as Apex's: the scale starts at 2**16, is halved on
    an overflow (not below 1), and doubled after every 1000 steps without one.
    A static scale stays as given.

    Args:
        init_optimizer: the optimizer to wrap, over the half model's params;
            its ``step`` must take ``grads``, ``output_params``, ``scale`` and
            ``grad_norms`` (Apex's contrib protocol).
        static_loss_scale (float, optional): Default: 1.0.
        dynamic_loss_scale (bool, optional): Default: False.
        dynamic_loss_args (dict, optional): not supported, as in Apex. Default: None.
        verbose (bool, optional): log each overflow. Default: True.

    Attributes:
        optimizer: the wrapped optimizer.
        fp16_groups (list of list of Tensor): the model's params, per group.
        fp32_groups (list of list of Tensor): their fp32 masters, per group.
        cur_scale (float): the loss scale.
        cur_iter (int): the steps taken or skipped.

    Raises:
        TypeError: the optimizer's ``step`` does not take Apex's contrib arguments.
        ValueError: ``dynamic_loss_args`` is given.

    Example::

        >>> model = model.half()
        >>> optimizer = FP16_Optimizer(FusedAdam(model.parameters(), lr=1e-3),
        ...                            dynamic_loss_scale=True)
        >>> optimizer.backward(loss)
        >>> optimizer.step()
        >>> optimizer.zero_grad()
    """

    def __init__(self, init_optimizer: Any, static_loss_scale: float = 1.0,
                 dynamic_loss_scale: bool = False, dynamic_loss_args: dict | None = None,
                 verbose: bool = True) -> None:
        if not _takes_protocol(getattr(init_optimizer, "step", None)):
            raise TypeError(
                f"apex.contrib.optimizers.FP16_Optimizer wraps an optimizer whose step() takes "
                f"grads=, output_params=, scale= and grad_norms= (apex.contrib.optimizers."
                f"FusedAdam); got {type(init_optimizer).__name__}. For any other optimizer use "
                "apex.fp16_utils.FP16_Optimizer")
        if dynamic_loss_args is not None:
            raise ValueError("apex.contrib.optimizers.FP16_Optimizer does not take "
                             "dynamic_loss_args (nor did Apex's); apex.fp16_utils.FP16_Optimizer "
                             "does")
        self.optimizer = init_optimizer
        self.fp16_groups: list[list[Tensor]] = []
        self.fp32_groups: list[list[Tensor]] = []
        for group in init_optimizer.param_groups:
            halves = list(group["params"])
            masters = [p.detach().clone().float() for p in halves]
            self.fp16_groups.append(halves)
            self.fp32_groups.append(masters)
            group["params"] = masters
        self.dynamic_loss_scale = bool(dynamic_loss_scale)
        self.cur_iter = 0
        if self.dynamic_loss_scale:
            self.cur_scale: float = 2.0 ** 16
            self.last_overflow_iter = -1
            self.scale_factor = 2.0
            self.scale_window = 1000
        else:
            self.cur_scale = static_loss_scale
        self.verbose = verbose
        self.overflow = False

    # -------------------------------------------------------------- the optimizer's face

    @property
    def state(self) -> Any:
        """The wrapped optimizer's ``state`` (settable)."""
        return self.optimizer.state

    @state.setter
    def state(self, value: Any) -> None:
        self.optimizer.state = value

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The wrapped optimizer's param groups, whose params are the fp32 masters (settable)."""
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self.optimizer.param_groups = value

    def zero_grad(self, set_grads_to_None: bool = True) -> None:  # noqa: N803 - Apex's name
        """Clear the half params' grads: to None by default, as Apex's did.

        Args:
            set_grads_to_None (bool, optional): else zero them in place. Default: True.
        """
        for group in self.fp16_groups:
            for p in group:
                if set_grads_to_None:
                    p.grad = None
                elif p.grad is not None:
                    p.grad.detach_()
                    p.grad.zero_()

    def backward(self, loss: Tensor) -> None:
        """Backpropagate ``loss.float() * cur_scale`` into the half params' grads.

        Args:
            loss (Tensor): the loss.
        """
        (loss.float() * self.cur_scale).backward()

    def step(self, closure: None = None) -> None:
        """Check the half grads, then step the wrapped optimizer from them, or skip on overflow.

        Args:
            closure (None, optional): not supported, as in Apex.

        Raises:
            TypeError: a closure is given.
        """
        if closure is not None:
            raise TypeError("apex.contrib.optimizers.FP16_Optimizer.step() takes no closure (nor "
                            "did Apex's)")
        grads = [[p.grad for p in group] for group in self.fp16_groups]
        norms: list[Tensor] = []
        skip = False
        for group_grads in grads:
            present = [g for g in group_grads if g is not None]
            if not present:
                continue
            flag = torch.zeros(1, dtype=torch.int32, device=present[0].device)
            norm, _ = multi_tensor_l2norm(2048 * 32, flag, [present], True)
            norms.append(norm)
            if flag.item() != 0:
                skip = True
        self.overflow = skip
        if not skip:
            self.optimizer.step(grads=grads, output_params=self.fp16_groups, scale=self.cur_scale,
                                grad_norms=norms)
        self._update_scale(skip)

    def _update_scale(self, skip: bool) -> None:
        if self.dynamic_loss_scale:
            if skip:
                if self.verbose:
                    logger.info("FP16_Optimizer: grad overflow on iteration %d with loss scale %s",
                                self.cur_iter, self.cur_scale)
                self.cur_scale = max(self.cur_scale / self.scale_factor, 1)
                self.last_overflow_iter = self.cur_iter
            elif (self.cur_iter - self.last_overflow_iter) % self.scale_window == 0:
                self.cur_scale *= self.scale_factor
        elif skip:
            logger.info("FP16_Optimizer: grad overflow on iteration %d with static loss scale %s",
                        self.cur_iter, self.cur_scale)
        self.cur_iter += 1

    # -------------------------------------------------------------- checkpoints

    def state_dict(self) -> dict[str, Any]:
        """The scaler's state, the wrapped optimizer's ``state_dict`` and the fp32 masters.

        Example::

            >>> torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, f)
        """
        state: dict[str, Any] = {"dynamic_loss_scale": self.dynamic_loss_scale,
                                 "cur_scale": self.cur_scale, "cur_iter": self.cur_iter}
        if self.dynamic_loss_scale:
            state.update(last_overflow_iter=self.last_overflow_iter,
                         scale_factor=self.scale_factor, scale_window=self.scale_window)
        state["optimizer_state_dict"] = self.optimizer.state_dict()
        state["fp32_groups"] = self.fp32_groups
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` saved; the masters get the saved values (exact resume).

        Args:
            state_dict (dict): from :meth:`state_dict`.

        Raises:
            KeyError: a key :meth:`state_dict` writes is missing.
        """
        self.dynamic_loss_scale = state_dict["dynamic_loss_scale"]
        self.cur_scale = state_dict["cur_scale"]
        self.cur_iter = state_dict["cur_iter"]
        if self.dynamic_loss_scale:
            self.last_overflow_iter = state_dict["last_overflow_iter"]
            self.scale_factor = state_dict["scale_factor"]
            self.scale_window = state_dict["scale_window"]
        self.optimizer.load_state_dict(state_dict["optimizer_state_dict"])
        for current, saved in zip(self.fp32_groups, state_dict["fp32_groups"]):
            for mine, theirs in zip(current, saved):
                with torch.no_grad():
                    mine.copy_(theirs)


def _per_group(values: Any, groups: int) -> list[Any]:
    """Apex's reading of ``grads`` / ``output_params``: None, one group's list, or per group."""
    if values is None:
        return [None] * groups
    if isinstance(values, types.GeneratorType):
        return [list(values)]
    values = list(values)
    if values and not isinstance(values[0], list):
        return [values]
    return values


class FusedAdam(torch.optim.Optimizer):
    """Apex's ``apex.contrib.optimizers.FusedAdam`` (the 2019 one), on the served fused_adam_cuda.

    Adam with L2 weight decay added to the update, the bias corrections
    folded into the step size, and eps inside or outside the square root,
    as :mod:`amp_patch.apex_compat.fused_adam_cuda` computes it, bit for bit;
    every param is updated in place, one call per param (``use_mt``: one per
    group).

    ``step(grads=, output_params=, scale=, grad_norms=)`` is the protocol of
    :class:`FP16_Optimizer`: the grads to use instead of ``p.grad`` (half
    grads of fp32 params), tensors that receive the updated params in their
    dtype, the scale to divide the grads by, and each group's grad norm (as
    given, so ``norm/scale`` is the true one) for ``max_grad_norm`` clipping:
    when ``(norm/scale + 1e-6)/max_grad_norm`` exceeds 1 the grads are also
    divided by it.

    Args:
        params (iterable): parameters or parameter groups.
        lr (float, optional): Default: 1e-3.
        bias_correction (bool, optional): Default: True.
        betas (tuple of float, optional): Default: (0.9, 0.999).
        eps (float, optional): Default: 1e-8.
        eps_inside_sqrt (bool, optional): eps inside the square root. Default: False.
        weight_decay (float, optional): Default: 0.
        max_grad_norm (float, optional): 0 turns clipping off. Default: 0.
        amsgrad (bool, optional): not supported, as in Apex. Default: False.
        use_mt (bool, optional): one multi-tensor call per group. Default: False.
        amp_scale_adjustment (float, optional): accepted (Apex's amp hook). Default: 1.0.

    Raises:
        RuntimeError: ``amsgrad=True``, or sparse grads.

    Example::

        >>> opt = FusedAdam(model.parameters(), lr=1e-3, betas=(0.9, 0.98))
        >>> loss.backward(); opt.step()
    """

    def __init__(self, params: Any, lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 eps_inside_sqrt: bool = False, weight_decay: float = 0.0,
                 max_grad_norm: float = 0.0, amsgrad: bool = False, use_mt: bool = False,
                 amp_scale_adjustment: float = 1.0) -> None:
        if amsgrad:
            raise RuntimeError("FusedAdam does not support the AMSGrad variant (nor did Apex's)")
        defaults = dict(lr=lr, bias_correction=bias_correction, betas=betas, eps=eps,
                        weight_decay=weight_decay, max_grad_norm=max_grad_norm)
        super().__init__(params, defaults)
        self.eps_mode = 0 if eps_inside_sqrt else 1
        self.use_mt = bool(use_mt)
        self._amp_scale_adjustment = amp_scale_adjustment

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None, grads: Any = None,
             output_params: Any = None, scale: float = 1.0, grad_norms: Any = None) -> Any:
        """One step; see the class for the protocol's arguments.

        Args:
            closure (callable, optional): re-evaluates the model and returns the loss.
            grads (list, optional): per group (or one group's flat list), the grads to use.
            output_params (list, optional): likewise, tensors receiving the updated params.
            scale (float, optional): the grads are divided by it. Default: 1.
            grad_norms (list, optional): per group, the norm of its grads as given.

        Returns:
            The closure's loss, or None.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        n = len(self.param_groups)
        norms = list(grad_norms) if grad_norms is not None else [None] * n
        for group, group_grads, group_outs, norm in zip(
                self.param_groups, _per_group(grads, n), _per_group(output_params, n), norms):
            combined_scale = scale
            max_norm = group["max_grad_norm"]
            if max_norm > 0 and norm is not None:
                clip = ((float(norm) / scale) + _CLIP_EPS) / max_norm
                if clip > 1:
                    combined_scale = clip * scale
            self._step_group(group, group_grads, group_outs, combined_scale)
        return loss

    def _step_group(self, group: dict[str, Any], grads: list | None, outs: list | None,
                    combined_scale: float) -> None:
        params = group["params"]
        grads = grads if grads is not None else [None] * len(params)
        outs = outs if outs is not None else [None] * len(params)
        beta1, beta2 = group["betas"]
        bias_correction = 1 if group["bias_correction"] else 0
        rows: list[list[Tensor]] = []
        step = 0
        for p, grad, out in zip(params, grads, outs):
            if p.grad is None and grad is None:
                continue
            grad = p.grad if grad is None else grad
            if grad.is_sparse:
                raise RuntimeError("FusedAdam does not support sparse gradients; use "
                                   "torch.optim.SparseAdam")
            state = self.state[p]
            if len(state) == 0:
                state["step"] = 0
                state["exp_avg"] = torch.zeros_like(p)
                state["exp_avg_sq"] = torch.zeros_like(p)
            state["step"] += 1
            step = state["step"]
            if self.use_mt:
                rows.append([p, state["exp_avg"], state["exp_avg_sq"], grad]
                            + ([out] if out is not None else []))
                continue
            fused_adam_cuda.adam(p, out if out is not None else torch.empty(0), state["exp_avg"],
                                 state["exp_avg_sq"], grad, group["lr"], beta1, beta2,
                                 group["eps"], combined_scale, step, self.eps_mode,
                                 bias_correction, group["weight_decay"])
        if rows:
            if len({len(r) for r in rows}) > 1:
                raise RuntimeError("FusedAdam(use_mt=True): output_params must be given for every "
                                   "param of a group or for none")
            fused_adam_cuda.adam_mt(2048 * 32, torch.zeros(1, dtype=torch.int32),
                                    [list(t) for t in zip(*rows)], group["lr"], beta1, beta2,
                                    group["eps"], combined_scale, step, self.eps_mode,
                                    bias_correction, group["weight_decay"])
