"""Optimizer processing: fp32 master weights, the patched methods, step skipping, checkpoints.

:func:`process` turns an optimizer into an amp one and returns the
:class:`OptimizerRecord` that holds everything about it. The package is split
by concept:

- :mod:`~amp_patch.optim.amp.master_weights`: with master weights, every half
  (fp16/bf16) parameter in ``param_groups`` is replaced by an fp32 master made
  at once (so ``step()`` before any backward works). fp32 parameters stay and
  are stepped directly, so the optimizer makes its state in fp32. After each
  step the masters are copied into the model in one fused
  ``multi_tensor_copy_`` per (device, dtype), and the master grads are
  released, as Apex did: ``model.zero_grad()`` cannot reach them.
- :mod:`~amp_patch.optim.amp.patched_methods`: ``step`` (and skipping it),
  ``zero_grad`` and ``add_param_group``, wrapped on the instance so that an
  ``lr_scheduler`` made before or after initialize keeps working.
- :mod:`~amp_patch.optim.amp.state_dict_hooks`: ``optimizer.state_dict()`` carries the
  fp32 masters, and ``load_state_dict`` restores them, so training resumes
  bit-exactly.
- :mod:`~amp_patch.optim.amp.optimizer_record`: the record itself, and the grads' way
  through :func:`amp_patch.scale_loss`.

The package imports neither the session nor the O1 patching: what it needs
from them (the undo registry, the context ``step()`` runs in) is handed to
:func:`process`.

After :meth:`OptimizerRecord.restore` (run by :func:`amp_patch.deinitialize`)
the optimizer again steps the model's own parameters: each master in
``param_groups`` is replaced by its model parameter, and the state kept for
the master moves to the parameter, cast to the parameter's dtype as
``Optimizer.load_state_dict`` would (``step`` counters unchanged). The model
keeps its current (half) values.
"""

import torch

from amp_patch.optim.amp.larc import LARC
from amp_patch.optim.amp.master_weights import MasterWeights
from amp_patch.optim.amp.optimizer_record import OptimizerRecord, process

__all__ = ["process", "OptimizerRecord", "MasterWeights", "OPTIMIZER_TYPES",
           "underlying_optimizer"]

#: What :func:`amp_patch.initialize` and :func:`amp_patch.scale_loss` take as an optimizer:
#: torch's, or Apex's LARC around one (as Apex accepted it).
OPTIMIZER_TYPES = (torch.optim.Optimizer, LARC)


def underlying_optimizer(optimizer) -> torch.optim.Optimizer:
    """The torch optimizer itself: the one a LARC wraps, else ``optimizer``."""
    return optimizer.optim if isinstance(optimizer, LARC) else optimizer
