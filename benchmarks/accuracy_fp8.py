"""Accuracy of FP8 training: the built-in LM at O2 bf16 against O2+fp8 with each recipe.

Trains the compare LM (:data:`~amp_patch.cli.compare.models.COMPARE_LM`: 2
pre-LN blocks of width 256, vocab 512, seq 128, batch 8) with amp_patch's
FusedAdam (AdamW mode, lr 3e-3) in bf16 at O2, and at O2 with
``fp8="tensorwise"``, ``"delayed"`` and ``"rowwise"``, each with seeds 0, 1
and 2 (a seed draws the initial weights and the data): O2's seed spread is
the yardstick of the FP8 rows' gaps. Every ``nn.Linear`` of the LM has dims
that are multiples of 16, and the runs convert them all (``fp8_modules``: the
default size rule, 2048, would convert none at this width): the four linears
of each block and the output head.

Three measures, each against FP8 off:

- **final loss**: the mean of the last :data:`TAIL` steps' losses; the gap of
  an FP8 run is to the O2 run of the same seed (target: within 1.5%);
- **weight-gradient cosine**: at a few steps of each FP8 run (the first, the
  middle, the last), the weight gradient of every converted layer on that
  step's batch with FP8 on, against the same model's on the same batch inside
  ``amp.fp8_autocast(enabled=False)`` (target: >= 0.95 for every layer). The
  loss alone cannot catch a broken backward: on this task the embedding and
  the head learn most of the loss by themselves;
- **logits' relative error**: on the same probes, ``max |z_fp8 - z| / max |z|``
  of the logits with FP8 on and off.

The script writes the curves and measures as JSON (``docs/fp8_accuracy.json``),
a plot (``docs/fp8_accuracy.png``) and the table into the ``accuracy`` section
of ``docs/fp8.md``.

Run: ``python benchmarks/accuracy_fp8.py`` (about 15 minutes on two CPU
cores). ``--steps`` shortens the runs, ``--seeds`` picks seeds,
``--recipes`` the FP8 recipes; ``--no-write`` prints without writing. Runs
already in the JSON (same steps) are not trained again.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch
from rich.console import Console
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

import amp_patch as amp  # noqa: E402
from amp_patch.cli.compare import models  # noqa: E402
from amp_patch.cli.compare.progress import make_progress  # noqa: E402

DOCS = Path(__file__).resolve().parent.parent / "docs"
#: Steps whose mean loss is a run's final loss.
TAIL = 20
SEEDS = (0, 1, 2)
RECIPES = ("tensorwise", "delayed", "rowwise")
DEFAULT_STEPS = 300
#: The targets (docs/fp8.md).
LOSS_GAP_PCT = 1.5
COSINE = 0.95


def every_multiple_of_16(name: str, linear: nn.Linear) -> bool:
    """The runs' FP8 filter: every linear whose dims are multiples of 16 (all of the LM's)."""
    return linear.in_features % 16 == 0 and linear.out_features % 16 == 0


def probe_steps(steps: int) -> tuple[int, ...]:
    """The steps at which gradients and logits are compared with FP8 off: the first (where
    the delayed recipe has no history yet and runs with scales of 1.0), the second, the
    middle and the last."""
    return tuple(sorted({0, 1, steps // 2, steps - 1}))


def _layer_grads(model: nn.Module, names: tuple[str, ...], loss_fn: Callable[..., Any],
                 batch: Any) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Each named layer's weight gradient (fp32) and the logits, from one forward and backward."""
    modules = dict(model.named_modules())
    model.zero_grad(set_to_none=True)
    logits = model(batch[:, :-1]).float().detach()  # the LM's batch: tokens, inputs then targets
    loss_fn(model, batch).backward()
    grads = {n: modules[n].weight.grad.detach().float().clone() for n in names}
    model.zero_grad(set_to_none=True)
    return grads, logits


