"""DistributedDataParallel on CPU (gloo, 2 processes): ranks stay identical, one rank's overflow skips both."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from training_utils import run_ranks

TESTS = Path(__file__).resolve().parents[1]
STEPS, BAD = 6, 2

WORKER = r"""
import os, sys, torch, torch.distributed as dist
sys.path.insert(0, sys.argv[1])
import amp_patch as amp
from training_utils import mlp, mlp_batch, xent

level, out, steps, bad = sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
dist.init_process_group("gloo")
rank = dist.get_rank()
model = mlp()
opt = torch.optim.Adam(model.parameters(), lr=1e-2)
model, opt = amp.initialize(model, opt, opt_level=level, loss_scale="dynamic", verbosity=0)
ddp = torch.nn.parallel.DistributedDataParallel(model)
losses = []
for step in range(steps):
    x, y = mlp_batch(2 * step + rank)  # each rank sees its own data
    loss = xent(ddp(x), y)
    with amp.scale_loss(loss, opt) as scaled:
        scaled.backward()
        if step == bad and rank == 1:  # after the all-reduce: only this rank sees it
            model[0].weight.grad[0, 0] = float("inf")
    opt.step()
    opt.zero_grad()
    losses.append(loss.item())
torch.save({"params": [p.detach() for p in model.parameters()],
            "steps": [opt.state[p]["step"].item() for p in amp.master_params(opt)],
            "amp": amp.state_dict(), "losses": losses}, out)
from amp_patch.helpers import close_process_group
close_process_group()
"""


@pytest.mark.slow
@pytest.mark.parametrize("level", ["O1", "O2"])
def test_ddp_two_ranks_identical_and_skip_together(level, tmp_path):
    codes = run_ranks(WORKER, lambda r: [str(TESTS), level, str(tmp_path / f"{r}.pt"),
                                         str(STEPS), str(BAD)])
    assert codes == [0, 0]
    r0, r1 = (torch.load(tmp_path / f"{r}.pt") for r in range(2))
    assert all(torch.equal(a, b) for a, b in zip(r0["params"], r1["params"]))
    for r in (r0, r1):
        assert r["amp"]["loss_scaler0"]["skipped"] == 1
        assert r["amp"]["loss_scaler0"]["loss_scale"] == 2.0**15
        assert r["steps"] == [STEPS - 1] * len(r["steps"])  # the skipped step did not count
    assert r0["losses"][-1] < r0["losses"][0] + 0.5
