"""Host-bound training step: O1, O2 and O3 against torch.autocast where the host sets the pace.

On a GPU a small model's step is bound by the host: Python, dispatch, one
kernel launch per op. This benchmark measures that proxy on the CPU: the
built-in transformer LM at tiny width (``d_model`` 64, seq 16, batch 2, 4
blocks, vocab 8192), where the blocks' arithmetic is negligible (the LM head's,
a million parameters, is about a third of the step on a CPU). Rows:

- ``O1`` with ``AdamW(fused=True)``; ``O2`` and ``O3`` with amp_patch's
  ``FusedAdam`` (AdamW mode);
- ``autocast``: ``torch.autocast`` bf16 with ``AdamW(fused=True)``, the anchor;
- ``autocast-AA``: a second autocast process, the A/A control: its ratio to
  ``autocast`` must be within 5% of 1, or the run is too noisy to read;
- ``bf16``: the model and ``AdamW(fused=True)`` in pure bf16, no amp at all:
  the floor.

Per row:

- **aten ops per step**: every op that reaches the dispatcher in one whole
  training step (``zero_grad``, forward, loss, backward with ``scale_loss``,
  ``optimizer.step()``), counted with a ``TorchDispatchMode`` (on a GPU, about
  the kernel launches), with the casts (``aten::_to_copy``) in the forward and
  the backward apart;
- **host time per step**: process CPU time (``time.process_time``), one torch
  thread per process. Each row lives in its own spawned process; in each round
  every row trains the same number of steps in turn (the first row rotating),
  and the reported figure is the median over rounds of the per-round ratio to
  autocast's time, over several sessions of fresh processes (a process keeps
  a speed of its own, so rounds alone do not average it away);
- **page faults per step**: the minor faults of the timed steps. By default the
  row processes run with the tuned glibc malloc of docs/install.md
  (``common.TUNED_MALLOC``): with glibc's defaults, freed blocks go back to
  the OS and fault in again, by an amount that depends on each process's
  allocation order and moves rows by up to 10% from run to run. That cost is
  the CPU's alone (a GPU's caching allocator keeps its memory), so it is left
  out of this proxy; ``--default-malloc`` measures with glibc's defaults.

Targets (H2, docs/design.md): O1 <= 1.00x autocast's time with no more aten
ops; O2 <= 0.95x with fewer ops. The section ``host-bound`` of
``docs/benchmarks.md`` is rewritten.

Usage::

    python benchmarks/bench_host_bound.py [--rounds 15] [--sessions 3] [--steps 20] [--default-malloc] [--no-write]
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import multiprocessing as mp
import resource
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

import amp_patch as amp  # noqa: E402
from amp_patch.cli.compare import models  # noqa: E402
from amp_patch.cli.compare.round_robin import spawn_environment  # noqa: E402
from amp_patch.cli.host_facts import LoadMonitor  # noqa: E402

#: The tiny LM: the benchmark LM's depth and vocabulary at width 64, seq 16, batch 2.
TINY_LM = dataclasses.replace(models.BENCH_LM, d_model=64, seq_len=16, batch_size=2)
#: Rows in the order of the tables; ``autocast`` is the anchor.
ROWS = ("O1", "O2", "O3", "autocast", "autocast-AA", "bf16")
ANCHOR = "autocast"
#: The A/A control's tolerance: ``autocast-AA`` / ``autocast`` within 1 +- this.
AA_TOLERANCE = 0.05
#: (row, target on the time ratio, how its op count must compare with autocast's).
TARGETS = [("O1", 1.00, "<="), ("O2", 0.95, "<")]


class OpCounter(TorchDispatchMode):
    """Counts the aten ops that reach the dispatcher, and the casts per phase.

    Attributes:
        ops (collections.Counter): op name (overload packet) to calls.
        casts (collections.Counter): phase to ``aten::_to_copy`` calls.
        phase (str): the phase the casts of the next ops count under.
    """

    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter = collections.Counter()
        self.casts: collections.Counter = collections.Counter()
        self.phase = "forward"

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        self.ops[name] += 1
        if name == "_to_copy":
            self.casts[self.phase] += 1
        return func(*args, **(kwargs or {}))


class _Row:
    """One row's model, optimizer and training step, built in its process."""

    def __init__(self, row: str) -> None:
        torch.manual_seed(0)
        level = row.split("-")[0]
        fused_adam = level in ("O2", "O3")
        cfg = dataclasses.replace(TINY_LM, fused=not fused_adam, fused_adam=fused_adam)
        self.model, self.optimizer, batch_fn, self.loss_fn = models.lm(config=cfg)
        self.batch = batch_fn(0)
        self.level = level
        if level == "bf16":
            self.model.to(torch.bfloat16)  # the optimizer holds the same Parameters
        elif level != "autocast":
            amp.initialize(self.model, self.optimizer, opt_level=level,
                           half_dtype=torch.bfloat16, verbosity=0)

    def step(self, phase: Callable[[str], None] = lambda _: None) -> None:
        """One training step; ``phase`` is told where the forward ends and the step begins."""
        self.optimizer.zero_grad()
        phase("forward")
        if self.level == "autocast":
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = self.loss_fn(self.model, self.batch)
            phase("backward")
            loss.backward()
        elif self.level == "bf16":
            loss = self.loss_fn(self.model, self.batch)
            phase("backward")
            loss.backward()
        else:
            loss = self.loss_fn(self.model, self.batch)
            phase("backward")
            with amp.scale_loss(loss, self.optimizer) as scaled:
                scaled.backward()
        phase("step")
        self.optimizer.step()

    def count(self) -> dict[str, Any]:
        counter = OpCounter()

        def phase(name: str) -> None:
            counter.phase = name

        with counter:
            self.step(phase)
        return {"ops": sum(counter.ops.values()), "casts": dict(counter.casts),
                "by_op": dict(counter.ops)}

    def timed(self, steps: int) -> tuple[float, float]:
        """Seconds of process CPU time and minor page faults, per step."""
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        t0 = time.process_time()
        for _ in range(steps):
            self.step()
        seconds = (time.process_time() - t0) / steps
        return seconds, (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults) / steps


