"""``amp-patch compare``: train one model under O0-O3 and torch.autocast, side by side.

Every level trains in its own persistent process, from the same seed on the
same batches, and the levels are timed round-robin (:mod:`amp_patch.cli.rounds`,
shared with ``benchmarks/bench_e2e.py``). Each speed is the median over the
timed rounds, with the min-max over rounds beside it; the host and its load
are recorded, and a warning is printed when they make the ratios unreliable.
With ``--nproc N`` each level trains data-parallel over N ranks of its own
(:mod:`amp_patch.cli.ranks`), and every rank's peak memory is reported.
"""

from __future__ import annotations

import argparse
import inspect
import io
import json
import math
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from amp_patch.cli import machine, models, ranks
from amp_patch.cli.options import UsageError, check_output_dir, check_output_file, parse_device
from amp_patch.cli.progress import make_progress
from amp_patch.cli.rounds import JobSpec, LevelRecord, measure, split_steps
from amp_patch.cli.trainer import LEVELS
from amp_patch.dtypes import HALF_DTYPE_NAMES

__all__ = ["LEVELS", "DEMO_STEPS", "FULL_STEPS", "LevelResult", "Comparison", "add_parser",
           "run_compare", "render_table", "write_plot", "validate", "check_model"]

#: Steps per level by default: the demo size, a few minutes of CPU time at most.
DEMO_STEPS = 60
#: Steps per level with ``--full``: the loss curves of docs/compare.md.
FULL_STEPS = 100

DESCRIPTION = f"""\
Train one model under O0, O1, O2, O3 and torch.autocast (with
torch.amp.GradScaler when the half type is fp16), each level in its own
process, from the same seed on the same synthetic batches. Then print a table:
steps/s and speed-up over O0 (median over timed rounds, min-max beside it),
peak memory, final loss, the largest |loss - O0 loss| over the run, skipped
(overflow) steps and the final loss scale.

Timing: every level process builds its model and trains --warmup untimed
steps; then, in each of --rounds timed rounds, the levels train their share
of the remaining steps in turn (round-robin, the first level rotating), so
that other load on the machine falls on all of them alike. A speed needs at
least {machine.MIN_ROUNDS} timed rounds to be shown. The host (CPU or GPU, threads,
native bf16), torch's version and the load average before and after are
recorded; a warning says when the load, or the spread between rounds, makes
the ratios unreliable.

Peak memory is torch.cuda.max_memory_allocated on CUDA; on CPU it is the
process's peak anonymous resident memory (heap, sampled after forward,
backward and step) above its value before the model was built.

--nproc N trains every level data-parallel over N processes (ranks) of its
own process group, launched here as torchrun --standalone would (gloo on
the CPU, NCCL with one GPU per rank on CUDA): --strategy ddp (the default)
wraps the model in DistributedDataParallel, --strategy fsdp2 shards it with
FSDP2's fully_shard. Each rank trains on its 1/N of every global batch
(--batch-size is the global batch) with the CPUs shared out among the
ranks; the loss shown is that of the whole batch, and peak memory is taken
in every rank: the table shows the largest and each rank's, the JSON and
the plot each rank's. Rank 0 reports; the others print nothing.

--model takes a built-in name (lm: a small GPT-style transformer LM, the
default; mlp; convnet: a conv net with BatchNorm) or pkg.module:factory, a
function returning (model, optimizer, batch_fn, loss_fn), where batch_fn(step)
returns the batch of a step and loss_fn(model, batch) the scalar loss. The
factory may take the keyword arguments device, batch_size and seed. Bad
options end with exit status 2 before any process starts; the exit status
is 1 if any level failed.
"""

EPILOG = f"""\
examples:
  amp-patch compare                                  # built-in LM, all levels, {DEMO_STEPS} steps
  amp-patch compare --full --out out/                # {FULL_STEPS} steps, into out/: table.txt,
                                                     # results.json and compare.png
  amp-patch compare --model mlp --steps 50 --levels O0 O2 autocast
  amp-patch compare --model convnet --json r.json --plot r.png
  amp-patch compare --nproc 2 --out out/             # each level over 2 DDP ranks
  amp-patch compare --nproc 4 --strategy fsdp2 --levels O0 O2 O3
  amp-patch compare --model mypkg.models:make_workload --device cuda --half-dtype fp16
  amp-patch compare | tee log.txt                    # plain progress lines when not on a terminal
"""

