"""How often a two-rank DDP run on gloo aborts at exit, by its ending, and what a clean one costs.

Each exit is one ``torchrun --standalone --nproc_per_node 2`` of a short DDP
loop at O2 on the CPU, which then ends in one of three ways:

- ``none``: nothing, as Apex-era scripts end;
- ``destroy``: ``dist.barrier()`` and ``dist.destroy_process_group()``;
- ``close``: :func:`amp_patch.helpers.close_process_group`.

An exit counts as an abort when torchrun reports a rank killed by SIGABRT
(gloo's "terminate called without an active exception", see
docs/distributed.md). The abort needs a gloo worker thread to be descheduled
at the wrong moment, so ``--load`` busy processes run beside the exits; the
modes take turns, so that they share the load alike. The section also gives
the median time of each ending on rank 0, and the cost of
:func:`~amp_patch.helpers.wait_for_gloo_workers` in a process without
gloo (what ``amp-patch run`` adds to every script).

Run: ``python benchmarks/bench_gloo_exit.py`` (section ``gloo-exit`` of
docs/benchmarks.md; about 4 s per exit); ``--runs 3 --no-write`` for a quick look.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

from common import interleaved_median, machine, markdown_table, publish

from amp_patch.helpers import wait_for_gloo_workers

MODES = ("none", "destroy", "close")

WORKER = textwrap.dedent("""
    import sys, time, torch, torch.distributed as dist
    import torch.nn.functional as F
    import amp_patch as amp
    from amp_patch.helpers import close_process_group

    mode = sys.argv[1]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.GELU(), torch.nn.Linear(128, 4))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    model, optimizer = amp.initialize(model, optimizer, opt_level="O2", verbosity=0)
    model = torch.nn.parallel.DistributedDataParallel(model)
    g = torch.Generator().manual_seed(100 + rank)
    for _ in range(3):
        x = torch.randn(32, 32, generator=g)
        loss = F.cross_entropy(model(x).float(), x[:, :4].argmax(dim=1))
        optimizer.zero_grad()
        with amp.scale_loss(loss, optimizer) as scaled:
            scaled.backward()
        optimizer.step()
    start = time.perf_counter()
    if mode == "destroy":
        dist.barrier()
        dist.destroy_process_group()
    elif mode == "close":
        close_process_group()
    if rank == 0:
        print(f"ending ms {(time.perf_counter() - start) * 1e3:.3f}", flush=True)
""")


def one_exit(script: Path, mode: str) -> tuple[bool, float | None]:
    """Run one two-rank exit; return (aborted, rank 0's ending in ms)."""
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc_per_node", "2", str(script), mode],
                          capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    aborted = proc.returncode != 0 and "SIGABRT" in out
    if proc.returncode != 0 and not aborted:
        raise RuntimeError(f"mode {mode}: the run failed otherwise:\n{out[-3000:]}")
    ms = [float(line.split()[-1]) for line in proc.stdout.splitlines()
          if line.startswith("ending ms")]
    return aborted, (ms[0] if ms else None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20, help="exits per mode (default: 20)")
    parser.add_argument("--load", type=int, default=3,
                        help="busy processes beside the exits (default: 3)")
    parser.add_argument("--no-write", action="store_true", help="print only; leave docs/ as it is")
    ns = parser.parse_args()
    if ns.runs < 1 or ns.load < 0:
        parser.error("--runs must be at least 1 and --load at least 0")

    aborts = {m: 0 for m in MODES}
    ending_ms: dict[str, list[float]] = {m: [] for m in MODES}
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(ns.load)]
    try:
        with tempfile.TemporaryDirectory() as tmp:
            script = Path(tmp) / "ddp_exit.py"
            script.write_text(WORKER)
            for run in range(1, ns.runs + 1):
                for mode in MODES:
                    aborted, ms = one_exit(script, mode)
                    aborts[mode] += aborted
                    if ms is not None:
                        ending_ms[mode].append(ms)
                print(f"round {run}/{ns.runs}: aborts so far "
                      + ", ".join(f"{m} {aborts[m]}" for m in MODES), file=sys.stderr, flush=True)
    finally:
        for p in busy:
            p.kill()
            p.wait()

    no_gloo = interleaved_median({"wait": wait_for_gloo_workers}, repeats=21, inner=100)["wait"]
    rows = [[m, ns.runs, aborts[m],
             f"{statistics.median(ending_ms[m]):.2f}" if ending_ms[m] else "-"] for m in MODES]
    body = "\n".join([
        "## Exits of a two-rank DDP run on gloo (gloo-exit)",
        "",
        f"{machine()}. Each exit: `torchrun --standalone --nproc_per_node 2` of a 3-step DDP "
        f"loop at O2 on the CPU, with {ns.load} busy process(es) beside it; the modes take turns. "
        "`none` ends with nothing (as Apex scripts do), `destroy` with `barrier()` and "
        "`destroy_process_group()`, `close` with `amp_patch.helpers.close_process_group()`. "
        "An abort is a rank killed by SIGABRT after its last line (docs/distributed.md).",
        "",
        markdown_table(["ending", "exits", "aborts", "ending on rank 0, median ms"], rows),
        "",
        f"`wait_for_gloo_workers()` in a process without gloo (what `amp-patch run` adds to every "
        f"script): {no_gloo * 1e6:.1f} µs.",
    ])
    publish("gloo-exit", body, write=not ns.no_write)


if __name__ == "__main__":
    main()
