"""``amp-patch compare``'s plot: loss and loss scale against step, speed and memory per level."""

from __future__ import annotations

from pathlib import Path

from amp_patch.cli import host_facts
from amp_patch.cli.compare.results import Comparison, LevelResult

__all__ = ["write_plot"]

_STYLES = {"O0": ("black", "-", 2.2), "O1": ("tab:blue", "-", 1.4), "O2": ("tab:orange", "-", 1.4),
           "O3": ("tab:red", "-", 1.4), "O2-lean": ("tab:purple", "-.", 1.6),
           "O2+fp8": ("tab:brown", ":", 1.8),
           "autocast": ("tab:green", "--", 1.6)}


def write_plot(comparison: Comparison, path: Path, title: str) -> None:
    """Write a PNG: loss and loss scale against step, speed and memory per level with their spread.

    Skipped steps are marked with an ``x`` on the loss curve. The speed panel
    shows each level's median steps/s as a bar, the min-max over rounds as
    an error bar and every round as a dot; the memory panel the peak as a
    bar and every round's peak as a dot; over several ranks, the largest
    rank's peak as a bar and each rank's peak as a dot.

    Args:
        comparison (Comparison): the run; failed levels are left out.
        path (Path): the PNG to write.
        title (str): the figure's title.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = [r for r in comparison.results if r.ok]
    fig = plt.figure(figsize=(9, 10.5))
    grid = fig.add_gridspec(3, 2, height_ratios=[3, 1.4, 2])
    ax_loss = fig.add_subplot(grid[0, :])
    ax_scale = fig.add_subplot(grid[1, :], sharex=ax_loss)
    ax_speed, ax_mem = fig.add_subplot(grid[2, 0]), fig.add_subplot(grid[2, 1])
    for r in results:
        color, ls, lw = _STYLES.get(r.level, (None, "-", 1.4))
        steps = range(len(r.losses))
        ax_loss.plot(steps, r.losses, color=color, ls=ls, lw=lw, label=r.level)
        if r.skipped:
            ax_loss.plot(r.skipped, [r.losses[i] for i in r.skipped], "x", color=color, ms=7,
                         label=f"{r.level} skipped step")
        ax_scale.step(steps, r.loss_scales, where="post", color=color, ls=ls, lw=lw, label=r.level)
    ax_loss.set_ylabel("training loss")
    ax_loss.set_title(title, fontsize=10)
    ax_loss.grid(alpha=0.3)
    ax_loss.legend(ncol=2, fontsize=9)
    scales = {v for r in results for v in r.loss_scales}
    if len(scales) == 1:
        # A flat line reads as "nothing plotted"; say what it means.
        ax_scale.text(0.5, 0.75, f"loss scale {scales.pop():g} throughout, at every level",
                      transform=ax_scale.transAxes, ha="center", fontsize=9, color="dimgray")
    ax_scale.set_yscale("log", base=2)
    ax_scale.set_ylabel("loss scale")
    ax_scale.set_xlabel("step")
    ax_scale.grid(alpha=0.3)
    _spread_panel(ax_speed, results, lambda r: r.round_steps_per_s, lambda r: r.steps_per_s,
                  "steps/s (median, min-max, rounds)", 1.0)
    if len(comparison.rounds) < host_facts.MIN_ROUNDS:
        ax_speed.text(0.5, 0.5,
                      f"fewer than {host_facts.MIN_ROUNDS} timed rounds:\nno speed figures",
                      transform=ax_speed.transAxes, ha="center", va="center", color="dimgray")
    if comparison.strategy is not None:
        _spread_panel(ax_mem, results, lambda r: r.rank_peak_memory_bytes or [],
                      lambda r: r.peak_memory_bytes,
                      "peak MiB per rank (largest, ranks)", 2**20)
    else:
        _spread_panel(ax_mem, results, lambda r: r.round_peak_bytes,
                      lambda r: r.peak_memory_bytes, "peak memory, MiB (peak, rounds)", 2**20)
    if comparison.warnings:
        reasons = "; ".join(w.split(":")[0] for w in comparison.warnings)
        fig.text(0.5, 0.005, f"warning, speed ratios unreliable: {reasons}", ha="center",
                 va="bottom", fontsize=7, color="tab:red", wrap=True)
    fig.tight_layout(rect=(0, 0.03 if comparison.warnings else 0, 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _spread_panel(ax, results: list[LevelResult], rounds_of, value_of, label: str,
                  unit: float) -> None:
    for i, r in enumerate(results):
        color = _STYLES.get(r.level, (None,))[0]
        rounds = [v / unit for v in rounds_of(r)]
        value = value_of(r)
        if value is not None:
            value /= unit
            ax.bar(i, value, color=color, alpha=0.35, width=0.6)
            if rounds:
                ax.errorbar(i, value, yerr=[[value - min(rounds)], [max(rounds) - value]],
                            color=color, capsize=4, lw=1.2)
        if rounds:
            ax.plot([i] * len(rounds), rounds, ".", color=color, ms=4)
    ax.set_xticks(range(len(results)), [r.level for r in results])
    ax.set_ylabel(label, fontsize=9)
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3, axis="y")
