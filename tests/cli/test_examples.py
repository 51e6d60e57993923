"""Every example runs at a small size and prints what it did."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _run(*cmd: str, timeout: int = 300) -> str:
    proc = subprocess.run(list(cmd), capture_output=True, text=True, timeout=timeout, cwd=EXAMPLES)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def _example(name: str, *args: str) -> str:
    return _run(sys.executable, str(EXAMPLES / name), *args)


@pytest.mark.slow
@pytest.mark.parametrize("level", ["O1", "O2"])
def test_clip_grad(level):
    out = _example("clip_grad.py", "--opt-level", level, "--steps", "3", "--max-norm", "0.1")
    assert "clipped 3/3 steps" in out and "clipped grads are torch.float32" in out
    for after in re.findall(r"-> ([0-9.]+)", out):
        assert float(after) <= 0.1 + 1e-3


@pytest.mark.slow
@pytest.mark.parametrize("level", ["O1", "O2"])
def test_grad_accumulation_matches_full_batch(level):
    out = _example("grad_accumulation.py", "--opt-level", level, "--steps", "2", "--accum", "3")
    rel = float(re.search(r"relative difference ([0-9.e+-]+)", out).group(1))
    assert rel < 2e-2  # bf16 rounding of one full-batch gradient
    assert "each over 3 accumulated micro-batches" in out


@pytest.mark.slow
def test_grad_penalty():
    out = _example("grad_penalty.py", "--steps", "3")
    assert "gradient-norm penalty" in out and "grad norm" in out


@pytest.mark.slow
def test_multiple_models_losses():
    out = _example("multiple_models_losses.py", "--steps", "3")
    assert "3 models, 2 optimizers, 2 losses" in out


@pytest.mark.slow
def test_bf16_cpu():
    out = _example("bf16_cpu.py", "--steps", "2", "--width", "64")
    assert "O2: weights torch.bfloat16" in out and "stepped params torch.float32" in out
    assert "O3: weights torch.bfloat16" in out and "every level ran with a static scale" in out


@pytest.mark.slow
def test_ddp_single_process():
    out = _example("ddp_torchrun.py", "--steps", "2")
    assert "1 process(es), 2 steps; max weight difference across ranks 0" in out


@pytest.mark.slow
def test_ddp_torchrun_two_processes():
    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent)) or shutil.which("torchrun")
    if torchrun is None:
        pytest.skip("torchrun not found")
    out = _run(torchrun, "--standalone", "--nproc_per_node", "2", str(EXAMPLES / "ddp_torchrun.py"),
               "--steps", "3")
    assert "rank 1/2" in out
    assert "2 process(es), 3 steps; max weight difference across ranks 0" in out
