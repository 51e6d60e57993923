"""FP8 inside amp: ``initialize(fp8=...)`` trains at every level, and everything else keeps working.

The layers are chosen by ``min_features=16`` or ``fp8_modules`` here: the default size
rule (2048) converts nothing this small. docs/api.md, "FP8", is the contract.
"""

from __future__ import annotations

import copy
import logging
from pathlib import Path

import pytest
import torch
from torch import nn

import amp_patch as amp
from amp_patch.casting import fp8 as cfp8
from amp_patch.ops import fp8_ops
from amp_patch.optim.fused import FusedAdam
from conftest import DEVICES, HALF_DTYPES
from training_utils import count_device_reads, run_ranks, snapshot

LEVELS = ["O0", "O1", "O2", "O3"]
SCALINGS = ["tensorwise", "delayed", "rowwise"]
TESTS = Path(__file__).resolve().parents[1]


def net(seed: int = 0, device: str = "cpu") -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(),
                         nn.Linear(64, 16)).to(device)


def batch(step: int = 0, device: str = "cpu", rows: int = 24):
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(rows, 32, generator=g)
    y = torch.randint(0, 16, (rows,), generator=g)
    return x.to(device), y.to(device)


def recipe(scaling: str, **kw) -> amp.Fp8Recipe:
    return amp.Fp8Recipe(scaling=scaling, format="e4m3" if scaling == "rowwise" else "hybrid",
                         min_features=16, **kw)


def loss_of(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(out.float(), y)


def step(model, opt, x, y, poison: bool = False) -> torch.Tensor:
    loss = loss_of(model(x), y)
    if poison:
        loss = loss * float("inf")
    with amp.scale_loss(loss, opt) as scaled:
        scaled.backward()
    opt.step()
    opt.zero_grad()
    return loss


@pytest.fixture(autouse=True)
def _no_session():
    yield
    amp.deinitialize()


@pytest.fixture
def fp8_calls(monkeypatch):
    calls = {"linear": 0, "weight": 0}
    linear, weight = fp8_ops.fp8_linear, fp8_ops.quantize_weight

    def counted_linear(*a, **k):
        calls["linear"] += 1
        return linear(*a, **k)

    def counted_weight(*a, **k):
        calls["weight"] += 1
        return weight(*a, **k)

    monkeypatch.setattr(fp8_ops, "fp8_linear", counted_linear)
    monkeypatch.setattr(fp8_ops, "quantize_weight", counted_weight)
    return calls


# ---------------------------------------------------------------------------------------
# Every level, both half dtypes, each recipe


@pytest.mark.parametrize("scaling", SCALINGS)
@pytest.mark.parametrize("half", HALF_DTYPES, ids=["fp16", "bf16"])
@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("device", DEVICES)
def test_trains_at_every_level(device, level, half, scaling, fp8_calls):
    model = net(device=device)
    opt = torch.optim.SGD(model.parameters(), lr=0.2)
    # The head is left out: it must run at the level's precision, not in FP8.
    amp.initialize(model, opt, opt_level=level, half_dtype=half, verbosity=0,
                   fp8=recipe(scaling), fp8_modules=["0", "2"],
                   loss_scale="dynamic" if half == torch.float16 else None)
    assert amp.fp8_plan().converted == ("0", "2")
    assert amp.fp8_plan().left_out == {"4": "not chosen by fp8_modules"}
    x, y = batch(device=device)
    losses = []
    for i in range(6):
        out = model(x)
        if i == 0:
            want = {"O0": torch.float32, "O1": half}.get(level, torch.float32)
            assert out.dtype == want  # O2/O3 cast outputs to fp32
            assert fp8_calls["linear"] == 2
        loss = loss_of(out, y)
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert fp8_calls["linear"] == 12
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < losses[0]


@pytest.mark.parametrize("level", ["O0", "O1", "O2"])
def test_layer_output_dtype_is_the_levels(level):
    model = net()
    seen = {}
    model[2].register_forward_hook(lambda m, i, o: seen.update(x=i[0].dtype, y=o.dtype))
    amp.initialize(model, opt_level=level, half_dtype=torch.bfloat16, verbosity=0,
                   fp8=recipe("tensorwise"))
    model(batch()[0])
    want = torch.float32 if level == "O0" else torch.bfloat16
    assert seen["y"] == want


def test_default_filter_and_plan(caplog):
    model = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 48), nn.Linear(48, 10),
                          nn.Linear(10, 32), nn.Linear(32, 32))
    caplog.set_level(logging.INFO, "amp_patch")
    amp.initialize(model, opt_level="O2", fp8=amp.Fp8Recipe(min_features=32,
                                                            skip_first_last=True))
    plan = amp.fp8_plan()
    assert plan.converted == ("1",)
    assert set(plan.left_out) == {"0", "2", "3", "4"}
    assert "first" in plan.left_out["0"] and "last" in plan.left_out["4"]
    assert "out_features=10" in plan.left_out["2"] and "in_features=10" in plan.left_out["3"]
    assert "left out 2" in caplog.text and "1 nn.Linear layer(s) converted: 1" in caplog.text
    amp.deinitialize()
    amp.initialize(net(), opt_level="O1", fp8="tensorwise", verbosity=0)
    assert amp.fp8_plan().converted == ()  # 2048 by default: nothing this small
    assert "min_features=2048" in amp.fp8_plan().left_out["0"]


