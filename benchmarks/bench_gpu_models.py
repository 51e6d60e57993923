"""GPU-filling training steps: GPT-2-small and a ResNet-50, under O0-O3, autocast and fp32/TF32.

The end-to-end benchmark (``bench_e2e.py``) uses models sized for the CPU; on a
GPU their steps take a few milliseconds and measure launch overhead. This one
trains the models that Apex's users trained:

- ``gpt2``: GPT-2-small shapes, the built-in transformer LM
  (:class:`amp_patch.cli.compare.models.TransformerLM`) at vocab 50257, width 768,
  12 blocks of 12 heads, seq 1024, batch 8, its output head tied to the token
  embedding as GPT-2's is: 124 M params. Throughput in tokens per second.
- ``resnet50``: a ResNet-50 (bottleneck blocks 3-4-6-3, 25.6 M params),
  written here with ``torch.nn``, on 224x224 images, batch 128,
  ``channels_last``. Throughput in images per second.

Rows, each in its own spawned process (clean patches, its own memory peak),
one after another so that no two share the GPU:

- ``O0``: fp32, TF32 off; ``O0-tf32``: fp32 with TF32 matmuls and convolutions
  (``torch.backends.cuda.matmul.allow_tf32``, ``torch.backends.cudnn.allow_tf32``),
  the fp32 that an Ampere-or-later GPU trains with. Both with ``AdamW(fused=True)``.
- ``O1``: amp_patch O1 with ``AdamW(fused=True)``;
- ``O2``, ``O3``: amp_patch with its ``FusedAdam`` (AdamW mode; the one-pass
  step at O2);
- ``autocast``: ``torch.autocast`` with ``torch.amp.GradScaler`` (fp16) and
  ``AdamW(fused=True)``, torch's own fastest recipe.

O1-O3 and autocast run in each half dtype asked for; the fp32 rows once per
workload. A row trains ``--warmup`` untimed steps (the optimizer state is made
there), then ``--steps`` timed steps as one block, the device synchronised
before and after: the step time is the block's time over its steps, as a
training loop that never waits sees it. Peak memory is
``torch.cuda.max_memory_allocated`` over the timed block (on the CPU: the peak
anonymous resident memory above the process's before the model was built,
sampled after forward, backward and step, as ``amp-patch compare`` measures).

Targets (docs/design.md, "Performance targets"), each against an anchor of the
same run, in each half dtype:

- G1: O2 + FusedAdam throughput >= 1.2x autocast + fused AdamW (GPT-2-small);
- G2 (E1 on the GPU): O1 step time <= 1.03x autocast's;
- M1: O3 peak memory <= 0.55x O0's (the fp32 row), both net of the fp32 loss over the
  logits, which Apex's fp32 model outputs keep the same at every level
  (:func:`loss_fp32_bytes`; the raw ratio is in the table).

The section ``gpu-models-<device>`` of ``docs/benchmarks.md`` is rewritten, with
the GPU's name, torch version and date. On the CPU the script runs at
``--size tiny`` (a few-layer LM and a narrow ResNet of the same structure, at
small shapes) so that the suite can run it: those numbers say nothing about a
GPU, and the section says so.

Usage::

    python benchmarks/bench_gpu_models.py --device cuda
    python benchmarks/bench_gpu_models.py --device cuda --grid gpt2:fp16 gpt2:bf16 resnet50:fp16
    python benchmarks/bench_gpu_models.py --device cpu --size tiny --steps 2 --no-write
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import multiprocessing as mp
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

from amp_patch.cli.compare import models  # noqa: E402
from amp_patch.cli.compare.trainer import HALF_DTYPES, CpuPeak, LevelTrainer  # noqa: E402
from amp_patch.cli.host_facts import LoadMonitor  # noqa: E402
from amp_patch.optim.fused import FusedAdam  # noqa: E402

#: The rows: name to (the level LevelTrainer runs, TF32 on, amp_patch's FusedAdam).
ROWS: dict[str, tuple[str, bool, bool]] = {
    "O0": ("O0", False, False),
    "O0-tf32": ("O0", True, False),
    "O1": ("O1", False, False),
    "O2": ("O2", False, True),
    "O3": ("O3", False, True),
    "autocast": ("autocast", False, False),
}
#: The rows that compute in fp32 whatever the half dtype: run once per workload.
FP32_ROWS = ("O0", "O0-tf32")
#: The rows run by default on each device (TF32 means nothing on the CPU).
DEFAULT_ROWS = {"cuda": ("O0-tf32", "O1", "O2", "O3", "autocast"),
                "cpu": ("O0", "O1", "O2", "O3", "autocast")}


# --------------------------------------------------------------------------- the models


@dataclasses.dataclass(frozen=True)
class ResNetConfig:
    """Sizes of :class:`ResNet`: ResNet-50 by default.

    Args:
        blocks (tuple of int): bottleneck blocks per stage.
        width (int): the first stage's bottleneck width (doubled per stage; a
            block's output is four times its width).
        classes (int): output classes.
        image_size (int): input height and width.
        batch_size (int): images per batch.
        lr (float): AdamW learning rate.
    """

    blocks: tuple[int, ...] = (3, 4, 6, 3)
    width: int = 64
    classes: int = 1000
    image_size: int = 224
    batch_size: int = 128
    lr: float = 1e-3


class _Bottleneck(nn.Module):
    def __init__(self, cin: int, width: int, stride: int) -> None:
        super().__init__()
        cout = 4 * width
        self.conv1 = nn.Conv2d(cin, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        # The stride on the 3x3 convolution, as torchvision's ResNet v1.5 has it.
        self.conv2 = nn.Conv2d(width, width, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, cout, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(cout)
        self.down: nn.Module | None = None
        if stride != 1 or cin != cout:
            self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride=stride, bias=False),
                                      nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.down is None else self.down(x)
        y = F.relu(self.bn1(self.conv1(x)), inplace=True)
        y = F.relu(self.bn2(self.conv2(y)), inplace=True)
        return F.relu(self.bn3(self.conv3(y)) + identity, inplace=True)


class ResNet(nn.Module):
    """A ResNet of bottleneck blocks: the stem (7x7 convolution, max pool), four stages, a
    linear classifier. :class:`ResNetConfig`'s defaults make ResNet-50 (25.6 M params).

    Args:
        config (ResNetConfig): the sizes.

    Example::

        >>> model = ResNet(ResNetConfig()).to(memory_format=torch.channels_last)
        >>> model(torch.randn(2, 3, 224, 224)).shape
        torch.Size([2, 1000])
    """

    def __init__(self, config: ResNetConfig) -> None:
        super().__init__()
        w = config.width
        self.stem = nn.Sequential(nn.Conv2d(3, w, 7, stride=2, padding=3, bias=False),
                                  nn.BatchNorm2d(w), nn.ReLU(inplace=True),
                                  nn.MaxPool2d(3, stride=2, padding=1))
        stages: list[nn.Module] = []
        cin = w
        for i, n in enumerate(config.blocks):
            width = w * 2**i
            for j in range(n):
                stages.append(_Bottleneck(cin, width, 2 if (j == 0 and i > 0) else 1))
                cin = 4 * width
        self.stages = nn.Sequential(*stages)
        self.fc = nn.Linear(cin, config.classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits of shape ``(batch, classes)`` for images of shape ``(batch, 3, H, W)``."""
        x = self.stages(self.stem(x))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


