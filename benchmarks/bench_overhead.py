"""E4: the per-call overhead of the O1 wrappers on tiny ops.

Measured in one process run, interleaved (see ``common.interleaved_median``),
for both implementations of the wrappers in the same O1 session: the C fast
path (``amp_patch._C.CastWrapper``, what O1 installs when the extension is
built) and the Python wrapper (the fallback, and what ``AMP_PATCH_NO_EXT=1``
installs):

- nothing to cast: ``F.linear`` on an 8x8 bf16 input with a bf16 weight,
  ``torch.add`` of two small fp32 tensors (same dtype: nothing to promote),
  and the method ``x.softmax(-1)`` on fp32 (already the fp32 list's dtype),
  against the unpatched op (the saved original, called directly);
- a cached weight: ``F.linear`` of an fp32 8x8 input with an ``nn.Linear``'s
  fp32 weight and bias, under O1 (weight and bias from the cache, the input
  cast) against the unpatched op under ``torch.autocast`` (whose own cache
  holds the weight casts).

Targets (docs/design.md, "Performance targets", E4): at most +0.3 us over unpatched with nothing to
cast, and at most autocast + 1.0 us with a cached weight.

Run: ``python benchmarks/bench_overhead.py`` (writes the "overhead" section of
docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

import amp_patch
from amp_patch import session as amp_session
from amp_patch.cli.host_facts import LoadMonitor
from amp_patch.patching import wrappers

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import interleaved_median, machine, markdown_table, publish  # noqa: E402

BLOCK = 200  # calls per timed block: amortises the loop and the autocast context entry
NOTHING, CACHED = 0.3, 1.0  # the E4 targets, us per call over the anchor


def _block(fn, *args):
    def run():
        for _ in range(BLOCK):
            fn(*args)
    return run


def _softmax_method(x):
    def run():
        for _ in range(BLOCK):
            x.softmax(-1)  # method syntax: the patched class attribute, as user code calls it
    return run


def _autocast_block(fn, *args, dtype):
    def run():
        with torch.autocast("cpu", dtype=dtype):
            for _ in range(BLOCK):
                fn(*args)
    return run


def measure(repeats: int) -> tuple[str, list[tuple[str, str, float, float, float | None, float]]]:
    """The installed path's name, and rows of (case, anchor name, anchor us, installed path us,
    Python path us or None when it is the installed one, target us over anchor)."""
    torch.manual_seed(0)
    half = torch.bfloat16
    lin = torch.nn.Linear(8, 8)
    x32 = torch.randn(8, 8)
    x16, w16 = x32.to(half), lin.weight.detach().to(half)
    a, b = torch.randn(16), torch.randn(16)
    plain_linear, plain_add, plain_softmax = F.linear, torch.add, torch.Tensor.softmax

    amp_patch.initialize(lin, opt_level="O1", half_dtype=half, verbosity=0)
    try:
        state = amp_session.current().casts
        native = type(F.linear).__name__ == "CastWrapper"
        py = {  # the Python wrappers over the same session state
            "linear": wrappers._python_wrapper(wrappers.Policy.HALF, plain_linear, state,
                                               "F.linear", None),
            "add": wrappers._python_wrapper(wrappers.Policy.PROMOTE, plain_add, state,
                                            "torch.add", None),
            "softmax": wrappers._python_wrapper(wrappers.Policy.FP32, plain_softmax, state,
                                                "torch.Tensor.softmax", None),
        }
        with torch.no_grad():
            assert F.linear(x32, lin.weight, lin.bias).dtype == half
            assert py["linear"](x32, lin.weight, lin.bias).dtype == half
        fns = {
            "linear plain": _block(plain_linear, x16, w16),
            "linear O1": _block(F.linear, x16, w16),
            "linear py": _block(py["linear"], x16, w16),
            "add plain": _block(plain_add, a, b),
            "add O1": _block(torch.add, a, b),
            "add py": _block(py["add"], a, b),
            "softmax plain": _block(plain_softmax, x32, -1),
            "softmax O1": _softmax_method(x32),
            "softmax py": _block(py["softmax"], x32, -1),
            "cached autocast": _autocast_block(plain_linear, x32, lin.weight, lin.bias, dtype=half),
            "cached O1": _block(F.linear, x32, lin.weight, lin.bias),
            "cached py": _block(py["linear"], x32, lin.weight, lin.bias),
        }
        t = {k: v / BLOCK * 1e6 for k, v in interleaved_median(fns, repeats=repeats).items()}
    finally:
        amp_patch.deinitialize()
    label = "C path" if native else "Python path (no extension)"

    def row(case, anchor, key, base, limit):
        return (case, anchor, t[base], t[f"{key} O1"], t[f"{key} py"] if native else None, limit)
    return label, [
        row("`F.linear` 8x8 bf16, nothing to cast", "unpatched", "linear", "linear plain", NOTHING),
        row("`torch.add` 16 fp32 + fp32, nothing to cast", "unpatched", "add", "add plain", NOTHING),
        row("`x.softmax(-1)` 8x8 fp32 (method), nothing to cast", "unpatched", "softmax",
            "softmax plain", NOTHING),
        row("`F.linear` 8x8 fp32 input, cached fp32 weight and bias", "`torch.autocast` bf16",
            "cached", "cached autocast", CACHED),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=21)
    parser.add_argument("--no-write", action="store_true", help="print only")
    args = parser.parse_args()
    torch.set_num_threads(1)
    load = LoadMonitor().start()
    label, rows = measure(args.repeats)
    load.stop()
    table = markdown_table(
        ["case", "anchor", "anchor us/call", f"O1 ({label}) us/call", "O1 - anchor (us)",
         "target", "met", "Python path - anchor (us)"],
        [(case, anchor, f"{a:.2f}", f"{o:.2f}", f"{o - a:+.2f}", f"<= +{limit:.2f}",
          "yes" if o - a <= limit else "no", "" if p is None else f"{p - a:+.2f}")
         for case, anchor, a, o, p, limit in rows],
    )
    body = (
        "## O1 wrapper overhead (E4)\n\n"
        f"{machine()}; median of {args.repeats} interleaved rounds of {BLOCK} calls; "
        f"{load.line()}.\n\n{table}\n"
    )
    publish("overhead", body, write=not args.no_write)


if __name__ == "__main__":
    main()
