"""Accuracy of the lean optimizer state: loss curves at O2 against each ``optimizer_state`` setting.

Trains two built-in workloads of ``amp_patch.cli.compare.models`` in bf16 at O2:

- the compare LM (:data:`~amp_patch.cli.compare.models.COMPARE_LM`) with amp_patch's
  ``FusedAdam`` (AdamW mode, lr 3e-3, weight decay 0.01), 300 steps;
- the conv net with ``FusedSGD`` (momentum 0.9, lr 0.05: the workload's own
  optimizer, made fused), 300 steps, with 30% of its labels redrawn at random
  so that its loss has a floor (:func:`convnet_workload`).

Each trains at O2 as it is today (``optimizer_state="fp32"``,
``master_weights=True``) with seeds 0, 1 and 2, which gives O2's own seed
spread (a seed draws the initial weights and the data), and with seed 0 at
every lean setting: ``optimizer_state`` ``"fp32"``, ``"bf16"``, ``"int8"``,
``"fp8"``, each with fp32 masters (``True``) and bf16 masters (``"bf16"``).
A control run steps the bf16 params with no masters at all
(``master_weights=False``, fp32 state), which rounds each update to nearest
bf16: what bf16 masters would be without stochastic rounding.

The final loss of a run is the mean of its last 20 steps' losses. The script
writes the curves and the final losses as JSON (``docs/lean_state.json``), a
plot (``docs/lean_state.png``), and the table into the ``accuracy`` section
of ``docs/lean_state.md``.

Run: ``python benchmarks/accuracy_lean_state.py`` (about 25 minutes on two
CPU cores). On a busy machine, one thread per process is several times faster
than two: ``--threads 1 --models lm`` and ``--threads 1 --models convnet`` in
two processes fill in the same JSON, and the one that ends last writes the
plot and the table. ``--lm-steps``, ``--convnet-steps`` shorten the runs;
``--no-write`` prints the table without writing the plot or the docs. Runs
already in the JSON (same model and steps) are not trained again: delete
``docs/lean_state.json`` to measure anew.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch
from rich.console import Console

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

import amp_patch as amp  # noqa: E402
from amp_patch.cli.compare import models  # noqa: E402
from amp_patch.cli.compare.progress import make_progress  # noqa: E402
from amp_patch.optim.fused import FusedSGD  # noqa: E402

DOCS = Path(__file__).resolve().parent.parent / "docs"
#: Steps whose mean loss is a run's final loss.
TAIL = 20
#: Seeds of the O2 baseline; the lean settings run with the first.
BASELINE_SEEDS = (0, 1, 2)
#: Share of the conv net's labels redrawn uniformly (see :func:`convnet_workload`).
LABEL_NOISE = 0.3


@dataclasses.dataclass(frozen=True)
class Setting:
    """One configuration of :func:`amp_patch.initialize` at O2."""

    optimizer_state: str
    master_weights: bool | str

    @property
    def label(self) -> str:
        """A short name: ``"int8 / bf16 masters"``, ``"O2 (fp32 / fp32 masters)"``."""
        if self.master_weights is False:
            return "no masters (bf16, round to nearest)"
        masters = "bf16" if self.master_weights == "bf16" else "fp32"
        name = f"{self.optimizer_state} state / {masters} masters"
        return f"O2 ({name})" if self == O2 else name


O2 = Setting("fp32", True)
#: The lean settings, each run with seed 0, then the round-to-nearest control.
LEAN = tuple(Setting(state, masters) for state in ("fp32", "bf16", "int8", "fp8")
             for masters in (True, "bf16") if Setting(state, masters) != O2)
CONTROL = Setting("fp32", False)


def lm_workload(seed: int) -> models.Workload:
    """The compare LM with amp_patch's FusedAdam (AdamW mode)."""
    return models.lm(seed=seed, fused_adam=True)


