"""Cases that run inside one spawned gloo process group, many per group (see dist_utils.py).

Run as ``python _dist_cases.py OUT_DIR CASE[,CASE...]`` with RANK, WORLD_SIZE,
MASTER_ADDR and MASTER_PORT set. Every rank runs every case in order; a case
is a function of the :class:`Ctx`. A case that raises is recorded as failed
with its traceback and the next one runs. Each rank writes
``OUT_DIR/results-<rank>.json``: ``{case: "ok" or the traceback}``.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import sys
import traceback
from pathlib import Path
from typing import Callable

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import amp_patch as amp  # noqa: E402
from amp_patch.helpers import close_process_group  # noqa: E402
from amp_patch.helpers.tensors import local_tensor  # noqa: E402
from amp_patch.settings.levels import NAMES as LEVELS  # noqa: E402
import training_utils  # noqa: E402
from training_utils import conv_batch, convnet, count_host_syncs  # noqa: E402

CASES: dict[str, Callable[["Ctx", str], None]] = {}
GLOBAL_BATCH = 16


def case(name: str):
    def register(fn):
        CASES[name] = fn
        return fn
    return register


class Ctx:
    def __init__(self, out: Path) -> None:
        self.out = out
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()


# --------------------------------------------------------------------------- models and data


def mlp(seed: int = 0, dropout: float = 0.0) -> nn.Module:
    """Widths divisible by 4, so that 2 and 4 ranks shard every parameter evenly."""
    torch.manual_seed(seed)
    layers: list[nn.Module] = [nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU()]
    if dropout:
        layers.append(nn.Dropout(dropout))
    return nn.Sequential(*layers, nn.Linear(32, 4))


def shard(model: nn.Module) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    for m in model:
        if isinstance(m, nn.Linear):
            fully_shard(m)
    fully_shard(model)
    return model


def global_batch(step: int):
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(GLOBAL_BATCH, 8, generator=g)
    w = torch.randn(8, 4, generator=torch.Generator().manual_seed(7))
    return x, (x @ w).argmax(1)


def local_batch(ctx: Ctx, step: int):
    x, y = global_batch(step)
    return x.chunk(ctx.world)[ctx.rank], y.chunk(ctx.world)[ctx.rank]


def mean_over_ranks(value: torch.Tensor) -> float:
    v = value.detach().float().reshape(1).clone()
    dist.all_reduce(v)
    return v.item() / dist.get_world_size()


def train(model, opt, steps: int, batch_fn, start: int = 0, sharded: bool = True,
          on_backward=None) -> list[float]:
    """training_utils.train, with each loss averaged over the ranks when they split the batch."""
    return training_utils.train(model, opt, steps, batch_fn, start, on_backward=on_backward,
                                record=mean_over_ranks if sharded else torch.Tensor.item)


def full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a DTensor (a collective: every rank calls it), else the tensor."""
    return t.full_tensor() if local_tensor(t) is not t else t


def local_snapshot(model, opt) -> list[torch.Tensor]:
    out = [local_tensor(p).detach().clone() for p in model.parameters()]
    for p in amp.master_params(opt):
        for v in opt.state.get(p, {}).values():
            if isinstance(v, torch.Tensor):
                out.append(local_tensor(v).detach().clone())
    return out


def assert_equal(a: list[torch.Tensor], b: list[torch.Tensor], what: str) -> None:
    assert len(a) == len(b), what
    for i, (x, y) in enumerate(zip(a, b)):
        assert x.dtype == y.dtype and torch.equal(x, y), f"{what}: tensor {i} differs"


def close(a, b, rtol: float, atol: float, what: str) -> None:
    a, b = torch.as_tensor(a).float(), torch.as_tensor(b).float()
    diff = (a - b).abs().max().item() if a.numel() else 0.0
    assert torch.allclose(a, b, rtol=rtol, atol=atol), f"{what}: max difference {diff}"


#: Reduction-order tolerance per level: fp32 sums (O0); bf16 products whose per-rank partial
#: sums are rounded before FSDP adds them (O1, O2); and bf16 parameters too (O3).
TOLERANCE = {"O0": (1e-5, 1e-6), "O1": (2e-2, 2e-3), "O2": (2e-2, 2e-3), "O3": (5e-2, 2e-2)}


def sgd(model):
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


# --------------------------------------------------------------------------- FSDP2 at each level


