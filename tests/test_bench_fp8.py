"""benchmarks/bench_fp8.py at tiny sizes, so that the FP8 benchmark cannot rot unrun.

Its targets are for a GPU (docs/benchmarks.md, fp8-cuda); here its rows run at
``--size tiny`` on the CPU, and the full sizes are checked by counting.
"""

from __future__ import annotations


import pytest
import torch

from _scripts import load_script

bench = load_script("bench_fp8")


def test_full_sizes_are_the_issue_rows():
    full = bench.SIZES["full"]
    assert full.linear == ((16384, 8192, 8192),)
    # Every pair of the grid's dims on two token counts; each admitted by the default filter.
    assert len(full.filter) == 18 and all(k >= 2048 and n >= 2048 and k % 16 == n % 16 == 0
                                          for _, k, n in full.filter)
    llama = full.llama
    assert (llama.d, llama.heads, llama.ffn) == (4096, 32, 11008) and full.default_filter
    assert bench.block_params(llama) == 4 * 4096**2 + 3 * 4096 * 11008 + 2 * 4096
    with torch.device("meta"):
        block = bench.Block(llama.d, llama.heads, llama.ffn)
    assert sum(p.numel() for p in block.parameters()) == bench.block_params(llama)


@pytest.mark.slow
def test_tiny_run_prints_every_row(capsys):
    bench.main(["--device", "cpu", "--size", "tiny", "--no-write"])
    out = capsys.readouterr().out
    for row in ("| linear | 64 x 64 -> 64 |", "| filter | 32 x 64 -> 32 |", "| llama step |",
                "| llama peak memory |", "no target on the CPU", "Llama-style stack: 1 block"):
        assert row in out, row
    assert "partial" not in out


def test_section_is_written_after_each_row(tmp_path, monkeypatch):
    report = tmp_path / "benchmarks.md"
    monkeypatch.setenv("AMP_PATCH_BENCH_REPORT", str(report))
    written = []
    real = bench.common.write_section

    def spy(name, body, path=None):
        written.append(body)
        return real(name, body, path)

    monkeypatch.setattr(bench.common, "write_section", spy)
    bench.main(["--device", "cpu", "--size", "tiny", "--rows", "linear", "filter"])
    assert len(written) == 2 and "partial" in written[0] and "partial" not in written[1]
    assert "<!-- section:fp8-cpu -->" in report.read_text()


def test_cuda_and_full_size_are_refused_on_the_cpu():
    if torch.cuda.is_available():
        pytest.skip("checks the error without CUDA")
    with pytest.raises(SystemExit):
        bench.main(["--device", "cuda", "--no-write"])
    with pytest.raises(SystemExit):
        bench.main(["--device", "cpu", "--size", "full", "--no-write"])
