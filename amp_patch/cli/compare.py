"""``amp-patch compare``: train one model under O0-O3 and torch.autocast, side by side.

Each level trains in its own spawned process, from the same seed on the same
batches, so that patches and memory figures of one level never leak into
another. The parent shows a progress bar per level, then a table; it can write
the results as JSON and the loss and loss-scale curves as a PNG.
"""

from __future__ import annotations

import argparse
import io
import json
import math
import multiprocessing as mp
import os
import queue
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from amp_patch.cli.trainer import HALF_DTYPES, LEVELS, CpuPeak, LevelTrainer

__all__ = ["LEVELS", "LevelResult", "add_parser", "run_compare", "render_table", "write_plot"]


DESCRIPTION = """\
Train one model for N steps under O0, O1, O2, O3 and torch.autocast (with
torch.amp.GradScaler when the half type is fp16), each level in its own
process, from the same seed on the same synthetic batches. Then print a table:
steps/s, speed-up over O0, peak memory, final loss, the largest |loss - O0 loss|
over the run, skipped (overflow) steps and the final loss scale.

Peak memory is torch.cuda.max_memory_allocated on CUDA; on CPU it is the
process's peak anonymous resident memory (heap, sampled after forward,
backward and step) above its value before the model was built.

--model takes a built-in name (lm: a small GPT-style transformer LM, the
default; mlp; convnet: a conv net with BatchNorm) or pkg.module:factory, a
function returning (model, optimizer, batch_fn, loss_fn), where batch_fn(step)
returns the batch of a step and loss_fn(model, batch) the scalar loss. The
factory may take the keyword arguments device, batch_size and seed. The
exit status is 1 if any level failed.
"""

EPILOG = """\
examples:
  amp-patch compare                                  # built-in LM, all levels, about a minute on CPU
  amp-patch compare --out out/                       # also write out/table.txt, results.json, compare.png
  amp-patch compare --model mlp --steps 50 --levels O0 O2 autocast
  amp-patch compare --model convnet --json r.json --plot r.png
  amp-patch compare --model mypkg.models:make_workload --device cuda --half-dtype fp16
"""


@dataclass
class LevelResult:
    """What one level's run produced (or how it failed).

    Attributes:
        level (str): ``"O0"`` ... ``"O3"`` or ``"autocast"``.
        ok (bool): the run finished.
        error (str or None): the traceback when it did not.
        steps_per_s (float or None): steps per second after the warm-up steps.
        peak_memory_bytes (int or None): see ``memory_kind``.
        memory_kind (str): ``"cuda_max_allocated"`` or ``"cpu_peak_anon_rss_delta"``.
        losses (list of float): the loss of every step.
        loss_scales (list of float): the loss scale after every step (1.0 when none is used).
        skipped (list of int): steps whose optimizer step was skipped (overflow).
        speedup_vs_O0 (float or None): ``steps_per_s`` over O0's.
        max_abs_loss_diff_vs_O0 (float or None): max over steps of ``|loss - O0 loss|``.
    """

    level: str
    ok: bool = False
    error: str | None = None
    steps_per_s: float | None = None
    peak_memory_bytes: int | None = None
    memory_kind: str = ""
    losses: list[float] = field(default_factory=list)
    loss_scales: list[float] = field(default_factory=list)
    skipped: list[int] = field(default_factory=list)
    speedup_vs_O0: float | None = None
    max_abs_loss_diff_vs_O0: float | None = None

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


# --------------------------------------------------------------------------- the child process


def _level_worker(level: str, job: dict[str, Any], out: "mp.Queue") -> None:
    """Train ``job`` under ``level`` in this (spawned) process, reporting on ``out``."""
    try:
        _train_level(level, job, out)
    except BaseException:
        out.put(("error", level, traceback.format_exc()))


