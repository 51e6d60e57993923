"""End-to-end training-step time under O0-O3 and torch.autocast: rows E1-E3 and M1.

Each level runs in its own process (clean patches, its own memory figure) that
stays alive for the whole run. The parent asks the levels in turn, round after
round, to time a few steps each, so that machine noise falls on all of them
alike; the start of each round rotates to avoid a position bias. This is
``amp_patch.cli.compare.round_robin``, which ``amp-patch compare`` uses too. The median
step time per level gives the ratios:

- E1: O1 step time / autocast step time (target <= 1.05);
- E2: O2 throughput / O3 throughput (>= 0.97) and / autocast throughput
  (>= 1.05), each level with its fastest optimizer (workload ``lm-best``:
  amp_patch's FusedAdam at O0-O3, which takes the one-pass step at O2, and
  ``AdamW(fused=True)`` under autocast);
- E3: O1 and O2 throughput / O0 throughput (targets >= 2.1 and >= 2.4, CPU);
- M1: O3 peak memory / O0 peak memory, both net of the fp32 loss over the logits
  (GPU, target <= 0.55).

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
import dataclasses
import functools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

from amp_patch.cli.compare import models  # noqa: E402
from amp_patch.cli.compare.round_robin import (  # noqa: E402
    JobSpec,
    LevelRecord,
    measure as measure_levels,  # noqa: E402
    median_step_seconds,
)
from amp_patch.cli.compare.trainer import HALF_DTYPES, LEVELS, PRESETS  # noqa: E402
from amp_patch.cli.host_facts import MIN_ROUNDS, HostFacts, LoadMonitor, cpu_half_banner  # noqa: E402

#: The workloads, sized so that an fp32 step takes 100-500 ms on the project's 2-core CPU.
WORKLOADS = {
    "lm": dict(factory=models.lm, kwargs=dict(config=models.BENCH_LM),
               about="GPT-style LM, 21 M params, 4 pre-LN blocks, seq 128, batch 8, AdamW"),
    "lm-fused": dict(factory=models.lm, kwargs=dict(config=models.BENCH_LM, fused=True),
                     about="the same LM and batch, with AdamW(fused=True) at every level"),
    "lm-best": dict(factory=models.lm,
                    kwargs=dict(config=dataclasses.replace(models.BENCH_LM, fused_adam=True)),
                    levels={"autocast": dict(config=dataclasses.replace(models.BENCH_LM,
                                                                        fused=True))},
                    about="the same LM and batch, each level with its fastest optimizer: "
                          "amp_patch FusedAdam at O0-O3 (the one-pass step at O2), "
                          "AdamW(fused=True) under autocast"),
    "convnet": dict(factory=models.convnet, kwargs=dict(batch_size=32, channels=64, image_size=64),
                    about="conv net with BatchNorm, 3 stages of 64-256 channels, 64x64 images, "
                          "batch 32, SGD"),
}

TUNED_MALLOC = common.TUNED_MALLOC
ALLOCATORS = ("default", "tuned")

_LM = ("lm", "lm-fused")
#: (row, what, numerator level, denominator level, kind, target, "<=" or ">=", workloads).
#: The targets are stated for the built-in LM; the conv net's tables are context.
TARGETS = [
    ("E1", "O1 step time / autocast step time", "O1", "autocast", "time", 1.05, "<=", _LM),
    ("E2", "O2 throughput / O3 throughput", "O2", "O3", "throughput", 0.97, ">=", ("lm-best",)),
    ("E2", "O2 throughput / autocast throughput", "O2", "autocast", "throughput", 1.05, ">=",
     ("lm-best",)),
    ("E3", "O1 throughput / O0 throughput", "O1", "O0", "throughput", 2.1, ">=", _LM),
    ("E3", "O2 throughput / O0 throughput", "O2", "O0", "throughput", 2.4, ">=", _LM),
    ("M1", "(O3 peak - L) / (O0 peak - L), L the fp32 loss over the logits", "O3", "O0",
     "memory", 0.55, "<=", _LM),
]
#: M1's L for the LM workloads: the fp32 logits and their log-softmax, which the loss holds at
#: every level (docs/design.md, "Performance targets"; section m1-memory-cpu).
LOSS_FP32_BYTES = 2 * models.BENCH_LM.batch_size * models.BENCH_LM.seq_len * models.BENCH_LM.vocab * 4


def measure(workload: str, levels: list[str], device: str, half: str, rounds: int,
            steps: int, threads: int, warmup: int, allocator: str = "default") -> dict[str, dict]:
    """Median step time and peak memory of each level, timed round-robin (amp_patch.cli.compare.round_robin).

    Args:
        allocator (str, optional): ``"default"`` or ``"tuned"`` (:data:`TUNED_MALLOC`
            in the level processes' environment).

    Returns:
        dict: level to ``{"times", "median_s", "peak_bytes", "error"}``.
    """
    spec = WORKLOADS[workload]
    env = tuple((k, v if allocator == "tuned" else None) for k, v in TUNED_MALLOC.items())
    level_models = tuple((lv, functools.partial(spec["factory"], **kwargs))
                         for lv, kwargs in spec.get("levels", {}).items())
    job = JobSpec(functools.partial(spec["factory"], **spec["kwargs"]), device=device,
                  half_dtype=half, threads=threads, cycle_batches=2, env=env,
                  level_models=level_models)

    def report(r: int, records: dict[str, LevelRecord]) -> None:
        for lv, rec in records.items():
            if rec.error is not None and lv not in failed:
                failed.add(lv)
                print(f"  {lv} failed:\n{rec.error}", file=sys.stderr)
        if r >= 0:
            status = "  ".join(f"{lv} {median_step_seconds(rec) * 1e3:.0f}ms"
                               for lv, rec in records.items() if rec.ok)
            print(f"  {workload} [{allocator} malloc] round {r + 1}/{rounds}: {status}",
                  file=sys.stderr, flush=True)

    failed: set[str] = set()
    records = measure_levels(job, levels, warmup, [steps] * rounds, on_round=report)
    return {lv: {"times": rec.step_seconds,
                 "median_s": median_step_seconds(rec) if rec.ok else None,
                 "peak_bytes": max(rec.round_peak_bytes, default=None) if rec.ok else None,
                 "error": rec.error} for lv, rec in records.items()}


def _ratio(res: dict, num: str, den: str, kind: str) -> float | None:
    a, b = res.get(num), res.get(den)
    if not a or not b:
        return None
    if kind == "memory":
        if a["peak_bytes"] is None or not b["peak_bytes"] or b["peak_bytes"] <= LOSS_FP32_BYTES:
            return None
        return (a["peak_bytes"] - LOSS_FP32_BYTES) / (b["peak_bytes"] - LOSS_FP32_BYTES)
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
           steps: int, load: LoadMonitor | None = None) -> str:
    """Markdown for the report: a table per allocator setting and workload, then the targets.

    Args:
        results (dict): allocator setting to workload to level to measurement.
        load (LoadMonitor, optional): the machine's load around the measurement.
    """
    on_cuda = device.startswith("cuda")
    memory_kind = ("torch.cuda.max_memory_allocated" if on_cuda
                   else "peak anonymous RSS above its value before the model was built")
    parts = [f"## End-to-end training step, {device}, {half}",
             "",
             f"Machine: {common.machine()}. Each level in its own process, timed round-robin: "
             f"{rounds} rounds x {steps} steps, median step time. Memory: {memory_kind}."
             + (f" Machine load: {load.line()}." if load is not None else ""),
             ""]
    banner = cpu_half_banner(HostFacts.collect(device), half)
    if banner:
        parts += ["\n".join(f"> {line}" for line in banner.splitlines()), ""]
    if on_cuda:
        times = [r["median_s"] * 1e3 for by_workload in results.values()
                 for res in by_workload.values() for r in res.values() if r["error"] is None]
        if times:
            parts += [f"The workloads are sized for the CPU. On this GPU a step takes "
                      f"{min(times):.1f}-{max(times):.1f} ms, so it is bound by kernel launches "
                      "and host work, not by arithmetic: half precision gains little and O1's "
                      "casts cost launches. These rows measure each level's overhead, not what "
                      "mixed precision gives a model that fills the GPU.", ""]
    if rounds < MIN_ROUNDS:
        parts += [f"> {rounds} round(s): a smoke test, not a measurement (a speed needs "
                  f"{MIN_ROUNDS} rounds at least).", ""]
    for allocator, by_workload in results.items():
        for workload, res in by_workload.items():
            heading = f"### {workload}: {WORKLOADS[workload]['about']}"
            if not on_cuda:
                heading += f" ({allocator} malloc)"
            parts += [heading, "", _level_table(res), ""]
    target_rows = []
    for row, what, num, den, kind, target, op, workloads in TARGETS:
        if (kind == "memory" and not on_cuda) or (row == "E3" and on_cuda):
            continue
        for workload in workloads:
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
    parts += ["### Targets (docs/design.md)", "", common.markdown_table(header, target_rows)]
    return "\n".join(parts)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu", help="cpu or cuda (default: cpu)")
    p.add_argument("--half-dtype", choices=sorted(HALF_DTYPES), default=None,
                   help="default: fp16 on CUDA, bf16 on CPU")
    p.add_argument("--workloads", nargs="+", choices=sorted(WORKLOADS), default=list(WORKLOADS))
    # The presets (O2-lean) have their own benchmark, bench_lean_state.py.
    p.add_argument("--levels", nargs="+", choices=LEVELS,
                   default=[lv for lv in LEVELS if lv not in PRESETS])
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
    load = LoadMonitor().start()
    for allocator in allocators:
        for workload in ns.workloads:
            print(f"{workload} ({allocator} malloc): {WORKLOADS[workload]['about']}",
                  file=sys.stderr, flush=True)
            results.setdefault(allocator, {})[workload] = measure(
                workload, ns.levels, ns.device, half, ns.rounds, ns.steps, ns.threads, ns.warmup,
                allocator)
    text = report(results, ns.device, half, ns.rounds, ns.steps, load.stop())
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
