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
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import os
import platform
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
import torch.nn.functional as F

from amp_patch.distributed import agree
from amp_patch.dtypes import HALF_DTYPE_NAMES, HALF_DTYPE_SPELLINGS, HALF_DTYPES, half_dtype_name
from amp_patch.patching.patcher import Patcher

# The settings own the modes; the names here stay public.
from amp_patch.properties import (
    CPU_HALF_MODES as MODES,
    Properties,
    check_cpu_half_mode as check_mode,
)

__all__ = [
    "MODES",
    "ENV_VAR",
    "PROBE_RATIO_LIMIT",
    "DtypeSupport",
    "CpuHalfSupport",
    "CpuHalfPlan",
    "cpu_half_support",
    "override",
    "check_mode",
    "plan",
    "current_plan",
    "banner",
    "install",
    "targets",
]

logger = logging.getLogger("amp_patch")

#: Environment variable that replaces detection: a comma-separated list of the
#: half dtypes to treat as native (``bf16``, ``fp16``, ``bfloat16``, ``float16``),
#: or ``none``. Empty or unset means: detect.
ENV_VAR = "AMP_PATCH_CPU_HALF_NATIVE"

#: A dtype whose oneDNN check passes is native only if its probe runs in at most
#: this many times the fp32 time. Native half runs at 0.2-0.9x fp32's time (AMX,
#: avx512_bf16); a slow path is 5-100x; emulation costs about 1.1x. The limit sits
#: between the two with a wide margin, so that the verdict, which decides the
#: numerics of a run, does not change from one process to the next.
PROBE_RATIO_LIMIT = 2.5

_ONEDNN_CHECKS = {torch.bfloat16: "_is_mkldnn_bf16_supported",
                  torch.float16: "_is_mkldnn_fp16_supported"}
#: The host flags that decide half speed, as /proc/cpuinfo spells them (x86, then Arm).
_HALF_FLAGS = ("avx512_bf16", "amx_bf16", "amx_fp16", "avx512_fp16", "bf16", "fphp")


# --------------------------------------------------------------------------- detection


@dataclass(frozen=True)
class DtypeSupport:
    """Whether one half dtype is native for CPU matmul and convolution.

    Args:
        onednn (bool or None): oneDNN's own check
            (``torch.ops.mkldnn._is_mkldnn_bf16_supported`` or its fp16 twin);
            None when the answer was forced rather than detected.
        matmul (bool): matmuls in this dtype are native.
        conv (bool): convolutions in this dtype are native.
        matmul_ratio (float or None): the probe's half time over fp32 time for
            a small matmul; None when not probed (oneDNN said no, or forced).
        conv_ratio (float or None): the same for a small convolution.
    """

    onednn: bool | None
    matmul: bool
    conv: bool
    matmul_ratio: float | None = None
    conv_ratio: float | None = None


