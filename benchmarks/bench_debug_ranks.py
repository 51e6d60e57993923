"""What ``AMP_PATCH_DEBUG_RANKS=1`` costs per training step, on 2 gloo ranks on the CPU.

One ``torchrun --standalone --nproc_per_node 2`` trains a small MLP (4 x
Linear(256), batch 64 split over the ranks, SGD, dynamic loss scale, so that
every ``scale_loss`` checks at entry and at exit) on FSDP2 at O1 and on DDP
at O2. In one process, blocks of steps with the check on and off take turns
(the session's ``rank_check`` is set and cleared between blocks), so they
share the host's noise; the median step time of each, on rank 0, is printed
with the difference.

Run: ``python benchmarks/bench_debug_ranks.py [--rounds 15 --block 10]``.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import textwrap

WORKER = textwrap.dedent("""
    import statistics, sys, time, torch, torch.distributed as dist, torch.nn.functional as F
    from torch import nn
    import amp_patch as amp
    from amp_patch.helpers import close_process_group
    from amp_patch.frontend.debug import RankCheck

    rounds, block = int(sys.argv[1]), int(sys.argv[2])
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()

    def model():
        torch.manual_seed(0)
        return nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(256, 256), nn.ReLU())])

    for strategy, level in (("fsdp2", "O1"), ("ddp", "O2")):
        net = model()
        if strategy == "fsdp2":
            from torch.distributed.fsdp import fully_shard
            for m in net:
                if isinstance(m, nn.Linear):
                    fully_shard(m)
            fully_shard(net)
        opt = torch.optim.SGD(net.parameters(), lr=1e-3)
        net, opt = amp.initialize(net, opt, opt_level=level, loss_scale="dynamic", verbosity=0)
        run = nn.parallel.DistributedDataParallel(net) if strategy == "ddp" else net
        session = amp.session.current()
        x = torch.randn(64 // world, 256)

        def steps(n):
            times = []
            for _ in range(n):
                t = time.perf_counter()
                loss = run(x).float().pow(2).mean()
                with amp.scale_loss(loss, opt) as scaled:
                    scaled.backward()
                opt.step()
                opt.zero_grad()
                times.append(time.perf_counter() - t)
            return times

        steps(5)
        on, off = [], []
        for r in range(rounds):
            for check in ((True, False) if r % 2 == 0 else (False, True)):
                session.rank_check = RankCheck() if check else None
                (on if check else off).extend(steps(block))
        session.rank_check = None
        if rank == 0:
            a, b = statistics.median(on) * 1e3, statistics.median(off) * 1e3
            print(f"{strategy} {level}: step {b:.2f} ms off, {a:.2f} ms on: "
                  f"+{a - b:.3f} ms ({(a / b - 1) * 100:+.1f}%)", flush=True)
        del run
        amp.deinitialize()
    close_process_group()
""")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--block", type=int, default=10)
    args = parser.parse_args()
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(WORKER)
    try:
        subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                        "--nproc_per_node", "2", f.name, str(args.rounds), str(args.block)],
                       check=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    finally:
        os.unlink(f.name)


if __name__ == "__main__":
    main()
