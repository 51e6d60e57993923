"""The fused optimizers' step on FSDP2's shards against the same step on plain tensors.

Two ranks (gloo on the CPU, one thread each) each hold the same shards twice:
as DTensors sharded on dim 0 over both ranks, as FSDP2 leaves its parameters,
and as plain tensors holding the same rows. Every optimizer steps both, timed
in turn (a barrier before each timing, none inside it; median of repeats,
slowest rank). The ratio is the cost of stepping shards: handing the ops the
local tensors, and for FusedLAMB and FusedNovoGrad the all-reduces per step
that make their norms those of the whole tensors (docs/distributed.md). The
plain step is the anchor: it does the same arithmetic on the same bytes.

Usage::

    python benchmarks/bench_sharded_step.py [--params 20e6] [--repeats 9] [--no-write]
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine, markdown_table, write_section  # noqa: E402

WORLD = 2
N_TENSORS = 100
COLS = 512
OPTIMIZERS = {
    "FusedAdam": dict(lr=1e-3, weight_decay=0.01),
    "FusedAdagrad": dict(lr=1e-2),
    "FusedNovoGrad": dict(lr=1e-2, weight_decay=0.01),
    "FusedLAMB": dict(lr=1e-3, weight_decay=0.01, max_grad_norm=1.0),
}


def _rank(rank: int, port: int, params: int, repeats: int, out: "mp.SimpleQueue") -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from amp_patch import optimizers

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (WORLD,))
    rows = max(WORLD, params // (N_TENSORS * COLS))
    gen = torch.Generator().manual_seed(0)
    fulls = [torch.randn(rows, COLS, generator=gen) for _ in range(N_TENSORS)]
    grads = [torch.randn(rows, COLS, generator=gen) for _ in range(N_TENSORS)]
    steps = {}
    for name, kwargs in OPTIMIZERS.items():
        for kind in ("sharded", "plain"):
            if kind == "sharded":
                ps = [torch.nn.Parameter(distribute_tensor(t, mesh, [Shard(0)])) for t in fulls]
                for p, g in zip(ps, grads):
                    p.grad = distribute_tensor(g, mesh, [Shard(0)])
            else:
                ps = [torch.nn.Parameter(t.chunk(WORLD)[rank].clone()) for t in fulls]
                for p, g in zip(ps, grads):
                    p.grad = g.chunk(WORLD)[rank].clone()
            steps[(name, kind)] = getattr(optimizers, name)(ps, **kwargs).step
    times: dict[tuple[str, str], list[float]] = {k: [] for k in steps}
    for r in range(2 + repeats):
        for key, step in steps.items():
            dist.barrier()
            t0 = time.perf_counter()
            step()
            elapsed = time.perf_counter() - t0
            if r >= 2:
                times[key].append(elapsed)
    medians = torch.tensor([statistics.median(times[k]) for k in steps], dtype=torch.float64)
    dist.all_reduce(medians, op=dist.ReduceOp.MAX)  # the slowest rank's
    if rank == 0:
        out.put({k: float(v) for k, v in zip(steps, medians)})
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure(params: int, repeats: int) -> dict[tuple[str, str], float]:
    """Median seconds of each (optimizer, "sharded" or "plain") step, the slowest rank's."""
    ctx = mp.get_context("spawn")
    out = ctx.SimpleQueue()
    mp.start_processes(_rank, args=(_free_port(), params, repeats, out), nprocs=WORLD,
                       start_method="spawn")
    return out.get()


def report(results: dict[tuple[str, str], float], params: int, repeats: int) -> str:
    rows = []
    for name in OPTIMIZERS:
        sharded, plain = results[(name, "sharded")], results[(name, "plain")]
        rows.append([name, f"{sharded * 1e3:.1f}", f"{plain * 1e3:.1f}", f"{sharded / plain:.2f}x"])
    return "\n\n".join([
        "## Fused optimizer steps on FSDP2's shards (cpu, 2 ranks)",
        f"{machine()}. gloo, one thread per rank.",
        f"{params / 1e6:.1f} M params in {N_TENSORS} fp32 tensors, sharded on dim 0 over 2 ranks. "
        "`sharded`: the params are DTensors (FSDP2's); `plain`: the same rows as plain tensors "
        f"(the anchor: the same arithmetic, no collective). Median of {repeats} interleaved "
        "repeats, the slowest rank's. FusedNovoGrad all-reduces its norms once per step, "
        "FusedLAMB twice (the global grad norm, then the trust-ratio norms).",
        markdown_table(["optimizer", "sharded ms", "plain ms", "sharded / plain"], rows),
    ])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--params", type=float, default=20e6, help="params in all (default 20e6)")
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--no-write", action="store_true", help="print only; leave docs/benchmarks.md")
    args = p.parse_args(argv)
    print(f"stepping {len(OPTIMIZERS)} optimizers on {int(args.params):,} params over {WORLD} "
          "ranks...", flush=True)
    body = report(measure(int(args.params), args.repeats), int(args.params), args.repeats)
    print(body)
    if not args.no_write:
        print(f"wrote {write_section('sharded-steps', body)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
