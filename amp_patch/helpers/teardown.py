"""Leaving torch.distributed without the abort at exit that gloo can cause.

A collective launched during ``backward()`` (every all-reduce of
DistributedDataParallel, FSDP2's reduce-scatters) records the thread-local
state of its caller, and that state holds a Python object
(``torch.autograd.graph`` stashes a ``contextvars.Context`` there for the
length of the backward). The gloo worker thread that ran the collective lets
go of it a moment after the collective completes. If the interpreter has
begun to shut down by then, that thread cannot take the GIL to release the
object, and the process dies with ``terminate called without an active
exception`` (SIGABRT) after the script's last line. It happens when the worker
thread is descheduled at the wrong moment: on a loaded machine, one exit in
four or five of a two-rank DDP run on the CPU (``benchmarks/bench_gloo_exit.py``).

``destroy_process_group()`` does not prevent it: DDP keeps references to the
group, so its worker threads live on to the end. What does is to let those
threads finish before the interpreter goes: :func:`wait_for_gloo_workers`
sleeps, the GIL released, until none of them is runnable.
:func:`close_process_group` ends a rank's use of torch.distributed that way,
and ``amp-patch run`` waits for the workers after every script.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch.distributed as dist

__all__ = ["close_process_group", "wait_for_gloo_workers"]

logger = logging.getLogger("amp_patch")

#: The name torch gives to gloo's worker threads (``/proc/self/task/*/comm``).
GLOO_WORKER = "pt_gloo_runloop"

#: The directory of this process's threads; absent off Linux.
_TASKS = Path("/proc/self/task")

#: Seconds between two looks at the worker threads.
_POLL = 0.002


def _worker_states(tasks: Path) -> list[str]:
    """The scheduler state (``R``, ``S``, ...) of every gloo worker thread under ``tasks``."""
    states = []
    for task in sorted(tasks.iterdir()):
        try:
            if (task / "comm").read_text().strip() != GLOO_WORKER:
                continue
            # "tid (comm) state ...": the name may hold spaces or parentheses;
            # the state follows the last ")".
            states.append((task / "stat").read_text().rpartition(")")[2].split()[0])
        except (OSError, IndexError):  # the thread ended while being read
            continue
    return states


def wait_for_gloo_workers(timeout: float = 5.0, *, tasks: Path = _TASKS) -> bool:
    """Sleep until no gloo worker thread of this process is running or runnable.

    A worker blocked waiting for work (or for the GIL, which this sleep
    leaves free) is asleep; one still releasing a finished collective is
    running or waiting for a CPU. The workers count as done when two looks,
    :data:`_POLL` seconds apart, find them all asleep. Off Linux, where
    threads cannot be looked at this way, and in a process without gloo
    workers, it returns at once.

    Args:
        timeout (float, optional): the most seconds to wait. Default: 5.0.
        tasks (pathlib.Path, optional): the directory of the threads to look
            at. Default: ``/proc/self/task``.

    Returns:
        bool: True when the workers are done (or there are none to wait
        for); False when ``timeout`` passed first, which is logged as a
        warning.

    Example::

        >>> wait_for_gloo_workers()
        True
    """
    if not tasks.is_dir():
        return True
    deadline = time.monotonic() + timeout
    quiet_looks = 0
    while True:
        states = _worker_states(tasks)
        if not states:
            return True
        quiet_looks = quiet_looks + 1 if all(s in "SDI" for s in states) else 0
        if quiet_looks == 2:
            return True
        if time.monotonic() >= deadline:
            logger.warning("gloo's worker threads were still busy after %g s (states %s); the "
                           "process may abort as it exits", timeout, "".join(states))
            return False
        time.sleep(_POLL)


def close_process_group(timeout: float = 5.0) -> None:
    """End this rank's use of torch.distributed: barrier, destroy the group, let gloo finish.

    Call it on every rank, once training is over. The barrier keeps a rank
    from destroying the group while another still communicates; the wait is
    :func:`wait_for_gloo_workers`.

    Args:
        timeout (float, optional): the most seconds to wait for the gloo
            workers. Default: 5.0.

    Raises:
        ValueError: no process group is initialized (torch's own error).

    Example::

        >>> dist.init_process_group("gloo")
        >>> ...  # train
        >>> close_process_group()
    """
    dist.barrier()
    dist.destroy_process_group()
    wait_for_gloo_workers(timeout)
