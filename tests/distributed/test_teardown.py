"""``amp_patch.helpers.teardown``: no exit while gloo's workers hold backward's collectives."""

from __future__ import annotations

import logging
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch

from amp_patch.cli.run import command as cli_run
from amp_patch.helpers import close_process_group, teardown, wait_for_gloo_workers

ROOT = Path(__file__).resolve().parents[2]


def _fake_tasks(root: Path, threads: dict[str, tuple[str, str]]) -> Path:
    """A ``/proc/self/task`` look-alike: tid -> (name, state)."""
    for tid, (name, state) in threads.items():
        (root / tid).mkdir(parents=True)
        (root / tid / "comm").write_text(name + "\n")
        (root / tid / "stat").write_text(f"{tid} ({name}) {state} 1 2 3\n")
    return root


def test_no_gloo_threads_returns_at_once(tmp_path):
    tasks = _fake_tasks(tmp_path, {"1": ("python", "R"), "2": ("pt_tcpstore_uv", "R")})
    start = time.monotonic()
    assert wait_for_gloo_workers(tasks=tasks)
    assert time.monotonic() - start < 0.5
    assert wait_for_gloo_workers(tasks=tmp_path / "not_linux")  # no /proc: nothing to look at


def test_state_is_read_after_the_last_parenthesis(tmp_path):
    tasks = _fake_tasks(tmp_path, {"7": (teardown.GLOO_WORKER, "S")})
    (tasks / "7" / "stat").write_text("7 (odd) R name) S 1 2\n")
    assert teardown._worker_states(tasks) == ["S"]


def test_waits_while_a_worker_runs(tmp_path):
    tasks = _fake_tasks(tmp_path, {"10": (teardown.GLOO_WORKER, "S"),
                                   "11": (teardown.GLOO_WORKER, "R")})

    def finish():
        time.sleep(0.2)
        (tasks / "11" / "stat").write_text(f"11 ({teardown.GLOO_WORKER}) S 1 2\n")

    worker = threading.Thread(target=finish)
    start = time.monotonic()
    worker.start()
    assert wait_for_gloo_workers(timeout=10, tasks=tasks)
    worker.join()
    assert time.monotonic() - start >= 0.2


def test_a_worker_that_never_sleeps_is_a_warning_not_a_hang(tmp_path, caplog):
    tasks = _fake_tasks(tmp_path, {"10": (teardown.GLOO_WORKER, "R"),
                                   "11": (teardown.GLOO_WORKER, "S")})
    with caplog.at_level(logging.WARNING, logger="amp_patch"):
        assert not wait_for_gloo_workers(timeout=0.05, tasks=tasks)
    assert "still busy after 0.05 s (states RS)" in caplog.text


def test_close_without_a_group_is_torchs_error():
    with pytest.raises(ValueError, match="not been initialized"):
        close_process_group()


@pytest.mark.slow
def test_close_after_ddp_backward_leaves_the_workers_asleep(tmp_path):
    # One rank, a real gloo group: DDP's backward launches all-reduces on gloo's workers.
    script = textwrap.dedent(f"""
        import sys, torch, torch.distributed as dist
        sys.path.insert(0, {str(ROOT)!r})
        from amp_patch.helpers import close_process_group, teardown
        dist.init_process_group("gloo", init_method="file://{tmp_path / 'rdzv'}",
                                rank=0, world_size=1)
        model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 8))
        for _ in range(3):
            model(torch.randn(4, 8)).sum().backward()
        workers = len(teardown._worker_states(teardown._TASKS))
        if workers == 0:  # torch 2.6 and 2.9's gloo leave their threads unnamed: none to find
            print("unnamed")
            raise SystemExit(0)
        assert workers == 2, workers  # gloo's two workers
        close_process_group()
        assert not dist.is_initialized()
        states = teardown._worker_states(teardown._TASKS)
        assert all(s in "SDI" for s in states), states
        print("closed", "".join(states))
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # The last line: torch 2.9's gloo prints a connection line of its own first.
    last = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    if last == "unnamed":
        pytest.skip(f"torch {torch.__version__}'s gloo does not name its worker threads "
                    f"{teardown.GLOO_WORKER!r}, so there are none to wait for")
    assert last.startswith("closed"), proc.stdout


@pytest.mark.parametrize("body", ["pass", "raise SystemExit(4)"])
def test_run_waits_for_gloo_after_the_script(body, tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(cli_run, "wait_for_gloo_workers", lambda: calls.append(sys.argv[:]))
    script = tmp_path / "script.py"
    script.write_text(body + "\n")
    saved = sys.argv[:]
    try:
        cli_run.run_script(str(script), ["--flag"])
    except SystemExit as exit_:
        assert exit_.code == 4
    assert calls == [saved]  # once, after the script, with sys.argv put back
