"""A checkpoint taken mid-training and loaded in a fresh process continues bit-exactly, at every level."""

from __future__ import annotations

import copy
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import amp_patch as amp
from training_utils import assert_same_leaves, mlp, train

TESTS = Path(__file__).resolve().parent

# Runs steps [start, stop) of the loop below, optionally loading a checkpoint
# first and saving one at the end. At O1/O2 (dynamic scaling) step 1 has a NaN
# loss, so the loss scale has moved and a skipped step sits in the history; O0
# and O3 take the unchecked fast path, as plain torch does.
WORKER = r"""
import sys, torch
sys.path.insert(0, sys.argv[1])
import amp_patch as amp
from training_utils import convnet, conv_batch, xent

level, start, stop, load, save = sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5], sys.argv[6]
model = convnet(seed=0 if load == "-" else 123)  # a loaded run starts from other weights
opt = torch.optim.Adam(model.parameters(), lr=1e-2)
extra = {"loss_scale": "dynamic"} if level in ("O1", "O2") else {}
model, opt = amp.initialize(model, opt, opt_level=level, verbosity=0, **extra)
if load != "-":
    ckpt = torch.load(load)
    model.load_state_dict(ckpt["model"])
    opt.load_state_dict(ckpt["optimizer"])
    amp.load_state_dict(ckpt["amp"])
for step in range(start, stop):
    x, y = conv_batch(step)
    loss = xent(model(x), y)
    if step == 1 and extra:
        loss = loss * float("nan")
    with amp.scale_loss(loss, opt) as scaled:
        scaled.backward()
    opt.step()
    opt.zero_grad()
torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "amp": amp.state_dict()}, save)
"""


def run_worker(level, start, stop, load, save):
    subprocess.run([sys.executable, "-c", WORKER, str(TESTS), level, str(start), str(stop),
                    str(load), str(save)], check=True, timeout=300)


@pytest.mark.slow
@pytest.mark.parametrize("level", ["O0", "O1", "O2", "O3"])
def test_resume_in_fresh_process_is_bit_exact(level, tmp_path):
    whole, half, resumed = tmp_path / "whole.pt", tmp_path / "half.pt", tmp_path / "resumed.pt"
    run_worker(level, 0, 6, "-", whole)
    run_worker(level, 0, 3, "-", half)
    run_worker(level, 3, 6, half, resumed)
    a, b = torch.load(whole), torch.load(resumed)
    assert a["amp"] == b["amp"]
    if level in ("O1", "O2"):
        assert a["amp"]["loss_scaler0"]["skipped"] == 1
    assert_same_leaves([a["model"], a["optimizer"]], [b["model"], b["optimizer"]])
    if level == "O2":
        masters = a["optimizer"]["amp_master_params"]
        assert masters and all(t.dtype == torch.float32 for t in masters.values())


def _o2_run(seed: int, steps: int):
    model = mlp(seed)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    model, opt = amp.initialize(model, opt, opt_level="O2", verbosity=0)
    train(model, opt, steps)
    return model, opt


def _bits(model, opt) -> list:
    """Copies of the model's params, the masters, and the optimizer's whole state dict."""
    return copy.deepcopy([[p.detach() for p in model.parameters()],
                          [m.detach() for m in amp.master_params(opt)], opt.state_dict()])


def _bad_masters(kind: str, sd: dict) -> str:
    """Spoil ``sd``'s masters (or its groups) in place; returns what the error must say."""
    if kind in ("groups", "groups-no-masters"):
        sd["param_groups"][0]["params"].append(99)  # torch's own check fails after amp's hook
        return "size of optimizer's group"
    masters = sd["amp_master_params"]
    last = max(masters)
    if kind == "shape":
        masters[last] = torch.zeros(2, 2)
        return r"master weight 3 .*shape \(2, 2\).*expected .*shape \(4,\)"
    if kind == "dtype":
        masters[last] = masters[last].bfloat16()
        return r"master weight 3 .*torch.bfloat16.*expected torch.float32"
    if kind == "missing":
        del masters[last]
        return r"fp32 masters for parameters \[0, 1, 2\]; expected \[0, 1, 2, 3\]"
    masters[last + 1] = torch.zeros(3)
    return r"fp32 masters for parameters \[0, 1, 2, 3, 4\]; expected \[0, 1, 2, 3\]"


@pytest.mark.parametrize("kind", ["shape", "dtype", "missing", "extra", "groups",
                                  "groups-no-masters"])
def test_failed_load_changes_nothing(kind):
    """Everything is checked before anything is copied: a bad checkpoint leaves the masters,
    the model and the optimizer state exactly as they were."""
    _, source_opt = _o2_run(1, 3)
    sd = copy.deepcopy(source_opt.state_dict())
    amp.deinitialize()
    model, opt = _o2_run(0, 2)
    if kind == "groups-no-masters":
        del sd["amp_master_params"]  # the masters would restart from the (half) model
    before = _bits(model, opt)
    message = _bad_masters(kind, sd)
    with pytest.raises(ValueError, match=message):
        opt.load_state_dict(sd)
    assert_same_leaves(before, _bits(model, opt))
