"""Is half compute native on this CPU: oneDNN's answer, confirmed by a timed probe, cached.
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

from amp_patch.settings.dtypes import HALF_DTYPE_NAMES, HALF_DTYPE_SPELLINGS

# The settings own the modes; the names here stay public.

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

#: The kinds of CPU host for one half dtype, best first (docs/install.md, "CPU host kinds"):
#: ``"native"``, matmul and convolution at native speed (avx512_bf16, AMX); ``"conv-only"``,
#: oneDNN supports the dtype but emulates its matmuls at a measured 2-5x fp32's time (AVX-512
#: without avx512_bf16; its convolutions may stay near fp32's speed); ``"none"``, oneDNN has no
#: support and the dtype's matmuls take ATen's slow path, 100x fp32's time or more (AVX2 only).
HOST_KINDS = ("native", "conv-only", "none")

#: The environment that makes a host of a better kind behave as each kind: oneDNN's and ATen's
#: ISA caps, which they read once at start-up, so they go into a new process's environment
#: (``make test-hosts``, the demo's timings). They only lower a host: on an AVX2 host every
#: entry gives ``"none"``. ``"native"`` is the host as it is.
FORCED_KIND_ENV: dict[str, dict[str, str]] = {
    "native": {},
    "conv-only": {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE"},
    "none": {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"},
}

_ONEDNN_CHECKS = {torch.bfloat16: "_is_mkldnn_bf16_supported",
                  torch.float16: "_is_mkldnn_fp16_supported"}
#: The host flags that decide half speed, as /proc/cpuinfo spells them (x86, then Arm).
_HALF_FLAGS = ("avx512_bf16", "amx_bf16", "amx_fp16", "avx512_fp16", "bf16", "fphp")


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

    @property
    def kind(self) -> str:
        """The host kind for this dtype, one of :data:`HOST_KINDS`.

        ``"native"`` when matmul and convolution are both native;
        ``"conv-only"`` when oneDNN supports the dtype but the probe found it
        slower than native (oneDNN emulates it: its matmuls take
        :attr:`matmul_ratio` times fp32's time); ``"none"`` when oneDNN does
        not support it, or when a forced answer says not native.
        """
        if self.matmul and self.conv:
            return "native"
        return "conv-only" if self.onednn else "none"


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
            s = self.of(dtype)
            out[name] = dict(dataclasses.asdict(s), native=self.native(dtype), kind=s.kind)
        return out


def _describe_dtype(s: DtypeSupport) -> str:
    if s.matmul and s.conv:
        verdict = "native"
    elif s.matmul or s.conv:
        verdict = "native for " + ("matmul" if s.matmul else "convolution") + " only"
    else:
        verdict = "not native"
    if s.kind != "native":
        verdict += f", host kind {s.kind}"
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

        >>> s = amp.cpu_half_support()
        >>> s.bfloat16.kind in HOST_KINDS  # "native" with avx512_bf16 or AMX
        True
        >>> s.native(torch.float16) == (s.float16.kind == "native")
        True
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
def override(*, bfloat16: bool | DtypeSupport | None = None,
             float16: bool | DtypeSupport | None = None) -> Iterator[CpuHalfSupport]:
    """Force :func:`cpu_half_support`'s answer inside the block (nestable).

    A dtype given as True is treated as native for matmul and convolution,
    False as not native; a :class:`DtypeSupport` is taken as it is (a
    conv-only host's answer, say, with its probe's ratios); None keeps the
    detected answer (or the enclosing override's). What a session emulates
    is decided at :func:`amp_patch.initialize`, so the block needs to hold
    only that call.

    Args:
        bfloat16 (bool or DtypeSupport, optional): bf16's answer. Default: keep.
        float16 (bool or DtypeSupport, optional): fp16's answer. Default: keep.

    Yields:
        CpuHalfSupport: the forced answer.

    Example::

        >>> with amp_patch.patching.cpu_half.override(bfloat16=False):
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


def _forced(native: bool | DtypeSupport) -> DtypeSupport:
    if isinstance(native, DtypeSupport):
        return native
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
