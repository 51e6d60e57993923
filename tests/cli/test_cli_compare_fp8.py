"""compare's FP8 row (O2+fp8): the preset, the trainer that runs it, its skip, and the table."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

import amp_patch as amp
from amp_patch.cli.compare import models, trainer
from amp_patch.cli.compare import results as compare_results
from amp_patch.cli.compare.table import render_table
from amp_patch.cli.host_facts import HostFacts, LoadMonitor

TINY_LM = dict(vocab=64, d_model=32, n_layers=1, n_heads=2, seq_len=16, batch_size=2)


def test_o2_fp8_is_a_preset_with_its_recipe():
    row = trainer.preset("O2+fp8")
    assert row is trainer.PRESETS["O2+fp8"] and row.fp8 and not row.lean_state
    kwargs = row.initialize_kwargs()
    recipe = kwargs["fp8"]
    assert kwargs["opt_level"] == "O2" and isinstance(recipe, amp.Fp8Recipe)
    assert (recipe.scaling, recipe.format, recipe.min_features) == ("tensorwise", "hybrid", 16)
    assert row.json_kwargs() == {"opt_level": "O2", "fp8": recipe.describe()}
    assert "min_features=16" in row.about and "2048" in row.about
    assert not trainer.PRESETS["O2-lean"].fp8


def test_level_trainer_converts_the_builtin_lm():
    """The default LM's linears are all multiples of 16: every one runs FP8 under the row."""
    w = models.lm(**TINY_LM)
    t = trainer.LevelTrainer("O2+fp8", w.model, w.optimizer, w.loss_fn, torch.device("cpu"),
                             torch.bfloat16)
    try:
        plan = amp.fp8_plan()
        linears = [n for n, m in w.model.named_modules() if isinstance(m, torch.nn.Linear)]
        assert plan is not None and list(plan.converted) == linears and not plan.left_out
        assert t.notes() == [f"FP8: {len(linears)} of {len(linears)} nn.Linear layers converted"]
        losses = [t.step(w.batch_fn(0)).item()]
        assert all(torch.isfinite(torch.tensor(losses))) and not t.skipped
    finally:
        t.close()
    assert amp.fp8_plan() is None


def test_row_is_skipped_without_fp8_gemms(monkeypatch):
    monkeypatch.setattr(trainer.fp8_ops, "fp8_gemm_available", lambda device: False)
    w = models.lm(**TINY_LM)
    with pytest.raises(trainer.Unavailable, match="needs FP8 GEMMs"):
        trainer.LevelTrainer("O2+fp8", w.model, w.optimizer, w.loss_fn, torch.device("cpu"),
                             torch.bfloat16)


def test_level_trainer_notes_the_layers_left_out():
    """A layer the filter leaves out is named with its reason in the row's notes."""
    w = models.lm(**dict(TINY_LM, vocab=70))  # the head's 70 outputs: not a multiple of 16
    t = trainer.LevelTrainer("O2+fp8", w.model, w.optimizer, w.loss_fn, torch.device("cpu"),
                             torch.bfloat16)
    try:
        (note,) = t.notes()
    finally:
        t.close()
    assert note.startswith("FP8: ") and "left out: " in note and "out_features=70" in note
    o2 = trainer.LevelTrainer("O2", w.model, w.optimizer, w.loss_fn, torch.device("cpu"),
                              torch.bfloat16)
    try:
        assert o2.notes() == []
    finally:
        o2.close()


def test_table_caption_states_the_recipe():
    results = [compare_results.LevelResult("O2", losses=[1.0], peak_memory_bytes=2**20),
               compare_results.LevelResult("O2+fp8", losses=[1.0], peak_memory_bytes=2**20,
                                           notes=["FP8: 3 of 4 nn.Linear layers converted; "
                                                  "left out: head (why)"])]
    comparison = compare_results.Comparison(results, HostFacts.collect("cpu"), LoadMonitor(), [])
    from rich.console import Console

    console = Console(width=200, record=True, color_system=None)
    console.print(render_table(comparison, "t"))
    text = console.export_text()
    assert "O2+fp8: O2 with its nn.Linear layers in FP8" in text
    assert "O2+fp8: FP8: 3 of 4 nn.Linear layers converted; left out: head (why)" in text
    assert comparison.results[1].to_json()["notes"] == [results[1].notes[0]]


@pytest.mark.slow
def test_compare_runs_the_fp8_row(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "amp_patch", "compare", "--steps", "6",
                           "--levels", "O2", "O2+fp8", "--json", "r.json"], cwd=tmp_path,
                          capture_output=True, text=True, env=dict(os.environ, COLUMNS="160"),
                          timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads((tmp_path / "r.json").read_text())
    row = data["levels"]["O2+fp8"]
    assert row["ok"] and len(row["losses"]) == 6 and row["peak_memory_bytes"] > 0
    assert data["config"]["presets"]["O2+fp8"]["fp8"].startswith("tensorwise")
    # Same seed and data: FP8 starts where O2 starts, within FP8's rounding.
    assert abs(row["losses"][0] - data["levels"]["O2"]["losses"][0]) < 0.05
    assert "O2+fp8: O2 with its nn.Linear layers in FP8" in proc.stdout
    assert row["notes"] and row["notes"][0].startswith("FP8: ") and not data["levels"]["O2"]["notes"]
