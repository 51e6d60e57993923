"""benchmarks/bench_host_bound.py: its op count, its ratios, and the script end to end.

The host-bound proxy (H2 in docs/design.md) is a benchmark, not a timed test:
these check that it counts and divides what it says, and that it runs.
"""

from __future__ import annotations

import os

import pytest
import torch

from _scripts import load_script

bench = load_script("bench_host_bound")


def test_op_counter_counts_dispatched_ops_and_casts_by_phase():
    x = torch.randn(4, 4)
    counter = bench.OpCounter()
    with counter:
        y = x.to(torch.bfloat16)
        counter.phase = "backward"
        (y + y).float()
    assert counter.ops["_to_copy"] == 2 and counter.ops["add"] == 1
    assert dict(counter.casts) == {"forward": 1, "backward": 1}


@pytest.mark.slow
@pytest.mark.parametrize("row", bench.ROWS)
def test_each_row_counts_a_whole_step(row):
    """Every row trains in process; its count includes the optimizer step's own op."""
    run = bench._Row(row)
    try:
        counts = run.count()
        fused_step = "_fused_adamw_" if row in ("O1", "autocast", "autocast-AA", "bf16") else None
        assert counts["ops"] == sum(counts["by_op"].values()) > 100
        if fused_step:
            assert counts["by_op"][fused_step] == 1
        seconds, faults = run.timed(2)
        assert seconds > 0 and faults >= 0
    finally:
        import amp_patch

        amp_patch.deinitialize()


def test_ratio_is_the_median_of_per_round_ratios():
    records = {"autocast": bench.RowRecord("autocast", seconds=[1.0, 2.0, 1.0]),
               "O1": bench.RowRecord("O1", seconds=[1.1, 1.8, 3.0])}
    # Per round: 1.1, 0.9, 3.0; a ratio of medians would be 1.8 / 1.0.
    assert bench.ratio_to_anchor(records, "O1") == pytest.approx(1.1)


def test_sessions_pool_their_rounds_and_keep_their_own_medians():
    records = {"autocast": bench.RowRecord("autocast"), "O1": bench.RowRecord("O1")}
    for session, (anchor, row) in enumerate([([1.0, 1.0], [0.9, 0.95]),
                                             ([2.0, 2.0, 2.0], [2.4, 2.2, 2.6])]):
        records["autocast"].extend(bench.RowRecord("autocast", seconds=anchor), session)
        records["O1"].extend(bench.RowRecord("O1", counts={"ops": 1}, seconds=row), session)
    assert bench.session_ratios(records, "O1") == pytest.approx([0.925, 1.2])
    # All five rounds: 0.9, 0.95, 1.2, 1.1, 1.3.
    assert bench.ratio_to_anchor(records, "O1") == pytest.approx(1.1)
    assert records["O1"].counts == {"ops": 1} and records["O1"].session == [0, 0, 1, 1, 1]


@pytest.mark.slow
@pytest.mark.parametrize("default_malloc", [False, True], ids=["tuned-malloc", "default-malloc"])
def test_script_writes_its_section(tmp_path, monkeypatch, default_malloc):
    report = tmp_path / "benchmarks.md"
    monkeypatch.setenv("AMP_PATCH_BENCH_REPORT", str(report))
    monkeypatch.delenv("MALLOC_TOP_PAD_", raising=False)
    environ = dict(os.environ)
    args = ["--rounds", "2", "--sessions", "2", "--steps", "1", "--warmup", "1",
            "--rows", "O1", "autocast-AA"]
    assert bench.main(args + (["--default-malloc"] if default_malloc else [])) == 0
    assert dict(os.environ) == environ  # the rows' allocator settings stay theirs
    text = report.read_text()
    assert "<!-- section:host-bound -->" in text
    assert "A/A control" in text and "| O1 | <= 1.00x |" in text
    assert ("glibc malloc's defaults" in text) is default_malloc
    assert "page faults / step" in text