def test_fp8_modules_patterns_and_callable():
    amp.initialize(net(), opt_level="O0", fp8="tensorwise", fp8_modules="[02]", verbosity=0)
    assert amp.fp8_plan().converted == ("0", "2")
    amp.deinitialize()
    amp.initialize(net(), opt_level="O0", fp8="tensorwise", verbosity=0,
                   fp8_modules=lambda name, lin: lin.in_features == 64)
    assert amp.fp8_plan().converted == ("2", "4")
    amp.deinitialize()
    mha = nn.Module()
    mha.attn = nn.MultiheadAttention(32, 2)
    mha.proj = nn.Linear(32, 32)
    amp.initialize(mha, opt_level="O0", fp8=amp.Fp8Recipe(min_features=16), verbosity=0)
    assert amp.fp8_plan().converted == ("proj",)
    assert "MultiheadAttention" in amp.fp8_plan().left_out["attn.out_proj"]


# ---------------------------------------------------------------------------------------
# The weight's cast, once per iteration


@pytest.mark.parametrize("scaling", ["tensorwise", "delayed"])
@pytest.mark.parametrize("level", ["O1", "O2"])
def test_weight_cast_once_per_iteration(level, scaling, fp8_calls):
    model = net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    amp.initialize(model, opt, opt_level=level, verbosity=0, fp8=recipe(scaling))
    for it in range(3):
        for micro in range(2):  # gradient accumulation: two forwards per step
            x, y = batch(2 * it + micro)
            with amp.scale_loss(loss_of(model(x), y), opt, delay_unscale=micro == 0) as s:
                s.backward()
        opt.step()
        opt.zero_grad()
        assert fp8_calls["weight"] == 3 * (it + 1)
        assert fp8_calls["linear"] == 6 * (it + 1)
    # An in-place change of a weight outside the optimizer moves its version: a fresh cast.
    with torch.no_grad():
        model[0].weight.mul_(1.0)
    model(batch()[0])
    model(batch()[0])
    assert fp8_calls["weight"] == 9 + 3


