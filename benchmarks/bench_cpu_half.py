"""Half compute on the CPU: emulated half matmuls against O0, and what ``"auto"`` costs.

Training steps of the built-in LM (``amp_patch/cli/compare/models.py``; by default
``COMPARE_LM``, what ``amp-patch compare`` and ``make demo`` train), through
the same :class:`~amp_patch.cli.compare.trainer.LevelTrainer` that compare and bench use.
Each configuration runs in its own process (one amp session each) for the
whole run; round after round, the configurations of a group take turns (the
first one rotating) to time ``--steps`` steps. A configuration's ratio to its
group's O0 is taken per round and the median over rounds is reported, so that
the load of a shared machine falls on both sides of each ratio.

The configurations:

- O0, the anchor;
- bf16 O2 and O3 as ``cpu_half_compute="auto"`` runs them on this host;
- bf16 O1, O2 and O3 emulated: the detection forced to "not native"
  (``cpu_half.override``), so ``"auto"`` takes the path it takes on a host
  without native bf16. On a host with native bf16 this measures the
  emulation path, not such a host;
- fp16 O2 and O3 under ``"auto"``: emulated wherever fp16 is not native
  (any CPU without avx512_fp16 / AMX-FP16);
- fp16 O2 and O3 forced native: the slow path that emulation replaces
  (``--skip-slow`` leaves them out).

Targets (docs/design.md, "Performance targets", CPU half): emulated O2 and O3 steps take at most 1.25x O0's time on a
host without native bf16; on a native host, ``"auto"`` adds at most 1%. On a
native host ``"auto"`` installs no wrapper, so the step runs the very same
calls as ``"native"``: the script checks that, and reports the once-per-process
probe and the per-``initialize`` cost beside the interleaved step ratio.

Run: ``python benchmarks/bench_cpu_half.py`` (writes the "cpu-half" section of
docs/benchmarks.md on a host with native bf16, "cpu-half-no-native-bf16" on one
without: ``ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2`` makes an AVX-512 host
behave as one); ``--quick`` for a smoke test that writes nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing as mp
import os
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F

import amp_patch
from amp_patch.cli.compare import models
from amp_patch.cli.compare.trainer import LevelTrainer
from amp_patch.cli.host_facts import LoadMonitor
from amp_patch.patching import cpu_half

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import interleaved_median, machine, markdown_table, write_section  # noqa: E402

BF16, FP16 = torch.bfloat16, torch.float16
LMS = {"compare": models.COMPARE_LM, "bench": models.BENCH_LM}
TARGET_EMULATED = 1.25
TARGET_AUTO = 1.01


class Config(NamedTuple):
    label: str
    level: str
    half: torch.dtype
    #: None: the host's own answer; True/False: the detection forced native / not native.
    native: bool | None
    slow: bool = False


_O0 = Config("O0", "O0", BF16, None)
#: Measured group by group, each group interleaved with its own O0.
GROUPS = {
    "bf16": [
        _O0,
        Config("O2 bf16, auto", "O2", BF16, None),
        Config("O2 bf16, detection forced native", "O2", BF16, True),
        Config("O3 bf16, auto", "O3", BF16, None),
        Config("O1 bf16, emulated", "O1", BF16, False),
        Config("O2 bf16, emulated", "O2", BF16, False),
        Config("O3 bf16, emulated", "O3", BF16, False),
    ],
    "fp16": [
        _O0,
        Config("O2 fp16, auto", "O2", FP16, None),
        Config("O3 fp16, auto", "O3", FP16, None),
    ],
    "fp16 native": [
        _O0,
        Config("O2 fp16, forced native", "O2", FP16, True, slow=True),
        Config("O3 fp16, forced native", "O3", FP16, True, slow=True),
    ],
}


def _detection(cfg: Config):
    if cfg.native is None:
        return contextlib.nullcontext()
    return cpu_half.override(**{"bfloat16" if cfg.half == BF16 else "float16": cfg.native})


#: The clocks a step can be timed with: wall time, or the CPU time of the (single) thread.
CLOCKS = {"wall": time.perf_counter, "cpu": time.thread_time}


def _worker(conn, cfg: Config, lm_name: str, threads: int, clock: str) -> None:
    """One configuration's process: build, initialize, warm up, then time steps on request."""
    try:
        torch.set_num_threads(threads)
        now = CLOCKS[clock]
        model, optimizer, batch_fn, loss_fn = models.lm(config=LMS[lm_name])
        with _detection(cfg):
            trainer = LevelTrainer(cfg.level, model, optimizer, loss_fn, torch.device("cpu"), cfg.half)
        plan = cpu_half.current_plan()
        batch = batch_fn(0)
        trainer.step(batch)
        conn.send("-" if plan is None else plan.mode)
        for n in iter(conn.recv, 0):
            times = []
            for _ in range(n):
                t0 = now()
                trainer.step(batch)
                times.append(now() - t0)
            conn.send(times)
    except BaseException:
        conn.send(traceback.format_exc())


