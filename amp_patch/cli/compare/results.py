"""``amp-patch compare``'s results: what each level produced, and the run that measures them.

:func:`run_compare` trains every level in its own process, timed
round-robin (:mod:`amp_patch.cli.compare.round_robin`), and returns a :class:`Comparison`:
one :class:`LevelResult` per level, the host and the load. The table
(:mod:`~amp_patch.cli.compare.table`), the plot (:mod:`~amp_patch.cli.compare.plot`)
and the JSON of the command (:mod:`~amp_patch.cli.compare.command`) are made from it.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from amp_patch.cli import host_facts
from amp_patch.cli.compare import models
from amp_patch.cli.compare.progress import make_progress
from amp_patch.cli.compare.round_robin import JobSpec, LevelRecord, measure, split_steps
from amp_patch.cli.compare.trainer import LEVELS, PRESETS

__all__ = ["LEVELS", "LevelResult", "Comparison", "derive", "run_compare"]


@dataclass
class LevelResult:
    """What one level's run produced (or how it failed).

    Attributes:
        level (str): ``"O0"`` ... ``"O3"``, a preset (``"O2-lean"``) or ``"autocast"``.
        ok (bool): the run finished.
        error (str or None): the traceback when it did not.
        unavailable (str or None): why the row did not run with this workload
            (a lean preset with an optimizer that cannot keep lean state): skipped,
            not failed.
        steps_per_s (float or None): median over timed rounds of the
            round's steps per second; None with fewer than
            :data:`~amp_patch.cli.host_facts.MIN_ROUNDS` rounds.
        steps_per_s_range (list of float or None): min and max over rounds.
        round_steps_per_s (list of float): every timed round's steps per second.
        speedup_vs_O0 (float or None): median over rounds of this level's
            round speed over O0's in the same round.
        speedup_range (list of float or None): min and max of those ratios.
        peak_memory_bytes (int or None): peak over the timed rounds; see
            ``memory_kind``. Over several ranks, the largest rank's.
        round_peak_bytes (list of int): each timed round's peak (of the largest rank).
        rank_peak_memory_bytes (list of int or None): over several ranks,
            each rank's peak over the timed rounds, by rank; else None.
        round_rank_peak_bytes (list of list of int): over several ranks, each
            timed round's peak of each rank.
        memory_kind (str): ``"cuda_max_allocated"`` or ``"cpu_peak_anon_rss_delta"``.
        losses (list of float): the loss of every step, warm-up included.
        loss_scales (list of float): the loss scale after every step (1.0 when none is used).
        skipped (list of int): steps whose optimizer step was skipped (overflow).
        max_abs_loss_diff_vs_O0 (float or None): max over steps of ``|loss - O0 loss|``.
        warmup_steps (int): untimed steps before the rounds.
        threads (int or None): torch threads of the level's process.
        notes (list of str): what the level's setup decided (which layers FP8
            converted, and which it left out and why).
    """

    level: str
    ok: bool = False
    error: str | None = None
    unavailable: str | None = None
    steps_per_s: float | None = None
    steps_per_s_range: list[float] | None = None
    round_steps_per_s: list[float] = field(default_factory=list)
    speedup_vs_O0: float | None = None
    speedup_range: list[float] | None = None
    peak_memory_bytes: int | None = None
    round_peak_bytes: list[int] = field(default_factory=list)
    rank_peak_memory_bytes: list[int] | None = None
    round_rank_peak_bytes: list[list[int]] = field(default_factory=list)
    memory_kind: str = ""
    losses: list[float] = field(default_factory=list)
    loss_scales: list[float] = field(default_factory=list)
    skipped: list[int] = field(default_factory=list)
    max_abs_loss_diff_vs_O0: float | None = None
    warmup_steps: int = 0
    threads: int | None = None
    notes: list[str] = field(default_factory=list)

    @classmethod
    def from_record(cls, record: LevelRecord) -> "LevelResult":
        """The result of a level from what its process reported."""
        speeds = record.round_speeds
        enough = len(speeds) >= host_facts.MIN_ROUNDS
        peaks = record.round_peak_bytes
        rank_rounds = record.round_rank_peak_bytes
        rank_peaks = ([max(by_rank) for by_rank in zip(*rank_rounds)] if rank_rounds
                      else record.rank_peak_bytes or None)
        return cls(level=record.level, ok=record.ok, error=record.error,
                   unavailable=record.unavailable,
                   steps_per_s=statistics.median(speeds) if enough else None,
                   steps_per_s_range=[min(speeds), max(speeds)] if speeds else None,
                   round_steps_per_s=speeds,
                   peak_memory_bytes=max(peaks) if peaks else record.peak_bytes,
                   round_peak_bytes=peaks, rank_peak_memory_bytes=rank_peaks,
                   round_rank_peak_bytes=rank_rounds, memory_kind=record.memory_kind,
                   losses=record.losses,
                   loss_scales=record.loss_scales, skipped=record.skipped,
                   warmup_steps=record.warmup_steps, threads=record.threads,
                   notes=list(record.notes))

    @property
    def final_loss(self) -> float | None:
        return self.losses[-1] if self.losses else None

    @property
    def final_loss_scale(self) -> float | None:
        return self.loss_scales[-1] if self.loss_scales else None

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(final_loss=self.final_loss, final_loss_scale=self.final_loss_scale,
                 skipped_steps=len(self.skipped))
        return _finite_or_none(d)


@dataclass
class Comparison:
    """A whole run of ``compare``: the levels' results and the conditions they were measured in.

    Attributes:
        results (list of LevelResult): in the order the levels were asked for.
        host (HostFacts): the host.
        load (LoadMonitor): the load around the run.
        rounds (list of int): steps per level in each timed round.
        warnings (list of str): why the speed ratios may not be trusted.
        nproc (int): ranks per level.
        strategy (str or None): ``"ddp"`` or ``"fsdp2"`` when the levels ran over ranks.
        half_dtype (str): ``"bf16"`` or ``"fp16"``, the run's half type.
    """

    results: list[LevelResult]
    host: host_facts.HostFacts
    load: host_facts.LoadMonitor
    rounds: list[int]
    warnings: list[str] = field(default_factory=list)
    nproc: int = 1
    strategy: str | None = None
    half_dtype: str = "bf16"

    def spreads(self) -> dict[str, float | None]:
        """Relative spread over rounds of every level's speed and speed-up."""
        out: dict[str, float | None] = {}
        for r in self.results:
            if r.ok and r.steps_per_s is not None:
                out[f"{r.level} steps/s"] = host_facts.relative_spread(r.round_steps_per_s)
                if r.level != "O0" and r.speedup_range is not None and r.speedup_vs_O0:
                    low, high = r.speedup_range
                    out[f"{r.level}/O0"] = (high - low) / r.speedup_vs_O0
        return out