def _reference(level: str, steps: int) -> tuple[list[float], list[torch.Tensor]]:
    """One process on the global batch: the losses and the stepped (master) weights."""
    ref = mlp()
    ref_opt = sgd(ref)
    ref, ref_opt = amp.initialize(ref, ref_opt, opt_level=level, verbosity=0)
    losses = train(ref, ref_opt, steps, global_batch, sharded=False)
    params = [p.detach().clone() for p in amp.master_params(ref_opt)]
    amp.deinitialize()
    return losses, params


def _compare(what: str, level: str, losses, params, reference) -> None:
    rtol, atol = TOLERANCE[level]
    close(losses, reference[0], rtol, atol, f"{what} {level} losses")
    for i, (p, r) in enumerate(zip(params, reference[1])):
        assert p.dtype == r.dtype, (i, p.dtype, r.dtype)
        close(p, r, rtol, atol, f"{what} {level} parameter {i}")


def _match(ctx: Ctx, level: str) -> None:
    steps = 4
    reference = _reference(level, steps)
    model = shard(mlp())
    opt = sgd(model)
    model, opt = amp.initialize(model, opt, opt_level=level, verbosity=0)
    if level == "O2":
        # The sharded fp32 params are the masters: the optimizer steps them, nothing else.
        record = amp.session.current().optimizer_records[id(opt)]
        assert len(record.masters) == 0
        assert [id(p) for p in amp.master_params(opt)] == [id(p) for p in model.parameters()]
        policy = model._get_fsdp_state()._mp_policy
        assert (policy.param_dtype, policy.reduce_dtype) == (torch.bfloat16, torch.float32)
    if level == "O3":
        assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    losses = train(model, opt, steps, lambda s: local_batch(ctx, s))
    params = [full(p).detach() for p in model.parameters()]
    amp.deinitialize()
    _compare("FSDP2", level, losses, params, reference)


for _level in LEVELS:
    case(f"match:{_level}")(lambda ctx, _l=_level: _match(ctx, _l))


def _match_ddp(ctx: Ctx, level: str) -> None:
    """DDP against one process on the global batch (the weights all-reduced, not sharded)."""
    steps = 3
    reference = _reference(level, steps)
    model = mlp()
    opt = sgd(model)
    model, opt = amp.initialize(model, opt, opt_level=level, verbosity=0)
    ddp = nn.parallel.DistributedDataParallel(model)
    losses = train(ddp, opt, steps, lambda s: local_batch(ctx, s))
    params = [p.detach().clone() for p in amp.master_params(opt)]
    del ddp
    amp.deinitialize()
    _compare("DDP", level, losses, params, reference)


for _level in ("O1", "O2"):
    case(f"ddp_match:{_level}")(lambda ctx, _l=_level: _match_ddp(ctx, _l))


@case("two_nodes_of_two")
def _topology(ctx: Ctx) -> None:
    """torchrun's two agents made one group of 4: two nodes, two local ranks on each."""
    mine = (int(os.environ["GROUP_RANK"]), int(os.environ["LOCAL_RANK"]),
            int(os.environ["LOCAL_WORLD_SIZE"]))
    everyone = [None] * ctx.world
    dist.all_gather_object(everyone, mine)
    assert ctx.world == 4 and sorted(everyone) == [(n, r, 2) for n in (0, 1) for r in (0, 1)], \
        everyone


@case("o1_patched_inside_fsdp")
def _o1_inside(ctx: Ctx) -> None:
    model = shard(mlp())
    opt = sgd(model)
    model, opt = amp.initialize(model, opt, opt_level="O1", verbosity=0)
    seen = []
    hook = model[0].register_forward_hook(lambda m, a, out: seen.append(out.dtype))
    x, y = local_batch(ctx, 0)
    out = model(x)
    loss = F.cross_entropy(out.float(), y)
    with amp.scale_loss(loss, opt) as scaled:
        scaled.backward()
    hook.remove()
    assert seen == [torch.bfloat16], seen  # the patched F.linear ran inside FSDP's forward
    assert all(local_tensor(p.grad).dtype == torch.float32 for p in model.parameters())
    amp.deinitialize()