def _train_level(level: str, job: dict[str, Any], out: "mp.Queue") -> None:
    from amp_patch.cli import models

    device = torch.device(job["device"])
    on_cuda = device.type == "cuda"
    result = LevelResult(level, memory_kind="cuda_max_allocated" if on_cuda else "cpu_peak_anon_rss_delta")
    cpu_peak = CpuPeak()

    torch.manual_seed(job["seed"])
    factory = models.resolve(job["model"])
    model, optimizer, batch_fn, loss_fn = models.build(factory, device, job["batch_size"], job["seed"])
    trainer = LevelTrainer(level, model, optimizer, loss_fn, device, HALF_DTYPES[job["half_dtype"]],
                           sample=cpu_peak.sample)
    if on_cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    cpu_peak.sample()

    torch.manual_seed(job["seed"])
    steps, warmup = job["steps"], job["warmup"]
    timed = 0.0
    for step in range(steps):
        batch = batch_fn(step)
        if on_cuda:
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        loss_value = float(trainer.step(batch).float().item())  # the iteration's one sync for the loss
        scale = trainer.loss_scale
        if on_cuda:
            torch.cuda.synchronize(device)
        if step >= warmup:
            timed += time.perf_counter() - t0
        result.losses.append(loss_value)
        result.loss_scales.append(scale)
        if trainer.skipped:
            result.skipped.append(step)
        out.put(("step", level, step, loss_value))

    result.steps_per_s = (steps - warmup) / timed if timed > 0 else None
    if on_cuda:
        result.peak_memory_bytes = int(torch.cuda.max_memory_allocated(device))
    else:
        result.peak_memory_bytes = max(0, cpu_peak.delta())
    result.ok = True
    trainer.close()
    out.put(("done", level, asdict(result)))


# --------------------------------------------------------------------------- the parent


def _run_level(level: str, job: dict[str, Any], progress, task) -> LevelResult:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    proc = ctx.Process(target=_level_worker, args=(level, job, q), name=f"amp-patch-compare-{level}")
    proc.start()
    result = None
    while result is None:
        try:
            msg = q.get(timeout=0.2)
        except queue.Empty:
            if not proc.is_alive():
                # The process may have put its last message just before exiting.
                try:
                    msg = q.get(timeout=1.0)
                except queue.Empty:
                    result = LevelResult(level, error=f"the {level} process died with exit code "
                                                      f"{proc.exitcode} and no traceback")
                    break
            else:
                continue
        kind = msg[0]
        if kind == "step":
            _, _, step, loss = msg
            progress.update(task, completed=step + 1, info=f"loss {loss:.4f}")
        elif kind == "done":
            result = LevelResult(**msg[2])
        else:
            result = LevelResult(level, error=msg[2])
    proc.join()
    return result


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
        if base.steps_per_s and r.steps_per_s:
            r.speedup_vs_O0 = r.steps_per_s / base.steps_per_s
        diffs = [abs(a - b) for a, b in zip(r.losses, base.losses)]
        r.max_abs_loss_diff_vs_O0 = max(diffs) if diffs else None


def run_compare(job: dict[str, Any], levels: list[str], console=None) -> list[LevelResult]:
    """Run every level in its own process, with a progress bar per level.

    Args:
        job (dict): ``model``, ``steps``, ``warmup``, ``batch_size``,
            ``device``, ``half_dtype`` (``"bf16"``/``"fp16"``) and ``seed``.
        levels (list of str): a subset of :data:`LEVELS`.
        console (rich.console.Console, optional): where the progress goes.

    Returns:
        list of LevelResult: in the order of ``levels``, with the O0-relative
        figures filled in when O0 ran.
    """
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    results = []
    columns = (TextColumn("{task.description:>9}"), BarColumn(), MofNCompleteColumn(),
               TimeElapsedColumn(), TextColumn("{task.fields[info]}"))
    with Progress(*columns, console=console) as progress:
        tasks = {lv: progress.add_task(lv, total=job["steps"], start=False, info="waiting")
                 for lv in levels}
        for lv in levels:
            progress.start_task(tasks[lv])
            progress.update(tasks[lv], info="starting")
            r = _run_level(lv, job, progress, tasks[lv])
            info = (f"[green]{r.steps_per_s:.2f} steps/s, final loss {r.final_loss:.4f}"
                    if r.ok and r.steps_per_s else "[green]done" if r.ok else "[red]FAILED")
            progress.update(tasks[lv], info=info)
            progress.stop_task(tasks[lv])
            results.append(r)
    _derive(results)
    return results