@dataclass(frozen=True)
class CpuHalfSupport:
    """What :func:`cpu_half_support` found about this host's half compute.

    Args:
        cpu (str): the CPU model.
        capability (str): torch's CPU vector capability (``"AVX512"``, ``"AVX2"``, ...).
        flags (tuple of str or None): the half-related ISA flags the host has
            (``avx512_bf16``, ``amx_bf16``, ``avx512_fp16``, ...); None when
            the host does not say (no ``/proc/cpuinfo``).
        bfloat16 (DtypeSupport): bf16's answer.
        float16 (DtypeSupport): fp16's answer.
        source (str): ``"detected"``, ``"env"`` (:data:`ENV_VAR`) or
            ``"override"`` (:func:`override`).

    Example::

        >>> s = amp.cpu_half_support()
        >>> s.native(torch.bfloat16)
        True
        >>> s.describe()
        'AMD EPYC (AVX512; avx512_bf16 yes, AMX no, avx512_fp16 no): bf16 native ...'
    """

    cpu: str
    capability: str
    flags: tuple[str, ...] | None
    bfloat16: DtypeSupport
    float16: DtypeSupport
    source: str = "detected"

    def of(self, dtype: torch.dtype) -> DtypeSupport:
        """The :class:`DtypeSupport` of ``dtype``.

        Raises:
            ValueError: ``dtype`` is not torch.bfloat16 or torch.float16.
        """
        if dtype == torch.bfloat16:
            return self.bfloat16
        if dtype == torch.float16:
            return self.float16
        raise ValueError(f"expected torch.bfloat16 or torch.float16, got {dtype!r}")

    def native(self, dtype: torch.dtype) -> bool:
        """True when both matmul and convolution in ``dtype`` are native on this CPU.

        Args:
            dtype (torch.dtype): torch.bfloat16 or torch.float16.
        """
        s = self.of(dtype)
        return s.matmul and s.conv

    def host(self) -> str:
        """The host kind: CPU model, vector capability and half-related flags."""
        if self.flags is None:
            return f"{self.cpu} ({self.capability}; ISA flags unknown)"
        has = set(self.flags)
        marks = [("avx512_bf16", "avx512_bf16" in has), ("AMX", "amx_bf16" in has),
                 ("avx512_fp16", "avx512_fp16" in has)]
        if platform.machine().lower() in ("aarch64", "arm64"):
            marks = [("bf16", "bf16" in has), ("fp16", "fphp" in has)]
        return f"{self.cpu} ({self.capability}; " + ", ".join(
            f"{name} {'yes' if present else 'no'}" for name, present in marks) + ")"

    def describe(self) -> str:
        """One line: the host kind, then for bf16 and fp16 whether they are native and why."""
        return f"{self.host()}: " + "; ".join(
            f"{name} {_describe_dtype(self.of(d))}" for name, d in HALF_DTYPE_NAMES.items()
        ) + ("" if self.source == "detected" else f" [{self.source}]")

    def as_dict(self) -> dict[str, Any]:
        """A JSON-able dict of every field, with ``"native"`` per dtype and the host line."""
        out: dict[str, Any] = {"cpu": self.cpu, "capability": self.capability,
                               "flags": None if self.flags is None else list(self.flags),
                               "host": self.host(), "source": self.source}
        for name, dtype in HALF_DTYPE_NAMES.items():
            out[name] = dict(dataclasses.asdict(self.of(dtype)), native=self.native(dtype))
        return out


def _describe_dtype(s: DtypeSupport) -> str:
    if s.matmul and s.conv:
        verdict = "native"
    elif s.matmul or s.conv:
        verdict = "native for " + ("matmul" if s.matmul else "convolution") + " only"
    else:
        verdict = "not native"
    why = []
    if s.onednn is not None:
        why.append(f"oneDNN {'yes' if s.onednn else 'no'}")
    for what, ratio in (("matmul", s.matmul_ratio), ("conv", s.conv_ratio)):
        if ratio is not None:
            why.append(f"{what} {ratio:.2g}x fp32's time")
    return verdict + (f" ({', '.join(why)})" if why else "")


_lock = threading.Lock()
_detected: CpuHalfSupport | None = None
#: :func:`override` pushes its answer here; the innermost wins.
_overrides: list[CpuHalfSupport] = []
#: The last answer logged by :func:`install`, so that each is logged once.
_logged: CpuHalfSupport | None = None


def cpu_half_support() -> CpuHalfSupport:
    """Whether half (bf16, fp16) matmul and convolution are native on this CPU.

    The answer starts from oneDNN's own check
    (``torch.ops.mkldnn._is_mkldnn_bf16_supported()`` and the fp16 twin). A
    dtype that passes it is confirmed by a tiny timed probe (a 192x192
    matmul and a 64-channel 3x3 convolution in half against fp32,
    interleaved, the best of several); it is native when the half time is at
    most :data:`PROBE_RATIO_LIMIT` times the fp32 time. The probe takes a few
    milliseconds, runs once per process and leaves the global RNG untouched.

    :data:`ENV_VAR` (``AMP_PATCH_CPU_HALF_NATIVE=bf16``, say) and
    :func:`override` replace the detection, for tests and for hosts where
    the probe misjudges.

    Returns:
        CpuHalfSupport: frozen; ``.native(dtype)``, ``.describe()``, ``.as_dict()``.

    Raises:
        ValueError: :data:`ENV_VAR` names something other than the half dtypes.

    Example::

        >>> amp.cpu_half_support().native(torch.float16)
        False
    """
    global _detected
    if _overrides:
        return _overrides[-1]
    env = os.environ.get(ENV_VAR, "").strip()
    if env:
        return _from_env(env)
    with _lock:
        if _detected is None:
            _detected = _detect()
        return _detected