def measure(configs: list[Config], lm_name: str, rounds: int, steps: int, threads: int,
            clock: str = "wall") -> dict:
    """Per configuration: median step time, median per-round ratio to the group's O0, plan mode.

    Each configuration lives in its own process for the whole run (one amp
    session each); round after round the parent asks each in turn, the first
    one rotating, for ``steps`` steps (one for the slow rows), so that a
    round's ratios see the same machine load. ``clock="cpu"`` times the CPU
    time of the stepping thread (run it with one thread): on a machine loaded
    far beyond its cores, wall time mostly measures the waiting.
    """
    ctx = mp.get_context("spawn")
    conns, procs = {}, []
    for cfg in configs:
        parent, child = ctx.Pipe()
        procs.append(ctx.Process(target=_worker, args=(child, cfg, lm_name, threads, clock),
                                 daemon=True))
        procs[-1].start()
        conns[cfg.label] = parent
    modes = {label: conn.recv() for label, conn in conns.items()}
    failed = {label: m for label, m in modes.items() if m not in ("-", "native") and "emulate" not in m}
    if failed:
        raise RuntimeError("configurations failed to start:\n" + "\n".join(failed.values()))
    times: dict[str, list[float]] = {c.label: [] for c in configs}
    ratios: dict[str, list[float]] = {c.label: [] for c in configs}
    for r in range(rounds):
        this_round = {}
        for cfg in configs[r % len(configs):] + configs[:r % len(configs)]:
            conns[cfg.label].send(1 if cfg.slow else steps)
            got = conns[cfg.label].recv()
            if isinstance(got, str):
                raise RuntimeError(f"{cfg.label} failed:\n{got}")
            this_round[cfg.label] = statistics.median(got)
        for label, t in this_round.items():
            times[label].append(t)
            ratios[label].append(t / this_round["O0"])
        print(f"  round {r + 1}/{rounds}: " + "  ".join(
            f"{c.label} {this_round[c.label] * 1e3:.0f}ms" for c in configs), file=sys.stderr, flush=True)
    for conn in conns.values():
        conn.send(0)
    for proc in procs:
        proc.join(timeout=30)
    return {c.label: dict(ms=statistics.median(times[c.label]) * 1e3,
                          ratio=statistics.median(ratios[c.label]), mode=modes[c.label])
            for c in configs}


def auto_costs() -> dict:
    """What ``"auto"`` costs outside the step: the probe once per process, install per initialize.

    Also counts the wrappers that ``"auto"`` installs on this host (none where it is native).
    """
    t0, c0 = time.perf_counter(), time.process_time()
    cpu_half.detect._detect()
    probe_ms = (time.perf_counter() - t0) * 1e3
    probe_cpu_ms = (time.process_time() - c0) * 1e3
    model = torch.nn.Linear(4, 4)
    amp_patch.initialize(model, opt_level="O2", verbosity=0)
    session = amp_patch.session.current()
    repeats = 200
    t0 = time.perf_counter()
    for _ in range(repeats):
        cpu_half.session_plan._session_plan(session.props, session.models)
    plan_us = (time.perf_counter() - t0) / repeats * 1e6
    plan = cpu_half.current_plan()
    amp_patch.deinitialize()
    return dict(probe_ms=probe_ms, probe_cpu_ms=probe_cpu_ms, plan_us=plan_us, mode=plan.mode,
                wrappers=len(cpu_half.targets(plan.emulate_matmul, plan.emulate_conv))
                if plan.emulates else 0)