@case("deinitialize_restores_policy")
def _deinit(ctx: Ctx) -> None:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    model = shard(mlp())
    given = model._get_fsdp_state()._mp_policy
    opt = sgd(model)
    model, opt = amp.initialize(model, opt, opt_level="O2", verbosity=0)
    train(model, opt, 1, lambda s: local_batch(ctx, s))
    amp.deinitialize()
    assert model._get_fsdp_state()._mp_policy is given
    assert given == MixedPrecisionPolicy()
    seen = []
    hook = model[0].register_forward_hook(lambda m, a, out: seen.append(out.dtype))
    model(local_batch(ctx, 1)[0]).sum().backward()  # gathers in fp32 again
    hook.remove()
    assert seen == [torch.float32], seen


@case("initialize_after_a_forward")
def _after_forward(ctx: Ctx) -> None:
    """FSDP read its policy at the first forward, before initialize: amp makes it read again."""
    model = shard(mlp())
    x, y = local_batch(ctx, 0)
    F.cross_entropy(model(x), y).backward()  # fp32 all-gather buffers exist now
    for p in model.parameters():
        p.grad = None
    opt = sgd(model)
    model, opt = amp.initialize(model, opt, opt_level="O2", verbosity=0)
    seen = []
    hook = model[2].register_forward_hook(lambda m, a, out: seen.append(out.dtype))
    train(model, opt, 1, lambda s: local_batch(ctx, s))
    hook.remove()
    assert seen == [torch.bfloat16], seen
    assert all(p.dtype == torch.float32 for p in model.parameters())
    amp.deinitialize()


@case("reduce_dtype_override")
def _reduce_override(ctx: Ctx) -> None:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    model = mlp()
    fully_shard(model, mp_policy=MixedPrecisionPolicy(reduce_dtype=torch.bfloat16))
    opt = sgd(model)
    model, opt = amp.initialize(model, opt, opt_level="O2", verbosity=0)
    policy = model._get_fsdp_state()._mp_policy
    assert (policy.param_dtype, policy.reduce_dtype) == (torch.bfloat16, torch.bfloat16)
    x, y = local_batch(ctx, 0)
    with amp.scale_loss(F.cross_entropy(model(x).float(), y), opt) as scaled:
        scaled.backward()
    # Reduced in bf16, landed in the fp32 shards.
    assert all(local_tensor(p.grad).dtype == torch.float32 for p in model.parameters())
    opt.step()
    amp.deinitialize()


# --------------------------------------------------------------------------- initialize orders


@case("orders")
def _orders(ctx: Ctx) -> None:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    for level in LEVELS:
        # initialize, then fully_shard: the first forward says which order works.
        model = mlp()
        opt = sgd(model)
        model, opt = amp.initialize(model, opt, opt_level=level, verbosity=0)
        shard(model)
        with pytest.raises(RuntimeError, match=r"fully_shard\(model\) first"):
            model(local_batch(ctx, 0)[0])
        amp.deinitialize()
        # An optimizer built before fully_shard holds the unsharded parameters.
        model = mlp()
        opt = sgd(model)
        shard(model)
        with pytest.raises(ValueError, match=r"fully_shard\(model\) first"):
            amp.initialize(model, opt, opt_level=level, verbosity=0)
    # A policy that asks for another compute dtype than the level's.
    model = mlp()
    fully_shard(model, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="param_dtype=torch.bfloat16.*opt_level O1"):
        amp.initialize(model, sgd(model), opt_level="O1", verbosity=0)
    assert model._get_fsdp_state()._mp_policy.param_dtype == torch.bfloat16  # left as given
    # keep_batchnorm_fp32 with a batch norm in a group of other parameters.
    model = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Linear(8, 4))
    fully_shard(model)
    with pytest.raises(ValueError, match="BatchNorm1d.*keep_batchnorm_fp32=False"):
        amp.initialize(model, sgd(model), opt_level="O2", verbosity=0)
    # With its own fully_shard the batch norm is gathered in fp32, the rest in half.
    model = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Linear(8, 4))
    fully_shard(model[1])
    fully_shard(model)
    opt = sgd(model)
    model, opt = amp.initialize(model, opt, opt_level="O2", verbosity=0)
    assert model[1]._get_fsdp_state()._mp_policy.param_dtype is None
    assert model._get_fsdp_state()._mp_policy.param_dtype == torch.bfloat16
    train(model, opt, 2, lambda s: local_batch(ctx, s))
    amp.deinitialize()


