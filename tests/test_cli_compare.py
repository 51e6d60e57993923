"""``amp-patch compare``: every level runs in its own process and reports sane numbers."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from amp_patch.cli import main as cli_main
from amp_patch.cli import models

ROOT = Path(__file__).resolve().parent.parent
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _compare(tmp_path: Path, *args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ, COLUMNS="120")
    return subprocess.run([sys.executable, "-m", "amp_patch", "compare", *args],
                          cwd=cwd or tmp_path, env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_compare_all_levels_json_png_table(tmp_path):
    out = tmp_path / "out"
    proc = _compare(tmp_path, "--model", "mlp", "--steps", "5", "--batch-size", "32", "--out", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads((out / "results.json").read_text())
    assert data["config"]["half_dtype"] == "bf16" and data["config"]["steps"] == 5
    assert list(data["levels"]) == ["O0", "O1", "O2", "O3", "autocast"]
    o0 = data["levels"]["O0"]
    for level, r in data["levels"].items():
        assert r["ok"] and r["error"] is None, level
        assert len(r["losses"]) == 5 and all(math.isfinite(v) for v in r["losses"])
        assert r["steps_per_s"] > 0 and r["speedup_vs_O0"] > 0
        assert r["peak_memory_bytes"] >= 0
        assert r["skipped_steps"] == 0  # bf16: nothing overflows
        assert r["final_loss_scale"] == 1.0  # bf16: static scale 1.0
        # Same seed, same data: every level starts from O0's loss, within bf16 rounding.
        assert abs(r["losses"][0] - o0["losses"][0]) < 0.05
        assert r["max_abs_loss_diff_vs_O0"] < 0.5
    assert o0["max_abs_loss_diff_vs_O0"] == 0.0 and o0["speedup_vs_O0"] == 1.0
    assert (out / "compare.png").read_bytes()[:8] == PNG_MAGIC
    table = (out / "table.txt").read_text()
    for word in ("O0", "O1", "O2", "O3", "autocast", "steps/s", "speed-up", "peak mem", "skipped"):
        assert word in table


FACTORY = """
import torch

CALLS = []

def make(device="cpu", seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Linear(8, 2).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    def batch_fn(step):
        g = torch.Generator().manual_seed(step)
        return torch.randn(4, 8, generator=g).to(device)
    def loss_fn(model, x):
        return model(x).float().pow(2).mean()
    return model, opt, batch_fn, loss_fn

def broken_under_o3(device="cpu", seed=0):
    import amp_patch.session as s
    model, opt, batch_fn, loss_fn = make(device, seed)
    def bad_loss(model, x):
        if s.current() is not None and s.current().props.opt_level == "O3":
            raise ValueError("this factory refuses O3")
        return loss_fn(model, x)
    return model, opt, batch_fn, bad_loss
"""


def test_compare_user_factory_and_json_plot_paths(tmp_path):
    (tmp_path / "user_models.py").write_text(textwrap.dedent(FACTORY))
    proc = _compare(tmp_path, "--model", "user_models:make", "--steps", "3", "--levels", "O0",
                    "autocast", "--json", "r.json", "--plot", "r.png")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads((tmp_path / "r.json").read_text())
    assert list(data["levels"]) == ["O0", "autocast"]
    assert all(r["ok"] and len(r["losses"]) == 3 for r in data["levels"].values())
    assert (tmp_path / "r.png").read_bytes()[:8] == PNG_MAGIC


def test_compare_failing_level_exits_nonzero_and_shows_error(tmp_path):
    (tmp_path / "user_models.py").write_text(textwrap.dedent(FACTORY))
    proc = _compare(tmp_path, "--model", "user_models:broken_under_o3", "--steps", "2",
                    "--levels", "O0", "O3", "--json", "r.json")
    assert proc.returncode == 1
    assert "this factory refuses O3" in proc.stdout
    data = json.loads((tmp_path / "r.json").read_text())
    assert data["levels"]["O0"]["ok"]  # the other level still ran
    assert not data["levels"]["O3"]["ok"] and "refuses O3" in data["levels"]["O3"]["error"]


def test_compare_invalid_level_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exc:
        cli_main.main(["compare", "--levels", "O4"])
    assert exc.value.code != 0
    assert "O4" in capsys.readouterr().err


def test_compare_bad_model_spec(tmp_path):
    proc = _compare(tmp_path, "--model", "nosuchmodule_xyz:make", "--steps", "1", "--levels", "O0")
    assert proc.returncode == 1
    assert "nosuchmodule_xyz" in proc.stdout


@pytest.mark.parametrize("name", sorted(models.BUILTIN))
def test_builtin_factories_are_deterministic(name):
    kwargs = {"batch_size": 2}
    if name == "lm":
        kwargs.update(vocab=64, d_model=32, n_layers=1, n_heads=2, seq_len=8)
    a = models.BUILTIN[name](**kwargs)
    b = models.BUILTIN[name](**kwargs)
    for pa, pb in zip(a.model.parameters(), b.model.parameters()):
        assert pa.equal(pb)
    batch_a, batch_b = a.batch_fn(3), b.batch_fn(3)
    flat = lambda x: x if isinstance(x, tuple) else (x,)  # noqa: E731
    assert all(u.equal(v) for u, v in zip(flat(batch_a), flat(batch_b)))
    assert not all(u.equal(v) for u, v in zip(flat(a.batch_fn(4)), flat(batch_a)))
    loss = a.loss_fn(a.model, batch_a)
    assert loss.dim() == 0 and loss.requires_grad


def test_bench_lm_has_about_21m_params():
    w = models.lm(config=models.BENCH_LM)
    assert 20e6 < models.parameter_count(w.model) < 22e6


def test_resolve_rejects_unknown_names():
    with pytest.raises(ValueError, match="built-in name"):
        models.resolve("resnet")


def test_help_has_examples():
    proc = subprocess.run([sys.executable, "-m", "amp_patch", "--help"], capture_output=True,
                          text=True, cwd=ROOT)
    assert proc.returncode == 0
    for word in ("compare", "run", "bench", "examples:"):
        assert word in proc.stdout
