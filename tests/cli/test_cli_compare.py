"""``amp-patch compare``: every level runs in its own process and reports sane numbers."""

from __future__ import annotations

import io
import json
import math
import os
import re
import subprocess
import sys
import textwrap
import time
from collections import namedtuple
from pathlib import Path

import pytest
import torch

from rich.console import Console

from amp_patch.patching import cpu_half
from amp_patch.settings import levels
from amp_patch.cli import compare, host_facts
from amp_patch.cli.compare import data_parallel, round_robin, trainer
from amp_patch.cli.compare import command
from amp_patch.cli.compare import results as compare_results
from amp_patch.cli import main as cli_main
from amp_patch.cli.compare import models
from amp_patch.cli.options import UsageError
from amp_patch.casting.fsdp import cpu_fsdp_supported

ROOT = Path(__file__).resolve().parents[2]
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
    # Apex's levels, the lean preset (mlp builds FusedAdam for it), then torch.autocast where
    # the host's detection, as the run recorded it, lets it finish in time (docs/compare.md).
    host = host_facts.HostFacts(**data["machine"])
    cost = host_facts.autocast_cost(host, "bf16")
    assert list(data["levels"]) == [*levels.NAMES, "O2-lean", "O2+fp8",
                                    *(["autocast"] if cost.included else [])]
    assert list(trainer.PRESETS) == ["O2-lean", "O2+fp8"]
    assert data["config"]["presets"] == {
        "O2-lean": {"opt_level": "O2", "optimizer_state": "int8", "master_weights": "bf16"},
        "O2+fp8": {"opt_level": "O2",
                   "fp8": "tensorwise, format hybrid, margin 0, min_features 16"}}
    o0 = data["levels"]["O0"]
    for level, r in data["levels"].items():
        assert r["ok"] and r["error"] is None and r["unavailable"] is None, level
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
    verdict = "bf16 native" if machine["cpu_half"]["bf16"]["native"] else "bf16 not native"
    for word in ("O0", "O1", "O2", "O3", "O2-lean", "steps/s", "speed-up", "peak mem",
                 "skipped", "load average", verdict, "timed rounds",
                 "O2-lean: O2 with block-scaled int8 optimizer state"):
        assert word in table
    assert ("autocast" in table) == cost.included
    # Where autocast ran at a cost, its caption line says the measured factor.
    assert ("autocast: torch's own, not emulated" in table) == (cost.included
                                                               and cost.kind != "native")


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


@pytest.mark.slow
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
    assert "CPU half compute:" in proc.stdout  # host_facts.cpu_half_banner, before the run


class _Levels(Exception):
    pass


#: One answer per host kind (docs/install.md, "CPU host kinds"), as the detection gives it: a
#: native host, the conv-only host of docs/install.md (2.8x), one whose emulation is too slow for
#: the run, and one where oneDNN has no bf16.
KIND_ANSWERS = {
    "native": cpu_half.DtypeSupport(True, True, True, matmul_ratio=0.5, conv_ratio=0.6),
    "conv-only": cpu_half.DtypeSupport(True, False, True, matmul_ratio=2.8, conv_ratio=1.9),
    "conv-only-slow": cpu_half.DtypeSupport(True, False, False, matmul_ratio=9.5, conv_ratio=6.0),
    "none": cpu_half.DtypeSupport(False, False, False),
}