def convnet_workload(seed: int) -> models.Workload:
    """The conv net with its SGD (momentum 0.9, lr 0.05) made amp_patch's FusedSGD, and
    :data:`LABEL_NOISE` of its labels redrawn at random.

    The conv net's noisy templates are separable: its loss falls towards 0,
    where a gap in % means nothing. Random labels give the loss a floor (their
    entropy, about 1.2 nats), as the bigram chain gives the LM's.
    """
    model, optimizer, batch_fn, loss_fn = models.convnet(seed=seed)
    group = optimizer.param_groups[0]
    fused = FusedSGD(model.parameters(), lr=group["lr"], momentum=group["momentum"])
    classes = model[-1].out_features

    def noisy_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = batch_fn(step)
        g = torch.Generator().manual_seed(seed * 1_000_003 + step + 7_777_777)
        redraw = torch.rand(y.shape, generator=g) < LABEL_NOISE
        return x, torch.where(redraw, torch.randint(classes, y.shape, generator=g), y)

    return models.Workload(model, fused, noisy_batch, loss_fn)


WORKLOADS: dict[str, Callable[[int], models.Workload]] = {
    "lm": lm_workload, "convnet": convnet_workload}
DEFAULT_STEPS = {"lm": 300, "convnet": 300}


def train(factory: Callable[[int], models.Workload], setting: Setting, seed: int, steps: int,
          on_step: Callable[[int, float], None]) -> tuple[list[float], float]:
    """Train ``steps`` steps at O2 under ``setting``; the per-step losses and seconds per step."""
    model, optimizer, batch_fn, loss_fn = factory(seed)
    model, optimizer = amp.initialize(
        model, optimizer, opt_level="O2", half_dtype=torch.bfloat16, verbosity=0,
        optimizer_state=setting.optimizer_state, master_weights=setting.master_weights)
    losses: list[float] = []
    try:
        started = time.perf_counter()
        for step in range(steps):
            optimizer.zero_grad()
            loss = loss_fn(model, batch_fn(step))
            with amp.scale_loss(loss, optimizer) as scaled:
                scaled.backward()
            optimizer.step()
            losses.append(loss.item())
            on_step(step, losses[-1])
        seconds = (time.perf_counter() - started) / steps
    finally:
        amp.deinitialize()
    return losses, seconds


def optimizer_bytes(factory: Callable[[int], models.Workload], setting: Setting) -> float:
    """Bytes the optimizer holds per model parameter under ``setting``, after one step:
    its state (codes and scales) and the masters that are not the model's own params."""
    model, optimizer, batch_fn, loss_fn = factory(0)
    model, optimizer = amp.initialize(
        model, optimizer, opt_level="O2", half_dtype=torch.bfloat16, verbosity=0,
        optimizer_state=setting.optimizer_state, master_weights=setting.master_weights)
    try:
        with amp.scale_loss(loss_fn(model, batch_fn(0)), optimizer) as scaled:
            scaled.backward()
        optimizer.step()
        own = {id(p) for p in model.parameters()}
        held = [p for group in optimizer.param_groups for p in group["params"]
                if id(p) not in own]
        held += [v for state in optimizer.state.values() for v in state.values()
                 if isinstance(v, torch.Tensor)]
        total = sum(t.numel() * t.element_size() for t in held)
    finally:
        amp.deinitialize()
    return total / models.parameter_count(model)


def final_loss(losses: list[float]) -> float:
    """The mean of the last :data:`TAIL` losses."""
    tail = losses[-TAIL:]
    return sum(tail) / len(tail)


def runs_of(model: str) -> list[tuple[str, Setting, int]]:
    """``(run label, setting, seed)`` of every run of ``model``, baseline seeds first."""
    runs = [(f"{model} O2 seed {s}", O2, s) for s in BASELINE_SEEDS]
    runs += [(f"{model} {st.label}", st, 0) for st in (*LEAN, CONTROL)]
    return runs