# ---------------------------------------------------------------------------------------
# Overflow: nothing changes


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality of fp32 tensors, NaNs included."""
    return torch.equal(a.view(torch.int32), b.view(torch.int32))


def _fp8_state() -> dict:
    return {k: v.clone() for k, v in amp.state_dict().get("fp8", {}).items()}


OPTIMIZERS = {
    "sgd": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),  # reads the flag on the host
    "adamw-fused": lambda p: torch.optim.AdamW(p, lr=1e-2, fused=True),  # device flag
    "fused-adam": lambda p: FusedAdam(p, lr=1e-2),  # amp_patch's, device flag
}


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("level", ["O1", "O2"])
def test_overflow_skip_changes_nothing(level, name):
    model = net()
    opt = OPTIMIZERS[name](model.parameters())
    amp.initialize(model, opt, opt_level=level, half_dtype=torch.float16, loss_scale="dynamic",
                   fp8=recipe("delayed", amax_history_len=4), verbosity=0)
    for i in range(3):
        step(model, opt, *batch(i))
    before_iter, fp8_before_iter = snapshot([model], [opt]), _fp8_state()
    x, y = batch(3)
    loss = loss_of(model(x), y) * float("inf")
    with amp.scale_loss(loss, opt) as scaled:
        scaled.backward()
    fp8_before_step = _fp8_state()
    opt.step()
    opt.zero_grad()
    after, fp8_after = snapshot([model], [opt]), _fp8_state()
    assert all(torch.equal(a, b) for a, b in zip(before_iter, after))
    for key, value in fp8_after.items():
        assert same_bits(value, fp8_before_step[key]), key  # restored bitwise
        if key.endswith(".scale"):
            assert same_bits(value, fp8_before_iter[key]), key
        else:  # the past rows; row 0 is the iteration's own slot, overwritten next time
            assert same_bits(value[1:], fp8_before_iter[key][1:]), key
    assert amp.state_dict()["loss_scaler0"]["loss_scale"] == 2.0**15
    for i in range(4, 6):  # and training goes on
        assert torch.isfinite(step(model, opt, *batch(i)))
    assert all(torch.isfinite(v).all() for v in _fp8_state().values())


def test_delayed_scales_move_with_steps():
    model = net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    amp.initialize(model, opt, opt_level="O2", fp8=recipe("delayed"), verbosity=0)
    # Unset (0) until the first update: the first iteration scales by the current amaxes.
    assert all(torch.equal(v, torch.zeros(3)) for k, v in _fp8_state().items()
               if k.endswith(".scale"))
    step(model, opt, *batch())
    state = _fp8_state()
    assert all((state[f"{n}.scale"] > 0).all() for n in ("0", "2", "4"))
    assert all((state[f"{n}.history"][-1] > 0).all() for n in ("0", "2", "4"))


def test_delayed_first_iteration_scales_by_the_current_amax():
    """Before any history, the delayed recipe's first step equals the tensorwise one's."""
    outs = {}
    for scaling in ("tensorwise", "delayed"):
        model = net()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        amp.initialize(model, opt, opt_level="O2", fp8=recipe(scaling), verbosity=0)
        step(model, opt, *batch())
        outs[scaling] = [p.detach().clone() for p in model.parameters()]
        amp.deinitialize()
    assert all(torch.equal(a, b) for a, b in zip(outs["tensorwise"], outs["delayed"]))


# ---------------------------------------------------------------------------------------
# Checkpoints


def _train(model, opt, start: int, steps: int) -> None:
    for i in range(start, start + steps):
        step(model, opt, *batch(i))


@pytest.mark.parametrize("half", HALF_DTYPES, ids=["fp16", "bf16"])
def test_checkpoint_resume_is_bit_exact(half):
    kw = dict(opt_level="O2", half_dtype=half, verbosity=0, fp8=recipe("delayed"),
              loss_scale="dynamic" if half == torch.float16 else None)
    model = net()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    amp.initialize(model, opt, **kw)
    _train(model, opt, 0, 6)
    want, want_fp8 = snapshot([model], [opt]), _fp8_state()
    amp.deinitialize()

    model = net()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    amp.initialize(model, opt, **kw)
    _train(model, opt, 0, 3)
    saved = copy.deepcopy({"model": model.state_dict(), "opt": opt.state_dict(),
                           "amp": amp.state_dict()})
    assert set(saved["amp"]["fp8"]) == {f"{n}.{k}" for n in "024" for k in ("history", "scale")}
    amp.deinitialize()

    model = net(seed=1)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    amp.initialize(model, opt, **kw)
    model.load_state_dict(saved["model"])
    opt.load_state_dict(saved["opt"])
    amp.load_state_dict(saved["amp"])
    _train(model, opt, 3, 3)
    got, got_fp8 = snapshot([model], [opt]), _fp8_state()
    assert all(torch.equal(a, b) for a, b in zip(want, got))
    assert all(torch.equal(want_fp8[k], got_fp8[k]) for k in want_fp8)


@pytest.mark.slow
def test_dcp_checkpoint_resume_is_bit_exact(tmp_path):
    kw = dict(opt_level="O2", half_dtype=torch.float16, loss_scale="dynamic", verbosity=0,
              fp8=recipe("delayed"))
    model = net()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    amp.initialize(model, opt, **kw)
    _train(model, opt, 0, 2)
    amp.save_checkpoint(tmp_path / "ckpt", model, opt)
    _train(model, opt, 2, 2)
    want, want_fp8 = snapshot([model], [opt]), _fp8_state()
    amp.deinitialize()

    model = net(seed=1)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    amp.initialize(model, opt, **kw)
    amp.load_checkpoint(tmp_path / "ckpt", model, opt)
    _train(model, opt, 2, 2)
    assert all(torch.equal(a, b) for a, b in zip(want, snapshot([model], [opt])))
    assert all(same_bits(v, _fp8_state()[k]) for k, v in want_fp8.items())
    amp.deinitialize()

    # A checkpoint saved without FP8 loads into an FP8 session: the layers keep their scales.
    model = net()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    amp.initialize(model, opt, opt_level="O2", verbosity=0)
    amp.save_checkpoint(tmp_path / "plain", model, opt)
    amp.deinitialize()
    amp.initialize(model, opt, opt_level="O2", verbosity=0, fp8=recipe("delayed"))
    before = _fp8_state()
    amp.load_checkpoint(tmp_path / "plain", model, opt)
    assert all(same_bits(v, _fp8_state()[k]) for k, v in before.items())


def test_old_checkpoint_without_fp8_state_loads_and_a_wrong_one_is_refused():
    model = net()
    amp.initialize(model, opt_level="O2", verbosity=0, fp8=recipe("delayed"))
    state = amp.state_dict()
    before = _fp8_state()
    amp.load_state_dict({k: v for k, v in state.items() if k != "fp8"})
    assert all(torch.equal(before[k], v) for k, v in _fp8_state().items())
    bad = dict(state, fp8={k: v for k, v in state["fp8"].items() if not k.startswith("0.")})
    with pytest.raises(ValueError, match="missing"):
        amp.load_state_dict(bad)
    # The scalers were not touched by the refused load either.
    assert amp.state_dict()["loss_scaler0"] == state["loss_scaler0"]


# ---------------------------------------------------------------------------------------
# deinitialize, fp8_autocast


def test_deinitialize_restores_every_layer(fp8_calls):
    model = net()
    own = model[2].forward  # a bound method the instance holds itself: must come back as is
    model[2].forward = own
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    params = [id(p) for p in model.parameters()]
    keys = list(model.state_dict())
    amp.initialize(model, opt, opt_level="O1", verbosity=0, fp8=recipe("delayed"))
    assert model[2].forward is not own and "forward" in model[0].__dict__
    step(model, opt, *batch())
    amp.deinitialize()
    assert "forward" not in model[0].__dict__ and "forward" not in model[4].__dict__
    assert model[2].__dict__["forward"] is own
    assert model[0].forward.__func__ is nn.Linear.forward
    assert [id(p) for p in model.parameters()] == params and list(model.state_dict()) == keys
    assert not opt._optimizer_step_post_hooks
    n = fp8_calls["linear"]
    x, y = batch(1)
    loss = loss_of(model(x), y)  # plain torch now
    loss.backward()
    opt.step()
    assert torch.isfinite(loss) and fp8_calls["linear"] == n


def test_fp8_autocast_regions(fp8_calls):
    model = net()
    amp.initialize(model, opt_level="O1", verbosity=0, fp8=recipe("tensorwise"))
    x = batch()[0]
    with amp.fp8_autocast(enabled=False):
        model(x)
        assert fp8_calls["linear"] == 0
        with amp.fp8_autocast():
            model(x)
        assert fp8_calls["linear"] == 3
        model(x)
    assert fp8_calls["linear"] == 3

    @amp.fp8_autocast(enabled=False)
    def evaluate():
        return model(x)

    assert evaluate().dtype == torch.bfloat16 and fp8_calls["linear"] == 3
    with pytest.raises(KeyError):
        with amp.fp8_autocast(enabled=False):
            raise KeyError("inside")
    model(x)
    assert fp8_calls["linear"] == 6
    with amp.fp8_autocast(recipe=amp.Fp8Recipe(format="e4m3", margin=1)):
        model(x)
    assert fp8_calls["linear"] == 9
    with pytest.raises(ValueError, match="delayed"):
        with amp.fp8_autocast(recipe="delayed"):
            pass
    assert cfp8.current_region() is None


# ---------------------------------------------------------------------------------------
# Errors


def test_recipe_validation():
    with pytest.raises(ValueError, match="format='e4m3'"):
        amp.Fp8Recipe(scaling="rowwise", format="hybrid")
    with pytest.raises(ValueError, match="Fp8Recipe.scaling must be one of"):
        amp.Fp8Recipe(scaling="blockwise")
    with pytest.raises(ValueError, match="amax_compute_algo"):
        amp.Fp8Recipe(amax_compute_algo="mean")
    with pytest.raises(ValueError, match="amax_history_len"):
        amp.Fp8Recipe(amax_history_len=0)
    with pytest.raises(ValueError, match="fp8 must be None"):
        amp.initialize(net(), opt_level="O1", fp8="fp8", verbosity=0)
    with pytest.raises(ValueError, match="fp8_modules chooses"):
        amp.initialize(net(), opt_level="O1", fp8_modules=["0"], verbosity=0)
    with pytest.raises(ValueError, match="fp8_modules"):
        amp.initialize(net(), opt_level="O1", fp8="delayed", fp8_modules=[3], verbosity=0)


def test_unknown_module_name_lists_the_linears():
    model = net()
    with pytest.raises(ValueError, match=r"'mlp\.\*'.*nn\.Linear layers are: 0, 2, 4"):
        amp.initialize(model, opt_level="O2", fp8="tensorwise", fp8_modules=["0", "mlp.*"],
                       verbosity=0)
    assert model[0].weight.dtype == torch.float32 and "forward" not in model[0].__dict__


def test_no_fp8_gemm_is_a_clear_error_unless_emulated(monkeypatch, caplog):
    has = torch._C._dispatch_has_kernel_for_dispatch_key
    monkeypatch.setattr(torch._C, "_dispatch_has_kernel_for_dispatch_key",
                        lambda op, key: False if op == "aten::_scaled_mm" else has(op, key))
    model = net()
    with pytest.raises(RuntimeError, match="has no kernel for 'cpu'.*emulate=True"):
        amp.initialize(model, opt_level="O2", fp8=recipe("tensorwise"), verbosity=0)
    assert "forward" not in model[0].__dict__ and model[0].weight.dtype == torch.float32
    caplog.set_level(logging.INFO, "amp_patch")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    amp.initialize(model, opt, opt_level="O2", fp8=recipe("tensorwise", emulate=True))
    assert "emulate=True was chosen" in caplog.text
    assert torch.isfinite(step(model, opt, *batch()))


def test_old_torch_without_scaled_mm(monkeypatch):
    monkeypatch.setattr(fp8_ops, "SCALED_MM_SIGNATURE", None)
    with pytest.raises(RuntimeError, match="no torch._scaled_mm with the signature"):
        amp.initialize(net(), opt_level="O1", fp8="tensorwise", fp8_modules="*", verbosity=0)


def test_gpu_below_sm89(monkeypatch):
    monkeypatch.setattr(torch._C, "_dispatch_has_kernel_for_dispatch_key", lambda op, key: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    with pytest.raises(RuntimeError, match="sm_80; FP8 GEMMs need sm_89"):
        cfp8._check_devices(amp.Fp8Recipe(), [torch.device("cuda", 0)])
    cfp8._check_devices(amp.Fp8Recipe(emulate=True), [torch.device("cuda", 0)])


# ---------------------------------------------------------------------------------------
# No host read per iteration


@pytest.mark.parametrize("name", ["adamw-fused", "fused-adam"])
@pytest.mark.parametrize("scaling", ["tensorwise", "delayed"])
def test_no_host_read_per_iteration(scaling, name):
    model = net()
    opt = OPTIMIZERS[name](model.parameters())
    amp.initialize(model, opt, opt_level="O2", half_dtype=torch.float16, loss_scale="dynamic",
                   fp8=recipe(scaling), verbosity=0)
    step(model, opt, *batch(0))
    for i in range(1, 4):
        x, y = batch(i)
        with count_device_reads() as reads:
            step(model, opt, x, y, poison=i == 2)
        assert reads["n"] == 0, reads["ops"]


# ---------------------------------------------------------------------------------------
# torch.compile, DDP (slow)


@pytest.mark.slow
@pytest.mark.parametrize("scaling", ["tensorwise", "delayed"])
@pytest.mark.parametrize("level", ["O1", "O2", "O3"])
def test_compiles_without_graph_breaks(level, scaling):
    import torch._dynamo

    torch._dynamo.reset()
    model = net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    amp.initialize(model, opt, opt_level=level, verbosity=0, fp8=recipe(scaling))
    x, y = batch()
    explained = torch._dynamo.explain(model)(x)
    assert explained.graph_break_count == 0, explained.break_reasons
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    eager = model(x)
    out = compiled(x)
    assert torch.equal(out, eager)
    for i in range(3):
        x, y = batch(i)
        loss = loss_of(compiled(x), y)
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()
        opt.zero_grad()
        assert torch.isfinite(loss)


DDP_WORKER = r"""
import sys, torch, torch.distributed as dist
sys.path.insert(0, sys.argv[1])
import amp_patch as amp
from fp8.test_fp8_training import net, batch, loss_of, recipe

