"""End-to-end training-step time under O0-O3 and torch.autocast: rows E1-E3 and M1.

Each level runs in its own process (clean patches, its own memory figure) that
stays alive for the whole run. The parent asks the levels in turn, round after
round, to time a few steps each, so that machine noise falls on all of them
alike; the start of each round rotates to avoid a position bias. The median
step time per level gives the ratios:

- E1: O1 step time / autocast step time (target <= 1.05);
- E2: O2 throughput / autocast throughput (target >= 1.10);
- E3: O1 and O2 throughput / O0 throughput (targets >= 2.1 and >= 2.4, CPU);
- M1: O3 peak memory / O0 peak memory (GPU, target <= 0.55).

On CPU it measures twice: with glibc malloc's defaults, and with the
allocator tuning that PyTorch's CPU performance guides recommend (keep freed
memory in the heap instead of returning it to the OS, see ``TUNED_MALLOC``).
By default, every large temporary (an optimizer's fp32 ``sqrt`` of the second
moment, say) is a fresh ``mmap`` whose pages fault in on first touch, and that
costs the levels unequally. All levels of one measurement share one setting.

Usage::

    python benchmarks/bench_e2e.py                      # CPU, bf16, the LM and the conv net
    python benchmarks/bench_e2e.py --device cuda --half-dtype fp16
    python benchmarks/bench_e2e.py --quick              # few rounds, for a smoke test
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

from amp_patch.cli import models  # noqa: E402
from amp_patch.cli.trainer import HALF_DTYPES, LEVELS, CpuPeak, LevelTrainer  # noqa: E402

#: The workloads, sized so that an fp32 step takes 100-500 ms on the project's 2-core CPU.
WORKLOADS = {
    "lm": dict(factory=models.lm, kwargs=dict(config=models.BENCH_LM),
               about="GPT-style LM, 21 M params, 4 pre-LN blocks, seq 128, batch 8, AdamW"),
    "lm-fused": dict(factory=models.lm, kwargs=dict(config=models.BENCH_LM, fused=True),
                     about="the same LM and batch, with AdamW(fused=True) at every level"),
    "convnet": dict(factory=models.convnet, kwargs=dict(batch_size=32, channels=64, image_size=64),
                    about="conv net with BatchNorm, 3 stages of 64-256 channels, 64x64 images, "
                          "batch 32, SGD"),
}

#: glibc malloc settings read at process start: allocations up to 32 MiB come from the heap,
#: and freed memory stays there, so an iteration's temporaries reuse warm pages.
TUNED_MALLOC = {
    "MALLOC_MMAP_THRESHOLD_": str(32 * 2**20),
    "MALLOC_TRIM_THRESHOLD_": str(16 * 2**30),
    "MALLOC_TOP_PAD_": str(256 * 2**20),
}
ALLOCATORS = ("default", "tuned")

#: (row, what, numerator level, denominator level, kind, target, "<=" or ">=")
TARGETS = [
    ("E1", "O1 step time / autocast step time", "O1", "autocast", "time", 1.05, "<="),
    ("E2", "O2 throughput / autocast throughput", "O2", "autocast", "throughput", 1.10, ">="),
    ("E3", "O1 throughput / O0 throughput", "O1", "O0", "throughput", 2.1, ">="),
    ("E3", "O2 throughput / O0 throughput", "O2", "O0", "throughput", 2.4, ">="),
    ("M1", "O3 peak memory / O0 peak memory", "O3", "O0", "memory", 0.55, "<="),
]


def _worker(conn, workload: str, level: str, device: str, half: str, threads: int,
            warmup: int) -> None:
    """A level's process: build, warm up, then time steps whenever the parent asks."""
    try:
        torch.set_num_threads(threads)
        dev = torch.device(device)
        spec = WORKLOADS[workload]
        model, optimizer, batch_fn, loss_fn = spec["factory"](device=dev, **spec["kwargs"])
        cpu_peak = CpuPeak()
        trainer = LevelTrainer(level, model, optimizer, loss_fn, dev, HALF_DTYPES[half],
                               sample=cpu_peak.sample)
        batches = [batch_fn(i) for i in range(2)]
        for i in range(warmup):
            trainer.step(batches[i % 2])
        common.sync(dev)
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats(dev)
        conn.send(("ready", None))
        step = 0
        while True:
            cmd, n = conn.recv()
            if cmd == "stop":
                peak = (torch.cuda.max_memory_allocated(dev) if dev.type == "cuda"
                        else cpu_peak.delta())
                conn.send(("peak", peak))
                return
            times = []
            for _ in range(n):
                common.sync(dev)
                t0 = time.perf_counter()
                trainer.step(batches[step % 2])
                common.sync(dev)
                times.append(time.perf_counter() - t0)
                step += 1
            conn.send(("times", times))
    except BaseException:
        conn.send(("error", traceback.format_exc()))


