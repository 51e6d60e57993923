"""Apex-era GPU scripts in examples/legacy/ train unchanged under ``amp-patch run --device cpu``."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from amp_patch.settings.levels import NAMES as LEVELS

LEGACY = Path(__file__).resolve().parents[2] / "examples" / "legacy"

# Runs one script at every level in one interpreter, through the same entry point as the
# console script, so that each run also starts from what the previous one left behind.
DRIVER = """
import sys
from amp_patch.cli.main import main
from amp_patch.settings.levels import NAMES as LEVELS
script, flag, levels, args = sys.argv[1], sys.argv[2], sys.argv[3].split(","), sys.argv[4:]
for level in levels:
    print("=== level", level, flush=True)
    assert main(["run", "--device", "cpu", script, flag, level, *args]) == 0
"""

#: script, its opt-level flag, arguments that keep it to a few seconds.
SCRIPTS = {
    "dcgan_amp.py": ("--opt_level", ["--nbatches", "12"]),
    "imagenet_amp.py": ("--opt-level", ["--images", "192", "--epochs", "2"]),
    "bert_finetune_amp.py": ("--opt_level", []),
}

_MEANS = re.compile(r"mean over the first \d+ \w+ ([0-9.]+), over the last \d+ ([0-9.]+)")


def _run(cmd: list[str], env: dict[str, str] | None = None) -> str:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=LEGACY,
                          env={**os.environ, **(env or {})})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc.stdout


def _first_and_last(output: str) -> tuple[float, float]:
    match = _MEANS.search(output)
    assert match, output[-2000:]
    return float(match.group(1)), float(match.group(2))


@pytest.mark.slow
@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_legacy_script_trains_at_every_level_on_cpu(script):
    flag, args = SCRIPTS[script]
    out = _run([sys.executable, "-c", DRIVER, script, flag, ",".join(LEVELS), *args])
    runs = out.split("=== level ")[1:]
    assert [r.split()[0] for r in runs] == list(LEVELS)
    for level, run in zip(LEVELS, runs):
        first, last = _first_and_last(run)
        assert last < 0.95 * first, f"{script} at {level}: the loss did not fall: {first} -> {last}"


def test_legacy_scripts_are_apex_code():
    """Each is the Apex user's code: GPU calls and `apex` imports, no amp_patch."""
    for script in SCRIPTS:
        source = (LEGACY / script).read_text()
        code = source.split('"""', 2)[2]
        assert "from apex" in code and "amp_patch" not in code, script
        assert ".cuda(" in code or 'torch.device("cuda' in code, script
    imagenet = (LEGACY / "imagenet_amp.py").read_text()
    for call in ("torch.cuda.Stream()", "record_stream(", ".cuda(non_blocking=True)",
                 "torch.cuda.synchronize()", "backend='nccl'", "DDP(model"):
        assert call in imagenet
    dcgan = (LEGACY / "dcgan_amp.py").read_text()
    assert "num_losses=3" in dcgan and "netD.zero_grad()" in dcgan
    bert = (LEGACY / "bert_finetune_amp.py").read_text()
    assert "FusedAdam(" in bert and "gradient_accumulation_steps" in bert


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_imagenet_distributed_flag_one_process():
    env = dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(_free_port()))
    out = _run([sys.executable, "-m", "amp_patch", "run", "--device", "cpu", "imagenet_amp.py",
                "--opt-level", "O2", "--distributed", "--images", "192", "--epochs", "2"], env)
    first, last = _first_and_last(out)
    assert last < 0.95 * first


@pytest.mark.slow
def test_imagenet_torchrun_two_processes():
    # torch.distributed.run is torchrun, with this interpreter (a venv's torchrun may name another).
    out = _run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc_per_node", "2", "-m", "amp_patch", "run", "--device", "cpu",
                "imagenet_amp.py", "--opt-level", "O1", "--images", "192", "--epochs", "2"])
    first, last = _first_and_last(out)  # rank 0's mean of the all-reduced losses
    assert last < 0.95 * first
