"""``amp-patch compare``: every level runs in its own process and reports sane numbers."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from amp_patch.cli import compare, machine, rounds
from amp_patch.cli import main as cli_main
from amp_patch.cli import models

ROOT = Path(__file__).resolve().parent.parent
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _compare(tmp_path: Path, *args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ, COLUMNS="120")
    return subprocess.run([sys.executable, "-m", "amp_patch", "compare", *args],
                          cwd=cwd or tmp_path, env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_compare_all_levels_json_png_table(tmp_path):
    out = tmp_path / "out"
    proc = _compare(tmp_path, "--model", "mlp", "--steps", "5", "--batch-size", "32",
                    "--out", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads((out / "results.json").read_text())
    assert data["config"]["half_dtype"] == "bf16" and data["config"]["steps"] == 5
    assert list(data["levels"]) == ["O0", "O1", "O2", "O3", "autocast"]
    o0 = data["levels"]["O0"]
    for level, r in data["levels"].items():
        assert r["ok"] and r["error"] is None, level
        assert len(r["losses"]) == 5 and all(math.isfinite(v) for v in r["losses"])
        assert r["steps_per_s"] > 0 and r["speedup_vs_O0"] > 0
        assert r["peak_memory_bytes"] >= 0
        assert r["skipped_steps"] == 0  # bf16: nothing overflows
        assert r["final_loss_scale"] == 1.0  # bf16: static scale 1.0
        # Same seed, same data: every level starts from O0's loss, within bf16 rounding.
        assert abs(r["losses"][0] - o0["losses"][0]) < 0.05
        assert r["max_abs_loss_diff_vs_O0"] < 0.5
    assert o0["max_abs_loss_diff_vs_O0"] == 0.0 and o0["speedup_vs_O0"] == 1.0
    for r in data["levels"].values():  # 1 warm-up step, then 4 timed rounds of 1 step
        assert r["warmup_steps"] == 1 and len(r["round_steps_per_s"]) == 4
        low, high = r["steps_per_s_range"]
        assert low <= r["steps_per_s"] <= high
        assert len(r["round_peak_bytes"]) == 4
        assert r["peak_memory_bytes"] == max(r["round_peak_bytes"])
    machine = data["machine"]
    assert machine["cpu_model"] and machine["threads"] >= 1 and machine["cpus"] >= 1
    assert machine["torch"] == data["config"]["torch"]
    assert set(machine["cpu_half"]) >= {"bf16", "fp16", "host"}
    assert data["cpu_half_plan"]["half_dtype"] == "bf16"
    assert data["notes"][0].startswith("CPU half compute:")
    load = data["load"]
    assert len(load["load_before"]) == 3 and len(load["load_after"]) == 3
    assert isinstance(data["warnings"], list)
    assert (out / "compare.png").read_bytes()[:8] == PNG_MAGIC
    table = (out / "table.txt").read_text()
    for word in ("O0", "O1", "O2", "O3", "autocast", "steps/s", "speed-up", "peak mem", "skipped",
                 "load average", "bf16 native", "timed rounds"):
        assert word in table


FACTORY = """
import torch

CALLS = []

