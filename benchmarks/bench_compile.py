"""C1: O1 under ``torch.compile`` against eager O1, on the built-in LM and conv net.

Both copies of a model train in one O1 session, interleaved (see
``common.interleaved_median``): one eager, one ``torch.compile``-d (inductor,
the default backend). A step is the forward, the loss, ``scale_loss`` with its
backward, and the optimizer step, as a training loop runs them; only the
model is compiled. ``torch._dynamo.explain`` reports the graphs and breaks of
the forward and loss.

Target (docs/design.md, "Performance targets", C1): 0 graph breaks; the compiled step at least as
fast as the eager one.

Run: ``python benchmarks/bench_compile.py`` (writes the "compile" section of
docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

import amp_patch
from amp_patch.cli.compare import models
from amp_patch.cli.host_facts import LoadMonitor

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import interleaved_median, machine, markdown_table, publish  # noqa: E402

WORKLOADS = {
    "lm": lambda: models.lm(config=models.COMPARE_LM),
    "convnet": lambda: models.convnet(),
}


def _step(model, optimizer, loss_fn, batch):
    def run():
        loss = loss_fn(model, batch)
        with amp_patch.scale_loss(loss, optimizer) as scaled:
            scaled.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return run


def measure(name: str, repeats: int) -> dict:
    """Eager and compiled O1 step times (s), the compile time (s), graphs and breaks."""
    w, twin = WORKLOADS[name](), WORKLOADS[name]()  # the same seed: the same model
    (eager, compiled_model), (opt, twin_opt) = amp_patch.initialize(
        [w.model, twin.model], [w.optimizer, twin.optimizer], opt_level="O1",
        half_dtype=torch.bfloat16, verbosity=0)
    try:
        batch = w.batch_fn(0)
        torch._dynamo.reset()
        explained = torch._dynamo.explain(lambda b: w.loss_fn(compiled_model, b))(batch)
        torch._dynamo.reset()
        compiled = torch.compile(compiled_model)
        start = time.perf_counter()
        _step(compiled, twin_opt, w.loss_fn, batch)()  # compiles forward and backward
        compile_s = time.perf_counter() - start
        times = interleaved_median({
            "eager": _step(eager, opt, w.loss_fn, batch),
            "compiled": _step(compiled, twin_opt, w.loss_fn, batch),
        }, repeats=repeats)
    finally:
        amp_patch.deinitialize()
        torch._dynamo.reset()
    return {"eager": times["eager"], "compiled": times["compiled"], "compile_s": compile_s,
            "graphs": explained.graph_count, "breaks": explained.graph_break_count}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=11)
    parser.add_argument("--models", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    parser.add_argument("--threads", type=int, default=None,
                        help="intra-op threads (default: torch's); 1 avoids OpenMP spinning "
                             "on an oversubscribed machine")
    parser.add_argument("--no-write", action="store_true", help="print only")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = []
    load = LoadMonitor().start()
    for name in args.models:
        r = measure(name, args.repeats)
        speed = r["eager"] / r["compiled"]
        rows.append((name, r["graphs"], r["breaks"], f"{r['eager'] * 1e3:.1f}",
                     f"{r['compiled'] * 1e3:.1f}", f"{speed:.2f}x",
                     "yes" if r["breaks"] == 0 and speed >= 1.0 else "no",
                     f"{r['compile_s']:.0f}"))
    load.stop()
    table = markdown_table(
        ["model", "graphs", "breaks", "eager O1 ms/step", "compiled O1 ms/step",
         "compiled speed / eager", "C1 met (0 breaks, >= 1.0x)",
         "first compiled step (s; inductor's disk cache may hold its kernels)"],
        rows)
    body = (
        "## O1 under torch.compile (C1)\n\n"
        f"{machine()}; inductor; bf16; median of {args.repeats} interleaved steps after the "
        f"compiling one; {load.line()}. "
        "`lm` is `amp-patch compare`'s LM (d_model 256, 2 layers, seq 128, batch 8), "
        "`convnet` the built-in conv net (batch 64, 32x32).\n\n"
        f"{table}\n"
    )
    publish("compile", body, write=not args.no_write)


if __name__ == "__main__":
    main()