def summarize(results: dict[str, Any]) -> dict[str, Any]:
    """Add the final losses, the gaps to O2 seed 0 and O2's seed spread to ``results``."""
    for model, res in results["models"].items():
        finals = {label: final_loss(run["losses"]) for label, run in res["runs"].items()}
        base = finals[f"{model} O2 seed 0"]
        seeds = [finals[f"{model} O2 seed {s}"] for s in BASELINE_SEEDS]
        res["final"] = finals
        res["gap_pct"] = {label: 100.0 * (f - base) / base for label, f in finals.items()}
        res["seed_spread_pct"] = 100.0 * (max(seeds) - min(seeds)) / base
        res["optimizer_bytes_per_param"] = {
            st.label: optimizer_bytes(WORKLOADS[model], st) for st in (O2, *LEAN, CONTROL)}
    return results


def table(results: dict[str, Any]) -> str:
    """The markdown table: per model, the optimizer's bytes per param, final loss and gap."""
    names = list(results["models"])
    header = ["setting"] + [f"{m}: {col}" for m in names
                            for col in ("optimizer B/param", "final loss", "gap to O2")]
    rows: list[list[str]] = []
    for st, seed in [(O2, s) for s in BASELINE_SEEDS] + [(st, 0) for st in (*LEAN, CONTROL)]:
        label = f"O2 seed {seed}" if st == O2 else st.label
        row = [label]
        for m in names:
            res, key = results["models"][m], f"{m} {label}"
            row += [f"{res['optimizer_bytes_per_param'][st.label]:.2f}" if seed == 0 else "",
                    f"{res['final'][key]:.4f}",
                    "(baseline)" if st == O2 and seed == 0 else f"{res['gap_pct'][key]:+.2f}%"]
        rows.append(row)
    spread = ["O2's seed spread (max - min over seeds 0-2)"]
    for m in names:
        spread += ["", "", f"{results['models'][m]['seed_spread_pct']:.2f}%"]
    rows.append(spread)
    return common.markdown_table(header, rows)


#: Plot colour of each optimizer_state; fp32 masters are drawn solid, bf16 masters dashed.
_COLOURS = {"fp32": "tab:blue", "bf16": "tab:orange", "int8": "tab:green", "fp8": "tab:purple"}


def _style(short: str, run: dict[str, Any]) -> dict[str, Any]:
    if short.startswith("O2 seed"):
        seed = BASELINE_SEEDS.index(run["seed"])
        return {"color": "black", "linestyle": ("-", "--", ":")[seed], "linewidth": 1.8,
                "alpha": 1.0 if seed == 0 else 0.6}
    if run["master_weights"] is False:
        return {"color": "red", "linestyle": "-.", "linewidth": 1.2}
    return {"color": _COLOURS[run["optimizer_state"]], "linewidth": 1.2,
            "linestyle": "--" if run["master_weights"] == "bf16" else "-"}