def measure(workload: str, levels: list[str], device: str, half: str, rounds: int,
            steps: int, threads: int, warmup: int, allocator: str = "default") -> dict[str, dict]:
    """Median step time and peak memory of each level, timed round-robin.

    Args:
        allocator (str, optional): ``"default"`` or ``"tuned"`` (:data:`TUNED_MALLOC`
            in the level processes' environment).

    Returns:
        dict: level to ``{"median_s", "peak_bytes", "error"}``.
    """
    ctx = mp.get_context("spawn")
    procs, conns = {}, {}
    saved = {k: os.environ.get(k) for k in TUNED_MALLOC}
    for k in TUNED_MALLOC:
        os.environ.pop(k, None)
    if allocator == "tuned":
        os.environ.update(TUNED_MALLOC)
    for lv in levels:
        parent, child = ctx.Pipe()
        procs[lv] = ctx.Process(target=_worker, args=(child, workload, lv, device, half, threads,
                                                     warmup), daemon=True)
        procs[lv].start()
        conns[lv] = parent
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    out = {lv: {"times": [], "median_s": None, "peak_bytes": None, "error": None} for lv in levels}
    for lv in levels:
        kind, payload = conns[lv].recv()
        if kind == "error":
            out[lv]["error"] = payload
            print(f"  {lv} failed to start:\n{payload}", file=sys.stderr)
    alive = [lv for lv in levels if out[lv]["error"] is None]
    for r in range(rounds):
        order = alive[r % len(alive):] + alive[:r % len(alive)] if alive else []
        for lv in order:
            conns[lv].send(("run", steps))
            kind, payload = conns[lv].recv()
            if kind == "error":
                out[lv]["error"] = payload
                print(f"  {lv} failed:\n{payload}", file=sys.stderr)
            else:
                out[lv]["times"].extend(payload)
        alive = [lv for lv in alive if out[lv]["error"] is None]
        status = "  ".join(f"{lv} {statistics.median(out[lv]['times']) * 1e3:.0f}ms"
                           for lv in alive)
        print(f"  {workload} [{allocator} malloc] round {r + 1}/{rounds}: {status}", file=sys.stderr, flush=True)
    for lv in alive:
        conns[lv].send(("stop", 0))
        kind, payload = conns[lv].recv()
        out[lv]["peak_bytes"] = payload
        out[lv]["median_s"] = statistics.median(out[lv]["times"])
    for p in procs.values():
        p.join(timeout=30)
    return out


def _ratio(res: dict, num: str, den: str, kind: str) -> float | None:
    a, b = res.get(num), res.get(den)
    if not a or not b:
        return None
    if kind == "memory":
        if a["peak_bytes"] is None or not b["peak_bytes"]:
            return None
        return a["peak_bytes"] / b["peak_bytes"]
    if a["median_s"] is None or b["median_s"] is None:
        return None
    if kind == "time":
        return a["median_s"] / b["median_s"]
    return b["median_s"] / a["median_s"]


def _level_table(res: dict[str, dict]) -> str:
    o0 = res.get("O0") or {}
    ac = res.get("autocast") or {}
    rows = []
    for lv, r in res.items():
        if r["error"] is not None:
            rows.append([lv, "failed", "-", "-", "-", "-"])
            continue
        ms = r["median_s"] * 1e3
        vs_o0 = f"{o0['median_s'] / r['median_s']:.2f}x" if o0.get("median_s") else "-"
        vs_ac = f"{ac['median_s'] / r['median_s']:.2f}x" if ac.get("median_s") else "-"
        rows.append([lv, f"{ms:.1f}", f"{1e3 / ms:.2f}", vs_o0, vs_ac,
                     f"{r['peak_bytes'] / 2**20:.0f} MiB"])
    return common.markdown_table(["level", "ms/step", "steps/s", "throughput vs O0",
                                  "throughput vs autocast", "peak memory"], rows)


