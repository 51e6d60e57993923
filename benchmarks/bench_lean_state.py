"""Lean optimizer state: memory and step time of the benchmark LM at O2, per format and masters.

For the benchmark LM (``models.BENCH_LM``, about 21 M params, amp_patch's
FusedAdam in AdamW mode, bf16) at O2, every ``initialize(optimizer_state=...,
master_weights=...)`` combination (``fp32``, ``bf16``, ``int8``, ``fp8`` state;
fp32 masters (True) or bf16 masters) is measured against O2 as it is today
(fp32 state, fp32 masters: FusedAdam's one-pass fp32 step):

- **optimizer bytes / param**: the bytes of the tensors the optimizer owns
  (every tensor in its state: moments or their codes, block scales, step
  counters, fp32 masters kept there; and the params it steps that are not the
  model's own, the masters) over the model's parameter count. A bf16 param
  that is its own master counts 0: it is the model. Counted once per
  configuration after two training steps, in this process.
- **peak memory**: ``amp-patch compare``'s measure, in each configuration's
  own process (:mod:`amp_patch.cli.compare.round_robin`): on the CPU the peak
  anonymous resident memory, sampled after forward, backward and step, above
  the process's before the model was built; on CUDA the allocator's peak
  (``torch.cuda.max_memory_allocated``); the highest of the timed rounds' peaks.
- **optimizer step**: the ``optimizer.step()`` call alone, timed inside each
  training step (the unscale of the grads is part of it: the one-pass step
  reads the scaled bf16 grads; on CUDA the device is synchronised around it),
  median over all timed steps; and the whole training step's median. Both as
  ratios to O2's.

The configurations train side by side, round-robin (each round every
configuration trains its steps in turn, the first rotating), as compare and
``bench_e2e.py`` do, so that machine noise falls on all alike. Targets (issue
24): int8 state with bf16 masters at <= 0.70x O2's peak, <= 4 optimizer bytes
per parameter, and <= 1.05x O2's step time, reported both for the optimizer
step alone and for the whole training step. The section
``lean-state`` of ``docs/benchmarks.md`` is rewritten (``lean-state-<n>t``
with ``--threads n``, ``lean-state-cuda`` with ``--device cuda``).

Usage::

    python benchmarks/bench_lean_state.py [--rounds 10] [--steps 4] [--no-write]
    python benchmarks/bench_lean_state.py --configs int8/bf16 --quick
    python benchmarks/bench_lean_state.py --device cuda --rounds 5
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

import amp_patch as amp  # noqa: E402
from amp_patch import ops  # noqa: E402
from amp_patch.cli.compare import models  # noqa: E402
from amp_patch.cli.compare.round_robin import JobSpec, LevelRecord, measure as measure_levels  # noqa: E402
from amp_patch.cli.compare.trainer import Preset  # noqa: E402
from amp_patch.cli.host_facts import LoadMonitor  # noqa: E402
from amp_patch.settings.dtypes import OPTIMIZER_STATE_NAMES  # noqa: E402

#: The LM of the benchmark, with amp_patch's FusedAdam (the optimizer lean state needs).
LM = dataclasses.replace(models.BENCH_LM, fused_adam=True)
#: The masters: True (fp32) or "bf16", by the name a row shows.
MASTERS = {"fp32": True, "bf16": "bf16"}
#: The anchor: O2 today, fp32 state and fp32 masters.
ANCHOR = "fp32/fp32"

#: (what, numerator config, kind, target) of the issue's targets.
TARGETS = [
    ("peak memory / O2's", "int8/bf16", "peak", 0.70),
    ("optimizer bytes / param", "int8/bf16", "bytes", 4.0),
    ("optimizer step time / O2's", "int8/bf16", "opt", 1.05),
    # The "step time" read as the training step (compare's measure): both are shown.
    ("training step time / O2's", "int8/bf16", "train", 1.05),
]


def config_name(state: str, masters: str) -> str:
    """A row's name: ``"<optimizer_state>/<masters dtype>"``, e.g. ``"int8/bf16"``."""
    return f"{state}/{masters}"


def all_configs() -> list[str]:
    """Every combination, the anchor first."""
    return [config_name(s, m) for s in OPTIMIZER_STATE_NAMES for m in MASTERS]


def initialize_options(name: str) -> dict:
    """The ``initialize`` options of a row beyond ``opt_level="O2"``."""
    state, masters = name.split("/")
    return {"optimizer_state": state, "master_weights": MASTERS[masters]}


def preset(name: str) -> Preset:
    """The row as a :class:`~amp_patch.cli.compare.trainer.Preset` of O2, for the level processes."""
    options = initialize_options(name)
    return Preset(f"O2 {name}", "O2", tuple(options.items()),
                  f"O2 with {options['optimizer_state']} optimizer state and "
                  f"{name.split('/')[1]} masters")