def _fmt(value: float | None, spec: str, suffix: str = "") -> str:
    if value is None:
        return "-"
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return f"{value:{spec}}{suffix}"


def _memory(r: LevelResult) -> str:
    if r.peak_memory_bytes is None:
        return "-"
    return f"{r.peak_memory_bytes / 2**20:.0f} MiB"


def render_table(results: list[LevelResult], title: str):
    """A :class:`rich.table.Table` of the results, one row per level."""
    from rich import box
    from rich.table import Table
    from rich.text import Text

    headers = ("level", "steps/s", "speed-up", "peak mem", "final loss", "max |Δloss|", "skipped",
               "scale")
    rows = []
    for r in results:
        if not r.ok:
            rows.append([r.level, *["-"] * 6, "[red]FAILED"])
            continue
        rows.append([
            r.level, _fmt(r.steps_per_s, ".2f"), _fmt(r.speedup_vs_O0, ".2f", "x"), _memory(r),
            _fmt(r.final_loss, ".4f"), _fmt(r.max_abs_loss_diff_vs_O0, ".2e"), str(len(r.skipped)),
            _fmt(r.final_loss_scale, "g")])
    table = Table(title=title, box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True,
                  caption="speed-up and max |Δloss| are against O0, step by step")
    for i, name in enumerate(headers):
        # Wide enough for every cell, so a narrow terminal never turns numbers into ellipses.
        width = max([len(name)] + [len(Text.from_markup(row[i]).plain) for row in rows])
        table.add_column(name, justify="left" if i == 0 else "right", no_wrap=True, min_width=width)
    for row in rows:
        table.add_row(*row)
    return table


def write_plot(results: list[LevelResult], path: Path, title: str) -> None:
    """Write a PNG: loss against step (top) and loss scale against step (bottom, log2 axis).

    Skipped steps are marked with an ``x`` on the loss curve.

    Args:
        results (list of LevelResult): the levels; failed ones are left out.
        path (Path): the PNG to write.
        title (str): the figure's title.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_scale) = plt.subplots(2, 1, figsize=(9, 7.5), sharex=True,
                                            gridspec_kw={"height_ratios": [3, 1.4]})
    styles = {"O0": ("black", "-", 2.2), "O1": ("tab:blue", "-", 1.4), "O2": ("tab:orange", "-", 1.4),
              "O3": ("tab:red", "-", 1.4), "autocast": ("tab:green", "--", 1.6)}
    for r in results:
        if not r.ok:
            continue
        color, ls, lw = styles.get(r.level, (None, "-", 1.4))
        steps = range(len(r.losses))
        ax_loss.plot(steps, r.losses, color=color, ls=ls, lw=lw, label=r.level)
        if r.skipped:
            ax_loss.plot(r.skipped, [r.losses[i] for i in r.skipped], "x", color=color, ms=7,
                         label=f"{r.level} skipped step")
        ax_scale.step(steps, r.loss_scales, where="post", color=color, ls=ls, lw=lw, label=r.level)
    ax_loss.set_ylabel("training loss")
    ax_loss.set_title(title)
    ax_loss.grid(alpha=0.3)
    ax_loss.legend(ncol=2, fontsize=9)
    scales = {v for r in results if r.ok for v in r.loss_scales}
    if len(scales) == 1:
        # A flat line reads as "nothing plotted"; say what it means.
        ax_scale.text(0.5, 0.75, f"loss scale {scales.pop():g} throughout, at every level",
                      transform=ax_scale.transAxes, ha="center", fontsize=9, color="dimgray")
    ax_scale.set_yscale("log", base=2)
    ax_scale.set_ylabel("loss scale")
    ax_scale.set_xlabel("step")
    ax_scale.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register the ``compare`` subcommand."""
    p = subparsers.add_parser(
        "compare", help="train a model under O0-O3 and torch.autocast and compare speed, memory, loss",
        description=DESCRIPTION, epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="lm", metavar="NAME|MODULE:FACTORY",
                   help="lm (default), mlp, convnet, or pkg.module:factory")
    p.add_argument("--steps", type=int, default=100, help="training steps per level (default: 100)")
    p.add_argument("--warmup", type=int, default=None,
                   help="first steps left out of steps/s (default: min(3, steps // 4))")
    p.add_argument("--batch-size", type=int, default=None, help="batch size (default: the model's)")
    p.add_argument("--device", default=None, help="cpu or cuda[:N] (default: cuda if available)")
    p.add_argument("--half-dtype", choices=sorted(HALF_DTYPES), default=None,
                   help="the half type (default: fp16 on CUDA, bf16 on CPU)")
    p.add_argument("--levels", nargs="+", choices=LEVELS, default=list(LEVELS), metavar="LEVEL",
                   help=f"levels to run, from {' '.join(LEVELS)} (default: all)")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights and data (default: 0)")
    p.add_argument("--json", type=Path, metavar="PATH", help="write the results as JSON")
    p.add_argument("--plot", type=Path, metavar="PATH", help="write loss and loss-scale curves as PNG")
    p.add_argument("--out", type=Path, metavar="DIR",
                   help="write table.txt, results.json and compare.png into DIR")
    p.set_defaults(func=_main)
    return p


