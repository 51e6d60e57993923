"""benchmarks/bench_e2e.py: the ratios its target rows report (the script itself is a benchmark)."""

from __future__ import annotations


import pytest

from _scripts import load_script

bench = load_script("bench_e2e")


def test_m1_is_net_of_the_fp32_loss_and_the_others_plain_ratios():
    fixed = bench.LOSS_FP32_BYTES
    assert fixed == 2 * 8 * 128 * 8192 * 4  # the benchmark LM's logits, twice, in fp32
    res = {"O0": {"peak_bytes": fixed + 1000, "median_s": 2.0},
           "O3": {"peak_bytes": fixed + 500, "median_s": 1.0}}
    assert bench._ratio(res, "O3", "O0", "memory") == pytest.approx(0.5)
    assert bench._ratio(res, "O3", "O0", "time") == pytest.approx(0.5)
    assert bench._ratio(res, "O3", "O0", "throughput") == pytest.approx(2.0)
    # A peak no larger than L leaves nothing to compare.
    assert bench._ratio({"O0": {"peak_bytes": fixed}, "O3": {"peak_bytes": 1}},
                        "O3", "O0", "memory") is None