def _finite_or_none(obj: Any) -> Any:
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite_or_none(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_finite_or_none(v) for v in obj]
    return obj


def derive(results: list[LevelResult]) -> None:
    """Fill in each result's speed-up and loss difference against O0's (a no-op without O0)."""
    base = next((r for r in results if r.level == "O0" and r.ok), None)
    if base is None:
        return
    for r in results:
        if not r.ok:
            continue
        # Ratios within a round: both levels ran minutes apart at most, under the same load.
        ratios = [a / b for a, b in zip(r.round_steps_per_s, base.round_steps_per_s) if b > 0]
        measured = r.steps_per_s is not None and base.steps_per_s is not None
        if measured and len(ratios) >= host_facts.MIN_ROUNDS:
            r.speedup_vs_O0 = statistics.median(ratios)
            r.speedup_range = [min(ratios), max(ratios)]
        diffs = [abs(a - b) for a, b in zip(r.losses, base.losses)]
        r.max_abs_loss_diff_vs_O0 = max(diffs) if diffs else None


def run_compare(job: dict[str, Any], levels: list[str], console=None,
                progress_interval: float = 5.0) -> Comparison:
    """Train every level in its own process, timed round-robin, with progress on ``console``.

    Args:
        job (dict): ``model``, ``steps``, ``warmup``, ``rounds``,
            ``batch_size``, ``device``, ``half_dtype`` (``"bf16"``/``"fp16"``) and
            ``seed``; optionally ``strategy`` (``"ddp"``/``"fsdp2"``: each level
            over ``nproc`` ranks) and ``nproc``.
        levels (list of str): a subset of :data:`LEVELS`.
        console (rich.console.Console, optional): where progress goes. Default: stdout.
        progress_interval (float, optional): least seconds between plain
            progress lines of one level when ``console`` is not a terminal. Default: 5.

    Returns:
        Comparison: the results, the host, the load and the warnings.

    Example::

        >>> job = dict(model="mlp", steps=20, warmup=2, rounds=6, batch_size=None,
        ...            device="cpu", half_dtype="bf16", seed=0)
        >>> comparison = run_compare(job, ["O0", "O2"])
        >>> comparison.results[1].speedup_vs_O0
        1.8
    """
    from rich.console import Console

    console = console or Console()
    strategy, nproc = job.get("strategy"), job.get("nproc", 1)
    # The presets that need amp_patch's fused optimizers build the workload with one.
    level_models = tuple((lv, models.fused_variant(job["model"])) for lv in levels
                         if lv in PRESETS and PRESETS[lv].lean_state)
    spec = JobSpec(job["model"], device=job["device"], half_dtype=job["half_dtype"],
                   seed=job["seed"], batch_size=job["batch_size"], report_steps=True,
                   strategy=strategy, nproc=nproc, level_models=level_models)
    rounds = split_steps(job["steps"] - job["warmup"], job["rounds"])
    load = host_facts.LoadMonitor().start()
    with make_progress(levels, job["steps"], console, "compare", progress_interval) as progress:
        failed: set[str] = set()

        def tell_failures(records: dict[str, LevelRecord]) -> None:
            for lv, rec in records.items():
                if not rec.ok and lv not in failed:
                    failed.add(lv)
                    progress.status(lv, "FAILED" if rec.unavailable is None else "skipped",
                                    done=True)

        def ready(records: dict[str, LevelRecord]) -> None:
            tell_failures(records)
            for lv, rec in records.items():
                if rec.ok:
                    progress.status(lv, "ready")

        records = measure(spec, levels, job["warmup"], rounds, on_step=progress.step,
                          on_round=lambda r, recs: tell_failures(recs), on_ready=ready)
        results = [LevelResult.from_record(records[lv]) for lv in levels]
        for r in results:
            if r.ok:
                speed = f"{r.steps_per_s:.2f} steps/s, " if r.steps_per_s is not None else ""
                progress.status(r.level, f"done: {speed}final loss {r.final_loss:.4f}", done=True)
    load.stop()
    derive(results)
    threads = next((r.threads for r in results if r.threads), torch.get_num_threads())
    host = host_facts.HostFacts.collect(job["device"], threads)
    comparison = Comparison(results, host, load, rounds, nproc=nproc, strategy=strategy,
                            half_dtype=job["half_dtype"])
    comparison.warnings = host_facts.reliability_warnings(load, comparison.spreads(), host.cpus,
                                                       ranks=nproc if strategy else 1)
    return comparison