def _main(ns: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.panel import Panel

    console = Console()
    if ns.steps < 1:
        console.print("[red]--steps must be at least 1")
        return 2
    device = torch.device(ns.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    half = ns.half_dtype or ("fp16" if device.type == "cuda" else "bf16")
    if half == "fp16" and device.type == "cpu":
        console.print("[yellow]fp16 on CPU has no fast kernels on most CPUs and can be hundreds of "
                      "times slower than fp32; bf16 is the CPU half type.")
    levels = list(dict.fromkeys(ns.levels))
    warmup = min(3, ns.steps // 4) if ns.warmup is None else max(0, min(ns.warmup, ns.steps - 1))
    job = dict(model=ns.model, steps=ns.steps, warmup=warmup, batch_size=ns.batch_size,
               device=str(device), half_dtype=half, seed=ns.seed)
    # As with `python -m`, modules in the working directory can name a --model factory.
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())

    started = time.perf_counter()
    results = run_compare(job, levels, console)
    elapsed = time.perf_counter() - started
    title = (f"amp-patch compare: model {ns.model}, {ns.steps} steps, {device}, {half}, "
             f"torch {torch.__version__}")
    table = render_table(results, title)
    console.print(table)
    console.print(f"{len(levels)} levels in {elapsed:.0f} s. Peak memory: "
                  + ("torch.cuda.max_memory_allocated." if device.type == "cuda" else
                     "peak anonymous resident memory (heap) while training, above the "
                     "process's before the model was built."))
    for r in results:
        if not r.ok:
            console.print(Panel(r.error or "unknown error", title=f"[red]{r.level} failed",
                                border_style="red"))

    payload = {"config": dict(job, levels=levels, torch=torch.__version__,
                              threads=torch.get_num_threads(), elapsed_s=elapsed),
               "levels": {r.level: r.to_json() for r in results}}
    json_paths = [ns.json] if ns.json else []
    plot_paths = [ns.plot] if ns.plot else []
    if ns.out:
        ns.out.mkdir(parents=True, exist_ok=True)
        json_paths.append(ns.out / "results.json")
        plot_paths.append(ns.out / "compare.png")
        buf = io.StringIO()
        Console(file=buf, width=120, color_system=None).print(table)
        (ns.out / "table.txt").write_text(buf.getvalue())
        console.print(f"wrote {ns.out / 'table.txt'}")
    for path in json_paths:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(payload, indent=2))
        console.print(f"wrote {path}")
    for path in plot_paths:
        write_plot(results, path, title.replace("amp-patch compare: ", ""))
        console.print(f"wrote {path}")
    return 0 if all(r.ok for r in results) else 1