def _serve(conn, row: str, warmup: int) -> None:
    """A row's process: build, warm up, count once, then time steps when asked."""
    torch.set_num_threads(1)  # process CPU time then measures this thread's work alone
    try:
        run = _Row(row)
        for _ in range(warmup):
            run.step()
        conn.send(("ready", run.count()))
        while True:
            steps = conn.recv()
            if steps is None:
                return
            conn.send(("time", run.timed(steps)))
    except BaseException as exc:  # reported to the parent as the row's failure
        conn.send(("error", f"{type(exc).__name__}: {exc}"))


@dataclasses.dataclass
class RowRecord:
    """What the parent collected of a row: its op counts and per-round seconds per step."""

    row: str
    counts: dict[str, Any] = dataclasses.field(default_factory=dict)
    seconds: list[float] = dataclasses.field(default_factory=list)
    faults: list[float] = dataclasses.field(default_factory=list)
    error: str | None = None
    #: The session (a fresh set of row processes) of each entry of ``seconds``.
    session: list[int] = dataclasses.field(default_factory=list)

    def extend(self, other: "RowRecord", session: int) -> None:
        """Add ``other``'s rounds, measured in ``session``; its counts when none yet."""
        self.counts = self.counts or other.counts
        self.seconds += other.seconds
        self.faults += other.faults
        self.session += [session] * len(other.seconds)
        self.error = self.error or other.error


def measure(rows: tuple[str, ...], rounds: int, steps: int, warmup: int,
            malloc: dict[str, str | None] | None = None) -> dict[str, RowRecord]:
    """Start a process per row, then time ``rounds`` interleaved rounds of ``steps`` steps.

    ``malloc``: environment variables the row processes start with (None: unset).
    """
    ctx = mp.get_context("spawn")
    records = {r: RowRecord(r) for r in rows}
    procs, conns = {}, {}
    with spawn_environment(list((malloc or {}).items())):  # glibc reads them as a process starts
        for r in rows:
            parent, child = ctx.Pipe()
            procs[r] = ctx.Process(target=_serve, args=(child, r, warmup), daemon=True)
            procs[r].start()
            conns[r] = parent
    try:
        for r in rows:
            kind, payload = conns[r].recv()
            if kind == "error":
                records[r].error = payload
            else:
                records[r].counts = payload
        alive = [r for r in rows if records[r].error is None]
        for i in range(rounds):
            order = alive[i % len(alive):] + alive[:i % len(alive)]
            for r in order:
                conns[r].send(steps)
                kind, payload = conns[r].recv()
                if kind == "error":
                    records[r].error = payload
                    alive.remove(r)
                else:
                    records[r].seconds.append(payload[0])
                    records[r].faults.append(payload[1])
            print(f"  round {i + 1}/{rounds}: " + "  ".join(
                f"{r} {records[r].seconds[-1] * 1e3:.2f}" for r in alive if records[r].seconds)
                + " ms", file=sys.stderr, flush=True)
    finally:
        for r in rows:
            try:
                conns[r].send(None)
            except OSError:
                pass
            procs[r].join(timeout=10)
            if procs[r].is_alive():
                procs[r].terminate()
    return records


