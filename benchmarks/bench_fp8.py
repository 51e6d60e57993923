"""FP8 training speed and memory: the FP8 linear against bf16, Llama-style blocks at O2+fp8.

Rows, each a ratio against bf16 measured in the same run:

- ``linear``: one linear layer's forward and backward (grad-input and
  grad-weight), FP8 with its quantization included
  (:func:`amp_patch.ops.fp8_ops.fp8_linear`, tensorwise: x, W and dY cast each
  call) against ``nn.Linear`` in bf16 on bf16 inputs. On CUDA the issue's
  shape: an 8192x8192 weight on 16384 tokens (target >= 1.5x bf16).
- ``filter``: the same on a grid of the shapes the default filter admits
  (both dims multiples of 16 and at least ``Fp8Recipe.min_features``, 2048):
  every square and rectangular pair of 2048, 4096 and 8192 on 2048 and 8192
  tokens (target >= 1.0x each: the default must never slow a model down).
- ``llama``: a stack of Llama-style blocks (RMSNorm, causal attention with
  fused QKV, SwiGLU MLP; d=4096, 32 heads, MLP 11008) training with amp_patch's
  FusedAdam at O2 bf16 and at O2 with ``fp8="tensorwise"`` (the default filter,
  which admits every block linear at d=4096); on CUDA as many blocks as fill
  about half the GPU's memory with the O2 state. Step-time ratio (target >=
  1.3x, the torchao anchor 1.25x) and peak memory (target: O2+fp8's at most
  O2's).

The timings are medians over interleaved repeats (:func:`common.interleaved_median`);
the Llama rows alternate their sessions round by round (one amp session at a
time). On the CPU the shapes are small (``--size small``, the default there;
``--size tiny`` is the suite's smoke run): the CPU has FP8 GEMMs
(``torch._scaled_mm``) but no FP8 units, so its figures are reported beside
bf16's with no target, naming the host kind.

The section ``fp8-<device>`` of ``docs/benchmarks.md`` is rewritten after
every row, marked partial until the last, so that a run stopped by its time
limit keeps the rows it finished.

Usage::

    python benchmarks/bench_fp8.py --device cuda
    python benchmarks/bench_fp8.py --device cpu               # small shapes, no targets
    python benchmarks/bench_fp8.py --device cpu --size tiny --no-write
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import math
import sys
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

import amp_patch as amp  # noqa: E402
from amp_patch.cli.compare.models import causal_self_attention  # noqa: E402
from amp_patch.cli.compare.trainer import CpuPeak  # noqa: E402
from amp_patch.ops import fp8_ops  # noqa: E402
from amp_patch.optim.fused import FusedAdam  # noqa: E402

#: Targets on CUDA (the CPU has none).
TARGETS = {"linear": 1.5, "filter": 1.0, "llama": 1.3, "memory": 1.0}


@dataclasses.dataclass(frozen=True)
class LlamaSize:
    """The Llama-style stack: width, heads, MLP width, blocks (None: fill the GPU), batch, seq."""

    d: int
    heads: int
    ffn: int
    blocks: int | None
    batch: int
    seq: int


@dataclasses.dataclass(frozen=True)
class Size:
    """The shapes of one ``--size``: (tokens, in, out) triples and the Llama stack."""

    linear: tuple[tuple[int, int, int], ...]
    filter: tuple[tuple[int, int, int], ...]
    llama: LlamaSize
    #: Whether the default filter (min_features 2048) admits the Llama stack's layers; when
    #: not, the rows pass a filter that admits every linear whose dims are multiples of 16.
    default_filter: bool


_DIMS = (2048, 4096, 8192)
SIZES: dict[str, Size] = {
    "full": Size(linear=((16384, 8192, 8192),),
                 filter=tuple((t, k, n) for t in (2048, 8192) for k in _DIMS for n in _DIMS),
                 llama=LlamaSize(4096, 32, 11008, None, 2, 2048), default_filter=True),
    "small": Size(linear=((1024, 1024, 1024), (2048, 2048, 2048)),
                  filter=((512, 2048, 2048), (512, 2048, 4096), (512, 4096, 2048)),
                  llama=LlamaSize(512, 8, 1376, 2, 2, 256), default_filter=False),
    "tiny": Size(linear=((64, 64, 64),), filter=((32, 64, 32),),
                 llama=LlamaSize(64, 4, 176, 1, 1, 32), default_filter=False),
}


def every_multiple_of_16(name: str, linear: nn.Linear) -> bool:
    """The filter of the small stacks: every linear whose dims are multiples of 16."""
    return linear.in_features % 16 == 0 and linear.out_features % 16 == 0


# ---------------------------------------------------------------------------------------
# The linear rows


def linear_ratio(tokens: int, k: int, n: int, device: str, repeats: int) -> dict[str, float]:
    """Seconds per forward+backward of bf16 ``nn.Linear`` and of the FP8 linear, and their ratio."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, k, generator=g).to(device, torch.bfloat16).requires_grad_()
    w = (torch.randn(n, k, generator=g) / math.sqrt(k)).to(device, torch.bfloat16)
    w.requires_grad_()
    dy = torch.randn(tokens, n, generator=g).to(device, torch.bfloat16)

    def bf16() -> None:
        x.grad = w.grad = None
        F.linear(x, w).backward(dy)

    def fp8() -> None:
        x.grad = w.grad = None
        fp8_ops.fp8_linear(x, w).backward(dy)

    t = common.interleaved_median({"bf16": bf16, "fp8": fp8}, repeats=repeats, device=device)
    return {"bf16_s": t["bf16"], "fp8_s": t["fp8"], "speedup": t["bf16"] / t["fp8"]}


