"""The 2019-style scripts in examples/legacy/ train unchanged under ``amp-patch run``.

Each script prints ``step N loss L scale S state DIGEST`` per step, DIGEST
hashing every tensor training changes. Each test runs a script with an
injected overflow and a checkpoint, then resumes from that checkpoint in a
new process, and checks: the loss falls; the overflow step leaves the digest
of the step before it (nothing changed) and moves the scale as the scaling
kind says; the resumed run prints exactly the lines of the uninterrupted one.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

LEGACY = Path(__file__).resolve().parents[2] / "examples" / "legacy"


def _run(tmp_path: Path, script: str, *args: str, hook: bool = True,
         run_args: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "amp_patch", "run", *run_args] if hook else [sys.executable]
    proc = subprocess.run([*cmd, str(LEGACY / script), *args], capture_output=True, text=True,
                          timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


def _steps(stdout: str) -> dict[int, tuple[float, float, str]]:
    out = {}
    for line in stdout.splitlines():
        if line.startswith("step "):
            _, step, _, loss, _, scale, _, digest = line.split()
            out[int(step)] = (float(loss), float(scale), digest)
    return out


def _check_run_and_resume(tmp_path: Path, script: str, args: list[str], overflow: int,
                          save: int, scale_after_overflow,
                          run_args: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    """Run with an overflow and a checkpoint, resume from it; return the first run."""
    ckpt_dir = tmp_path / "ckpt"
    full = _run(tmp_path, script, *args, "--overflow_step", str(overflow), "--save_step",
                str(save), "--output_dir", str(ckpt_dir), run_args=run_args)
    steps = _steps(full.stdout)
    losses = [loss for loss, _, _ in steps.values() if loss != float("inf")]
    assert sum(losses[-4:]) < 0.8 * sum(losses[:4]), losses  # it learns

    loss, scale, digest = steps[overflow]
    assert loss == float("inf")
    assert digest == steps[overflow - 1][2]  # the skipped step changed nothing
    assert scale == scale_after_overflow(steps[overflow - 1][1])
    assert steps[overflow + 1][2] != digest  # and training went on

    resumed = _run(tmp_path, script, *args, "--resume", str(ckpt_dir / "checkpoint.pt"),
                   run_args=run_args)
    again = _steps(resumed.stdout)
    assert sorted(again) == [s for s in sorted(steps) if s >= save]
    assert all(again[s] == steps[s] for s in again), "the resumed run differs"
    return full


@pytest.mark.slow
@pytest.mark.parametrize("loss_scale, after_overflow", [
    ("0", lambda s: s / 2),        # dynamic: halves
    ("128", lambda s: s),          # static: unchanged (the step is still skipped)
], ids=["dynamic", "static"])
@pytest.mark.parametrize("run_args, half", [
    ((), "torch.float16"),
    # The script picks "cuda" when available; on the CPU, model.half() means the CPU half (bf16).
    (("--device", "cpu"), "torch.bfloat16"),
], ids=["as-is", "device-cpu"])
def test_bert_fine_tuner_fp16_optimizer(tmp_path, loss_scale, after_overflow, run_args, half):
    out = _check_run_and_resume(tmp_path, "bert_finetune_fp16.py",
                                ["--fp16", "--loss_scale", loss_scale], overflow=7, save=12,
                                scale_after_overflow=after_overflow, run_args=run_args).stdout
    assert f"parameters are {half}" in out
    if loss_scale == "128":
        assert {scale for _, scale, _ in _steps(out).values()} == {128.0}


@pytest.mark.slow
@pytest.mark.parametrize("level, loss_scale, after_overflow", [
    ("O2", "dynamic", lambda s: s / 2),
    ("O1", None, lambda s: s),
], ids=["O2-dynamic", "O1-static"])
def test_trainer_setting_amp_state_loss_scale(tmp_path, level, loss_scale, after_overflow):
    args = ["--fp16_opt_level", level] + (["--loss_scale", loss_scale] if loss_scale else [])
    out = _check_run_and_resume(tmp_path, "amp_state_trainer.py", args, overflow=6, save=10,
                                scale_after_overflow=after_overflow).stdout
    steps = _steps(out)
    assert steps[0][1] == 2.0**20  # the scale the script set through _amp_state
    assert f"opt level {level}" in out


@pytest.mark.slow
def test_guarded_import_trains_in_half_and_warns_instead_of_falling_back(tmp_path):
    full = _check_run_and_resume(tmp_path, "guarded_import.py", ["--fp16", "--fast_layer_norm"],
                                 overflow=5, save=10, scale_after_overflow=lambda s: s / 2)
    assert "training in torch.float16" in full.stdout and "apex not installed" not in full.stdout
    # The contrib import it guards is not served: amp_patch says so, and sums it up at the end.
    assert "apex.contrib.layer_norm is not provided by amp_patch" in full.stderr
    assert full.stderr.strip().splitlines()[-1].startswith(
        "amp-patch run: 1 apex name(s) not served by amp_patch")
    # Without the hook (and without apex) the same script quietly drops to fp32.
    plain = _run(tmp_path, "guarded_import.py", "--fp16", "--epochs", "1", hook=False)
    assert "WARNING: apex not installed" in plain.stdout and "torch.float32" in plain.stdout