@contextlib.contextmanager
def override(*, bfloat16: bool | None = None,
             float16: bool | None = None) -> Iterator[CpuHalfSupport]:
    """Force :func:`cpu_half_support`'s answer inside the block (nestable).

    A dtype given as True is treated as native for matmul and convolution,
    False as not native; None keeps the detected answer (or the enclosing
    override's). What a session emulates is decided at
    :func:`amp_patch.initialize`, so the block needs to hold only that call.

    Args:
        bfloat16 (bool, optional): bf16 is native. Default: keep.
        float16 (bool, optional): fp16 is native. Default: keep.

    Yields:
        CpuHalfSupport: the forced answer.

    Example::

        >>> with amp_patch.cpu_half.override(bfloat16=False):
        ...     model, opt = amp.initialize(model, opt, opt_level="O2")   # emulates bf16
    """
    base = cpu_half_support()
    forced = dataclasses.replace(
        base, source="override",
        bfloat16=base.bfloat16 if bfloat16 is None else _forced(bfloat16),
        float16=base.float16 if float16 is None else _forced(float16),
    )
    _overrides.append(forced)
    try:
        yield forced
    finally:
        _overrides.remove(forced)


def _forced(native: bool) -> DtypeSupport:
    return DtypeSupport(onednn=None, matmul=bool(native), conv=bool(native))


@functools.cache
def _from_env(value: str) -> CpuHalfSupport:
    names = {n.strip().lower() for n in value.split(",") if n.strip()}
    native = set()
    if names != {"none"}:
        unknown = sorted(names - set(HALF_DTYPE_SPELLINGS))
        if unknown:
            raise ValueError(
                f"{ENV_VAR} must list half dtypes (bf16, fp16, bfloat16, float16) or be 'none', "
                f"got {value!r}"
            )
        native = {HALF_DTYPE_SPELLINGS[n] for n in names}
    cpu, capability, flags = _host()
    return CpuHalfSupport(cpu, capability, flags, _forced(torch.bfloat16 in native),
                          _forced(torch.float16 in native), source="env")


@functools.cache
def _host() -> tuple[str, str, tuple[str, ...] | None]:
    cpu, flags = None, None
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key in ("model name", "Model") and cpu is None:
                    cpu = value.strip()
                elif key in ("flags", "Features") and flags is None:
                    have = set(value.split())
                    flags = tuple(fl for fl in _HALF_FLAGS if fl in have)
    except OSError:
        pass
    cpu = cpu or platform.processor() or platform.machine() or "unknown CPU"
    return cpu, torch.backends.cpu.get_cpu_capability(), flags


def _detect() -> CpuHalfSupport:
    cpu, capability, flags = _host()
    return CpuHalfSupport(cpu, capability, flags, _detect_dtype(torch.bfloat16),
                          _detect_dtype(torch.float16))


def _onednn_says(dtype: torch.dtype) -> bool:
    try:
        return bool(getattr(torch.ops.mkldnn, _ONEDNN_CHECKS[dtype])())
    except (AttributeError, RuntimeError):  # a torch built without oneDNN
        return False


def _detect_dtype(dtype: torch.dtype) -> DtypeSupport:
    if not _onednn_says(dtype):
        return DtypeSupport(onednn=False, matmul=False, conv=False)
    matmul_ratio, conv_ratio = _probe(dtype)
    return DtypeSupport(onednn=True, matmul=matmul_ratio <= PROBE_RATIO_LIMIT,
                        conv=conv_ratio <= PROBE_RATIO_LIMIT,
                        matmul_ratio=round(matmul_ratio, 3), conv_ratio=round(conv_ratio, 3))


