"""``AMP_PATCH_DEBUG_RANKS=1``: at every ``scale_loss``, check that the ranks decided alike.

A decision that differs between ranks shows up, without this, as a
collective that does not match: gloo aborts with "Received data size doesn't
match expected size" deep inside FSDP's backward, NCCL hangs. With
``AMP_PATCH_DEBUG_RANKS=1`` in the environment of :func:`amp_patch.initialize`
(and a process group of more than one rank), amp all-gathers a short vector
of its per-step decisions twice per ``scale_loss``:

- at entry, after the forward and before ``backward()`` runs any of FSDP's or
  DDP's collectives: which loss, the ``delay_*`` flags, whether the fast path
  (no unscale, no check) is taken, the loss scale, and the O1 weight-cast
  cache's entries, the casts made since the last exit and a digest of the
  sizes of all casts in order (a cache hit on one rank where another casts
  changes these);
- at exit, after the scaler's update: how many gradients were unscaled and
  how many left scaled for the one-pass O2 step, the overflow verdict, the
  new loss scale, and the scaler's counts of skipped and clean steps.

On a mismatch it raises :class:`RanksDisagreeError`, on every rank, naming
each decision that differs and every rank's value. Off (the default) it costs
one attribute read per ``scale_loss``.

Example::

    $ AMP_PATCH_DEBUG_RANKS=1 torchrun --nproc-per-node 2 train.py
    amp_patch.frontend.debug.RanksDisagreeError: amp_patch's ranks disagree at
    scale_loss entry (loss_id 0, scale_loss call 5): weight casts made since the last
    scale_loss: rank 0: 5, rank 1: 6
"""

from __future__ import annotations

import math
import os
from typing import TYPE_CHECKING, Sequence

import torch

from amp_patch.helpers import agree

if TYPE_CHECKING:
    from amp_patch.scaler import AmpScaler
    from amp_patch.session import AmpSession

__all__ = ["ENV_VAR", "RanksDisagreeError", "RankCheck", "enabled", "install"]

#: The environment variable that turns the check on (``1``), read at each ``initialize``.
ENV_VAR = "AMP_PATCH_DEBUG_RANKS"

#: The decisions compared at ``scale_loss`` entry, in the order of the gathered vector.
ENTRY_FIELDS = (
    "loss_id",
    "delay_unscale",
    "delay_overflow_check",
    "fast path (no unscale, no overflow check)",
    "loss scale",
    "weight-cast cache entries",
    "weight casts made since the last scale_loss",
    "digest of the sizes of all casts made, in order",
)
#: The decisions compared at ``scale_loss`` exit.
EXIT_FIELDS = (
    "loss_id",
    "gradients unscaled",
    "gradients left scaled for the one-pass O2 step",
    "overflow (the step is skipped)",
    "loss scale after the update",
    "skipped steps",
    "clean steps since the scale last changed",
)
_WHERE = {1.0: "scale_loss entry", 2.0: "scale_loss exit"}
#: where, call number, then the fields, padded: the same length at entry and exit.
_WIDTH = 2 + max(len(ENTRY_FIELDS), len(EXIT_FIELDS))


class RanksDisagreeError(RuntimeError):
    """The ranks made different amp decisions in one step (``AMP_PATCH_DEBUG_RANKS=1``).

    Attributes:
        differences (dict): decision name to the list of every rank's value.
    """

    def __init__(self, message: str, differences: dict[str, list[float]]) -> None:
        super().__init__(message)
        self.differences = differences


def enabled() -> bool:
    """Whether ``AMP_PATCH_DEBUG_RANKS`` asks for the check (any value but empty or ``0``)."""
    return os.environ.get(ENV_VAR, "") not in ("", "0")