_MODEL_CONTRACT = ("factory(device=..., batch_size=..., seed=...) -> (model, optimizer, "
                   "batch_fn, loss_fn); it may take any of those keywords")


@dataclass
class LevelResult:
    """What one level's run produced (or how it failed).

    Attributes:
        level (str): ``"O0"`` ... ``"O3"`` or ``"autocast"``.
        ok (bool): the run finished.
        error (str or None): the traceback when it did not.
        steps_per_s (float or None): median over timed rounds of the
            round's steps per second; None with fewer than
            :data:`~amp_patch.cli.machine.MIN_ROUNDS` rounds.
        steps_per_s_range (list of float or None): min and max over rounds.
        round_steps_per_s (list of float): every timed round's steps per second.
        speedup_vs_O0 (float or None): median over rounds of this level's
            round speed over O0's in the same round.
        speedup_range (list of float or None): min and max of those ratios.
        peak_memory_bytes (int or None): peak over the timed rounds; see
            ``memory_kind``. Over several ranks, the largest rank's.
        round_peak_bytes (list of int): each timed round's peak (of the largest rank).
        rank_peak_memory_bytes (list of int or None): over several ranks,
            each rank's peak over the timed rounds, by rank; else None.
        round_rank_peak_bytes (list of list of int): over several ranks, each
            timed round's peak of each rank.
        memory_kind (str): ``"cuda_max_allocated"`` or ``"cpu_peak_anon_rss_delta"``.
        losses (list of float): the loss of every step, warm-up included.
        loss_scales (list of float): the loss scale after every step (1.0 when none is used).
        skipped (list of int): steps whose optimizer step was skipped (overflow).
        max_abs_loss_diff_vs_O0 (float or None): max over steps of ``|loss - O0 loss|``.
        warmup_steps (int): untimed steps before the rounds.
        threads (int or None): torch threads of the level's process.
    """

    level: str
    ok: bool = False
    error: str | None = None
    steps_per_s: float | None = None
    steps_per_s_range: list[float] | None = None
    round_steps_per_s: list[float] = field(default_factory=list)
    speedup_vs_O0: float | None = None
    speedup_range: list[float] | None = None
    peak_memory_bytes: int | None = None
    round_peak_bytes: list[int] = field(default_factory=list)
    rank_peak_memory_bytes: list[int] | None = None
    round_rank_peak_bytes: list[list[int]] = field(default_factory=list)
    memory_kind: str = ""
    losses: list[float] = field(default_factory=list)
    loss_scales: list[float] = field(default_factory=list)
    skipped: list[int] = field(default_factory=list)
    max_abs_loss_diff_vs_O0: float | None = None
    warmup_steps: int = 0
    threads: int | None = None

    @classmethod
    def from_record(cls, record: LevelRecord) -> "LevelResult":
        """The result of a level from what its process reported."""
        speeds = record.round_speeds
        enough = len(speeds) >= machine.MIN_ROUNDS
        peaks = record.round_peak_bytes
        rank_rounds = record.round_rank_peak_bytes
        rank_peaks = ([max(by_rank) for by_rank in zip(*rank_rounds)] if rank_rounds
                      else record.rank_peak_bytes or None)
        return cls(level=record.level, ok=record.ok, error=record.error,
                   steps_per_s=statistics.median(speeds) if enough else None,
                   steps_per_s_range=[min(speeds), max(speeds)] if speeds else None,
                   round_steps_per_s=speeds,
                   peak_memory_bytes=max(peaks) if peaks else record.peak_bytes,
                   round_peak_bytes=peaks, rank_peak_memory_bytes=rank_peaks,
                   round_rank_peak_bytes=rank_rounds, memory_kind=record.memory_kind,
                   losses=record.losses,
                   loss_scales=record.loss_scales, skipped=record.skipped,
                   warmup_steps=record.warmup_steps, threads=record.threads)

    @property
    def final_loss(self) -> float | None:
        return self.losses[-1] if self.losses else None

    @property
    def final_loss_scale(self) -> float | None:
        return self.loss_scales[-1] if self.loss_scales else None

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(final_loss=self.final_loss, final_loss_scale=self.final_loss_scale,
                 skipped_steps=len(self.skipped))
        return _finite_or_none(d)


