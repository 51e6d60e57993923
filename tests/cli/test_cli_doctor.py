"""``amp-patch doctor``: the installation report for bug reports."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from amp_patch import _native, ops
from amp_patch.patching import cpu_half
from amp_patch.apex_compat.import_hook import apex_import_hook
from amp_patch.cli import doctor
from amp_patch.cli.main import main

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _rows(text: str) -> dict[str, str]:
    rows = {}
    for line in text.splitlines()[1:]:
        if line[:1].strip():
            name, _, value = line.partition("  ")
            rows[name.strip()] = value.strip()
    return rows


@pytest.mark.slow
def test_doctor_reports_versions_kernels_and_hook(capsys):
    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("amp_patch ") and len(out.splitlines()) <= 20  # short enough to paste
    rows = _rows(out)
    assert torch.__version__ in rows["torch"]
    assert rows["kernels"].startswith(_native.status().source)
    for family in ("loss-scaling kernels", "fused optimizers", "O1 wrappers", "CPU half",
                   "compiler", "CUDA", "import hook"):
        assert family in rows, family
    expect = "native" if ops.has_native_kernel("cpu") else "reference"
    assert rows["loss-scaling kernels"].startswith(f"cpu: {expect}")
    assert rows["import hook"].startswith("inactive")


@pytest.mark.slow
def test_doctor_sees_the_import_hook():
    with apex_import_hook():
        assert _rows(doctor.report())["import hook"].startswith("active")


@pytest.mark.slow
def test_doctor_names_the_reference_ops_and_why():
    env = dict(os.environ, AMP_PATCH_NO_EXT="1", PYTHONPATH=ROOT)
    proc = subprocess.run([sys.executable, "-m", "amp_patch", "doctor"], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    rows = _rows(proc.stdout)
    assert rows["kernels"] == "reference: AMP_PATCH_NO_EXT=1"
    assert rows["loss-scaling kernels"].startswith("cpu: reference")
    assert rows["fused optimizers"].startswith("cpu: reference")
    assert rows["O1 wrappers"].startswith("Python")
    assert "AMP_PATCH_NO_EXT=1" in rows["environment"]


@pytest.mark.slow
@pytest.mark.parametrize("answer, says, runs", [
    (cpu_half.DtypeSupport(True, True, True, 0.5, 0.6), "runs its bf16 matmuls natively", True),
    (cpu_half.DtypeSupport(True, False, True, 2.8, 1.9), "take 2.8x fp32's time on this host "
                                                         "(kind conv-only", True),
    (cpu_half.DtypeSupport(False, False, False), "ATen's slow path on this host (kind none", False),
], ids=["native", "conv-only", "none"])
def test_doctor_says_what_autocast_costs_on_each_host_kind(answer, says, runs):
    """The same wording and decision as compare's, from the same detection."""
    with cpu_half.override(bfloat16=answer):
        row = _rows(doctor.report())["autocast"]
    assert says in row and "many times" not in row
    assert row.endswith("compare runs it") == runs
    assert ("compare leaves it out" in row) == (not runs)


def test_doctor_fp8_row_says_where_fp8_gemms_run(monkeypatch):
    line = doctor.fp8_support(["cpu"])
    assert line.startswith("torch._scaled_mm: cpu: yes") and "e5m2 (max 57344)" in line
    assert "FP8" in dict(_rows(doctor.report()))
    from amp_patch.ops import fp8_ops

    monkeypatch.setattr(fp8_ops, "fp8_gemm_available", lambda device, rowwise=False: False)
    assert "cpu: no (emulation only, when asked)" in doctor.fp8_support(["cpu"])
    monkeypatch.setattr(fp8_ops, "SCALED_MM_SIGNATURE", None)
    assert doctor.fp8_support(["cpu"]).startswith("no: torch")