def ratio_to_anchor(records: dict[str, RowRecord], row: str,
                    session: int | None = None) -> float | None:
    """The median over rounds of ``row``'s time over the anchor's in the same round (of one
    session, or of all)."""
    a, b = records[row], records[ANCHOR]
    ratios = [x / y for i, (x, y) in enumerate(zip(a.seconds, b.seconds))
              if y > 0 and (session is None or i >= len(a.session) or a.session[i] == session)]
    return statistics.median(ratios) if ratios else None


def session_ratios(records: dict[str, RowRecord], row: str) -> list[float]:
    """:func:`ratio_to_anchor` of each session, in order."""
    out = []
    for session in dict.fromkeys(records[row].session):
        ratio = ratio_to_anchor(records, row, session)
        if ratio is not None:
            out.append(ratio)
    return out


def report(records: dict[str, RowRecord], rounds: int, steps: int, warmup: int,
           load: LoadMonitor, tuned_malloc: bool = True, sessions: int = 1) -> str:
    """The markdown section ``host-bound``."""
    anchor_ops = records[ANCHOR].counts.get("ops")
    aa = ratio_to_anchor(records, "autocast-AA") if "autocast-AA" in records else None
    usable = aa is not None and abs(aa - 1) <= AA_TOLERANCE
    rows = []
    for r, rec in records.items():
        if rec.error:
            rows.append([r, "failed", "-", "-", "-", "-", "-", "-", rec.error])
            continue
        ratio = ratio_to_anchor(records, r)
        casts = rec.counts.get("casts", {})
        rows.append([r, rec.counts["ops"], f"{casts.get('forward', 0)} / {casts.get('backward', 0)}"
                     f" / {casts.get('step', 0)}",
                     f"{statistics.median(rec.seconds) * 1e3:.2f}",
                     "-" if ratio is None else f"{ratio:.3f}x",
                     " / ".join(f"{x:.3f}" for x in session_ratios(records, r)) or "-",
                     f"{statistics.median(rec.faults):.0f}" if rec.faults else "-",
                     _about(r), ""])
    target_rows = []
    for r, target, sense in TARGETS:
        rec = records.get(r)
        if rec is None or rec.error:
            target_rows.append([r, f"<= {target:.2f}x", "-", f"{sense} autocast's", "-",
                                "not measured"])
            continue
        ratio = ratio_to_anchor(records, r)
        ops = rec.counts["ops"]
        ops_ok = ops <= anchor_ops if sense == "<=" else ops < anchor_ops
        time_ok = ratio is not None and ratio <= target
        verdict = "met" if time_ok and ops_ok else "**missed**"
        if not usable:
            verdict += " (A/A control out of range: not judged)"
        target_rows.append([r, f"<= {target:.2f}x", f"{ratio:.3f}x", f"{sense} {anchor_ops}",
                            f"{ops} ({'ok' if ops_ok else 'missed'})", verdict])
    aa_line = ("-" if aa is None else f"{aa:.3f}") + (
        " (within 5%: the run is usable)" if usable else " (**outside 5%: rerun when quieter**)")
    threads = 1
    return "\n".join([
        "## Host-bound step: the tiny LM, O1-O3 against autocast (host-bound)",
        "",
        f"Machine: {common.machine()}. Host kind: {_host_kind()}. Machine load: {load.line()}.",
        "",
        f"The built-in LM at width {TINY_LM.d_model}, seq {TINY_LM.seq_len}, batch "
        f"{TINY_LM.batch_size}, {TINY_LM.n_layers} blocks, vocab {TINY_LM.vocab}, bf16: the "
        "blocks' arithmetic is negligible and the rest of the step's time is the host's "
        "(Python, dispatch; on a GPU, one launch per op), but for the LM head and its "
        "optimizer state, a million parameters at this vocab, whose matmuls, log-softmax "
        "and optimizer kernels take about a third of autocast's step on a CPU (torch "
        "profiler: 3.8 of 11.2 ms). Each row in its own spawned process with "
        f"{threads} torch thread, {warmup} warm-up steps, then {rounds} interleaved rounds of "
        f"{steps} steps (the first row rotating); {sessions} session(s), each with fresh "
        "processes (a process keeps a speed of its own, within a few per cent, so rounds alone "
        "do not average it away). Time: process CPU time per step; the ratio "
        "is the median over all rounds of the row's time over autocast's in the same round, "
        "and per session the same median over that session's rounds. aten "
        "ops: one whole training step (zero_grad, forward, loss, backward, optimizer step) "
        "under a TorchDispatchMode; casts are `aten::_to_copy` calls. Page faults: the median "
        "over rounds of the minor faults per timed step. "
        + ("The row processes ran with the tuned glibc malloc of docs/install.md "
           "(`MALLOC_MMAP_THRESHOLD_`, `MALLOC_TRIM_THRESHOLD_`, `MALLOC_TOP_PAD_`): with "
           "glibc's defaults, freed blocks go back to the OS and fault in again by an amount "
           "that depends on each process's allocation order, a CPU-only cost that moved rows "
           "by up to 10% between runs (`--default-malloc` measures it)."
           if tuned_malloc else
           "The row processes ran with glibc malloc's defaults (`--default-malloc`)."),
        "",
        f"A/A control (a second autocast process / autocast): {aa_line}.",
        "",
        common.markdown_table(["row", "aten ops / step", "casts: forward / backward / step",
                               "CPU ms / step (median)", "time / autocast's",
                               "per session", "page faults / step", "what", "error"], rows),
        "",
        "### Targets (H2, docs/design.md)",
        "",
        common.markdown_table(["row", "time target", "time measured", "ops target",
                               "ops measured", "verdict"], target_rows),
    ]) + "\n"


