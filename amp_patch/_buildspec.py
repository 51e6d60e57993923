"""How ``amp_patch._C`` is compiled: one definition for ``setup.py`` and the just-in-time build.

This module imports nothing from amp_patch and nothing heavy at import time, so that
``setup.py`` can load it by path without importing the package (whose ``__init__``
imports torch). Both builds call :func:`extension_spec` with the torch they build
against and get the same sources, flags and macros.

The build record (:func:`build_record`) is what a build writes beside the library
(``_C_build.json``) and what :mod:`amp_patch._native` compares with the running torch
before it loads a prebuilt ``_C``.
"""

from __future__ import annotations

import glob
import os
import sys
from dataclasses import dataclass

__all__ = ["ExtensionSpec", "extension_spec", "build_record", "BUILD_RECORD", "RECORD_KEYS"]

#: The file a build writes beside the compiled library.
BUILD_RECORD = "_C_build.json"

#: The entries of a build record that must equal the running torch's for a library to load.
RECORD_KEYS = ("torch", "torch_git", "cxx11_abi", "cuda", "python")

#: The per-ISA builds of the CPU loops, in the order they link (see :func:`extension_spec`).
ISA_SOURCES = ("default", "avx2", "avx512")


@dataclass(frozen=True)
class ExtensionSpec:
    """The sources and flags of one build of ``amp_patch._C``.

    Attributes:
        sources (tuple of str): absolute paths, in link order.
        include_dirs (tuple of str): absolute include directories.
        cxx_flags (tuple of str): flags for the C++ compiler.
        nvcc_flags (tuple of str): flags for nvcc (empty without CUDA).
        link_flags (tuple of str): flags for the linker.
        with_cuda (bool): whether the CUDA kernels are part of the build.
    """

    sources: tuple[str, ...]
    include_dirs: tuple[str, ...]
    cxx_flags: tuple[str, ...]
    nvcc_flags: tuple[str, ...] = ()
    link_flags: tuple[str, ...] = ()
    with_cuda: bool = False


def _sorted_glob(csrc_root: str, pattern: str) -> list[str]:
    return sorted(glob.glob(os.path.join(csrc_root, pattern)))


def extension_spec(torch, csrc_root: str, cuda_home: str | None) -> ExtensionSpec:
    """The sources and flags that build ``amp_patch._C`` against ``torch``.

    Args:
        torch (module): the imported torch the library is built for.
        csrc_root (str): the ``csrc`` directory (the repository's, or the copy the
            package ships as ``amp_patch/_csrc``).
        cuda_home (str or None): the CUDA toolkit (``torch.utils.cpp_extension.CUDA_HOME``);
            None builds the CPU kernels only.

    Returns:
        ExtensionSpec: absolute source paths, in link order.

    Raises:
        FileNotFoundError: ``csrc_root`` holds no ``init.cpp``.

    Example::

        >>> import torch
        >>> spec = extension_spec(torch, "csrc", None)
        >>> spec.sources[-1].endswith("avx512.cpp"), "-ffp-contract=off" in spec.cxx_flags
        (True, True)
    """
    csrc_root = os.path.abspath(csrc_root)
    if not os.path.isfile(os.path.join(csrc_root, "init.cpp")):
        raise FileNotFoundError(f"no amp_patch C++ sources in {csrc_root} (init.cpp is missing)")
    # The per-ISA builds of the CPU loops link last and in increasing ISA order:
    # for an inline function that several objects emit, the linker keeps the
    # first copy, so baseline code never calls one compiled for AVX2/AVX-512
    # (see csrc/cpu/vec_loops.h).
    isa = [os.path.join(csrc_root, "cpu", "isa", f"{name}.cpp") for name in ISA_SOURCES]
    sources = _sorted_glob(csrc_root, "*.cpp") + _sorted_glob(csrc_root, "cpu/*.cpp") + isa
    # No FMA contraction: the kernels must round a*x and b*y separately, as the
    # reference ops do, to be bit-identical with them.
    # No -std: torch's build helper picks the standard its headers need (C++20
    # from torch 2.14 on; an explicit -std=c++17 breaks that build).
    # -g0 overrides the -g that Python's own CFLAGS bring to a setuptools build:
    # debug info for the kernel tables took 60 % of the compile time and 2.7 GB
    # per compiler (a 117 MB library); no one steps through them in a debugger.
    cxx_flags = ["-O3", "-g0", "-fvisibility=hidden", "-ffp-contract=off"]
    link_flags: list[str] = []
    # at::parallel_for is an inline template: with torch's OpenMP backend its
    # `#pragma omp parallel` is compiled into *our* objects, and without
    # -fopenmp it silently runs every kernel on one thread.
    if torch._C.has_openmp and sys.platform.startswith("linux"):
        cxx_flags.append("-fopenmp")
        link_flags.append("-fopenmp")
    with_cuda = (
        torch.version.cuda is not None
        and cuda_home is not None
        and os.environ.get("AMP_PATCH_NO_CUDA", "0") != "1"
    )
    nvcc_flags: list[str] = []
    if with_cuda:
        sources += _sorted_glob(csrc_root, "cuda/*.cu")
        # No --use_fast_math: it flushes fp32 denormals to zero, which the
        # reference ops keep. The kernels are memory-bound; it buys nothing.
        nvcc_flags = ["-O3", "-lineinfo"]
        cxx_flags.append("-DAMP_PATCH_WITH_CUDA")
    return ExtensionSpec(
        sources=tuple(sources), include_dirs=(csrc_root,), cxx_flags=tuple(cxx_flags),
        nvcc_flags=tuple(nvcc_flags), link_flags=tuple(link_flags), with_cuda=with_cuda)


def build_record(torch, with_cuda: bool) -> dict:
    """What a build of ``amp_patch._C`` records about the torch it was compiled against.

    Args:
        torch (module): the imported torch.
        with_cuda (bool): whether the build holds the CUDA kernels.

    Returns:
        dict: ``torch`` (version), ``torch_git`` (commit), ``cxx11_abi``, ``cuda``
        (torch's CUDA version or None), ``python`` ("3.12"), ``with_cuda``.

    Example::

        >>> import torch
        >>> build_record(torch, False)["torch"] == torch.__version__
        True
    """
    return {
        "torch": str(torch.__version__),
        "torch_git": getattr(torch.version, "git_version", None),
        "cxx11_abi": bool(torch._C._GLIBCXX_USE_CXX11_ABI),
        "cuda": torch.version.cuda,
        "python": f"{sys.version_info[0]}.{sys.version_info[1]}",
        "with_cuda": bool(with_cuda),
    }