@case("failed_initialize_puts_shards_back")
def _failed_initialize(ctx: Ctx) -> None:
    import amp_patch.optim.amp as optim_pkg

    model = shard(mlp())
    opt = sgd(model)
    params = list(model.parameters())
    before = [local_tensor(p).clone() for p in params]

    def broken(*args, **kwargs):
        raise RuntimeError("injected")

    real, optim_pkg.process = optim_pkg.process, broken  # fails after the shards were cast
    try:
        amp.initialize(model, opt, opt_level="O3", verbosity=0)
    except RuntimeError as exc:
        assert "injected" in str(exc)
    finally:
        optim_pkg.process = real
    assert list(model.parameters()) == params  # the same objects, their fp32 shards back
    assert_equal([local_tensor(p) for p in params], before, "an uncast shard")
    model, opt = amp.initialize(model, opt, opt_level="O0", verbosity=0)
    train(model, opt, 1, lambda s: local_batch(ctx, s))  # FSDP works on the shards put back
    amp.deinitialize()


# --------------------------------------------------------------------------- overflow and syncs


@case("overflow_skips_everywhere")
def _overflow(ctx: Ctx) -> None:
    model = shard(mlp())
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    model, opt = amp.initialize(model, opt, opt_level="O2", loss_scale="dynamic", verbosity=0)
    train(model, opt, 2, lambda s: local_batch(ctx, s))
    before = local_snapshot(model, opt)
    scale = amp.state_dict()["loss_scaler0"]["loss_scale"]

    def poison(step):
        if ctx.rank == ctx.world - 1:  # only this rank's shard: no other rank sees the inf
            local_tensor(model[0].weight.grad)[0, 0] = float("inf")

    train(model, opt, 1, lambda s: local_batch(ctx, s), start=2, on_backward=poison)
    assert_equal(local_snapshot(model, opt), before, "the skipped step changed a tensor")
    state = amp.state_dict()["loss_scaler0"]
    assert state["loss_scale"] == scale / 2 and state["skipped"] == 1, state
    states = [None] * ctx.world
    dist.all_gather_object(states, state)
    assert all(s == state for s in states), states
    train(model, opt, 1, lambda s: local_batch(ctx, s), start=3)
    after = local_snapshot(model, opt)
    assert not torch.equal(after[0], before[0]), "the step after the skip did nothing"
    amp.deinitialize()


@case("one_host_sync")
def _syncs(ctx: Ctx) -> None:
    for level in ("O1", "O2"):
        model = shard(mlp())
        opt = sgd(model)  # Adam's for-loop path (DTensor params) reads its step counters
        model, opt = amp.initialize(model, opt, opt_level=level, loss_scale="dynamic", verbosity=0)
        train(model, opt, 1, lambda s: local_batch(ctx, s))  # FSDP's lazy init and Adam's state
        x, y = local_batch(ctx, 1)
        with count_host_syncs() as counts:
            loss = F.cross_entropy(model(x).float(), y)
            with amp.scale_loss(loss, opt) as scaled:
                scaled.backward()
            opt.step()
            opt.zero_grad()
        assert counts["n"] == 1, f"{level}: {counts['n']} host syncs in one iteration"
        amp.deinitialize()


# --------------------------------------------------------------------------- clipping


@case("clip_matches_unsharded_norm")
def _clip(ctx: Ctx) -> None:
    model = shard(mlp())
    opt = sgd(model)
    model, opt = amp.initialize(model, opt, opt_level="O2", loss_scale="dynamic", verbosity=0)
    for max_norm in (0.05, 1e3):  # clipped, and left alone
        x, y = local_batch(ctx, 0)
        loss = F.cross_entropy(model(x).float(), y)
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        grads = [full(p.grad).clone() for p in amp.master_params(opt)]
        expected = torch.linalg.vector_norm(torch.cat([g.flatten() for g in grads]))
        total = amp.clip_grad_norm_(opt, max_norm)
        close(total, expected, 1e-6, 0.0, "total norm")
        coef = min(1.0, max_norm / (expected.item() + 1e-6))
        for i, (p, g) in enumerate(zip(amp.master_params(opt), grads)):
            close(full(p.grad), g * coef, 1e-6, 1e-9, f"clipped grad {i}")
        opt.zero_grad()
    amp.deinitialize()


# --------------------------------------------------------------------------- memory


