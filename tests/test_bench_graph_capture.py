"""benchmarks/bench_graph_capture.py (G3) runs at CPU size here, so that it cannot rot before a
GPU runs it: the eager step and its report; the capture itself needs CUDA."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import bench_graph_capture  # noqa: E402


def test_cpu_size_runs_the_eager_step_and_reports(capsys):
    assert bench_graph_capture.main(["--device", "cpu", "--size", "tiny", "--rounds", "1",
                                     "--steps", "2", "--warmup", "1", "--no-write"]) == 0
    out = capsys.readouterr().out
    assert "## Whole-step capture (cpu)" in out and "| eager O2, FusedAdam |" in out
    assert "CUDA graph |" not in out  # no graph without CUDA, and no ratio claimed


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a host without CUDA")
def test_cuda_without_cuda_is_a_clear_error(capsys):
    with pytest.raises(SystemExit):
        bench_graph_capture.main(["--device", "cuda"])
    assert "CUDA is not available" in capsys.readouterr().err


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA not available")
def test_cuda_graph_replay_is_timed(capsys):
    bench_graph_capture.main(["--device", "cuda", "--size", "tiny", "--rounds", "1",
                              "--steps", "2", "--warmup", "2", "--no-write"])
    assert "the whole step as one CUDA graph" in capsys.readouterr().out