#: GPT-2-small: 124 M params with the head tied to the embedding.
GPT2 = models.LMConfig(vocab=50257, d_model=768, n_layers=12, n_heads=12, seq_len=1024,
                       batch_size=8, lr=6e-4)

#: Full (GPU) and tiny (the CPU test) sizes of each workload.
SIZES: dict[str, dict[str, Any]] = {
    "full": {"gpt2": GPT2, "resnet50": ResNetConfig()},
    "tiny": {"gpt2": models.LMConfig(vocab=512, d_model=64, n_layers=2, n_heads=4, seq_len=32,
                                     batch_size=2, lr=6e-4),
             "resnet50": ResNetConfig(blocks=(1, 1, 1, 1), width=8, classes=10, image_size=32,
                                      batch_size=4)},
}
ABOUT = {
    "gpt2": "GPT-2-small shapes: the built-in transformer LM, head tied to the embedding",
    "resnet50": "ResNet-50: bottleneck blocks, BatchNorm, channels_last",
}
#: What a workload's throughput counts.
UNIT = {"gpt2": "tokens", "resnet50": "images"}


def _optimizer(params, lr: float, fused_adam: bool) -> torch.optim.Optimizer:
    params = list(params)
    if fused_adam:
        return FusedAdam(params, lr=lr, weight_decay=0.01)
    return torch.optim.AdamW(params, lr=lr, weight_decay=0.01, fused=True)