@dataclass
class Comparison:
    """A whole run of ``compare``: the levels' results and the conditions they were measured in.

    Attributes:
        results (list of LevelResult): in the order the levels were asked for.
        host (HostFacts): the machine.
        load (LoadMonitor): the load around the run.
        rounds (list of int): steps per level in each timed round.
        warnings (list of str): why the speed ratios may not be trusted.
        nproc (int): ranks per level.
        strategy (str or None): ``"ddp"`` or ``"fsdp2"`` when the levels ran over ranks.
    """

    results: list[LevelResult]
    host: machine.HostFacts
    load: machine.LoadMonitor
    rounds: list[int]
    warnings: list[str] = field(default_factory=list)
    nproc: int = 1
    strategy: str | None = None

    def spreads(self) -> dict[str, float | None]:
        """Relative spread over rounds of every level's speed and speed-up."""
        out: dict[str, float | None] = {}
        for r in self.results:
            if r.ok and r.steps_per_s is not None:
                out[f"{r.level} steps/s"] = machine.relative_spread(r.round_steps_per_s)
                if r.level != "O0" and r.speedup_range is not None and r.speedup_vs_O0:
                    low, high = r.speedup_range
                    out[f"{r.level}/O0"] = (high - low) / r.speedup_vs_O0
        return out


def _finite_or_none(obj: Any) -> Any:
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite_or_none(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_finite_or_none(v) for v in obj]
    return obj


def _derive(results: list[LevelResult]) -> None:
    base = next((r for r in results if r.level == "O0" and r.ok), None)
    if base is None:
        return
    for r in results:
        if not r.ok:
            continue
        # Ratios within a round: both levels ran minutes apart at most, under the same load.
        ratios = [a / b for a, b in zip(r.round_steps_per_s, base.round_steps_per_s) if b > 0]
        measured = r.steps_per_s is not None and base.steps_per_s is not None
        if measured and len(ratios) >= machine.MIN_ROUNDS:
            r.speedup_vs_O0 = statistics.median(ratios)
            r.speedup_range = [min(ratios), max(ratios)]
        diffs = [abs(a - b) for a, b in zip(r.losses, base.losses)]
        r.max_abs_loss_diff_vs_O0 = max(diffs) if diffs else None


def run_compare(job: dict[str, Any], levels: list[str], console=None,
                progress_interval: float = 5.0) -> Comparison:
    """Train every level in its own process, timed round-robin, with progress on ``console``.

    Args:
        job (dict): ``model``, ``steps``, ``warmup``, ``rounds``,
            ``batch_size``, ``device``, ``half_dtype`` (``"bf16"``/``"fp16"``) and
            ``seed``; optionally ``strategy`` (``"ddp"``/``"fsdp2"``: each level
            over ``nproc`` ranks) and ``nproc``.
        levels (list of str): a subset of :data:`LEVELS`.
        console (rich.console.Console, optional): where progress goes. Default: stdout.
        progress_interval (float, optional): least seconds between plain
            progress lines of one level when ``console`` is not a terminal. Default: 5.

    Returns:
        Comparison: the results, the host, the load and the warnings.

    Example::

        >>> job = dict(model="mlp", steps=20, warmup=2, rounds=6, batch_size=None,
        ...            device="cpu", half_dtype="bf16", seed=0)
        >>> comparison = run_compare(job, ["O0", "O2"])
        >>> comparison.results[1].speedup_vs_O0
        1.8
    """
    from rich.console import Console

    console = console or Console()
    strategy, nproc = job.get("strategy"), job.get("nproc", 1)
    spec = JobSpec(job["model"], device=job["device"], half_dtype=job["half_dtype"],
                   seed=job["seed"], batch_size=job["batch_size"], report_steps=True,
                   strategy=strategy, nproc=nproc)
    rounds = split_steps(job["steps"] - job["warmup"], job["rounds"])
    load = machine.LoadMonitor().start()
    with make_progress(levels, job["steps"], console, "compare", progress_interval) as progress:
        failed: set[str] = set()

        def tell_failures(records: dict[str, LevelRecord]) -> None:
            for lv, rec in records.items():
                if not rec.ok and lv not in failed:
                    failed.add(lv)
                    progress.status(lv, "FAILED", done=True)

        def ready(records: dict[str, LevelRecord]) -> None:
            tell_failures(records)
            for lv, rec in records.items():
                if rec.ok:
                    progress.status(lv, "ready")

        records = measure(spec, levels, job["warmup"], rounds, on_step=progress.step,
                          on_round=lambda r, recs: tell_failures(recs), on_ready=ready)
        results = [LevelResult.from_record(records[lv]) for lv in levels]
        for r in results:
            if r.ok:
                speed = f"{r.steps_per_s:.2f} steps/s, " if r.steps_per_s is not None else ""
                progress.status(r.level, f"done: {speed}final loss {r.final_loss:.4f}", done=True)
    load.stop()
    _derive(results)
    threads = next((r.threads for r in results if r.threads), torch.get_num_threads())
    host = machine.HostFacts.collect(job["device"], threads)
    comparison = Comparison(results, host, load, rounds, nproc=nproc, strategy=strategy)
    comparison.warnings = machine.reliability_warnings(load, comparison.spreads(), host.cpus,
                                                       ranks=nproc if strategy else 1)
    return comparison


