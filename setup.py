"""Build script of amp_patch.

By default (``pip install .``, with pip's build isolation) this installs the
Python package and ships the C++/CUDA sources inside it as ``amp_patch/_csrc``.
No torch is needed to build: the kernels are compiled on first use, just in
time, against the torch that imports amp_patch (see ``amp_patch/_native.py``
and docs/install.md).

``AMP_PATCH_BUILD_EXT=1`` also compiles ``amp_patch._C`` at install time,
against the torch of the build environment, so it needs
``--no-build-isolation`` (``make install`` does this). The C++ CPU kernels are
always built; the CUDA kernels are added when torch is a CUDA build and a CUDA
toolkit is found (``CUDA_HOME``); no GPU is needed to compile them. The build
writes ``amp_patch/_C_build.json`` beside the library: the torch version, C++
ABI and CUDA version it was compiled against, which the import checks.

The sources and flags are defined once, in ``amp_patch/_buildspec.py``, for
this script and for the just-in-time build.
"""

import importlib.util
import json
import os
import shutil
import sys

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = os.path.dirname(os.path.abspath(__file__))


def _load_buildspec():
    # By path: importing the amp_patch package would import torch.
    path = os.path.join(ROOT, "amp_patch", "_buildspec.py")
    spec = importlib.util.spec_from_file_location("_amp_patch_buildspec", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


buildspec = _load_buildspec()


class BuildPyWithSources(build_py):
    """Copies ``csrc/`` into the built package as ``amp_patch/_csrc``, for the JIT build."""

    def run(self):
        super().run()
        if getattr(self, "editable_mode", False):
            return  # an editable install reads csrc/ from the checkout itself
        target = os.path.join(self.build_lib, "amp_patch", "_csrc")
        if os.path.isdir(target):
            shutil.rmtree(target)
        shutil.copytree(os.path.join(ROOT, "csrc"), target)


def _want_extension():
    if os.environ.get("AMP_PATCH_NO_EXT", "0") == "1":
        return False
    return os.environ.get("AMP_PATCH_BUILD_EXT", "0") == "1"


def _extensions():
    if not _want_extension():
        return [], {}
    try:
        import torch
        from torch.utils import cpp_extension
    except ImportError as exc:
        raise SystemExit(
            "AMP_PATCH_BUILD_EXT=1 compiles amp_patch._C against the installed torch, "
            f"but torch does not import here ({exc}). Install torch first and build with "
            "`pip install --no-build-isolation .`, or leave AMP_PATCH_BUILD_EXT unset: the "
            "kernels are then compiled on first use.") from exc

    spec = buildspec.extension_spec(torch, os.path.join(ROOT, "csrc"), cpp_extension.CUDA_HOME)
    sources = [os.path.relpath(p, ROOT) for p in spec.sources]
    extra = {"cxx": list(spec.cxx_flags)}
    extension = cpp_extension.CppExtension
    if spec.with_cuda:
        extension = cpp_extension.CUDAExtension
        extra["nvcc"] = list(spec.nvcc_flags)
    ext = extension(
        name="amp_patch._C",
        sources=sources,
        include_dirs=list(spec.include_dirs),
        extra_compile_args=extra,
        extra_link_args=list(spec.link_flags),
        py_limited_api=False,
    )
    record = buildspec.build_record(torch, spec.with_cuda)

    base = cpp_extension.BuildExtension.with_options(use_ninja=True)

    class BuildExtensionWithRecord(base):
        """Links the objects in the spec's order, and writes the build record beside the library."""

        def _record_path(self, ext):
            return os.path.join(os.path.dirname(self.get_ext_fullpath(ext.name)),
                                buildspec.BUILD_RECORD)

        def build_extension(self, ext):
            # distutils compiles (and so links) the sources sorted by name, which would put
            # the per-ISA objects first, avx2 before default; the link order matters for them
            # (see amp_patch/_buildspec.py), so the link gets the objects in the spec's order.
            order = {os.path.splitext(src)[0]: i for i, src in enumerate(ext.sources)}
            link = self.compiler.link_shared_object

            def rank(obj):
                rel = os.path.splitext(os.path.relpath(obj, self.build_temp))[0]
                return order.get(rel, len(order))

            def link_in_order(objects, *args, **kwargs):
                return link(sorted(objects, key=rank), *args, **kwargs)

            self.compiler.link_shared_object = link_in_order
            try:
                super().build_extension(ext)
            finally:
                self.compiler.link_shared_object = link
            path = self._record_path(ext)
            with open(path, "w") as f:
                json.dump(record, f, indent=1, sort_keys=True)
            self._written = getattr(self, "_written", []) + [(ext, path)]

        def run(self):
            super().run()
            if not self.inplace:
                return
            # An in-place (editable) build compiles into the build directory and copies the
            # library into the package; the record goes with it.
            build_py = self.get_finalized_command("build_py")
            for ext, path in getattr(self, "_written", []):
                package = build_py.get_package_dir(ext.name.rpartition(".")[0])
                target = os.path.join(os.path.abspath(package), buildspec.BUILD_RECORD)
                shutil.copyfile(path, target)

        def get_outputs(self):
            return super().get_outputs() + [self._record_path(e) for e in self.extensions]

    return [ext], {"build_ext": BuildExtensionWithRecord}


ext_modules, cmdclass = _extensions()
cmdclass["build_py"] = BuildPyWithSources
setup(ext_modules=ext_modules, cmdclass=cmdclass)
