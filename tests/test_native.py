"""Loading amp_patch._C for the running torch: build record, mismatch warning, JIT build.

A mismatch is simulated in a subprocess by giving torch another commit
(``torch.version.git_version``) before amp_patch is imported: the prebuilt
library's build record then names another torch, as after ``pip install
torch==<other>`` under an installed amp_patch.
"""

from __future__ import annotations

import json
import re
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from amp_patch import _buildspec, _native, ops

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Runs in a fresh interpreter: logs at INFO as "LEVEL message" on stderr, fakes another torch
# commit when FAKE_TORCH_GIT is set, prints the outcome as JSON on stdout.
_PROBE = textwrap.dedent("""
    import json, logging, os, sys
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s", stream=sys.stderr)
    import torch
    if os.environ.get("FAKE_TORCH_GIT"):
        torch.version.git_version = os.environ["FAKE_TORCH_GIT"]
    from amp_patch import _native, ops
    s = _native.status()
    x = [torch.full((1000,), 2.0), torch.tensor([float("inf")])]
    found = torch.zeros(1)
    ops.multi_tensor_unscale_(x, found, torch.full((1,), 0.5))
    print(json.dumps({"source": s.source, "reason": s.reason, "path": s.path,
                      "native_cpu": ops.has_native_kernel("cpu"),
                      "loaded": ops.native_extension_loaded(),
                      "cast_wrapper": __import__("amp_patch.patching.wrappers",
                                                 fromlist=["x"])._CastWrapper is not None,
                      "ok": bool(found.item() == 1.0 and x[0][0].item() == 1.0)}))
""")


