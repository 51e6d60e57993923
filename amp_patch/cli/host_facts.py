"""The host a measurement ran on, and how busy it was: for ``compare``, ``run`` and the benchmarks.

Speed ratios between opt levels depend on the machine (whether its CPU has
native bf16 matmuls, how many threads ran) and on what else ran beside them.
:class:`HostFacts` records the first, :class:`LoadMonitor` the second, and
:func:`reliability_warnings` says when either makes the ratios unreliable.
:func:`cpu_half_banner` is the one place that words the note about how the
CPU computes in half precision.
"""

from __future__ import annotations

import os
import platform
import resource
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Sequence

import torch

from amp_patch.patching import cpu_half
from amp_patch.settings.dtypes import HALF_DTYPE_NAMES

# The class below has a field named torch; annotations inside it reach the module this way.
_Device = torch.device

__all__ = [
    "LOAD_AVERAGE_LIMIT",
    "OTHERS_SHARE_LIMIT",
    "SPREAD_LIMIT",
    "MIN_ROUNDS",
    "HostFacts",
    "LoadMonitor",
    "cpu_count",
    "relative_spread",
    "reliability_warnings",
    "oversubscribed",
    "cpu_half_banner",
    "cpu_half_plan",
    "AUTOCAST_FACTOR_LIMIT",
    "AutocastCost",
    "autocast_cost",
]

#: The 1-minute load average per usable CPU before the run above which the machine is busy. (After
#: the run it counts compare's own processes too; others_share covers the time in between.)
LOAD_AVERAGE_LIMIT = 0.5
#: The share of the machine's CPU time that other processes took during the measurement,
#: above which it counts as busy (one busy process on a 2-CPU machine takes 0.5).
OTHERS_SHARE_LIMIT = 0.2
#: ``(max - min) / median`` over timed rounds above which a speed or a ratio counts as unsteady.
SPREAD_LIMIT = 0.25
#: Timed rounds a speed needs before it is reported as a figure.
MIN_ROUNDS = 3


