"""Fused optimizers with Apex's interfaces (served as ``apex.optimizers`` under ``amp-patch run``).

Each optimizer's step is one (LAMB: two) multi-tensor op call per param group
and device, from :mod:`amp_patch.ops`: every grad, param and state tensor is
read once and written once, on the CPU (vectorised, all threads) and on CUDA.
They are ``torch.optim.Optimizer`` subclasses, so :func:`amp_patch.initialize`,
LR schedulers and ``torch.amp.GradScaler`` work with them.

- :class:`FusedAdam`: Adam / AdamW (``adam_w_mode``), optional fp32 masters.
- :class:`FusedLAMB`: LAMB with global grad-norm clipping and the trust ratio.
- :class:`FusedMixedPrecisionLamb`: LAMB with fp32 masters for half params.
- :class:`FusedSGD`: SGD with momentum, Nesterov, weight decay before or after.
- :class:`FusedNovoGrad`: NovoGrad, per-tensor second moments.
- :class:`FusedAdagrad`: Adagrad.
- :class:`FusedStepInputs`: redirects a step's grads and outputs (amp's one-pass O2).
"""

from amp_patch.optim.fused._base import FusedOptimizer, FusedStepInputs
from amp_patch.optim.fused.adagrad import FusedAdagrad
from amp_patch.optim.fused.adam import FusedAdam
from amp_patch.optim.fused.lamb import FusedLAMB, FusedMixedPrecisionLamb
from amp_patch.optim.fused.novograd import FusedNovoGrad
from amp_patch.optim.fused.sgd import FusedSGD

__all__ = [
    "FusedAdam",
    "FusedLAMB",
    "FusedMixedPrecisionLamb",
    "FusedSGD",
    "FusedNovoGrad",
    "FusedAdagrad",
    "FusedStepInputs",
    "FusedOptimizer",
]