class RankCheck:
    """The per-session state of the check: the calls so far and the cache's count at the last exit.

    Made by :func:`install`; :func:`amp_patch.scale_loss` calls :meth:`at_entry` and
    :meth:`at_exit`. Both are collectives over the default process group.

    Example::

        >>> check = RankCheck()
        >>> check.at_entry(session, loss_id=0, delay_unscale=False,
        ...                delay_overflow_check=False, fast=False)
    """

    def __init__(self) -> None:
        self.calls = 0
        self._casts_at_exit = 0

    def _cache(self, session: "AmpSession"):
        return session.casts.cache if session.casts is not None else None

    def at_entry(self, session: "AmpSession", loss_id: int, delay_unscale: bool,
                 delay_overflow_check: bool, fast: bool) -> None:
        """Compare the decisions taken up to ``backward()`` (see the module's text).

        Raises:
            RanksDisagreeError: a decision differs between ranks.
        """
        self.calls += 1
        cache = self._cache(session)
        entries = len(cache) if cache is not None else 0
        made = cache.casts - self._casts_at_exit if cache is not None else 0
        digest = cache.digest if cache is not None else 0
        self._compare(1.0, ENTRY_FIELDS, [loss_id, delay_unscale, delay_overflow_check, fast,
                                          session.scalers[loss_id].loss_scale, entries, made,
                                          digest])

    def at_exit(self, session: "AmpSession", scaler: "AmpScaler", unscaled: int,
                deferred: int, overflow: bool) -> None:
        """Compare the decisions of the exit, after the scaler's update.

        Args:
            session (AmpSession): the live session.
            scaler (AmpScaler): the exit's scaler.
            unscaled (int): gradients passed to the unscale passes.
            deferred (int): gradients left scaled for the one-pass O2 step.
            overflow (bool): the (all-reduced) overflow verdict.

        Raises:
            RanksDisagreeError: a decision differs between ranks.
        """
        self._compare(2.0, EXIT_FIELDS, [scaler.loss_id, unscaled, deferred, overflow,
                                         scaler.loss_scale, scaler.skipped_steps,
                                         scaler.state_dict()["unskipped"]])

    def iteration_ended(self, session: "AmpSession") -> None:
        """The cache was cleared: casts counted from here on belong to the next iteration."""
        cache = self._cache(session)
        self._casts_at_exit = cache.casts if cache is not None else 0

    def _compare(self, where: float, names: Sequence[str], values: Sequence[float]) -> None:
        if not agree.group_active():
            return
        import torch.distributed as dist

        row = [where, float(self.calls), *(float(v) for v in values)]
        row += [0.0] * (_WIDTH - len(row))
        mine = torch.tensor(row, dtype=torch.float64, device=agree.collective_device())
        rows = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(rows, mine)
        table = torch.stack(rows).cpu().tolist()
        labels = ["where", "scale_loss calls", *names]
        differences = {}
        for i, label in enumerate(labels):
            column = [r[i] for r in table]
            if any(not _same(column[0], v) for v in column[1:]):
                differences[label] = column
        if not differences:
            return
        if "where" in differences:
            differences["where"] = [_WHERE.get(v, str(v)) for v in differences["where"]]
        said = "; ".join(
            f"{name}: " + ", ".join(f"rank {r}: {_show(v)}" for r, v in enumerate(vals))
            for name, vals in differences.items())
        raise RanksDisagreeError(
            f"amp_patch's ranks disagree at {_WHERE[where]} (scale_loss call {self.calls} of this "
            f"rank): {said}. Every rank must make the same amp decisions, or the collectives "
            "that follow (FSDP's, DDP's, amp's overflow all-reduce) do not match; see "
            "docs/distributed.md, 'Every rank makes the same decision'.", differences)


def _same(a: float, b: float) -> bool:
    return a == b or (math.isnan(a) and math.isnan(b))


def _show(value) -> str:
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
        return str(int(value))
    return str(value)


def install(session: "AmpSession") -> RankCheck | None:
    """Give the session a :class:`RankCheck` when :func:`enabled`; None (and no cost) otherwise.

    Example::

        >>> os.environ["AMP_PATCH_DEBUG_RANKS"] = "1"
        >>> amp.initialize(model, opt)
        >>> amp_patch.session.current().rank_check
        <amp_patch.frontend.debug.RankCheck object at ...>
    """
    session.rank_check = RankCheck() if enabled() else None
    return session.rank_check