def _about(row: str) -> str:
    return {"O1": "amp_patch O1, AdamW(fused=True)",
            "O2": "amp_patch O2, FusedAdam (one-pass step)",
            "O3": "amp_patch O3, FusedAdam",
            "autocast": "torch.autocast bf16, AdamW(fused=True): the anchor",
            "autocast-AA": "the same, a second process: the A/A control",
            "bf16": "model and AdamW(fused=True) in bf16, no amp: the floor"}[row]


def _host_kind() -> str:
    bf16 = amp.cpu_half_support().bfloat16
    kind = ("native bf16" if bf16.matmul and bf16.conv else "conv-only bf16" if bf16.conv
            else "no native bf16")
    return f"{kind}; {amp.cpu_half_support().host()}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=15,
                   help="interleaved rounds per session (default: 15)")
    p.add_argument("--sessions", type=int, default=3,
                   help="sessions, each with fresh row processes (default: 3)")
    p.add_argument("--steps", type=int, default=20, help="steps per row per round (default: 20)")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps per row (default: 5)")
    p.add_argument("--rows", nargs="+", choices=ROWS, default=None,
                   help=f"rows beside {ANCHOR} (default: all)")
    p.add_argument("--default-malloc", action="store_true",
                   help="run the rows with glibc malloc's defaults, not the tuned settings")
    p.add_argument("--no-write", action="store_true", help="print only; leave docs/benchmarks.md")
    ns = p.parse_args(argv)
    rows = tuple(dict.fromkeys([ANCHOR, *(ns.rows or ROWS)]))
    malloc = ({k: None for k in common.TUNED_MALLOC} if ns.default_malloc
              else dict(common.TUNED_MALLOC))
    load = LoadMonitor().start()
    records = {r: RowRecord(r) for r in rows}
    for session in range(ns.sessions):
        print(f"session {session + 1}/{ns.sessions}", file=sys.stderr, flush=True)
        for r, rec in measure(rows, ns.rounds, ns.steps, ns.warmup, malloc).items():
            records[r].extend(rec, session)
    body = report(records, ns.rounds, ns.steps, ns.warmup, load.stop(),
                  tuned_malloc=not ns.default_malloc, sessions=ns.sessions)
    common.publish("host-bound", body, write=not ns.no_write)
    return 0 if all(r.error is None for r in records.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