@pytest.mark.parametrize("answer, args, autocast, says", [
    ("native", [], True, None),
    ("conv-only", [], True, "take 2.8x fp32's time"),
    ("conv-only-slow", [], False, "take 9.5x fp32's time"),
    ("none", [], False, "ATen's slow path"),
    ("none", ["--levels", "O0", "autocast"], True, "ATen's slow path"),
])
def test_compare_includes_autocast_where_it_can_finish(answer, args, autocast, says,
                                                       monkeypatch, capsys):
    """amp_patch emulates its own levels on a host without native half; torch.autocast it
    cannot, so compare runs it by default where its measured cost fits, and says that cost."""
    def stop(job, levels, *rest):
        raise _Levels(levels)

    monkeypatch.setattr(command, "run_compare", stop)
    with cpu_half.override(bfloat16=KIND_ANSWERS[answer]):
        with pytest.raises(_Levels) as exc:
            cli_main.main(["compare", "--model", "mlp", "--device", "cpu", *args])
        cost = host_facts.autocast_cost(host_facts.HostFacts.collect("cpu"), "bf16")
    assert ("autocast" in exc.value.args[0]) == autocast
    assert cost.included == (autocast and not args)
    out = " ".join(capsys.readouterr().out.replace("│", " ").split())
    assert ("torch.autocast is left out" in out) == (not autocast)
    assert "CPU half compute:" in out and "many times" not in out
    if says is None:
        assert "torch.autocast's" not in out
    else:
        assert says in out


def test_compare_leaves_autocast_out_when_forced_not_native(monkeypatch, capsys):
    """AMP_PATCH_CPU_HALF_NATIVE=none forces the none kind: nothing was measured."""
    monkeypatch.setenv("AMP_PATCH_CPU_HALF_NATIVE", "none")

    def stop(job, levels, *rest):
        raise _Levels(levels)

    monkeypatch.setattr(command, "run_compare", stop)
    with pytest.raises(_Levels) as exc:
        cli_main.main(["compare", "--model", "mlp", "--device", "cpu"])
    assert "autocast" not in exc.value.args[0]
    assert "torch.autocast is left out" in capsys.readouterr().out


@pytest.mark.slow
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


