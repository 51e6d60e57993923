"""The parts of ``apex.contrib`` that amp-era training scripts used, served by amp_patch.

``apex.contrib.optimizers`` (:mod:`.optimizers`: ``FP16_Optimizer`` and the
``FusedAdam`` it wrapped), ``apex.contrib.xentropy`` (:mod:`.xentropy`:
``SoftmaxCrossEntropyLoss``) and ``apex.contrib.clip_grad`` (:mod:`.clip_grad`).
The rest of ``apex.contrib`` (fused multi-head attention, fmha, groupbn,
bottleneck, sparsity, transducer, focal loss, the distributed optimizers, ...)
was a set of CUDA-only kernels for particular models; the import hook refuses
those with a warning naming what to use instead (docs/migration.md).
"""
