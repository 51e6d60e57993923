"""Per-rank memory of the built-in LM at O0-O3 under DDP and FSDP2, with 1, 2 and 4 data_parallel.

Every configuration (mode, level, ranks) runs in its own fresh process group,
launched as ``amp-patch compare --nproc`` launches its ranks
(``amp_patch/cli/compare/data_parallel.py``: torch's elastic agent, gloo over the CPU, NCCL
and one GPU per rank where CUDA is available). Each rank builds the LM
(``amp_patch/cli/compare/models.py``; ``BENCH_LM`` by default), wraps it in
DistributedDataParallel or shards it with ``fully_shard`` (each block, then
the root, the usual recipe), runs ``amp_patch.initialize`` at the level with
AdamW, and trains ``--steps`` steps on its slice of one global batch (the
LM's batch size, split over the ranks). Two numbers per rank, the table
showing the largest over the ranks:

- **state**: the bytes of parameters, gradients, fp32 masters and optimizer
  state that the rank holds, counted when they are all alive at once (after
  the backward of a step, before its ``step()``). Exact and load-independent.
- **peak**: on the CPU, the rise of the process's peak resident memory
  (``VmHWM``, reset through ``/proc/self/clear_refs``) over its resident
  memory before the model is built: the model, the state, the activations and
  the all-gather buffers, plus what the allocator keeps. A run of a tiny LM
  through the same mode and level comes first, so that library code paged in
  and the allocator's first arenas are not counted. On CUDA, the rise of
  ``torch.cuda.max_memory_allocated``.

Run: ``python benchmarks/bench_distributed.py`` (writes the memory table into
docs/distributed.md); ``--quick`` runs the small LM (``COMPARE_LM``), two
steps, 1 and 2 ranks, and writes nothing.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

import amp_patch as amp
from amp_patch.cli.compare import data_parallel, models
from amp_patch.cli.host_facts import cpu_count
from amp_patch.helpers import close_process_group
from amp_patch.helpers.tensors import local_tensor
from amp_patch.settings import levels

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine, markdown_table, write_section  # noqa: E402

DOC = Path(__file__).resolve().parent.parent / "docs" / "distributed.md"
LMS = {"compare": models.COMPARE_LM, "bench": models.BENCH_LM}
LEVELS = levels.NAMES
MODES = ("ddp", "fsdp")
WORLDS = (1, 2, 4)
MiB = 2**20


# --------------------------------------------------------------------------- one rank


def _status(field: str) -> int:
    """A ``/proc/self/status`` field in bytes (``VmRSS``, ``VmHWM``)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def _reset_peak() -> int:
    """Reset the peak resident memory to the current one; return the current one."""
    Path("/proc/self/clear_refs").write_text("5")
    return _status("VmRSS")


def _state_bytes(model, optimizer) -> int:
    stepped = list(amp.master_params(optimizer))
    tensors = {id(t): t for t in list(model.parameters()) + stepped}
    grads = [t.grad for t in tensors.values() if t.grad is not None]
    states = [v for p in stepped for v in optimizer.state.get(p, {}).values()
              if isinstance(v, torch.Tensor)]
    return sum(local_tensor(t).numel() * local_tensor(t).element_size()
               for t in list(tensors.values()) + grads + states)


