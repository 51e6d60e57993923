"""Half compute on the CPU: is it native on this host, and emulating it where it is not.

Many CPUs have no native half matmul: on an AVX2-only host a bf16 matmul runs
tens of times slower than an fp32 one, and fp16 is as slow on any CPU without
avx512_fp16 or AMX-FP16. Elementwise ops and norms stay fast in half there.

- :func:`cpu_half_support` says, per half dtype, whether CPU matmul and
  convolution are native. It asks oneDNN (the library behind torch's CPU
  matmuls and convolutions) and confirms a yes with a tiny timed probe. The
  answer is cached for the process.
- Under emulation (the session property ``cpu_half_compute``), the
  matmul-class ops that would run in half on the CPU compute on fp32 copies
  of their half inputs, and the output is rounded to half. Storage, rounding
  points and the dtypes of outputs, grads and params stay those of native
  half; autograd through the casts runs backward in fp32 too. The emulating
  wrappers are one more patch set on ``torch``, ``torch.nn.functional`` and
  ``torch.Tensor``, recorded by a :class:`~amp_patch.patching.patcher.Patcher`,
  so :func:`amp_patch.deinitialize` restores the very same objects.

:func:`install` is what :func:`amp_patch.initialize` calls, before the O1
patches, so that O1's wrappers (cast to half, then call the original they
captured) call the emulating wrappers.

The package is split by concept: :mod:`~amp_patch.patching.cpu_half.detect` (the
host's answer), :mod:`~amp_patch.patching.cpu_half.session_plan` (what a session does, and
:func:`install`) and :mod:`~amp_patch.patching.cpu_half.emulate` (the wrappers).
"""

from amp_patch.patching.cpu_half.detect import (
    ENV_VAR,
    FORCED_KIND_ENV,
    HOST_KINDS,
    PROBE_RATIO_LIMIT,
    CpuHalfSupport,
    DtypeSupport,
    cpu_half_support,
    override,
)
from amp_patch.patching.cpu_half.emulate import targets
from amp_patch.patching.cpu_half.session_plan import (
    CpuHalfPlan,
    banner,
    current_plan,
    install,
    plan,
)

__all__ = [
    "ENV_VAR",
    "HOST_KINDS",
    "FORCED_KIND_ENV",
    "PROBE_RATIO_LIMIT",
    "DtypeSupport",
    "CpuHalfSupport",
    "CpuHalfPlan",
    "cpu_half_support",
    "override",
    "plan",
    "current_plan",
    "banner",
    "install",
    "targets",
]
