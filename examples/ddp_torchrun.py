"""Data-parallel training with amp and torch DDP, launched with torchrun (gloo on CPU).

Call ``amp.initialize`` on the bare model first, then wrap it in
DistributedDataParallel. Under torch.distributed the loss scaler's overflow
decision is the same on every rank.

    torchrun --standalone --nproc_per_node 2 examples/ddp_torchrun.py --opt-level O2
    python examples/ddp_torchrun.py          # one process, no torchrun needed

An Apex script using ``apex.parallel.DistributedDataParallel`` runs the same
way through ``torchrun --standalone --nproc_per_node 2 -m amp_patch run train.py``.
"""

import argparse
import os
import socket

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import amp_patch as amp
from amp_patch.helpers import close_process_group


def init_process_group() -> None:
    if "RANK" not in os.environ:
        # Not launched by torchrun: a world of one, on a free local port.
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend)
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--opt-level", default="O2")
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()

    init_process_group()
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")

    torch.manual_seed(0)  # the same initial weights on every rank
    model = torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.GELU(),
                                torch.nn.Linear(128, 4)).to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    model, optimizer = amp.initialize(model, optimizer, opt_level=args.opt_level, verbosity=0)
    model = DDP(model)

    g = torch.Generator().manual_seed(100 + rank)  # each rank its own shard of the data
    for step in range(args.steps):
        x = torch.randn(32, 32, generator=g).to(device)
        y = x[:, :4].argmax(dim=1)
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), y)
        with amp.scale_loss(loss, optimizer) as scaled_loss:
            scaled_loss.backward()
        optimizer.step()
        if step % 5 == 0 or step == args.steps - 1:
            print(f"rank {rank}/{world} step {step:3d} loss {loss.item():.4f}", flush=True)

    # DDP keeps replicas identical: the largest difference from rank 0's weights is zero.
    flat = torch.cat([p.detach().float().flatten() for p in model.parameters()])
    reference = flat.clone()
    dist.broadcast(reference, src=0)
    diff = (flat - reference).abs().max()
    dist.all_reduce(diff, op=dist.ReduceOp.MAX)
    if rank == 0:
        print(f"{args.opt_level}: {world} process(es), {args.steps} steps; max weight difference "
              f"across ranks {diff.item():g}", flush=True)
    # Meet the other ranks, destroy the group, and let gloo's worker threads finish
    # before the interpreter exits: they still hold the last all-reduces of backward,
    # and releasing those during shutdown aborts the process (docs/distributed.md).
    close_process_group()


if __name__ == "__main__":
    main()
