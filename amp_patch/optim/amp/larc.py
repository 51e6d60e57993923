"""LARC: layer-wise adaptive rate clipping or scaling around any optimizer (``apex.parallel.LARC``).

LARC (You et al., https://arxiv.org/abs/1708.03888) gives every parameter a
local learning rate from the ratio of its weight norm to its gradient norm.
Apex applied it by rescaling each gradient before the wrapped optimizer's
``step()``, so that it works around any optimizer; this class does the same,
with Apex's constructor and math, and without a host sync per parameter (the
"norm is zero" test is a tensor ``where``, not a Python ``if``).

:func:`amp_patch.initialize` accepts a LARC at every level. Under O2 the
wrapped optimizer's ``param_groups`` hold the fp32 masters, so the trust
ratio is computed on the masters and their unscaled grads, as in Apex.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

__all__ = ["LARC"]


class LARC:
    """Wrap ``optimizer`` so that each parameter's step uses a trust-ratio learning rate.

    Before the wrapped ``step()``, for every parameter ``p`` with a gradient,
    and ``wd`` its group's weight decay (taken over from the optimizer, whose
    own weight decay is set to 0 for the step and restored after)::

        local_lr = trust_coefficient * ||p|| / (||grad|| + ||p|| * wd + eps)
        clip:    factor = min(local_lr / lr, 1)   # the step uses min(local_lr, lr)
        scale:   factor = local_lr                # the step uses local_lr * lr
        grad = (grad + wd * p) * factor

    A parameter whose weight norm or gradient norm is zero keeps its gradient
    as it is (and gets no weight decay), as in Apex.

    Args:
        optimizer (torch.optim.Optimizer): the optimizer to wrap.
        trust_coefficient (float, optional): the trust coefficient. Default: 0.02.
        clip (bool, optional): clip (True) or scale (False) the learning rate.
            Default: True.
        eps (float, optional): added to the denominator. Default: 1e-8.

    Attributes:
        optim (torch.optim.Optimizer): the wrapped optimizer.

    Example::

        >>> optimizer = LARC(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
        >>> model, optimizer = amp.initialize(model, optimizer, opt_level="O2")
        >>> loss = loss_fn(model(x), y)
        >>> with amp.scale_loss(loss, optimizer) as scaled_loss:
        ...     scaled_loss.backward()
        >>> optimizer.step()
    """

    def __init__(self, optimizer: torch.optim.Optimizer, trust_coefficient: float = 0.02,
                 clip: bool = True, eps: float = 1e-8) -> None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"LARC wraps a torch.optim.Optimizer, got {type(optimizer).__name__}")
        self.optim = optimizer
        self.trust_coefficient = trust_coefficient
        self.eps = eps
        self.clip = clip

    def __getstate__(self) -> dict:
        return self.optim.__getstate__()

    def __setstate__(self, state: dict) -> None:
        self.optim.__setstate__(state)

    def __repr__(self) -> str:
        return self.optim.__repr__()

    @property
    def state(self) -> dict:
        """The wrapped optimizer's state."""
        return self.optim.state

    @property
    def param_groups(self) -> list[dict]:
        """The wrapped optimizer's param groups (settable)."""
        return self.optim.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict]) -> None:
        self.optim.param_groups = value

    def state_dict(self) -> dict:
        """The wrapped optimizer's state dict."""
        return self.optim.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        """Load the wrapped optimizer's state dict."""
        self.optim.load_state_dict(state_dict)

    def register_state_dict_post_hook(self, hook: Callable, prepend: bool = False) -> Any:
        """Register ``hook`` on the wrapped optimizer (as amp's checkpoint of the masters does)."""
        return self.optim.register_state_dict_post_hook(hook, prepend=prepend)

    def register_load_state_dict_pre_hook(self, hook: Callable, prepend: bool = False) -> Any:
        """Register ``hook`` on the wrapped optimizer (as amp's checkpoint of the masters does)."""
        return self.optim.register_load_state_dict_pre_hook(hook, prepend=prepend)

    def register_load_state_dict_post_hook(self, hook: Callable, prepend: bool = False) -> Any:
        """Register ``hook`` on the wrapped optimizer (as amp's checkpoint of the masters does)."""
        return self.optim.register_load_state_dict_post_hook(hook, prepend=prepend)

    def zero_grad(self, set_to_none: bool | None = None) -> None:
        """Clear the wrapped optimizer's grads: by its own default (as Apex's LARC, which took no
        argument), or to None or to zero as ``set_to_none`` says."""
        if set_to_none is None:
            self.optim.zero_grad()
        else:
            self.optim.zero_grad(set_to_none=set_to_none)

    def add_param_group(self, param_group: dict) -> None:
        """Add a param group to the wrapped optimizer."""
        self.optim.add_param_group(param_group)

    def step(self, closure: Callable | None = None) -> Any:
        """Rescale every gradient by its trust ratio, then step the wrapped optimizer.

        Args:
            closure (callable, optional): passed to the wrapped optimizer's ``step``.
        """
        weight_decays = [group.get("weight_decay", 0) for group in self.optim.param_groups]
        with torch.no_grad():
            for group, weight_decay in zip(self.optim.param_groups, weight_decays):
                group["weight_decay"] = 0
                for p in group["params"]:
                    if p.grad is not None:
                        self._rescale(p, p.grad, weight_decay, group["lr"])
        try:
            return self.optim.step() if closure is None else self.optim.step(closure)
        finally:
            for group, weight_decay in zip(self.optim.param_groups, weight_decays):
                group["weight_decay"] = weight_decay

    def _rescale(self, p: torch.Tensor, grad: torch.Tensor, weight_decay: float, lr: float) -> None:
        param_norm = torch.norm(p)
        grad_norm = torch.norm(grad)
        local_lr = self.trust_coefficient * param_norm / (
            grad_norm + param_norm * weight_decay + self.eps)
        if self.clip:
            local_lr = torch.clamp(local_lr / lr, max=1)
        new = grad if weight_decay == 0 else grad + weight_decay * p
        applies = (param_norm != 0) & (grad_norm != 0)
        grad.copy_(torch.where(applies, new * local_lr, grad))
