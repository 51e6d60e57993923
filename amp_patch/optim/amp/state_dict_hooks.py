"""State-dict hooks: the optimizer's checkpoint carries its fp32 masters.

``optimizer.state_dict()`` gains ``"amp_master_params"``: the fp32 masters, by
the same flat index as ``state``. ``optimizer.load_state_dict()`` restores
them, so training resumes bit-exactly; a checkpoint without them (saved at
another opt level) restarts the masters from the model, which should be
loaded first.

Each saved param group also names its masters, by position in the group
(:data:`GROUP_MASTERS_KEY`; the same tensors, which ``torch.save`` stores
once). A plain optimizer that loads the checkpoint before
:func:`amp_patch.initialize` drops the top-level key but keeps its groups'
keys, so :meth:`MasterWeights.attach` can make the masters of a model loaded
before ``initialize`` from the checkpoint's exact fp32 values rather than from
the half params the cast rounded them to (Apex's
``test_checkpointing.test_restoring`` with ``amp.initialize`` after the loads).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import Tensor

from amp_patch.optim.amp.master_weights import GROUP_MASTERS_KEY, MasterWeights

__all__ = ["MASTERS_KEY", "GROUP_MASTERS_KEY", "install_optimizer_hooks"]

#: The key of the fp32 masters in an O2 optimizer's state dict.
MASTERS_KEY = "amp_master_params"



def install_optimizer_hooks(optimizer: torch.optim.Optimizer, masters: MasterWeights,
                            before_save: Callable[[], None]) -> list[Any]:
    """Register the hooks that save and load ``masters`` with ``optimizer``'s state dict.

    A load checks every saved master (which parameters have one, their shapes
    and dtypes) before the optimizer's own checks, and copies them only after
    ``Optimizer.load_state_dict`` has succeeded: a load that raises leaves the
    masters, the model and the optimizer state as they were.

    Args:
        optimizer (torch.optim.Optimizer): the optimizer stepping the masters.
        masters (MasterWeights): its masters.
        before_save (callable): run before the masters are saved (it refreshes
            masters whose model params were written from outside).

    Returns:
        list: the hook handles; ``handle.remove()`` undoes each.

    Example::

        >>> handles = install_optimizer_hooks(opt, masters, refresh)
        >>> "amp_master_params" in opt.state_dict()
        True
    """
    hooks = _MasterHooks(masters, before_save)
    return [optimizer.register_state_dict_post_hook(hooks.save),
            optimizer.register_load_state_dict_pre_hook(hooks.check),
            optimizer.register_load_state_dict_post_hook(hooks.copy)]


class _MasterHooks:
    """The state-dict hooks of one optimizer's masters, and the copies a load has checked."""

    def __init__(self, masters: MasterWeights, before_save: Callable[[], None]) -> None:
        self.masters = masters
        self.before_save = before_save
        # (master, value) pairs checked by the pre-hook, copied by the post-hook; a load that
        # fails in between leaves them here until the next load replaces them.
        self._pending: list[tuple[Tensor, Tensor]] = []

    def save(self, opt: torch.optim.Optimizer, state_dict: dict) -> dict:
        self.before_save()
        flat = _flat_params(opt)
        state_dict[MASTERS_KEY] = {i: p for i, p in enumerate(flat) if self.masters.is_master(p)}
        for group in state_dict["param_groups"]:
            group[GROUP_MASTERS_KEY] = [flat[i] if self.masters.is_master(flat[i]) else None
                                        for i in group["params"]]
        return state_dict

    def check(self, opt: torch.optim.Optimizer, state_dict: dict) -> dict:
        self._pending = []
        state_dict = dict(state_dict)
        saved = state_dict.pop(MASTERS_KEY, None)
        # The masters are loaded below; the group copies would stay in the live groups.
        state_dict["param_groups"] = [{k: v for k, v in g.items() if k != GROUP_MASTERS_KEY}
                                      for g in state_dict["param_groups"]]
        flat = _flat_params(opt)
        if saved is None:
            self._pending = [(master, model_p) for model_p, master in self.masters.pairs(flat)]
            return state_dict
        expected = [i for i, p in enumerate(flat) if self.masters.is_master(p)]
        found = sorted(int(i) for i in saved)
        if found != expected:
            raise ValueError(
                f"the checkpoint holds fp32 masters for parameters {found}; expected {expected} "
                "(the flat indices of this optimizer's half parameters); was it saved with the "
                "same model, param groups and opt level?")
        pending = []
        for i, value in saved.items():
            master = flat[int(i)]
            if not isinstance(value, Tensor) or value.shape != master.shape \
                    or value.dtype != master.dtype:
                got = (f"a {value.dtype} tensor of shape {tuple(value.shape)}"
                       if isinstance(value, Tensor) else type(value).__name__)
                raise ValueError(f"master weight {i} of the checkpoint: {got}; expected "
                                 f"{master.dtype} of shape {tuple(master.shape)}")
            pending.append((master, value))
        self._pending = pending
        return state_dict

    @torch.no_grad()
    def copy(self, opt: torch.optim.Optimizer) -> None:
        pending, self._pending = self._pending, []
        for master, value in pending:
            master.copy_(value)


def _flat_params(optimizer: torch.optim.Optimizer) -> list:
    return [p for group in optimizer.param_groups for p in group["params"]]
