"""An Apex-era script, unchanged under ``amp-patch run``, against the math it stands for.

``examples/legacy/gan_checkpoint_amp.py`` is written the way Apex's README
taught: ``.cuda()`` everywhere, ``from apex import amp``, ``from
apex.fp16_utils import *``, two models and optimizers under one
``amp.initialize`` with ``num_losses=3``, grads cleared through the models
(``netD.zero_grad()``), and a checkpoint of models, optimizers and
``amp.state_dict()``. It runs here under ``amp-patch run --device cpu``.

Each level is checked against the same training written by hand in plain
PyTorch, without amp:

- O0: fp32 throughout. Bit for bit.
- O2: a bf16 model, fp32 master weights that the optimizers step, each loss's
  half grads added into the masters' fp32 grads, the masters copied back into
  the model after each step. Bit for bit.
- O3: a pure bf16 model and optimizers. Bit for bit.
- O1: patched functions have no simpler hand-written twin; its losses and
  weights are checked against the fp32 run within bf16 tolerance.

Every level also resumes: a run that stops at step 3 and a new process that
resumes from its checkpoint print the very lines, and end with the very
weights, of the run that went straight through.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "legacy" / "gan_checkpoint_amp.py"
STEPS, SAVE_AT, BATCH, LR, NZ, FEATURES = 6, 3, 16, 0.002, 8, 16
LINE = re.compile(r"^step (\d+) errD (\S+) errG (\S+)$", re.M)


def _run(tmp: Path, level: str, *extra: str) -> dict[int, tuple[str, str]]:
    # The bitwise references compute natively in bf16; so does amp here, whatever the host
    # (tiny shapes: a host without native bf16 pays nothing noticeable for it).
    env = dict(os.environ, AMP_PATCH_CPU_HALF_NATIVE="bf16")
    proc = subprocess.run(
        [sys.executable, "-m", "amp_patch", "run", "--device", "cpu", str(SCRIPT),
         "--opt_level", level, "--steps", str(STEPS), "--batch_size", str(BATCH),
         "--lr", str(LR), "--output_dir", str(tmp), *extra],
        cwd=tmp, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return {int(s): (d, g) for s, d, g in LINE.findall(proc.stdout)}


def _reference(level: str) -> tuple[dict[int, tuple[str, str]], dict[str, dict[str, torch.Tensor]]]:
    """The script's training, written by hand in plain PyTorch (O0, O2 or O3 math)."""
    torch.manual_seed(0)
    netD = nn.Sequential(nn.Linear(FEATURES, 32), nn.LeakyReLU(0.2), nn.Linear(32, 1))
    netG = nn.Sequential(nn.Linear(NZ, 32), nn.ReLU(), nn.Linear(32, FEATURES), nn.Tanh())
    real = torch.randn(4 * BATCH, FEATURES, generator=torch.Generator().manual_seed(1234)) * 0.3 + 0.5
    half = level in ("O2", "O3")
    dtype = torch.bfloat16 if half else torch.float32
    netD.to(dtype)
    netG.to(dtype)

    def stepped(net: nn.Module) -> list[torch.Tensor]:
        if level != "O2":
            return list(net.parameters())
        return [p.detach().float().requires_grad_() for p in net.parameters()]

    mastersD, mastersG = stepped(netD), stepped(netG)
    optD = torch.optim.Adam(mastersD, lr=LR, betas=(0.5, 0.999))
    optG = torch.optim.Adam(mastersG, lr=LR, betas=(0.5, 0.999))

    def forward(net: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return net(x.to(dtype)).float()  # amp casts a model's inputs in and its outputs out

    def backward(loss: torch.Tensor, net: nn.Module, masters: list[torch.Tensor]) -> None:
        # O2: the loss's half grads go into the fp32 master grads (the loss scale of bf16 is 1).
        if level != "O2":
            loss.backward()
            return
        for p in net.parameters():
            p.grad = None
        loss.backward()
        for p, m in zip(net.parameters(), masters):
            m.grad = p.grad.float() if m.grad is None else p.grad.float() + m.grad

    def step(opt: torch.optim.Optimizer, net: nn.Module, masters: list[torch.Tensor]) -> None:
        opt.step()
        if level == "O2":
            with torch.no_grad():
                for p, m in zip(net.parameters(), masters):
                    p.copy_(m)
                    m.grad = None

    bce = nn.BCEWithLogitsLoss()
    lines = {}
    for i in range(STEPS):
        batch = real[(i % 4) * BATCH:(i % 4 + 1) * BATCH]
        ones, zeros = torch.ones(BATCH), torch.zeros(BATCH)
        netD.zero_grad()
        err_real = bce(forward(netD, batch).view(-1), ones)
        backward(err_real, netD, mastersD)
        fake = forward(netG, torch.randn(BATCH, NZ))
        err_fake = bce(forward(netD, fake.detach()).view(-1), zeros)
        backward(err_fake, netD, mastersD)
        step(optD, netD, mastersD)
        netG.zero_grad()
        err_g = bce(forward(netD, fake).view(-1), ones)
        backward(err_g, netG, mastersG)
        step(optG, netG, mastersG)
        lines[i] = (repr((err_real + err_fake).item()), repr(err_g.item()))

    def weights(net: nn.Module, masters: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        # What the amp model's state_dict holds: fp32, the masters themselves under O2.
        names = [n for n, _ in net.named_parameters()]
        source = masters if level == "O2" else [p.detach() for p in net.parameters()]
        return {n: t.detach().float() for n, t in zip(names, source)}

    return lines, {"netD": weights(netD, mastersD), "netG": weights(netG, mastersG)}


def _final(path: Path) -> dict[str, dict[str, torch.Tensor]]:
    return torch.load(path, weights_only=True)


@pytest.mark.slow
@pytest.mark.parametrize("level", ["O0", "O1", "O2", "O3"])
def test_apex_script_matches_its_math_and_resumes_exactly(tmp_path, level):
    straight = _run(tmp_path, level, "--save_step", str(SAVE_AT), "--final", "straight.pt")
    resumed = _run(tmp_path, level, "--resume", str(tmp_path / "checkpoint.pt"),
                   "--final", "resumed.pt")
    assert sorted(straight) == list(range(STEPS)) and sorted(resumed) == list(range(SAVE_AT, STEPS))
    assert {s: straight[s] for s in resumed} == resumed
    for model, tensors in _final(tmp_path / "straight.pt").items():
        for name, value in tensors.items():
            assert torch.equal(value, _final(tmp_path / "resumed.pt")[model][name]), (model, name)

    ref_level = "O0" if level == "O1" else level
    ref_lines, ref_weights = _reference(ref_level)
    final = _final(tmp_path / "straight.pt")
    if level == "O1":
        # bf16 matmuls against fp32: 8 mantissa bits, a few steps of Adam.
        for i in range(STEPS):
            for ours, ref in zip(straight[i], ref_lines[i]):
                assert float(ours) == pytest.approx(float(ref), rel=2e-2), (i, ours, ref)
        for model, tensors in ref_weights.items():
            for name, ref in tensors.items():
                torch.testing.assert_close(final[model][name], ref, rtol=0, atol=2e-2)
        return
    assert straight == ref_lines
    for model, tensors in ref_weights.items():
        for name, ref in tensors.items():
            assert final[model][name].dtype == torch.float32
            assert torch.equal(final[model][name], ref), (level, model, name)