def probe(model: nn.Module, names: tuple[str, ...], loss_fn: Callable[..., Any],
          batch: Any) -> dict[str, Any]:
    """Per-layer weight-gradient cosine and the logits' relative error, FP8 on against off."""
    on, z_on = _layer_grads(model, names, loss_fn, batch)
    with amp.fp8_autocast(enabled=False):
        off, z_off = _layer_grads(model, names, loss_fn, batch)
    cos = {n: torch.nn.functional.cosine_similarity(on[n].flatten(), off[n].flatten(),
                                                    dim=0).item() for n in names}
    rel = ((z_on - z_off).abs().max() / z_off.abs().max()).item()
    return {"cosine": cos, "logits_rel_err": rel}


def train(recipe: str | None, seed: int, steps: int,
          on_step: Callable[[int, float], None]) -> dict[str, Any]:
    """Train ``steps`` steps at O2 (with ``fp8=recipe`` when given); losses, probes, speed."""
    model, optimizer, batch_fn, loss_fn = models.lm(seed=seed, fused_adam=True)
    kwargs: dict[str, Any] = {}
    if recipe is not None:
        kwargs = {"fp8": recipe, "fp8_modules": every_multiple_of_16}
    model, optimizer = amp.initialize(model, optimizer, opt_level="O2",
                                      half_dtype=torch.bfloat16, verbosity=0, **kwargs)
    losses: list[float] = []
    probes: dict[str, Any] = {}
    converted: tuple[str, ...] = ()
    try:
        if recipe is not None:
            plan = amp.fp8_plan()
            assert plan is not None
            converted = tuple(plan.converted)
        started = time.perf_counter()
        probe_seconds = 0.0
        for step in range(steps):
            batch = batch_fn(step)
            if recipe is not None and step in probe_steps(steps):
                t0 = time.perf_counter()
                probes[str(step)] = probe(model, converted, loss_fn, batch)
                probe_seconds += time.perf_counter() - t0
            optimizer.zero_grad()
            loss = loss_fn(model, batch)
            with amp.scale_loss(loss, optimizer) as scaled:
                scaled.backward()
            optimizer.step()
            losses.append(loss.item())
            on_step(step, losses[-1])
        seconds = (time.perf_counter() - started - probe_seconds) / steps
    finally:
        amp.deinitialize()
    return {"recipe": recipe, "seed": seed, "converted": list(converted),
            "seconds_per_step": round(seconds, 4), "machine": common.machine(),
            "losses": [round(v, 5) for v in losses], "probes": probes}


def final_loss(losses: list[float]) -> float:
    """The mean of the last :data:`TAIL` losses."""
    tail = losses[-TAIL:]
    return sum(tail) / len(tail)


def label(recipe: str | None, seed: int) -> str:
    """``"O2 seed 0"``, ``"O2+fp8 delayed seed 1"``."""
    return f"O2 seed {seed}" if recipe is None else f"O2+fp8 {recipe} seed {seed}"


def runs_of(recipes: tuple[str, ...], seeds: tuple[int, ...],
            fp8_seeds: tuple[int, ...] | None = None) -> list[tuple[str, str | None, int]]:
    """``(label, recipe, seed)`` of every run, O2's first; the FP8 runs with ``fp8_seeds``
    (default: ``seeds``)."""
    fp8_seeds = seeds if fp8_seeds is None else fp8_seeds
    return [(label(None, s), None, s) for s in seeds] + [
        (label(r, s), r, s) for r in recipes for s in fp8_seeds]