def _probe(dtype: torch.dtype, repeats: int = 7) -> tuple[float, float]:
    """Half time over fp32 time of a small matmul and a small convolution.

    The C entry points are called directly, so patches in effect (O1's, or
    this module's) do not change what is timed. Calls alternate between the
    dtypes and each keeps its best time, so that a busy machine slows both
    alike and a preempted call does not count. They run on one thread: on a
    loaded machine a parallel region stalls whenever one of its threads is
    descheduled, which no best-of-N filters out (a small conv measured 0.5x
    to 2x fp32's time from one process to the next with two threads, and
    0.41-0.43x with one).
    """
    vf = torch._C._VariableFunctions
    g = torch.Generator().manual_seed(0)  # a private stream: the global RNG stays as it was
    a, b = torch.randn(192, 192, generator=g), torch.randn(192, 192, generator=g)
    x, w = torch.randn(1, 64, 16, 16, generator=g), torch.randn(64, 64, 3, 3, generator=g)
    calls: dict[tuple[str, torch.dtype], Callable[[], Any]] = {}
    for d in (torch.float32, dtype):
        a_d, b_d, x_d, w_d = (t.to(d) for t in (a, b, x, w))
        calls["mm", d] = functools.partial(vf.mm, a_d, b_d)
        calls["conv", d] = functools.partial(vf.conv2d, x_d, w_d, None, 1, 1)
    best = dict.fromkeys(calls, float("inf"))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.no_grad():
            for round_ in range(repeats + 2):  # two untimed rounds: oneDNN builds its kernels
                for key, call in calls.items():
                    t0 = time.perf_counter()
                    call()
                    elapsed = time.perf_counter() - t0
                    if round_ >= 2:
                        best[key] = min(best[key], elapsed)
    finally:
        torch.set_num_threads(threads)
    return (best["mm", dtype] / best["mm", torch.float32],
            best["conv", dtype] / best["conv", torch.float32])


# --------------------------------------------------------------------------- what a session does

@dataclass(frozen=True)
class CpuHalfPlan:
    """What one session does about half compute on the CPU.

    Build it with :func:`plan`.

    Args:
        half_dtype (torch.dtype): the dtype the session computes in on the CPU.
        requested (str): the ``cpu_half_compute`` property: ``"auto"``,
            ``"native"`` or ``"emulate"``.
        emulate_matmul (bool): matmul-class ops are emulated.
        emulate_conv (bool): convolutions are emulated.
        host_matmul (bool): the host's matmul in ``half_dtype`` is native.
        host_conv (bool): the host's convolution in ``half_dtype`` is native.
    """

    half_dtype: torch.dtype
    requested: str
    emulate_matmul: bool
    emulate_conv: bool
    host_matmul: bool
    host_conv: bool

    @property
    def emulates(self) -> bool:
        """True when any op class is emulated."""
        return self.emulate_matmul or self.emulate_conv

    @property
    def mode(self) -> str:
        """``"native"``, ``"emulate"``, or, for one class, ``"emulate-matmul"`` /
        ``"emulate-conv"``."""
        if self.emulate_matmul and self.emulate_conv:
            return "emulate"
        if self.emulates:
            return "emulate-matmul" if self.emulate_matmul else "emulate-conv"
        return "native"

    def describe(self) -> str:
        """One sentence: what runs how, and why."""
        h = half_dtype_name(self.half_dtype)
        host = ("has native " + h if self.host_matmul and self.host_conv
                else f"has no native {h} " + ("convolution" if self.host_matmul else "matmul"))
        why = f"cpu_half_compute={self.requested!r}; this host {host}"
        if not self.emulates:
            slow = "" if self.host_matmul and self.host_conv else ": expect them to be slow"
            return f"{h} matmuls and convolutions run natively in {h} ({why}){slow}"
        what = {"emulate": "matmuls and convolutions", "emulate-matmul": "matmuls",
                "emulate-conv": "convolutions"}[self.mode]
        return (f"{h} {what} are emulated: computed in fp32 on fp32 copies of the {h} inputs, "
                f"outputs rounded to {h} ({why})")

    def as_dict(self) -> dict[str, Any]:
        """A JSON-able dict: the fields (the dtype as ``"bf16"``/``"fp16"``) and ``mode``."""
        out = dataclasses.asdict(self)
        out.update(half_dtype=half_dtype_name(self.half_dtype), mode=self.mode)
        return out