@case("o2_memory_is_sharded")
def _memory(ctx: Ctx) -> None:
    """params + grads + optimizer state per rank: FSDP2 O2 against unsharded O2."""

    def nbytes(tensors) -> int:
        return sum(local_tensor(t).numel() * local_tensor(t).element_size() for t in tensors)

    def footprint(model, opt) -> int:
        stepped = list(amp.master_params(opt))
        owned = list(model.parameters()) + [p for p in stepped if all(p is not q for q in
                                                                      model.parameters())]
        grads = [p.grad for p in owned if p.grad is not None]
        states = [v for p in stepped for v in opt.state[p].values()
                  if isinstance(v, torch.Tensor) and v.dim()]
        return nbytes(owned) + nbytes(grads) + nbytes(states)

    sizes = {}
    for sharded in (False, True):
        model = shard(mlp()) if sharded else mlp()
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        model, opt = amp.initialize(model, opt, opt_level="O2", verbosity=0)
        batch = (lambda s: local_batch(ctx, s)) if sharded else global_batch
        train(model, opt, 1, batch, sharded=sharded)  # Adam's state exists now
        x, y = batch(1)
        with amp.scale_loss(F.cross_entropy(model(x).float(), y), opt) as scaled:
            scaled.backward()
        sizes[sharded] = footprint(model, opt)  # at its largest: every grad is there
        opt.step()
        amp.deinitialize()
    # Unsharded O2: half params and grads, fp32 masters, their grads and Adam's two moments
    # (20 bytes a parameter); sharded: fp32 params, grads and moments over N (16 / N).
    n = sum(p.numel() for p in mlp().parameters())
    assert sizes[False] == 20 * n, sizes
    assert sizes[True] == 16 * n // ctx.world, sizes


# --------------------------------------------------------------------------- SyncBatchNorm


@case("syncbn_ddp_o2")
def _syncbn(ctx: Ctx) -> None:
    from amp_patch.apex_compat.parallel import SyncBatchNorm, convert_syncbn_model

    def batch(step):
        x, y = conv_batch(step, batch=8)
        return x.chunk(ctx.world)[ctx.rank], y.chunk(ctx.world)[ctx.rank]

    ref = convnet()
    ref_opt = sgd(ref)
    ref, ref_opt = amp.initialize(ref, ref_opt, opt_level="O2", verbosity=0)
    ref_losses = train(ref, ref_opt, 3, lambda s: conv_batch(s, batch=8), sharded=False)
    ref_state = {k: v.clone() for k, v in ref.state_dict().items()}
    amp.deinitialize()

    model = convert_syncbn_model(convnet())
    assert isinstance(model[1], SyncBatchNorm)
    opt = sgd(model)
    model, opt = amp.initialize(model, opt, opt_level="O2", keep_batchnorm_fp32=True, verbosity=0)
    assert model[1].weight.dtype == torch.float32 and model[0].weight.dtype == torch.bfloat16
    ddp = nn.parallel.DistributedDataParallel(model)
    losses = train(ddp, opt, 3, batch)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    del ddp
    amp.deinitialize()
    rtol, atol = TOLERANCE["O2"]
    close(losses, ref_losses, rtol, atol, "SyncBatchNorm losses")
    for k, v in ref_state.items():  # running statistics of the global batch included
        close(state[k], v, rtol, atol, k)
    gathered = [None] * ctx.world
    dist.all_gather_object(gathered, state)
    assert all(torch.equal(g[k], state[k]) for g in gathered for k in state), "ranks differ"


# --------------------------------------------------------------------------- DCP checkpoints


def _dcp_model(ctx: Ctx, kind: str, seed: int):
    """A model and Adam for the checkpoint cases: FSDP2 at O2, or DDP at O2 (masters)."""
    model = mlp(seed, dropout=0.1)
    if kind == "fsdp":
        shard(model)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    model, opt = amp.initialize(model, opt, opt_level="O2", loss_scale="dynamic", verbosity=0)
    wrapped = nn.parallel.DistributedDataParallel(model) if kind == "ddp" else model
    return model, wrapped, opt


def _dcp_resume(ctx: Ctx, kind: str) -> None:
    path = ctx.out / f"dcp-{kind}-w{ctx.world}"
    batch = lambda s: local_batch(ctx, s)  # noqa: E731

    def snapshot(model, opt):
        return local_snapshot(model, opt) + [torch.rand(3)] + [
            torch.tensor(amp.state_dict()["loss_scaler0"]["loss_scale"])]

    model, wrapped, opt = _dcp_model(ctx, kind, seed=0)
    train(wrapped, opt, 2, batch)
    amp.save_checkpoint(path, wrapped, opt, extra={"meta": {"step": 2}})
    train(wrapped, opt, 2, batch, start=2)
    expected = snapshot(model, opt)
    del wrapped
    amp.deinitialize()

    torch.manual_seed(123)  # another RNG state and other weights: the checkpoint must set both
    model, wrapped, opt = _dcp_model(ctx, kind, seed=1)
    extra = {"meta": {"step": 0}}
    amp.load_checkpoint(path, wrapped, opt, extra=extra)
    assert extra["meta"]["step"] == 2, extra
    train(wrapped, opt, 2, batch, start=2)
    assert_equal(snapshot(model, opt), expected, f"{kind}: the resumed run differs")
    del wrapped
    amp.deinitialize()