# --------------------------------------------------------------------------- output


def _fmt(value: float | None, spec: str, suffix: str = "") -> str:
    if value is None:
        return "-"
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return f"{value:{spec}}{suffix}"


def _with_range(value: float | None, bounds: list[float] | None, spec: str,
                suffix: str = "") -> str:
    if value is None:
        return "n/a"
    text = f"{value:{spec}}{suffix}"
    if bounds is not None:
        text += f" ({bounds[0]:{spec}}-{bounds[1]:{spec}})"
    return text


def _memory(r: LevelResult) -> str:
    if r.peak_memory_bytes is None:
        return "-"
    return f"{r.peak_memory_bytes / 2**20:.0f} MiB"


def _rank_memory(r: LevelResult) -> str:
    peaks = [b / 2**20 for b in r.rank_peak_memory_bytes or []]
    if not peaks:
        return "-"
    if len(peaks) > 4:  # a column of eight figures reads worse than its range
        return f"{min(peaks):.0f}-{max(peaks):.0f} MiB"
    return "/".join(f"{p:.0f}" for p in peaks) + " MiB"


def ranks_line(comparison: Comparison) -> str | None:
    """The caption line that says how the levels ran over ranks; None for one process each."""
    if comparison.strategy is None:
        return None
    name = {"ddp": "DistributedDataParallel", "fsdp2": "FSDP2's fully_shard"}[comparison.strategy]
    return (f"each level over {comparison.nproc} rank{'s' * (comparison.nproc > 1)} "
            f"({name}), each on its 1/{comparison.nproc} of every global batch; "
            "peak mem is the largest rank's, per rank lists rank 0, 1, ...")


def render_table(comparison: Comparison, title: str):
    """A :class:`rich.table.Table`: a row per level, the conditions in its caption."""
    from rich import box
    from rich.table import Table
    from rich.text import Text

    by_rank = comparison.strategy is not None
    headers = ("level", "steps/s (min-max)", "speed-up (min-max)", "peak mem",
               *(("per rank",) if by_rank else ()),
               "final loss", "max |Δloss|", "skipped", "scale")
    rows = []
    for r in comparison.results:
        if not r.ok:
            rows.append([r.level, *["-"] * (len(headers) - 2), "[red]FAILED"])
            continue
        rows.append([
            r.level, _with_range(r.steps_per_s, r.steps_per_s_range, ".2f"),
            _with_range(r.speedup_vs_O0, None if r.level == "O0" else r.speedup_range, ".2f", "x"),
            _memory(r), *((_rank_memory(r),) if by_rank else ()),
            _fmt(r.final_loss, ".4f"), _fmt(r.max_abs_loss_diff_vs_O0, ".2e"), str(len(r.skipped)),
            _fmt(r.final_loss_scale, "g")])
    warmup = next((r.warmup_steps for r in comparison.results if r.ok), 0)
    caption = [f"{len(comparison.rounds)} timed rounds of {_steps_per_round(comparison.rounds)} "
               f"steps per level after {warmup} warm-up steps; speeds are medians over rounds, "
               "speed-up and max |Δloss| are against O0 (per round, per step)",
               *filter(None, [ranks_line(comparison)]),
               comparison.host.line(), comparison.load.line()]
    if len(comparison.rounds) < machine.MIN_ROUNDS:
        caption.append(f"n/a: a speed needs at least {machine.MIN_ROUNDS} timed rounds, this run "
                       f"had {len(comparison.rounds)} (raise --steps or --rounds)")
    table = Table(title=title, box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True,
                  caption="\n".join(caption))
    for i, name in enumerate(headers):
        # Wide enough for every cell, so a narrow terminal never turns numbers into ellipses.
        width = max([len(name)] + [len(Text.from_markup(row[i]).plain) for row in rows])
        table.add_column(name, justify="left" if i == 0 else "right", no_wrap=True, min_width=width)
    for row in rows:
        table.add_row(*row)
    return table


