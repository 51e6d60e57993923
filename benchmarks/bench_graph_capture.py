"""The whole training step captured as one CUDA graph, against the same step run eagerly (G3).

With the sync-free step (docs/design.md, "Host syncs") nothing in an iteration
reads the device from the host: forward, backward, ``scale_loss`` and the
optimizer's step (amp_patch's FusedAdam with fp32 state, its step counters on
the device) are captured in one ``torch.cuda.graph`` and replayed with new
batches copied into static inputs. On a launch-bound step the replay saves
the host's time per launch. Target G3: the replay at >= 1.3x the eager O2
step's throughput on the benchmark LM (about 21 M params).

    python benchmarks/bench_graph_capture.py --device cuda     # writes section graph-capture-cuda
    python benchmarks/bench_graph_capture.py --device cpu --size tiny --no-write
                                                               # the eager path only (the tests)

On a CPU there is no graph to capture: the script runs the eager step and the
capture's warm-up there, so that it cannot rot, and reports no ratio.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.utils import _pytree

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402

import amp_patch as amp  # noqa: E402
from amp_patch.cli.compare import models  # noqa: E402

SIZES = {
    "bench": models.BENCH_LM,
    # The same shapes at a size the CPU tests run in a second or two.
    "tiny": dataclasses.replace(models.BENCH_LM, vocab=256, d_model=64, n_layers=2, n_heads=4,
                                seq_len=16, batch_size=2),
}
TARGET = 1.3


class _Step:
    """One O2 training iteration of the LM over static inputs, eager or replayed from a graph."""

    def __init__(self, device: str, config: models.LMConfig, half: torch.dtype) -> None:
        cfg = dataclasses.replace(config, fused_adam=True)
        self.model, self.optimizer, batch_fn, self.loss_fn = models.lm(device=device, config=cfg)
        amp.initialize(self.model, self.optimizer, opt_level="O2", half_dtype=half, verbosity=0)
        self.batch_fn = batch_fn
        # The batch is static: a graph replays on the very tensors it captured.
        self.static = _pytree.tree_map(torch.clone, batch_fn(0))
        self.loss = torch.zeros((), device=device)
        self.graph: torch.cuda.CUDAGraph | None = None

    def eager(self) -> None:
        loss = self.loss_fn(self.model, self.static)
        with amp.scale_loss(loss, self.optimizer) as scaled:
            scaled.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=False)
        self.loss.copy_(loss.detach())

    def capture(self, warmup: int) -> None:
        """Warm up on a side stream (the state is made there), then capture one iteration."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(warmup):
                self.eager()
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.eager()

    def replay(self) -> None:
        assert self.graph is not None
        self.graph.replay()


def _time(fn, steps: int, device: str) -> float:
    """Seconds per call of ``fn`` over ``steps`` calls, synchronised around them."""
    common.sync(device)
    t0 = time.perf_counter()
    for _ in range(steps):
        fn()
    common.sync(device)
    return (time.perf_counter() - t0) / steps


def measure(device: str, size: str, half: torch.dtype, rounds: int, steps: int,
            warmup: int) -> dict[str, float]:
    """Seconds per step, the median of ``rounds`` timings of ``steps`` steps: ``eager``, and on
    CUDA ``graph``, the same model and session captured after its eager rounds.

    One session serves both, in turn: two amp sessions cannot be live at once, and a graph
    must not outlive the masters and state its kernels write.
    """
    step = _Step(device, SIZES[size], half)
    times: dict[str, float] = {}
    try:
        for _ in range(warmup):
            step.eager()
        eager = []
        for r in range(rounds):
            print(f"  eager round {r + 1}/{rounds}", file=sys.stderr, flush=True)
            eager.append(_time(step.eager, steps, device))
        times["eager"] = statistics.median(eager)
        if device == "cuda":
            step.capture(warmup)
            graph = []
            for r in range(rounds):
                print(f"  graph round {r + 1}/{rounds}", file=sys.stderr, flush=True)
                graph.append(_time(step.replay, steps, device))
            times["graph"] = statistics.median(graph)
    finally:
        amp.deinitialize()
    return times


def report(times: dict[str, float], device: str, size: str, half: str, rounds: int,
           steps: int) -> str:
    cfg = SIZES[size]
    params = sum(p.numel() for p in models.lm(config=cfg)[0].parameters())
    rows = [["eager O2, FusedAdam", f"{times['eager'] * 1e3:.2f}", "1.00x", ""]]
    verdict = "no graph on the CPU"
    if "graph" in times:
        speedup = times["eager"] / times["graph"]
        verdict = "met" if speedup >= TARGET else "**missed**"
        rows.append(["the whole step as one CUDA graph", f"{times['graph'] * 1e3:.2f}",
                     f"{speedup:.2f}x", f"G3 >= {TARGET}x: {verdict}"])
    return "\n".join([
        f"## Whole-step capture ({device})",
        "",
        f"Machine: {common.machine()}.",
        "",
        f"The benchmark LM ({params / 1e6:.1f} M params, seq {cfg.seq_len}, batch "
        f"{cfg.batch_size}) at O2 in {half} with amp_patch's FusedAdam (fp32 state): forward, "
        "backward, `scale_loss` and the step, eager or replayed from one CUDA graph captured "
        f"after a warm-up, in one session, the eager rounds first. Median of {rounds} rounds of "
        f"{steps} steps each.",
        "",
        common.markdown_table(["step", "ms / step", "speed-up", "target"], rows),
    ])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   choices=["cpu", "cuda"])
    p.add_argument("--size", default="bench", choices=sorted(SIZES))
    p.add_argument("--half-dtype", default=None, choices=["fp16", "bf16"],
                   help="default: fp16 on CUDA, bf16 on the CPU")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--no-write", action="store_true")
    ns = p.parse_args(argv)
    if ns.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: CUDA is not available here")
    half = ns.half_dtype or ("fp16" if ns.device == "cuda" else "bf16")
    dtype = torch.float16 if half == "fp16" else torch.bfloat16
    times = measure(ns.device, ns.size, dtype, ns.rounds, ns.steps, ns.warmup)
    common.publish(f"graph-capture-{ns.device}", report(times, ns.device, ns.size, half,
                                                          ns.rounds, ns.steps),
                   write=not ns.no_write and ns.device == "cuda")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