case("dcp_resume:fsdp")(lambda ctx: _dcp_resume(ctx, "fsdp"))
case("dcp_resume:ddp")(lambda ctx: _dcp_resume(ctx, "ddp"))

#: Steps before the checkpoint, and after it, of the resharding cases.
RESHARD_BEFORE, RESHARD_AFTER = 2, 3


def _reshard_model(level: str, seed: int):
    model = shard(mlp(seed))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    model, opt = amp.initialize(model, opt, opt_level=level, loss_scale="dynamic", verbosity=0)
    return model, opt


def _reshard_save(ctx: Ctx, level: str) -> None:
    """Train, checkpoint, go on; the losses after the checkpoint go to a file."""
    model, opt = _reshard_model(level, seed=0)
    batch = lambda s: local_batch(ctx, s)  # noqa: E731
    train(model, opt, RESHARD_BEFORE, batch)
    amp.save_checkpoint(ctx.out / f"reshard-{level}-w{ctx.world}", model, opt)
    losses = train(model, opt, RESHARD_AFTER, batch, start=RESHARD_BEFORE)
    amp.deinitialize()
    if ctx.rank == 0:
        (ctx.out / f"reshard-{level}-w{ctx.world}.json").write_text(json.dumps(losses))


def _reshard_load(ctx: Ctx, level: str, saved_world: int) -> None:
    """Resume another world size's checkpoint: the same losses as the run that saved it."""
    name = f"reshard-{level}-w{saved_world}"
    model, opt = _reshard_model(level, seed=1)
    amp.load_checkpoint(ctx.out / name, model, opt)
    losses = train(model, opt, RESHARD_AFTER, lambda s: local_batch(ctx, s), start=RESHARD_BEFORE)
    amp.deinitialize()
    expected = json.loads((ctx.out / f"{name}.json").read_text())
    rtol, atol = TOLERANCE[level]
    close(losses, expected, rtol, atol, f"{level}: losses after resuming {saved_world} -> "
                                        f"{ctx.world} ranks")


for _level in ("O0", "O2"):
    case(f"reshard_save:{_level}")(lambda ctx, _l=_level: _reshard_save(ctx, _l))
    for _saved in (2, 4):
        case(f"reshard_load:{_level}:{_saved}")(
            lambda ctx, _l=_level, _s=_saved: _reshard_load(ctx, _l, _s))


# --------------------------------------------------------------------------- groups


#: The process groups the tests launch: (world size, the cases it runs, the group it needs
#: first). Few launches: starting a process costs more than most cases on two loaded cores.
GROUPS = {
    "w2": (2, [*(f"match:{lv}" for lv in LEVELS), "o1_patched_inside_fsdp",
               "deinitialize_restores_policy", "initialize_after_a_forward",
               "reduce_dtype_override", "orders",
               "failed_initialize_puts_shards_back",
               "overflow_skips_everywhere", "one_host_sync", "clip_matches_unsharded_norm",
               "o2_memory_is_sharded", "syncbn_ddp_o2", "dcp_resume:fsdp", "dcp_resume:ddp",
               "reshard_save:O0", "reshard_save:O2"], None),
    "w4": (4, [*(f"match:{lv}" for lv in LEVELS), "overflow_skips_everywhere",
               "clip_matches_unsharded_norm", "o2_memory_is_sharded", "dcp_resume:fsdp",
               "reshard_load:O0:2", "reshard_load:O2:2", "reshard_save:O0", "reshard_save:O2"],
           "w2"),
    "w2-after-w4": (2, ["reshard_load:O0:4", "reshard_load:O2:4"], "w4"),
}
#: What the two-node test trains: FSDP2 and DDP at O1 and O2.
MULTINODE = ["two_nodes_of_two", "match:O1", "match:O2", "ddp_match:O1", "ddp_match:O2"]
#: Seconds one group may take (4 ranks on 2 busy cores are slow to start).
GROUP_TIMEOUT = 900

