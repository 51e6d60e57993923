"""``amp-patch run`` on Transformer Engine scripts: TE's quickstart shape trains on the CPU."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _run(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "amp_patch", "run", *args],
                          capture_output=True, text=True, timeout=300, cwd=cwd)


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["delayed", "current"])
def test_te_quickstart_trains_on_the_cpu(tmp_path, recipe):
    """examples/te_quickstart.py: te.Linear, te.LayerNormLinear, fp8_autocast and TE's recipes."""
    proc = _run(tmp_path, "--device", "cpu", str(ROOT / "examples" / "te_quickstart.py"),
                "--steps", "25", "--recipe", recipe)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    first, last = map(float, re.search(r"first loss ([0-9.]+) last loss ([0-9.]+)",
                                       proc.stdout).groups())
    assert last < 0.5 * first
    assert "not served" not in proc.stderr


@pytest.mark.slow
def test_te_with_apex_amp_and_a_refused_name(tmp_path):
    """TE's layers under Apex's O2 (bf16 weights, FP8 GEMMs in the region), and a caught miss."""
    script = tmp_path / "te_amp.py"
    script.write_text(textwrap.dedent("""
        import torch
        from apex import amp
        import transformer_engine.pytorch as te
        from transformer_engine.common.recipe import DelayedScaling, Format
        try:
            from transformer_engine.pytorch import TransformerLayer
        except ImportError:
            TransformerLayer = None
        torch.manual_seed(0)
        model = torch.nn.Sequential(te.Linear(64, 64), torch.nn.ReLU(), te.Linear(64, 64)).cuda()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        model, opt = amp.initialize(model, opt, opt_level="O2", verbosity=0)
        recipe = DelayedScaling(fp8_format=Format.HYBRID, amax_history_len=8)
        x = torch.randn(32, 64).cuda()
        losses = []
        for _ in range(20):
            with te.fp8_autocast(enabled=True, fp8_recipe=recipe):
                out = model(x)
            loss = (out.float() - x).pow(2).mean()
            opt.zero_grad()
            with amp.scale_loss(loss, opt) as scaled:
                scaled.backward()
            opt.step()
            losses.append(loss.item())
        print("weight", model[0].weight.dtype, "fell", losses[-1] < 0.7 * losses[0],
              "layer", TransformerLayer)
    """))
    proc = _run(tmp_path, "--device", "cpu", str(script))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "weight torch.bfloat16 fell True layer None" in proc.stdout
    assert "transformer_engine.pytorch.TransformerLayer is not provided" in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].endswith(
        "transformer_engine.pytorch.TransformerLayer")