def _steps_per_round(rounds: list[int]) -> str:
    if not rounds:
        return "0"
    return str(rounds[0]) if min(rounds) == max(rounds) else f"{min(rounds)}-{max(rounds)}"


_STYLES = {"O0": ("black", "-", 2.2), "O1": ("tab:blue", "-", 1.4), "O2": ("tab:orange", "-", 1.4),
           "O3": ("tab:red", "-", 1.4), "autocast": ("tab:green", "--", 1.6)}


def write_plot(comparison: Comparison, path: Path, title: str) -> None:
    """Write a PNG: loss and loss scale against step, speed and memory per level with their spread.

    Skipped steps are marked with an ``x`` on the loss curve. The speed panel
    shows each level's median steps/s as a bar, the min-max over rounds as
    an error bar and every round as a dot; the memory panel the peak as a
    bar and every round's peak as a dot; over several ranks, the largest
    rank's peak as a bar and each rank's peak as a dot.

    Args:
        comparison (Comparison): the run; failed levels are left out.
        path (Path): the PNG to write.
        title (str): the figure's title.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = [r for r in comparison.results if r.ok]
    fig = plt.figure(figsize=(9, 10.5))
    grid = fig.add_gridspec(3, 2, height_ratios=[3, 1.4, 2])
    ax_loss = fig.add_subplot(grid[0, :])
    ax_scale = fig.add_subplot(grid[1, :], sharex=ax_loss)
    ax_speed, ax_mem = fig.add_subplot(grid[2, 0]), fig.add_subplot(grid[2, 1])
    for r in results:
        color, ls, lw = _STYLES.get(r.level, (None, "-", 1.4))
        steps = range(len(r.losses))
        ax_loss.plot(steps, r.losses, color=color, ls=ls, lw=lw, label=r.level)
        if r.skipped:
            ax_loss.plot(r.skipped, [r.losses[i] for i in r.skipped], "x", color=color, ms=7,
                         label=f"{r.level} skipped step")
        ax_scale.step(steps, r.loss_scales, where="post", color=color, ls=ls, lw=lw, label=r.level)
    ax_loss.set_ylabel("training loss")
    ax_loss.set_title(title, fontsize=10)
    ax_loss.grid(alpha=0.3)
    ax_loss.legend(ncol=2, fontsize=9)
    scales = {v for r in results for v in r.loss_scales}
    if len(scales) == 1:
        # A flat line reads as "nothing plotted"; say what it means.
        ax_scale.text(0.5, 0.75, f"loss scale {scales.pop():g} throughout, at every level",
                      transform=ax_scale.transAxes, ha="center", fontsize=9, color="dimgray")
    ax_scale.set_yscale("log", base=2)
    ax_scale.set_ylabel("loss scale")
    ax_scale.set_xlabel("step")
    ax_scale.grid(alpha=0.3)
    _spread_panel(ax_speed, results, lambda r: r.round_steps_per_s, lambda r: r.steps_per_s,
                  "steps/s (median, min-max, rounds)", 1.0)
    if len(comparison.rounds) < machine.MIN_ROUNDS:
        ax_speed.text(0.5, 0.5, f"fewer than {machine.MIN_ROUNDS} timed rounds:\nno speed figures",
                      transform=ax_speed.transAxes, ha="center", va="center", color="dimgray")
    if comparison.strategy is not None:
        _spread_panel(ax_mem, results, lambda r: r.rank_peak_memory_bytes or [],
                      lambda r: r.peak_memory_bytes,
                      "peak MiB per rank (largest, ranks)", 2**20)
    else:
        _spread_panel(ax_mem, results, lambda r: r.round_peak_bytes,
                      lambda r: r.peak_memory_bytes, "peak memory, MiB (peak, rounds)", 2**20)
    if comparison.warnings:
        reasons = "; ".join(w.split(":")[0] for w in comparison.warnings)
        fig.text(0.5, 0.005, f"warning, speed ratios unreliable: {reasons}", ha="center",
                 va="bottom", fontsize=7, color="tab:red", wrap=True)
    fig.tight_layout(rect=(0, 0.03 if comparison.warnings else 0, 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _spread_panel(ax, results: list[LevelResult], rounds_of, value_of, label: str,
                  unit: float) -> None:
    for i, r in enumerate(results):
        color = _STYLES.get(r.level, (None,))[0]
        rounds = [v / unit for v in rounds_of(r)]
        value = value_of(r)
        if value is not None:
            value /= unit
            ax.bar(i, value, color=color, alpha=0.35, width=0.6)
            if rounds:
                ax.errorbar(i, value, yerr=[[value - min(rounds)], [max(rounds) - value]],
                            color=color, capsize=4, lw=1.2)
        if rounds:
            ax.plot([i] * len(rounds), rounds, ".", color=color, ms=4)
    ax.set_xticks(range(len(results)), [r.level for r in results])
    ax.set_ylabel(label, fontsize=9)
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3, axis="y")


# --------------------------------------------------------------------------- command line


def _level(text: str) -> str:
    for name in LEVELS:
        if text.lower() == name.lower():
            return name
    raise argparse.ArgumentTypeError(f"invalid level {text!r} (choose from {', '.join(LEVELS)})")


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register the ``compare`` subcommand."""
    p = subparsers.add_parser(
        "compare",
        help="train a model under O0-O3 and torch.autocast and compare speed, memory, loss",
        description=DESCRIPTION, epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="lm", metavar="NAME|MODULE:FACTORY",
                   help="lm (default), mlp, convnet, or pkg.module:factory")
    p.add_argument("--steps", type=int, default=None,
                   help=f"steps per level (default: {DEMO_STEPS}, {FULL_STEPS} with --full)")
    p.add_argument("--full", action="store_true",
                   help=f"the full-size run of docs/compare.md: {FULL_STEPS} steps per level")
    p.add_argument("--warmup", type=int, default=None,
                   help="untimed steps per level before the rounds (default: steps // 10, 1 to 5)")
    p.add_argument("--rounds", type=int, default=8,
                   help="timed rounds the remaining steps are split into (default: 8)")
    p.add_argument("--batch-size", type=int, default=None, help="batch size (default: the model's)")
    p.add_argument("--device", default=None, help="cpu or cuda[:N] (default: cuda if available)")
    p.add_argument("--half-dtype", choices=sorted(HALF_DTYPE_NAMES), default=None,
                   help="the half type (default: fp16 on CUDA, bf16 on CPU)")
    p.add_argument("--levels", nargs="+", type=_level, default=None, metavar="LEVEL",
                   help=f"levels to run, from {' '.join(LEVELS)} (default: all; autocast is "
                        "left out on a CPU without native half)")
    p.add_argument("--nproc", type=int, default=1, metavar="N",
                   help="train each level data-parallel over N ranks on this machine (default: 1, "
                        "one process per level)")
    p.add_argument("--strategy", choices=ranks.STRATEGIES, default=None,
                   help="how the ranks share the model: ddp (DistributedDataParallel, the default "
                        "with --nproc) or fsdp2 (fully_shard); given with --nproc 1, one rank")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights and data (default: 0)")
    p.add_argument("--json", type=Path, metavar="PATH", help="write the results as JSON")
    p.add_argument("--plot", type=Path, metavar="PATH",
                   help="write loss, loss-scale, speed and memory panels as PNG")
    p.add_argument("--out", type=Path, metavar="DIR",
                   help="write table.txt, results.json and compare.png into DIR")
    p.add_argument("--progress-interval", type=float, default=5.0, metavar="S",
                   help="seconds between progress lines of a level when stdout is not a terminal "
                        "(default: 5)")
    p.set_defaults(func=_main, parser=p)
    return p


