"""Fused multi-tensor ops behind loss scaling and master weights.

The ops are defined here, once, under the ``amp_patch`` namespace of
``torch.library``. Each has a pure-PyTorch reference body registered as
``CompositeExplicitAutograd``. The compiled library ``amp_patch._C`` registers
C++ kernels for ``CPU`` (and ``CUDA`` when built). Those take precedence over
the reference, so one name, ``torch.ops.amp_patch.<op>``, routes to the
fastest kernel available for the tensors' device.

All ops take lists of tensors that may mix dtypes (fp32, fp16, bf16, fp64) and
sizes. Arithmetic is done in fp32 ("opmath"), or in fp64 for a tensor (or a
pair) with an fp64 side, and rounded once to the output dtype. ``found_inf`` is
a one-element float tensor that an op sets to 1.0 when it sees an inf or NaN in
the checked input. An op never clears it. Scale arguments are one-element
tensors on the device, so no op syncs with the host. A tensor that an op writes
may share memory with no other tensor of the call, except that ``dst[i]`` may be
``src[i]`` itself.

.. note::
    Every tensor in one call must be on the same device as ``found_inf``.
    Callers group tensors by device first (for instance with
    :func:`amp_patch.helpers.tensors.group_by_device_and_dtype`).

The package is split by concept: :mod:`~amp_patch.ops.scaling_ops` (the ops
behind loss scaling and master weights), :mod:`~amp_patch.ops.optimizer_ops`
(the fused optimizer steps), :mod:`~amp_patch.ops.lean_state_ops` (the same steps over
block-scaled 8-bit or bf16 state and bf16 params) and :mod:`~amp_patch.ops._library` (the namespace,
the shared checks, loading the compiled kernels). docs/extending.md says how to
add an op.
"""

from amp_patch.ops import _library
from amp_patch.ops._library import has_native_kernel, native_extension_loaded
from amp_patch.ops.lean_state_ops import (
    multi_tensor_adam_lean_,
    multi_tensor_lamb_lean_stage1_,
    multi_tensor_lamb_lean_stage2_,
    multi_tensor_sgd_lean_,
)
from amp_patch.ops.optimizer_ops import (
    adam_bias_corrections,
    adam_device_step_,
    fp32_betas,
    multi_tensor_adagrad_,
    multi_tensor_adam_,
    multi_tensor_lamb_stage1_,
    multi_tensor_lamb_stage2_,
    multi_tensor_novograd_,
    multi_tensor_sgd_,
)
from amp_patch.ops.scaling_ops import (
    loss_scale_update_,
    multi_tensor_axpby_,
    multi_tensor_copy_,
    multi_tensor_l2norm,
    multi_tensor_unscale_,
    multi_tensor_unscale_copy_,
    multi_tensor_unscale_l2norm,
    update_scale_hysteresis,
)

__all__ = [
    # loss scaling and master weights
    "multi_tensor_unscale_",
    "multi_tensor_unscale_copy_",
    "multi_tensor_axpby_",
    "multi_tensor_l2norm",
    "multi_tensor_copy_",
    "multi_tensor_unscale_l2norm",
    "update_scale_hysteresis",
    "loss_scale_update_",
    # fused optimizer steps
    "multi_tensor_adam_",
    "adam_bias_corrections",
    "adam_device_step_",
    "fp32_betas",
    "multi_tensor_sgd_",
    "multi_tensor_adagrad_",
    "multi_tensor_novograd_",
    "multi_tensor_lamb_stage1_",
    "multi_tensor_lamb_stage2_",
    # fused optimizer steps over low-precision state
    "multi_tensor_adam_lean_",
    "multi_tensor_sgd_lean_",
    "multi_tensor_lamb_lean_stage1_",
    "multi_tensor_lamb_lean_stage2_",
    # the compiled kernels
    "has_native_kernel",
    "native_extension_loaded",
]

# Once every op is defined: the compiled kernels register under the same names.
_library.load_native()
