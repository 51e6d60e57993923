"""Data-parallel ranks on this machine: launch them, wrap or shard the model, split the batch.

``amp-patch compare --nproc N`` and ``benchmarks/bench_distributed.py``
train a workload over several processes the same way, through this module:

- :func:`launch` starts the ranks with torch's elastic launcher (what
  ``torchrun --standalone`` does): one agent, a c10d rendezvous on
  localhost at a free port, no restarts;
- each rank calls :func:`init_process_group` (gloo on the CPU, NCCL and one
  GPU per rank on CUDA) and, at the end,
  :func:`amp_patch.helpers.close_process_group`;
- :func:`shard` applies FSDP2's ``fully_shard`` in the usual recipe and
  points the optimizer at the sharded parameters, so that
  :func:`amp_patch.initialize` can follow (the order amp supports);
  :func:`wrap_ddp` wraps a model that amp has initialized in
  ``DistributedDataParallel``;
- every rank builds the same global batch and trains on its slice of it
  (:func:`local_batch`), so that the ranks together see what one process
  would, and :func:`mean_over_ranks` gives the loss of the whole batch.
"""

from __future__ import annotations

import datetime
import logging
import os
import tempfile
import uuid
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.fsdp import fully_shard
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

__all__ = ["STRATEGIES", "COLLECTIVE_TIMEOUT", "launch", "first_to_fail", "failure_text",
           "init_process_group", "rank_threads", "shard", "wrap_ddp",
           "local_batch", "mean_over_ranks"]

#: How a level is trained over the ranks: DistributedDataParallel, or FSDP2's ``fully_shard``.
STRATEGIES = ("ddp", "fsdp2")

#: The environment variable that tells the ranks of a launch where to claim a failure.
_CLAIMS = "AMP_PATCH_RANK_CLAIMS"

#: How long a rank may wait in a collective. Compare's ranks wait in one while the other
#: levels train their rounds, which can take long; a rank that dies ends the group anyway,
#: since the agent then stops the others.
COLLECTIVE_TIMEOUT = datetime.timedelta(hours=12)


def launch(nproc: int, entrypoint: Callable[..., Any], *args: Any) -> dict[int, Any]:
    """Run ``entrypoint(*args)`` in ``nproc`` new processes that form one process group.

    This is ``torchrun --standalone --nproc-per-node nproc`` as a function
    call: torch's elastic agent runs in this process, meets its workers at a
    c10d rendezvous on 127.0.0.1 (a free port) and sets ``RANK``,
    ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` in
    each. A failed rank is not restarted: the agent stops the others and
    raises. The agent's own log lines are silenced, since the caller reports
    the failure (:func:`failure_text`).

    Args:
        nproc (int): ranks to start.
        entrypoint (callable): a picklable (module-level) function; it is
            called in every rank with the same ``args``.
        *args: picklable arguments (a :class:`multiprocessing.connection.Connection` is).

    Returns:
        dict: rank to what ``entrypoint`` returned there.

    Raises:
        torch.distributed.elastic.multiprocessing.errors.ChildFailedError: a rank failed.

    Example::

        >>> def entry(x):
        ...     init_process_group("cpu")
        ...     ...
        ...     amp_patch.helpers.close_process_group()
        ...     return x
        >>> launch(2, entry, 7)
        {0: 7, 1: 7}
    """
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=nproc,
                          run_id=f"amp-patch-{uuid.uuid4().hex}", rdzv_backend="c10d",
                          rdzv_endpoint="127.0.0.1:0", local_addr="127.0.0.1", max_restarts=0,
                          start_method="spawn")
    # The agent logs a failed rank's traceback, and the termination of the others, at ERROR
    # and WARNING level through loggers it configures itself; the caller reports the failure.
    disabled = logging.root.manager.disable
    logging.disable(logging.ERROR)
    saved = os.environ.get(_CLAIMS)
    try:
        with tempfile.TemporaryDirectory(prefix="amp-patch-ranks-") as claims:
            os.environ[_CLAIMS] = claims  # the ranks inherit it
            return elastic_launch(config, entrypoint)(*args)
    finally:
        logging.disable(disabled)
        if saved is None:
            os.environ.pop(_CLAIMS, None)
        else:
            os.environ[_CLAIMS] = saved


