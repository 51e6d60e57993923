"""timm's Apex integration (``ApexScaler``, ``CheckpointSaver``, ``resume_checkpoint``) under the hook.

timm imports ``from apex import amp`` at import time, saves amp's state only
if ``'state_dict' in amp.__dict__``, and reads checkpoints back with
``torch.load(weights_only=True)``. The script below is run by ``amp-patch run``
at O0-O3: it trains through ``ApexScaler``, checkpoints with
``CheckpointSaver``, resumes a fresh model with ``resume_checkpoint`` and
checks that the resumed run matches the uninterrupted one: bit for bit, or
within :data:`RESUME_TOLERANCE` on the host kinds where docs/install.md
("Exact resume on each CPU host kind") promises only that. The script reads
the kind from amp_patch's own detection, in the process that trains. It runs
the small conv net, and timm's ResNet-18 and ViT-tiny at 32x32.

It runs in a subprocess: timm (and the torchvision it imports) stay out of the
test process. It is skipped where timm does not import.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

#: Per CPU host kind (amp_patch.patching.cpu_half.HOST_KINDS), how far a resumed run's losses, and its
#: params and buffers (relative), may be from the uninterrupted run's: 0 is bit for bit. The
#: numbers are docs/install.md's ("Exact resume on each CPU host kind").
RESUME_TOLERANCE = {"native": 0.0, "conv-only": 1e-5, "none": 0.0}

SCRIPT = textwrap.dedent('''
    import json
    import os
    import sys

    try:
        import timm.utils.cuda
        from timm.models import resume_checkpoint
        from timm.utils import ApexScaler, CheckpointSaver
    except ImportError as exc:
        print(f"SKIP: timm does not import here: {exc}")
        sys.exit(3)

    import timm
    import torch
    import torch.nn as nn
    import torch.nn.functional as F
    from apex import amp

    import amp_patch

    assert timm.utils.cuda.has_apex and timm.utils.cuda.amp is amp

    root, name = sys.argv[1], sys.argv[2]
    kind = amp_patch.cpu_half_support().bfloat16.kind
    tol = json.loads(sys.argv[3])[kind]
    size = 6 if name == "convnet" else 32

    def make():
        torch.manual_seed(0)
        if name == "convnet":
            model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(),
                                  nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 3))
            lr = 0.2
        else:
            extra = dict(img_size=32, patch_size=8) if name.startswith("vit") else {}
            model = timm.create_model(name, num_classes=3, **extra)
            lr = 0.01 if name.startswith("vit") else 0.05
        return model, torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)

    def batch(step):
        g = torch.Generator().manual_seed(step % 4)
        x = torch.randn(8 if name == "convnet" else 4, 3, size, size, generator=g)
        return x, (x.mean((1, 2, 3)) > 0).long() + (x[:, 0].mean((1, 2)) > 0).long()

    def same(a, b, what):
        if tol == 0:
            assert a.dtype == b.dtype and torch.equal(a, b), what
        else:
            assert a.dtype == b.dtype, what
            torch.testing.assert_close(a.float(), b.float(), rtol=tol, atol=tol, msg=str(what))

    def train(model, optimizer, scaler, steps):
        losses = []
        for step in steps:
            x, y = batch(step)
            loss = F.cross_entropy(model(x).float(), y)
            scaler(loss, optimizer, clip_grad=5.0)
            optimizer.zero_grad()
            losses.append(loss.item())
        return losses

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
        worst = max(abs(a - b) for a, b in zip(resumed, rest))
        assert (resumed == rest) if tol == 0 else worst <= tol, (level, kind, resumed, rest)
        for k, v in model.state_dict().items():
            same(v, expected[k], (level, kind, k))
        assert amp.state_dict() == expected_amp, (amp.state_dict(), expected_amp)
        amp.deinitialize()
        print(f"{level}: loss {first[0]:.4f} -> {rest[-1]:.4f}, host kind {kind}, resumed "
              f"{'exactly' if worst == 0 else f'within {worst:.1e}'} (allowed {tol:g}), "
              f"amp state {expected_amp['loss_scaler0']}")
''')


@pytest.mark.slow
@pytest.mark.parametrize("model", ["convnet", "resnet18", "vit_tiny_patch16_224"])
def test_timm_apex_scaler_checkpoint_resume_at_every_level(tmp_path, model):
    script = tmp_path / "timm_apex.py"
    script.write_text(SCRIPT)
    proc = subprocess.run([sys.executable, "-W", "ignore", "-m", "amp_patch", "run", str(script),
                           str(tmp_path), model, json.dumps(RESUME_TOLERANCE)],
                          capture_output=True, text=True, timeout=600, cwd=tmp_path)
    if proc.returncode == 3 and proc.stdout.startswith("SKIP:"):
        pytest.skip(proc.stdout.strip().removeprefix("SKIP: "))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for level in ("O0", "O1", "O2", "O3"):
        line = next(ln for ln in proc.stdout.splitlines() if ln.startswith(level + ":"))
        before, after = (float(v) for v in line.split("loss ")[1].split(",")[0].split(" -> "))
        assert after < before, line