@pytest.mark.slow
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

    monkeypatch.setattr(round_robin.LevelPool, "start", refuse)


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
    (["--nproc", "0"], "--nproc must be at least 1 (ranks per level), got 0"),
    (["--nproc", "-2"], "--nproc must be at least 1 (ranks per level), got -2"),
    (["--strategy", "zero"], "invalid choice: 'zero'"),
    # --device cpu: on a GPU machine the default device is CUDA, whose rank check comes first.
    (["--nproc", "3", "--device", "cpu"], "--nproc 3: the global batch of 8 (the default of --model lm) does not "
                       "split evenly over 3 ranks; expected a --batch-size that is a multiple "
                       "of 3"),
    (["--nproc", "2", "--device", "cpu", "--batch-size", "5"], "the global batch of 5 (--batch-size) does not split"),
    (["--nproc", "2", "--device", "cpu", "--model", "user_models:odd_batch"],
     "the global batch of 7 (the default of --model user_models:odd_batch) does not split"),
    (["--nproc", "2", "--device", "cuda"], "CUDA is not available"),
])
def test_compare_usage_errors_exit_2(args, message, tmp_path, monkeypatch, capsys, no_workers):
    if args[:1] == ["--device"] and args[1].startswith("cuda") and torch.cuda.device_count() > 7:
        pytest.skip("this machine has that CUDA device")
    if message == "CUDA is not available":  # on any machine, GPU or not
        monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    (tmp_path / "user_models.py").write_text(textwrap.dedent(FACTORY) + textwrap.dedent("""
        NOT_CALLABLE = 3

        def needs_x(x, device="cpu"):
            return make(device)

        def odd_batch(device="cpu", batch_size=7):
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


@pytest.mark.slow
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
    from amp_patch.optim.fused import FusedAdam

    tiny = dict(vocab=64, d_model=32, n_layers=1, n_heads=2, seq_len=8, batch_size=2)
    assert isinstance(models.lm(fused_adam=True, **tiny).optimizer, FusedAdam)
    assert models.lm(fused=True, **tiny).optimizer.defaults["fused"] is True
    with pytest.raises(ValueError, match="choose one"):
        models.lm(fused=True, fused_adam=True, **tiny)


@pytest.mark.slow
def test_level_models_build_another_workload_for_some_levels():
    spec = round_robin.JobSpec("mlp", batch_size=4, level_models=(("O2", "convnet"),))
    records = round_robin.measure(spec, ["O0", "O2"], warmup=1, rounds=[])
    first = models.build(models.BUILTIN["convnet"], batch_size=4)
    first_loss = first.loss_fn(first.model, first.batch_fn(0)).item()
    assert records["O2"].losses[0] == pytest.approx(first_loss, rel=0.05)
    assert records["O0"].losses[0] != pytest.approx(first_loss, rel=0.05)


def test_resolve_rejects_unknown_names():
    with pytest.raises(ValueError, match="built-in name"):
        models.resolve("resnet")


@pytest.mark.slow
def test_help_has_examples():
    proc = subprocess.run([sys.executable, "-m", "amp_patch", "--help"], capture_output=True,
                          text=True, cwd=ROOT)
    assert proc.returncode == 0
    for word in ("compare", "run", "bench", "examples:"):
        assert word in proc.stdout


def test_split_steps_and_spread():
    assert round_robin.split_steps(10, 4) == [3, 3, 2, 2]
    assert round_robin.split_steps(2, 8) == [1, 1]
    assert round_robin.split_steps(0, 8) == []
    assert host_facts.relative_spread([1.0]) is None
    assert host_facts.relative_spread([9.0, 10.0, 12.0]) == pytest.approx(0.3)


def test_speeds_need_three_rounds_and_ratios_pair_rounds():
    record = round_robin.LevelRecord("O2", round_steps=[2, 2], round_seconds=[1.0, 0.5])
    assert compare.LevelResult.from_record(record).steps_per_s is None
    base = round_robin.LevelRecord("O0", round_steps=[2, 2, 2], round_seconds=[1.0, 2.0, 1.0])
    fast = round_robin.LevelRecord("O2", round_steps=[2, 2, 2], round_seconds=[0.5, 1.0, 0.25])
    results = [compare.LevelResult.from_record(r) for r in (base, fast)]
    compare_results.derive(results)
    assert results[0].steps_per_s == 2.0 and results[0].steps_per_s_range == [1.0, 2.0]
    # Round by round, O2 was 2x, 2x and 4x O0: a slow round for both is no spread of the ratio.
    assert results[1].speedup_vs_O0 == 2.0 and results[1].speedup_range == [2.0, 4.0]


def test_host_line_gives_the_cpu_half_verdict():
    # The verdict is cpu_half_support()'s (oneDNN and the probe), not oneDNN's check alone.
    from amp_patch.patching import cpu_half

    for native, word in ((False, "not native"), (True, "native")):
        with cpu_half.override(bfloat16=native):
            facts = host_facts.HostFacts.collect("cpu")
            assert f"bf16 {word}," in facts.line()
            assert facts.cpu_half["bf16"]["native"] is native
            assert facts.cpu_model == cpu_half.cpu_half_support().cpu


def test_reliability_warnings():
    # The load average after a run counts the run's own processes: no warning from it.
    quiet = host_facts.LoadMonitor(load_before=[0.1, 0.1, 0.1], load_after=[1.9, 0.5, 0.2],
                                others_share=0.02)
    assert host_facts.reliability_warnings(quiet, {"O2 steps/s": 0.05, "O2/O0": 0.1}, cpus=2) == []
    busy = host_facts.LoadMonitor(load_before=[1.8, 1.0, 0.5], load_after=[0.5, 0.5, 0.5],
                               others_share=0.4)
    warnings = host_facts.reliability_warnings(busy, {"O2 steps/s": 0.6, "O1/O0": None}, cpus=2)
    assert len(warnings) == 3
    assert "busy before the run: 1-minute load average 1.80" in warnings[0]
    assert "other processes took 40%" in warnings[1]
    assert "O2 steps/s 60%" in warnings[2]
    crowded = host_facts.reliability_warnings(quiet, {}, cpus=2, ranks=3)
    assert crowded == [host_facts.oversubscribed(3, 2)] and "3 ranks per level on 2 CPUs" in crowded[0]
    assert host_facts.oversubscribed(2, 2) is None


@pytest.mark.slow
def test_load_monitor_counts_other_processes():
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        monitor = host_facts.LoadMonitor().start()
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
    assert monitor.others_share >= 0.2 / host_facts.cpu_count()


@pytest.mark.slow
def test_compare_warns_under_injected_load(tmp_path):
    # reliability_warnings' rules are test_reliability_warnings'; this checks that compare
    # measures the load and reports it. Busy loops on half the CPUs take ~50% of the machine,
    # well over the 20% limit, and leave the other half to compare.
    (tmp_path / "user_models.py").write_text(textwrap.dedent(FACTORY))
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
            for _ in range(max(1, host_facts.cpu_count() // 2))]
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
    assert data["load"]["others_share"] > host_facts.OTHERS_SHARE_LIMIT


# --------------------------------------------------------------------------- --nproc


@pytest.mark.parametrize("args, strategy, nproc, crowded", [
    ([], None, 1, False),
    (["--nproc", "1"], None, 1, False),
    (["--nproc", "2"], "ddp", 2, False),
    (["--strategy", "fsdp2"], "fsdp2", 1, False),
    (["--nproc", "4", "--strategy", "fsdp2"], "fsdp2", 4, True),
])
def test_compare_nproc_picks_the_strategy_and_warns_of_more_ranks_than_cpus(
        args, strategy, nproc, crowded, monkeypatch, capsys):
    monkeypatch.setattr(host_facts, "cpu_count", lambda: 2)

    def stop(job, levels, *rest):
        raise _Levels(job)

    monkeypatch.setattr(command, "run_compare", stop)
    with pytest.raises(_Levels) as exc:
        cli_main.main(["compare", "--device", "cpu", *args])
    job = exc.value.args[0]
    assert (job["strategy"], job["nproc"]) == (strategy, nproc)
    out = capsys.readouterr().out
    assert ("more ranks than CPUs" in out) == crowded
    assert ("4 ranks per level on 2 CPUs" in out) == crowded


def test_compare_nproc_on_cuda_needs_a_gpu_per_rank(monkeypatch):
    # No GPU needed: the check reads the device count, which is faked here.
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    ns = cli_main.build_parser().parse_args(["compare", "--nproc", "2", "--device", "cuda:1"])
    with pytest.raises(UsageError, match="rank r takes GPU cuda:r; pass --device cuda"):
        command._check_ranks(ns, torch.device("cuda", 1))
    with pytest.raises(UsageError, match="NCCL needs a GPU per rank and 1 are visible"):
        command._check_ranks(ns, torch.device("cuda"))
    ns.nproc = 1  # one process per level: no rank takes a GPU of its own
    assert command._check_ranks(ns, torch.device("cuda", 1)) is None


def test_local_batch_splits_every_tensor_by_rows():
    Batch = namedtuple("Batch", "x y")
    batch = {"pair": (torch.arange(8).view(4, 2), torch.arange(4)), "scale": torch.tensor(2.0),
             "named": Batch(torch.zeros(4, 3), [torch.ones(4)]), "name": "kept"}
    half = data_parallel.local_batch(batch, rank=1, world=2)
    assert torch.equal(half["pair"][0], torch.tensor([[4, 5], [6, 7]]))
    assert torch.equal(half["pair"][1], torch.tensor([2, 3]))
    assert half["scale"].item() == 2.0 and half["name"] == "kept"
    assert isinstance(half["named"], Batch) and half["named"].x.shape == (2, 3)
    assert half["named"].y[0].shape == (2,)
    with pytest.raises(ValueError, match=r"shape \(4, 2\) has 4 rows, which do not split evenly "
                                         r"over 3 ranks"):
        data_parallel.local_batch(batch, rank=0, world=3)


def test_the_first_failed_rank_is_reported(tmp_path, monkeypatch):
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    monkeypatch.setenv("AMP_PATCH_RANK_CLAIMS", str(tmp_path))
    assert data_parallel.first_to_fail() and not data_parallel.first_to_fail()  # one claim per launch

    def failure(rank, exitcode, text=None):
        path = tmp_path / f"error{rank}.json"
        if text is not None:
            path.write_text(json.dumps({"message": {"message": text, "extraInfo": {
                "py_callstack": f"Traceback (most recent call last):\n{text}\n",
                "timestamp": "100"}}}))
        return ProcessFailure(local_rank=rank, pid=1, exitcode=exitcode, error_file=str(path))

    alike = ChildFailedError("fn", {0: failure(0, 1, "ValueError: no"),
                                    1: failure(1, 1, "ValueError: no")})
    assert data_parallel.failure_text(alike) == ("ranks 0, 1 failed (exit code 1):\n"
                                         "Traceback (most recent call last):\nValueError: no")
    killed = ChildFailedError("fn", {2: failure(2, -9)})
    assert data_parallel.failure_text(killed) == "rank 2 ended with signal SIGKILL and left no traceback"


def test_rank_peaks_in_the_result_and_the_table():
    record = round_robin.LevelRecord("O2", round_steps=[1, 1], round_seconds=[1.0, 1.0],
                                round_peak_bytes=[5 * 2**20, 3 * 2**20],
                                round_rank_peak_bytes=[[2**20, 5 * 2**20], [3 * 2**20, 2 * 2**20]],
                                losses=[1.0, 0.5])
    result = compare.LevelResult.from_record(record)
    assert result.rank_peak_memory_bytes == [3 * 2**20, 5 * 2**20]
    assert result.peak_memory_bytes == 5 * 2**20
    assert result.to_json()["rank_peak_memory_bytes"] == [3 * 2**20, 5 * 2**20]
    comparison = compare.Comparison([result], host_facts.HostFacts.collect("cpu"),
                                    host_facts.LoadMonitor(), [1, 1], nproc=2, strategy="ddp")
    buf = io.StringIO()
    Console(file=buf, width=160, color_system=None).print(compare.render_table(comparison, "t"))
    text = buf.getvalue()
    assert "per rank" in text and "3/5 MiB" in text and "5 MiB" in text
    assert "each level over 2 ranks (DistributedDataParallel)" in text


@pytest.mark.parametrize("answer", list(KIND_ANSWERS))
def test_table_labels_autocast_with_its_cost_on_the_host(answer):
    """The autocast row's caption line names what it cost, from the same answer as the run."""
    record = round_robin.LevelRecord("autocast", round_steps=[1, 1], round_seconds=[1.0, 1.0],
                                     round_peak_bytes=[2**20, 2**20], losses=[1.0, 0.5])
    with cpu_half.override(bfloat16=KIND_ANSWERS[answer]):
        host = host_facts.HostFacts.collect("cpu")
    comparison = compare.Comparison([compare.LevelResult.from_record(record)], host,
                                    host_facts.LoadMonitor(), [1, 1])
    buf = io.StringIO()
    Console(file=buf, width=400, color_system=None).print(compare.render_table(comparison, "t"))
    text = " ".join(buf.getvalue().split())
    factor = KIND_ANSWERS[answer].matmul_ratio
    if answer == "native":
        assert "not emulated" not in text
    elif factor is not None:
        assert f"its bf16 matmuls ran at {factor:.1f}x fp32's time on this host" in text
    else:
        assert "its bf16 matmuls ran on ATen's slow path" in text


RANK_FAILURE = """

def rank1_refuses_o3(device="cpu", seed=0):
    import os
    import amp_patch.session as s
    model, opt, batch_fn, loss_fn = make(device, seed)
    def bad_loss(model, x):
        if x.shape[0] != 2:
            raise ValueError(f"rank {os.environ['RANK']} got {x.shape[0]} rows, not its 2 of 4")
        if s.current().props.opt_level == "O3" and os.environ["RANK"] == "1":
            raise ValueError("rank 1 refuses O3")
        return loss_fn(model, x)
    return model, opt, batch_fn, bad_loss
"""


@pytest.mark.slow
def test_compare_nproc_2_trains_each_level_over_two_ranks(tmp_path):
    (tmp_path / "user_models.py").write_text(textwrap.dedent(FACTORY) + RANK_FAILURE)
    proc = _compare(tmp_path, "--model", "user_models:rank1_refuses_o3", "--steps", "3",
                    "--nproc", "2", "--levels", "O0", "O2", "O3", "--json", "r.json",
                    "--progress-interval", "0")
    assert proc.returncode == 1, proc.stdout + proc.stderr  # O3 failed, on rank 1 only
    data = json.loads((tmp_path / "r.json").read_text())
    assert (data["config"]["nproc"], data["config"]["strategy"]) == (2, "ddp")
    # One process on the whole batch, in fp32: what DDP's two halves must add up to.
    scope: dict = {}
    exec(textwrap.dedent(FACTORY), scope)
    model, opt, batch_fn, loss_fn = scope["make"]()
    reference = []
    for step in range(3):
        loss = loss_fn(model, batch_fn(step))
        opt.zero_grad()
        loss.backward()
        opt.step()
        reference.append(loss.item())
    for level, tolerance in (("O0", 1e-6), ("O2", 2e-2)):
        r = data["levels"][level]
        assert r["ok"], r["error"]
        assert len(r["losses"]) == 3 and all(math.isfinite(v) for v in r["losses"])
        assert r["losses"] == pytest.approx(reference, rel=tolerance)
        assert len(r["rank_peak_memory_bytes"]) == 2 and min(r["rank_peak_memory_bytes"]) > 0
        assert r["peak_memory_bytes"] == max(r["rank_peak_memory_bytes"])
        assert [len(p) for p in r["round_rank_peak_bytes"]] == [2, 2]
    o3 = data["levels"]["O3"]
    assert not o3["ok"] and "rank 1 failed" in o3["error"] and "rank 1 refuses O3" in o3["error"]
    assert "2 ranks (DDP)" in proc.stdout and "per rank" in proc.stdout
    assert "compare: O2 step 3/3 loss" in proc.stdout
    assert "refuses" not in proc.stderr  # rank 1 is silent; compare itself reports the failure


SHARD_ONE_RANK = r"""
import os, sys, torch, torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
import amp_patch as amp
from amp_patch.cli.compare import data_parallel

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv, self.bn = nn.Conv1d(4, 8, 1), nn.BatchNorm1d(8)
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))

    def forward(self, x):
        x = self.bn(self.conv(x)).flatten(1)
        for block in self.blocks:
            x = torch.relu(block(x))
        return x

dist.init_process_group("gloo", init_method=f"file://{sys.argv[1]}", rank=0, world_size=1)
torch.manual_seed(0)
model = Net()
decay = [p for n, p in model.named_parameters() if n.endswith("weight")]
rest = [p for n, p in model.named_parameters() if not n.endswith("weight")]
opt = torch.optim.AdamW([{"params": decay}, {"params": rest, "weight_decay": 0.0}], lr=1e-2)
data_parallel.shard(model, opt)
assert all(isinstance(m, FSDPModule) for m in (model, model.bn, *model.blocks))
assert not isinstance(model.conv, FSDPModule)  # a plain layer stays in its parent's group
sharded = dict(model.named_parameters())
assert all(isinstance(p, DTensor) for p in sharded.values())
assert [len(g["params"]) for g in opt.param_groups] == [len(decay), len(rest)]
assert opt.param_groups[1]["weight_decay"] == 0.0
assert {id(p) for g in opt.param_groups for p in g["params"]} == {id(p) for p in sharded.values()}
model, opt = amp.initialize(model, opt, opt_level="O2", verbosity=0)  # keep_batchnorm_fp32
before = model.bn.weight.full_tensor().clone()
loss = model(torch.randn(4, 4, 1)).float().pow(2).mean()
with amp.scale_loss(loss, opt) as scaled:
    scaled.backward()
opt.step()
assert model.bn.weight.dtype == torch.float32 and model.blocks[0].weight.dtype == torch.float32
assert not torch.equal(before, model.bn.weight.full_tensor())
amp.deinitialize()
amp.helpers.close_process_group()
print("ok")
"""


@pytest.mark.slow
def test_shard_points_the_optimizer_at_the_sharded_parameters(tmp_path):
    """--strategy fsdp2's recipe in a one-rank group: each batch norm and each block a group."""
    if not cpu_fsdp_supported():
        pytest.skip(f"torch {torch.__version__}'s FSDP2 cannot run on the CPU (torch.cpu.Stream has no record_event)")
    proc = subprocess.run([sys.executable, "-c", SHARD_ONE_RANK, str(tmp_path / "rendezvous")],
                          capture_output=True, text=True, timeout=300)
    # The last line: torch 2.9's gloo prints a line of its own for a one-rank group.
    assert proc.returncode == 0 and proc.stdout.strip().splitlines()[-1:] == ["ok"], (
        proc.stdout + proc.stderr)


def test_shard_refuses_a_stepped_optimizer_and_stray_tensors():
    # Both are refused before fully_shard is imported: no process group needed.
    model = torch.nn.Linear(2, 2)
    stepped = torch.optim.Adam(model.parameters())
    model(torch.ones(1, 2)).sum().backward()
    stepped.step()
    with pytest.raises(ValueError, match="the optimizer has stepped already"):
        data_parallel.shard(model, stepped)
    stray = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1)
    with pytest.raises(ValueError, match=r"steps 1 tensor\(s\) that are not parameters of the"):
        data_parallel.shard(model, stray)


@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA not available")
def test_compare_ranks_on_cuda_use_nccl_and_a_gpu_each(tmp_path):
    nproc = min(2, torch.cuda.device_count())
    (tmp_path / "user_models.py").write_text(textwrap.dedent(FACTORY))
    proc = _compare(tmp_path, "--model", "user_models:make", "--device", "cuda", "--steps", "3",
                    "--nproc", str(nproc), "--strategy", "ddp", "--levels", "O0", "O2",
                    "--json", "r.json")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads((tmp_path / "r.json").read_text())
    for r in data["levels"].values():
        assert r["ok"] and r["memory_kind"] == "cuda_max_allocated"
        assert len(r["rank_peak_memory_bytes"]) == nproc and min(r["rank_peak_memory_bytes"]) > 0
        assert len(r["losses"]) == 3 and all(math.isfinite(v) for v in r["losses"])


@pytest.mark.slow
def test_a_level_that_died_between_chunks_fails_alone(tmp_path, monkeypatch):
    """Its pipe is broken when the next chunk is asked for: the level fails, compare goes on."""
    (tmp_path / "user_models.py").write_text(textwrap.dedent(FACTORY))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    with round_robin.LevelPool(round_robin.JobSpec("user_models:make"), ["O0"]) as pool:
        pool.start()
        assert pool.train("O0", 1)
        pool._procs["O0"].kill()  # as the OOM killer would, while the level waits for orders
        pool._procs["O0"].join()
        assert not pool.train("O0", 1)
    assert "exit code -9" in pool.records["O0"].error and pool.records["O0"].losses
    sys.modules.pop("user_models", None)