def train(cfg: models.LMConfig, mode: str, level: str, steps: int, device) -> int:
    """Build, wrap or shard, initialize and train; the largest state bytes seen."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model, optimizer, batch_fn, loss_fn = models.lm(device=device, config=cfg)
    if mode == "fsdp":
        data_parallel.shard(model, optimizer)
    model, optimizer = amp.initialize(model, optimizer, opt_level=level, verbosity=0)
    net = data_parallel.wrap_ddp(model, device) if mode == "ddp" else model
    state = 0
    for step in range(steps):
        loss = loss_fn(net, data_parallel.local_batch(batch_fn(step), rank, world))
        with amp.scale_loss(loss, optimizer) as scaled:
            scaled.backward()
        state = max(state, _state_bytes(model, optimizer))
        optimizer.step()
        optimizer.zero_grad()
    del net
    amp.deinitialize()
    return state


#: Run first, untimed and unmeasured, so that the library code and the allocator's first
#: arenas the real run would touch anyway are not counted as its memory.
WARMUP_LM = models.LMConfig(vocab=64, d_model=32, n_layers=1, n_heads=2, seq_len=16, batch_size=4)


def worker(mode: str, level: str, lm_name: str, steps: int, world: int) -> dict:
    """One rank: its state bytes and peak memory."""
    torch.set_num_threads(data_parallel.rank_threads(world, cpu_count()))
    device = data_parallel.init_process_group("cuda" if torch.cuda.is_available() else "cpu")
    cuda = device.type == "cuda"
    train(WARMUP_LM, mode, level, 2, device)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
        baseline = torch.cuda.memory_allocated()
    else:
        baseline = _reset_peak()
    state = train(LMS[lm_name], mode, level, steps, device)
    peak = (torch.cuda.max_memory_allocated() if cuda else _status("VmHWM")) - baseline
    close_process_group()
    return {"state": state, "peak": peak}


# --------------------------------------------------------------------------- the table


def run(mode: str, level: str, world: int, lm_name: str, steps: int) -> dict:
    """One configuration in a fresh process group; the largest numbers over its data_parallel."""
    try:
        per_rank = data_parallel.launch(world, worker, mode, level, lm_name, steps, world)
    except Exception as exc:
        raise RuntimeError(f"{mode} {level} x{world}: {data_parallel.failure_text(exc)}") from None
    return {"state": max(r["state"] for r in per_rank.values()),
            "peak": max(r["peak"] for r in per_rank.values())}


def host() -> str:
    # machine() already names the CPUs this process may use and the detected bf16 support.
    return f"{machine()}; the CPUs shared out among the ranks"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lm", choices=sorted(LMS), default="bench")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--quick", action="store_true",
                        help="the small LM, two steps, 1 and 2 ranks, nothing written")
    args = parser.parse_args()
    lm_name, steps, worlds = (("compare", 2, (1, 2)) if args.quick
                              else (args.lm, args.steps, WORLDS))
    rows, started = [], time.time()
    for mode in MODES:
        for level in LEVELS:
            cells = [run(mode, level, w, lm_name, steps) for w in worlds]
            rows.append([mode.upper() if mode == "ddp" else "FSDP2", level]
                        + [f"{c['state'] / MiB:.0f}" for c in cells]
                        + [f"{c['peak'] / MiB:.0f}" for c in cells])
            print(" | ".join(rows[-1]), flush=True)
    cfg = LMS[lm_name]
    n_params = models.parameter_count(models.TransformerLM(cfg))
    header = (["mode", "level"] + [f"state, {w} rank{'s' * (w > 1)} (MiB)" for w in worlds]
              + [f"peak, {w} rank{'s' * (w > 1)} (MiB)" for w in worlds])
    body = "\n".join([
        "## Per-rank memory of the built-in LM",
        "",
        f"Measured by `benchmarks/bench_distributed.py` on {host()}. The LM is "
        f"`{'BENCH_LM' if lm_name == 'bench' else 'COMPARE_LM'}` ({n_params / 1e6:.1f} M "
        f"parameters), AdamW, a global batch of {cfg.batch_size} sequences of {cfg.seq_len} "
        f"tokens split over the ranks, {steps} steps; bf16 on the CPU. *state*: parameters, "
        "gradients, fp32 masters and optimizer state held by the rank; *peak*: the rise of the "
        "rank's peak resident memory over the run (the largest rank shown). "
        f"Took {time.time() - started:.0f} s.",
        "",
        markdown_table(header, rows),
    ])
    print(body)
    if not args.quick:
        write_section("distributed-memory", body, path=DOC)


if __name__ == "__main__":
    main()
