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

from amp_patch import cpu_half
from amp_patch.dtypes import HALF_DTYPE_NAMES

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
    "autocast_is_slow",
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
    that note: :func:`amp_patch.cpu_half.banner` for the run's half type and
    ``cpu_half_compute="auto"`` (what the levels use), which says whether the
    half matmuls ran natively or emulated, on what host, and why CPU speed
    ratios do not predict GPU speed.

    Args:
        facts (HostFacts): the host.
        half_dtype (str): ``"bf16"`` or ``"fp16"``.

    Returns:
        str or None: the note, three lines.
    """
    if not facts.device.startswith("cpu"):
        return None
    return cpu_half.banner(HALF_DTYPE_NAMES[half_dtype], "auto")


def cpu_half_plan(facts: HostFacts, half_dtype: str) -> dict[str, Any] | None:
    """What ``cpu_half_compute="auto"`` does for the run's half type on this host (JSON-able).

    Returns:
        dict or None: :meth:`amp_patch.cpu_half.CpuHalfPlan.as_dict`; None off the CPU.
    """
    if not facts.device.startswith("cpu"):
        return None
    return cpu_half.plan("auto", HALF_DTYPE_NAMES[half_dtype]).as_dict()


def autocast_is_slow(facts: HostFacts, half_dtype: str) -> bool:
    """True when ``torch.autocast`` would run its half matmuls on a slow path here.

    amp_patch emulates half matmuls only for its own levels; ``torch.autocast``
    is torch's, so on a CPU without native half it runs many times slower
    than fp32.
    """
    if not facts.device.startswith("cpu") or facts.cpu_half is None:
        return False
    return not facts.cpu_half[half_dtype]["native"]
