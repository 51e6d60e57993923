"""One training step under an amp opt level or ``torch.autocast``: shared by compare and bench.

``amp-patch compare`` and ``benchmarks/bench_e2e.py`` must time the very same
step, so both drive a :class:`LevelTrainer`. It also holds the CPU peak-memory
sampler that both report.
"""

from __future__ import annotations

import dataclasses
import resource
import sys
import time
from types import MappingProxyType
from typing import Any, Callable, Mapping

import torch
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

import amp_patch as amp
from amp_patch.cli.compare import data_parallel
from amp_patch.ops import fp8_ops
from amp_patch.settings import levels
from amp_patch.settings.dtypes import HALF_DTYPE_NAMES

__all__ = ["LEVELS", "AMP_LEVELS", "AMP_ROWS", "PRESETS", "Preset", "Unavailable", "HALF_DTYPES",
           "LevelTrainer", "CpuPeak", "preset"]

#: The levels that go through :func:`amp_patch.initialize` (the registry's names).
AMP_LEVELS = levels.NAMES


@dataclasses.dataclass(frozen=True)
class Preset:
    """A row of compare and the benchmarks that is an opt level with more ``initialize`` options.

    Args:
        name (str): the row's name, e.g. ``"O2-lean"``.
        opt_level (str): the level it starts from (one of :data:`AMP_LEVELS`).
        options (tuple of (str, object)): further keyword arguments of
            :func:`amp_patch.initialize`, as pairs (a frozen, picklable mapping).
        about (str): what the row is, for tables and docs.
        lean_state (bool): its options need an optimizer that keeps low-precision
            state (``LEAN_STATE``: amp_patch's FusedAdam or FusedSGD); with any
            other, :class:`LevelTrainer` raises :class:`Unavailable`.

    Example::

        >>> PRESETS["O2-lean"].initialize_kwargs()
        {'opt_level': 'O2', 'optimizer_state': 'int8', 'master_weights': 'bf16'}
    """

    name: str
    opt_level: str
    options: tuple[tuple[str, Any], ...]
    about: str
    lean_state: bool = True

    def __post_init__(self) -> None:
        if self.opt_level not in AMP_LEVELS:
            raise ValueError(f"preset {self.name!r}: unknown opt level {self.opt_level!r}; "
                             f"choose from {', '.join(AMP_LEVELS)}")
        if self.name in AMP_LEVELS or self.name == "autocast":
            raise ValueError(f"preset {self.name!r}: the name of a level cannot name a preset")

    def initialize_kwargs(self) -> dict[str, Any]:
        """The keyword arguments of :func:`amp_patch.initialize` for this row."""
        return {"opt_level": self.opt_level, **dict(self.options)}

    def json_kwargs(self) -> dict[str, Any]:
        """:meth:`initialize_kwargs` for JSON: a recipe object as its one-line description."""
        return {k: v if v is None or isinstance(v, (str, int, float, bool)) else
                getattr(v, "describe", lambda v=v: repr(v))()
                for k, v in self.initialize_kwargs().items()}

    @property
    def fp8(self) -> bool:
        """Whether the row runs FP8 linears (``initialize(fp8=...)``)."""
        return dict(self.options).get("fp8") is not None


#: The presets that ``compare`` shows by default beside the levels: the one table of them.
PRESETS: Mapping[str, Preset] = MappingProxyType({p.name: p for p in (
    Preset("O2-lean", "O2", (("optimizer_state", "int8"), ("master_weights", "bf16")),
           "O2 with block-scaled int8 optimizer state and bf16 master weights "
           "(amp_patch's FusedAdam or FusedSGD)"),
    # The default size rule (min_features 2048) converts none of the built-in models' layers.
    Preset("O2+fp8", "O2", (("fp8", amp.Fp8Recipe(scaling="tensorwise", min_features=16)),),
           "O2 with its nn.Linear layers in FP8 (fp8=Fp8Recipe(scaling='tensorwise', "
           "min_features=16): every layer whose dims are multiples of 16, since the default "
           "size rule, 2048, converts none of a model this small)", lean_state=False),
)})
#: The rows that go through :func:`amp_patch.initialize`: the levels, then the presets.
AMP_ROWS = (*AMP_LEVELS, *PRESETS)
#: Every row, in the order tools run and report them: amp's levels and presets, then
#: torch.autocast.
LEVELS = (*AMP_ROWS, "autocast")


class Unavailable(ValueError):
    """A row cannot run with the workload's optimizer (a lean preset with torch's Adam, say).

    Tools show the row as skipped, with this message as the reason, rather than as failed.
    """


def preset(row: str | Preset) -> Preset | None:
    """The :class:`Preset` of a row name (or the preset itself); None for a level or autocast.

    Raises:
        ValueError: an unknown row name.

    Example::

        >>> preset("O2-lean").opt_level
        'O2'
        >>> preset("O1") is None
        True
    """
    if isinstance(row, Preset):
        return row
    if row in PRESETS:
        return PRESETS[row]
    if row in LEVELS:
        return None
    raise ValueError(f"unknown level {row!r}; choose from {', '.join(LEVELS)}")
#: Command-line names of the half types (:data:`amp_patch.settings.dtypes.HALF_DTYPE_NAMES`).
HALF_DTYPES = HALF_DTYPE_NAMES