def call_costs() -> dict[str, float]:
    """Microseconds per call of a tiny ``F.linear`` (8x8, bias): original against emulating wrapper,
    on fp32 inputs (passed straight through) and on bf16 inputs (emulated)."""
    wrapped = cpu_half.emulate._emulator(F.linear, BF16, "linear")
    x, w, b = torch.randn(8, 8), torch.randn(8, 8), torch.randn(8)
    xh, wh, bh = x.bfloat16(), w.bfloat16(), b.bfloat16()
    block = 200

    def loop(fn, *args):
        def run():
            for _ in range(block):
                fn(*args)
        return run

    t = interleaved_median({
        "fp32 original": loop(F.linear, x, w, b), "fp32 through the wrapper": loop(wrapped, x, w, b),
        "bf16 native": loop(F.linear, xh, wh, bh), "bf16 emulated": loop(wrapped, xh, wh, bh),
    }, repeats=9)
    return {k: v / block * 1e6 for k, v in t.items()}


def report(results: dict[str, dict], costs: dict, calls: dict[str, float], lm_name: str,
           rounds: int, steps: int, load: LoadMonitor, clock: str, threads: int) -> str:
    """The markdown section. ``results``: group name to :func:`measure`'s result."""
    support = amp_patch.cpu_half_support()
    host = support.host()
    native = support.native(torch.bfloat16)
    rows = [[group, label, r["mode"], f"{r['ms']:.1f}", f"{r['ratio']:.2f}x"]
            for group, res in results.items() for label, r in res.items()]
    flat = {label: r for res in results.values() for label, r in res.items() if label != "O0"}
    name, title = _section(support)
    parts = [
        f"## CPU half compute: emulated half matmuls, {title} ({name})",
        "",
        f"Machine: {machine()}. Host kind: {host}. Detection: {support.describe()}.",
        f"Workload: built-in LM `{lm_name}` ({_lm_about(LMS[lm_name])}), AdamW. Each configuration "
        f"in its own process with {threads} torch thread(s); {rounds} rounds, {steps} timed steps "
        f"per configuration per round (1 for the forced-native fp16 rows), each group interleaved "
        f"with its own O0. Clock: {_CLOCK_TEXT[clock]}. Machine load: {load.line()}.",
        "",
        _about_rows(native, host),
        "",
        markdown_table(["group", "configuration", "plan", f"ms/step ({clock}, median)",
                        "time / O0 (median per round)"], rows),
        "",
        "### Targets",
        "",
    ]
    target_rows = []
    for label in ("O2 bf16, emulated", "O3 bf16, emulated", "O2 fp16, auto", "O3 fp16, auto"):
        if label in flat:
            value = flat[label]["ratio"]
            target_rows.append([f"{label}: time / O0", f"<= {TARGET_EMULATED}", f"{value:.2f}",
                                "met" if value <= TARGET_EMULATED else "**missed**", host])
    if "O2 bf16, auto" in flat and "O2 bf16, detection forced native" in flat and native:
        value = flat["O2 bf16, auto"]["ratio"] / flat["O2 bf16, detection forced native"]["ratio"]
        if costs["wrappers"] == 0:
            verdict = "met: no wrapper installed, the step makes the same calls (the ratio is noise)"
        else:
            verdict = "met" if value <= TARGET_AUTO else "**missed**"
        target_rows.append([
            f"O2 bf16 step, \"auto\" / native (plan: {costs['mode']}, {costs['wrappers']} wrappers "
            "installed)", f"<= {TARGET_AUTO}", f"{value:.3f}", verdict, host])
    parts += [markdown_table(["ratio", "target", "measured", "verdict", "host kind"], target_rows), ""]
    parts += [
        f"Outside the step, `\"auto\"` costs the detection probe once per process "
        f"({costs['probe_ms']:.1f} ms wall, {costs['probe_cpu_ms']:.1f} ms CPU) and "
        f"{costs['plan_us']:.1f} us per `initialize` to plan.",
        "",
        f"### Per call (tiny `F.linear`, 8x8 with bias, {threads} thread(s); wall microseconds, "
        "interleaved median)",
        "",
        markdown_table(["call", "us"], [[k, f"{v:.2f}"] for k, v in calls.items()]),
    ]
    return "\n".join(parts)