def check_model(spec: str) -> None:
    """Check in this process that ``spec`` names a usable model factory.

    A built-in name passes. ``pkg.module:factory`` is imported and its
    signature checked: every parameter without a default must be one that
    compare passes (``device``, ``batch_size``, ``seed``).

    Args:
        spec (str): the ``--model`` value.

    Raises:
        UsageError: naming what is wrong, the expected syntax and the factory's contract.
    """
    if spec in models.BUILTIN:
        return
    expected = (f"expected a built-in model ({', '.join(models.BUILTIN)}) or pkg.module:factory, "
                f"where {_MODEL_CONTRACT}")
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise UsageError(f"--model {spec!r}: {expected}")
    try:
        factory = models.resolve(spec)
    except ImportError as exc:
        raise UsageError(f"--model {spec!r}: cannot import module {module_name!r} ({exc}); the "
                         f"working directory is on the path. {expected}") from None
    except AttributeError:
        raise UsageError(f"--model {spec!r}: module {module_name!r} has no attribute {attr!r}; "
                         f"{expected}") from None
    except TypeError as exc:
        raise UsageError(f"--model {spec!r}: {exc}; {expected}") from None
    try:
        signature = inspect.signature(factory)
    except (TypeError, ValueError):
        return
    passed = {"device", "batch_size", "seed"}
    needed = [name for name, p in signature.parameters.items()
              if p.default is inspect.Parameter.empty and name not in passed
              and p.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)]
    if needed:
        raise UsageError(f"--model {spec!r}: the factory {attr}{signature} needs "
                         f"{', '.join(needed)}, which compare cannot pass; "
                         f"expected {_MODEL_CONTRACT}")