def optimizer_bytes(optimizer: torch.optim.Optimizer, model: torch.nn.Module) -> int:
    """Bytes of the tensors ``optimizer`` owns: its state, and the params it steps that are
    not ``model``'s (fp32 masters). Each storage counts once."""
    model_params = {id(p) for p in model.parameters()}
    seen: set[tuple[int, int]] = set()
    total = 0

    def add(t: torch.Tensor) -> None:
        nonlocal total
        key = (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()

    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) not in model_params:
                add(p)
            for value in optimizer.state.get(p, {}).values():
                if isinstance(value, torch.Tensor):
                    add(value)
    return total


def count_bytes(name: str, device: str = "cpu") -> tuple[int, int]:
    """``(optimizer bytes, model params)`` of a row, after two training steps in this process."""
    model, optimizer, batch_fn, loss_fn = models.lm(device=device, config=LM)
    amp.initialize(model, optimizer, opt_level="O2", half_dtype=torch.bfloat16, verbosity=0,
                   **initialize_options(name))
    try:
        for step in range(2):
            optimizer.zero_grad()
            with amp.scale_loss(loss_fn(model, batch_fn(step)), optimizer) as scaled:
                scaled.backward()
            optimizer.step()
        return optimizer_bytes(optimizer, model), models.parameter_count(model)
    finally:
        amp.deinitialize()


def measure(names: list[str], rounds: int, steps: int, warmup: int, threads: int | None,
            device: str = "cpu") -> dict[str, LevelRecord]:
    """Train every row in its own process, round-robin; their records by row name."""
    presets = {n: preset(n) for n in names}
    job = JobSpec(functools.partial(models.lm, config=LM), device=device, half_dtype="bf16",
                  threads=threads, cycle_batches=2, presets=tuple(presets.values()),
                  time_optimizer=device == "cuda")

    def report(r: int, records: dict[str, LevelRecord]) -> None:
        if r < 0:
            return
        status = "  ".join(
            f"{lv[3:]} {statistics.median(rec.step_seconds) * 1e3:.0f}/"
            f"{statistics.median(rec.optimizer_step_seconds) * 1e3:.1f}ms"
            for lv, rec in records.items() if rec.ok and rec.step_seconds)
        print(f"  round {r + 1}/{rounds} (step/optimizer): {status}", file=sys.stderr, flush=True)

    records = measure_levels(job, [p.name for p in presets.values()], warmup, [steps] * rounds,
                             on_round=report)
    return {n: records[p.name] for n, p in presets.items()}


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