out, strategy = sys.argv[2], sys.argv[3]
dist.init_process_group("gloo")
rank = dist.get_rank()
model = net()
if strategy == "fsdp2":  # FP8 compute on the all-gathered weights
    from torch.distributed.fsdp import fully_shard
    for layer in (model[0], model[2], model[4]):
        fully_shard(layer)
    fully_shard(model)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
model, opt = amp.initialize(model, opt, opt_level="O2", half_dtype=torch.float16,
                            loss_scale="dynamic", fp8=recipe("delayed"), verbosity=0)
ddp = torch.nn.parallel.DistributedDataParallel(model) if strategy == "ddp" else model
losses = []
for i in range(4):
    x, y = batch(2 * i + rank) if strategy == "ddp" else batch(0)
    loss = loss_of(ddp(x), y)
    with amp.scale_loss(loss, opt) as scaled:
        scaled.backward()
    opt.step()
    opt.zero_grad()
    losses.append(loss.item())
torch.save({"params": [p.detach().full_tensor() if strategy == "fsdp2" else p.detach()
                       for p in model.parameters()], "losses": losses,
            "plan": amp.fp8_plan().converted}, out)
from amp_patch.helpers import close_process_group
close_process_group()
"""


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_two_ranks(strategy, tmp_path):
    codes = run_ranks(DDP_WORKER, lambda r: [str(TESTS), str(tmp_path / f"{r}.pt"), strategy])
    assert codes == [0, 0]
    r0, r1 = (torch.load(tmp_path / f"{r}.pt") for r in range(2))
    assert r0["plan"] == ("0", "2", "4")
    assert all(torch.equal(a, b) for a, b in zip(r0["params"], r1["params"]))
    assert all(torch.isfinite(torch.tensor(r["losses"])).all() for r in (r0, r1))
    if strategy == "fsdp2":  # the same batches on both ranks
        assert r0["losses"] == r1["losses"] and r0["losses"][-1] < r0["losses"][0]