def _about_rows(native: bool, host: str) -> str:
    """What the "emulated" and "forced native" rows measure on this host."""
    if native:
        return (f"\"emulated\" rows force the detection to \"not native\", so `\"auto\"` takes the path "
                f"that it takes on a host without native bf16; on this host ({host}) that measures "
                "the emulation path, not such a host. The fp16 rows under `\"auto\"` are genuinely "
                "non-native on any CPU without avx512_fp16.")
    held = ", ".join(f"{k}={os.environ[k]}" for k in ("ONEDNN_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY")
                     if os.environ.get(k))
    held = f" (held there by {held}, whatever the CPU's flags say)" if held else ""
    return (f"This host ({host}) has no native bf16 matmul{held}, so `\"auto\"` emulates by "
            "itself; the \"detection forced native\" row is the slow path that torch takes there "
            "without the emulation.")


def _section(support) -> tuple[str, str]:
    """The report section this host's run owns, and its title: one per host kind, so that a
    run on a host without native bf16 sits beside the native host's instead of replacing it."""
    if support.native(torch.bfloat16):
        return "cpu-half", "host with native bf16"
    return "cpu-half-no-native-bf16", "host without native bf16"


_CLOCK_TEXT = {"wall": "wall time",
               "cpu": "CPU time of the stepping thread (the machine was loaded far beyond its cores)"}


def _lm_about(lm: models.LMConfig) -> str:
    return (f"d_model {lm.d_model}, {lm.n_layers} blocks, {lm.n_heads} heads, seq {lm.seq_len}, "
            f"batch {lm.batch_size}, vocab {lm.vocab}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lm", choices=sorted(LMS), default="compare",
                   help="COMPARE_LM (the demo's, default) or BENCH_LM")
    p.add_argument("--rounds", type=int, default=9, help="rounds (default: 9)")
    p.add_argument("--steps", type=int, default=2, help="timed steps per configuration per round")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads per process (default: torch's default; 1 with --clock cpu)")
    p.add_argument("--clock", choices=sorted(CLOCKS), default="wall",
                   help="wall time (default), or the stepping thread's CPU time at one thread, "
                        "for a machine loaded far beyond its cores")
    p.add_argument("--skip-slow", action="store_true", help="leave out the forced-native fp16 rows")
    p.add_argument("--quick", action="store_true", help="2 rounds of 1 step, no slow rows, no write")
    p.add_argument("--no-write", action="store_true", help="print only; leave docs/benchmarks.md")
    ns = p.parse_args(argv)
    if ns.quick:
        ns.rounds, ns.steps, ns.skip_slow, ns.no_write = 2, 1, True, True
    if ns.threads is None:
        ns.threads = 1 if ns.clock == "cpu" else torch.get_num_threads()
    elif ns.clock == "cpu" and ns.threads != 1:
        p.error("--clock cpu times one thread: use --threads 1")
    torch.set_num_threads(ns.threads)
    load = LoadMonitor().start()
    costs = auto_costs()
    calls = call_costs()
    results = {}
    for group, configs in GROUPS.items():
        if ns.skip_slow and any(c.slow for c in configs):
            continue
        print(f"{group}:", file=sys.stderr, flush=True)
        results[group] = measure(configs, ns.lm, ns.rounds, ns.steps, ns.threads, ns.clock)
    text = report(results, costs, calls, ns.lm, ns.rounds, ns.steps, load.stop(),
                  ns.clock, ns.threads)
    print(text)
    if not ns.no_write:
        name, _ = _section(amp_patch.cpu_half_support())
        print(f"wrote {write_section(name, text)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
