"""Optimizers: the fused ones amp_patch ships, and what amp does to any optimizer.

- :mod:`amp_patch.optim.fused`: Apex's fused optimizers (``FusedAdam``, ``FusedLAMB``, ...)
  on the multi-tensor kernels; users import them as :mod:`amp_patch.optimizers`.
- :mod:`amp_patch.optim.amp`: amp's hold on a user's optimizer: its record, fp32 (or bf16)
  masters, the patched ``step``/``zero_grad``, checkpoints, LARC.

The two do not import each other's internals: amp hands a fused optimizer its grads and
outputs through :class:`~amp_patch.optim.fused.FusedStepInputs`.
"""