def make(device="cpu", seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Linear(8, 2).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    def batch_fn(step):
        g = torch.Generator().manual_seed(step)
        return torch.randn(4, 8, generator=g).to(device)
    def loss_fn(model, x):
        return model(x).float().pow(2).mean()
    return model, opt, batch_fn, loss_fn

def broken_under_o3(device="cpu", seed=0):
    import amp_patch.session as s
    model, opt, batch_fn, loss_fn = make(device, seed)
    def bad_loss(model, x):
        if s.current() is not None and s.current().props.opt_level == "O3":
            raise ValueError("this factory refuses O3")
        return loss_fn(model, x)
    return model, opt, batch_fn, bad_loss
"""


def test_compare_user_factory_and_json_plot_paths(tmp_path):
    (tmp_path / "user_models.py").write_text(textwrap.dedent(FACTORY))
    proc = _compare(tmp_path, "--model", "user_models:make", "--steps", "3", "--levels", "O0",
                    "autocast", "--json", "r.json", "--plot", "r.png")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads((tmp_path / "r.json").read_text())
    assert list(data["levels"]) == ["O0", "autocast"]
    assert all(r["ok"] and len(r["losses"]) == 3 for r in data["levels"].values())
    assert (tmp_path / "r.png").read_bytes()[:8] == PNG_MAGIC
    # 3 steps: 1 warm-up and 2 timed rounds, too few for a speed figure.
    for r in data["levels"].values():
        assert len(r["round_steps_per_s"]) == 2
        assert r["steps_per_s"] is None and r["speedup_vs_O0"] is None
    assert "n/a: a speed needs at least 3 timed rounds, this run had 2" in proc.stdout
    assert "CPU half compute:" in proc.stdout  # machine.cpu_half_banner, before the run


class _Levels(Exception):
    pass


@pytest.mark.parametrize("native, args, autocast", [
    ("bf16", [], True),
    ("none", [], False),
    ("none", ["--levels", "O0", "autocast"], True),
])
def test_compare_leaves_autocast_out_without_native_half(native, args, autocast, monkeypatch,
                                                         capsys):
    """amp_patch emulates its own levels on such a CPU; torch.autocast it cannot."""
    monkeypatch.setenv("AMP_PATCH_CPU_HALF_NATIVE", native)

    def stop(job, levels, *rest):
        raise _Levels(levels)

    monkeypatch.setattr(compare, "run_compare", stop)
    with pytest.raises(_Levels) as exc:
        cli_main.main(["compare", "--model", "mlp", "--device", "cpu", *args])
    assert ("autocast" in exc.value.args[0]) == autocast
    out = capsys.readouterr().out
    assert ("torch.autocast is left out" in out) == (not autocast)
    assert "CPU half compute:" in out


def test_compare_failing_level_exits_nonzero_and_shows_error(tmp_path):
    (tmp_path / "user_models.py").write_text(textwrap.dedent(FACTORY))
    proc = _compare(tmp_path, "--model", "user_models:broken_under_o3", "--steps", "2",
                    "--levels", "O0", "O3", "--json", "r.json")
    assert proc.returncode == 1
    assert "this factory refuses O3" in proc.stdout
    data = json.loads((tmp_path / "r.json").read_text())
    assert data["levels"]["O0"]["ok"]  # the other level still ran
    assert not data["levels"]["O3"]["ok"] and "refuses O3" in data["levels"]["O3"]["error"]


def test_compare_invalid_level_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exc:
        cli_main.main(["compare", "--levels", "O4"])
    assert exc.value.code != 0
    assert "O4" in capsys.readouterr().err


def test_compare_bad_model_path_exits_2_before_any_process(tmp_path):
    proc = _compare(tmp_path, "--model", "nosuchmodule_xyz:make", "--steps", "1", "--levels", "O0")
    assert proc.returncode == 2
    assert "cannot import module 'nosuchmodule_xyz'" in proc.stderr
    assert "pkg.module:factory" in proc.stderr and "factory(device=" in proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout == ""


@pytest.fixture
def no_workers(monkeypatch):
    """Fail the test if any level process would start."""
    def refuse(self):
        raise AssertionError("a level process was started")

    monkeypatch.setattr(rounds.LevelPool, "start", refuse)


@pytest.mark.parametrize("args, message", [
    (["--model", "resnet"], "expected a built-in model (lm, mlp, convnet) or pkg.module:factory"),
    (["--model", "user_models:nope"], "module 'user_models' has no attribute 'nope'"),
    (["--model", "user_models:needs_x"], "the factory needs_x(x, device='cpu') needs x"),
    (["--model", "user_models:NOT_CALLABLE"], "is not callable"),
    (["--device", "cuda"], "CUDA is not available"),
    (["--device", "cuda:7"], "--device 'cuda:7'"),
    (["--device", "gpu0"], "expected cpu, cuda or cuda:N"),
    (["--device", "mps"], "mps is not supported"),
    (["--out", "a_file.txt"], "names a file; expected a directory"),
    (["--out", "a_file.txt/sub"], "cannot create the directory"),
    (["--json", "."], "--json .: names a directory"),
    (["--levels", "O4"], "invalid level 'O4'"),
    (["--levels"], "expected at least one argument"),
    (["--steps", "0"], "--steps must be at least 1"),
    (["--rounds", "0"], "--rounds must be at least 1"),
    (["--steps", "5", "--warmup", "5"], "--warmup must be at least 0 and less than --steps (5)"),
    (["--batch-size", "0"], "--batch-size must be at least 1"),
    (["--half-dtype", "fp8"], "invalid choice: 'fp8'"),
])
def test_compare_usage_errors_exit_2(args, message, tmp_path, monkeypatch, capsys, no_workers):
    if args[:1] == ["--device"] and args[1].startswith("cuda") and torch.cuda.device_count() > 7:
        pytest.skip("this machine has that CUDA device")
    (tmp_path / "user_models.py").write_text(textwrap.dedent(FACTORY) + textwrap.dedent("""
        NOT_CALLABLE = 3

        def needs_x(x, device="cpu"):
            return make(device)
    """))
    (tmp_path / "a_file.txt").write_text("")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [str(tmp_path), *sys.path])
    with pytest.raises(SystemExit) as exc:
        cli_main.main(["compare", *args])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert message in err, err
    assert "usage: amp-patch compare" in err
    sys.modules.pop("user_models", None)


def test_compare_plain_progress_lines_when_not_a_terminal(tmp_path):
    (tmp_path / "user_models.py").write_text(textwrap.dedent(FACTORY))
    proc = _compare(tmp_path, "--model", "user_models:make", "--steps", "4", "--levels", "O0", "O2",
                    "--progress-interval", "0")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    for level in ("O0", "O2"):
        steps = [ln for ln in lines if ln.startswith(f"compare: {level} step ")]
        assert len(steps) == 4, lines
        assert re.fullmatch(rf"compare: {level} step 4/4 loss [0-9.]+ elapsed [0-9.]+ s", steps[-1])
        assert f"compare: {level} ready" in lines
    assert not any("\x1b[" in ln for ln in lines)  # no terminal control codes in a log


@pytest.mark.parametrize("name", sorted(models.BUILTIN))
def test_builtin_factories_are_deterministic(name):
    kwargs = {"batch_size": 2}
    if name == "lm":
        kwargs.update(vocab=64, d_model=32, n_layers=1, n_heads=2, seq_len=8)
    a = models.BUILTIN[name](**kwargs)
    b = models.BUILTIN[name](**kwargs)
    for pa, pb in zip(a.model.parameters(), b.model.parameters()):
        assert pa.equal(pb)
    batch_a, batch_b = a.batch_fn(3), b.batch_fn(3)
    flat = lambda x: x if isinstance(x, tuple) else (x,)  # noqa: E731
    assert all(u.equal(v) for u, v in zip(flat(batch_a), flat(batch_b)))
    assert not all(u.equal(v) for u, v in zip(flat(a.batch_fn(4)), flat(batch_a)))
    loss = a.loss_fn(a.model, batch_a)
    assert loss.dim() == 0 and loss.requires_grad


def test_bench_lm_has_about_21m_params():
    w = models.lm(config=models.BENCH_LM)
    assert 20e6 < models.parameter_count(w.model) < 22e6


def test_lm_optimizer_choices():
    from amp_patch.optimizers import FusedAdam

    tiny = dict(vocab=64, d_model=32, n_layers=1, n_heads=2, seq_len=8, batch_size=2)
    assert isinstance(models.lm(fused_adam=True, **tiny).optimizer, FusedAdam)
    assert models.lm(fused=True, **tiny).optimizer.defaults["fused"] is True
    with pytest.raises(ValueError, match="choose one"):
        models.lm(fused=True, fused_adam=True, **tiny)


def test_level_models_build_another_workload_for_some_levels():
    spec = rounds.JobSpec("mlp", batch_size=4, level_models=(("O2", "convnet"),))
    records = rounds.measure(spec, ["O0", "O2"], warmup=1, rounds=[])
    first = models.build(models.BUILTIN["convnet"], batch_size=4)
    first_loss = first.loss_fn(first.model, first.batch_fn(0)).item()
    assert records["O2"].losses[0] == pytest.approx(first_loss, rel=0.05)
    assert records["O0"].losses[0] != pytest.approx(first_loss, rel=0.05)


def test_resolve_rejects_unknown_names():
    with pytest.raises(ValueError, match="built-in name"):
        models.resolve("resnet")


def test_help_has_examples():
    proc = subprocess.run([sys.executable, "-m", "amp_patch", "--help"], capture_output=True,
                          text=True, cwd=ROOT)
    assert proc.returncode == 0
    for word in ("compare", "run", "bench", "examples:"):
        assert word in proc.stdout


def test_split_steps_and_spread():
    assert rounds.split_steps(10, 4) == [3, 3, 2, 2]
    assert rounds.split_steps(2, 8) == [1, 1]
    assert rounds.split_steps(0, 8) == []
    assert machine.relative_spread([1.0]) is None
    assert machine.relative_spread([9.0, 10.0, 12.0]) == pytest.approx(0.3)


def test_speeds_need_three_rounds_and_ratios_pair_rounds():
    record = rounds.LevelRecord("O2", round_steps=[2, 2], round_seconds=[1.0, 0.5])
    assert compare.LevelResult.from_record(record).steps_per_s is None
    base = rounds.LevelRecord("O0", round_steps=[2, 2, 2], round_seconds=[1.0, 2.0, 1.0])
    fast = rounds.LevelRecord("O2", round_steps=[2, 2, 2], round_seconds=[0.5, 1.0, 0.25])
    results = [compare.LevelResult.from_record(r) for r in (base, fast)]
    compare._derive(results)
    assert results[0].steps_per_s == 2.0 and results[0].steps_per_s_range == [1.0, 2.0]
    # Round by round, O2 was 2x, 2x and 4x O0: a slow round for both is no spread of the ratio.
    assert results[1].speedup_vs_O0 == 2.0 and results[1].speedup_range == [2.0, 4.0]


def test_host_line_gives_the_cpu_half_verdict():
    # The verdict is cpu_half_support()'s (oneDNN and the probe), not oneDNN's check alone.
    from amp_patch import cpu_half

    for native, word in ((False, "not native"), (True, "native")):
        with cpu_half.override(bfloat16=native):
            facts = machine.HostFacts.collect("cpu")
            assert f"bf16 {word}," in facts.line()
            assert facts.cpu_half["bf16"]["native"] is native
            assert facts.cpu_model == cpu_half.cpu_half_support().cpu


def test_reliability_warnings():
    # The load average after a run counts the run's own processes: no warning from it.
    quiet = machine.LoadMonitor(load_before=[0.1, 0.1, 0.1], load_after=[1.9, 0.5, 0.2],
                                others_share=0.02)
    assert machine.reliability_warnings(quiet, {"O2 steps/s": 0.05, "O2/O0": 0.1}, cpus=2) == []
    busy = machine.LoadMonitor(load_before=[1.8, 1.0, 0.5], load_after=[0.5, 0.5, 0.5],
                               others_share=0.4)
    warnings = machine.reliability_warnings(busy, {"O2 steps/s": 0.6, "O1/O0": None}, cpus=2)
    assert len(warnings) == 3
    assert "busy before the run: 1-minute load average 1.80" in warnings[0]
    assert "other processes took 40%" in warnings[1]
    assert "O2 steps/s 60%" in warnings[2]


def test_load_monitor_counts_other_processes():
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        monitor = machine.LoadMonitor().start()
        deadline = time.perf_counter() + 1.5
        while time.perf_counter() < deadline:
            pass  # this process's own work is not counted as others'
        monitor.stop()
    finally:
        busy.kill()
        busy.wait()
    if monitor.others_share is None:
        pytest.skip("no /proc/stat here")
    # The busy loop had up to a whole CPU of the machine's; this process's spin is its own.
    assert monitor.others_share >= 0.2 / machine.cpu_count()


@pytest.mark.slow
def test_compare_warns_under_injected_load(tmp_path):
    # reliability_warnings' rules are test_reliability_warnings'; this checks that compare
    # measures the load and reports it. Busy loops on half the CPUs take ~50% of the machine,
    # well over the 20% limit, and leave the other half to compare.
    (tmp_path / "user_models.py").write_text(textwrap.dedent(FACTORY))
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
            for _ in range(max(1, machine.cpu_count() // 2))]
    try:
        proc = _compare(tmp_path, "--model", "user_models:make", "--steps", "4",
                        "--levels", "O0", "O3", "--json", "r.json")
    finally:
        for p in busy:
            p.kill()
            p.wait()
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Speed ratios unreliable" in proc.stdout
    assert "other processes took" in proc.stdout
    data = json.loads((tmp_path / "r.json").read_text())
    assert any("other processes took" in w for w in data["warnings"])
    assert data["load"]["others_share"] > machine.OTHERS_SHARE_LIMIT