def plan(cpu_half_compute: str = "auto", half_dtype: torch.dtype = torch.bfloat16,
         support: CpuHalfSupport | None = None) -> CpuHalfPlan:
    """What ``cpu_half_compute`` means on this host for ``half_dtype``.

    ``"auto"`` emulates exactly the op classes (matmul, convolution) that the
    host does not run natively in ``half_dtype``; ``"native"`` emulates
    nothing; ``"emulate"`` emulates both.

    Args:
        cpu_half_compute (str, optional): ``"auto"``, ``"native"`` or ``"emulate"``.
            Default: ``"auto"``.
        half_dtype (torch.dtype, optional): torch.bfloat16 or torch.float16.
            Default: torch.bfloat16.
        support (CpuHalfSupport, optional): Default: :func:`cpu_half_support`.

    Returns:
        CpuHalfPlan: frozen; ``.emulates``, ``.mode``, ``.describe()``, ``.as_dict()``.

    Raises:
        ValueError: an unknown mode or a dtype that is not half.

    Example::

        >>> amp_patch.cpu_half.plan("auto", torch.float16).mode    # on a host without avx512_fp16
        'emulate'
    """
    check_mode(cpu_half_compute)
    s = (support or cpu_half_support()).of(half_dtype)
    emulate = cpu_half_compute == "emulate"
    auto = cpu_half_compute == "auto"
    return CpuHalfPlan(half_dtype, cpu_half_compute,
                       emulate_matmul=emulate or (auto and not s.matmul),
                       emulate_conv=emulate or (auto and not s.conv),
                       host_matmul=s.matmul, host_conv=s.conv)


def _session_plan(props: Properties, models: list[torch.nn.Module]) -> CpuHalfPlan | None:
    """The plan of a session that computes in half on the CPU; None for one that does not."""
    if not props.enabled or not _on_cpu(models):
        return None
    if props.cast_model_type in HALF_DTYPES:
        dtype = props.cast_model_type
    elif props.patch_torch_functions:
        dtype = props.half_dtype
    else:
        return None
    return plan(props.cpu_half_compute, dtype)


def _on_cpu(models) -> bool:
    return all(t.device.type == "cpu" for m in models
               for t in (*m.parameters(), *m.buffers()) if t.is_floating_point())


#: The live session's plan: set by :func:`install`, cleared when that session closes.
_live_plan: CpuHalfPlan | None = None


def current_plan() -> CpuHalfPlan | None:
    """The live session's plan (decided at its :func:`amp_patch.initialize`), or None when no
    session computes in half on the CPU.

    Example::

        >>> with amp_patch.cpu_half.override(bfloat16=True):  # as on a host with native bf16
        ...     model, opt = amp.initialize(model, opt, opt_level="O2", half_dtype=torch.bfloat16)
        >>> amp_patch.cpu_half.current_plan().mode
        'native'
    """
    return _live_plan


def banner(half_dtype: torch.dtype = torch.bfloat16, cpu_half_compute: str = "auto", *,
           support: CpuHalfSupport | None = None) -> str:
    """The text that tools print beside CPU speed figures: which compute mode ran, and why
    those figures do not predict GPU speed.

    Three lines: the plan (:meth:`CpuHalfPlan.describe`), the host
    (:meth:`CpuHalfSupport.describe`), and the caveat. ``amp-patch compare``,
    ``bench`` and ``make demo`` print it on CPU runs; a host without native
    half is where it matters most.

    Args:
        half_dtype (torch.dtype, optional): the half dtype of the run. Default: torch.bfloat16.
        cpu_half_compute (str, optional): the mode the run used. Default: ``"auto"``.
        support (CpuHalfSupport, optional): Default: :func:`cpu_half_support`.

    Returns:
        str: three lines, no trailing newline.

    Example::

        >>> len(amp_patch.cpu_half.banner(torch.bfloat16).splitlines())
        3
    """
    support = support or cpu_half_support()
    p = plan(cpu_half_compute, half_dtype, support)
    h = half_dtype_name(half_dtype)
    if p.emulates:
        here = (f"here {h} matmuls ran at about fp32 speed (emulated), so O1-O3 run near O0's "
                "speed and their differences come from casts, elementwise ops and memory traffic")
    else:
        here = f"here they ran on this CPU's own {h} units, whose speed-up over fp32 is no guide"
    return "\n".join([
        f"CPU half compute: {p.describe()}.",
        f"Host: {support.describe()}.",
        "CPU speed ratios do not predict GPU speed: on a GPU, half matmuls run on tensor cores "
        f"several times faster than fp32; {here}.",
    ])


