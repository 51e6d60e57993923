"""Progress of the levels while they train: rich bars on a terminal, plain lines elsewhere.

On a terminal, each level has a live bar (steps, elapsed time, loss). When
stdout is not a terminal (``| tee``, a CI log), live bars would print
nothing until the end, so each level prints a plain line instead, at most
every ``interval`` seconds, and at its last step::

    compare: O2 step 40/100 loss 2.3456 elapsed 12.3 s
"""

from __future__ import annotations

import time
from typing import Any, Sequence

__all__ = ["LevelProgress", "make_progress"]


class LevelProgress:
    """Progress of several levels; the base class prints nothing.

    Subclasses report what :meth:`step` and :meth:`status` tell them. Use as
    a context manager around the run.

    Args:
        levels (sequence of str): the levels, in display order.
        total (int): steps per level.
    """

    def __init__(self, levels: Sequence[str], total: int) -> None:
        self.levels = list(levels)
        self.total = total
        self.started = time.perf_counter()

    def __enter__(self) -> "LevelProgress":
        return self

    def __exit__(self, *exc: Any) -> None:
        return None

    def step(self, level: str, step: int, loss: float) -> None:
        """Step ``step`` (0-based) of ``level`` ended with ``loss``."""

    def status(self, level: str, text: str, done: bool = False) -> None:
        """A word on ``level`` (starting, ready, failed, its final speed)."""


class _RichProgress(LevelProgress):
    def __init__(self, levels: Sequence[str], total: int, console: Any) -> None:
        super().__init__(levels, total)
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
        )

        columns = (TextColumn("{task.description:>9}"), BarColumn(), MofNCompleteColumn(),
                   TimeElapsedColumn(), TextColumn("{task.fields[info]}"))
        self._progress = Progress(*columns, console=console)
        self._tasks = {lv: self._progress.add_task(lv, total=total, info="starting")
                       for lv in self.levels}

    def __enter__(self) -> "_RichProgress":
        self._progress.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._progress.__exit__(*exc)

    def step(self, level: str, step: int, loss: float) -> None:
        self._progress.update(self._tasks[level], completed=step + 1, info=f"loss {loss:.4f}")

    def status(self, level: str, text: str, done: bool = False) -> None:
        self._progress.update(self._tasks[level], info=text)
        if done:
            self._progress.stop_task(self._tasks[level])


class _PlainProgress(LevelProgress):
    def __init__(self, levels: Sequence[str], total: int, stream: Any, prefix: str,
                 interval: float) -> None:
        super().__init__(levels, total)
        self.stream, self.prefix, self.interval = stream, prefix, interval
        self._last = {lv: float("-inf") for lv in self.levels}

    def _line(self, text: str) -> None:
        self.stream.write(f"{self.prefix}: {text}\n")
        self.stream.flush()

    def step(self, level: str, step: int, loss: float) -> None:
        now = time.perf_counter()
        if now - self._last[level] >= self.interval or step + 1 == self.total:
            self._last[level] = now
            self._line(f"{level} step {step + 1}/{self.total} loss {loss:.4f} "
                       f"elapsed {now - self.started:.1f} s")

    def status(self, level: str, text: str, done: bool = False) -> None:
        self._line(f"{level} {text}")


def make_progress(levels: Sequence[str], total: int, console: Any, prefix: str,
                  interval: float = 5.0) -> LevelProgress:
    """Rich bars when ``console`` is a terminal, else plain lines on its file.

    Args:
        levels (sequence of str): the levels, in display order.
        total (int): steps per level.
        console (rich.console.Console): where progress goes.
        prefix (str): the plain lines' prefix (the command's name).
        interval (float, optional): least seconds between two plain lines of
            one level. Default: 5.

    Example::

        >>> import io
        >>> from rich.console import Console
        >>> console = Console(file=io.StringIO())
        >>> with make_progress(["O0", "O2"], 100, console, "compare") as progress:
        ...     progress.step("O0", 0, 6.3)
    """
    if console.is_terminal:
        return _RichProgress(levels, total, console)
    return _PlainProgress(levels, total, console.file, prefix, interval)
