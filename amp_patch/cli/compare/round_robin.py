"""Opt levels trained side by side in persistent processes and timed round-robin.

``amp-patch compare`` and ``benchmarks/bench_e2e.py`` measure the same way,
through :func:`measure`:

- each level lives in its own spawned process for the whole measurement,
  so that O1's patches and one level's memory never touch another's;
- every process builds the same workload from the same seed, then trains
  ``warmup`` untimed steps;
- then come the timed rounds: in each, every level in turn trains its
  chunk of steps while the others wait, so that what else runs on the
  machine falls on all levels alike; the first level of a round rotates,
  so that none is always first;
- each step is timed on its own (batch creation left out, the device
  synchronised), and each round's peak memory is taken.

With a :attr:`JobSpec.strategy`, a level's process is instead a launcher
that starts ``nproc`` ranks in a process group of their own
(:func:`amp_patch.cli.compare.data_parallel.launch`), which train the level data-parallel,
each on its slice of every global batch. Rank 0 takes the parent's orders
and passes them on (one broadcast per chunk), reports the loss of the whole
batch (the mean over the ranks) and every rank's peak memory; the other
ranks print nothing.

A level's speed is then the median over rounds, with the min-max over
rounds as its spread (:class:`LevelRecord`).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import statistics
import time
import traceback
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.distributed as dist

from amp_patch.cli.compare import data_parallel, models
from amp_patch.cli.compare.trainer import CpuPeak, LevelTrainer, Preset, Unavailable
from amp_patch.cli.host_facts import cpu_count
from amp_patch.helpers import close_process_group
from amp_patch.settings.dtypes import HALF_DTYPE_NAMES

__all__ = ["JobSpec", "LevelRecord", "LevelPool", "measure", "split_steps", "median_step_seconds",
           "spawn_environment"]

#: How long the parent waits between checks that a silent level process is still alive.
_POLL_S = 0.2


@dataclass(frozen=True)
class JobSpec:
    """What every level process builds and how it trains. Picklable.

    Args:
        model (str or callable): a built-in model name, ``"pkg.module:factory"``
            or a picklable factory (see :mod:`amp_patch.cli.compare.models`).
        device (str, optional): Default: ``"cpu"``.
        half_dtype (str, optional): ``"bf16"`` or ``"fp16"``. Default: ``"bf16"``.
        seed (int, optional): seeds the weights and data. Default: 0.
        batch_size (int, optional): Default: the factory's own.
        threads (int, optional): ``torch.set_num_threads`` in each level
            process. Default: torch's default.
        cycle_batches (int, optional): 0 trains step ``k`` on ``batch_fn(k)``
            (a loss curve over fresh batches); ``n > 0`` builds ``n`` batches
            once and cycles through them (a benchmark that times only the
            step). Default: 0.
        report_steps (bool, optional): send every step's loss to the parent
            as it happens (for progress). Default: False.
        env (tuple of (str, str or None), optional): environment variables
            set (or, for None, unset) in the level processes at start
            (allocator settings, say). Default: none.
        level_models (tuple of (str, model), optional): levels that build
            another ``model`` than the others (the same network with the
            optimizer that is fastest at that level, say). Default: none.
        strategy (str, optional): ``"ddp"`` or ``"fsdp2"``: train each level
            over ``nproc`` ranks of its own process group (gloo on the CPU,
            NCCL on CUDA with GPU ``LOCAL_RANK`` per rank); ``batch_size`` is
            then the global batch, split over the data_parallel. Default: None, one
            process per level.
        nproc (int, optional): ranks per level under a ``strategy``. Their
            threads default to the CPUs shared out among them. Default: 1.
        presets (tuple of Preset, optional): rows beyond
            :data:`~amp_patch.cli.compare.trainer.LEVELS` that the processes may be asked
            for, by their names (a benchmark's grid of ``initialize`` options,
            say). Default: none.
        time_optimizer (bool, optional): synchronise the device around each
            ``optimizer.step()`` (its time is reported either way, see
            :attr:`LevelRecord.optimizer_step_seconds`). Default: False.
    """

    model: Any
    device: str = "cpu"
    half_dtype: str = "bf16"
    seed: int = 0
    batch_size: int | None = None
    threads: int | None = None
    cycle_batches: int = 0
    report_steps: bool = False
    env: tuple[tuple[str, str | None], ...] = ()
    level_models: tuple[tuple[str, Any], ...] = ()
    strategy: str | None = None
    nproc: int = 1
    presets: tuple[Preset, ...] = ()
    time_optimizer: bool = False


@dataclass
class LevelRecord:
    """Everything one level's process reported.

    Attributes:
        level (str): the level.
        error (str or None): the traceback (or how the process died), when it failed.
        unavailable (str or None): why the row cannot run with this workload
            (:class:`~amp_patch.cli.compare.trainer.Unavailable`): it was skipped, not failed.
        threads (int or None): torch threads the process ran with.
        memory_kind (str): ``"cuda_max_allocated"`` or ``"cpu_peak_anon_rss_delta"``.
        warmup_steps (int): untimed steps before the first round.
        losses (list of float): the loss of every step, warm-up included.
        loss_scales (list of float): the loss scale after every step.
        skipped (list of int): steps whose optimizer step was skipped.
        round_steps (list of int): steps trained in each timed round.
        round_seconds (list of float): time of each timed round (the sum of its steps' times).
        round_peak_bytes (list of int): peak memory within each timed round.
        step_seconds (list of float): every timed step's time, in order.
        optimizer_step_seconds (list of float): the time of every timed step's
            ``optimizer.step()`` call alone, in order.
        peak_bytes (int or None): peak memory over the whole run, warm-up
            included; under a strategy, of the rank with the most.
        rank_peak_bytes (list of int): under a strategy, each rank's peak
            memory over the whole run, warm-up included; else empty.
        round_rank_peak_bytes (list of list of int): under a strategy, each
            timed round's peak of each rank; else empty.
        notes (list of str): what the level's setup decided that its row should say
            (which layers FP8 converted).
    """

    level: str
    error: str | None = None
    unavailable: str | None = None
    threads: int | None = None
    notes: list[str] = field(default_factory=list)
    memory_kind: str = ""
    warmup_steps: int = 0
    losses: list[float] = field(default_factory=list)
    loss_scales: list[float] = field(default_factory=list)
    skipped: list[int] = field(default_factory=list)
    round_steps: list[int] = field(default_factory=list)
    round_seconds: list[float] = field(default_factory=list)
    round_peak_bytes: list[int] = field(default_factory=list)
    step_seconds: list[float] = field(default_factory=list)
    optimizer_step_seconds: list[float] = field(default_factory=list)
    peak_bytes: int | None = None
    rank_peak_bytes: list[int] = field(default_factory=list)
    round_rank_peak_bytes: list[list[int]] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """The row ran: it neither failed nor was unavailable."""
        return self.error is None and self.unavailable is None

    @property
    def round_speeds(self) -> list[float]:
        """Steps per second in each timed round."""
        return [n / s for n, s in zip(self.round_steps, self.round_seconds) if s > 0]

    def add_chunk(self, chunk: dict[str, Any], timed: bool) -> None:
        """Append a chunk of steps reported by the level's process."""
        self.losses += chunk["losses"]
        self.loss_scales += chunk["scales"]
        self.skipped += chunk["skipped"]
        if chunk["peak_bytes"] is not None:
            self.peak_bytes = max(self.peak_bytes or 0, chunk["peak_bytes"])
        per_rank = chunk.get("rank_peak_bytes")
        if per_rank is not None:
            self.rank_peak_bytes = ([max(a, b) for a, b in zip(self.rank_peak_bytes, per_rank)]
                                    if self.rank_peak_bytes else list(per_rank))
            if timed:
                self.round_rank_peak_bytes.append(list(per_rank))
        if timed:
            self.round_steps.append(len(chunk["seconds"]))
            self.round_seconds.append(sum(chunk["seconds"]))
            self.step_seconds += chunk["seconds"]
            self.optimizer_step_seconds += chunk.get("optimizer_seconds", [])
            if chunk["peak_bytes"] is not None:
                self.round_peak_bytes.append(chunk["peak_bytes"])
        else:
            self.warmup_steps += len(chunk["seconds"])


def split_steps(steps: int, rounds: int) -> list[int]:
    """``steps`` split into ``min(rounds, steps)`` near-equal chunks, larger ones first.

    Example::

        >>> split_steps(10, 4)
        [3, 3, 2, 2]
    """
    rounds = max(0, min(rounds, steps))
    if rounds == 0:
        return []
    base, extra = divmod(steps, rounds)
    return [base + (i < extra) for i in range(rounds)]


# --------------------------------------------------------------------------- the level process


class _Memory:
    """Peak memory within a chunk of steps: CUDA's allocator peak, or the CPU heap's."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cpu = CpuPeak()
        self.kind = "cuda_max_allocated" if device.type == "cuda" else "cpu_peak_anon_rss_delta"

    def begin(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            self.cpu.restart()

    def end(self) -> int:
        if self.device.type == "cuda":
            return int(torch.cuda.max_memory_allocated(self.device))
        return max(0, self.cpu.delta())


class _Level:
    """A level's workload, built once in its process (or in each rank), then trained by chunks."""

    def __init__(self, level: str, spec: JobSpec, device: torch.device) -> None:
        self.spec = spec
        self.device = device
        self.memory = _Memory(device)  # its CPU baseline is taken before the model exists
        self.rank, self.world = 0, 1
        if spec.strategy is not None:
            self.rank, self.world = dist.get_rank(), dist.get_world_size()
        torch.manual_seed(spec.seed)
        row: str | Preset = next((p for p in spec.presets if p.name == level), level)
        model_ref = dict(spec.level_models).get(level, spec.model)
        factory = models.resolve(model_ref) if isinstance(model_ref, str) else model_ref
        model, optimizer, self.batch_fn, loss_fn = models.build(factory, device, spec.batch_size,
                                                                spec.seed)
        self.trainer = LevelTrainer(row, model, optimizer, loss_fn, device,
                                    HALF_DTYPE_NAMES[spec.half_dtype],
                                    sample=self.memory.cpu.sample,
                                    strategy=spec.strategy, time_optimizer=spec.time_optimizer)
        self.cached = [self._batch(i) for i in range(spec.cycle_batches)]
        torch.manual_seed(spec.seed)  # what the model's own randomness (dropout) draws from
        self.step = 0

    def _batch(self, step: int) -> Any:
        batch = self.batch_fn(step)
        return batch if self.world == 1 else data_parallel.local_batch(batch, self.rank, self.world)

    def facts(self) -> dict[str, Any]:
        return {"threads": torch.get_num_threads(), "memory_kind": self.memory.kind,
                "notes": self.trainer.notes()}

    def train(self, n: int, send: Callable[[Any], None] | None) -> dict[str, Any]:
        """Train the next ``n`` steps; return the chunk (every rank's peaks on rank 0)."""
        spec, device = self.spec, self.device
        chunk: dict[str, Any] = {"losses": [], "scales": [], "skipped": [], "seconds": [],
                                 "optimizer_seconds": []}
        self.memory.begin()
        for _ in range(n):
            batch = (self.cached[self.step % len(self.cached)] if self.cached
                     else self._batch(self.step))
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            step_loss = self.trainer.step(batch)
            loss = step_loss.item()  # the step's one sync; a Python float for any dtype
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            chunk["seconds"].append(time.perf_counter() - t0)
            chunk["optimizer_seconds"].append(self.trainer.optimizer_seconds)
            if self.world > 1:  # the loss of the whole global batch; not timed
                loss = data_parallel.mean_over_ranks(step_loss)
            chunk["losses"].append(loss)
            chunk["scales"].append(self.trainer.loss_scale)
            if self.trainer.skipped:
                chunk["skipped"].append(self.step)
            if spec.report_steps and send is not None:
                send(("step", (self.step, loss)))
            self.step += 1
        chunk["peak_bytes"] = self.memory.end()
        if spec.strategy is not None:
            peaks: list[Any] | None = [None] * self.world if self.rank == 0 else None
            dist.gather_object(chunk["peak_bytes"], peaks, dst=0)
            if peaks is not None:
                chunk["rank_peak_bytes"] = peaks
                chunk["peak_bytes"] = max(peaks)
        return chunk

    def close(self) -> None:
        self.trainer.close()


def _serve(conn, level: str, spec: JobSpec) -> None:
    """A level's process: build the workload, then train chunks of steps when the parent asks."""
    try:
        if spec.threads:
            torch.set_num_threads(spec.threads)
        try:
            run = _Level(level, spec, torch.device(spec.device))
        except Unavailable as exc:
            conn.send(("unavailable", str(exc)))
            return
        conn.send(("ready", run.facts()))
        while True:
            cmd, n = conn.recv()
            if cmd == "stop":
                run.close()
                conn.send(("stopped", None))
                return
            conn.send(("chunk", run.train(n, conn.send)))
    except BaseException:
        try:
            conn.send(("error", traceback.format_exc()))
        except (OSError, ValueError):
            pass


def _serve_rank(conn, level: str, spec: JobSpec) -> None:
    """A rank of a level under a strategy: rank 0 talks with the parent, the others follow it."""
    lead = int(os.environ["RANK"]) == 0
    if not lead:
        conn.close()
        # Rank 0 speaks for the level. A failure still reaches the parent: the launcher
        # reads every failed rank's traceback from the agent's error files.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 1)
        os.dup2(devnull, 2)
        os.close(devnull)
    try:
        torch.set_num_threads(spec.threads or data_parallel.rank_threads(spec.nproc, cpu_count()))
        device = data_parallel.init_process_group(torch.device(spec.device).type)
        try:
            run = _Level(level, spec, device)
        except Unavailable as exc:  # every rank builds the same optimizer: all end here
            close_process_group()
            if lead:
                conn.send(("unavailable", str(exc)))
            return
        if lead:
            conn.send(("ready", run.facts()))
        while True:
            order: list[Any] = [conn.recv() if lead else None]
            dist.broadcast_object_list(order, src=0)
            cmd, n = order[0]
            if cmd == "stop":
                run.close()
                close_process_group()
                if lead:
                    conn.send(("stopped", None))
                return
            chunk = run.train(n, conn.send if lead else None)
            if lead:
                conn.send(("chunk", chunk))
    except BaseException:
        # The launcher reports the traceback of the rank that failed first; the others
        # were failing because of it, or alike.
        if data_parallel.first_to_fail():
            raise
        os._exit(0)


def _launch(conn, level: str, spec: JobSpec) -> None:
    """A level's process under a strategy: the elastic agent of its data_parallel."""
    try:
        data_parallel.launch(spec.nproc, _serve_rank, conn, level, spec)
    except BaseException as exc:
        try:
            conn.send(("error", f"{level} over {spec.nproc} ranks ({spec.strategy}): "
                                f"{data_parallel.failure_text(exc)}"))
        except (OSError, ValueError):
            pass


# --------------------------------------------------------------------------- the parent


@contextmanager
def spawn_environment(pairs: Sequence[tuple[str, str | None]]) -> Iterator[None]:
    """Set ``(name, value)`` environment variables for processes started inside the block.

    Spawned processes read the environment as they start (glibc's ``MALLOC_*``
    settings among it); the parent's own is put back on exit. A value of None
    unsets the variable, so that one the parent has does not reach them.

    Example::

        >>> with spawn_environment([("MALLOC_TOP_PAD_", "268435456")]):
        ...     os.environ["MALLOC_TOP_PAD_"]
        '268435456'
    """
    saved = {k: os.environ.get(k) for k, _ in pairs}
    for k, v in pairs:
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


class LevelPool:
    """One persistent process per level, driven from the parent.

    Args:
        spec (JobSpec): what each process builds.
        levels (sequence of str): the levels, one process each.
        on_step (callable, optional): ``on_step(level, step, loss)`` for each
            step, when ``spec.report_steps``.

    Example::

        >>> with LevelPool(JobSpec("mlp"), ["O0", "O2"]) as pool:
        ...     pool.start()
        ...     chunk = pool.train("O2", 5)
    """

    def __init__(self, spec: JobSpec, levels: Sequence[str],
                 on_step: Callable[[str, int, float], None] | None = None) -> None:
        self.spec = spec
        self.levels = list(levels)
        self.on_step = on_step
        self.records = {lv: LevelRecord(lv) for lv in self.levels}
        self._procs: dict[str, Any] = {}
        self._conns: dict[str, Any] = {}

    def __enter__(self) -> "LevelPool":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    @property
    def alive(self) -> list[str]:
        """The levels whose process has not failed, in order."""
        return [lv for lv in self.levels if self.records[lv].ok and lv in self._conns]

    def start(self) -> None:
        """Spawn every level's process (they build their models at once); wait for all."""
        ctx = mp.get_context("spawn")
        # A launcher starts the ranks, and a daemonic process may not have children.
        target, daemon = (_serve, True) if self.spec.strategy is None else (_launch, False)
        with spawn_environment(self.spec.env):
            for lv in self.levels:
                parent, child = ctx.Pipe()
                proc = ctx.Process(target=target, args=(child, lv, self.spec), daemon=daemon,
                                   name=f"amp-patch-{lv}")
                proc.start()
                child.close()
                self._procs[lv], self._conns[lv] = proc, parent
        for lv in self.levels:
            reply = self._receive(lv, "ready")
            if reply is not None:
                self.records[lv].threads = reply["threads"]
                self.records[lv].memory_kind = reply["memory_kind"]
                self.records[lv].notes = list(reply.get("notes", ()))

    def train(self, level: str, steps: int, timed: bool = True) -> bool:
        """Have ``level`` train its next ``steps`` steps; add them to its record.

        Returns:
            bool: False when the level failed (its record holds the error).
        """
        if level not in self.alive:
            return False
        try:
            self._conns[level].send(("train", steps))
        except OSError:
            pass  # it died waiting for this order: _receive reads its last words, or its death
        chunk = self._receive(level, "chunk")
        if chunk is None:
            return False
        self.records[level].add_chunk(chunk, timed)
        return True

    def _receive(self, level: str, expected: str) -> Any:
        conn, proc = self._conns[level], self._procs[level]
        while True:
            if not conn.poll(_POLL_S):
                if proc.is_alive():
                    continue
                if not conn.poll(1.0):  # it may have written its last words just before exiting
                    self._fail(level, f"the {level} process died with exit code {proc.exitcode} "
                                      "and no traceback")
                    return None
            try:
                kind, payload = conn.recv()
            except (EOFError, OSError):
                self._fail(level, f"the {level} process closed its pipe "
                                  f"(exit code {proc.exitcode})")
                return None
            if kind == "step":
                if self.on_step is not None:
                    self.on_step(level, *payload)
            elif kind == expected:
                return payload
            elif kind == "unavailable":
                self.records[level].unavailable = payload
                self._drop(level)
                return None
            else:
                self._fail(level, payload)
                return None

    def _fail(self, level: str, error: str) -> None:
        self.records[level].error = error
        self._drop(level)

    def _drop(self, level: str) -> None:
        proc = self._procs.pop(level)
        self._conns.pop(level).close()
        proc.join(timeout=5)
        if proc.is_alive():
            proc.terminate()

    def close(self) -> None:
        """Stop every process (each undoes its amp state first) and wait for them."""
        for lv in list(self._conns):
            try:
                self._conns[lv].send(("stop", 0))
                self._receive(lv, "stopped")
            except (OSError, BrokenPipeError):
                pass
        for lv, proc in list(self._procs.items()):
            proc.join(timeout=30)
            if proc.is_alive():
                proc.terminate()
                proc.join()
            self._conns.pop(lv).close()
        self._procs.clear()


def measure(spec: JobSpec, levels: Sequence[str], warmup: int, rounds: Sequence[int],
            on_step: Callable[[str, int, float], None] | None = None,
            on_round: Callable[[int, dict[str, LevelRecord]], None] | None = None,
            on_ready: Callable[[dict[str, LevelRecord]], None] | None = None,
            ) -> dict[str, LevelRecord]:
    """Train every level in its own process; time them round-robin.

    Args:
        spec (JobSpec): the workload and how to train it.
        levels (sequence of str): the levels.
        warmup (int): untimed steps per level first.
        rounds (sequence of int): steps per level in each timed round
            (see :func:`split_steps`).
        on_step (callable, optional): ``on_step(level, step, loss)``, when
            ``spec.report_steps``.
        on_round (callable, optional): ``on_round(r, records)`` after timed
            round ``r`` (0-based) and, with ``r = -1``, after the warm-up.
        on_ready (callable, optional): ``on_ready(records)`` once every
            process has built its workload.

    Returns:
        dict: level to its :class:`LevelRecord`, in the order of ``levels``.
        A level that failed has its ``error`` set; the others still ran.
    """
    with LevelPool(spec, levels, on_step) as pool:
        pool.start()
        if on_ready is not None:
            on_ready(pool.records)
        if warmup > 0:
            for lv in pool.alive:
                pool.train(lv, warmup, timed=False)
            if on_round is not None:
                on_round(-1, pool.records)
        for r, steps in enumerate(rounds):
            alive = pool.alive
            if not alive:
                break
            k = r % len(alive)
            for lv in alive[k:] + alive[:k]:
                pool.train(lv, steps)
            if on_round is not None:
                on_round(r, pool.records)
    return pool.records


def median_step_seconds(record: LevelRecord) -> float | None:
    """The median of a level's timed step times, or None when it has none."""
    return statistics.median(record.step_seconds) if record.step_seconds else None
