"""One training step under an amp opt level or ``torch.autocast``: shared by compare and bench.

``amp-patch compare`` and ``benchmarks/bench_e2e.py`` must time the very same
step, so both drive a :class:`LevelTrainer`. It also holds the CPU peak-memory
sampler that both report.
"""

from __future__ import annotations

import resource
import sys
from typing import Any, Callable

import torch
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

import amp_patch as amp
from amp_patch import levels
from amp_patch.cli import data_parallel
from amp_patch.dtypes import HALF_DTYPE_NAMES

__all__ = ["LEVELS", "AMP_LEVELS", "HALF_DTYPES", "LevelTrainer", "CpuPeak"]

#: The levels that go through :func:`amp_patch.initialize` (the registry's names).
AMP_LEVELS = levels.NAMES
#: Every level, in the order tools run and report them: amp's, then torch.autocast.
LEVELS = (*AMP_LEVELS, "autocast")
#: Command-line names of the half types (:data:`amp_patch.dtypes.HALF_DTYPE_NAMES`).
HALF_DTYPES = HALF_DTYPE_NAMES


class LevelTrainer:
    """Trains a workload one step at a time under one level.

    For ``"O0"`` to ``"O3"`` it calls :func:`amp_patch.initialize` and steps
    through :func:`amp_patch.scale_loss`. For ``"autocast"`` it runs the
    forward under ``torch.autocast`` and, with fp16, scales through
    ``torch.amp.GradScaler``, which is torch's own recipe.

    Args:
        level (str): one of :data:`LEVELS`.
        model (torch.nn.Module): the fp32 model.
        optimizer (torch.optim.Optimizer): its optimizer.
        loss_fn (callable): ``loss_fn(model, batch)`` returns the scalar loss.
        device (torch.device): where the model lives.
        half_dtype (torch.dtype): ``torch.bfloat16`` or ``torch.float16``.
        sample (callable, optional): called after forward, backward and step
            (a memory sampler, say).
        strategy (str, optional): in a rank of a process group,
            ``"ddp"`` wraps the model in DistributedDataParallel after
            :func:`amp_patch.initialize` and ``"fsdp2"`` shards it with
            ``fully_shard`` before (see :mod:`amp_patch.cli.data_parallel`);
            ``loss_fn`` then gets the wrapped model. Default: None, one process.

    Attributes:
        skipped (bool): the last :meth:`step` skipped its optimizer step
            (overflow), as seen by the optimizer's step post-hook not firing.

    Example::

        >>> trainer = LevelTrainer("O2", model, opt, loss_fn, torch.device("cpu"), torch.bfloat16)
        >>> loss = trainer.step(batch)
        >>> trainer.close()
    """

    def __init__(self, level: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor], device: torch.device,
                 half_dtype: torch.dtype, sample: Callable[[], None] | None = None,
                 strategy: str | None = None) -> None:
        if level not in LEVELS:
            raise ValueError(f"unknown level {level!r}; choose from {', '.join(LEVELS)}")
        if strategy not in (None, *data_parallel.STRATEGIES):
            raise ValueError(f"unknown strategy {strategy!r}; choose from "
                             f"{', '.join(data_parallel.STRATEGIES)}")
        self.level = level
        self.device = device
        self.half_dtype = half_dtype
        self.loss_fn = loss_fn
        self._sample = sample or (lambda: None)
        self._grad_scaler: torch.amp.GradScaler | None = None
        if strategy == "fsdp2":
            data_parallel.shard(model, optimizer)  # amp supports this order: shard, then initialize
        if level in AMP_LEVELS:
            model, optimizer = amp.initialize(model, optimizer, opt_level=level,
                                              half_dtype=half_dtype, verbosity=0)
        elif half_dtype == torch.float16 and strategy == "fsdp2":
            # Each rank checks only its shards: the overflow flag must be all-reduced.
            self._grad_scaler = ShardedGradScaler(device.type)
        elif half_dtype == torch.float16:
            self._grad_scaler = torch.amp.GradScaler(device.type)
        self.model, self.optimizer = model, optimizer
        #: What ``loss_fn`` runs: the model, or its DistributedDataParallel wrapper.
        self.net = data_parallel.wrap_ddp(model, device) if strategy == "ddp" else model
        self._steps_taken = 0
        optimizer.register_step_post_hook(self._count_step)
        self.skipped = False

    def _count_step(self, *_: Any) -> None:
        self._steps_taken += 1

    def step(self, batch: Any) -> torch.Tensor:
        """One training step (zero_grad, forward, backward, optimizer step) on ``batch``.

        Returns:
            torch.Tensor: the loss, detached, not synchronised.
        """
        before = self._steps_taken
        self.optimizer.zero_grad()
        if self.level in AMP_LEVELS:
            loss = self.loss_fn(self.net, batch)
            self._sample()
            with amp.scale_loss(loss, self.optimizer) as scaled:
                scaled.backward()
            self._sample()
            self.optimizer.step()
        else:
            with torch.autocast(self.device.type, dtype=self.half_dtype):
                loss = self.loss_fn(self.net, batch)
            self._sample()
            if self._grad_scaler is not None:
                self._grad_scaler.scale(loss).backward()
                self._sample()
                self._grad_scaler.step(self.optimizer)
                self._grad_scaler.update()
            else:
                loss.backward()
                self._sample()
                self.optimizer.step()
        self._sample()
        self.skipped = self._steps_taken == before
        return loss.detach()

    @property
    def loss_scale(self) -> float:
        """The current loss scale (1.0 when none is used). Synchronises with the device."""
        if self.level in AMP_LEVELS:
            return float(amp.state_dict()["loss_scaler0"]["loss_scale"])
        if self._grad_scaler is not None:
            return float(self._grad_scaler.get_scale())
        return 1.0

    def close(self) -> None:
        """Undo :func:`amp_patch.initialize` (a no-op for autocast); drop the DDP wrapper."""
        self.net = self.model  # DDP's reducer holds the process group
        if self.level in AMP_LEVELS:
            amp.deinitialize()


def _anon_rss_bytes() -> int | None:
    # Anonymous resident memory (heap: tensors, allocator caches), not the shared-library
    # code pages that torch touches lazily and that would swamp the model's share of RSS.
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


class CpuPeak:
    """Peak anonymous resident memory above a baseline, sampled when :meth:`sample` is called.

    Linux only; elsewhere :meth:`delta` falls back to ``getrusage``'s
    ``ru_maxrss``, which also counts code pages.
    """

    def __init__(self) -> None:
        self.baseline = _anon_rss_bytes()
        self.peak: int = self.baseline or 0

    def sample(self) -> None:
        """Record the current anonymous resident memory if it is a new peak."""
        if self.baseline is not None:
            self.peak = max(self.peak, _anon_rss_bytes() or 0)

    def restart(self) -> None:
        """Start a new peak from the current memory (the baseline stays)."""
        if self.baseline is not None:
            self.peak = _anon_rss_bytes() or self.baseline

    def delta(self) -> int:
        """Bytes of peak memory above the baseline."""
        if self.baseline is not None:
            return self.peak - self.baseline
        maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return maxrss if sys.platform == "darwin" else maxrss * 1024