# ---------------------------------------------------------------------------------------
# The Llama-style stack


class Block(nn.Module):
    """A pre-norm Llama-style block: RMSNorm, causal attention (fused QKV), RMSNorm, SwiGLU."""

    def __init__(self, d: int, heads: int, ffn: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.RMSNorm(d), nn.RMSNorm(d)
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.o = nn.Linear(d, d, bias=False)
        self.gate_up = nn.Linear(d, 2 * ffn, bias=False)
        self.down = nn.Linear(ffn, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.o(causal_self_attention(self.qkv(self.norm1(x)), self.heads))
        gate, up = self.gate_up(self.norm2(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


def block_params(size: LlamaSize) -> int:
    """Parameters of one block."""
    return 4 * size.d * size.d + 3 * size.d * size.ffn + 2 * size.d


def blocks_for(size: LlamaSize, device: str) -> int:
    """The blocks that fill about half the GPU with O2's state (about 18 bytes a parameter:
    bf16 weights and grads, fp32 masters and Adam's two moments), the rest for activations."""
    if size.blocks is not None:
        return size.blocks
    if torch.device(device).type != "cuda":
        return 2
    total = torch.cuda.get_device_properties(torch.device(device)).total_memory
    return max(1, int(0.5 * total / (18 * block_params(size))))


def fp8_supported() -> bool:
    """Whether this amp_patch's ``initialize`` takes ``fp8=``."""
    return "fp8" in inspect.signature(amp.initialize).parameters


def _llama_session(size: LlamaSize, blocks: int, device: str, fp8: bool,
                   default_filter: bool) -> tuple[nn.Module, Any, Callable[[], None]]:
    torch.manual_seed(0)
    model = nn.Sequential(*[Block(size.d, size.heads, size.ffn) for _ in range(blocks)]).to(device)
    optimizer = FusedAdam(model.parameters(), lr=1e-4, adam_w_mode=True)
    kwargs: dict[str, Any] = {}
    if fp8:
        kwargs["fp8"] = "tensorwise"
        if not default_filter:
            kwargs["fp8_modules"] = every_multiple_of_16
    model, optimizer = amp.initialize(model, optimizer, opt_level="O2",
                                      half_dtype=torch.bfloat16, verbosity=0, **kwargs)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(size.batch, size.seq, size.d, generator=g).to(device, torch.bfloat16)

    def step() -> None:
        optimizer.zero_grad()
        loss = model(x).float().square().mean()
        with amp.scale_loss(loss, optimizer) as scaled:
            scaled.backward()
        optimizer.step()

    return model, optimizer, step


def llama_rows(size: Size, device: str, rounds: int, steps: int) -> dict[str, Any]:
    """Step time and peak memory of the stack at O2 and O2+fp8 tensorwise, rounds interleaved."""
    blocks = blocks_for(size.llama, device)
    cuda = torch.device(device).type == "cuda"
    times: dict[str, list[float]] = {"O2": [], "O2+fp8": []}
    peaks: dict[str, int] = {"O2": 0, "O2+fp8": 0}
    import time

    for _ in range(rounds):
        for row in times:
            if cuda:
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats(device)
            cpu_peak = CpuPeak()
            model, optimizer, step = _llama_session(size.llama, blocks, device, row != "O2",
                                                    size.default_filter)
            try:
                step()  # the optimizer state is made here
                cpu_peak.sample()
                common.sync(device)
                t0 = time.perf_counter()
                for _ in range(steps):
                    step()
                    cpu_peak.sample()
                common.sync(device)
                times[row].append((time.perf_counter() - t0) / steps)
                peak = torch.cuda.max_memory_allocated(device) if cuda else cpu_peak.delta()
                peaks[row] = max(peaks[row], peak)
            finally:
                amp.deinitialize()
                del model, optimizer, step
    med = {row: sorted(v)[len(v) // 2] for row, v in times.items()}
    tokens = size.llama.batch * size.llama.seq
    return {"blocks": blocks, "params": blocks * block_params(size.llama), "tokens": tokens,
            "O2_s": med["O2"], "fp8_s": med["O2+fp8"], "speedup": med["O2"] / med["O2+fp8"],
            "O2_peak": peaks["O2"], "fp8_peak": peaks["O2+fp8"],
            "memory_ratio": peaks["O2+fp8"] / peaks["O2"] if peaks["O2"] else float("nan")}


# ---------------------------------------------------------------------------------------
# The report


def _verdict(ratio: float, key: str, cuda: bool, lower_is_better: bool = False) -> str:
    if not cuda:
        return "no target on the CPU"
    target = TARGETS[key]
    ok = ratio <= target if lower_is_better else ratio >= target
    return f"{'met' if ok else 'MISSED'} ({'<=' if lower_is_better else '>='} {target:g}x)"


def section_name(device: str) -> str:
    """``fp8-cpu`` or ``fp8-cuda``."""
    return f"fp8-{torch.device(device).type}"


def report(rows: list[list[str]], device: str, size: str, llama: dict[str, Any] | None,
           partial: bool) -> str:
    """The markdown section."""
    cuda = torch.device(device).type == "cuda"
    lines = [f"## FP8 training: the FP8 linear and Llama-style blocks against bf16 "
             f"({section_name(device)})", "",
             f"Machine: {common.machine()}. Size {size}. Written by "
             "`python benchmarks/bench_fp8.py`"
             + (" (partial: the run stopped before its last row)." if partial else ".")]
    if not cuda:
        lines += ["", "On the CPU, `torch._scaled_mm` runs FP8 GEMMs without FP8 units "
                  "(on this host kind, beside its native bf16 matmuls): these ratios check "
                  "that the rows run and say nothing about a GPU, and there is no target."]
    lines += ["", "Speed-up: bf16's median seconds over FP8's, forward and backward "
              "(grad-input and grad-weight), with FP8's casts of x, W and dY (tensorwise "
              "scaling) included.", ""]
    lines.append(common.markdown_table(
        ["row", "tokens x in -> out", "bf16 ms", "FP8 ms", "speed-up", "target"], rows))
    if llama is not None:
        lines += ["", f"Llama-style stack: {llama['blocks']} block(s), "
                  f"{llama['params'] / 1e6:.1f} M params, {llama['tokens']} tokens a step, "
                  "amp_patch FusedAdam, O2 bf16 against O2 with `fp8=\"tensorwise\"`"
                  + ("" if llama.get("default_filter") else
                     " and a filter admitting every linear whose dims are multiples of 16 "
                     "(the default size rule admits none at this width)") + "."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--size", choices=list(SIZES), default=None,
                        help="full on CUDA (default there), small on the CPU (default), tiny: "
                             "the suite's smoke run")
    parser.add_argument("--repeats", type=int, default=None,
                        help="timed repeats of each linear row (default: 7, tiny 2)")
    parser.add_argument("--rounds", type=int, default=None,
                        help="interleaved rounds of the Llama rows (default: 3, tiny 1)")
    parser.add_argument("--steps", type=int, default=None,
                        help="timed steps per Llama round (default: 5, tiny 1)")
    parser.add_argument("--rows", nargs="+", choices=["linear", "filter", "llama"],
                        default=["linear", "filter", "llama"])
    parser.add_argument("--no-write", action="store_true", help="print; write no docs")
    ns = parser.parse_args(argv)
    cuda = torch.device(ns.device).type == "cuda"
    if cuda and not torch.cuda.is_available():
        parser.error("--device cuda: CUDA is not available")
    size_name = ns.size or ("full" if cuda else "small")
    if size_name == "full" and not cuda:
        parser.error("--size full is for a GPU; on the CPU use small or tiny")
    size = SIZES[size_name]
    tiny = size_name == "tiny"
    repeats = ns.repeats or (2 if tiny else 7)
    rounds = ns.rounds or (1 if tiny else 3)
    steps = ns.steps or (1 if tiny else 5)
    fp8_ops.require_fp8_gemm(ns.device)

    plan: list[tuple[str, tuple[int, int, int] | None]] = []
    for row in ns.rows:
        shapes = size.linear if row == "linear" else size.filter if row == "filter" else (None,)
        plan += [(row, shape) for shape in shapes]
    rows: list[list[str]] = []
    llama: dict[str, Any] | None = None

    def publish(done: bool) -> None:
        body = report(rows, ns.device, size_name, llama, partial=not done)
        if ns.no_write:
            if done:
                print(body)
        else:
            common.write_section(section_name(ns.device), body)
            if done:
                print(body)

    for i, (row, shape) in enumerate(plan):
        if row == "llama":
            if not fp8_supported():
                rows.append(["llama", "-", "-", "-", "n/a", "amp.initialize has no fp8= yet"])
            else:
                r = llama_rows(size, ns.device, rounds, steps)
                r["default_filter"] = size.default_filter
                llama = r
                shape_txt = f"{r['tokens']} x {size.llama.d} (stack)"
                rows.append(["llama step", shape_txt, f"{1e3 * r['O2_s']:.1f}",
                             f"{1e3 * r['fp8_s']:.1f}", f"{r['speedup']:.2f}x",
                             _verdict(r["speedup"], "llama", cuda)])
                if cuda:
                    rows.append(["llama peak memory", shape_txt,
                                 f"{r['O2_peak'] / 2**20:.0f} MiB",
                                 f"{r['fp8_peak'] / 2**20:.0f} MiB",
                                 f"{r['memory_ratio']:.2f}x O2's",
                                 _verdict(r["memory_ratio"], "memory", cuda,
                                          lower_is_better=True)])
                else:
                    # One process holds both sessions: the CPU heap the first freed serves
                    # the second, so a resident-memory peak cannot tell them apart.
                    rows.append(["llama peak memory", shape_txt, "-", "-", "n/a",
                                 "CUDA only (torch.cuda.max_memory_allocated)"])
        else:
            assert shape is not None
            t, k, n = shape
            r = linear_ratio(t, k, n, ns.device, repeats)
            rows.append([row, f"{t} x {k} -> {n}", f"{1e3 * r['bf16_s']:.2f}",
                         f"{1e3 * r['fp8_s']:.2f}", f"{r['speedup']:.2f}x",
                         _verdict(r["speedup"], row, cuda)])
        print(" | ".join(rows[-1]), flush=True)
        publish(done=i == len(plan) - 1)


if __name__ == "__main__":
    main()
