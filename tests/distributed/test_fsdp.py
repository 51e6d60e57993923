"""FSDP2 (fully_shard) under amp on CPU gloo with 2 and 4 ranks, and clip_grad_norm_.

The distributed cases live in _dist_cases.py and run many to a process group
(starting processes costs more than the cases); each test here reads its
case's outcome. The clipping tests at the end run in this process.
"""

from __future__ import annotations

import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import _dist_cases
import amp_patch as amp
from training_utils import count_host_syncs, mlp, mlp_batch, xent

from amp_patch.casting.fsdp import cpu_fsdp_supported

# Every case here shards on the CPU (gloo).
pytestmark = pytest.mark.skipif(not cpu_fsdp_supported(), reason=f"torch {torch.__version__}'s FSDP2 cannot run on the CPU (torch.cpu.Stream has no record_event)")

WORLDS = {"w2": 2, "w4": 4}


def _check(group: str, name: str, tmp_path_factory) -> None:
    result = _dist_cases.outcome(group, name, tmp_path_factory)
    if result != "ok":
        pytest.fail(f"{name} with {_dist_cases.GROUPS[group][0]} ranks:\n{result}", pytrace=False)


@pytest.mark.slow
@pytest.mark.parametrize("group", list(WORLDS))
@pytest.mark.parametrize("level", _dist_cases.LEVELS)
def test_fsdp_matches_single_process(group, level, tmp_path_factory):
    """Same global batch, same losses and weights as one process, within reduction order."""
    _check(group, f"match:{level}", tmp_path_factory)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["o1_patched_inside_fsdp", "deinitialize_restores_policy",
                                  "initialize_after_a_forward", "reduce_dtype_override",
                                  "failed_initialize_puts_shards_back", "one_host_sync"])
def test_fsdp_two_ranks(name, tmp_path_factory):
    _check("w2", name, tmp_path_factory)


@pytest.mark.slow
def test_initialize_orders(tmp_path_factory):
    """initialize then fully_shard fails at the first forward, naming the order that works."""
    _check("w2", "orders", tmp_path_factory)


@pytest.mark.slow
@pytest.mark.parametrize("group", list(WORLDS))
def test_overflow_on_one_rank_skips_everywhere(group, tmp_path_factory):
    _check(group, "overflow_skips_everywhere", tmp_path_factory)


@pytest.mark.slow
@pytest.mark.parametrize("group", list(WORLDS))
def test_clip_matches_unsharded_norm(group, tmp_path_factory):
    _check(group, "clip_matches_unsharded_norm", tmp_path_factory)


@pytest.mark.slow
@pytest.mark.parametrize("group", list(WORLDS))
def test_o2_memory_is_one_nth(group, tmp_path_factory):
    _check(group, "o2_memory_is_sharded", tmp_path_factory)


@pytest.mark.slow
def test_syncbn_under_ddp_at_o2(tmp_path_factory):
    """apex.parallel.convert_syncbn_model under DDP at O2 with keep_batchnorm_fp32, on gloo."""
    _check("w2", "syncbn_ddp_o2", tmp_path_factory)


# --------------------------------------------------------------------------- clip_grad_norm_


def _twin_grads(seed: int, dtype=torch.float32):
    torch.manual_seed(seed)
    a, b = mlp(seed), mlp(seed)
    for p, q in zip(a.parameters(), b.parameters()):
        p.data, q.data = p.data.to(dtype), q.data.to(dtype)
        p.grad = torch.randn_like(p) * 3
        q.grad = p.grad.clone()
    return list(a.parameters()), list(b.parameters())