def _probe(tmp_path, **env) -> tuple[dict, list[str]]:
    full = dict(os.environ, AMP_PATCH_CACHE=str(tmp_path / "cache"), PYTHONPATH=ROOT, **env)
    full.pop("AMP_PATCH_NO_EXT", None)
    proc = subprocess.run([sys.executable, "-c", _PROBE], env=full, capture_output=True,
                          text=True, timeout=1500, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr.splitlines()


def _warnings(lines: list[str]) -> list[str]:
    return [line for line in lines if line.startswith("WARNING ")]


def _needs_prebuilt() -> None:
    if _native.status().source != "prebuilt" or _native.status().record is None:
        pytest.skip("needs amp_patch._C built at install time with its build record "
                    f"(make install); here: {_native.status().source}")


def test_extension_spec_links_the_isa_builds_last_in_order():
    spec = _buildspec.extension_spec(torch, os.path.join(ROOT, "csrc"), None)
    isa = [os.path.basename(p) for p in spec.sources[-3:]]
    assert isa == ["default.cpp", "avx2.cpp", "avx512.cpp"]
    assert os.path.join(ROOT, "csrc", "init.cpp") in spec.sources
    assert "-ffp-contract=off" in spec.cxx_flags and "-O3" in spec.cxx_flags
    assert ("-fopenmp" in spec.cxx_flags) == (torch._C.has_openmp and sys.platform == "linux")
    assert not spec.with_cuda and not any(p.endswith(".cu") for p in spec.sources)


def test_extension_spec_refuses_a_directory_without_sources(tmp_path):
    with pytest.raises(FileNotFoundError, match="init.cpp"):
        _buildspec.extension_spec(torch, str(tmp_path), None)


def test_build_record_names_the_running_torch():
    record = _buildspec.build_record(torch, False)
    assert record["torch"] == torch.__version__
    assert record["cxx11_abi"] == bool(torch._C._GLIBCXX_USE_CXX11_ABI)
    assert record["cuda"] == torch.version.cuda
    assert set(_buildspec.RECORD_KEYS) <= set(record)


def test_prebuilt_library_carries_a_matching_record():
    _needs_prebuilt()
    status = _native.status()
    assert ops.native_extension_loaded()
    assert not _native._mismatch(status.record, _buildspec.build_record(torch, False))
    assert os.path.dirname(status.path) == os.path.dirname(os.path.abspath(_native.__file__))


def test_cache_dir_is_per_torch(monkeypatch, tmp_path):
    monkeypatch.setenv("AMP_PATCH_CACHE", str(tmp_path))
    here = _native.jit_build_dir(False)
    assert here.startswith(str(tmp_path)) and torch.__version__.replace("+", "_") in here
    assert _native.jit_build_dir(True) != here
    monkeypatch.setattr(torch.version, "git_version", "f" * 40)
    assert _native.jit_build_dir(False) != here


def test_cache_root_follows_xdg(monkeypatch, tmp_path):
    monkeypatch.delenv("AMP_PATCH_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert _native.cache_root() == os.path.join(str(tmp_path), "amp_patch")


@pytest.mark.slow
@pytest.mark.parametrize("env, why", [
    ({"AMP_PATCH_JIT": "0"}, "AMP_PATCH_JIT=0"),
    ({"CXX": "/nonexistent/c++"}, "no C++ compiler"),
])
def test_mismatch_without_jit_warns_once_and_uses_the_reference(tmp_path, env, why):
    _needs_prebuilt()
    out, err = _probe(tmp_path, FAKE_TORCH_GIT="0" * 40, **env)
    warnings = _warnings(err)
    assert len(warnings) == 1, err
    assert "was built for" in warnings[0] and why in warnings[0] and "Fix:" in warnings[0]
    assert out["source"] == "reference" and not out["loaded"] and not out["native_cpu"]
    assert not out["cast_wrapper"]
    assert out["ok"]
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").iterdir())


@pytest.mark.slow
def test_mismatch_rebuilds_once_for_the_running_torch(tmp_path):
    """Two processes meet a stale _C at once: one compiles, the other waits; both go native."""
    _needs_prebuilt()
    env = dict(os.environ, AMP_PATCH_CACHE=str(tmp_path / "cache"), PYTHONPATH=ROOT,
               FAKE_TORCH_GIT="0" * 40, MAX_JOBS=os.environ.get("MAX_JOBS", "2"))
    env.pop("AMP_PATCH_NO_EXT", None)
    procs = [subprocess.Popen([sys.executable, "-c", _PROBE], env=env, cwd=ROOT, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for _ in range(2)]
    results = [p.communicate(timeout=1800) for p in procs]
    for p, (out, err) in zip(procs, results):
        assert p.returncode == 0, err[-4000:]
    outs = [json.loads(out.strip().splitlines()[-1]) for out, _ in results]
    errs = [err.splitlines() for _, err in results]
    for out, err in zip(outs, errs):
        assert len(_warnings(err)) == 1, err
        assert "was built for" in _warnings(err)[0]
        assert out["source"] == "jit" and out["loaded"] and out["native_cpu"], out
        assert out["cast_wrapper"] and out["ok"]
        assert out["path"].startswith(str(tmp_path / "cache"))
    compiled = [line for err in errs for line in err if "kernels compiled in" in line]
    assert len(compiled) == 1, errs  # the lock: one process compiled, the other found its build

    # The next process loads the cached build without compiling; the stale _C is still named.
    out, err = _probe(tmp_path, FAKE_TORCH_GIT="0" * 40)
    assert out["source"] == "jit" and out["native_cpu"] and out["ok"]
    warnings = _warnings(err)
    assert len(warnings) == 1 and "using the kernels compiled for this torch" in warnings[0]
    assert not any("compiling" in line for line in err)


def test_kernel_checks_build_their_messages_without_streams():
    """Every check in csrc/ is an AMP_CHECK (csrc/check.h): no stream formats a message.

    With a C++ runtime linked into amp_patch._C, a stream that printed a number crashed the
    process instead of raising (H200 image, torch 2.11). tests/ops/test_ops.py checks the text.
    """
    offenders = []
    for folder, _, files in os.walk(os.path.join(ROOT, "csrc")):
        for name in files:
            if name == "check.h" or not name.endswith((".h", ".cpp", ".cu", ".cuh")):
                continue
            path = os.path.join(folder, name)
            with open(path) as f:
                for number, line in enumerate(f, 1):
                    if any(s in line for s in ("TORCH_CHECK(", "c10::str(", "stringstream")):
                        offenders.append(f"{os.path.relpath(path, ROOT)}:{number}: {line.strip()}")
    assert not offenders, "\n".join(offenders)



def test_the_sources_stay_within_cplusplus17():
    # torch 2.11 and older compile the extension as C++17 (torch 2.14's helper picks C++20, and
    # `make check-cuda` builds against it), so a C++20 construct would build here and fail there.
    root = os.path.join(os.path.dirname(_buildspec.__file__), os.pardir, "csrc")
    cxx20 = re.compile(r"\brequires\s*[({]|\bconcept\s+\w+\s*=|\bconsteval\b|<=>|\bco_(await|yield|return)\b"
                       r"|#include\s*<(span|concepts|ranges|bit|numbers)>")
    found = []
    for folder, _, names in os.walk(root):
        for name in names:
            if name.endswith((".h", ".cpp", ".cu", ".cuh")):
                path = os.path.join(folder, name)
                with open(path, encoding="utf-8") as f:
                    for number, line in enumerate(f, 1):
                        code = line.split("//")[0]
                        if cxx20.search(code):
                            found.append(f"{os.path.relpath(path, root)}:{number}: {line.strip()}")
    assert not found, "C++20 in csrc (torch 2.11 builds C++17):\n" + "\n".join(found)
