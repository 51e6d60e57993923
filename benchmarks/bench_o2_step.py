"""O2 master-grad step: scale_loss's exit on realistic grads against two torch passes.

The fused path is what ``scale_loss`` runs on exit under O2: half model grads
are unscaled into fp32 master grads by ``multi_tensor_unscale_copy_``, with
the overflow flag, then the scaler's one sync. The anchor does the same with
torch's ops in two passes: ``_foreach_copy_`` into the fp32 grads, then
``torch._amp_foreach_non_finite_check_and_unscale_`` over them, then the
same one ``.item()``. Both are timed interleaved in one run; the section
``o2-unscale`` of ``docs/benchmarks.md`` is rewritten.

Usage::

    python benchmarks/bench_o2_step.py [--params 20e6] [--tensors 100] [--dtype bf16]
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

import amp_patch as amp  # noqa: E402
from amp_patch import ops, session as _session  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def build(n_params: int, n_tensors: int, dtype: torch.dtype, device: str):
    """A model of ``n_tensors`` params holding ``n_params`` elements, at O2, with random grads."""
    per = n_params // n_tensors
    model = torch.nn.ParameterList(
        [torch.nn.Parameter(torch.randn(per + (i % 7) * 13, device=device)) for i in range(n_tensors)])
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    amp.initialize(model, opt, opt_level="O2", half_dtype=dtype, loss_scale="dynamic", verbosity=0)
    for p in model:
        p.grad = torch.randn_like(p) * 1000  # scaled grads; finite
    return model, opt


def fused_exit(opt, loss):
    """What scale_loss does around backward, with backward replaced by grads already there."""
    record = _session.current().record_for(opt)
    scaler = _session.current().scalers[0]
    for master in amp.master_params(opt):
        master.grad = None  # a fresh iteration after zero_grad(): the one-pass copy path
    in_place, copy, acc = [], ([], []), ([], [])
    record.end_backward_scaled()  # the grads put there are scaled ones
    record.collect_unscale(in_place, copy, acc)
    scaler.check_loss(loss)
    scaler.unscale(in_place, copy, acc)
    return scaler.update()


def torch_two_pass(model_grads, fp32_grads, found_inf, inv_scale):
    torch._foreach_copy_(fp32_grads, model_grads)
    torch._amp_foreach_non_finite_check_and_unscale_(fp32_grads, found_inf, inv_scale)
    overflow = found_inf.item() != 0.0
    found_inf.zero_()
    return overflow


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", type=float, default=20e6)
    ap.add_argument("--tensors", type=int, default=100)
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--no-write", action="store_true", help="print only; leave docs/benchmarks.md")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = DTYPES[args.dtype]

    model, opt = build(int(args.params), args.tensors, dtype, device)
    model_grads = [p.grad for p in model]
    fp32_grads = [torch.empty_like(g, dtype=torch.float32) for g in model_grads]
    found_inf = torch.zeros(1, device=device)
    inv_scale = torch.full((1,), 2.0**-16, device=device)
    loss = torch.tensor(1.0, device=device)

    # Correctness first: both paths give the same fp32 grads on these random grads.
    fused_exit(opt, loss)
    torch_two_pass(model_grads, fp32_grads, found_inf, inv_scale)
    for master, ref in zip(amp.master_params(opt), fp32_grads):
        torch.testing.assert_close(master.grad, ref, rtol=0, atol=0)

    times = common.interleaved_median(
        {"fused": lambda: fused_exit(opt, loss),
         "torch": lambda: torch_two_pass(model_grads, fp32_grads, found_inf, inv_scale)},
        repeats=args.repeats, device=device)
    n = sum(g.numel() for g in model_grads)
    half_bytes = torch.finfo(dtype).bits // 8
    one_pass = n * (half_bytes + 4)  # read half, write fp32
    ratio = times["torch"] / times["fused"]
    kernel = "native" if ops.has_native_kernel(device, "multi_tensor_unscale_copy_") else "reference"
    rows = [
        ["fused `scale_loss` exit (`multi_tensor_unscale_copy_`, " + kernel + ")",
         f"{times['fused'] * 1e3:.2f}", f"{one_pass / times['fused'] / 1e9:.1f}", f"{ratio:.2f}x"],
        ["`_foreach_copy_` + `_amp_foreach_non_finite_check_and_unscale_`",
         f"{times['torch'] * 1e3:.2f}", f"{one_pass / times['torch'] / 1e9:.1f}", "1.00x"],
    ]
    table = common.markdown_table(["path", "ms", "GB/s (6 B/elem floor)", "speed-up"], rows)
    body = (
        "## O2 unscale into fp32 masters (o2-unscale)\n\n"
        f"{common.machine()}. {n / 1e6:.1f} M {args.dtype} params in {args.tensors} tensors, "
        f"median of {args.repeats} interleaved repeats. Both paths include the one `.item()` "
        "sync; GB/s counts the one-pass traffic (read half, write fp32). Target K2: >= 1.8x.\n\n"
        f"{table}\n"
    )
    print(body)
    if not args.no_write:
        print(f"wrote {common.write_section('o2-unscale', body)}")
    amp.deinitialize()


if __name__ == "__main__":
    main()
