"""amp_patch: Apex-style automatic mixed precision (O0-O3) for current PyTorch.

Use it as Apex's ``amp`` was used::

    import amp_patch as amp

    model, optimizer = amp.initialize(model, optimizer, opt_level="O2")
    with amp.scale_loss(loss, optimizer) as scaled_loss:
        scaled_loss.backward()
    optimizer.step()

Runs on CPU (bf16) and CUDA (fp16/bf16). :func:`deinitialize` undoes everything.
"""

# First: it refuses a torch older than the supported floor with a clear ImportError.
from amp_patch import (
    _native,  # noqa: F401
    ops,
)
from amp_patch.frontend.checkpoint import load_checkpoint, save_checkpoint
from amp_patch.frontend.clip import clip_grad_norm_
from amp_patch.frontend.fp8 import fp8_autocast, fp8_plan
from amp_patch.frontend.legacy_handle import init
from amp_patch.frontend.lifecycle import deinitialize, initialize, load_state_dict, state_dict
from amp_patch.frontend.loss_scaling import master_params, scale_loss
from amp_patch.ops.multi_tensor_apply import multi_tensor_applier
from amp_patch.patching import cpu_half
from amp_patch.patching.cpu_half import cpu_half_support
from amp_patch.patching.registry import (
    float_function,
    half_function,
    promote_function,
    register_float_function,
    register_half_function,
    register_promote_function,
)
from amp_patch.patching.state import disable_casts
from amp_patch.settings.fp8 import Fp8Recipe
from amp_patch.settings.properties import Properties

__version__ = "0.1.0"

__all__ = [
    # set-up and teardown
    "initialize",
    "deinitialize",
    "Properties",
    # checkpoints
    "state_dict",
    "load_state_dict",
    "save_checkpoint",
    "load_checkpoint",
    # training loop
    "scale_loss",
    "master_params",
    "clip_grad_norm_",
    # FP8
    "Fp8Recipe",
    "fp8_autocast",
    "fp8_plan",
    # O1 casting
    "disable_casts",
    "half_function",
    "float_function",
    "promote_function",
    "register_half_function",
    "register_float_function",
    "register_promote_function",
    # legacy handle API
    "init",
    # half compute on the CPU
    "cpu_half_support",
    "cpu_half",
    # kernels
    "ops",
    "multi_tensor_applier",
]
