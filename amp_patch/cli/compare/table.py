"""``amp-patch compare``'s table: a row per level, the conditions of the run in its caption."""

from __future__ import annotations

import math

from amp_patch.cli import host_facts
from amp_patch.cli.compare.results import Comparison, LevelResult
from amp_patch.cli.compare.trainer import PRESETS

__all__ = ["render_table", "ranks_line"]


def _fmt(value: float | None, spec: str, suffix: str = "") -> str:
    if value is None:
        return "-"
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return f"{value:{spec}}{suffix}"


def _with_range(value: float | None, bounds: list[float] | None, spec: str,
                suffix: str = "") -> str:
    if value is None:
        return "n/a"
    text = f"{value:{spec}}{suffix}"
    if bounds is not None:
        text += f" ({bounds[0]:{spec}}-{bounds[1]:{spec}})"
    return text


def _memory(r: LevelResult) -> str:
    if r.peak_memory_bytes is None:
        return "-"
    return f"{r.peak_memory_bytes / 2**20:.0f} MiB"


def _rank_memory(r: LevelResult) -> str:
    peaks = [b / 2**20 for b in r.rank_peak_memory_bytes or []]
    if not peaks:
        return "-"
    if len(peaks) > 4:  # a column of eight figures reads worse than its range
        return f"{min(peaks):.0f}-{max(peaks):.0f} MiB"
    return "/".join(f"{p:.0f}" for p in peaks) + " MiB"


def ranks_line(comparison: Comparison) -> str | None:
    """The caption line that says how the levels ran over ranks; None for one process each."""
    if comparison.strategy is None:
        return None
    name = {"ddp": "DistributedDataParallel", "fsdp2": "FSDP2's fully_shard"}[comparison.strategy]
    return (f"each level over {comparison.nproc} rank{'s' * (comparison.nproc > 1)} "
            f"({name}), each on its 1/{comparison.nproc} of every global batch; "
            "peak mem is the largest rank's, per rank lists rank 0, 1, ...")


def render_table(comparison: Comparison, title: str):
    """A :class:`rich.table.Table`: a row per level, the conditions in its caption."""
    from rich import box
    from rich.table import Table
    from rich.text import Text

    by_rank = comparison.strategy is not None
    headers = ("level", "steps/s (min-max)", "speed-up (min-max)", "peak mem",
               *(("per rank",) if by_rank else ()),
               "final loss", "max |Δloss|", "skipped", "scale")
    rows = []
    for r in comparison.results:
        if r.unavailable is not None:
            rows.append([r.level, *["-"] * (len(headers) - 2), "[yellow]skipped"])
            continue
        if not r.ok:
            rows.append([r.level, *["-"] * (len(headers) - 2), "[red]FAILED"])
            continue
        rows.append([
            r.level, _with_range(r.steps_per_s, r.steps_per_s_range, ".2f"),
            _with_range(r.speedup_vs_O0, None if r.level == "O0" else r.speedup_range, ".2f", "x"),
            _memory(r), *((_rank_memory(r),) if by_rank else ()),
            _fmt(r.final_loss, ".4f"), _fmt(r.max_abs_loss_diff_vs_O0, ".2e"), str(len(r.skipped)),
            _fmt(r.final_loss_scale, "g")])
    warmup = next((r.warmup_steps for r in comparison.results if r.ok), 0)
    caption = [f"{len(comparison.rounds)} timed rounds of {_steps_per_round(comparison.rounds)} "
               f"steps per level after {warmup} warm-up steps; speeds are medians over rounds, "
               "speed-up and max |Δloss| are against O0 (per round, per step)",
               *filter(None, [ranks_line(comparison)]),
               *(f"{r.level}: {PRESETS[r.level].about}" for r in comparison.results
                 if r.level in PRESETS),
               *(f"{r.level}: {note}" for r in comparison.results for note in r.notes),
               *filter(None, [_autocast_label(comparison)]),
               comparison.host.line(), comparison.load.line()]
    if len(comparison.rounds) < host_facts.MIN_ROUNDS:
        caption.append(f"n/a: a speed needs at least {host_facts.MIN_ROUNDS} timed rounds, "
                       f"this run had {len(comparison.rounds)} (raise --steps or --rounds)")
    table = Table(title=title, box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True,
                  caption="\n".join(caption))
    for i, name in enumerate(headers):
        # Wide enough for every cell, so a narrow terminal never turns numbers into ellipses.
        width = max([len(name)] + [len(Text.from_markup(row[i]).plain) for row in rows])
        table.add_column(name, justify="left" if i == 0 else "right", no_wrap=True, min_width=width)
    for row in rows:
        table.add_row(*row)
    return table


def _autocast_label(comparison: Comparison) -> str | None:
    """The caption's line on what the autocast row cost on this host, when it ran at a cost."""
    if not any(r.level == "autocast" for r in comparison.results):
        return None
    cost = host_facts.autocast_cost(comparison.host, comparison.half_dtype)
    return cost.label() if cost is not None else None


def _steps_per_round(rounds: list[int]) -> str:
    if not rounds:
        return "0"
    return str(rounds[0]) if min(rounds) == max(rounds) else f"{min(rounds)}-{max(rounds)}"
