"""FSDP2 training with amp: fully_shard, initialize, clip, and a DCP checkpoint to resume from.

The order is the one amp supports: ``fully_shard`` the model, build the
optimizer over its (sharded) parameters, then ``amp.initialize``. At O2 the
sharded fp32 parameters are the master weights; FSDP all-gathers them in bf16
(fp16 on CUDA) and reduce-scatters the gradients in fp32.

    torchrun --standalone --nproc_per_node 2 examples/fsdp_torchrun.py --opt-level O2
    torchrun --standalone --nproc_per_node 2 examples/fsdp_torchrun.py --resume ckpt

The first run saves ``ckpt`` (``--save``) after its steps; the second loads
it and goes on, with any number of processes.
"""

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.fsdp import fully_shard

import amp_patch as amp
from amp_patch.helpers import close_process_group


def build(device: torch.device) -> torch.nn.Module:
    torch.manual_seed(0)  # the same initial weights on every rank, before sharding
    model = torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.GELU(),
                                torch.nn.Linear(128, 128), torch.nn.GELU(),
                                torch.nn.Linear(128, 4)).to(device)
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    return model


def train(args: argparse.Namespace, device: torch.device) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    model = build(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = amp.initialize(model, optimizer, opt_level=args.opt_level, verbosity=0)
    start = {"step": 0}
    if args.resume:
        amp.load_checkpoint(args.resume, model, optimizer, extra={"progress": start})

    for step in range(start["step"], start["step"] + args.steps):
        g = torch.Generator().manual_seed(step)  # one global batch per step, split over the ranks
        x = torch.randn(64, 32, generator=g).chunk(world)[rank].to(device)
        y = x[:, :4].argmax(dim=1)
        loss = F.cross_entropy(model(x), y)
        with amp.scale_loss(loss, optimizer) as scaled_loss:
            scaled_loss.backward()
        norm = amp.clip_grad_norm_(optimizer, args.max_norm)  # the norm of the whole gradient
        optimizer.step()
        optimizer.zero_grad()
        total = loss.detach().reshape(1).clone()
        dist.all_reduce(total)
        if rank == 0 and (step % 5 == 0 or step == start["step"] + args.steps - 1):
            print(f"step {step:3d} loss {total.item() / world:.4f} grad norm {norm.item():.3f}",
                  flush=True)

    amp.save_checkpoint(args.save, model, optimizer,
                        extra={"progress": {"step": start["step"] + args.steps}})
    if rank == 0:
        shard = next(model.parameters())
        print(f"{args.opt_level}: {world} process(es); rank 0 holds {shard.to_local().shape[0]} "
              f"of {shard.shape[0]} rows of the first weight, in {shard.dtype}; saved {args.save}",
              flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--opt-level", default="O2")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--max-norm", type=float, default=1.0)
    parser.add_argument("--save", default="ckpt", help="checkpoint directory written at the end")
    parser.add_argument("--resume", help="checkpoint directory to start from")
    args = parser.parse_args()

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if cuda else "gloo")
    train(args, torch.device("cuda" if cuda else "cpu"))
    # Meet the other ranks, destroy the group, and let gloo's worker threads finish before
    # the interpreter exits: releasing backward's collectives during shutdown aborts the process.
    close_process_group()


if __name__ == "__main__":
    main()
