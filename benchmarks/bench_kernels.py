"""K1-K4 and the Apex extras: the fused multi-tensor kernels against torch's own ops.

Usage::

    python benchmarks/bench_kernels.py [--device cpu|cuda] [--quick]

Checks every kernel against the reference ops on fresh random data first, then
times each kernel and its anchor interleaved (median of repeats), and the
device's bandwidth in the same run: in-place ``mul_`` on CPU, ``copy_`` on GPU.
Each row gives the speed-up over the anchor and the kernel's time over its
bandwidth floor (the bytes it must move, each input read once and each output
written once, over that bandwidth). Besides K1-K4 (docs/design.md, "Performance targets") it times
the two ops served for Apex's ``amp_C``, which have no target: UL2,
``multi_tensor_unscale_l2norm`` against the same math in torch (foreach
multiply, then foreach norms), and HYST, ``update_scale_hysteresis`` against
torch's own scale update (``_amp_update_scale_``, no hysteresis), per call, and FB,
``multi_tensor_unscale_`` on 200 x 64k fp32 against the reference ops that serve when
``amp_patch._C`` is missing or stale (the fallback's cost). It prints the table and rewrites the
``kernels-cpu`` / ``kernels-cuda`` section of ``docs/benchmarks.md``.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import interleaved_median, machine, markdown_table, write_section  # noqa: E402

from amp_patch import ops  # noqa: E402
from amp_patch.ops import scaling_ops  # noqa: E402

N_TENSORS = 200
#: Elements per tensor of the FB row (the fallback's cost), as in the measurement of docs/install.md.
FALLBACK_NUMEL = 65536


@dataclass
class Row:
    id: str
    what: str
    anchor: str
    target: float | None  # None: no target set
    ours: float
    anchor_s: float
    floor_s: float | None  # None: not bandwidth-bound (a one-element op)

    @property
    def speedup(self) -> float:
        return self.anchor_s / self.ours

    @property
    def over_floor(self) -> float | None:
        return None if self.floor_s is None else self.ours / self.floor_s


def _grads(total: int, dtype: torch.dtype, device: str, seed: int) -> list[torch.Tensor]:
    """``N_TENSORS`` random tensors of varied sizes summing to about ``total`` elements."""
    gen = torch.Generator().manual_seed(seed)
    weights = torch.rand(N_TENSORS, generator=gen) + 0.5
    sizes = (weights / weights.sum() * total).long().clamp(min=1).tolist()
    return [torch.randn(n, generator=gen).to(dtype).to(device) for n in sizes]


def check_correctness(device: str) -> None:
    """Every kernel equals the reference bit for bit (l2norm: within fp32 rounding) on fresh data."""
    x = _grads(300_000, torch.bfloat16, device, seed=11)[:50] + _grads(300_000, torch.float32, device, seed=12)[:50]
    inv = torch.full((1,), 1.0 / 1024.0, device=device)

    def same(a: list[torch.Tensor], b: list[torch.Tensor], what: str) -> None:
        if not all(torch.equal(u, v) for u, v in zip(a, b)):
            raise SystemExit(f"{what}: kernel differs from the reference; not timing it")

    f1, f2 = torch.zeros(1, device=device), torch.zeros(1, device=device)
    got, want = [t.clone() for t in x], [t.clone() for t in x]
    ops.multi_tensor_unscale_(got, f1, inv)
    scaling_ops._unscale_ref(want, f2, inv)
    same(got, want, "multi_tensor_unscale_")
    got, want = [torch.empty_like(t, dtype=torch.float32) for t in x], [torch.empty_like(t, dtype=torch.float32) for t in x]
    ops.multi_tensor_unscale_copy_(x, got, f1, inv)
    scaling_ops._unscale_copy_ref(x, want, f2, inv)
    same(got, want, "multi_tensor_unscale_copy_")
    ops.multi_tensor_axpby_(x, got, f1, 0.3, 0.9)
    scaling_ops._axpby_ref(x, want, f2, 0.3, 0.9)
    same(got, want, "multi_tensor_axpby_")
    ops.multi_tensor_copy_(want, x)
    expected = [t.clone() for t in x]
    scaling_ops._copy_ref(want, expected)
    same(x, expected, "multi_tensor_copy_")
    total, _ = ops.multi_tensor_l2norm(x, False)
    exact = torch.cat([t.double().flatten() for t in x]).norm()
    if not torch.allclose(total.double(), exact, rtol=1e-5):
        raise SystemExit(f"multi_tensor_l2norm: {total.item()} vs {exact.item()}")
    total, _ = ops.multi_tensor_unscale_l2norm(x, inv, False)
    if not torch.allclose(total.double(), exact * inv.item(), rtol=1e-5):
        raise SystemExit(f"multi_tensor_unscale_l2norm: {total.item()} vs {exact.item() * inv.item()}")
    states = [[torch.full((1,), 1024.0, device=device), torch.zeros(1, dtype=torch.int32, device=device),
               torch.full((1,), 2, dtype=torch.int32, device=device)] for _ in range(2)]
    for flag in [1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0.0]:
        found = torch.full((1,), flag, device=device)
        ops.update_scale_hysteresis(*states[0], found, 2.0, 0.5, 3, 2)
        scaling_ops._update_scale_hysteresis_ref(*states[1], found, 2.0, 0.5, 3, 2)
        same(states[0], states[1], "update_scale_hysteresis")
    if f1.item() != 0.0 or f2.item() != 0.0:
        raise SystemExit("found_inf set on finite data")


def measure(device: str, total: int, repeats: int) -> tuple[float, list[Row]]:
    """Bandwidth (bytes/s) and the K1-K4 rows, each timed interleaved with its anchor."""
    bw_src = torch.randn(total, device=device)
    bw_dst = torch.empty_like(bw_src)
    bw_fn: Callable[[], object]
    if device == "cuda":
        bw_fn = lambda: bw_dst.copy_(bw_src)  # noqa: E731
    else:
        bw_fn = lambda: bw_src.mul_(1.0)  # noqa: E731
    bw_bytes = 8 * total
    bandwidths: list[float] = []
    rows: list[Row] = []

    def timed(row_id: str, what: str, anchor_name: str, target: float | None, nbytes: int,
              ours: Callable[[], object], anchor: Callable[[], object]) -> None:
        t = interleaved_median({"ours": ours, "anchor": anchor, "bw": bw_fn}, repeats=repeats, device=device)
        bandwidths.append(bw_bytes / t["bw"])
        rows.append(Row(row_id, what, anchor_name, target, t["ours"], t["anchor"], nbytes / (bw_bytes / t["bw"])))

    found = torch.zeros(1, device=device)
    # In-place unscaling by 1.0 keeps the data random across repeats (a real scale
    # would drive it to zero); the multiply and the check run all the same.
    one = torch.ones(1, device=device)
    inv = torch.full((1,), 1.0 / 1024.0, device=device)
    torch_unscale = torch._amp_foreach_non_finite_check_and_unscale_

    # torch's CUDA unscale takes fp32 and fp16 grads only (GradScaler is for fp16 there), so the
    # half row is fp16 on CUDA and bf16 on the CPU.
    half = (torch.float16, "fp16") if device == "cuda" else (torch.bfloat16, "bf16")
    for dtype, name in [(torch.float32, "fp32"), half]:
        g = _grads(total, dtype, device, seed=1)
        timed("K1", f"multi_tensor_unscale_, {name} grads", "torch._amp_foreach_non_finite_check_and_unscale_",
              0.95, 2 * dtype.itemsize * total,
              lambda: ops.multi_tensor_unscale_(g, found, one), lambda: torch_unscale(g, found, one))
        del g

    src = _grads(total, torch.bfloat16, device, seed=2)
    dst = [torch.empty_like(t, dtype=torch.float32) for t in src]
    timed("K2", "multi_tensor_unscale_copy_, bf16 -> fp32", "_foreach_copy_ + torch unscale", 1.8, 6 * total,
          lambda: ops.multi_tensor_unscale_copy_(src, dst, found, inv),
          lambda: (torch._foreach_copy_(dst, src), torch_unscale(dst, found, inv)))
    del src, dst

    for dtype, name in [(torch.float32, "fp32"), (torch.bfloat16, "bf16")]:
        x = _grads(total, dtype, device, seed=3)
        timed("K3", f"multi_tensor_l2norm, {name}", "_foreach_norm + stack + norm", 1.0, dtype.itemsize * total,
              lambda: ops.multi_tensor_l2norm(x, False),
              lambda: torch.linalg.vector_norm(torch.stack(torch._foreach_norm(x))))
        del x

    for dtype, name in [(torch.float32, "fp32"), (torch.bfloat16, "bf16")]:
        x = _grads(total, dtype, device, seed=4)
        y = [torch.randn(t.shape, device=device) for t in x]
        a, b = 1.0 / 1024.0, 1.0

        def anchor(x=x, y=y) -> None:
            torch._foreach_mul_(y, b)
            torch._foreach_add_(y, x, alpha=a)

        timed("K4", f"multi_tensor_axpby_, {name} x, fp32 y", "_foreach_mul_ + _foreach_add_", 1.5,
              (dtype.itemsize + 8) * total,
              lambda x=x, y=y: ops.multi_tensor_axpby_(x, y, found, a, b), anchor)
        del x, y
        gc.collect()

    inv0 = inv.reshape(())
    for dtype, name in [(torch.float32, "fp32"), (torch.bfloat16, "bf16")]:
        x = _grads(total, dtype, device, seed=5)
        timed("UL2", f"multi_tensor_unscale_l2norm, {name}", "_foreach_mul + _foreach_norm + stack + norm", None,
              dtype.itemsize * total,
              lambda x=x: ops.multi_tensor_unscale_l2norm(x, inv, False),
              lambda x=x: torch.linalg.vector_norm(torch.stack(torch._foreach_norm(torch._foreach_mul(x, inv0)))))
        del x
        gc.collect()

    # One-element state: launch (or call) overhead only, so per call over a
    # batch of calls, and no bandwidth floor.
    calls = 200
    state = [torch.full((1,), 65536.0, device=device), torch.zeros(1, dtype=torch.int32, device=device),
             torch.full((1,), 2, dtype=torch.int32, device=device)]
    torch_state = [torch.full((1,), 65536.0, device=device), torch.zeros(1, dtype=torch.int32, device=device)]
    clean = torch.zeros(1, device=device)

    def hysteresis_calls() -> None:
        for _ in range(calls):
            ops.update_scale_hysteresis(*state, clean, 2.0, 0.5, 2000, 2)

    def torch_calls() -> None:
        for _ in range(calls):
            torch._amp_update_scale_(*torch_state, clean, 2.0, 0.5, 2000)

    t = interleaved_median({"ours": hysteresis_calls, "anchor": torch_calls}, repeats=repeats, device=device)
    rows.append(Row("HYST", "update_scale_hysteresis, per call", "torch._amp_update_scale_ (no hysteresis)", None,
                    t["ours"] / calls, t["anchor"] / calls, None))

    # FB: what a missing or stale amp_patch._C costs (docs/install.md): the same op against
    # the reference body that serves without the compiled kernels, on 200 x 64k fp32 grads.
    if ops.has_native_kernel(device):
        fb = [torch.randn(FALLBACK_NUMEL, device=device) for _ in range(N_TENSORS)]
        timed("FB", f"multi_tensor_unscale_, fp32, {N_TENSORS} x 64k", "the reference ops (no _C)",
              None, 8 * FALLBACK_NUMEL * N_TENSORS,
              lambda: ops.multi_tensor_unscale_(fb, found, one),
              lambda: scaling_ops._unscale_ref(fb, found, one))
        del fb

    bandwidths.sort()
    return bandwidths[len(bandwidths) // 2], rows


def report(device: str, total: int, bandwidth: float, rows: list[Row]) -> str:
    """The markdown section: machine, bandwidth, and one row per measurement."""
    bw_name = "copy_" if device == "cuda" else "in-place mul_"
    isa = ""
    if device == "cpu" and ops.native_extension_loaded():
        from amp_patch import _C

        isa = f" CPU kernels: {_C.cpu_capability()}."
    elif not ops.has_native_kernel(device):
        isa = " No compiled kernel for this device: the reference ops were timed."
    # On a shared machine the load says how far to trust the absolute numbers.
    load = f" Load average (1 min) at the end: {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs." if device == "cpu" else ""
    header = ["id", "kernel", "anchor", "ms", "anchor ms", "speed-up", "target", "GB/s", "time / floor"]

    def ms(seconds: float) -> str:
        return f"{seconds * 1e3:.1f}" if seconds >= 1e-4 else f"{seconds * 1e3:.4f}"

    table = markdown_table(header, [
        [r.id, r.what, r.anchor, ms(r.ours), ms(r.anchor_s), f"{r.speedup:.2f}x",
         "none set" if r.target is None else f">= {r.target}x {'ok' if r.speedup >= r.target else 'MISSED'}",
         "-" if r.floor_s is None else f"{r.floor_s * bandwidth / r.ours / 1e9:.1f}",
         "-" if r.over_floor is None else f"{r.over_floor:.2f}"]
        for r in rows
    ])
    return (
        f"## Kernels ({device})\n\n"
        f"{machine()}.{isa}{load}\n\n"
        f"{N_TENSORS} tensors, {total / 1e6:.0f} M elements per list. Bandwidth ({bw_name}, bytes read + written, "
        f"median over the rows): {bandwidth / 1e9:.1f} GB/s. `speed-up` is anchor time / kernel time; "
        f"`time / floor` is kernel time over (bytes it must move / that bandwidth), so 1.0 is "
        f"bandwidth-bound and K1 at 0.9x of in-place bandwidth is <= 1.11.\n\n"
        f"{table}\n"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--quick", action="store_true", help="10 M elements and 3 repeats (a smoke run)")
    parser.add_argument("--no-write", action="store_true", help="print only; leave docs/benchmarks.md alone")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: CUDA is not available")
    total, repeats = (10_000_000, 3) if args.quick else (100_000_000, 7)

    check_correctness(args.device)
    bandwidth, rows = measure(args.device, total, repeats)
    body = report(args.device, total, bandwidth, rows)
    print(body)
    if not args.no_write and not args.quick:
        path = write_section(f"kernels-{args.device}", body)
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