def _fmt(value: float | None, spec: str, suffix: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{suffix}"


def report(names: list[str], sizes: dict[str, tuple[int, int]], records: dict[str, LevelRecord],
           rounds: int, steps: int, warmup: int, load: LoadMonitor, pinned: bool = False,
           device: str = "cpu") -> str:
    """The markdown section (``pinned``: the rows ran with ``--threads``)."""
    peak = {n: max(r.round_peak_bytes, default=None) if r.ok else None
            for n, r in records.items()}
    opt = {n: _median(r.optimizer_step_seconds) if r.ok else None for n, r in records.items()}
    whole = {n: _median(r.step_seconds) if r.ok else None for n, r in records.items()}
    per_param = {n: b / count for n, (b, count) in sizes.items()}
    rows = []
    for n in names:
        state, masters = n.split("/")
        rec = records[n]
        label = f"`{state}`, {masters} masters" + (" (O2 today)" if n == ANCHOR else "")
        if not rec.ok:
            rows.append([label, f"{per_param[n]:.2f}", "failed", "-", "-", "-", "-", "-"])
            continue
        rows.append([
            label, f"{per_param[n]:.2f}", _fmt(peak[n] and peak[n] / 2**20, ".0f", " MiB"),
            _fmt(_ratio(peak[n], peak.get(ANCHOR)), ".2f", "x"),
            _fmt(opt[n] and opt[n] * 1e3, ".1f"), _fmt(_ratio(opt[n], opt.get(ANCHOR)), ".2f", "x"),
            _fmt(whole[n] and whole[n] * 1e3, ".0f"),
            _fmt(_ratio(whole[n], whole.get(ANCHOR)), ".3f", "x")])
    table = common.markdown_table(
        ["optimizer_state, masters", "optimizer bytes / param", "peak memory", "peak / O2",
         "optimizer step ms", "step / O2's", "training step ms", "training step / O2's"], rows)
    host = _host_kind(device)
    values = {"peak": lambda n: _ratio(peak.get(n), peak.get(ANCHOR)),
              "bytes": lambda n: per_param.get(n),
              "opt": lambda n: _ratio(opt.get(n), opt.get(ANCHOR)),
              "train": lambda n: _ratio(whole.get(n), whole.get(ANCHOR))}
    target_rows = []
    for what, n, kind, target in TARGETS:
        value = values[kind](n) if n in records or kind == "bytes" else None
        verdict = ("not measured" if value is None else "met" if value <= target else "**missed**")
        target_rows.append([f"`{n}`: {what}", f"<= {target:.2f}",
                            "-" if value is None else f"{value:.2f}", verdict, host])
    params = next(iter(sizes.values()))[1]
    kernel = ("native" if ops.has_native_kernel(device, "multi_tensor_adam_lean_")
              else "the reference ops (no compiled kernel)")
    failed = [f"{n}: {records[n].error}" for n in names if not records[n].ok]
    threads = next((r.threads for r in records.values() if r.threads), None)
    peak_measure = ("the allocator's peak, `torch.cuda.max_memory_allocated`" if device == "cuda"
                    else "peak anonymous RSS above the process's before the model was built")
    section = section_name(device, threads if pinned else None)
    parts = [
        f"## Lean optimizer state: the benchmark LM at O2 ({section})",
        "",
        f"{common.machine()}. Host kind: {host}. Lean ops: {kernel}. Machine load: "
        f"{load.line()}.",
        "",
        f"LM: `models.BENCH_LM` ({params / 1e6:.1f} M params, vocab {LM.vocab}, d_model "
        f"{LM.d_model}, {LM.n_layers} blocks, seq {LM.seq_len}, batch {LM.batch_size}), amp_patch "
        "FusedAdam (AdamW mode), bf16, O2 with each `optimizer_state` and `master_weights` "
        "(`fp32` masters: True; `bf16`: a bf16 param is its own master, stochastic rounding). "
        f"Each row in its own process ({threads} torch thread{'s' * (threads != 1)}), "
        f"round-robin: {warmup} warm-up steps, then {rounds} rounds "
        f"of {steps} timed steps per row. Optimizer bytes: every tensor in the optimizer's state "
        "(moments or codes, block scales, step counters) plus the fp32 masters it steps, over the "
        "parameter count (a bf16 param that is its own master counts 0). Peak memory: compare's "
        f"measure ({peak_measure}; the highest round). Optimizer step: the `optimizer.step()` "
        "call alone (the one-pass step includes the unscale"
        f"{'; the device synchronised around it' if device == 'cuda' else ''}), median over the "
        "timed steps; training step: the whole step's median. Ratios are against the first "
        "row, O2 as it is today.",
        "",
        table,
        "",
        "### Targets (docs/design.md)",
        "",
        common.markdown_table(["ratio", "target", "measured", "verdict", "host kind"],
                              target_rows),
    ]
    if failed:
        parts += ["", "Failed rows:", *[f"- {line.splitlines()[-1]}" for line in failed]]
    return "\n".join(parts) + "\n"


def section_name(device: str, threads: int | None) -> str:
    """The section of docs/benchmarks.md a run writes: ``lean-state``, ``lean-state-<n>t``
    (pinned to n threads) or ``lean-state-cuda``."""
    if device == "cuda":
        return "lean-state-cuda"
    return "lean-state" + (f"-{threads}t" if threads else "")


def _host_kind(device: str = "cpu") -> str:
    if device == "cuda":
        return torch.cuda.get_device_name()
    support = amp.cpu_half_support()
    return (f"{support.host()}; `torch.ops.mkldnn._is_mkldnn_bf16_supported()` "
            f"{torch.ops.mkldnn._is_mkldnn_bf16_supported()}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--configs", nargs="+", choices=all_configs(), default=None,
                   metavar="STATE/MASTERS",
                   help=f"rows to measure beside {ANCHOR} (O2), from {' '.join(all_configs())} "
                        "(default: all)")
    p.add_argument("--rounds", type=int, default=10, help="round-robin rounds (default: 10)")
    p.add_argument("--steps", type=int, default=4,
                   help="timed steps per row per round (default: 4)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per row first (default: 3)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads per row's process (default: torch's default)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="where the rows train (default: cpu)")
    p.add_argument("--quick", action="store_true", help="2 rounds of 1 step, nothing written")
    p.add_argument("--no-write", action="store_true", help="print only; leave docs/benchmarks.md")
    ns = p.parse_args(argv)
    if ns.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: CUDA is not available to this torch "
                f"({torch.__version__}, CUDA {torch.version.cuda})")
    if ns.quick:
        ns.rounds, ns.steps, ns.warmup = 3, 1, 1
    names = list(dict.fromkeys([ANCHOR, *(ns.configs or all_configs())]))
    load = LoadMonitor().start()
    sizes = {}
    for n in names:
        sizes[n] = count_bytes(n, ns.device)
        print(f"  {n}: {sizes[n][0] / sizes[n][1]:.2f} optimizer bytes / param", file=sys.stderr,
              flush=True)
    records = measure(names, ns.rounds, ns.steps, ns.warmup, ns.threads, ns.device)
    body = report(names, sizes, records, ns.rounds, ns.steps, ns.warmup, load.stop(),
                  pinned=ns.threads is not None, device=ns.device)
    print(body)
    if not ns.no_write and not ns.quick:
        # A run pinned to a thread count, or on CUDA, gets a section of its own.
        section = section_name(ns.device, ns.threads)
        print(f"wrote {common.write_section(section, body)}", file=sys.stderr)
    return 0 if all(r.ok for r in records.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
