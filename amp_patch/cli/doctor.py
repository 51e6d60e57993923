"""``amp-patch doctor``: a short report of the installation, to paste into a bug report.

It says which torch, CUDA and compiler amp_patch runs with, whether this CPU
computes in half natively, and for each family of ops (loss-scaling kernels,
fused optimizers, the O1 C++ wrappers) whether it runs natively (installed
prebuilt, or compiled just in time for this torch) or on the reference Python
code, and why; and whether the apex import hook is active. DeepSpeed's
``ds_report`` is the model.

Example::

    $ amp-patch doctor
    amp_patch 0.1.0 doctor
    python      3.11.7 (Linux x86_64)
    torch       2.13.0+cpu (git 0123abc, C++11 ABI 1, CPU build, OpenMP)
    ...
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import subprocess
import sys

import torch

import amp_patch
from amp_patch import _native, ops
from amp_patch.ops import optimizer_ops, scaling_ops

__all__ = ["add_parser", "report", "families", "fp8_support"]

#: The op families of the report: name -> the ops (without namespace) that make it up.
FAMILIES = {
    "loss-scaling kernels": tuple(scaling_ops._SCHEMAS),
    "fused optimizers": tuple(optimizer_ops._OPTIM_SCHEMAS),
}


def _first_line(cmd: list[str], last: bool = False) -> str | None:
    """The first (or last) non-empty output line of a short command, or None when it fails."""
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    lines = [line.strip() for line in (proc.stdout or proc.stderr).splitlines() if line.strip()]
    if proc.returncode != 0 or not lines:
        return None
    return lines[-1] if last else lines[0]


def _compiler() -> str:
    cxx = os.environ.get("CXX", "c++")
    path = shutil.which(cxx)
    if path is None:
        return f"none ({cxx!r} not on PATH: no just-in-time build)"
    version = _first_line([path, "--version"]) or "version unknown"
    ninja = _first_line(["ninja", "--version"]) if shutil.which("ninja") else None
    return f"{cxx}: {version}; ninja {ninja or 'missing (pip install ninja)'}"


def _cuda() -> str:
    from torch.utils import cpp_extension

    if torch.version.cuda is None:
        return "none (CPU build of torch)"
    home = cpp_extension.CUDA_HOME
    nvcc = None
    if home:
        nvcc = _first_line([os.path.join(home, "bin", "nvcc"), "--version"], last=True)
    toolkit = "no CUDA_HOME"
    if home:
        toolkit = f"CUDA_HOME={home}" + (f" ({nvcc})" if nvcc else " (no nvcc)")
    if torch.cuda.is_available():
        names = sorted({torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())})
        devices = f"{torch.cuda.device_count()} device(s): {', '.join(names)}"
    else:
        devices = "no device visible"
    return f"torch built for CUDA {torch.version.cuda}; {devices}; {toolkit}"


def families(device_types: list[str] | None = None) -> list[tuple[str, str]]:
    """Each op family with how it runs on each device type: native (and whence) or reference.

    Args:
        device_types (list of str, optional): default ``["cpu"]``, plus ``"cuda"`` for a
            CUDA build of torch.

    Returns:
        list of (str, str): the family's name and one line.

    Example::

        >>> dict(families())["loss-scaling kernels"].startswith("cpu: ")
        True
    """
    if device_types is None:
        device_types = ["cpu"] + (["cuda"] if torch.version.cuda is not None else [])
    status = _native.status()
    out = []
    for family, names in FAMILIES.items():
        parts = []
        for dev in device_types:
            native = sum(ops.has_native_kernel(dev, n) for n in names)
            if native == len(names):
                parts.append(f"{dev}: native ({status.source}, {native} ops)")
            elif native == 0:
                parts.append(f"{dev}: reference (Python)")
            else:
                parts.append(f"{dev}: native for {native} of {len(names)} ops, "
                             "reference for the rest")
        out.append((family, "; ".join(parts)))
    from amp_patch.patching import wrappers

    if wrappers._CastWrapper is not None:
        wrap = f"native (C++ CastWrapper, {status.source})"
    else:
        wrap = "Python (no compiled amp_patch._C)"
    out.append(("O1 wrappers", wrap))
    return out


def _autocast() -> str:
    """What torch.autocast costs in bf16 (the CPU's half type) on this CPU: its host kind and the
    probe's factor, worded where ``compare`` words it, and whether ``compare`` runs it."""
    from amp_patch.cli.host_facts import AUTOCAST_FACTOR_LIMIT, HostFacts, autocast_cost

    cost = autocast_cost(HostFacts.collect("cpu"), "bf16")
    if cost is None:  # only a device other than the CPU has no answer
        return "unknown"
    verdict = ("compare runs it" if cost.included else
               f"compare leaves it out (its limit: {AUTOCAST_FACTOR_LIMIT:g}x fp32's time)")
    return f"bf16: {cost.describe()}; {verdict}"


def _host_syncs() -> str:
    """Which optimizers a sync-free iteration reads the overflow flag for (docs/design.md,
    "Host syncs"), from the same test the step uses."""
    from amp_patch.optim.amp.patched_methods import host_reads_per_step
    from amp_patch.optim.fused import FusedAdam, FusedLAMB

    params = [torch.nn.Parameter(torch.zeros(1))]
    optimizers = {
        "torch Adam/AdamW/SGD(fused=True)": torch.optim.AdamW(params, fused=True),
        "amp_patch FusedAdam, FusedSGD (fp32 state)": FusedAdam(params),
        "amp_patch FusedLAMB, the others and low-precision state": FusedLAMB(params),
        "other torch optimizers, LARC": torch.optim.SGD(params, lr=0.1),
    }
    return "; ".join(f"{name}: {host_reads_per_step(opt)} per step"
                     for name, opt in optimizers.items()) + (
        " (sync_free=False: 1 per scale_loss exit, whatever the optimizer)")


def fp8_support(device_types: list[str] | None = None) -> str:
    """Whether ``torch._scaled_mm`` serves FP8 GEMMs on each device type, and in which formats.

    CUDA needs sm_89 or later (Ada, Hopper and later); elsewhere emulation
    (``Fp8Recipe(emulate=True)``) is the only way, and never chosen silently.

    Example::

        >>> fp8_support(["cpu"]).startswith("torch._scaled_mm: cpu: yes")
        True
    """
    from amp_patch.ops import fp8_ops

    if fp8_ops.SCALED_MM_SIGNATURE is None:
        return (f"no: torch {torch.__version__} has no torch._scaled_mm with the signature "
                "amp_patch calls (torch >= 2.5); only emulation (Fp8Recipe(emulate=True))")
    if device_types is None:
        device_types = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    parts = []
    for dev in device_types:
        if dev == "cuda":
            caps = sorted({torch.cuda.get_device_capability(i)
                           for i in range(torch.cuda.device_count())})
            arch = ", ".join(f"sm_{a}{b}" for a, b in caps)
            if fp8_ops.fp8_gemm_available("cuda"):
                parts.append(f"cuda: yes ({arch}; sm_89 or later has FP8 tensor cores)")
            else:
                parts.append(f"cuda: no ({arch or 'no kernel'}; FP8 GEMMs need sm_89 or later: "
                             "emulation only, when asked)")
            continue
        if not fp8_ops.fp8_gemm_available(dev):
            parts.append(f"{dev}: no (emulation only, when asked)")
            continue
        rowwise = ("rowwise too" if fp8_ops.fp8_gemm_available(dev, rowwise=True)
                   else "tensorwise only (rowwise: emulation)")
        parts.append(f"{dev}: yes, {rowwise}" + (" (no FP8 units: correct, not fast)"
                                                  if dev == "cpu" else ""))
    return (f"torch._scaled_mm: {'; '.join(parts)}; formats e4m3fn (max 448) and e5m2 "
            "(max 57344), HYBRID (E4M3 forward, E5M2 backward) or E4M3; docs/fp8.md")


def _import_hook() -> str:
    from amp_patch.apex_compat.import_hook import ApexFinder

    finders = [f for f in sys.meta_path if isinstance(f, ApexFinder)]
    if not finders:
        return "inactive (`amp-patch run` installs it for the script it runs)"
    return f"active ({len(finders)} finder(s) on sys.meta_path)"


def report() -> str:
    """The report, as a few lines of text.

    Returns:
        str: no trailing newline.

    Example::

        >>> report().splitlines()[0].startswith("amp_patch ")
        True
    """
    from amp_patch.patching.cpu_half import cpu_half_support

    status = _native.status()
    rec = _native._running_record()
    threads = torch.get_num_threads()
    build = f"CUDA {rec['cuda']}" if rec["cuda"] else "CPU"
    torch_line = (f"{torch.__version__} (git {(rec['torch_git'] or 'unknown')[:7]}, C++11 ABI "
                  f"{int(rec['cxx11_abi'])}, {build} build, "
                  f"{'OpenMP' if torch._C.has_openmp else 'no OpenMP'}, {threads} threads)")
    kernels = f"{status.source}: {status.reason}"
    if status.path:
        kernels += f"\n{status.path}"
    if status.loaded:
        capability = getattr(_native.module(), "cpu_capability", None)
        if capability is not None:
            kernels += f"\nCPU kernels run with {capability()}"
    shown = ("CUDA_HOME", "TORCH_CUDA_ARCH_LIST", "MAX_JOBS")
    knobs = {k: v for k, v in sorted(os.environ.items())
             if k.startswith("AMP_PATCH_") or k in shown}
    rows = [
        ("python", f"{platform.python_version()} ({platform.system()} {platform.machine()})"),
        ("torch", torch_line),
        ("CUDA", _cuda()),
        ("compiler", _compiler()),
        ("CPU half", cpu_half_support().describe()),
        ("autocast", _autocast()),
        ("kernels", kernels),
        *families(),
        ("JIT cache",
         f"{_native.cache_root()} (AMP_PATCH_JIT={os.environ.get('AMP_PATCH_JIT', '1')})"),
        ("FP8", fp8_support()),
        ("import hook", _import_hook()),
        ("host syncs", _host_syncs()),
        ("environment", " ".join(f"{k}={v}" for k, v in knobs.items()) or "no AMP_PATCH_* set"),
    ]
    width = max(len(name) for name, _ in rows) + 2
    return "\n".join([f"amp_patch {amp_patch.__version__} doctor"]
                     + [f"{name:<{width}}" + value.replace("\n", "\n" + " " * width)
                        for name, value in rows])


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register the ``doctor`` subcommand."""
    p = sub.add_parser(
        "doctor",
        help="report torch, CUDA, compiler and how each kernel family runs (for bug reports)",
        description="Print a short report of this installation: torch, CUDA and compiler versions, "
                    "the CPU half-compute verdict, whether the loss-scaling kernels, fused "
                    "optimizers "
                    "and O1 wrappers run natively (prebuilt or compiled just in time) or on the "
                    "reference Python code and why, and whether the apex import hook is active. "
                    "Paste it into bug reports.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="example:\n  amp-patch doctor\n")
    p.set_defaults(func=_doctor, parser=p)


def _doctor(ns: argparse.Namespace) -> int:
    print(report())
    return 0
