"""Verdicts that every rank must share, agreed through one small collective.

amp_patch's rule under torch.distributed (docs/distributed.md): any decision
that changes which collectives run, or their sizes, or that would let ranks
that should hold the same values drift apart, is the same on every rank.
Most decisions are so by construction (they follow from the arguments every
rank passes alike). The few that come from the host itself (a timed probe, a
library that loaded or did not) are agreed here: each rank contributes its
verdict and takes the group's.

Outside an initialized process group every function returns its input, so a
single process pays nothing. The functions are collectives otherwise: every
rank of the default group must call them, in the same order.

A leaf module: it imports torch only, so any layer may use it.
"""

from __future__ import annotations

import logging
from typing import Sequence

import torch

__all__ = ["group_active", "collective_device", "agree_max", "agree_min", "check_kernels"]

logger = logging.getLogger("amp_patch")


def group_active() -> bool:
    """True inside an initialized default process group of more than one rank.

    Example::

        >>> group_active()   # a plain python process
        False
    """
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def collective_device() -> torch.device:
    """Where a small tensor for the default group's backend lives: the current CUDA device for
    NCCL, the CPU otherwise."""
    import torch.distributed as dist

    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _reduce(values: Sequence[float], op_name: str) -> list[float]:
    import torch.distributed as dist

    t = torch.tensor([float(v) for v in values], dtype=torch.float64, device=collective_device())
    dist.all_reduce(t, op=getattr(dist.ReduceOp, op_name))
    return t.tolist()


def agree_max(values: Sequence[float]) -> list[float]:
    """The elementwise maximum of ``values`` over the ranks (``values`` itself in one process).

    For verdicts where one rank's "yes" must hold for all: "emulate", "overflow".

    Args:
        values (sequence of float or bool): this rank's verdicts, the same length on every rank.

    Returns:
        list of float: the group's verdicts.

    Example::

        >>> agree_max([True, 0.5])   # one process: its own verdicts
        [1.0, 0.5]

        On two ranks, ``agree_max([rank == 1])`` gives ``[1.0]`` on both.
    """
    if not group_active():
        return [float(v) for v in values]
    return _reduce(values, "MAX")


def agree_min(values: Sequence[float]) -> list[float]:
    """The elementwise minimum of ``values`` over the ranks (``values`` itself in one process).

    For verdicts that hold only where every rank says so: "native kernels loaded".

    Args:
        values (sequence of float or bool): this rank's verdicts, the same length on every rank.

    Returns:
        list of float: the group's verdicts.

    Example::

        >>> agree_min([True, 0.5])   # one process: its own verdicts
        [1.0, 0.5]

        On two ranks, ``agree_min([rank != 1])`` gives ``[0.0]`` on both.
    """
    if not group_active():
        return [float(v) for v in values]
    return _reduce(values, "MIN")


def check_kernels(native: bool) -> bool:
    """Say so when the ranks do not all run the same kind of multi-tensor kernels.

    Whether ``amp_patch._C`` loaded is decided per process at import. The
    native kernels are bit-identical to the reference ones except the L2 norm
    (another summation order), and neither changes which collectives run, so
    a mixed group trains; but the norms behind DDP's clipping, which each
    rank computes on its own, may then differ in the last bits from rank to
    rank, and so may the replicas. Logged at WARNING on every rank.

    Args:
        native (bool): this rank loaded the compiled extension.

    Returns:
        bool: every rank loaded it (``native`` itself in one process).

    Example::

        >>> check_kernels(amp_patch.ops.native_extension_loaded())
        True
    """
    all_native, none_native = (bool(v) for v in agree_min([native, not native]))
    if not (all_native or none_native):
        logger.warning("amp_patch: the ranks do not all run the same multi-tensor kernels: this "
                       "rank runs the %s ones, another the %s ones (whether amp_patch._C loaded). "
                       "Results are the same except the L2 norms, whose last bits may differ "
                       "between ranks", *(("compiled", "reference") if native else
                                          ("reference", "compiled")))
    return all_native
