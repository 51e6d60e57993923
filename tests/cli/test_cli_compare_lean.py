"""compare's lean row (O2-lean): the preset table, the trainer that runs it, and the skip."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from amp_patch.cli.compare import models, round_robin, trainer
from amp_patch.cli.compare import results as compare_results
from amp_patch.cli.compare.table import render_table
from amp_patch.cli.host_facts import HostFacts, LoadMonitor
from amp_patch.ops.lean_state_ops import SCALED_CODES
from amp_patch.optim.fused import FusedAdam, FusedSGD

TINY_LM = dict(vocab=64, d_model=32, n_layers=1, n_heads=2, seq_len=8, batch_size=2)


def test_presets_are_one_table_beside_the_levels():
    assert trainer.AMP_ROWS == (*trainer.AMP_LEVELS, "O2-lean", "O2+fp8")
    assert trainer.LEVELS == (*trainer.AMP_ROWS, "autocast")
    lean = trainer.preset("O2-lean")
    assert lean is trainer.PRESETS["O2-lean"] and lean.lean_state
    assert lean.initialize_kwargs() == {"opt_level": "O2", "optimizer_state": "int8",
                                        "master_weights": "bf16"}
    assert trainer.preset("O2") is None and trainer.preset("autocast") is None
    with pytest.raises(ValueError, match="unknown level 'O2-fat'"):
        trainer.preset("O2-fat")
    with pytest.raises(ValueError, match="unknown opt level 'O5'"):
        trainer.Preset("x", "O5", (), "")
    with pytest.raises(ValueError, match="cannot name a preset"):
        trainer.Preset("O1", "O2", (), "")


@pytest.mark.parametrize("name, optimizer", [("lm", FusedAdam), ("mlp", FusedAdam),
                                             ("convnet", FusedSGD)])
def test_fused_variants_of_the_builtins(name, optimizer):
    variant = models.fused_variant(name)
    kwargs = dict(TINY_LM) if name == "lm" else {"batch_size": 2}
    plain, fused = models.BUILTIN[name](**kwargs), variant(**kwargs)
    assert isinstance(fused.optimizer, optimizer)
    assert not isinstance(plain.optimizer, (FusedAdam, FusedSGD))
    # The same network and hyper-parameters: only the optimizer's implementation differs.
    for a, b in zip(plain.model.parameters(), fused.model.parameters()):
        assert a.equal(b)
    assert fused.optimizer.defaults["lr"] == plain.optimizer.defaults["lr"]
    assert models.fused_variant("pkg.mod:make") == "pkg.mod:make"


def _step_o2_lean(half_dtype=torch.bfloat16):
    w = models.mlp(batch_size=8, in_features=64, hidden=128, layers=3, fused_adam=True)
    t = trainer.LevelTrainer("O2-lean", w.model, w.optimizer, w.loss_fn, torch.device("cpu"),
                             half_dtype)
    return w, t


def test_level_trainer_runs_o2_lean_with_lean_state():
    w, t = _step_o2_lean()
    try:
        assert t.level == "O2-lean"
        assert t.initialize_kwargs["optimizer_state"] == "int8"
        losses = [t.step(w.batch_fn(i)).item() for i in range(3)]
        assert all(torch.isfinite(torch.tensor(losses))) and not t.skipped
        assert t.optimizer_seconds is not None and t.optimizer_seconds > 0
        # bf16 masters: the optimizer steps the bf16 model params themselves; the
        # matrices' moments are block-scaled 8-bit codes with their scales.
        stepped = [p for g in w.optimizer.param_groups for p in g["params"]]
        assert all(p.dtype == torch.bfloat16 for p in stepped)
        model_params = {id(p) for p in w.model.parameters()}
        assert all(id(p) in model_params for p in stepped)
        codes = [s["exp_avg"].dtype for s in w.optimizer.state.values() if "exp_avg" in s]
        assert torch.int8 in codes
        assert any(k.endswith("_scale") for s in w.optimizer.state.values() for k in s)
        assert all(d in (torch.float32, *SCALED_CODES) for d in codes)
    finally:
        t.close()


def test_level_trainer_says_why_a_preset_is_unavailable():
    w = models.mlp(batch_size=8, in_features=64, hidden=128, layers=3)
    with pytest.raises(trainer.Unavailable, match="needs amp_patch's FusedAdam or FusedSGD; "
                                                  "this workload's optimizer is Adam"):
        trainer.LevelTrainer("O2-lean", w.model, w.optimizer, w.loss_fn, torch.device("cpu"),
                             torch.bfloat16)
    # Nothing was initialized: a plain level still runs on the same workload.
    t = trainer.LevelTrainer("O2", w.model, w.optimizer, w.loss_fn, torch.device("cpu"),
                             torch.bfloat16)
    t.step(w.batch_fn(0))
    t.close()


@pytest.mark.slow
def test_job_presets_are_rows_of_a_measure():
    """A benchmark's own preset runs in a level process and reports its optimizer times."""
    grid = trainer.Preset("O2-bf16", "O2", (("optimizer_state", "bf16"),), "bf16 moments")
    spec = round_robin.JobSpec(models.fused_variant("mlp"), batch_size=8, presets=(grid,))
    records = round_robin.measure(spec, ["O2", "O2-bf16"], warmup=1, rounds=[2, 1])
    for rec in records.values():
        assert rec.ok, rec.error
        assert len(rec.optimizer_step_seconds) == len(rec.step_seconds) == 3
        assert all(0 < o < s for o, s in zip(rec.optimizer_step_seconds, rec.step_seconds))