# --------------------------------------------------------------------------- the emulating wrappers

#: Matmul-class ops by namespace. Tensor.__rmatmul__ is absent: it calls torch.matmul.
_MATMUL = (
    (torch, "torch", ("matmul", "mm", "bmm", "addmm", "baddbmm", "addbmm", "mv", "addmv", "dot",
                      "einsum", "linalg.matmul", "linalg.multi_dot")),
    (F, "torch.nn.functional", ("linear", "scaled_dot_product_attention")),
    (torch.Tensor, "torch.Tensor", ("matmul", "__matmul__", "mm", "bmm", "addmm", "baddbmm",
                                    "addbmm", "mv", "addmv", "dot",
                                    "addmm_", "baddbmm_", "addbmm_", "addmv_")),
)
_CONV_NAMES = ("conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d",
               "conv_transpose3d", "conv_tbc")
_CONV = (
    (torch, "torch", _CONV_NAMES + ("convolution",)),
    (F, "torch.nn.functional", _CONV_NAMES),
)


def targets(matmul: bool = True, conv: bool = True) -> list[tuple[Any, str, str]]:
    """The attributes that emulation patches: ``(namespace, printable prefix, name)``.

    Names ending in ``_`` are in-place Tensor methods. Names the installed
    torch lacks are skipped when patching.

    Args:
        matmul (bool, optional): include the matmul-class ops. Default: True.
        conv (bool, optional): include the convolutions. Default: True.
    """
    groups = (_MATMUL if matmul else ()) + (_CONV if conv else ())
    return [(ns, prefix, name) for ns, prefix, names in groups for name in names]


_Tensor = torch.Tensor
_FP32 = torch.float32
_SEQUENCES = (list, tuple)
# TensorBase's own methods: never a patched version, and no argument parsing.
_widen_one = torch._C.TensorBase.float
_copy = torch._C.TensorBase.copy_
_NARROW = {torch.bfloat16: torch._C.TensorBase.bfloat16, torch.float16: torch._C.TensorBase.half}


def _scan(items, dtype: torch.dtype) -> int:
    """1 when ``items`` (lists and tuples inside too) hold a CPU ``dtype`` tensor and no other
    floating or complex tensor; -1 when they hold another one; 0 when no floating tensor.

    The emulating wrappers' pre-check: it allocates nothing.
    """
    found = 0
    for a in items:
        if isinstance(a, _Tensor):
            d = a.dtype
            if d is dtype and a.is_cpu:
                found = 1
            elif d is dtype or d.is_floating_point or d.is_complex:
                return -1
        elif isinstance(a, _SEQUENCES):
            inner = _scan(a, dtype)
            if inner < 0:
                return -1
            found |= inner
    return found


def _widen(items, dtype: torch.dtype) -> list:
    """``items`` with every ``dtype`` tensor replaced by an fp32 copy (lists and tuples
    inside too)."""
    out: list[Any] = []
    for a in items:
        if isinstance(a, _Tensor):
            out.append(_widen_one(a) if a.dtype is dtype else a)
        elif isinstance(a, _SEQUENCES):
            out.append(type(a)(_widen(a, dtype)))
        else:
            out.append(a)
    return out


