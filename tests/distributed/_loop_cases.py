"""Real training loops on 2 gloo ranks, at every level, on FSDP2 and on DDP (docs/distributed.md).

Every case is ``CASE:STRATEGY:LEVEL`` and runs one loop twice: on the ranks,
each on its share of every global batch, and in one process on the whole
batch (the reference, computed by every rank for itself). It then checks:

- the ranks agree: the same recorded losses, bit for bit, the same
  parameters (DDP's replicas bit for bit; FSDP2's shards gathered) and the
  same loss scalers;
- the losses and the stepped parameters match the single process within
  :data:`_dist_cases.TOLERANCE` of the level (reduction order, and bf16 sums
  rounded per rank before they are added).

The workers run with ``AMP_PATCH_DEBUG_RANKS=1``, so every ``scale_loss`` of
every case also checks that the ranks made the same amp decisions. Run by
``tests/distributed/test_rank_agreement.py`` through ``_dist_cases.launch``: one group of
2 processes runs them all.
"""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import amp_patch as amp  # noqa: E402
import _dist_cases as dc  # noqa: E402
from amp_patch.helpers.tensors import local_tensor  # noqa: E402

CASES: dict[str, Callable[[dc.Ctx], None]] = {}
STRATEGIES = ("fsdp2", "ddp")
#: The loops, a to h of docs/distributed.md's list of real loops.
LOOPS = ("eval_grad", "eval_no_grad", "accumulate", "checkpointing", "two_losses", "frozen",
         "overflow_one_rank", "dcp_resume")


# --------------------------------------------------------------------------- models


