"""timm's Apex integration (``ApexScaler``, ``CheckpointSaver``, ``resume_checkpoint``) under the hook.

timm imports ``from apex import amp`` at import time, saves amp's state only
if ``'state_dict' in amp.__dict__``, and reads checkpoints back with
``torch.load(weights_only=True)``. The script below is run by ``amp-patch run``
at O0-O3: it trains through ``ApexScaler``, checkpoints with
``CheckpointSaver``, resumes a fresh model with ``resume_checkpoint`` and
checks that the resumed run is bit-identical to the uninterrupted one.

It runs in a subprocess: timm (and the torchvision it imports) stay out of the
test process. It is skipped where timm does not import.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent('''
    import os
    import sys

    try:
        import timm.utils.cuda
        from timm.models import resume_checkpoint
        from timm.utils import ApexScaler, CheckpointSaver
    except ImportError as exc:
        print(f"SKIP: timm does not import here: {exc}")
        sys.exit(3)

    import torch
    import torch.nn as nn
    import torch.nn.functional as F
    from apex import amp

    assert timm.utils.cuda.has_apex and timm.utils.cuda.amp is amp

    def make():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(),
                              nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 3))
        return model, torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)

    def batch(step):
        g = torch.Generator().manual_seed(step % 4)
        x = torch.randn(8, 3, 6, 6, generator=g)
        return x, (x.mean((1, 2, 3)) > 0).long() + (x[:, 0].mean((1, 2)) > 0).long()

    def train(model, optimizer, scaler, steps):
        losses = []
        for step in steps:
            x, y = batch(step)
            loss = F.cross_entropy(model(x).float(), y)
            scaler(loss, optimizer, clip_grad=5.0)
            optimizer.zero_grad()
            losses.append(loss.item())
        return losses

    root = sys.argv[1]
    for level in ["O0", "O1", "O2", "O3"]:
        out = os.path.join(root, level)
        os.makedirs(out)
        model, optimizer = make()
        model, optimizer = amp.initialize(model, optimizer, opt_level=level,
                                          loss_scale="dynamic", verbosity=0)
        scaler = ApexScaler()
        first = train(model, optimizer, scaler, range(0, 6))
        saver = CheckpointSaver(model, optimizer, amp_scaler=scaler, checkpoint_dir=out,
                                recovery_dir=out, max_history=1)
        saver.save_checkpoint(epoch=0, metric=first[-1])
        rest = train(model, optimizer, scaler, range(6, 12))
        expected = {k: v.clone() for k, v in model.state_dict().items()}
        expected_amp = amp.state_dict()
        amp.deinitialize()

        path = os.path.join(out, "last.pth.tar")
        saved = torch.load(path, weights_only=True)
        assert saved["amp"]["loss_scaler0"]["unskipped"] == 6, saved["amp"]

        model, optimizer = make()
        model, optimizer = amp.initialize(model, optimizer, opt_level=level,
                                          loss_scale="dynamic", verbosity=0)
        scaler = ApexScaler()
        epoch = resume_checkpoint(model, path, optimizer, scaler, log_info=False)
        resumed = train(model, optimizer, scaler, range(6, 12))
        assert epoch == 1, epoch
        assert resumed == rest, (level, resumed, rest)
        for k, v in model.state_dict().items():
            assert v.dtype == expected[k].dtype and torch.equal(v, expected[k]), (level, k)
        assert amp.state_dict() == expected_amp, (amp.state_dict(), expected_amp)
        amp.deinitialize()
        print(f"{level}: loss {first[0]:.4f} -> {rest[-1]:.4f}, resumed exactly, "
              f"amp state {expected_amp['loss_scaler0']}")
''')


@pytest.mark.slow
def test_timm_apex_scaler_checkpoint_resume_at_every_level(tmp_path):
    script = tmp_path / "timm_apex.py"
    script.write_text(SCRIPT)
    proc = subprocess.run([sys.executable, "-W", "ignore", "-m", "amp_patch", "run", str(script),
                           str(tmp_path)], capture_output=True, text=True, timeout=600,
                          cwd=tmp_path)
    if proc.returncode == 3 and proc.stdout.startswith("SKIP:"):
        pytest.skip(proc.stdout.strip().removeprefix("SKIP: "))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for level in ("O0", "O1", "O2", "O3"):
        line = next(ln for ln in proc.stdout.splitlines() if ln.startswith(level + ":"))
        before, after = (float(v) for v in line.split("loss ")[1].split(",")[0].split(" -> "))
        assert after < before, line
