"""``amp-patch compare``'s command line: its options, their checks, and the run that prints,
writes the JSON and draws the plot."""

from __future__ import annotations

import argparse
import inspect
import io
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

from amp_patch.cli import host_facts
from amp_patch.cli.compare import data_parallel, models
from amp_patch.cli.compare.plot import write_plot
from amp_patch.cli.compare.results import run_compare
from amp_patch.cli.compare.table import render_table
from amp_patch.cli.compare.trainer import LEVELS, PRESETS
from amp_patch.cli.options import UsageError, check_output_dir, check_output_file, parse_device
from amp_patch.settings.dtypes import HALF_DTYPE_NAMES

__all__ = ["DEMO_STEPS", "FULL_STEPS", "add_parser", "check_model", "validate"]

#: Steps per level by default: the demo size, a few minutes of CPU time at most.
DEMO_STEPS = 60
#: Steps per level with ``--full``: the loss curves of docs/compare.md.
FULL_STEPS = 100

DESCRIPTION = f"""\
Train one model under O0, O1, O2, O3, O2-lean, O2+fp8 and torch.autocast (with
torch.amp.GradScaler when the half type is fp16), each level in its own
process, from the same seed on the same synthetic batches. Then print a table:
steps/s and speed-up over O0 (median over timed rounds, min-max beside it),
peak memory, final loss, the largest |loss - O0 loss| over the run, skipped
(overflow) steps and the final loss scale.

Timing: every level process builds its model and trains --warmup untimed
steps; then, in each of --rounds timed rounds, the levels train their share
of the remaining steps in turn (round-robin, the first level rotating), so
that other load on the machine falls on all of them alike. A speed needs at
least {host_facts.MIN_ROUNDS} timed rounds to be shown. The host (CPU or GPU, threads,
native bf16), torch's version and the load average before and after are
recorded; a warning says when the load, or the spread between rounds, makes
the ratios unreliable.

O2-lean is O2 with initialize(optimizer_state="int8", master_weights="bf16"):
block-scaled 8-bit Adam moments (or SGD momentum) and bf16 master weights,
which need amp_patch's FusedAdam or FusedSGD. The built-in models build it
with those (lm and mlp FusedAdam, convnet FusedSGD; the other rows keep
torch's optimizers); with a user's factory whose optimizer is another, the
row is skipped and the reason printed.

O2+fp8 is O2 with its nn.Linear layers' GEMMs in FP8 (initialize(fp8=...),
tensorwise scaling, E4M3 forward and E5M2 backward). The built-in models are
too small for the default filter's size rule (both dims >= 2048), so the row
converts every linear whose dims are multiples of 16 (min_features=16). It is
skipped where torch._scaled_mm has no kernel (CUDA before sm_89).

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
                        "left out on a CPU where its half matmuls would take more than "
                        f"{host_facts.AUTOCAST_FACTOR_LIMIT:g}x fp32's time; O2-lean is O2 with "
                        "int8 optimizer state and bf16 masters)")
    p.add_argument("--nproc", type=int, default=1, metavar="N",
                   help="train each level data-parallel over N ranks on this machine (default: 1, "
                        "one process per level)")
    p.add_argument("--strategy", choices=data_parallel.STRATEGIES, default=None,
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
    host = host_facts.HostFacts.collect(job["device"])
    notes = [note for note in (host_facts.cpu_half_banner(host, job["half_dtype"]),) if note]
    levels = list(dict.fromkeys(ns.levels or LEVELS))
    cost = host_facts.autocast_cost(host, job["half_dtype"])
    left_out = cost.note() if cost is not None and ns.levels is None else None
    if left_out:
        # amp_patch emulates half matmuls for its own levels only; torch.autocast runs at the
        # host's own half speed, and here it would hold up the whole comparison. Where it does
        # run at a cost, the banner's last line and the table's caption say the cost.
        levels.remove("autocast")
        notes.append(left_out)
    for note in notes:
        console.print(Panel(note, title="CPU half precision", border_style="yellow"))
    crowded = host_facts.oversubscribed(job["nproc"], host.cpus) if job["strategy"] else None
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
        if r.unavailable is not None:
            console.print(Panel(r.unavailable, title=f"{r.level} skipped", border_style="yellow"))
        elif not r.ok:
            console.print(Panel(r.error or "unknown error", title=f"[red]{r.level} failed",
                                border_style="red"))

    presets = {lv: PRESETS[lv].json_kwargs() for lv in levels if lv in PRESETS}
    payload = {"config": dict(job, levels=levels, presets=presets, round_steps=comparison.rounds,
                              torch=torch.__version__, threads=comparison.host.threads,
                              elapsed_s=elapsed),
               "machine": comparison.host.as_dict(), "load": comparison.load.as_dict(),
               "cpu_half_plan": host_facts.cpu_half_plan(host, job["half_dtype"]),
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
    # A skipped row (unavailable with this workload's optimizer) is not a failure.
    return 0 if all(r.error is None for r in comparison.results) else 1