class Block(nn.Module):
    """A residual MLP block whose inside is recomputed in backward (non-reentrant checkpoint)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(width, width), nn.Linear(width, width)

    def inner(self, x):
        return self.fc2(F.relu(self.fc1(x)))

    def forward(self, x):
        return x + checkpoint(self.inner, x, use_reentrant=False)


class WithUnused(nn.Module):
    """An MLP and a layer that forward never calls (DDP's ``find_unused_parameters``)."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        self.net = dc.mlp(seed)
        self.unused = nn.Linear(4, 4)

    def forward(self, x):
        return self.net(x)


def build(loop: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    if loop == "checkpointing":
        return nn.Sequential(nn.Linear(8, 32), Block(32), Block(32), nn.Linear(32, 4))
    if loop == "frozen":
        model = WithUnused(seed)
        model.net[0].requires_grad_(False)  # a frozen submodule
        return model
    return dc.mlp(seed)


def shard(model: nn.Module, mesh=None) -> nn.Module:
    """fully_shard each Block and each Linear outside one (each its own FSDP group), then the
    root."""
    from torch.distributed.fsdp import fully_shard

    inside = {id(m) for b in model.modules() if isinstance(b, Block) for m in b.modules()}
    for m in model.modules():
        if m is not model and (isinstance(m, Block) or
                               (isinstance(m, nn.Linear) and id(m) not in inside)):
            fully_shard(m, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


# --------------------------------------------------------------------------- one run


class Run:
    """One training run of a loop: distributed over the ranks, or one process on the whole batch."""

    def __init__(self, ctx: dc.Ctx, loop: str, strategy: str, level: str, distributed: bool,
                 seed: int = 0, mesh=None) -> None:
        self.ctx, self.loop, self.strategy, self.level = ctx, loop, strategy, level
        self.distributed = distributed
        self.solo = False  # set for FSDP2 on a 1-rank mesh: each rank trains on the whole batch
        self.model = build(loop, seed)
        if distributed and strategy == "fsdp2":
            shard(self.model, mesh)
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.opt = torch.optim.SGD(params, lr=0.1, momentum=0.9)
        kwargs = dict(loss_scale="dynamic", verbosity=0)
        if loop == "two_losses":
            kwargs["num_losses"] = 2
        if loop == "overflow_one_rank":
            kwargs["half_dtype"] = torch.float16
        self.model, self.opt = amp.initialize(self.model, self.opt, opt_level=level, **kwargs)
        self.run = self.model
        if distributed and strategy == "ddp":
            self.run = nn.parallel.DistributedDataParallel(
                self.model, find_unused_parameters=loop == "frozen")
        self.losses: list[float] = []

    # ---- data and records

    def batch(self, step: int):
        x, y = dc.global_batch(step)
        if self.distributed and not (self.strategy == "fsdp2" and self.solo):
            return x.chunk(self.ctx.world)[self.ctx.rank], y.chunk(self.ctx.world)[self.ctx.rank]
        return x, y

    def record(self, loss: torch.Tensor) -> None:
        if self.distributed and not self.solo:
            self.losses.append(dc.mean_over_ranks(loss))
        else:
            self.losses.append(loss.item())

    def loss(self, step: int) -> torch.Tensor:
        x, y = self.batch(step)
        return F.cross_entropy(self.run(x).float(), y)

    # ---- the pieces of a loop

    def step(self, step: int, on_backward=None) -> None:
        loss = self.loss(step)
        with amp.scale_loss(loss, self.opt) as scaled:
            scaled.backward()
            if on_backward is not None:
                on_backward()
        self.opt.step()
        self.opt.zero_grad()
        self.record(loss)

    def backward(self, loss: torch.Tensor, loss_id: int = 0) -> None:
        with amp.scale_loss(loss, self.opt, loss_id=loss_id) as scaled:
            scaled.backward()

    def evaluate(self, step: int, grad: bool) -> None:
        if grad:  # grad mode left on: a loss computed only to be logged
            self.record(self.loss(step))
            return
        self.run.eval()
        with torch.no_grad():
            self.record(self.loss(step))
        self.run.train()

    def accumulate(self, step: int) -> None:
        """Two micro-batches per step; the first neither syncs nor unscales."""
        sharded = self.distributed and self.strategy == "fsdp2"
        quiet = (self.run.no_sync() if self.distributed and self.strategy == "ddp"
                 else contextlib.nullcontext())
        if sharded:
            self.model.set_requires_gradient_sync(False)
        with quiet:
            first = self.loss(2 * step) / 2
            with amp.scale_loss(first, self.opt, delay_unscale=True) as scaled:
                scaled.backward()
        if sharded:
            self.model.set_requires_gradient_sync(True)
        second = self.loss(2 * step + 1) / 2
        with amp.scale_loss(second, self.opt) as scaled:
            scaled.backward()
        self.opt.step()
        self.opt.zero_grad()
        self.record(first.detach() + second.detach())

    def two_losses(self, step: int) -> None:
        """Two forwards, then a backward of each loss with its own loss scaler.

        DDP reduces in the first backward after a forward, so there each
        loss's forward is followed by its backward (both reduced): two
        forwards first leaves the replicas apart in plain torch too.
        """
        if self.distributed and self.strategy == "ddp":
            first = self.loss(2 * step)
            self.backward(first, loss_id=0)
            second = self.loss(2 * step + 1)
        else:
            first, second = self.loss(2 * step), self.loss(2 * step + 1)
            self.backward(first, loss_id=0)
        self.backward(second, loss_id=1)
        self.opt.step()
        self.opt.zero_grad()
        self.record(first.detach() + second.detach())

    def poison(self) -> None:
        """An inf in one gradient of the last rank only (after DDP's all-reduce, or in this
        rank's shard), or of the single process."""
        if not self.distributed or self.ctx.rank == self.ctx.world - 1:
            weight = next(p for p in self.model.parameters() if p.requires_grad)
            local_tensor(weight.grad).view(-1)[0] = float("inf")

    # ---- the loops

    def train_loop(self, start: int = 0) -> None:
        """The steps of the loop from ``start``; case h's reference runs its first two steps,
        then loop a from step 2, which is what the resumed run goes on with."""
        loop = self.loop
        if loop == "dcp_resume" and start == 0:
            for s in range(2):
                self.step(s)
            start = 2
        if loop in ("eval_grad", "eval_no_grad", "dcp_resume"):
            for s in range(start, start + 2):
                self.step(s)
            self.evaluate(100 + start, grad=loop != "eval_no_grad")
            for s in range(start + 2, start + 4):
                self.step(s)
        elif loop == "accumulate":
            for s in range(3):
                self.accumulate(s)
        elif loop == "two_losses":
            for s in range(3):
                self.two_losses(s)
        elif loop == "overflow_one_rank":
            for s in range(3):
                self.step(s, on_backward=self.poison if s == 1 else None)
        else:  # checkpointing, frozen
            for s in range(3):
                self.step(s)

    def stepped(self) -> list[torch.Tensor]:
        """What the optimizer steps, whole (FSDP2's shards gathered)."""
        return [dc.full(p).detach().clone() for p in amp.master_params(self.opt)]

    def close(self) -> None:
        del self.run
        amp.deinitialize()


# --------------------------------------------------------------------------- checks


def check_ranks_agree(run: Run, stepped: list[torch.Tensor]) -> None:
    state = amp.state_dict()
    mine = (run.losses, [t.tolist() for t in stepped], state)
    everyone = [None] * run.ctx.world
    dist.all_gather_object(everyone, mine)
    for r, theirs in enumerate(everyone):
        assert theirs[0] == mine[0], f"rank {r}'s losses {theirs[0]} != this rank's {mine[0]}"
        assert theirs[1] == mine[1], f"rank {r}'s parameters differ from this rank's"
        assert theirs[2] == mine[2], f"rank {r}'s loss scalers {theirs[2]} != {mine[2]}"


def compare(run: Run, stepped, reference: Run, reference_stepped) -> None:
    rtol, atol = dc.TOLERANCE[run.level]
    what = f"{run.loop} {run.strategy} {run.level}"
    assert len(run.losses) == len(reference.losses), (run.losses, reference.losses)
    dc.close(run.losses, reference.losses, rtol, atol, f"{what} losses")
    assert len(stepped) == len(reference_stepped), what
    for i, (p, r) in enumerate(zip(stepped, reference_stepped)):
        assert p.dtype == r.dtype, (what, i, p.dtype, r.dtype)
        dc.close(p, r, rtol, atol, f"{what} parameter {i}")


def reference_run(ctx: dc.Ctx, loop: str, strategy: str, level: str):
    ref = Run(ctx, loop, strategy, level, distributed=False)
    ref.train_loop()
    stepped, state = ref.stepped(), amp.state_dict()
    ref.close()
    return ref, stepped, state


def loop_case(ctx: dc.Ctx, loop: str, strategy: str, level: str) -> None:
    reference, reference_stepped, reference_state = reference_run(ctx, loop, strategy, level)
    if loop == "dcp_resume":
        run = resumed(ctx, strategy, level)
    else:
        run = Run(ctx, loop, strategy, level, distributed=True)
        run.train_loop()
    stepped = run.stepped()
    check_ranks_agree(run, stepped)
    state = amp.state_dict()
    run.close()
    compare(run, stepped, reference, reference_stepped)
    if loop == "overflow_one_rank":  # every rank skipped the poisoned step, as the process did
        assert state == reference_state, (state, reference_state)
        assert state["loss_scaler0"]["skipped"] == 1, state


# --------------------------------------------------------------------------- h: DCP resume


def solo_groups(ctx: dc.Ctx) -> list:
    """A 1-rank process group per rank (every rank must make every group, in order)."""
    if not hasattr(ctx, "solos"):
        ctx.solos = [dist.new_group([r]) for r in range(ctx.world)]
    return ctx.solos


def resumed(ctx: dc.Ctx, strategy: str, level: str) -> Run:
    """Case h: train 2 steps at world size 1, checkpoint, resume on 2 ranks, then loop a.

    Each rank trains its own world-size-1 run (FSDP2 on a 1-rank mesh, or the
    plain model for DDP) on the whole batch; rank 0 saves it over its 1-rank
    group. Then the 2 ranks load it into a model of another seed and go on.
    The reference goes the same way without the checkpoint: the losses of the
    steps after the resume match it.
    """
    from torch.distributed.device_mesh import DeviceMesh

    solo = solo_groups(ctx)[ctx.rank]
    path = ctx.out / f"loops-dcp-{strategy}-{level}"
    mesh = DeviceMesh.from_group(solo, "cpu") if strategy == "fsdp2" else None
    first = Run(ctx, "dcp_resume", strategy, level, distributed=strategy == "fsdp2", mesh=mesh)
    first.solo = True
    for s in range(2):
        first.step(s)
    if ctx.rank == 0:
        amp.save_checkpoint(path, first.run, first.opt, process_group=solo)
    first.close()
    dist.barrier()
    run = Run(ctx, "dcp_resume", strategy, level, distributed=True, seed=1)
    amp.load_checkpoint(path, run.run, run.opt)
    run.losses = list(first.losses)
    run.train_loop(start=2)
    return run


for _loop in LOOPS:
    for _strategy in STRATEGIES:
        for _level in dc.LEVELS:
            CASES[f"{_loop}:{_strategy}:{_level}"] = (
                lambda ctx, _a=_loop, _s=_strategy, _l=_level: loop_case(ctx, _a, _s, _l))


# --------------------------------------------------------------------------- lean optimizer state


#: FSDP2 with low-precision optimizer state (docs/lean_state.md): setting -> (optimizer, its arguments,
#: optimizer_state, master_weights).
LEAN = {
    "adamw-int8-mwbf16": ("FusedAdam", dict(lr=1e-2, weight_decay=0.01), "int8", "bf16"),
    "sgd-fp8-mwTrue": ("FusedSGD", dict(lr=0.05, momentum=0.9), "fp8", True),
    # The fused optimizer's own fp32 state on FSDP2 (its ops take the local shards too).
    "adamw-fp32-mwTrue": ("FusedAdam", dict(lr=1e-2, weight_decay=0.01), "fp32", True),
    "adagrad-fp32-mwTrue": ("FusedAdagrad", dict(lr=1e-2, weight_decay=0.01), "fp32", True),
    # LAMB's trust ratio and NovoGrad's moments take norms of whole tensors: summed over shards.
    "lamb-fp32-mwTrue": ("FusedLAMB", dict(lr=1e-2, weight_decay=0.01), "fp32", True),
    "lamb-int8-mwbf16": ("FusedLAMB", dict(lr=1e-2, weight_decay=0.01), "int8", "bf16"),
    "novograd-fp32-mwTrue": ("FusedNovoGrad", dict(lr=1e-2, weight_decay=0.01), "fp32", True),
}


class LeanRun:
    """A model with two weights of block-scaled state (512 x 8: one block per row; 16 x 512:
    two), FSDP2-sharded or whole, at O2 with a lean optimizer state."""

    def __init__(self, ctx: dc.Ctx, setting: str, sharded: bool, seed: int = 0) -> None:
        from amp_patch import optimizers

        name, kwargs, state, masters = LEAN[setting]
        self.ctx, self.sharded = ctx, sharded
        torch.manual_seed(seed)
        self.model = nn.Sequential(nn.Linear(8, 512), nn.ReLU(), nn.Linear(512, 16), nn.ReLU(),
                                   nn.Linear(16, 4))
        if sharded:
            dc.shard(self.model)
        self.opt = getattr(optimizers, name)(self.model.parameters(), **kwargs)
        self.model, self.opt = amp.initialize(
            self.model, self.opt, opt_level="O2", half_dtype=torch.bfloat16, loss_scale="dynamic",
            verbosity=0, optimizer_state=state, master_weights=masters)
        self.losses: list[float] = []

    def step(self, step: int, poison: bool = False) -> None:
        x, y = dc.local_batch(self.ctx, step) if self.sharded else dc.global_batch(step)
        loss = F.cross_entropy(self.model(x).float(), y)
        with amp.scale_loss(loss, self.opt) as scaled:
            scaled.backward()
            if poison and (not self.sharded or self.ctx.rank == self.ctx.world - 1):
                local_tensor(self.model[0].weight.grad).view(-1)[0] = float("inf")
        self.opt.step()
        self.opt.zero_grad()
        self.losses.append(dc.mean_over_ranks(loss) if self.sharded else loss.item())

    def snapshot(self) -> list:
        """This rank's bits of every param, stepped tensor, state entry and step counter."""
        out: list = [local_tensor(p).detach().clone() for p in self.model.parameters()]
        for group in self.opt.param_groups:
            out.append(group.get("step"))
            for p in group["params"]:
                out.append(local_tensor(p).detach().clone())
                for key, value in sorted(self.opt.state.get(p, {}).items()):
                    out.append((key, local_tensor(value).detach().clone()
                                if isinstance(value, torch.Tensor) else value))
        return out


def _same_bits(a: list, b: list, what: str) -> None:
    assert len(a) == len(b), what
    for i, (x, y) in enumerate(zip(a, b)):
        if isinstance(x, tuple):
            assert x[0] == y[0], (what, i, x[0], y[0])
            x, y = x[1], y[1]
        if isinstance(x, torch.Tensor):
            assert x.dtype == y.dtype and x.shape == y.shape, (what, i, x.dtype, y.dtype)
            assert torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8)), \
                f"{what}: tensor {i} differs"
        else:
            assert x == y, (what, i, x, y)


def _check_lean_sharding(run: LeanRun) -> int:
    """Every code tensor is a DTensor sharded like its param, its scales sharded on dim 0 with
    the rows; returns how many block-scaled tensors there are."""
    from torch.distributed.tensor import DTensor, Shard

    from amp_patch.ops.lean_state_ops import SCALED_CODES, scale_shape

    scaled = 0
    for p in amp.master_params(run.opt):
        assert isinstance(p, DTensor)
        for key, value in run.opt.state[p].items():
            if not isinstance(value, torch.Tensor) or key == "step" or key.endswith("_scale"):
                continue
            if value.dim() == 0:  # NovoGrad's second moment: one norm per tensor, every rank's
                continue
            assert isinstance(value, DTensor) and value.placements == p.placements, key
            assert value.shape == p.shape, (key, value.shape, p.shape)
            if value.dtype not in SCALED_CODES:
                continue
            scaled += 1
            scales = run.opt.state[p][key + "_scale"]
            assert isinstance(scales, DTensor) and scales.placements == (Shard(0),), key
            assert tuple(scales.shape) == scale_shape(p.shape), (scales.shape, p.shape)
            rows = p.shape[0] // run.ctx.world
            assert tuple(scales.to_local().shape) == (rows, scales.shape[1]), scales.shape
    return scaled


def lean_case(ctx: dc.Ctx, setting: str) -> None:
    """FSDP2 steps the lean state on its shards: an overflow on one rank skips the step on every
    rank without changing a bit, codes and scales are DTensors sharded on dim 0, the losses
    follow one process on the whole batch (within O2's tolerance: the stochastic rounding draws
    per shard), and a DCP checkpoint resumes bit for bit into a fresh sharded model."""
    import torch.distributed.checkpoint as dcp

    ref = LeanRun(ctx, setting, sharded=False)
    for s in range(4):
        ref.step(s, poison=s == 1)
    ref_stepped = [p.detach().clone() for p in amp.master_params(ref.opt)]
    amp.deinitialize()

    run = LeanRun(ctx, setting, sharded=True)
    run.step(0)
    before = run.snapshot()
    run.step(1, poison=True)
    _same_bits(before, run.snapshot(), "the skipped step")
    assert amp.state_dict()["loss_scaler0"]["skipped"] == 1
    run.step(2)
    sgd = setting.startswith("sgd")
    scaled = 0 if LEAN[setting][2] == "fp32" else 2 if sgd else 4  # one buffer, or two moments
    assert _check_lean_sharding(run) == scaled  # the two large weights' moments or buffers
    # bf16 masters of a bf16 model are the bf16 shards themselves; fp32 ones are fp32 shards.
    masters = {p.dtype for p in amp.master_params(run.opt)}
    assert masters == {torch.bfloat16 if setting.endswith("mwbf16") else torch.float32}, masters
    path = ctx.out / f"lean-{setting}"
    amp.save_checkpoint(path, run.model, run.opt)
    run.step(3)
    rtol, atol = dc.TOLERANCE["O2"]
    dc.close(run.losses, ref.losses, rtol, atol, f"lean {setting} losses")
    lr = run.opt.param_groups[0]["lr"]
    for i, (p, r) in enumerate(zip(amp.master_params(run.opt), ref_stepped)):
        full = dc.full(p)
        if not sgd:
            # Adam and the others step a grad near 0 by about lr either way: where its sign
            # differs (reduction order), an element is a step or two apart.
            diff = (full.float() - r.float()).abs()
            assert diff.max() <= 4 * lr and diff.mean() < lr / 10, (i, diff.max(), diff.mean())
        else:
            dc.close(full, r, rtol, atol, f"lean {setting} parameter {i}")
    expected = run.snapshot()
    amp.deinitialize()

    saved = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    first = "momentum_buffer" if sgd else "exp_avg"
    if scaled:
        assert tuple(saved[f"optimizer.state.2.weight.{first}_scale"].size) == (16, 2)
        assert tuple(saved[f"optimizer.state.0.weight.{first}_scale"].size) == (512, 1)
    resumed = LeanRun(ctx, setting, sharded=True, seed=1)
    amp.load_checkpoint(path, resumed.model, resumed.opt)
    resumed.step(3)
    _same_bits(resumed.snapshot(), expected, "resumed from DCP")
    amp.deinitialize()


for _setting in LEAN:
    CASES[f"lean:fsdp2:{_setting}"] = lambda ctx, _s=_setting: lean_case(ctx, _s)


#: Optimizers whose step takes norms of whole tensors: name -> arguments. max_grad_norm 0.5 makes
#: LAMB clip by the global grad norm too.
NORMED = {
    "FusedLAMB": dict(lr=0.1, weight_decay=0.01, max_grad_norm=0.5),
    "FusedLAMB-nvlamb": dict(lr=0.1, weight_decay=0.0, use_nvlamb=True),
    "FusedNovoGrad": dict(lr=0.1, weight_decay=0.01),
    "FusedNovoGrad-max": dict(lr=0.1, norm_type=0),
    "FusedMixedPrecisionLamb": dict(lr=0.1, weight_decay=0.01, max_grad_norm=0.5),
    # bf16 params stepped through fp32 masters: the masters are compared.
    "FusedMixedPrecisionLamb-bf16": dict(lr=0.1, weight_decay=0.01, max_grad_norm=0.5,
                                         reduced_precision_dtype=torch.bfloat16),
}


def normed_case(ctx: dc.Ctx, name: str) -> None:
    """Two steps on DTensor shards (Shard(0), uneven: 7 rows over the ranks) equal the same steps
    on the whole tensors to fp32 reduction-order error: the global grad norm, LAMB's trust-ratio
    norms and NovoGrad's per-tensor norms are taken over the whole tensors, not the shards."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from amp_patch import optimizers

    mesh = init_device_mesh("cpu", (ctx.world,))
    g = torch.Generator().manual_seed(3)
    fulls = [torch.randn(7, 5, generator=g), torch.randn(6, generator=g)]
    grads = [[torch.randn(t.shape, generator=g) * 4 for t in fulls] for _ in range(2)]
    cls, kwargs = getattr(optimizers, name.split("-")[0]), NORMED[name]
    dtype = kwargs.get("reduced_precision_dtype", torch.float32)
    fulls = [t.to(dtype).float() for t in fulls]  # the masters start as the half params
    whole = [nn.Parameter(t.to(dtype, copy=True)) for t in fulls]
    shards = [nn.Parameter(distribute_tensor(t.to(dtype, copy=True), mesh, [Shard(0)]))
              for t in fulls]
    stepped = {}
    for params, sharded in ((whole, False), (shards, True)):
        opt = cls(params, **kwargs)
        for step_grads in grads:
            for p, gr in zip(params, step_grads):
                gr = gr.to(dtype, copy=True)
                p.grad = distribute_tensor(gr, mesh, [Shard(0)]) if sharded else gr
            opt.step()
        stepped[sharded] = [opt.state[p]["master_param"] if dtype != torch.float32 else p.detach()
                            for p in params]
    for i, (w, s, start) in enumerate(zip(stepped[False], stepped[True], fulls)):
        moved, want = dc.full(s) - start, w - start
        torch.testing.assert_close(moved, want, rtol=1e-5, atol=1e-7, msg=f"{name} param {i}")


for _name in NORMED:
    CASES[f"normed:{_name}"] = lambda ctx, _n=_name: normed_case(ctx, _n)


# --------------------------------------------------------------------------- the debug mode


def _debug_names_the_decision(ctx: dc.Ctx) -> None:
    """AMP_PATCH_DEBUG_RANKS=1: a cast made on one rank only, then a scale set on one rank
    only, are each named before backward runs any collective."""
    from amp_patch.frontend.debug import RanksDisagreeError

    assert os.environ.get("AMP_PATCH_DEBUG_RANKS") == "1"
    for level, inject in (("O1", "cast"), ("O2", "scale")):
        run = Run(ctx, "eval_grad", "fsdp2", level, distributed=True)
        run.step(0)  # agreeing ranks: no error
        if ctx.rank == 1:
            if inject == "cast":
                amp.session.current().casts.cache.cast(nn.Parameter(torch.ones(3)), torch.bfloat16)
            else:
                amp.load_state_dict({"loss_scaler0": {"loss_scale": 1024.0, "unskipped": 1}})
        loss = run.loss(1)
        try:
            with amp.scale_loss(loss, run.opt) as scaled:
                scaled.backward()
        except RanksDisagreeError as exc:
            assert "scale_loss entry" in str(exc), str(exc)
            if inject == "cast":
                made = exc.differences["weight casts made since the last scale_loss"]
                assert made[1] == made[0] + 1, exc.differences
                assert "weight casts made since the last scale_loss: rank 0: " in str(exc)
            else:
                assert exc.differences == {"loss scale": [65536.0, 1024.0]}, exc.differences
                assert "loss scale: rank 0: 65536, rank 1: 1024" in str(exc), str(exc)
        else:
            raise AssertionError(f"{inject} on rank 1 only: no RanksDisagreeError")
        run.close()


CASES["debug_names_the_decision"] = _debug_names_the_decision


if __name__ == "__main__":
    dc.main(CASES)
