"""Two torchrun "nodes" on localhost (2 processes each, c10d rendezvous): FSDP2 and DDP at O1, O2.

Each launch is ``torchrun --nnodes=2 --nproc-per-node=2`` with its own node rank;
the two agents meet at one c10d rendezvous endpoint, and their 4 workers form
one gloo group that runs the cases of _dist_cases.MULTINODE.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import _dist_cases
from training_utils import free_port

from amp_patch.casting.fsdp import cpu_fsdp_supported

#: Seconds for both launches (two agents and four workers on two busy cores).
TIMEOUT = 600


@pytest.mark.slow
def test_two_nodes_of_two_processes(tmp_path):
    if not cpu_fsdp_supported():  # the cases include FSDP2 ones ("match:O1")
        pytest.skip(f"torch {torch.__version__}'s FSDP2 cannot run on the CPU "
                    "(torch.cpu.Stream has no record_event)")
    port = free_port()
    names = _dist_cases.MULTINODE
    logs = [tmp_path / f"node{n}.log" for n in (0, 1)]
    procs = []
    for node, log_path in enumerate(logs):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=2",
               f"--node-rank={node}", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}",
               "--rdzv-id=amp-patch-multinode", f"--rdzv-conf=is_host={node == 0}",
               "--local-addr=127.0.0.1", "--max-restarts=0",
               _dist_cases.__file__, str(tmp_path), ",".join(names)]
        with open(log_path, "w") as log:
            procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                          env=_dist_cases.worker_env()))
    codes = _dist_cases.wait_all(procs, TIMEOUT)
    results = _dist_cases.collect(names, 4, tmp_path, logs, codes)
    failed = {n: r for n, r in results.items() if r != "ok"}
    assert not failed, "\n".join(f"{n}:\n{r}" for n, r in failed.items())
    assert codes == [0, 0], codes
