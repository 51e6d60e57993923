"""State-dict hooks: the optimizer's checkpoint carries its fp32 masters.

``optimizer.state_dict()`` gains ``"amp_master_params"``: the fp32 masters, by
the same flat index as ``state``. ``optimizer.load_state_dict()`` restores
them, so training resumes bit-exactly; a checkpoint without them (saved at
another opt level) restarts the masters from the model, which should be
loaded first.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from amp_patch.optim.masters import MasterWeights

__all__ = ["MASTERS_KEY", "install_optimizer_hooks"]

#: The key of the fp32 masters in an O2 optimizer's state dict.
MASTERS_KEY = "amp_master_params"


def install_optimizer_hooks(optimizer: torch.optim.Optimizer, masters: MasterWeights,
                            before_save: Callable[[], None]) -> list[Any]:
    """Register the hooks that save and load ``masters`` with ``optimizer``'s state dict.

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

    def save(opt, state_dict: dict) -> dict:
        before_save()
        flat = _flat_params(opt)
        state_dict[MASTERS_KEY] = {i: p for i, p in enumerate(flat) if masters.is_master(p)}
        return state_dict

    @torch.no_grad()
    def load(opt, state_dict: dict) -> dict:
        state_dict = dict(state_dict)
        saved = state_dict.pop(MASTERS_KEY, None)
        flat = _flat_params(opt)
        if saved is None:
            for model_p, master in masters.pairs(flat):
                master.copy_(model_p)
            return state_dict
        for i, value in saved.items():
            if not (0 <= int(i) < len(flat)) or not masters.is_master(flat[int(i)]):
                raise ValueError(
                    f"the checkpoint has an fp32 master for parameter {i}, which is not a half "
                    "parameter of this optimizer; was it saved with the same model and opt level?"
                )
            master = flat[int(i)]
            if master.shape != value.shape:
                raise ValueError(
                    f"master weight {i}: checkpoint shape {tuple(value.shape)} differs from "
                    f"{tuple(master.shape)}"
                )
            master.copy_(value)
        return state_dict

    return [optimizer.register_state_dict_post_hook(save),
            optimizer.register_load_state_dict_pre_hook(load)]


def _flat_params(optimizer: torch.optim.Optimizer) -> list:
    return [p for group in optimizer.param_groups for p in group["params"]]