def cpu_count() -> int:
    """CPUs this process may run on (its affinity mask where the OS has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _load_average() -> list[float] | None:
    try:
        return [round(v, 2) for v in os.getloadavg()]
    except (AttributeError, OSError):
        return None


@dataclass
class HostFacts:
    """What a measurement's numbers depend on, besides the code.

    Attributes:
        device (str): ``"cpu"`` or ``"cuda:N"``.
        cpu_model (str): the CPU's model name (:func:`amp_patch.cpu_half_support`'s ``cpu``).
        cpus (int): CPUs this process may run on.
        threads (int): torch's intra-op threads in the measuring processes.
        gpu_name (str or None): the CUDA device's name, when the device is one.
        cpu_half (dict or None): on a CPU device,
            :func:`amp_patch.cpu_half_support`'s answer (``.as_dict()``): per
            half dtype, oneDNN's check, the probe's ratios and the verdict.
        torch (str): torch's version.
        python (str): Python's version.
        platform (str): the OS and machine.

    Example::

        >>> HostFacts.collect("cpu").line()  # doctest: +ELLIPSIS
        'CPU ..., ... CPUs, ... threads, bf16 ...native, fp16 ...native; torch ...'
    """

    device: str
    cpu_model: str
    cpus: int
    threads: int
    gpu_name: str | None
    cpu_half: dict[str, Any] | None
    torch: str
    python: str
    platform: str

    @classmethod
    def collect(cls, device: str | _Device = "cpu", threads: int | None = None) -> "HostFacts":
        """The facts of this host.

        Args:
            device (str or torch.device, optional): the device measured. Default: ``"cpu"``.
            threads (int, optional): the measuring processes' torch threads.
                Default: this process's ``torch.get_num_threads()``.
        """
        device = torch.device(device)
        gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else None
        support = cpu_half.cpu_half_support()
        half = support.as_dict() if device.type == "cpu" else None
        return cls(device=str(device), cpu_model=support.cpu, cpus=cpu_count(),
                   threads=threads if threads is not None else torch.get_num_threads(),
                   gpu_name=gpu, cpu_half=half,
                   torch=torch.__version__,
                   python=platform.python_version(),
                   platform=f"{platform.system()} {platform.machine()}")

    def line(self) -> str:
        """One line for a table's caption or a report's header.

        On a CPU device it gives :func:`amp_patch.cpu_half_support`'s verdict
        per half dtype (oneDNN's check confirmed by the probe).
        """
        where = f"GPU {self.gpu_name}; " if self.gpu_name else ""
        parts = [f"CPU {self.cpu_model}", f"{self.cpus} CPUs", f"{self.threads} threads"]
        if self.cpu_half:
            parts += [f"{name} {'native' if self.cpu_half[name]['native'] else 'not native'}"
                      for name in ("bf16", "fp16")]
        return f"{where}{', '.join(parts)}; torch {self.torch}"

    def as_dict(self) -> dict[str, Any]:
        """The facts as a JSON-able dict."""
        return asdict(self)


def _proc_stat_busy() -> tuple[float, float] | None:
    # Busy and total CPU seconds of the whole machine since boot; steal counts as busy, since
    # a hypervisor's neighbours take that time from this machine's CPUs just as local processes do.
    try:
        fields = Path("/proc/stat").read_text().splitlines()[0].split()
    except (OSError, IndexError):
        return None
    if fields[0] != "cpu":
        return None
    ticks = [float(v) for v in fields[1:9]]
    user, nice, system, idle, iowait, irq, softirq, steal = ticks + [0.0] * (8 - len(ticks))
    hz = os.sysconf("SC_CLK_TCK")
    busy = user + nice + system + irq + softirq + steal
    return busy / hz, (busy + idle + iowait) / hz


def _own_cpu_seconds() -> float:
    # This process and its children that have been waited for (the level processes, once joined).
    own = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def _cpu_pressure() -> float | None:
    # The share of the last 10 s in which some runnable task waited for a CPU (Linux PSI).
    try:
        for line in Path("/proc/pressure/cpu").read_text().splitlines():
            if line.startswith("some"):
                return float(line.split("avg10=")[1].split()[0]) / 100
    except (OSError, IndexError, ValueError):
        pass
    return None


@dataclass
class LoadMonitor:
    """How busy the machine was around a measurement.

    It records the load average and CPU pressure before and after, and the
    share of the machine's CPU time that *other* processes took in between:
    all CPU time the OS counted, less this process's and its waited-for
    children's. Call :meth:`stop` after the measuring processes were joined,
    so that their time counts as this measurement's own.

    Attributes:
        load_before, load_after (list of float or None): 1-, 5- and 15-minute load averages.
        pressure_before, pressure_after (float or None): CPU pressure (PSI ``some avg10``), 0 to 1.
        others_share (float or None): other processes' share of the machine's
            CPU time during the measurement, 0 to 1 (Linux only).
        seconds (float): wall time between :meth:`start` and :meth:`stop`.

    Example::

        >>> monitor = LoadMonitor().start()
        >>> ...                                   # measure, then join the worker processes
        >>> monitor.stop().others_share
        0.03
    """

    load_before: list[float] | None = None
    load_after: list[float] | None = None
    pressure_before: float | None = None
    pressure_after: float | None = None
    others_share: float | None = None
    seconds: float = 0.0
    _start: tuple[float, tuple[float, float] | None, float] | None = field(default=None, repr=False)

    def start(self) -> "LoadMonitor":
        """Record the state before the measurement."""
        self.load_before = _load_average()
        self.pressure_before = _cpu_pressure()
        self._start = (time.perf_counter(), _proc_stat_busy(), _own_cpu_seconds())
        return self

    def stop(self) -> "LoadMonitor":
        """Record the state after the measurement and derive :attr:`others_share`."""
        if self._start is None:
            raise RuntimeError("LoadMonitor.stop() before start()")
        t0, stat0, own0 = self._start
        self.seconds = time.perf_counter() - t0
        stat1, own1 = _proc_stat_busy(), _own_cpu_seconds()
        self.load_after = _load_average()
        self.pressure_after = _cpu_pressure()
        if stat0 is not None and stat1 is not None and stat1[1] > stat0[1]:
            others = (stat1[0] - stat0[0]) - (own1 - own0)
            self.others_share = round(min(1.0, max(0.0, others / (stat1[1] - stat0[1]))), 3)
        return self

    def as_dict(self) -> dict[str, Any]:
        """The record as a JSON-able dict."""
        return {k: v for k, v in asdict(self).items() if not k.startswith("_")}

    def line(self) -> str:
        """One line: load averages before and after, other processes' CPU share."""
        def fmt(load):
            return "/".join(f"{v:.2f}" for v in load) if load else "unknown"

        share = "unknown" if self.others_share is None else f"{self.others_share:.0%}"
        return (f"load average (1/5/15 min) before {fmt(self.load_before)}, "
                f"after {fmt(self.load_after)}; other processes took {share} of the CPU time "
                "during the run")


def relative_spread(values: Sequence[float]) -> float | None:
    """``(max - min) / median`` of ``values``, or None for fewer than two."""
    if len(values) < 2:
        return None
    mid = statistics.median(values)
    return (max(values) - min(values)) / mid if mid else None


def oversubscribed(ranks: int, cpus: int) -> str | None:
    """The warning that ``ranks`` processes training at once outnumber the ``cpus``; else None."""
    if ranks <= cpus:
        return None
    return (f"{ranks} ranks per level on {cpus} CPUs: the ranks of a level train at once, "
            "so they take turns on the CPUs and wait for each other in every collective; "
            "the run works, but its speeds say little")


def reliability_warnings(load: LoadMonitor, spreads: dict[str, float | None],
                         cpus: int, ranks: int = 1) -> list[str]:
    """Why the speed ratios of a measurement may not be trusted, one sentence per reason.

    Args:
        load (LoadMonitor): the stopped monitor of the measurement.
        spreads (dict): a name (``"O2 steps/s"``, ``"O2/O0"``) to its :func:`relative_spread`.
        cpus (int): CPUs of the machine, to judge the load average by.
        ranks (int, optional): processes that trained each level at once. Default: 1.

    Returns:
        list of str: empty when nothing was found wrong.
    """
    out = [w for w in (oversubscribed(ranks, cpus),) if w]
    avg = load.load_before
    if avg and avg[0] > LOAD_AVERAGE_LIMIT * cpus:
        out.append(f"the machine was busy before the run: 1-minute load average "
                   f"{avg[0]:.2f} on {cpus} CPUs (limit {LOAD_AVERAGE_LIMIT * cpus:.2f})")
    if load.others_share is not None and load.others_share > OTHERS_SHARE_LIMIT:
        out.append(f"other processes took {load.others_share:.0%} of the machine's CPU time "
                   f"during the run (limit {OTHERS_SHARE_LIMIT:.0%})")
    wide = {k: v for k, v in spreads.items() if v is not None and v > SPREAD_LIMIT}
    if wide:
        listed = ", ".join(f"{k} {v:.0%}" for k, v in sorted(wide.items(), key=lambda kv: -kv[1]))
        out.append(f"speeds moved by more than {SPREAD_LIMIT:.0%} between rounds "
                   f"(max-min over median): {listed}")
    return out


def cpu_half_banner(facts: HostFacts, half_dtype: str) -> str | None:
    """The note on how this host computes in half precision on the CPU; None off the CPU.

    This is the one place where ``compare``, ``run`` and the benchmarks get
    that note: :func:`amp_patch.patching.cpu_half.banner` for the run's half type and
    ``cpu_half_compute="auto"`` (what the levels use), which says whether the
    half matmuls ran natively or emulated, on what host, and why CPU speed
    ratios do not predict GPU speed; on a host without native half, a fourth
    line says what ``torch.autocast`` costs there (:meth:`AutocastCost.describe`).

    Args:
        facts (HostFacts): the host.
        half_dtype (str): ``"bf16"`` or ``"fp16"``.

    Returns:
        str or None: the note, three or four lines.
    """
    if not facts.device.startswith("cpu"):
        return None
    text = cpu_half.banner(HALF_DTYPE_NAMES[half_dtype], "auto")
    cost = autocast_cost(facts, half_dtype)
    if cost is not None and cost.kind != "native":
        text += f"\n{cost.describe()}."
    return text


def cpu_half_plan(facts: HostFacts, half_dtype: str) -> dict[str, Any] | None:
    """What ``cpu_half_compute="auto"`` does for the run's half type on this host (JSON-able).

    Returns:
        dict or None: :meth:`amp_patch.patching.cpu_half.CpuHalfPlan.as_dict`; None off the CPU.
    """
    if not facts.device.startswith("cpu"):
        return None
    return cpu_half.plan("auto", HALF_DTYPE_NAMES[half_dtype]).as_dict()


#: The most times fp32's matmul time that torch.autocast's half matmuls may take on this host for
#: ``compare`` to run it among its default levels. autocast's step time over O0's is at most about
#: that factor (only its matmuls and convolutions run in half); on a conv-only host (about 2.8x
#: on a real one, 4.8x forced on a native one) ``make demo`` then stays within 90 s
#: (docs/benchmarks.md, section demo-hosts). On a host without oneDNN's half support the factor
#: is 100 or more, and the run would take many minutes.
AUTOCAST_FACTOR_LIMIT = 8.0


@dataclass(frozen=True)
class AutocastCost:
    """What ``torch.autocast`` costs on this CPU, and whether ``compare`` runs it by default.

    amp_patch emulates half matmuls for its own levels on a host without
    native ones (:mod:`amp_patch.patching.cpu_half`); ``torch.autocast`` is torch's, so it
    runs them as the host does. This is the one place that words that cost,
    for ``compare`` (its notes, the table's caption), the banner and ``doctor``.

    Attributes:
        half_dtype (str): ``"bf16"`` or ``"fp16"``.
        kind (str): the host kind for that dtype
            (:data:`amp_patch.patching.cpu_half.HOST_KINDS`).
        factor (float or None): the detection probe's half matmul time over
            fp32's; None where it was not measured (oneDNN has no support, or
            the answer was forced).

    Example::

        >>> cost = AutocastCost("bf16", "conv-only", 4.8)  # as autocast_cost gives on one
        >>> cost.included
        True
        >>> cost.describe()  # doctest: +ELLIPSIS
        "torch.autocast's bf16 matmuls take 4.8x fp32's time on this host (kind conv-only: ..."
        >>> AutocastCost("bf16", "none", None).included
        False
    """

    half_dtype: str
    kind: str
    factor: float | None

    @property
    def included(self) -> bool:
        """True when ``compare`` runs torch.autocast among its default levels here: wherever its
        half matmuls run natively, or at most :data:`AUTOCAST_FACTOR_LIMIT` times fp32's time."""
        if self.kind == "native":
            return True
        return self.factor is not None and self.factor <= AUTOCAST_FACTOR_LIMIT

    def describe(self) -> str:
        """One sentence: how torch.autocast computes in half on this host, with the measured factor.
        """
        h = self.half_dtype
        if self.kind == "native":
            measured = (f" (the probe: {self.factor:.1f}x fp32's time on one thread)"
                        if self.factor is not None else "")
            return f"torch.autocast runs its {h} matmuls natively on this CPU{measured}"
        if self.factor is not None:
            return (f"torch.autocast's {h} matmuls take {self.factor:.1f}x fp32's time on this "
                    f"host (kind {self.kind}: measured here; oneDNN emulates {h}), and amp_patch "
                    "does not emulate them for it, since autocast is torch's own: expect its "
                    f"steps to take up to about {self.factor:.1f}x O0's")
        why = (f"oneDNN has no {h} support on this CPU" if self.kind == "none"
               else f"this CPU's {h} is forced not native")
        return (f"torch.autocast's {h} matmuls take ATen's slow path on this host (kind "
                f"{self.kind}: {why}), tens to hundreds of times fp32's time (docs/compare.md), "
                "and amp_patch does not emulate them for it, since autocast is torch's own")

    def label(self) -> str | None:
        """The table caption's line on an autocast row that ran here; None on a native host."""
        if self.kind == "native":
            return None
        cost = (f"at {self.factor:.1f}x fp32's time" if self.factor is not None
                else "on ATen's slow path (tens to hundreds of times fp32's time)")
        return (f"autocast: torch's own, not emulated: its {self.half_dtype} matmuls ran {cost} "
                f"on this host (kind {self.kind}), so its speed-up is this CPU's, not a GPU's")

    def note(self) -> str | None:
        """``compare``'s note where it leaves torch.autocast out of its default levels; None where
        it runs it (:attr:`included`)."""
        if self.included:
            return None
        return (f"torch.autocast is left out: {self.describe()}. Name it in --levels to run it "
                "anyway.")


def autocast_cost(facts: HostFacts, half_dtype: str) -> AutocastCost | None:
    """What ``torch.autocast`` in ``half_dtype`` costs on the measured host; None off the CPU.

    It reads the host's detection as recorded in ``facts`` (the same answer
    that decided the levels' emulation), so a test can rebuild it from a
    run's JSON.

    Args:
        facts (HostFacts): the host.
        half_dtype (str): ``"bf16"`` or ``"fp16"``.

    Example::

        >>> cost = autocast_cost(HostFacts.collect("cpu"), "bf16")
        >>> cost.kind in amp_patch.patching.cpu_half.HOST_KINDS
        True
    """
    if not facts.device.startswith("cpu") or facts.cpu_half is None:
        return None
    d = facts.cpu_half[half_dtype]
    kind = d.get("kind") or cpu_half.DtypeSupport(
        d["onednn"], d["matmul"], d["conv"], d["matmul_ratio"], d["conv_ratio"]).kind
    return AutocastCost(half_dtype, kind, d["matmul_ratio"])