def plot(results: dict[str, Any], path: Path, window: int = 10) -> None:
    """One row per model: the smoothed curves, and the last third of them enlarged."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results["models"])
    fig, axes = plt.subplots(len(names), 2, figsize=(13, 4.6 * len(names)), squeeze=False)
    for row, model in zip(axes, names):
        res = results["models"][model]
        curves = [(label[len(model) + 1:], run["losses"], _style(label[len(model) + 1:], run))
                  for label, run in res["runs"].items()]
        common.loss_panels(row, curves, res["steps"], window, title=f"{model}: ")
    fig.suptitle("O2 in bf16 with lean optimizer state (seed 0), against O2 with seeds 0, 1, 2",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def run_model(model: str, steps: int, results: dict[str, Any], save: Callable[[], None],
              console: Console) -> None:
    """Train every run of ``model`` not already in ``results`` with ``steps`` steps, saving
    after each."""
    res = results["models"].get(model)
    if res is None or res["steps"] != steps:
        res = results["models"][model] = {"steps": steps, "machine": common.machine(),
                                          "threads": torch.get_num_threads(), "runs": {}}
    runs = [r for r in runs_of(model) if r[0] not in res["runs"]]
    with make_progress([label for label, _, _ in runs], steps, console, "accuracy") as progress:
        for label, setting, seed in runs:
            losses, seconds = train(WORKLOADS[model], setting, seed, steps,
                                    lambda i, v, lb=label: progress.step(lb, i, v))
            progress.status(label, f"final {final_loss(losses):.4f}, "
                                   f"{1000 * seconds:.0f} ms/step", done=True)
            res["runs"][label] = {"optimizer_state": setting.optimizer_state,
                                  "master_weights": setting.master_weights, "seed": seed,
                                  "machine": common.machine(),
                                  "seconds_per_step": round(seconds, 4),
                                  "losses": [round(v, 5) for v in losses]}
            save()


def report(results: dict[str, Any]) -> str:
    """The markdown section: machine, method and the table."""
    names = list(results["models"])
    # Each run's machine (a run added to an earlier model entry may differ from the entry's).
    machines = sorted({run.get("machine", results["models"][m]["machine"])
                       for m in names for run in results["models"][m]["runs"].values()})
    return "\n".join([
        "#### Final loss against O2",
        "",
        f"Machine: {'; '.join(machines)}. "
        "Written by `python benchmarks/accuracy_lean_state.py`; the curves are in "
        f"`lean_state.json`. Final loss: the mean of the last {TAIL} steps' losses. Steps: "
        + ", ".join(f"{m} {results['models'][m]['steps']}" for m in names)
        + ". Gap: to O2 seed 0, whose seed (initial weights and data) every lean setting "
        "shares; O2's seed spread draws both anew.",
        "",
        table(results),
    ])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", choices=list(WORKLOADS), default=list(WORKLOADS))
    parser.add_argument("--lm-steps", type=int, default=DEFAULT_STEPS["lm"])
    parser.add_argument("--convnet-steps", type=int, default=DEFAULT_STEPS["convnet"])
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads (default: torch's); one thread per process is "
                             "fastest on a busy machine, with --models run in two processes")
    parser.add_argument("--json", type=Path, default=DOCS / "lean_state.json",
                        help="results file: runs already in it (same model and steps) are "
                             "kept, not trained again; each run is saved as it ends")
    parser.add_argument("--plot", type=Path, default=DOCS / "lean_state.png")
    parser.add_argument("--no-write", action="store_true",
                        help="print the table; write no plot or docs")
    ns = parser.parse_args()
    steps = {"lm": ns.lm_steps, "convnet": ns.convnet_steps}
    if any(steps[m] <= TAIL for m in ns.models):
        parser.error(f"each model needs more than {TAIL} steps")
    if ns.threads is not None:
        torch.set_num_threads(ns.threads)

    results: dict[str, Any] = {"tail": TAIL, "models": {}}
    if ns.json.exists():
        results = json.loads(ns.json.read_text())

    def save() -> None:
        # Re-read first: another process may be filling in another model.
        on_disk = json.loads(ns.json.read_text()) if ns.json.exists() else {"models": {}}
        on_disk["tail"] = TAIL
        on_disk["models"].update({m: results["models"][m] for m in ns.models
                                  if m in results["models"]})
        ns.json.write_text(json.dumps(on_disk, separators=(",", ":")) + "\n")

    console = Console()
    for model in ns.models:
        run_model(model, steps[model], results, save, console)
    results = json.loads(ns.json.read_text())
    complete = {m: r for m, r in results["models"].items()
                if all(label in r["runs"] for label, _, _ in runs_of(m))}
    if not complete:
        raise SystemExit(f"no model has all its runs in {ns.json}")
    results = summarize({"tail": TAIL, "models": complete})
    body = report(results)
    print(body)
    if not ns.no_write:
        plot(results, ns.plot)
        common.write_section("accuracy", body, DOCS / "lean_state.md")
        print(f"wrote {ns.plot} and the accuracy section of docs/lean_state.md")


if __name__ == "__main__":
    main()