FACTORY = """
import torch

def make(device="cpu", seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Linear(8, 2).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    def batch_fn(step):
        g = torch.Generator().manual_seed(step)
        return torch.randn(4, 8, generator=g).to(device)
    def loss_fn(model, x):
        return model(x).float().pow(2).mean()
    return model, opt, batch_fn, loss_fn
"""


@pytest.mark.slow
def test_compare_skips_o2_lean_for_a_torch_optimizer(tmp_path):
    (tmp_path / "user_models.py").write_text(textwrap.dedent(FACTORY))
    proc = subprocess.run([sys.executable, "-m", "amp_patch", "compare", "--model",
                           "user_models:make", "--steps", "3", "--levels", "O0", "O2-lean",
                           "--json", "r.json"], cwd=tmp_path, capture_output=True, text=True,
                          env=dict(os.environ, COLUMNS="120"), timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr  # skipped is not failed
    assert "O2-lean skipped" in proc.stdout and "failed" not in proc.stdout
    data = json.loads((tmp_path / "r.json").read_text())
    lean = data["levels"]["O2-lean"]
    assert not lean["ok"] and lean["error"] is None and lean["losses"] == []
    assert "FusedAdam or FusedSGD; this workload's optimizer is SGD" in lean["unavailable"]
    assert data["levels"]["O0"]["ok"] and len(data["levels"]["O0"]["losses"]) == 3


def test_table_shows_a_skipped_row():
    from rich.console import Console

    rows = [compare_results.LevelResult("O0", ok=True, losses=[1.0], loss_scales=[1.0]),
            compare_results.LevelResult("O2-lean", unavailable="needs FusedAdam")]
    comparison = compare_results.Comparison(rows, HostFacts.collect("cpu"),
                                            LoadMonitor(load_before=[0.0] * 3,
                                                        load_after=[0.0] * 3), [1])
    console = Console(width=200, color_system=None, record=True)
    console.print(render_table(comparison, "t"))
    text = console.export_text()
    assert "skipped" in text and "FAILED" not in text
    assert "O2-lean: O2 with block-scaled int8 optimizer state" in text


def _bench_lean_state():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_lean_state.py"
    spec = importlib.util.spec_from_file_location("bench_lean_state", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("config, low, high", [
    ("fp32/fp32", 12.0, 12.01),  # O2 today: fp32 master and two fp32 moments
    ("fp32/bf16", 8.0, 8.01),  # the bf16 params are their own masters: the moments alone
    ("bf16/bf16", 4.0, 4.01),
    ("int8/fp32", 6.0, 6.1),  # fp32 master, int8 + uint8 codes, a scale per 256 each
    ("int8/bf16", 2.0, 2.1),  # the biases (0.1 % of the params) keep fp32 moments
])
def test_bench_lean_state_counts_the_optimizers_bytes(config, low, high):
    """benchmarks/bench_lean_state.py's bytes per param: state, scales and masters, no model."""
    import amp_patch as amp

    bench = _bench_lean_state()
    w = models.mlp(batch_size=8, in_features=256, hidden=1024, layers=3, fused_adam=True)
    amp.initialize(w.model, w.optimizer, opt_level="O2", half_dtype=torch.bfloat16, verbosity=0,
                   **bench.initialize_options(config))
    try:
        with amp.scale_loss(w.loss_fn(w.model, w.batch_fn(0)), w.optimizer) as scaled:
            scaled.backward()
        w.optimizer.step()
        per_param = bench.optimizer_bytes(w.optimizer, w.model) / models.parameter_count(w.model)
    finally:
        amp.deinitialize()
    assert low <= per_param < high, per_param


def test_bench_lean_state_sections_by_device_and_threads():
    """A CUDA run and a pinned run write sections of their own, beside the default one."""
    bench = _bench_lean_state()
    assert bench.section_name("cpu", None) == "lean-state"
    assert bench.section_name("cpu", 1) == "lean-state-1t"
    assert bench.section_name("cuda", None) == "lean-state-cuda"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error where CUDA is missing")
def test_bench_lean_state_refuses_cuda_without_cuda(capsys):
    bench = _bench_lean_state()
    with pytest.raises(SystemExit) as exc:
        bench.main(["--device", "cuda", "--quick"])
    assert exc.value.code == 2
    assert "CUDA is not available" in capsys.readouterr().err