def first_to_fail() -> bool:
    """Called by a failing rank: True in the first rank of its launch to call it.

    When one rank fails, the others soon fail too, in a collective whose
    peer is gone, and the agent may see one of them die first and report
    only that. A rank that is not the first to fail should therefore end
    quietly (``os._exit(0)``), leaving the first one's traceback as the
    launch's failure. The claim is a file created exclusively in a directory
    :func:`launch` made, so only ranks on this machine share it.

    Returns:
        bool: this rank failed first (or was not started by :func:`launch`).
    """
    claims = os.environ.get(_CLAIMS)
    if claims is None:
        return True
    try:
        os.close(os.open(os.path.join(claims, "failed"), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    return True


def failure_text(exc: BaseException) -> str:
    """What went wrong in :func:`launch`: each failed rank's traceback (or exit), earliest first.

    Ranks that failed alike are named together.
    """
    if not isinstance(exc, ChildFailedError):
        return f"the launcher failed: {type(exc).__name__}: {exc}"
    alike: dict[str, list[int]] = {}
    for rank, failure in sorted(exc.failures.items(), key=lambda kv: (kv[1].timestamp, kv[0])):
        how = (f"signal {failure.signal_name()}" if failure.exitcode < 0
               else f"exit code {failure.exitcode}")
        recorded = failure.error_file_data.get("message")
        if isinstance(recorded, dict):  # the error file of a Python exception
            recorded = recorded.get("extraInfo", {}).get("py_callstack") or recorded.get("message")
        if isinstance(recorded, str) and recorded != "<NONE>":
            alike.setdefault(f"failed ({how}):\n{recorded.rstrip()}", []).append(rank)
        else:
            alike.setdefault(f"ended with {how} and left no traceback", []).append(rank)
    return "\n".join(f"rank{'s' * (len(group) > 1)} {', '.join(map(str, group))} {text}"
                     for text, group in alike.items())


def init_process_group(device_type: str) -> torch.device:
    """Join the group :func:`launch` set up; return this rank's device.

    gloo on the CPU; on CUDA, NCCL with GPU ``LOCAL_RANK`` made current.

    Args:
        device_type (str): ``"cpu"`` or ``"cuda"``.

    Returns:
        torch.device: ``cpu``, or ``cuda:LOCAL_RANK``.
    """
    if device_type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", timeout=COLLECTIVE_TIMEOUT, device_id=device)
        return device
    dist.init_process_group("gloo", timeout=COLLECTIVE_TIMEOUT)
    return torch.device("cpu")


def rank_threads(nproc: int, cpus: int) -> int:
    """Intra-op threads of each of ``nproc`` ranks: the ``cpus`` shared out, at least one."""
    return max(1, cpus // nproc)


def shard(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Shard ``model`` with FSDP2 and point ``optimizer`` at the sharded parameters, in place.

    The usual recipe: ``fully_shard`` on every batch norm with parameters
    (so that O2's ``keep_batchnorm_fp32`` can gather them in fp32), then on
    every entry of every :class:`~torch.nn.ModuleList` (the blocks of a
    transformer), then on the model. Every rank must have built the same
    weights. Call it before :func:`amp_patch.initialize`, with an
    optimizer that has not stepped yet.

    Args:
        model (nn.Module): the fp32 model, on this rank's device.
        optimizer (torch.optim.Optimizer): its optimizer over ``model``'s parameters.

    Raises:
        ValueError: the optimizer has state, or steps a tensor that is not a parameter of ``model``.

    Example::

        >>> model, optimizer, batch_fn, loss_fn = models.lm()
        >>> shard(model, optimizer)
        >>> model, optimizer = amp.initialize(model, optimizer, opt_level="O2")
    """
    if optimizer.state:
        raise ValueError("shard: the optimizer has stepped already; shard the model before the "
                         "first step")
    names = {id(p): name for name, p in model.named_parameters()}
    stray = sum(id(p) not in names for g in optimizer.param_groups for p in g["params"])
    if stray:
        raise ValueError(f"shard: the optimizer steps {stray} tensor(s) that are not parameters "
                         "of the model; FSDP2 can only shard the model's own")
    units: list[nn.Module] = [m for m in model.modules()
                              if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    units += [m for lst in model.modules() if isinstance(lst, nn.ModuleList) for m in lst]
    done: set[int] = set()
    for m in units:
        if id(m) not in done and m is not model and any(True for _ in m.parameters()):
            fully_shard(m)
            done.add(id(m))
    fully_shard(model)
    # fully_shard swapped every parameter for a sharded one under the same name; the
    # optimizer has no state yet, so its groups can simply take the new objects.
    sharded = dict(model.named_parameters())
    for group in optimizer.param_groups:
        group["params"] = [sharded[names[id(p)]] for p in group["params"]]


def wrap_ddp(model: nn.Module, device: torch.device) -> nn.Module:
    """``DistributedDataParallel(model)``, on this rank's GPU where the device is one."""
    ids = [device.index] if device.type == "cuda" else None
    return nn.parallel.DistributedDataParallel(model, device_ids=ids)


def local_batch(batch: Any, rank: int, world: int) -> Any:
    """This rank's slice of a global batch: every tensor's rows split evenly over the ranks.

    Tensors are cut along their first dimension, inside tuples, lists
    (named tuples too) and dicts; 0-d tensors and anything else are kept.

    Args:
        batch: what the workload's ``batch_fn`` returned.
        rank (int): this rank.
        world (int): the ranks.

    Returns:
        the same structure with each tensor's ``rank``-th of ``world`` equal row blocks.

    Raises:
        ValueError: a tensor's rows do not split evenly over the ranks.

    Example::

        >>> local_batch((torch.zeros(8, 3), torch.arange(8)), rank=1, world=2)[1]
        tensor([4, 5, 6, 7])
    """
    if isinstance(batch, torch.Tensor):
        if batch.dim() == 0:
            return batch
        rows = batch.shape[0]
        if rows % world:
            raise ValueError(f"a batch tensor of shape {tuple(batch.shape)} has {rows} rows, "
                             f"which do not split evenly over {world} ranks; give a batch size "
                             f"that is a multiple of {world} (--batch-size)")
        return batch.chunk(world)[rank]
    if isinstance(batch, dict):
        return type(batch)((k, local_batch(v, rank, world)) for k, v in batch.items())
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):
        return type(batch)(*(local_batch(v, rank, world) for v in batch))
    if isinstance(batch, (tuple, list)):
        return type(batch)(local_batch(v, rank, world) for v in batch)
    return batch


def mean_over_ranks(value: torch.Tensor) -> float:
    """The mean of a scalar over the ranks (a collective: every rank calls it)."""
    total = value.detach().float().reshape(1).clone()
    dist.all_reduce(total)
    return total.item() / dist.get_world_size()
