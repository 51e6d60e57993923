"""Loading the compiled kernels, ``amp_patch._C``, for the torch that is running.

A compiled torch extension works only with the torch it was compiled against:
another torch release (or C++ ABI, or CUDA version) makes it fail to load
(undefined symbols) or, worse, load and misbehave. So:

1. A build of ``_C`` at install time (``AMP_PATCH_BUILD_EXT=1``, as ``make install``
   does) writes ``_C_build.json`` beside it: the torch version and commit, the C++
   ABI, the CUDA and Python versions (:func:`amp_patch._buildspec.build_record`).
   :func:`load` compares it with the running torch before importing the library.
2. When there is no prebuilt library, or it was built for another torch, or it
   fails to load, the kernels are compiled just in time for the running torch
   with :func:`torch.utils.cpp_extension.load`, from the sources the package
   ships (``amp_patch/_csrc``, or ``csrc/`` of a source checkout), with the flags
   of ``setup.py`` (:func:`amp_patch._buildspec.extension_spec`). The build is
   cached per torch version, commit, ABI, CUDA and Python version under
   :func:`cache_root`, so it happens once per torch; a file lock keeps several
   processes (ranks) from compiling at once, and progress is logged while it runs.
3. Without a compiler or ninja, or with ``AMP_PATCH_JIT=0``, the reference ops of
   :mod:`amp_patch.ops` serve instead, which are many times slower
   (docs/install.md has the numbers).

A stale or failing prebuilt library, and the start of a compile, are said once,
at WARNING level, with the fix. An install without a prebuilt library (plain
``pip install``) compiles on first use with that one warning, and then loads
from the cache silently.

Environment variables:

- ``AMP_PATCH_NO_EXT=1``: no compiled kernels at all (reference ops), silently.
- ``AMP_PATCH_JIT=0``: never compile at import; the reference ops serve when
  the prebuilt library is missing or does not match.
- ``AMP_PATCH_CACHE``: the cache directory (default ``$XDG_CACHE_HOME/amp_patch``,
  else ``~/.cache/amp_patch``).
- ``AMP_PATCH_NO_CUDA=1``: compile the CPU kernels only.
- ``MAX_JOBS``, ``CXX``, ``CUDA_HOME``, ``TORCH_CUDA_ARCH_LIST``: as for any torch extension.

Example::

    >>> from amp_patch import _native
    >>> _native.status().source in ("prebuilt", "jit", "reference")
    True
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.machinery
import importlib.util
import json
import logging
import os
import shutil
import sys
import threading
import time
import types
from dataclasses import dataclass
from typing import Iterator

import torch

from amp_patch import _buildspec

__all__ = ["NativeStatus", "load", "status", "module", "cache_root", "jit_build_dir",
           "sources_root"]

logger = logging.getLogger("amp_patch")

#: The oldest torch amp_patch supports: the oldest the test matrix passes on (docs/install.md).
MIN_TORCH = (2, 6)


def _torch_release(version: str) -> tuple[int, ...]:
    """``(2, 13)`` from ``"2.13.0+cpu"`` (or ``"2.10.0a0+git123"``)."""
    parts = []
    for piece in version.split("+")[0].split(".")[:2]:
        digits = "".join(c for c in piece if c.isdigit()) or "0"
        parts.append(int(digits))
    return tuple(parts)


if _torch_release(str(torch.__version__)) < MIN_TORCH:
    raise ImportError(
        f"amp_patch needs torch >= {'.'.join(map(str, MIN_TORCH))}, found {torch.__version__}: it "
        "relies on FSDP2's fully_shard, DTensor and Module.register_state_dict_post_hook, which "
        "older releases lack. Upgrade torch (pip install 'torch>=2.6'); docs/install.md lists "
        "the tested range.")

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))
#: The name the library is imported under, whichever way it was built.
MODULE_NAME = "amp_patch._C"
#: The seconds between two progress messages of a just-in-time build.
PROGRESS_EVERY_S = 20.0


@dataclass(frozen=True)
class NativeStatus:
    """Where the kernels come from in this process, and why.

    Attributes:
        source (str): ``"prebuilt"`` (``amp_patch._C`` as installed), ``"jit"``
            (compiled for this torch into the cache) or ``"reference"`` (no
            compiled kernels: the pure-PyTorch ops).
        reason (str): one line on why (what did not match, what was missing).
        path (str or None): the loaded library file.
        record (dict or None): the build record of the loaded library (or of the
            prebuilt one that was refused).

    Example::

        >>> NativeStatus("reference", "AMP_PATCH_NO_EXT=1").loaded
        False
    """

    source: str
    reason: str
    path: str | None = None
    record: dict | None = None

    @property
    def loaded(self) -> bool:
        """Whether compiled kernels were loaded (prebuilt or just in time)."""
        return self.source != "reference"


_status: NativeStatus | None = None
_module: types.ModuleType | None = None


def cache_root() -> str:
    """The directory of just-in-time builds.

    ``$AMP_PATCH_CACHE``, else ``$XDG_CACHE_HOME/amp_patch``, else ``~/.cache/amp_patch``.

    Returns:
        str: an absolute path (not created here).

    Example::

        >>> cache_root().endswith("amp_patch") or "AMP_PATCH_CACHE" in os.environ
        True
    """
    explicit = os.environ.get("AMP_PATCH_CACHE")
    if explicit:
        return os.path.abspath(os.path.expanduser(explicit))
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(os.path.abspath(base), "amp_patch")


def sources_root() -> str | None:
    """The C++/CUDA sources a just-in-time build compiles, or None when there are none.

    An installed package ships them as ``amp_patch/_csrc``; a source checkout
    (an editable install) has them in ``csrc/`` beside the package.

    Returns:
        str or None: the directory that holds ``init.cpp``.
    """
    for candidate in (os.path.join(_PACKAGE_DIR, "_csrc"),
                      os.path.join(os.path.dirname(_PACKAGE_DIR), "csrc")):
        if os.path.isfile(os.path.join(candidate, "init.cpp")):
            return candidate
    return None


def _running_record(with_cuda: bool = False) -> dict:
    return _buildspec.build_record(torch, with_cuda)


def _describe(record: dict) -> str:
    git = (record.get("torch_git") or "")[:7]
    return (f"torch {record.get('torch')}{f' ({git})' if git else ''}, "
            f"C++11 ABI {int(bool(record.get('cxx11_abi')))}, CUDA {record.get('cuda') or 'none'}, "
            f"Python {record.get('python')}")


def _mismatch(record: dict, running: dict) -> list[str]:
    return [k for k in _buildspec.RECORD_KEYS if record.get(k) != running.get(k)]


def jit_build_dir(with_cuda: bool) -> str:
    """The cache directory of the just-in-time build for the running torch.

    One directory per torch version and commit, C++ ABI, CUDA version, Python
    version, and whether the CUDA kernels are in it.

    Args:
        with_cuda (bool): whether the build compiles the CUDA kernels.

    Returns:
        str: a path under :func:`cache_root`.
    """
    r = _running_record(with_cuda)
    tag = (f"torch-{r['torch']}-{(r['torch_git'] or 'nogit')[:10]}-abi{int(r['cxx11_abi'])}"
           f"-{'cu' + r['cuda'] if r['cuda'] else 'cpu'}-py{r['python']}"
           f"-{'cuda' if with_cuda else 'cpu'}kernels")
    tag = "".join(c if c.isalnum() or c in "-._" else "_" for c in tag)
    return os.path.join(cache_root(), tag)


def _import_library(path: str) -> types.ModuleType:
    """Import a built ``_C`` shared library from ``path`` as ``amp_patch._C``."""
    loader = importlib.machinery.ExtensionFileLoader(MODULE_NAME, path)
    spec = importlib.util.spec_from_file_location(MODULE_NAME, path, loader=loader)
    if spec is None:
        raise ImportError(f"amp_patch: cannot import the kernel library {path}")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[MODULE_NAME] = mod
    try:
        loader.exec_module(mod)
    except BaseException:
        sys.modules.pop(MODULE_NAME, None)
        raise
    return mod


def _publish(mod: types.ModuleType) -> None:
    """Make ``from amp_patch import _C`` find the loaded library, whichever way it was built."""
    global _module
    _module = mod
    sys.modules[MODULE_NAME] = mod
    package = sys.modules.get("amp_patch")
    if package is not None:
        package._C = mod  # type: ignore[attr-defined]


# -- the prebuilt library ----------------------------------------------------------------------

def _try_prebuilt() -> tuple[NativeStatus | None, str | None]:
    """Load the installed ``amp_patch._C`` when it matches; else say why not.

    Returns:
        (status, problem): status when it loaded; else problem, a sentence for
        the warning (None when simply nothing was built at install time).
    """
    spec = importlib.util.find_spec(MODULE_NAME)
    if spec is None or spec.origin is None:
        return None, None
    record_path = os.path.join(os.path.dirname(spec.origin), _buildspec.BUILD_RECORD)
    record = None
    if os.path.isfile(record_path):
        try:
            with open(record_path) as f:
                record = json.load(f)
        except (OSError, ValueError) as exc:
            logger.debug("unreadable %s (%s); loading amp_patch._C unchecked", record_path, exc)
    running = _running_record()
    if record is not None:
        differ = _mismatch(record, running)
        if differ:
            return None, (f"the installed amp_patch._C was built for {_describe(record)}, "
                          f"but this is {_describe(running)} ({', '.join(differ)} differ)")
    try:
        mod = _import_library(spec.origin)
    except ImportError as exc:
        return None, f"the installed amp_patch._C does not load with {_describe(running)}: {exc}"
    _publish(mod)
    how = "its build record matches" if record is not None else "no build record; it loaded"
    return NativeStatus("prebuilt", f"installed with amp_patch ({how})", spec.origin, record), None


# -- the just-in-time build ----------------------------------------------------------------------

@contextlib.contextmanager
def _file_lock(path: str) -> Iterator[None]:
    """An exclusive ``flock`` on ``path`` (created), held inside the block; waits for it."""
    with open(path, "a+") as f:
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logger.info("amp_patch: another process is compiling the kernels (%s); waiting", path)
            fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def _sources_digest(spec: _buildspec.ExtensionSpec) -> str:
    h = hashlib.sha256()
    flags = [spec.cxx_flags, spec.nvcc_flags, spec.link_flags, spec.with_cuda]
    h.update(json.dumps(flags).encode())
    root = spec.include_dirs[0]
    for dirpath, _, files in sorted(os.walk(root)):
        for name in sorted(files):
            p = os.path.join(dirpath, name)
            h.update(os.path.relpath(p, root).encode())
            with open(p, "rb") as f:
                h.update(f.read())
    return h.hexdigest()


def _cached(build_dir: str, digest: str) -> tuple[str, dict] | None:
    """The library and its record in ``build_dir`` when they were built from these sources."""
    lib = os.path.join(build_dir, "_C.so")
    try:
        with open(os.path.join(build_dir, _buildspec.BUILD_RECORD)) as f:
            record = json.load(f)
    except (OSError, ValueError):
        return None
    if record.get("sources_sha256") != digest or not os.path.isfile(lib):
        return None
    return lib, record


def _progress(build_dir: str, total: int, done: threading.Event) -> None:
    start = time.monotonic()
    while not done.wait(PROGRESS_EVERY_S):
        try:
            objects = sum(1 for n in os.listdir(build_dir) if n.endswith(".o"))
        except OSError:
            objects = 0
        logger.info("amp_patch: compiling the kernels: %d of %d sources done, %.0f s",
                    min(objects, total), total, time.monotonic() - start)


def _compile(spec: _buildspec.ExtensionSpec, build_dir: str, digest: str) -> tuple[str, dict]:
    from torch.utils import cpp_extension

    logger.info("amp_patch: compiling %d sources into %s (MAX_JOBS=%s)", len(spec.sources),
                build_dir, os.environ.get("MAX_JOBS", "all cores"))
    done = threading.Event()
    ticker = threading.Thread(target=_progress, args=(build_dir, len(spec.sources), done),
                              name="amp_patch-jit-progress", daemon=True)
    start = time.monotonic()
    ticker.start()
    try:
        # is_python_module=False: build and dlopen-free; the library is imported below, once,
        # as amp_patch._C (its init function is PyInit__C).
        cpp_extension.load(
            name="_C", sources=list(spec.sources), extra_cflags=list(spec.cxx_flags),
            extra_cuda_cflags=list(spec.nvcc_flags), extra_ldflags=list(spec.link_flags),
            extra_include_paths=list(spec.include_dirs), build_directory=build_dir,
            with_cuda=spec.with_cuda, is_python_module=False, verbose=False)
    finally:
        done.set()
        ticker.join()
    record = dict(_running_record(spec.with_cuda), sources_sha256=digest)
    with open(os.path.join(build_dir, _buildspec.BUILD_RECORD), "w") as f:
        json.dump(record, f, indent=1, sort_keys=True)
    logger.info("amp_patch: kernels compiled in %.0f s", time.monotonic() - start)
    return os.path.join(build_dir, "_C.so"), record


def _jit_unavailable(sources: str | None) -> str | None:
    """Why a just-in-time build cannot run here, or None when it can."""
    if os.environ.get("AMP_PATCH_JIT", "1") == "0":
        return "AMP_PATCH_JIT=0 turns the just-in-time build off"
    if sources is None:
        return "this installation holds no C++ sources (amp_patch/_csrc) to compile"
    cxx = os.environ.get("CXX", "c++")
    if shutil.which(cxx) is None:
        return f"no C++ compiler ({cxx!r} is not on PATH; set CXX or install g++)"
    from torch.utils import cpp_extension

    if not cpp_extension.is_ninja_available():
        return "ninja is not installed (pip install ninja)"
    return None


def _jit_cuda_home() -> str | None:
    """The CUDA toolkit a just-in-time build uses, or None for the CPU kernels only.

    Only with a GPU to run them (torch.cuda.is_available()) and an nvcc in the
    toolkit: compiling for no GPU takes long and, without TORCH_CUDA_ARCH_LIST, fails.
    """
    from torch.utils import cpp_extension

    home = cpp_extension.CUDA_HOME
    if torch.version.cuda is None or home is None:
        return None
    if not os.path.isfile(os.path.join(home, "bin", "nvcc")):
        logger.debug("amp_patch: no nvcc under CUDA_HOME=%s; compiling the CPU kernels only", home)
        return None
    if not torch.cuda.is_available():
        logger.debug("amp_patch: no CUDA device; compiling the CPU kernels only")
        return None
    return home


def _try_jit(problem: str | None) -> NativeStatus:
    sources = sources_root()
    why_not = _jit_unavailable(sources)
    fallback = ("the reference ops serve instead (many times slower; the O1 C++ wrappers are "
                "off too)")
    if why_not is not None or sources is None:
        why_not = why_not or "its C++ sources are not installed"
        if problem is None:
            problem = "amp_patch was installed without compiled kernels"
        logger.warning("amp_patch: %s, and %s: %s. Fix: reinstall amp_patch against this torch "
                       "(docs/install.md), or make a compiler and ninja available so that the "
                       "kernels are compiled on first use.", problem, why_not, fallback)
        return NativeStatus("reference", f"{problem}; {why_not}")
    spec = _buildspec.extension_spec(torch, sources, _jit_cuda_home())
    build_dir = jit_build_dir(spec.with_cuda)
    digest = _sources_digest(spec)
    hit = _cached(build_dir, digest)
    if hit is None:
        os.makedirs(build_dir, exist_ok=True)
        logger.warning(
            "amp_patch: %s: compiling the kernels for %s now (a few minutes, once per torch; "
            "cached in %s; progress at INFO on the 'amp_patch' logger). To avoid it: reinstall "
            "amp_patch against this torch (docs/install.md); AMP_PATCH_JIT=0 skips the build "
            "and uses the slow reference ops.",
            problem or "no compiled kernels for this torch yet", _describe(_running_record()),
            build_dir)
        try:
            with _file_lock(build_dir + ".lock"):
                hit = _cached(build_dir, digest)  # another rank may have built it meanwhile
                if hit is None:
                    hit = _compile(spec, build_dir, digest)
        except Exception as exc:  # noqa: BLE001 (any build failure means: the reference ops)
            logger.warning("amp_patch: compiling the kernels failed (%s); %s. The build log: "
                           "rerun with MAX_JOBS=1 and the 'amp_patch' logger at DEBUG, or run "
                           "ninja in %s.", str(exc).strip().splitlines()[-1] if str(exc) else
                           type(exc).__name__, fallback, build_dir)
            logger.debug("amp_patch: the build error in full", exc_info=True)
            return NativeStatus("reference", f"{problem or 'no prebuilt kernels'}; the "
                                "just-in-time build failed: " + type(exc).__name__)
    elif problem is not None:
        logger.warning("amp_patch: %s; using the kernels compiled for this torch in %s. "
                       "Fix: reinstall amp_patch against this torch (docs/install.md).",
                       problem, build_dir)
    lib, record = hit
    try:
        mod = _import_library(lib)
    except ImportError as exc:
        logger.warning("amp_patch: the kernels compiled in %s do not load (%s); %s. Delete that "
                       "directory to rebuild them.", build_dir, exc, fallback)
        return NativeStatus("reference", f"the cached build does not load: {exc}", lib, record)
    _publish(mod)
    reason = (f"{problem}; compiled for this torch" if problem is not None
              else "no prebuilt amp_patch._C; compiled for this torch")
    return NativeStatus("jit", reason, lib, record)


def load() -> NativeStatus:
    """Load the compiled kernels once per process (prebuilt, else just in time); the outcome.

    Called by :mod:`amp_patch.ops` at import. Later calls return the first outcome.

    Returns:
        NativeStatus: where the kernels come from, and why.
    """
    global _status
    if _status is not None:
        return _status
    if os.environ.get("AMP_PATCH_NO_EXT", "0") == "1":
        logger.debug("AMP_PATCH_NO_EXT=1: using the reference multi-tensor ops")
        _status = NativeStatus("reference", "AMP_PATCH_NO_EXT=1")
        return _status
    loaded, problem = _try_prebuilt()
    _status = loaded if loaded is not None else _try_jit(problem)
    return _status


def status() -> NativeStatus:
    """Where the kernels come from in this process (loads them first if nothing did yet).

    Returns:
        NativeStatus: frozen.
    """
    return load()


def module() -> types.ModuleType | None:
    """The loaded ``amp_patch._C`` module (prebuilt or just-in-time), or None.

    Returns:
        module or None.
    """
    load()
    return _module
