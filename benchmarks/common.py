"""Shared by the benchmark scripts: machine facts, interleaved timing, and the report file.

Each script owns one section of ``docs/benchmarks.md``, delimited by
``<!-- section:NAME -->`` markers, and rewrites only that section.
"""

from __future__ import annotations

import datetime
import os
import re
import statistics
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import torch

REPORT = Path(__file__).resolve().parent.parent / "docs" / "benchmarks.md"
_HEADER = """# Benchmarks

Written by the scripts in `benchmarks/` (`make bench`). Every row is a ratio
against an anchor measured in the same process run, interleaved, as the median
of several repeats: absolute times on shared machines move from run to run.
Each section states the machine, torch version and date it was measured on.
"""


#: glibc malloc settings read at process start: allocations up to 32 MiB come from the heap,
#: and freed memory stays there, so an iteration's temporaries reuse warm pages.
TUNED_MALLOC = {
    "MALLOC_MMAP_THRESHOLD_": str(32 * 2**20),
    "MALLOC_TRIM_THRESHOLD_": str(16 * 2**30),
    "MALLOC_TOP_PAD_": str(256 * 2**20),
}


def machine() -> str:
    """A one-line description: GPU name or CPU model, threads, native bf16, torch version, date."""
    from amp_patch.cli.host_facts import HostFacts

    facts = HostFacts.collect("cuda" if torch.cuda.is_available() else "cpu")
    return f"{facts.line()}; {datetime.date.today().isoformat()}"


def sync(device: str | torch.device) -> None:
    """Wait for queued work on ``device`` (a no-op on CPU)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def interleaved_median(
    fns: dict[str, Callable[[], object]],
    repeats: int = 7,
    inner: int = 1,
    device: str | torch.device = "cpu",
    warmup: int = 2,
) -> dict[str, float]:
    """Median seconds per call of each function, timed round-robin.

    Each repeat times every function once (``inner`` calls each), in turn, so
    that machine noise falls on all of them alike.

    Args:
        fns (dict): label to zero-argument callable.
        repeats (int, optional): rounds; the median over rounds is reported.
        inner (int, optional): calls per timing, for very short functions.
        device (str, optional): synchronised around each timing.
        warmup (int, optional): untimed rounds first.

    Returns:
        dict: label to median seconds per call.
    """
    times: dict[str, list[float]] = {k: [] for k in fns}
    for r in range(warmup + repeats):
        for label, fn in fns.items():
            sync(device)
            t0 = time.perf_counter()
            for _ in range(inner):
                fn()
            sync(device)
            if r >= warmup:
                times[label].append((time.perf_counter() - t0) / inner)
    return {k: statistics.median(v) for k, v in times.items()}


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A GitHub markdown table."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def write_section(name: str, body: str, path: Path | None = None) -> Path:
    """Replace (or append) section ``name`` of the report with ``body``.

    Args:
        name (str): section id, e.g. ``"kernels-cpu"``.
        body (str): markdown, including the section's own heading.
        path (Path, optional): the report file. Default: ``docs/benchmarks.md``
            (``AMP_PATCH_BENCH_REPORT`` overrides it).

    Returns:
        Path: the file written.
    """
    path = Path(path or os.environ.get("AMP_PATCH_BENCH_REPORT") or REPORT)
    text = path.read_text() if path.exists() else _HEADER
    block = f"<!-- section:{name} -->\n{body.strip()}\n<!-- end:{name} -->"
    pattern = re.compile(rf"<!-- section:{re.escape(name)} -->.*?<!-- end:{re.escape(name)} -->", re.S)
    text = pattern.sub(lambda _: block, text) if pattern.search(text) else text.rstrip() + "\n\n" + block + "\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def publish(name: str, body: str, write: bool = True) -> None:
    """Print a section, and write it into the report unless ``write`` is False."""
    print(body)
    if write:
        print(f"wrote {write_section(name, body)}")


def loss_panels(row: Sequence[Any], curves: Iterable[tuple[str, Sequence[float], dict]],
                steps: int, window: int = 10, title: str = "") -> None:
    """Training-loss curves on a pair of matplotlib axes: the whole run, and its last third
    enlarged, each curve the mean of ``window`` steps.

    Args:
        row: the two axes.
        curves: ``(label, losses of every step, plot style)`` per run.
        steps (int): the runs' length.
        window (int, optional): the smoothing window. Default: 10.
        title (str, optional): put before the axes' titles (``"lm: "``). Default: none.
    """
    first = steps * 2 // 3
    xs = list(range(window, steps + 1))
    tails: list[float] = []
    for label, losses, style in curves:
        smooth = torch.tensor(losses).unfold(0, window, 1).mean(1).tolist()
        for ax in row:
            ax.plot(xs, smooth, label=label, **style)
        tails += smooth[first - window + 1:]
    row[0].set_title(f"{title}training loss (mean of {window} steps)")
    row[1].set_title(f"{title}steps {first}-{steps}, enlarged")
    row[1].set_xlim(first, steps)
    low, high = min(tails), max(tails)
    row[1].set_ylim(low - 0.05 * (high - low), high + 0.05 * (high - low))
    for ax in row:
        ax.set_xlabel("step")
        ax.set_ylabel("loss")
        ax.grid(alpha=0.3)
    row[0].legend(fontsize=7, loc="upper right")