def validate(ns: argparse.Namespace) -> dict[str, Any]:
    """Check every option before any process starts; return the job.

    Raises:
        UsageError: a bad value, with what was expected.
    """
    steps = ns.steps if ns.steps is not None else (FULL_STEPS if ns.full else DEMO_STEPS)
    if steps < 1:
        raise UsageError(f"--steps must be at least 1, got {steps}")
    if ns.rounds < 1:
        raise UsageError(f"--rounds must be at least 1, got {ns.rounds}")
    if ns.warmup is not None and not 0 <= ns.warmup < steps:
        raise UsageError(f"--warmup must be at least 0 and less than --steps ({steps}), "
                         f"got {ns.warmup}")
    if ns.batch_size is not None and ns.batch_size < 1:
        raise UsageError(f"--batch-size must be at least 1, got {ns.batch_size}")
    if ns.progress_interval < 0:
        raise UsageError(f"--progress-interval must not be negative, got {ns.progress_interval}")
    device = (parse_device(ns.device) if ns.device else
              torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    if ns.out is not None:
        check_output_dir(ns.out)
    for option, path in (("--json", ns.json), ("--plot", ns.plot)):
        if path is not None:
            check_output_file(path, option)
    # As with `python -m`, modules in the working directory can name a --model factory.
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    check_model(ns.model)
    strategy = _check_ranks(ns, device)
    warmup = ns.warmup if ns.warmup is not None else min(5, max(1, steps // 10)) if steps > 1 else 0
    half = ns.half_dtype or ("fp16" if device.type == "cuda" else "bf16")
    return dict(model=ns.model, steps=steps, warmup=warmup, rounds=ns.rounds,
                batch_size=ns.batch_size, device=str(device), half_dtype=half, seed=ns.seed,
                nproc=ns.nproc, strategy=strategy)


def _check_ranks(ns: argparse.Namespace, device: torch.device) -> str | None:
    """The strategy ``--nproc`` and ``--strategy`` ask for (None: one process per level)."""
    nproc = ns.nproc
    if nproc < 1:
        raise UsageError(f"--nproc must be at least 1 (ranks per level), got {nproc}")
    strategy = ns.strategy or ("ddp" if nproc > 1 else None)
    if strategy is None:
        return None
    if device.type == "cuda":
        if device.index is not None:
            raise UsageError(f"--device {ns.device}: over ranks, rank r takes GPU cuda:r; "
                             "pass --device cuda (CUDA_VISIBLE_DEVICES chooses the GPUs)")
        count = torch.cuda.device_count()
        if nproc > count:
            raise UsageError(f"--nproc {nproc}: NCCL needs a GPU per rank and {count} are "
                             f"visible; expected at most {count}")
    rows = ns.batch_size or models.default_batch_size(ns.model)
    if rows is not None and rows % nproc:
        source = "--batch-size" if ns.batch_size else f"the default of --model {ns.model}"
        raise UsageError(f"--nproc {nproc}: the global batch of {rows} ({source}) does not split "
                         f"evenly over {nproc} ranks; expected a --batch-size that is a multiple "
                         f"of {nproc}")
    return strategy


def _main(ns: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.panel import Panel

    job = validate(ns)
    console = Console()
    if not console.is_terminal:
        # A log file has no width; 80 columns would crop the table.
        console = Console(width=max(console.width, 132))
    host = machine.HostFacts.collect(job["device"])
    notes = [note for note in (machine.cpu_half_banner(host, job["half_dtype"]),) if note]
    levels = list(dict.fromkeys(ns.levels or LEVELS))
    if ns.levels is None and machine.autocast_is_slow(host, job["half_dtype"]):
        # amp_patch emulates half matmuls for its own levels only; torch.autocast would take
        # many times O0's time here and hold up the whole comparison.
        levels.remove("autocast")
        notes.append(f"torch.autocast is left out: this CPU has no native {job['half_dtype']} "
                     "matmul, and autocast is torch's own, which amp_patch does not emulate, so "
                     "its steps would take many times O0's. Name it in --levels to run it anyway.")
    for note in notes:
        console.print(Panel(note, title="CPU half precision", border_style="yellow"))
    crowded = machine.oversubscribed(job["nproc"], host.cpus) if job["strategy"] else None
    if crowded:
        console.print(Panel(crowded, title="more ranks than CPUs", border_style="yellow"))

    started = time.perf_counter()
    comparison = run_compare(job, levels, console, ns.progress_interval)
    elapsed = time.perf_counter() - started
    over = (f", {job['nproc']} rank{'s' * (job['nproc'] > 1)} ({job['strategy'].upper()})"
            if job["strategy"] else "")
    title = (f"amp-patch compare: model {job['model']}, {job['steps']} steps, {job['device']}"
             f"{over}, {job['half_dtype']}, torch {torch.__version__}")
    table = render_table(comparison, title)
    console.print(table)
    warning = ("Speed ratios unreliable:\n- " + "\n- ".join(comparison.warnings)
               if comparison.warnings else None)
    if warning:
        console.print(Panel(warning, title="warning", border_style="red"))
    console.print(f"{len(levels)} levels in {elapsed:.0f} s. Peak memory"
                  + (", in each rank: " if job["strategy"] else ": ")
                  + ("torch.cuda.max_memory_allocated." if job["device"].startswith("cuda") else
                     "peak anonymous resident memory (heap) while training, above the "
                     "process's before the model was built."))
    for r in comparison.results:
        if not r.ok:
            console.print(Panel(r.error or "unknown error", title=f"[red]{r.level} failed",
                                border_style="red"))

    payload = {"config": dict(job, levels=levels, round_steps=comparison.rounds,
                              torch=torch.__version__, threads=comparison.host.threads,
                              elapsed_s=elapsed),
               "machine": comparison.host.as_dict(), "load": comparison.load.as_dict(),
               "cpu_half_plan": machine.cpu_half_plan(host, job["half_dtype"]),
               "warnings": comparison.warnings, "notes": notes,
               "levels": {r.level: r.to_json() for r in comparison.results}}
    json_paths = [ns.json] if ns.json else []
    plot_paths = [ns.plot] if ns.plot else []
    if ns.out:
        json_paths.append(ns.out / "results.json")
        plot_paths.append(ns.out / "compare.png")
        buf = io.StringIO()
        text_console = Console(file=buf, width=120, color_system=None)
        text_console.print(table)
        if warning:
            text_console.print(Panel(warning, title="warning"))
        (ns.out / "table.txt").write_text(buf.getvalue())
        console.print(f"wrote {ns.out / 'table.txt'}")
    for path in json_paths:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(payload, indent=2))
        console.print(f"wrote {path}")
    for path in plot_paths:
        write_plot(comparison, path, title.replace("amp-patch compare: ", ""))
        console.print(f"wrote {path}")
    return 0 if all(r.ok for r in comparison.results) else 1
