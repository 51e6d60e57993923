"""Build script for the ``amp_patch._C`` kernel library.

The C++ CPU kernels are always built. The CUDA kernels are added when torch is a
CUDA build and a CUDA toolkit is found (``CUDA_HOME``); no GPU is needed to
compile them. ``AMP_PATCH_NO_EXT=1`` installs the pure-Python package, which
falls back to the reference ops in ``amp_patch/ops.py``.
"""

import glob
import os
import sys

from setuptools import setup

ROOT = os.path.dirname(os.path.abspath(__file__))


def _extensions():
    if os.environ.get("AMP_PATCH_NO_EXT", "0") == "1":
        return [], {}

    import torch
    from torch.utils import cpp_extension

    def rel(pattern):
        return sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, pattern)))

    # The per-ISA builds of the CPU loops link last and in increasing ISA order:
    # for an inline function that several objects emit, the linker keeps the
    # first copy, so baseline code never calls one compiled for AVX2/AVX-512
    # (see csrc/cpu/vec_loops.h).
    isa = [f"csrc/cpu/isa/{name}.cpp" for name in ("default", "avx2", "avx512")]
    sources = rel("csrc/*.cpp") + rel("csrc/cpu/*.cpp") + isa
    # No FMA contraction: the kernels must round a*x and b*y separately, as the
    # reference ops do, to be bit-identical with them.
    # No -std: torch's build helper picks the standard its headers need (C++20
    # from torch 2.14 on; an explicit -std=c++17 breaks that build).
    cxx_flags = ["-O3", "-fvisibility=hidden", "-ffp-contract=off"]
    link_flags = []
    # at::parallel_for is an inline template: with torch's OpenMP backend its
    # `#pragma omp parallel` is compiled into *our* objects, and without
    # -fopenmp it silently runs every kernel on one thread.
    if torch._C.has_openmp and sys.platform.startswith("linux"):
        cxx_flags.append("-fopenmp")
        link_flags.append("-fopenmp")
    extension = cpp_extension.CppExtension
    extra = {"cxx": cxx_flags}

    with_cuda = (
        torch.version.cuda is not None
        and cpp_extension.CUDA_HOME is not None
        and os.environ.get("AMP_PATCH_NO_CUDA", "0") != "1"
    )
    if with_cuda:
        sources += rel("csrc/cuda/*.cu")
        extension = cpp_extension.CUDAExtension
        # No --use_fast_math: it flushes fp32 denormals to zero, which the
        # reference ops keep. The kernels are memory-bound; it buys nothing.
        extra["nvcc"] = ["-O3", "-lineinfo"]
        cxx_flags.append("-DAMP_PATCH_WITH_CUDA")

    ext = extension(
        name="amp_patch._C",
        sources=sources,
        include_dirs=[os.path.join(ROOT, "csrc")],
        extra_compile_args=extra,
        extra_link_args=link_flags,
        py_limited_api=False,
    )
    build_ext = cpp_extension.BuildExtension.with_options(use_ninja=True)
    return [ext], {"build_ext": build_ext}


ext_modules, cmdclass = _extensions()
setup(ext_modules=ext_modules, cmdclass=cmdclass)