class LevelTrainer:
    """Trains a workload one step at a time under one level.

    For ``"O0"`` to ``"O3"`` and the presets (:data:`PRESETS`, or a
    :class:`Preset` of one's own) it calls :func:`amp_patch.initialize` and
    steps through :func:`amp_patch.scale_loss`. For ``"autocast"`` it runs the
    forward under ``torch.autocast`` and, with fp16, scales through
    ``torch.amp.GradScaler``, which is torch's own recipe.

    Args:
        level (str or Preset): one of :data:`LEVELS`, or a preset.
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
            ``fully_shard`` before (see :mod:`amp_patch.cli.compare.data_parallel`);
            ``loss_fn`` then gets the wrapped model. Default: None, one process.
        time_optimizer (bool, optional): synchronise the device around the
            ``optimizer.step()`` call, so that :attr:`optimizer_seconds` is its
            time on a GPU too (on the CPU it is timed either way). Default: False.

    Raises:
        Unavailable: a preset that needs amp_patch's FusedAdam or FusedSGD, with another optimizer.

    Attributes:
        skipped (bool): the last :meth:`step` skipped its optimizer step
            (overflow), as seen by the optimizer's step post-hook not firing.
        optimizer_seconds (float or None): wall time of the last :meth:`step`'s
            ``optimizer.step()`` call alone.

    Example::

        >>> trainer = LevelTrainer("O2", model, opt, loss_fn, torch.device("cpu"), torch.bfloat16)
        >>> loss = trainer.step(batch)
        >>> trainer.close()
    """

    def __init__(self, level: str | Preset, model: torch.nn.Module,
                 optimizer: torch.optim.Optimizer,
                 loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor], device: torch.device,
                 half_dtype: torch.dtype, sample: Callable[[], None] | None = None,
                 strategy: str | None = None, time_optimizer: bool = False) -> None:
        row = preset(level)  # raises for an unknown name
        if strategy not in (None, *data_parallel.STRATEGIES):
            raise ValueError(f"unknown strategy {strategy!r}; choose from "
                             f"{', '.join(data_parallel.STRATEGIES)}")
        if row is not None and row.fp8 and not fp8_ops.fp8_gemm_available(device):
            raise Unavailable(f"{row.name} needs FP8 GEMMs (torch._scaled_mm) on {device}; this "
                              "torch or GPU has none (CUDA needs sm_89 or later)")
        if row is not None and row.lean_state and not _keeps_lean_state(optimizer):
            raise Unavailable(
                f"{row.name} ({', '.join(f'{k}={v!r}' for k, v in row.options)}) needs amp_patch's "
                f"FusedAdam or FusedSGD; this workload's optimizer is {type(optimizer).__name__}")
        #: The row's name (a level, a preset's name, or ``"autocast"``).
        self.level = row.name if row is not None else level
        #: The :func:`amp_patch.initialize` arguments, or None under autocast.
        self.initialize_kwargs = (row.initialize_kwargs() if row is not None
                                  else {"opt_level": level} if level in AMP_LEVELS else None)
        self._uses_amp = self.initialize_kwargs is not None
        self._sync_optimizer = time_optimizer and device.type == "cuda"
        self.optimizer_seconds: float | None = None
        self.device = device
        self.half_dtype = half_dtype
        self.loss_fn = loss_fn
        self._sample = sample or (lambda: None)
        self._grad_scaler: torch.amp.GradScaler | None = None
        if strategy == "fsdp2":
            data_parallel.shard(model, optimizer)  # amp supports this order: shard, then initialize
        if self.initialize_kwargs is not None:
            model, optimizer = amp.initialize(model, optimizer, **self.initialize_kwargs,
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
        if self._uses_amp:
            loss = self.loss_fn(self.net, batch)
            self._sample()
            with amp.scale_loss(loss, self.optimizer) as scaled:
                scaled.backward()
            self._sample()
            self._timed_optimizer_step(self.optimizer.step)
        else:
            with torch.autocast(self.device.type, dtype=self.half_dtype):
                loss = self.loss_fn(self.net, batch)
            self._sample()
            if self._grad_scaler is not None:
                self._grad_scaler.scale(loss).backward()
                self._sample()
                scaler = self._grad_scaler
                self._timed_optimizer_step(lambda: scaler.step(self.optimizer))
                self._grad_scaler.update()
            else:
                loss.backward()
                self._sample()
                self._timed_optimizer_step(self.optimizer.step)
        self._sample()
        self.skipped = self._steps_taken == before
        return loss.detach()

    def _timed_optimizer_step(self, step: Callable[[], Any]) -> None:
        if self._sync_optimizer:
            torch.cuda.synchronize(self.device)
        t0 = time.perf_counter()
        step()
        if self._sync_optimizer:
            torch.cuda.synchronize(self.device)
        self.optimizer_seconds = time.perf_counter() - t0

    @property
    def loss_scale(self) -> float:
        """The current loss scale (1.0 when none is used). Synchronises with the device."""
        if self._uses_amp:
            return float(amp.state_dict()["loss_scaler0"]["loss_scale"])
        if self._grad_scaler is not None:
            return float(self._grad_scaler.get_scale())
        return 1.0

    def notes(self) -> list[str]:
        """What the row's setup decided that its row should say: which layers FP8 converted
        and which it left out, with why (:meth:`amp_patch.casting.fp8.Fp8Plan.summary`)."""
        plan = amp.fp8_plan() if self._uses_amp else None
        return [plan.summary()] if plan is not None else []

    def close(self) -> None:
        """Undo :func:`amp_patch.initialize` (a no-op for autocast); drop the DDP wrapper."""
        self.net = self.model  # DDP's reducer holds the process group
        if self._uses_amp:
            amp.deinitialize()


def _keeps_lean_state(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` (or the one a LARC wraps) takes low-precision state."""
    return bool(getattr(getattr(optimizer, "optim", optimizer), "LEAN_STATE", False))


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
