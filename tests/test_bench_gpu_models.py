"""benchmarks/bench_gpu_models.py at tiny sizes, so that the GPU benchmark cannot rot unrun.

The script's targets and figures are for a GPU (docs/design.md, "Performance
targets": G1, G2, M1); here it runs its rows at ``--size tiny`` on the CPU, in
process and then as the script, and the full sizes are checked by counting
parameters on the meta device.
"""

from __future__ import annotations

import math

import pytest
import torch

from conftest import DEVICES

from _scripts import load_script

bench = load_script("bench_gpu_models")


def test_full_sizes_are_gpt2_small_and_resnet50():
    """The full workloads have the published parameter counts (124.4 M and 25.6 M)."""
    with torch.device("meta"):
        lm = bench.gpt2(device="meta", size="full").model
        resnet = bench.resnet50(device="meta", size="full").model
    assert lm.head.weight is lm.tok.weight
    assert abs(sum(p.numel() for p in lm.parameters()) - 124.4e6) < 0.1e6
    assert abs(sum(p.numel() for p in resnet.parameters()) - 25.56e6) < 0.01e6


def test_plan_runs_fp32_rows_once_per_workload():
    grid = [("gpt2", "fp16"), ("gpt2", "bf16"), ("resnet50", "fp16")]
    specs = bench.plan(grid, ("O0-tf32", "O1", "O2"), "cuda", "full", 1, 2)
    names = [(s.workload, s.row, s.half_dtype) for s in specs]
    assert names == [("gpt2", "O0-tf32", "fp16"), ("gpt2", "O1", "fp16"), ("gpt2", "O2", "fp16"),
                     ("gpt2", "O1", "bf16"), ("gpt2", "O2", "bf16"),
                     ("resnet50", "O0-tf32", "fp16"), ("resnet50", "O1", "fp16"),
                     ("resnet50", "O2", "fp16")]


def test_grid_rejects_bad_pairs():
    with pytest.raises(SystemExit):
        bench.main(["--device", "cpu", "--grid", "gpt2-bf16", "--no-write"])
    with pytest.raises(SystemExit):
        bench.main(["--device", "cpu", "--size", "full", "--no-write"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error without CUDA")
def test_cuda_without_cuda_is_a_clear_error(capsys):
    with pytest.raises(SystemExit):
        bench.main(["--device", "cuda", "--no-write"])
    assert "CUDA is not available" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("workload", ["gpt2", "resnet50"])
@pytest.mark.parametrize("row", ["O0", "O1", "O2", "O3", "autocast"])
def test_row_trains_at_tiny_size(device, workload, row):
    """Each row of each workload trains in process and reports a time, a peak and a loss."""
    spec = bench.RowSpec(workload, row, "bf16", device, "tiny", warmup=1, steps=2)
    result = bench.run_row(spec)
    assert result.ok, result.error
    assert result.step_seconds > 0 and result.peak_bytes is not None
    assert math.isfinite(result.final_loss)
    assert result.params == sum(p.numel() for p in bench.WORKLOADS[workload](size="tiny").model
                                .parameters())


def test_targets_are_ratios_to_the_same_runs_anchors():
    """G1 is autocast's step time over O2's, G2 O1's over autocast's, M1 O3's peak over O0's,
    both net of the fp32 loss over the logits."""
    def row(name, seconds, peak):
        return bench.RowResult(bench.RowSpec("gpt2", name, "fp16", "cuda", "full", 1, 1),
                               step_seconds=seconds, peak_bytes=peak, params=1, final_loss=1.0)

    results = [row("O0-tf32", 0.4, 1000), row("O1", 0.33, 700), row("O2", 0.25, 600),
               row("O3", 0.2, 520), row("autocast", 0.3, 650)]
    assert bench._target_value("g1", results, "gpt2", "fp16") == pytest.approx(1.2)
    assert bench._target_value("g2", results, "gpt2", "fp16") == pytest.approx(1.1)
    # M1 net of the fp32 loss L on both sides (tiny size: L = 2 x 2 x 32 x 512 x 4 = 262144).
    assert bench._target_value("m1", results, "gpt2", "fp16") is None  # a peak below L
    big = [bench.RowResult(r.spec, r.step_seconds, r.peak_bytes * 10**4, r.params, r.final_loss)
           for r in results]
    fixed = bench.loss_fp32_bytes("gpt2", "tiny")
    assert fixed == 262144
    assert bench._target_value("m1", big, "gpt2", "fp16", "tiny") == pytest.approx(
        (5_200_000 - fixed) / (10_000_000 - fixed))
    assert bench._target_value("g1", results, "gpt2", "bf16") is None


def test_a_stopped_run_leaves_its_rows_marked_partial():
    """Rows are written as they come: a run stopped by its time limit says how many it has."""
    def row(name, seconds):
        return bench.RowResult(bench.RowSpec("gpt2", name, "bf16", "cpu", "tiny", 1, 1),
                               step_seconds=seconds, peak_bytes=100, params=1, final_loss=1.0)

    load = bench.LoadMonitor().start().stop()
    grid = [("gpt2", "bf16")]
    results = [row("O2", 0.25), row("autocast", 0.3)]
    text = bench.report(results, grid, "cpu", "tiny", 1, 1, load, planned=5)
    assert "Partial: 2 of 5 rows" in text
    assert "| G1 | gpt2 | bf16 |" in text and "1.200" in text  # both its rows are there
    assert "Partial" not in bench.report(results, grid, "cpu", "tiny", 1, 1, load, planned=2)


@pytest.mark.slow
def test_script_runs_every_row_in_its_own_process(tmp_path, monkeypatch):
    """The script at tiny size on the CPU: every row in a spawned process, one section written."""
    report = tmp_path / "benchmarks.md"
    monkeypatch.setenv("AMP_PATCH_BENCH_REPORT", str(report))
    # Two rows per workload keep it short: test_row_trains_at_tiny_size trains every row.
    rc = bench.main(["--device", "cpu", "--grid", "gpt2:bf16", "resnet50:bf16",
                     "--rows", "O2", "autocast", "--warmup", "1", "--steps", "1"])
    assert rc == 0
    text = report.read_text()
    assert "<!-- section:gpu-models-cpu-tiny -->" in text
    assert "failed" not in text
    for workload in ("gpt2", "resnet50"):
        assert f"### {workload}:" in text
    assert "| G1 | gpt2 | bf16 |" in text
    assert "| G2 | resnet50 | bf16 |" in text  # shown, not measured: no O1 row
    assert "not a GPU: not judged" in text


def test_m1_report_gives_each_model_its_ratio_net_of_the_fp32_loss():
    def count(peak, fixed):
        return {"params": 1, "masters": 0, "state": 2, "step_peak": peak - 3, "peak": peak,
                "logits_fp32": fixed, "peak_at": "aten::nll_loss_forward"}

    mib = 2**20
    counts = {"benchmark LM": {"O0": count(518 * mib, 64 * mib), "O3": count(291 * mib, 64 * mib)},
              "other": {"O0": count(400 * mib, 100 * mib), "O3": count(280 * mib, 100 * mib)}}
    text = bench.m1_report(counts)
    assert "### benchmark LM (vocab" in text and "### other" in text
    assert "(O3 - L) / (O0 - L): **0.500**" in text  # (291 - 64) / (518 - 64)
    assert "(O3 - L) / (O0 - L): **0.600**" in text and "O3 / O0: 0.700" in text