def _emulator(original: Callable, dtype: torch.dtype, name: str) -> Callable:
    """A wrapper that runs ``original`` on fp32 copies of its CPU ``dtype`` inputs and rounds
    the output to ``dtype``; any other call (CUDA, fp32, mixed dtypes) goes straight through.

    ``out=`` receives the rounded result. An in-place method (``name`` ending
    in ``_``) works on an fp32 copy of ``self`` and copies it back, rounding once.
    """
    narrow = _NARROW[dtype]
    in_place = name.endswith("_") and not name.endswith("__")

    def emulated(*args, **kwargs):
        found = _scan(args, dtype)
        if kwargs and found >= 0:
            in_kwargs = _scan(kwargs.values(), dtype)
            found = -1 if in_kwargs < 0 else found | in_kwargs
        if found <= 0 or (in_place and args[0].dtype is not dtype):
            return original(*args, **kwargs)
        wide = _widen(args, dtype)
        dest = None
        if kwargs:
            dest = kwargs.get("out")
            keys = [k for k in kwargs if k != "out"]
            kwargs = dict(zip(keys, _widen([kwargs[k] for k in keys], dtype)))
        if in_place:
            original(*wide, **kwargs)
            return _copy(args[0], wide[0])
        result = original(*wide, **kwargs)
        if dest is not None:
            return _copy(dest, result)
        if isinstance(result, _Tensor) and result.dtype is _FP32:
            return narrow(result)
        return result

    functools.update_wrapper(emulated, original)  # every target is a named torch callable
    emulated._amp_patch_cpu_half = dtype  # type: ignore[attr-defined]  # marks our wrappers
    return emulated


def _log_once(support: CpuHalfSupport) -> None:
    global _logged
    if support is not _logged and logger.isEnabledFor(logging.INFO):
        _logged = support
        logger.info("CPU half compute on this host: %s", support.describe())


def _agreed(p: CpuHalfPlan | None) -> CpuHalfPlan | None:
    """``p``, emulating every op class that any rank of the process group emulates.

    The host's answer comes from a timed probe and an environment variable,
    either of which can differ between ranks (a busy core, another node);
    the plan decides the numerics, so the ranks take one plan: an op class
    is emulated everywhere if one rank must. Whether a plan exists at all
    follows from the session's properties and the models' device, the same
    on every rank. One all-reduce at initialize, only under torch.distributed.
    """
    if p is None or not agree.group_active():
        return p
    matmul, conv = (bool(v) for v in agree.agree_max([p.emulate_matmul, p.emulate_conv]))
    if (matmul, conv) == (p.emulate_matmul, p.emulate_conv):
        return p
    logger.info("CPU half compute: another rank emulates what this host runs natively; this "
                "rank emulates it too, so that all ranks compute alike")
    return dataclasses.replace(p, emulate_matmul=matmul, emulate_conv=conv)


def install(props: Properties, models: list[torch.nn.Module],
            on_close: Callable[..., None]) -> CpuHalfPlan | None:
    """Install the emulating wrappers when the session computes in half on a CPU that needs them.

    It is what :func:`amp_patch.initialize` calls, before the O1 patches.
    For models on the CPU it logs the host's answer (once per answer and
    process). When the session computes in half there (O1, or a model cast
    to half at O2/O3) the plan becomes :func:`current_plan` until the session
    closes; when the plan emulates, it patches the op classes that the plan
    names and registers their undo with ``on_close`` ("CPU half emulation").

    Args:
        props (Properties): the session's settings.
        models (list of torch.nn.Module): the models passed to initialize.
        on_close (callable): ``on_close(what, undo)`` registers an undo with the session.

    Returns:
        CpuHalfPlan or None: the plan; None when the session computes no half
        on the CPU (O0, models on CUDA, ``enabled=False``).

    Example::

        >>> from amp_patch.properties import Properties
        >>> props = Properties.from_opt_level("O2", torch.bfloat16)
        >>> undos = []
        >>> with override(bfloat16=False):  # as on a host without native bf16
        ...     install(props, [model], lambda what, undo: undos.append(undo)).mode
        'emulate'
        >>> for undo in reversed(undos):  # what the session's close does
        ...     undo()
    """
    global _live_plan
    if not (props.enabled and _on_cpu(models)):
        return None
    _log_once(cpu_half_support())
    p = _agreed(_session_plan(props, models))
    if p is not None:
        def forget() -> None:
            global _live_plan
            if _live_plan is p:
                _live_plan = None

        _live_plan = p
        on_close("the live CPU half plan", forget)
    if p is None or not p.emulates:
        if p is not None:
            logger.debug("%s", p.describe())
        return p
    patcher = Patcher()
    on_close("CPU half emulation", patcher.undo_all)
    for namespace, _, name in targets(p.emulate_matmul, p.emulate_conv):
        patcher.patch(namespace, name, functools.partial(_emulator, dtype=p.half_dtype, name=name))
    logger.info("%s", p.describe())
    return p