def summarize(results: dict[str, Any], recipes: tuple[str, ...], seeds: tuple[int, ...],
              fp8_seeds: tuple[int, ...]) -> dict[str, Any]:
    """Per recipe: final losses, gaps to O2 of the same seed, the worst cosines (at step 0,
    and after it) and the worst logits error."""
    runs = results["runs"]
    base = {s: final_loss(runs[label(None, s)]["losses"]) for s in seeds}
    out: dict[str, Any] = {"O2": {"final": base,
                                  "spread_pct": 100 * (max(base.values()) - min(base.values()))
                                  / min(base.values())}}
    for r in recipes:
        finals = {s: final_loss(runs[label(r, s)]["losses"]) for s in fp8_seeds}
        gaps = {s: 100 * (finals[s] - base[s]) / base[s] for s in fp8_seeds}
        probes = [(int(step), p) for s in fp8_seeds
                  for step, p in runs[label(r, s)]["probes"].items()]
        first = [c for step, p in probes if step == 0 for c in p["cosine"].values()]
        later = [c for step, p in probes if step > 0 for c in p["cosine"].values()]
        per_layer: dict[str, float] = {}
        for step, p in probes:
            for name, c in p["cosine"].items():
                if step > 0:
                    per_layer[name] = min(per_layer.get(name, 1.0), c)
        out[r] = {"final": finals, "gap_pct": gaps,
                  "spread_pct": 100 * (max(finals.values()) - min(finals.values()))
                  / min(finals.values()),
                  "min_cosine_step0": min(first), "min_cosine": min(later),
                  "per_layer_min_cosine": per_layer,
                  "max_logits_rel_err": max(p["logits_rel_err"] for _, p in probes),
                  "ms_per_step": 1000 * sum(runs[label(r, s)]["seconds_per_step"]
                                            for s in fp8_seeds) / len(fp8_seeds)}
    out["O2"]["ms_per_step"] = 1000 * sum(runs[label(None, s)]["seconds_per_step"]
                                          for s in seeds) / len(seeds)
    return out


def report(results: dict[str, Any], summary: dict[str, Any], recipes: tuple[str, ...],
           seeds: tuple[int, ...], fp8_seeds: tuple[int, ...]) -> str:
    """The markdown section."""
    machines = sorted({run["machine"] for run in results["runs"].values()})
    seeds_txt = ", ".join(map(str, seeds))

    def finals(m: dict[str, Any]) -> list[str]:
        return [f"{m['final'][s]:.4f}" if s in m["final"] else "" for s in seeds]

    rows = [["O2 bf16", *finals(summary["O2"]), "(baseline)",
             f"{summary['O2']['spread_pct']:.2f}%", "", "", "",
             f"{summary['O2']['ms_per_step']:.0f}"]]
    for r in recipes:
        m = summary[r]
        gaps = ", ".join(f"{m['gap_pct'][s]:+.2f}%" for s in fp8_seeds)
        rows.append([f"O2+fp8 {r}", *finals(m), gaps,
                     f"{m['spread_pct']:.2f}%" if len(fp8_seeds) > 1 else "",
                     f"{m['min_cosine_step0']:.4f}", f"{m['min_cosine']:.4f}",
                     f"{m['max_logits_rel_err']:.4f}", f"{m['ms_per_step']:.0f}"])
    header = ["run", *(f"final loss, seed {s}" for s in seeds), "gap to O2 (same seed)",
              "seed spread", "min grad cosine, step 0", "min grad cosine, later steps",
              "max logits rel. error", "ms/step"]
    layers = sorted({n for r in recipes for n in summary[r]["per_layer_min_cosine"]})
    layer_rows = [[n, *(f"{summary[r]['per_layer_min_cosine'][n]:.4f}" for r in recipes)]
                  for n in layers]
    worst_gap = max(abs(summary[r]["gap_pct"][s]) for r in recipes for s in fp8_seeds)
    worst_cos = min(summary[r]["min_cosine"] for r in recipes)
    return "\n".join([
        "### Accuracy: the built-in LM at O2 bf16 and O2+fp8",
        "",
        f"Machine: {'; '.join(machines)}. Written by `python benchmarks/accuracy_fp8.py`; "
        "the curves are in `fp8_accuracy.json`, the plot in `fp8_accuracy.png`. "
        f"{results['steps']} steps of the compare LM (FusedAdam, lr 3e-3), O2 with seeds "
        f"{seeds_txt}, the FP8 recipes with seed(s) {', '.join(map(str, fp8_seeds))}; "
        f"every linear converted ({len(layers)}: the four of each block and "
        f"the head). Final loss: the mean of the last {TAIL} steps' losses. Gap: to O2 "
        "with the same seed (initial weights and data). Seed spread: (max - min) / min of "
        "a row's final losses over the seeds. Cosine: each converted layer's weight "
        "gradient with FP8 on against FP8 off, same model and batch, at steps "
        f"{', '.join(map(str, probe_steps(results['steps'])))} of every FP8 run (step 0 "
        "apart: there the delayed recipe has no amax history yet and scales each tensor by "
        "its current amax, as tensorwise does); the "
        "logits' error is max |z_fp8 - z| / max |z| on the same probes. ms/step: the "
        "wall time of a training step on this CPU, which has no FP8 units and was shared "
        "with other work: no speed comparison, and no target.",
        "",
        common.markdown_table(header, rows),
        "",
        f"Targets: every gap within {LOSS_GAP_PCT}% (largest: {worst_gap:.2f}%), every "
        f"cosine >= {COSINE} after step 0 (smallest: {worst_cos:.4f}).",
        "",
        "Smallest weight-gradient cosine of each layer over seeds and probes after step 0:",
        "",
        common.markdown_table(["layer", *recipes], layer_rows),
    ])