def gpt2(device: str | torch.device = "cpu", seed: int = 0, size: str = "full",
         fused_adam: bool = False) -> models.Workload:
    """GPT-2-small shapes (or ``size="tiny"``): the built-in LM with its head tied to the
    token embedding, on uniformly random tokens.

    Args:
        device (str or torch.device, optional): Default: ``"cpu"``.
        seed (int, optional): seeds the weights and the data. Default: 0.
        size (str, optional): ``"full"`` or ``"tiny"`` (:data:`SIZES`). Default: ``"full"``.
        fused_adam (bool, optional): amp_patch's FusedAdam (AdamW mode) instead of
            ``AdamW(fused=True)``. Default: False.

    Returns:
        Workload: ``(model, optimizer, batch_fn, loss_fn)``.

    Example::

        >>> model, opt, batch_fn, loss_fn = gpt2(size="tiny")
        >>> loss_fn(model, batch_fn(0)).shape
        torch.Size([])
    """
    cfg: models.LMConfig = SIZES[size]["gpt2"]
    device = torch.device(device)
    torch.manual_seed(seed)
    model = models.TransformerLM(cfg)
    model.head.weight = model.tok.weight  # GPT-2 ties them: 124 M params, not 163 M
    model.to(device)
    optimizer = _optimizer(model.parameters(), cfg.lr, fused_adam)

    def batch_fn(step: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(seed * 1_000_003 + step)
        return torch.randint(cfg.vocab, (cfg.batch_size, cfg.seq_len + 1), generator=g).to(device)

    def loss_fn(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
        logits = model(tokens[:, :-1])
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(),
                               tokens[:, 1:].reshape(-1))

    return models.Workload(model, optimizer, batch_fn, loss_fn)


def resnet50(device: str | torch.device = "cpu", seed: int = 0, size: str = "full",
             fused_adam: bool = False) -> models.Workload:
    """ResNet-50 (or ``size="tiny"``) in ``channels_last``, on random images and labels.

    Args:
        device (str or torch.device, optional): Default: ``"cpu"``.
        seed (int, optional): seeds the weights and the data. Default: 0.
        size (str, optional): ``"full"`` or ``"tiny"`` (:data:`SIZES`). Default: ``"full"``.
        fused_adam (bool, optional): amp_patch's FusedAdam (AdamW mode) instead of
            ``AdamW(fused=True)``. Default: False.

    Returns:
        Workload: ``(model, optimizer, batch_fn, loss_fn)``.
    """
    cfg: ResNetConfig = SIZES[size]["resnet50"]
    device = torch.device(device)
    torch.manual_seed(seed)
    model = ResNet(cfg).to(device, memory_format=torch.channels_last)
    optimizer = _optimizer(model.parameters(), cfg.lr, fused_adam)

    def batch_fn(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(seed * 1_000_003 + step)
        x = torch.randn(cfg.batch_size, 3, cfg.image_size, cfg.image_size, generator=g)
        y = torch.randint(cfg.classes, (cfg.batch_size,), generator=g)
        return x.to(device, memory_format=torch.channels_last), y.to(device)

    def loss_fn(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(model(x).float(), y)

    return models.Workload(model, optimizer, batch_fn, loss_fn)


WORKLOADS: dict[str, Callable[..., models.Workload]] = {"gpt2": gpt2, "resnet50": resnet50}


def items_per_step(workload: str, size: str) -> int:
    """Tokens (gpt2) or images (resnet50) that one training step consumes."""
    cfg = SIZES[size][workload]
    return cfg.batch_size * (cfg.seq_len if workload == "gpt2" else 1)


# --------------------------------------------------------------------------- one row


@dataclasses.dataclass(frozen=True)
class RowSpec:
    """One row to measure, in its own process. Picklable.

    Args:
        workload (str): a key of :data:`WORKLOADS`.
        row (str): a key of :data:`ROWS`.
        half_dtype (str): ``"fp16"`` or ``"bf16"`` (ignored by the fp32 rows).
        device (str): ``"cuda"`` or ``"cpu"``.
        size (str): a key of :data:`SIZES`.
        warmup (int): untimed steps.
        steps (int): timed steps.
    """

    workload: str
    row: str
    half_dtype: str
    device: str
    size: str
    warmup: int
    steps: int


@dataclasses.dataclass
class RowResult:
    """What a row's process measured (or why it failed).

    Attributes:
        step_seconds (float or None): the timed block's time over its steps.
        peak_bytes (int or None): peak memory over the timed block.
        params (int): parameters of the model.
        final_loss (float or None): the last step's loss.
        error (str or None): the last line of the traceback, when the row failed.
    """

    spec: RowSpec
    step_seconds: float | None = None
    peak_bytes: int | None = None
    params: int = 0
    final_loss: float | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.step_seconds is not None


def _set_tf32(on: bool) -> None:
    torch.backends.cuda.matmul.allow_tf32 = on
    torch.backends.cudnn.allow_tf32 = on


def run_row(spec: RowSpec) -> RowResult:
    """Build the row's workload in this process, train it and measure it (a row process's body)."""
    level, tf32, fused_adam = ROWS[spec.row]
    device = torch.device(spec.device)
    cpu_peak = CpuPeak()  # its baseline is taken before the model exists
    _set_tf32(tf32)
    model, optimizer, batch_fn, loss_fn = WORKLOADS[spec.workload](
        device=device, size=spec.size, fused_adam=fused_adam)
    result = RowResult(spec, params=models.parameter_count(model))
    trainer = LevelTrainer(level, model, optimizer, loss_fn, device,
                           HALF_DTYPES[spec.half_dtype], sample=cpu_peak.sample)
    try:
        batches = [batch_fn(i) for i in range(2)]
        loss = None
        for i in range(spec.warmup):
            loss = trainer.step(batches[i % 2])
        common.sync(device)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        cpu_peak.restart()
        t0 = time.perf_counter()
        for i in range(spec.steps):
            loss = trainer.step(batches[i % 2])
        common.sync(device)
        result.step_seconds = (time.perf_counter() - t0) / max(spec.steps, 1)
        result.peak_bytes = (int(torch.cuda.max_memory_allocated(device)) if device.type == "cuda"
                             else cpu_peak.delta())
        result.final_loss = None if loss is None else float(loss)
    finally:
        trainer.close()
    return result


def _run_isolated(spec: RowSpec) -> RowResult:
    """:func:`run_row` in a fresh spawned process; a failure (an OOM, a crash) becomes the
    row's error."""
    ctx = mp.get_context("spawn")
    try:
        with concurrent.futures.ProcessPoolExecutor(max_workers=1, mp_context=ctx) as pool:
            return pool.submit(run_row, spec).result()
    except Exception as exc:  # the row failed; the others still run
        lines = traceback.format_exception_only(type(exc), exc)
        return RowResult(spec, error=lines[-1].strip())


def plan(grid: list[tuple[str, str]], rows: tuple[str, ...], device: str, size: str,
         warmup: int, steps: int) -> list[RowSpec]:
    """The rows to run for ``grid`` (``(workload, half dtype)`` pairs): the fp32 rows once
    per workload (under its first half dtype), the others per pair."""
    specs: list[RowSpec] = []
    seen_fp32: set[tuple[str, str]] = set()
    for workload, half in grid:
        for row in rows:
            if row in FP32_ROWS:
                if (workload, row) in seen_fp32:
                    continue
                seen_fp32.add((workload, row))
            specs.append(RowSpec(workload, row, half, device, size, warmup, steps))
    return specs


# --------------------------------------------------------------------------- the report


#: (id, what, workloads, kind, target, "<=" or ">="); kind picks the measure in _target_value.
TARGETS = [
    ("G1", "O2 throughput / autocast throughput", ("gpt2",), "g1", 1.2, ">="),
    ("G2", "O1 step time / autocast step time", ("gpt2", "resnet50"), "g2", 1.03, "<="),
    ("M1", "(O3 peak - L) / (O0 peak - L), L the fp32 loss over the logits",
     ("gpt2", "resnet50"), "m1", 0.55, "<="),
]


def loss_fp32_bytes(workload: str, size: str) -> int:
    """L of M1: what the loss holds in fp32 at the end of the forward, the same at every level.

    The model's outputs come back in fp32 (``cast_model_outputs``' default, as
    Apex's), and the cross-entropy keeps its log-softmax, also fp32, for the
    backward: two tensors of the logits' size (section m1-memory-cpu counts them).

    Example::

        >>> loss_fp32_bytes("gpt2", "full") // 2**20  # 2 x 8 x 1024 x 50257 x 4 bytes
        3141
    """
    cfg = SIZES[size][workload]
    per_item = cfg.seq_len * cfg.vocab if workload == "gpt2" else cfg.classes
    return 2 * cfg.batch_size * per_item * 4



def _find(results: list[RowResult], workload: str, row: str, half: str) -> RowResult | None:
    for r in results:
        if (r.spec.workload == workload and r.spec.row == row
                and (row in FP32_ROWS or r.spec.half_dtype == half) and r.ok):
            return r
    return None


def _fp32_anchor(results: list[RowResult], workload: str) -> RowResult | None:
    return _find(results, workload, "O0", "") or _find(results, workload, "O0-tf32", "")


def _target_value(kind: str, results: list[RowResult], workload: str, half: str,
                  size: str = "full") -> float | None:
    def get(row: str) -> RowResult | None:
        return _find(results, workload, row, half)

    autocast = get("autocast")
    if kind == "g1":
        o2 = get("O2")
        return (autocast.step_seconds / o2.step_seconds  # type: ignore[operator]
                if o2 and autocast else None)
    if kind == "g2":
        o1 = get("O1")
        return (o1.step_seconds / autocast.step_seconds  # type: ignore[operator]
                if o1 and autocast else None)
    o3, o0 = get("O3"), _fp32_anchor(results, workload)
    if not (o3 and o0 and o3.peak_bytes is not None and o0.peak_bytes):
        return None
    fixed = loss_fp32_bytes(workload, size)
    if o0.peak_bytes <= fixed:
        return None
    return (o3.peak_bytes - fixed) / (o0.peak_bytes - fixed)


def _mib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**20:.0f} MiB"


def section_name(device: str, size: str) -> str:
    """The section of docs/benchmarks.md a run writes: ``gpu-models-cuda``, or on the CPU
    ``gpu-models-cpu-<size>``."""
    if device == "cuda" and size == "full":
        return "gpu-models-cuda"
    return f"gpu-models-{device}-{size}"


def report(results: list[RowResult], grid: list[tuple[str, str]], device: str, size: str,
           warmup: int, steps: int, load: LoadMonitor, notes: dict[str, str] | None = None,
           planned: int | None = None) -> str:
    """The markdown section: one table per workload, then the targets.

    Args:
        notes (dict, optional): target id to a note shown beside its rows (M1's explanation).
        planned (int, optional): the rows the run set out to measure, when ``results`` holds
            fewer (a run stopped by its time limit): the section says it is partial.
    """
    gpu = device == "cuda"
    host = torch.cuda.get_device_name() if gpu else _host_kind()
    parts = [
        f"## GPU-filling models: GPT-2-small and ResNet-50 ({section_name(device, size)})",
        "",
        f"Machine: {common.machine()}. Host kind: {host}. Machine load: {load.line()}.",
        "",
        f"Each row in its own spawned process, one after another: {warmup} untimed steps (the "
        f"optimizer state is made there), then {steps} timed steps as one block, the device "
        "synchronised before and after; ms/step is the block's time over its steps. Peak "
        + ("memory: `torch.cuda.max_memory_allocated` over the timed block. "
           if gpu else "memory: the peak anonymous resident memory above the process's before "
                       "the model was built, over the timed block. ")
        + "O0 and O0-tf32 are fp32 (TF32 off and on) with `AdamW(fused=True)`, O1 with "
        "`AdamW(fused=True)`, O2 and O3 with amp_patch's `FusedAdam` (AdamW mode), autocast "
        "with `AdamW(fused=True)` and `GradScaler` in fp16.",
    ]
    if planned is not None and len(results) < planned:
        parts += ["", f"**Partial: {len(results)} of {planned} rows; the run stopped (its time "
                      "limit) before the rest. A target whose rows are missing is not measured.**"]
    if not (gpu and size == "full"):
        parts += ["", f"**Size {size} on the {device}: a smoke run of the script, not a "
                      "measurement of what mixed precision gives a GPU-filling model.**"]
    for workload in dict.fromkeys(w for w, _ in grid):
        rows = [r for r in results if r.spec.workload == workload]
        params = next((r.params for r in rows if r.params), 0)
        cfg = SIZES[size][workload]
        shape = (f"vocab {cfg.vocab}, width {cfg.d_model}, {cfg.n_layers} blocks, seq "
                 f"{cfg.seq_len}, batch {cfg.batch_size}" if workload == "gpt2" else
                 f"blocks {'-'.join(map(str, cfg.blocks))}, width {cfg.width}, "
                 f"{cfg.image_size}x{cfg.image_size}, batch {cfg.batch_size}")
        unit = UNIT[workload]
        table_rows = []
        for r in rows:
            half = "fp32" if r.spec.row in FP32_ROWS else r.spec.half_dtype
            if not r.ok:
                table_rows.append([r.spec.row, half, "failed", "-", "-", "-", "-", r.error or ""])
                continue
            autocast = _find(results, workload, "autocast",
                             r.spec.half_dtype if r.spec.row not in FP32_ROWS else "")
            anchor = _fp32_anchor(results, workload)
            speed = items_per_step(workload, size) / r.step_seconds  # type: ignore[operator]
            vs_autocast = ("-" if autocast is None or r.spec.row in FP32_ROWS
                           else f"{autocast.step_seconds / r.step_seconds:.2f}x")  # type: ignore[operator]
            vs_o0 = ("-" if anchor is None or not anchor.peak_bytes or r.peak_bytes is None
                     else f"{r.peak_bytes / anchor.peak_bytes:.2f}x")
            table_rows.append([r.spec.row, half, f"{r.step_seconds * 1e3:.1f}",  # type: ignore[operator]
                               f"{speed:,.0f}", vs_autocast, _mib(r.peak_bytes), vs_o0,
                               f"{r.final_loss:.3f}" if r.final_loss is not None else "-"])
        parts += ["", f"### {workload}: {ABOUT[workload]} ({params / 1e6:.1f} M params; {shape})",
                  "", common.markdown_table(
                      ["row", "dtype", "ms/step", f"{unit}/s", "throughput / autocast's",
                       "peak memory", "peak / O0's", "last loss"], table_rows)]
    target_rows = []
    halves = list(dict.fromkeys(h for _, h in grid))
    for tid, what, workloads, kind, target, sense in TARGETS:
        for workload in workloads:
            if workload not in dict(grid):
                continue
            for half in halves:
                if (workload, half) not in grid:
                    continue
                value = _target_value(kind, results, workload, half, size)
                met = value is not None and (value >= target if sense == ">=" else value <= target)
                verdict = ("not measured" if value is None else "met" if met else "**missed**")
                if not (gpu and size == "full") and value is not None:
                    verdict += " (not a GPU: not judged)"
                note = (notes or {}).get(tid, "")
                target_rows.append([tid, workload, half, what, f"{sense} {target}",
                                    "-" if value is None else f"{value:.3f}", verdict, note])
    parts += ["", "### Targets (docs/design.md)", "",
              common.markdown_table(["id", "workload", "dtype", "ratio", "target", "measured",
                                     "verdict", "note"], target_rows)]
    return "\n".join(parts) + "\n"


def _host_kind() -> str:
    """The CPU and its kind for bf16: native bf16 (matmul and conv), conv-only, or none."""
    import amp_patch as amp

    bf16 = amp.cpu_half_support().bfloat16
    kind = ("native bf16" if bf16.matmul and bf16.conv else "conv-only bf16" if bf16.conv
            else "no native bf16")
    return f"{kind}; {amp.cpu_half_support().host()}"


def _parse_grid(items: list[str]) -> list[tuple[str, str]]:
    grid = []
    for item in items:
        workload, sep, half = item.partition(":")
        if not sep or workload not in WORKLOADS or half not in HALF_DTYPES:
            raise ValueError(f"--grid {item!r}: expected WORKLOAD:DTYPE with WORKLOAD one of "
                             f"{', '.join(WORKLOADS)} and DTYPE one of {', '.join(HALF_DTYPES)}")
        grid.append((workload, half))
    return grid


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="where the rows train (default: cuda)")
    p.add_argument("--size", choices=tuple(SIZES), default=None,
                   help="full (GPU) or tiny (the CPU smoke run); default: full on cuda, tiny "
                        "on cpu")
    p.add_argument("--grid", nargs="+", default=None, metavar="WORKLOAD:DTYPE",
                   help="workloads and half dtypes (default: gpt2 and resnet50 in fp16 and bf16 "
                        "on cuda, in bf16 on cpu)")
    p.add_argument("--rows", nargs="+", choices=tuple(ROWS), default=None,
                   help="rows per pair (default: " + "; ".join(
                       f"{d}: {' '.join(r)}" for d, r in DEFAULT_ROWS.items()) + ")")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per row (default: 3)")
    p.add_argument("--steps", type=int, default=6, help="timed steps per row (default: 6)")
    p.add_argument("--no-write", action="store_true", help="print only; leave docs/benchmarks.md")
    p.add_argument("--m1-count", action="store_true",
                   help="instead: count what holds the memory of the benchmark LM and of GPT-2-small "
                        "(batch 1) at O0 and O3 on the CPU (section m1-memory-cpu)")
    ns = p.parse_args(argv)
    if ns.m1_count:
        counts = {}
        for name, cfg in M1_MODELS.items():
            counts[name] = {}
            for lv in ("O0", "O3"):
                print(f"  counting {name} at {lv}", file=sys.stderr, flush=True)
                counts[name][lv] = memory_count(lv, cfg=cfg)
        common.publish("m1-memory-cpu", m1_report(counts), write=not ns.no_write)
        return 0
    size = ns.size or ("full" if ns.device == "cuda" else "tiny")
    if ns.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: CUDA is not available to this torch "
                f"({torch.__version__}, CUDA {torch.version.cuda}); on the CPU use "
                "--device cpu --size tiny")
    if ns.device == "cpu" and size == "full":
        p.error("--size full on the CPU would take minutes per step (124 M params at seq 1024); "
                "use --size tiny")
    halves = ("fp16", "bf16") if ns.device == "cuda" else ("bf16",)
    try:
        grid = _parse_grid(ns.grid or [f"{w}:{h}" for w in WORKLOADS for h in halves])
    except ValueError as exc:
        p.error(str(exc))
    rows = tuple(ns.rows or DEFAULT_ROWS[ns.device])
    specs = plan(grid, rows, ns.device, size, ns.warmup, ns.steps)
    load = LoadMonitor().start()
    results = []
    for i, spec in enumerate(specs):
        t0 = time.perf_counter()
        result = _run_isolated(spec)
        results.append(result)
        how = (f"{result.step_seconds * 1e3:.1f} ms/step, peak {_mib(result.peak_bytes)}"
               if result.ok else f"FAILED: {result.error}")
        print(f"  [{i + 1}/{len(specs)}] {spec.workload} {spec.row} {spec.half_dtype}: {how} "
              f"({time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)
        if not ns.no_write and i + 1 < len(specs):
            # Device time is short: the rows measured so far are written after each row, so a
            # run stopped by its time limit still leaves them, marked partial.
            common.publish(section_name(ns.device, size),
                           report(results, grid, ns.device, size, ns.warmup, ns.steps, load,
                                  notes=M1_NOTES if size == "full" else None,
                                  planned=len(specs)), write=True)
    body = report(results, grid, ns.device, size, ns.warmup, ns.steps, load.stop(),
                  notes=M1_NOTES if size == "full" else None)
    common.publish(section_name(ns.device, size), body, write=not ns.no_write)
    return 0 if all(r.ok for r in results) else 1


#: Notes shown beside a target's rows.
M1_NOTES: dict[str, str] = {
    "M1": ("net of L, the fp32 loss over the logits, which no level halves (section "
           "m1-memory-cpu); the raw O3 / O0 is the table's peak / O0's"),
}


# --------------------------------------------------------------------------- M1: what holds memory


def memory_count(level: str, half_dtype: str = "bf16",
                 cfg: models.LMConfig | None = None) -> dict[str, Any]:
    """Bytes that one training step of the benchmark LM (``models.BENCH_LM``) holds at its
    peak on the CPU, by kind, counted from the profiler's allocation events.

    The params, the optimizer's state and the masters are counted from the
    tensors themselves; the step's own allocations (the previous step's grads
    freed by ``zero_grad``, then activations, logits, grads, temporaries) are a
    running sum of every op's self-allocated bytes in the order the ops ran, and
    its maximum is the step's peak above what persists. ``logits_fp32`` is
    what the loss holds in fp32 at the end of the forward (the fp32 logits and
    the log-softmax over them, ``B * T * V * 4`` bytes each), whatever the level.

    Args:
        level (str): an amp level or ``"autocast"``.
        half_dtype (str, optional): ``"bf16"`` or ``"fp16"``. Default: ``"bf16"``.
        cfg (LMConfig, optional): the LM. Default: ``models.BENCH_LM``.

    Returns:
        dict: ``params``, ``masters``, ``state``, ``grads``, ``step_peak`` (the
        running sum's maximum, grads included), ``peak`` (persistent +
        step_peak), ``logits_fp32``, and ``peak_at``: the name of the op whose
        allocation reached the peak.
    """
    from torch.profiler import ProfilerActivity, profile

    cfg = cfg or models.BENCH_LM
    model, optimizer, batch_fn, loss_fn = models.lm(config=cfg)
    trainer = LevelTrainer(level, model, optimizer, loss_fn, torch.device("cpu"),
                           HALF_DTYPES[half_dtype])
    try:
        batch = batch_fn(0)
        trainer.step(batch)  # the optimizer state exists from here on

        def nbytes(tensors) -> int:
            return sum(t.untyped_storage().nbytes() for t in tensors)

        own = {id(p) for p in model.parameters()}
        sizes = {
            "params": nbytes(model.parameters()),
            "masters": nbytes(p for g in optimizer.param_groups for p in g["params"]
                              if id(p) not in own),
            "state": nbytes(v for s in optimizer.state.values() for v in s.values()
                            if isinstance(v, torch.Tensor)),
            "grads": nbytes(p.grad for p in model.parameters() if p.grad is not None),
        }
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            trainer.step(batch)
    finally:
        trainer.close()
    live = peak = sizes["grads"]  # zero_grad frees them first
    peak_at = "zero_grad"
    for event in sorted(prof.events(), key=lambda e: e.time_range.start):
        live += event.cpu_memory_usage if event.name == "[memory]" else event.self_cpu_memory_usage
        if live > peak:
            peak, peak_at = live, event.name
    result: dict[str, Any] = dict(sizes, step_peak=peak, peak_at=peak_at)
    result["peak"] = sizes["params"] + sizes["masters"] + sizes["state"] + peak
    result["logits_fp32"] = 2 * cfg.batch_size * cfg.seq_len * cfg.vocab * 4
    return result


#: The LMs whose memory ``--m1-count`` counts: the benchmark LM, and GPT-2-small at batch 1
#: (the GPU rows' model; a batch of 8 would take minutes of CPU per level).
M1_MODELS = {"benchmark LM": models.BENCH_LM,
             "GPT-2-small, batch 1": dataclasses.replace(GPT2, batch_size=1)}


def m1_report(counts: dict[str, dict[str, dict[str, Any]]]) -> str:
    """The section ``m1-memory-cpu``: what holds the memory at O0 and O3, for each LM of
    :data:`M1_MODELS` (``counts[model][level]`` from :func:`memory_count`), and M1 net of
    the fp32 loss."""
    m = 2**20
    parts = [
        "## M1: what holds the memory of the benchmark LM at O0 and O3 (m1-memory-cpu)",
        "",
        f"Machine: {common.machine()}. Host kind: {_host_kind()}.",
        "",
        "One training step in bf16 with torch AdamW, counted on the CPU by `python "
        "benchmarks/bench_gpu_models.py --m1-count`: params, masters and optimizer state from "
        "the tensors; the step's own peak (the previous grads, then activations, logits, new "
        "grads, temporaries) as the maximum of a running sum of every op's self-allocated "
        "bytes, from the profiler. L is the fp32 loss over the logits: O3's model returns its "
        "logits cast to fp32 (`cast_model_outputs` defaults to fp32, as Apex's did) and the "
        "loss keeps `log_softmax` of them in fp32 for the backward, 2 x B x T x V x 4 bytes "
        "at either level. MiB:",
    ]
    for name, by_level in counts.items():
        cfg = M1_MODELS.get(name)
        o0, o3 = by_level["O0"], by_level["O3"]
        fixed = o0["logits_fp32"]
        rows = [[lv, *(f"{c[k] / m:.0f}" for k in ("params", "masters", "state", "step_peak",
                                                    "peak", "logits_fp32"))]
                for lv, c in by_level.items()]
        shape = ("" if cfg is None else f" (vocab {cfg.vocab}, d_model {cfg.d_model}, "
                 f"{cfg.n_layers} blocks, seq {cfg.seq_len}, batch {cfg.batch_size})")
        parts += ["", f"### {name}{shape}", "",
                  common.markdown_table(["level", "params", "masters", "optimizer state",
                                         "step's peak (grads, activations, logits)", "peak",
                                         "L"], rows),
                  "",
                  f"O3 / O0: {o3['peak'] / o0['peak']:.3f}; net of L, (O3 - L) / (O0 - L): "
                  f"**{(o3['peak'] - fixed) / (o0['peak'] - fixed):.3f}**. The peak is reached "
                  f"in `{o0['peak_at']}` at O0 and `{o3['peak_at']}` at O3."]
    parts += [
        "",
        "Params, optimizer state, grads and activations all halve at O3; L does not, and "
        "nothing a level does can halve it while the model's outputs come back in fp32. So "
        "M1 (docs/design.md) is taken net of L: the raw ratio's floor is set by the "
        "vocabulary against the rest (V = 8192 against d_model = 512 in the benchmark LM, "
        "50257 against 768 in GPT-2), not by amp. On a GPU other terms may not halve "
        "either: cuBLAS's workspace comes from the caching allocator and counts in "
        "`max_memory_allocated`, and torch's AdamW on CUDA keeps temporaries the size of the "
        "state; the GPU rows of section gpu-models-cuda measure them.",
    ]
    return "\n".join(parts) + "\n"

if __name__ == "__main__":
    sys.exit(main())