def report(results: dict[str, dict[str, dict]], device: str, half: str, rounds: int,
           steps: int) -> str:
    """Markdown for the report: a table per allocator setting and workload, then the targets.

    Args:
        results (dict): allocator setting to workload to level to measurement.
    """
    on_cuda = device.startswith("cuda")
    memory_kind = "torch.cuda.max_memory_allocated" if on_cuda else "peak anonymous RSS above start"
    parts = [f"## End-to-end training step, {device}, {half}",
             "",
             f"Machine: {common.machine()}. Each level in its own process, timed round-robin: "
             f"{rounds} rounds x {steps} steps, median step time. Memory: {memory_kind}.",
             ""]
    for allocator, by_workload in results.items():
        for workload, res in by_workload.items():
            heading = f"### {workload}: {WORKLOADS[workload]['about']}"
            if not on_cuda:
                heading += f" ({allocator} malloc)"
            parts += [heading, "", _level_table(res), ""]
    target_rows = []
    for row, what, num, den, kind, target, op in TARGETS:
        if (kind == "memory" and not on_cuda) or (row == "E3" and on_cuda):
            continue
        # The targets are stated for the built-in LM (with torch's default AdamW, and with
        # its fused AdamW); the conv net's tables are context.
        for workload in ("lm", "lm-fused"):
            if not any(workload in by_workload for by_workload in results.values()):
                continue
            cells = []
            for by_workload in results.values():
                value = _ratio(by_workload.get(workload, {}), num, den, kind)
                if value is None:
                    cells.append("not measured")
                else:
                    met = value <= target if op == "<=" else value >= target
                    cells.append(f"{value:.3f} " + ("met" if met else "**missed**"))
            target_rows.append([row, workload, what, f"{op} {target}", *cells])
    header = ["row", "workload", "ratio", "target"] + [
        f"measured, {a} malloc" if not on_cuda else "measured" for a in results]
    parts += ["### Targets (PERFORMANCE.md)", "", common.markdown_table(header, target_rows)]
    return "\n".join(parts)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu", help="cpu or cuda (default: cpu)")
    p.add_argument("--half-dtype", choices=sorted(HALF_DTYPES), default=None,
                   help="default: fp16 on CUDA, bf16 on CPU")
    p.add_argument("--workloads", nargs="+", choices=sorted(WORKLOADS), default=list(WORKLOADS))
    p.add_argument("--levels", nargs="+", choices=LEVELS, default=list(LEVELS))
    p.add_argument("--allocators", nargs="+", choices=ALLOCATORS, default=None,
                   help="CPU malloc settings to measure under (default: both on CPU)")
    p.add_argument("--rounds", type=int, default=8, help="rounds of round-robin timing (default: 8)")
    p.add_argument("--steps", type=int, default=3, help="timed steps per level per round (default: 3)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per level first (default: 3)")
    p.add_argument("--threads", type=int, default=torch.get_num_threads(),
                   help="torch threads per level process (default: torch's default)")
    p.add_argument("--quick", action="store_true", help="2 rounds of 1 step: a smoke test")
    p.add_argument("--no-write", action="store_true", help="print only; leave docs/benchmarks.md")
    ns = p.parse_args(argv)
    on_cuda = ns.device.startswith("cuda")
    half = ns.half_dtype or ("fp16" if on_cuda else "bf16")
    allocators = ns.allocators or (["default"] if on_cuda else list(ALLOCATORS))
    if ns.quick:
        ns.rounds, ns.steps, ns.warmup = 2, 1, 1
    results: dict[str, dict[str, dict]] = {}
    for allocator in allocators:
        for workload in ns.workloads:
            print(f"{workload} ({allocator} malloc): {WORKLOADS[workload]['about']}",
                  file=sys.stderr, flush=True)
            results.setdefault(allocator, {})[workload] = measure(
                workload, ns.levels, ns.device, half, ns.rounds, ns.steps, ns.threads, ns.warmup,
                allocator)
    text = report(results, ns.device, half, ns.rounds, ns.steps)
    print(text)
    if not ns.no_write and not ns.quick:
        path = common.write_section(f"e2e-{torch.device(ns.device).type}-{half}", text)
        print(f"wrote {path}", file=sys.stderr)
    failed = [f"{a}/{w}/{lv}" for a, by_w in results.items() for w, res in by_w.items()
              for lv, r in res.items() if r["error"]]
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
