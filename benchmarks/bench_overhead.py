"""E4: the per-call overhead of the O1 wrappers on tiny ops.

Measured in one process run, interleaved (see ``common.interleaved_median``):

- nothing to cast: ``F.linear`` on an 8x8 bf16 input with a bf16 weight, and
  ``torch.add`` of two small fp32 tensors (same dtype: nothing to promote),
  patched against the unpatched op (the saved original, called directly);
- a cached weight: ``F.linear`` of an fp32 8x8 input with an ``nn.Linear``'s
  fp32 weight and bias, under O1 (weight and bias from the cache, the input
  cast) against the unpatched op under ``torch.autocast`` (whose own cache
  holds the weight casts).

Targets (PERFORMANCE.md, E4): at most +1.0 us over unpatched with nothing to
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
sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import interleaved_median, machine, markdown_table, write_section  # noqa: E402

BLOCK = 200  # calls per timed block: amortises the loop and the autocast context entry


def _block(fn, *args):
    def run():
        for _ in range(BLOCK):
            fn(*args)
    return run


def _autocast_block(fn, *args, dtype):
    def run():
        with torch.autocast("cpu", dtype=dtype):
            for _ in range(BLOCK):
                fn(*args)
    return run


def measure(repeats: int) -> list[tuple[str, str, float, float, float]]:
    """Rows of (case, anchor name, anchor us, O1 us, target us)."""
    torch.manual_seed(0)
    half = torch.bfloat16
    lin = torch.nn.Linear(8, 8)
    x32 = torch.randn(8, 8)
    x16, w16 = x32.to(half), lin.weight.detach().to(half)
    a, b = torch.randn(16), torch.randn(16)
    plain_linear, plain_add = F.linear, torch.add

    amp_patch.initialize(lin, opt_level="O1", half_dtype=half, verbosity=0)
    try:
        assert F.linear is not plain_linear and torch.add is not plain_add
        with torch.no_grad():
            check = F.linear(x32, lin.weight, lin.bias)
        assert check.dtype == half
        fns = {
            "linear plain": _block(plain_linear, x16, w16),
            "linear O1": _block(F.linear, x16, w16),
            "add plain": _block(plain_add, a, b),
            "add O1": _block(torch.add, a, b),
            "cached autocast": _autocast_block(plain_linear, x32, lin.weight, lin.bias, dtype=half),
            "cached O1": _block(F.linear, x32, lin.weight, lin.bias),
        }
        t = {k: v / BLOCK * 1e6 for k, v in interleaved_median(fns, repeats=repeats).items()}
    finally:
        amp_patch.deinitialize()
    return [
        ("`F.linear` 8x8 bf16, nothing to cast", "unpatched", t["linear plain"], t["linear O1"],
         t["linear plain"] + 1.0),
        ("`torch.add` 16 fp32 + fp32, nothing to cast", "unpatched", t["add plain"], t["add O1"],
         t["add plain"] + 1.0),
        ("`F.linear` 8x8 fp32 input, cached fp32 weight and bias", "`torch.autocast` bf16",
         t["cached autocast"], t["cached O1"], t["cached autocast"] + 1.0),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=21)
    parser.add_argument("--no-write", action="store_true", help="print only")
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = measure(args.repeats)
    table = markdown_table(
        ["case", "anchor", "anchor us/call", "O1 us/call", "O1 - anchor (us)", "target", "met"],
        [(case, anchor, f"{a:.2f}", f"{o:.2f}", f"{o - a:+.2f}", "<= +1.00",
          "yes" if o <= limit else "no") for case, anchor, a, o, limit in rows],
    )
    body = (
        "## O1 wrapper overhead (E4)\n\n"
        f"{machine()}; median of {args.repeats} interleaved rounds of "
        f"{BLOCK} calls.\n\n{table}\n"
    )
    print(body)
    if not args.no_write:
        print(f"wrote {write_section('overhead', body)}")


if __name__ == "__main__":
    main()
