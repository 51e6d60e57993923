"""``amp-patch run`` and its apex import hook."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import amp_patch
from amp_patch import optimizers as fused
from amp_patch.apex_compat import import_hook

ROOT = Path(__file__).resolve().parents[2]


def _run(tmp_path: Path, script: str, *args: str) -> subprocess.CompletedProcess:
    path = tmp_path / "script.py"
    path.write_text(textwrap.dedent(script))
    return subprocess.run([sys.executable, "-m", "amp_patch", "run", str(path), *args],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)


def test_apex_amp_is_amp_patch_api():
    with import_hook.apex_import_hook(shadow_apex=True):
        from apex import amp
        import amp_C  # noqa: F401
        from apex.optimizers import FusedAdam, FusedSGD
        from apex.parallel import DistributedDataParallel

        for name in amp_patch.__all__:
            assert getattr(amp, name) is getattr(amp_patch, name)
        assert issubclass(FusedAdam, fused.FusedAdam) and FusedSGD is fused.FusedSGD
        assert issubclass(DistributedDataParallel, torch.nn.parallel.DistributedDataParallel)
    assert "apex" not in sys.modules and "apex.amp" not in sys.modules


@pytest.mark.parametrize("stmt, name", [
    ("import apex.contrib.multihead_attn", "apex.contrib.multihead_attn"),
    ("import xentropy_cuda", "xentropy_cuda"),
    ("from apex.normalization import MixedFusedLayerNorm",
     "apex.normalization.MixedFusedLayerNorm"),
    ("import apex.transformer", "apex.transformer"),
])
def test_unsupported_names_fail_at_import_naming_them(stmt, name):
    with import_hook.apex_import_hook(shadow_apex=True):
        with pytest.raises(ImportError, match="is not supported") as exc:
            exec(stmt, {})
    assert str(exc.value).startswith(f"{name} is not supported")
    assert isinstance(exc.value, import_hook.ApexUnsupportedError)


@pytest.mark.slow
def test_run_script_with_argv_and_unsupported_message(tmp_path):
    proc = _run(tmp_path, """
        import sys
        from apex import amp
        print("argv", sys.argv[1:], "main" if __name__ == "__main__" else __name__)
        print("initialize is amp_patch's:", amp.initialize.__module__)
        from apex.contrib.multihead_attn import SelfMultiheadAttn
    """, "--flag", "value")
    assert proc.returncode != 0
    assert "argv ['--flag', 'value'] main" in proc.stdout
    assert "initialize is amp_patch's: amp_patch.frontend.lifecycle" in proc.stdout
    assert "apex.contrib.multihead_attn is not supported by amp_patch" in proc.stderr


@pytest.mark.slow
def test_run_summarises_names_the_script_fell_back_from(tmp_path):
    proc = _run(tmp_path, """
        try:
            from apex.contrib.multihead_attn import SelfMultiheadAttn
        except ImportError:
            print("WARNING: apex not installed, using the plain attention")
        try:
            import fused_layer_norm_cuda
        except ImportError:
            pass
        from apex.fp16_utils import FP16_Optimizer
        print("served", FP16_Optimizer.__name__)
    """)
    assert proc.returncode == 0, proc.stderr
    assert "WARNING: apex not installed" in proc.stdout and "served FP16_Optimizer" in proc.stdout
    assert "apex.contrib.multihead_attn is not provided by amp_patch" in proc.stderr
    assert "fused_layer_norm_cuda is not provided by amp_patch" in proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (
        "amp-patch run: 2 apex name(s) not served by amp_patch (the script may have run "
        "without them): apex.contrib.multihead_attn, fused_layer_norm_cuda")


@pytest.mark.slow
def test_run_propagates_exit_code(tmp_path):
    proc = _run(tmp_path, "import sys; sys.exit(3)")
    assert proc.returncode == 3


@pytest.mark.slow
def test_run_missing_script(tmp_path):
    from amp_patch.cli.options import UsageError
    from amp_patch.cli.run.command import run_script

    proc = subprocess.run([sys.executable, "-m", "amp_patch", "run", "no_such_script.py"],
                          capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 2 and "no such script: no_such_script.py" in proc.stderr
    with pytest.raises(UsageError, match="no such script"):
        run_script(str(tmp_path / "no_such_script.py"), [])


@pytest.mark.slow
def test_legacy_example_runs_unmodified_through_run(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "amp_patch", "run", str(ROOT / "examples" / "legacy_apex_train.py"),
         "--steps", "12"], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "step 0 loss" in proc.stdout and "step 11 loss" in proc.stdout
    assert "saved and restored checkpoint" in proc.stdout
    first = float(proc.stdout.split("step 0 loss ")[1].split()[0])
    final = float(proc.stdout.split("final loss ")[1].split()[0])
    assert final < first
    # The example is the Apex user's code: it imports apex, never amp_patch.
    source = (ROOT / "examples" / "legacy_apex_train.py").read_text()
    assert "from apex import amp" in source and "amp_patch" not in source.split('"""', 2)[2]