@pytest.mark.parametrize("norm_type", [2.0, 1.0, math.inf, 3.0])
@pytest.mark.parametrize("max_norm", [0.5, 1e4])
def test_clip_matches_torch(norm_type, max_norm):
    ours, theirs = _twin_grads(0)
    total = amp.clip_grad_norm_(ours, max_norm, norm_type)
    expected = torch.nn.utils.clip_grad_norm_(theirs, max_norm, norm_type)
    assert total.dtype == torch.float32 and total.dim() == 0
    torch.testing.assert_close(total, expected, rtol=1e-6, atol=0)
    for p, q in zip(ours, theirs):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=1e-9)
    if max_norm > 1e3:  # not clipped: untouched to the bit
        assert all(torch.equal(p.grad, q.grad) for p, q in zip(ours, theirs))


def test_clip_half_grads_match_torch(half_dtype):
    ours, theirs = _twin_grads(1, half_dtype)
    total = amp.clip_grad_norm_(ours, 0.5)
    expected = torch.nn.utils.clip_grad_norm_(theirs, 0.5)
    torch.testing.assert_close(total, expected.float(), rtol=2.0**-8, atol=0)  # torch rounds it
    for p, q in zip(ours, theirs):
        # Ours scales in fp32 and rounds once; torch rounds the coefficient to half first.
        torch.testing.assert_close(p.grad.float(), q.grad.float(), rtol=1e-2, atol=1e-3)


def test_clip_takes_an_amp_optimizer_and_does_not_sync():
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O2", loss_scale=128.0, verbosity=0)
    x, y = mlp_batch(0)
    with amp.scale_loss(xent(model(x), y), opt) as scaled:
        scaled.backward()
    masters = list(amp.master_params(opt))
    copies = [m.grad.clone() for m in masters]
    expected = torch.linalg.vector_norm(torch.cat([g.flatten() for g in copies]))
    with count_host_syncs() as counts:
        total = amp.clip_grad_norm_(opt, 0.01)
    assert counts["n"] == 0
    torch.testing.assert_close(total, expected, rtol=1e-6, atol=0)
    coef = 0.01 / (expected + 1e-6)
    for m, g in zip(masters, copies):
        torch.testing.assert_close(m.grad, g * coef, rtol=1e-6, atol=1e-12)
    with pytest.raises(ValueError, match="master weights"):
        amp.clip_grad_norm_(model.parameters(), 1.0)  # the half grads are still scaled


def test_clip_input_errors():
    p = nn.Parameter(torch.ones(3))
    assert amp.clip_grad_norm_([p], 1.0).item() == 0.0  # no grad at all
    p.grad = torch.ones(3)
    with pytest.raises(ValueError, match="norm_type"):
        amp.clip_grad_norm_(p, 1.0, norm_type=0)
    with pytest.raises(TypeError, match="optimizer or parameters"):
        amp.clip_grad_norm_(3.0, 1.0)
    with pytest.raises(TypeError, match="optimizer or tensors"):
        amp.clip_grad_norm_([p, "w"], 1.0)
    torch.testing.assert_close(amp.clip_grad_norm_(p, 1.0), torch.tensor(math.sqrt(3.0)))


@pytest.mark.slow
def test_fsdp_example_saves_and_resumes_on_another_world_size(tmp_path):
    example = Path(__file__).resolve().parents[2] / "examples" / "fsdp_torchrun.py"

    def torchrun(nproc: int, *args: str) -> str:
        proc = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--standalone",
             f"--nproc-per-node={nproc}", str(example), *args],
            capture_output=True, text=True, timeout=300, cwd=tmp_path,
            env=_dist_cases.worker_env())
        assert proc.returncode == 0, proc.stdout + proc.stderr
        return proc.stdout

    out = torchrun(2, "--steps", "3", "--save", "ckpt")
    assert "O2: 2 process(es); rank 0 holds 64 of 128 rows" in out and "torch.float32" in out
    out = torchrun(1, "--steps", "2", "--resume", "ckpt", "--save", "ckpt2")
    assert re.search(r"step +4 loss", out), out  # went on from the saved step
    assert "O2: 1 process(es); rank 0 holds 128 of 128 rows" in out
