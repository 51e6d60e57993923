"""The import graph of amp_patch goes one way: tools/check_imports.py finds no upward import
and no cycle (TYPE_CHECKING imports counted), and it does find them when one is injected."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TOOL = ROOT / "tools" / "check_imports.py"


def _load_tool():
    spec = importlib.util.spec_from_file_location("check_imports", TOOL)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while building
    spec.loader.exec_module(module)
    return module


check_imports = _load_tool()


@pytest.fixture
def package_copy(tmp_path: Path) -> Path:
    """The package's Python files, copied where a test may break them."""
    dest = tmp_path / "amp_patch"
    shutil.copytree(ROOT / "amp_patch", dest, ignore=shutil.ignore_patterns(
        "*.so", "*.pyd", "__pycache__"))
    return dest


def test_the_package_imports_one_way_without_cycles():
    assert check_imports.check(ROOT / "amp_patch") == []


@pytest.mark.slow
def test_the_script_passes_from_the_command_line():
    done = subprocess.run([sys.executable, str(TOOL)], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.slow
def test_an_upward_import_fails(package_copy: Path):
    target = package_copy / "helpers" / "tensors.py"
    target.write_text(target.read_text() + "\nfrom amp_patch import session\n")
    problems = check_imports.check(package_copy)
    assert any("amp_patch.helpers.tensors (helpers) imports amp_patch.session (session)" in p
               for p in problems), problems
    done = subprocess.run([sys.executable, str(TOOL), str(package_copy)],
                          capture_output=True, text=True)
    assert done.returncode == 1 and "higher layer" in done.stdout


def test_an_upward_import_inside_a_function_fails(package_copy: Path):
    target = package_copy / "scaler.py"
    target.write_text(target.read_text()
                      + "\n\ndef _late():\n    from amp_patch.frontend.lifecycle import initialize\n")
    problems = check_imports.check(package_copy)
    assert any("amp_patch.scaler (scaler) imports amp_patch.frontend.lifecycle" in p for p in problems)


def test_a_type_checking_cycle_fails(package_copy: Path):
    # Allowed by the layer rule (typing only), but it closes a circle with session.py's imports.
    target = package_copy / "scaler.py"
    target.write_text(target.read_text()
                      + "\nfrom typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                        "    from amp_patch.session import AmpSession\n")
    problems = check_imports.check(package_copy)
    assert not any("higher layer" in p for p in problems), problems
    assert any(p.startswith("import cycle:") and "amp_patch.scaler" in p
               and "amp_patch.session" in p for p in problems), problems


def test_a_relative_import_is_resolved(package_copy: Path):
    target = package_copy / "optim" / "amp" / "master_weights.py"
    target.write_text(target.read_text() + "\nfrom ...patching import state\n")
    problems = check_imports.check(package_copy)
    assert any("amp_patch.optim.amp.master_weights (optimizers) imports "
               "amp_patch.patching.state (patching)" in p for p in problems), problems


def test_a_module_in_the_folder_of_another_layer_fails(package_copy: Path, monkeypatch):
    (package_copy / "patching" / "stray.py").write_text("import torch\n")
    layers = tuple((name, patterns + ("amp_patch.patching.stray",) if name == "front end"
                    else patterns) for name, patterns in check_imports.LAYERS)
    monkeypatch.setattr(check_imports, "LAYERS", layers)
    problems = check_imports.check(package_copy)
    assert any("amp_patch.patching.stray (front end) sits in the folder of another layer" in p
               for p in problems), problems


def test_a_module_outside_every_layer_fails(package_copy: Path):
    (package_copy / "stray.py").write_text("import torch\n")
    problems = check_imports.check(package_copy)
    assert any("amp_patch.stray is in no layer" in p for p in problems), problems


@pytest.mark.parametrize("module, layer", [
    ("amp_patch.helpers.tensors", "helpers"),
    ("amp_patch.settings.properties", "settings"),
    ("amp_patch.optim.amp.larc", "optimizers"),
    ("amp_patch.optimizers", "public names"),
    ("amp_patch._native", "build"),
    ("amp_patch.casting.fsdp", "model casting"),
    ("amp_patch.patching.state", "patching"),
    ("amp_patch.apex_compat.larc", "apex_compat"),
    ("amp_patch", "public names"),
    ("amp_patch.cli.compare", "cli"),
])
def test_layers_are_looked_up_by_the_longest_pattern(module: str, layer: str):
    assert check_imports.LAYERS[check_imports.layer_of(module)][0] == layer