_outcomes: dict[str, dict[str, str]] = {}
_out_dir: list[Path] = []


def outcome(group: str, name: str, tmp_path_factory) -> str:
    """``"ok"`` or what failed, for case ``name`` of ``group``; the group runs on first use."""
    if group not in _outcomes:
        if not _out_dir:
            _out_dir.append(tmp_path_factory.mktemp("dist"))
        world, names, needs = GROUPS[group]
        if needs is not None:
            outcome(needs, GROUPS[needs][1][0], tmp_path_factory)
        _outcomes[group] = launch(world, names, _out_dir[0], group)
    return _outcomes[group][name]


def collect(names: list[str], world: int, out: Path, logs: list[Path],
            codes: list[int | None]) -> dict[str, str]:
    """Merge the ranks' results files: ``{case: "ok" or each failing rank's traceback}``."""
    per_rank = []
    for r in range(world):
        path = out / f"results-{r}.json"
        if path.exists():
            per_rank.append(json.loads(path.read_text()))
            continue
        tails = "\n".join(f"--- {log.name}:\n{log.read_text()[-3000:]}" for log in logs
                          if log.exists())
        per_rank.append({n: f"rank {r} wrote no results (exit codes {codes}):\n{tails}"
                         for n in names})
    merged = {}
    for n in names:
        bad = [f"rank {r}: {res.get(n, 'not run')}" for r, res in enumerate(per_rank)
               if res.get(n) != "ok"]
        merged[n] = "ok" if not bad else "\n".join(bad)
    if any(codes):  # the cases passed, but a process died on the way out (a teardown race)
        tails = "\n".join(f"--- {log.name}:\n{log.read_text()[-2000:]}" for log in logs)
        merged = {n: f"exit codes {codes} after the cases:\n{tails}" if r == "ok" else r
                  for n, r in merged.items()}
    return merged


def wait_all(procs, timeout: float) -> list[int | None]:
    """Wait for every process up to ``timeout`` seconds in all; kill the ones still running."""
    import subprocess
    import time

    deadline = time.monotonic() + timeout
    try:
        for p in procs:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pass
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return [p.returncode for p in procs]


def worker_env() -> dict[str, str]:
    """The environment of a worker: one thread each (the ranks share two cores)."""
    return dict(os.environ, OMP_NUM_THREADS="1")


def launch(world: int, names: list[str], out: Path, tag: str, script: str = __file__,
           env: dict[str, str] | None = None) -> dict[str, str]:
    """Run the cases in a fresh gloo group of ``world`` processes; ``{case: "ok" or why not}``.

    ``script`` is a case file whose ``__main__`` calls :func:`main` with its cases
    (this file by default); ``env`` adds to the workers' environment.
    """
    import subprocess

    from training_utils import free_port

    env = dict(worker_env(), **(env or {}), MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(free_port()), WORLD_SIZE=str(world))
    logs = [out / f"{tag}-rank{r}.log" for r in range(world)]
    for r in range(world):
        (out / f"results-{r}.json").unlink(missing_ok=True)
    procs = []
    for r in range(world):
        with open(logs[r], "w") as log:
            procs.append(subprocess.Popen([sys.executable, script, str(out), ",".join(names)],
                                          env=dict(env, RANK=str(r)), stdout=log,
                                          stderr=subprocess.STDOUT))
    return collect(names, world, out, logs, wait_all(procs, GROUP_TIMEOUT))


# --------------------------------------------------------------------------- driver


def main(cases: dict[str, Callable[[Ctx], None]] | None = None) -> None:
    """Run the cases named in ``sys.argv`` from ``cases`` (this file's :data:`CASES` by default)."""
    cases = CASES if cases is None else cases
    out, names = Path(sys.argv[1]), sys.argv[2].split(",")
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=90))
    ctx = Ctx(out)
    torch.set_num_threads(1)
    results = {}
    for name in names:
        try:
            cases[name](ctx)
            results[name] = "ok"
        except Exception:  # recorded; the other cases still run
            results[name] = traceback.format_exc()
            with contextlib.suppress(Exception):
                amp.deinitialize()
        dist.barrier()  # every rank finishes a case before any starts the next
    (out / f"results-{ctx.rank}.json").write_text(json.dumps(results))
    close_process_group()


if __name__ == "__main__":
    main()