_COLOURS = {None: "black", "tensorwise": "tab:blue", "delayed": "tab:orange",
            "rowwise": "tab:green"}


def plot(results: dict[str, Any], path: Path, recipes: tuple[str, ...],
         seeds: tuple[int, ...], fp8_seeds: tuple[int, ...], window: int = 10) -> None:
    """The smoothed curves of every run, and the last third enlarged."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(13, 4.6))
    curves = []
    for lbl, recipe, seed in runs_of(recipes, seeds, fp8_seeds):
        style = {"color": _COLOURS[recipe], "linestyle": ("-", "--", ":")[seeds.index(seed) % 3],
                 "linewidth": 1.8 if recipe is None else 1.2}
        curves.append((lbl, results["runs"][lbl]["losses"], style))
    common.loss_panels(axes, curves, results["steps"], window)
    fig.suptitle("The compare LM at O2 bf16 (black) and O2+fp8 per recipe; line style: seed",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=DEFAULT_STEPS)
    parser.add_argument("--seeds", type=int, nargs="+", default=list(SEEDS))
    parser.add_argument("--recipes", nargs="+", choices=RECIPES, default=list(RECIPES))
    parser.add_argument("--fp8-seeds", type=int, nargs="+", default=None,
                        help="seeds of the FP8 runs (default: --seeds)")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--json", type=Path, default=DOCS / "fp8_accuracy.json",
                        help="results file: runs already in it (same steps) are kept, not "
                             "trained again; each run is saved as it ends")
    parser.add_argument("--plot", type=Path, default=DOCS / "fp8_accuracy.png")
    parser.add_argument("--no-write", action="store_true",
                        help="print the table; write no plot or docs")
    ns = parser.parse_args(argv)
    if ns.steps <= TAIL:
        parser.error(f"--steps must be more than {TAIL}")
    if ns.threads is not None:
        torch.set_num_threads(ns.threads)
    recipes, seeds = tuple(ns.recipes), tuple(ns.seeds)
    fp8_seeds = seeds if ns.fp8_seeds is None else tuple(ns.fp8_seeds)
    results: dict[str, Any] = {"steps": ns.steps, "tail": TAIL, "runs": {}}
    if ns.json.exists():
        on_disk = json.loads(ns.json.read_text())
        if on_disk.get("steps") == ns.steps:
            results = on_disk

    def save() -> None:
        if not ns.no_write:
            ns.json.write_text(json.dumps(results, separators=(",", ":")) + "\n")

    todo = [r for r in runs_of(recipes, seeds, fp8_seeds) if r[0] not in results["runs"]]
    console = Console()
    with make_progress([lbl for lbl, _, _ in todo], ns.steps, console, "fp8 accuracy") as progress:
        for lbl, recipe, seed in todo:
            run = train(recipe, seed, ns.steps, lambda i, v, lb=lbl: progress.step(lb, i, v))
            results["runs"][lbl] = run
            progress.status(lbl, f"final {final_loss(run['losses']):.4f}, "
                                 f"{1000 * run['seconds_per_step']:.0f} ms/step", done=True)
            save()
    summary = summarize(results, recipes, seeds, fp8_seeds)
    body = report(results, summary, recipes, seeds, fp8_seeds)
    print(body)
    if not ns.no_write:
        plot(results, ns.plot, recipes, seeds, fp8_seeds)
        common.write_section("accuracy", body, DOCS / "fp8.md")
        print(f"wrote {ns.plot} and the accuracy section of docs/fp8.md")


if __name__ == "__main__":
    main()
