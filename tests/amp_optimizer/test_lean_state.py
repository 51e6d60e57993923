"""Low-precision optimizer state and bf16 masters keep every amp guarantee (docs/lean_state.md).

For every ``optimizer_state`` (fp32, bf16, int8, fp8) and, at O2, every
``master_weights`` (True, "bf16", False), with FusedAdam (AdamW and Adam's L2
mode), FusedSGD (momentum) and FusedLAMB, on bf16 and fp16 models:

- an overflow-skipped step changes nothing, bitwise: params, masters, codes,
  scales and step counters; the run then equals one that never saw the batch;
- ``optimizer.state_dict()`` with ``amp.state_dict()`` (through ``torch.save``),
  and ``amp.save_checkpoint`` (DCP), resume bit-exactly into fresh objects;
- a checkpoint written under another ``optimizer_state`` loads and trains;
- ``amp.clip_grad_norm_`` clips the quantized run as torch's clipping does;
- ``deinitialize`` gives the optimizer its previous format back, state kept;
- optimizers that cannot keep such state, and bad values, raise ValueError.

The model has two weights of at least 4096 elements (block-scaled codes, one
of them two blocks per row) and small tensors that keep fp32 state. FSDP2's
cases run in the shared 2-rank group of ``tests/distributed``
(``_loop_cases.py``, ``lean:*``).
"""

from __future__ import annotations

import io
import itertools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import amp_patch as amp
from amp_patch.optim.amp import LARC
from amp_patch.optim.fused import (FusedAdagrad, FusedAdam, FusedLAMB, FusedMixedPrecisionLamb,
                                  FusedNovoGrad, FusedSGD)
from amp_patch.ops.lean_state_ops import decode
from amp_patch.optim.fused.state_format import SCALE_SUFFIX, SCALED_CODES
from training_utils import single_thread

@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny tensors through the reference ops: one thread is several times faster than two."""
    with single_thread():
        yield


STATES = ("fp32", "bf16", "int8", "fp8")
HALVES = {"bf16": torch.bfloat16, "fp16": torch.float16}
OPTIMIZERS = {
    "adamw": (FusedAdam, dict(lr=1e-2, weight_decay=0.01)),
    "adam_l2": (FusedAdam, dict(lr=1e-2, weight_decay=0.01, adam_w_mode=False)),
    "sgd": (FusedSGD, dict(lr=0.05, momentum=0.9, weight_decay=1e-4)),
    "lamb": (FusedLAMB, dict(lr=1e-2, weight_decay=0.01)),
}
D_IN = 320  # the first weight is 16 x 320: two blocks of 256 per row


def _settings():
    """(level, optimizer_state, master_weights, half dtype name) of every combination."""
    out = [("O2", s, m, h) for s, m, h in itertools.product(STATES, (True, "bf16", False), HALVES)]
    out += [("O1", s, None, h) for s, h in itertools.product(STATES, HALVES)]
    return out


SETTINGS = _settings()
SETTING_IDS = [f"{lvl}-{s}-mw{m}-{h}" for lvl, s, m, h in SETTINGS]


def settings(fn):
    fn = pytest.mark.parametrize("level,state,masters,half", SETTINGS, ids=SETTING_IDS)(fn)
    return pytest.mark.parametrize("opt_name", sorted(OPTIMIZERS))(fn)


def model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(D_IN, 16), nn.ReLU(), nn.Linear(16, 256), nn.ReLU(),
                         nn.Linear(256, 4))


def batch(step: int):
    g = torch.Generator().manual_seed(500 + step)
    x = torch.randn(8, D_IN, generator=g)
    w = torch.randn(D_IN, 4, generator=torch.Generator().manual_seed(3))
    return x, (x @ w).argmax(1)


def build(opt_name: str, level: str, state: str, masters, half: str, seed: int = 0,
          **overrides):
    net = model(seed)
    cls, kwargs = OPTIMIZERS[opt_name]
    opt = cls(net.parameters(), **kwargs)
    options = dict(opt_level=level, loss_scale="dynamic", verbosity=0, optimizer_state=state,
                   half_dtype=HALVES[half])
    if level == "O2":
        options["master_weights"] = masters
    options.update(overrides)
    return amp.initialize(net, opt, **options)


def train_step(net, opt, step: int, inject: str | None = None, clip: float | None = None,
               clip_with=amp.clip_grad_norm_) -> torch.Tensor:
    x, y = batch(step)
    loss = F.cross_entropy(net(x).float(), y)
    if inject == "nan_loss":
        loss = loss * float("nan")
    with amp.scale_loss(loss, opt) as scaled:
        scaled.backward()
        if inject == "inf_grad":
            grad = net[0].weight.grad
            grad.view(-1)[7] = float("inf")
    if clip is not None:
        clip_with(opt, clip)
    opt.step()
    opt.zero_grad()
    return loss.detach()


def snapshot(net, opt) -> list:
    """Every bit of the training state: the model's tensors, what the optimizer steps (masters),
    its state (codes, scales, step counters) and its param groups' step counters."""
    out: list = [t.detach().clone() for t in net.state_dict().values()]
    out += [p.detach().clone() for p in net.parameters()]
    for group in opt.param_groups:
        out.append(("group step", _plain(group.get("step"))))
        for p in group["params"]:
            out.append(p.detach().clone())
            for key, value in sorted(opt.state.get(p, {}).items()):
                out.append((key, value.detach().clone() if isinstance(value, torch.Tensor)
                            else value))
    return out


def _plain(value):
    return value.item() if isinstance(value, torch.Tensor) else value


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def assert_same(a: list, b: list, what: str = "") -> None:
    """The same leaves, tensors bit for bit (fp8 included)."""
    assert len(a) == len(b), what
    for i, (x, y) in enumerate(zip(a, b)):
        if isinstance(x, tuple):
            assert isinstance(y, tuple) and x[0] == y[0], (what, i, x[0], y)
            x, y = x[1], y[1]
        if isinstance(x, torch.Tensor):
            assert isinstance(y, torch.Tensor), (what, i)
            assert x.dtype == y.dtype and x.shape == y.shape, (what, i, x.dtype, y.dtype)
            assert torch.equal(_bits(x), _bits(y)), f"{what}: tensor {i} differs"
        else:
            assert x == y, (what, i, x, y)


def state_codes(opt) -> set:
    """The dtypes of the optimizer's state tensors other than step counters and scales."""
    return {v.dtype for s in opt.state.values() for k, v in s.items()
            if isinstance(v, torch.Tensor) and k != "step" and not k.endswith(SCALE_SUFFIX)
            and k != "master_param"}


def state_values(opt) -> dict:
    """(flat index, key) -> the value of each moment or buffer, decoded to fp32."""
    out = {}
    for i, p in enumerate(p for g in opt.param_groups for p in g["params"]):
        for key, v in opt.state[p].items():
            if isinstance(v, torch.Tensor) and key not in ("step", "master_param") \
                    and not key.endswith(SCALE_SUFFIX):
                out[(i, key)] = decode(v, opt.state[p].get(key + SCALE_SUFFIX)).clone()
    return out


def expected_codes(opt_name: str, state: str) -> set:
    fmt = {"fp32": set(), "bf16": {torch.bfloat16}, "int8": {torch.int8, torch.uint8},
           "fp8": {torch.float8_e4m3fn, torch.bfloat16}}[state]
    if opt_name == "sgd":
        fmt = {"fp32": set(), "bf16": {torch.bfloat16}, "int8": {torch.int8},
               "fp8": {torch.float8_e4m3fn}}[state]
    return fmt


# --------------------------------------------------------------------------- the formats are used


@settings
def test_the_state_has_the_format(opt_name, level, state, masters, half):
    net, opt = build(opt_name, level, state, masters, half)
    for s in range(2):
        train_step(net, opt, s)
    codes = state_codes(opt)
    assert expected_codes(opt_name, state) <= codes
    scaled = [k for s in opt.state.values() for k in s if k.endswith(SCALE_SUFFIX)]
    assert bool(scaled) == (state in ("int8", "fp8"))
    for s in opt.state.values():
        for key, value in s.items():
            if isinstance(value, torch.Tensor) and value.dtype in SCALED_CODES:
                scales = s[key + SCALE_SUFFIX]
                assert scales.dtype == torch.float32 and scales.shape[0] == value.shape[0]
    if masters == "bf16" and level == "O2":
        assert {p.dtype for p in amp.master_params(opt) if p.dim() == 2} == {torch.bfloat16}


# --------------------------------------------------------------------------- 1. overflow skips


@settings
def test_overflow_skip_changes_nothing(opt_name, level, state, masters, half):
    """An inf grad at step 2: the step changes no bit, the scale halves, and the run goes on as
    one that never saw batch 2 (the rounding bits follow the step count, which did not move)."""
    net, opt = build(opt_name, level, state, masters, half)
    for s in range(2):
        train_step(net, opt, s)
    before, scale = snapshot(net, opt), amp.state_dict()["loss_scaler0"]["loss_scale"]
    train_step(net, opt, 2, inject="inf_grad")
    assert_same(before, snapshot(net, opt), "the skipped step")
    assert amp.state_dict()["loss_scaler0"]["loss_scale"] == scale / 2
    for s in range(3, 5):
        train_step(net, opt, s)
    skipped = snapshot(net, opt)
    amp.deinitialize()

    net, opt = build(opt_name, level, state, masters, half)
    for s in (0, 1, 3, 4):
        train_step(net, opt, s)
    assert_same(snapshot(net, opt), skipped, "against the run without batch 2")


# --------------------------------------------------------------------------- 2. checkpoints


def _save(net, opt) -> bytes:
    buf = io.BytesIO()
    torch.save({"model": net.state_dict(), "optimizer": opt.state_dict(),
                "amp": amp.state_dict()}, buf)
    return buf.getvalue()


def _load(blob: bytes, net, opt) -> None:
    ckpt = torch.load(io.BytesIO(blob))
    net.load_state_dict(ckpt["model"])
    opt.load_state_dict(ckpt["optimizer"])
    amp.load_state_dict(ckpt["amp"])


def _first_and_rest(opt_name, level, state, masters, half, save, load):
    """Steps 0-2 (step 1 overflows), ``save``, steps 3-5: the snapshot and losses. Then a fresh
    model of another seed and a fresh optimizer, ``load``, steps 3-5: the same."""
    net, opt = build(opt_name, level, state, masters, half)
    for s in range(3):
        train_step(net, opt, s, inject="nan_loss" if s == 1 else None)
    saved = save(net, opt)
    losses = [train_step(net, opt, s) for s in range(3, 6)]
    expected, scaler = snapshot(net, opt), amp.state_dict()
    amp.deinitialize()

    net, opt = build(opt_name, level, state, masters, half, seed=1)
    load(saved, net, opt)
    resumed = [train_step(net, opt, s) for s in range(3, 6)]
    assert_same(snapshot(net, opt), expected, "resumed")
    assert_same(resumed, losses, "losses")
    assert amp.state_dict() == scaler
    assert scaler["loss_scaler0"]["skipped"] >= 1  # the NaN step (LAMB on bare fp16: more)


@settings
def test_state_dict_resume_is_exact(opt_name, level, state, masters, half):
    _first_and_rest(opt_name, level, state, masters, half, _save, _load)


def _dcp_save(path):
    def save(net, opt):
        amp.save_checkpoint(path, net, opt)
    return save


def _dcp_load(path):
    def load(_, net, opt):
        amp.load_checkpoint(path, net, opt)
    return load


@pytest.mark.slow
@settings
def test_dcp_resume_is_exact(opt_name, level, state, masters, half, tmp_path):
    _first_and_rest(opt_name, level, state, masters, half, _dcp_save(tmp_path / "ckpt"),
                    _dcp_load(tmp_path / "ckpt"))


@pytest.mark.parametrize("saved_state,loaded_state", [("fp32", "int8"), ("int8", "fp32"),
                                                      ("int8", "fp8"), ("fp8", "bf16")])
@pytest.mark.parametrize("opt_name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("how", ["state_dict", "dcp"])
def test_checkpoint_of_another_format_converts(opt_name, saved_state, loaded_state, how,
                                               tmp_path):
    """A checkpoint saved under one optimizer_state loads under another; the next step converts
    the state to the new codes, whose values are the saved ones to the new code's rounding."""
    save, load = ((_save, _load) if how == "state_dict"
                  else (_dcp_save(tmp_path / "ckpt"), _dcp_load(tmp_path / "ckpt")))
    net, opt = build(opt_name, "O2", saved_state, "bf16", "bf16")
    for s in range(3):
        train_step(net, opt, s)
    blob = save(net, opt)
    saved = state_values(opt)
    first = train_step(net, opt, 3)
    amp.deinitialize()

    net, opt = build(opt_name, "O2", loaded_state, "bf16", "bf16", seed=1)
    load(blob, net, opt)
    loaded = state_values(opt)
    assert loaded.keys() == saved.keys()
    for key in saved:  # the saved codes, not their bits read as values of another code
        assert torch.equal(loaded[key], saved[key]), key
    losses = [train_step(net, opt, s) for s in range(3, 6)]
    assert all(torch.isfinite(loss) for loss in losses)
    assert torch.allclose(losses[0], first, rtol=1e-2)  # same weights, same batch
    assert expected_codes(opt_name, loaded_state) <= state_codes(opt)
    if loaded_state == "fp32":
        assert state_codes(opt) == {torch.float32}
        assert not any(k.endswith(SCALE_SUFFIX) for s in opt.state.values() for k in s)


# --------------------------------------------------------------------------- 4. clipping


@pytest.mark.parametrize("state", STATES)
@pytest.mark.parametrize("opt_name", ["adamw", "sgd"])
def test_clip_grad_norm(opt_name, state):
    """O2 with bf16 masters: amp.clip_grad_norm_ with a bound above every norm is the unclipped
    run, bit for bit; with a bound below them it clips every step, and the losses follow the
    run clipped by torch's clip_grad_norm_ on amp.master_params."""

    def run(clip, clip_with="amp"):
        net, opt = build(opt_name, "O2", state, "bf16", "bf16")
        norms = []

        def clip_and_record(o, max_norm):
            if clip_with == "torch":
                norms.append(torch.nn.utils.clip_grad_norm_(list(amp.master_params(o)), max_norm))
            else:
                norms.append(amp.clip_grad_norm_(o, max_norm))

        losses = [train_step(net, opt, s, clip=clip, clip_with=clip_and_record)
                  for s in range(5)]
        out = torch.stack(losses), snapshot(net, opt), norms
        amp.deinitialize()
        return out

    unclipped, unclipped_state, _ = run(None)
    loose, loose_state, loose_norms = run(1e6)
    assert_same(loose_state, unclipped_state, "clipping above the norm")
    assert all(n < 1e6 for n in loose_norms)
    clipped, _, norms = run(0.05)
    torch_clipped, _, torch_norms = run(0.05, "torch")
    assert min(n.item() for n in norms) > 0.05  # every step clipped
    # Clipping moves the losses; amp's and torch's clipping (their norms are summed in other
    # orders, and bf16 grads rounded apart) agree several times more closely than that.
    effect = (clipped - unclipped).abs().max()
    assert effect > 0.01
    assert (clipped - torch_clipped).abs().max() < effect / 4
    torch.testing.assert_close(torch.stack(norms), torch.stack(torch_norms).float(),
                               rtol=2e-2, atol=1e-3)


# --------------------------------------------------------------------------- 5. errors


def _larc(cls, **kw):
    return lambda params: LARC(cls(params, **kw))


NOT_LEAN = {
    "torch.AdamW": lambda params: torch.optim.AdamW(params, lr=1e-3),
    "torch.SGD": lambda params: torch.optim.SGD(params, lr=1e-3, momentum=0.9),
    "FusedMixedPrecisionLamb": lambda params: FusedMixedPrecisionLamb(params, lr=1e-3),
    "FusedNovoGrad": lambda params: FusedNovoGrad(params, lr=1e-3),
    "FusedAdagrad": lambda params: FusedAdagrad(params, lr=1e-3),
    "LARC(torch.SGD)": _larc(torch.optim.SGD, lr=1e-3),
    "LARC(FusedNovoGrad)": _larc(FusedNovoGrad, lr=1e-3),
}


@pytest.mark.parametrize("lean", [dict(optimizer_state="int8"), dict(optimizer_state="bf16"),
                                  dict(master_weights="bf16")], ids=["int8", "bf16", "mw-bf16"])
@pytest.mark.parametrize("name", sorted(NOT_LEAN))
def test_optimizers_without_lean_state_are_refused(name, lean):
    net = model()
    opt = NOT_LEAN[name](net.parameters())
    before = [p.detach().clone() for p in net.parameters()]
    with pytest.raises(ValueError, match="FusedAdam") as info:
        amp.initialize(net, opt, opt_level="O2", half_dtype=torch.bfloat16, verbosity=0, **lean)
    message = str(info.value)
    assert "FusedSGD" in message and ("optimizer_state" in message or "master_weights" in message)
    # Nothing stays patched or cast: the failed initialize was undone.
    assert amp.session.current() is None
    assert all(p.dtype == torch.float32 for p in net.parameters())
    assert all(torch.equal(a, b) for a, b in zip(before, net.parameters()))


@pytest.mark.parametrize("lean", [dict(optimizer_state="int8"), dict(master_weights="bf16")],
                         ids=["int8", "mw-bf16"])
def test_apex_fp16_optimizer_is_refused(lean):
    """Apex's FP16_Optimizer keeps its own fp32 masters and state: amp takes no such wrapper."""
    from amp_patch.apex_compat.fp16_optimizer import FP16_Optimizer

    net = model()
    opt = FP16_Optimizer(FusedAdam(net.parameters(), lr=1e-3))
    with pytest.raises(TypeError, match="got FP16_Optimizer"):
        amp.initialize(net, opt, opt_level="O2", verbosity=0, **lean)
    assert amp.session.current() is None


@pytest.mark.parametrize("cls", [FusedAdam, FusedSGD])
def test_larc_around_a_lean_optimizer_trains(cls):
    net = model()
    kwargs = dict(lr=1e-2, momentum=0.9) if cls is FusedSGD else dict(lr=1e-2)
    opt = LARC(cls(net.parameters(), **kwargs))
    net, opt = amp.initialize(net, opt, opt_level="O2", half_dtype=torch.bfloat16, verbosity=0,
                              optimizer_state="int8", master_weights="bf16")
    losses = [train_step(net, opt, s) for s in range(3)]
    assert all(torch.isfinite(loss) for loss in losses)
    assert torch.int8 in state_codes(opt.optim)


@pytest.mark.parametrize("bad,match", [
    (dict(optimizer_state="int4"), "optimizer_state must be one of"),
    (dict(optimizer_state="FP8"), "optimizer_state must be one of"),
    (dict(optimizer_state=8), "optimizer_state must be one of"),
    (dict(master_weights="fp8"), "master_weights must be"),
    (dict(master_weights="fp32"), "master_weights must be"),
    (dict(master_weights=torch.bfloat16), "master_weights must be"),
])
def test_bad_values_are_refused(bad, match):
    net = model()
    opt = FusedAdam(net.parameters(), lr=1e-3)
    with pytest.raises(ValueError, match=match):
        amp.initialize(net, opt, opt_level="O2", verbosity=0, **bad)
    assert amp.session.current() is None


@pytest.mark.parametrize("masters", [True, "bf16"])
def test_masters_at_o1_are_refused(masters):
    net = model()
    opt = FusedAdam(net.parameters(), lr=1e-3)
    with pytest.raises(ValueError, match="master_weights"):
        amp.initialize(net, opt, opt_level="O1", verbosity=0, master_weights=masters)
    assert amp.session.current() is None


def test_fused_optimizer_set_state_format_errors():
    net = model()
    with pytest.raises(ValueError, match="optimizer_state must be one of"):
        FusedAdam(net.parameters(), state_format="int4")
    novograd = FusedNovoGrad(net.parameters(), lr=1e-3)
    with pytest.raises(ValueError, match="the optimizers that can are FusedAdam, FusedSGD"):
        novograd.set_state_format("int8")
    with pytest.raises(ValueError, match="the optimizers that can are FusedAdam, FusedSGD"):
        novograd.set_state_format("fp32", stochastic_rounding=True)
    assert novograd.state_format.name == "fp32" and not novograd.stochastic_rounding


# --------------------------------------------------------------------------- 6. deinitialize


@pytest.mark.parametrize("state", ["bf16", "int8", "fp8"])
@pytest.mark.parametrize("opt_name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("masters", [True, "bf16"])
def test_deinitialize_restores_the_format(opt_name, state, masters):
    """The optimizer gets its format (and rounding) back; its state survives, each value as the
    quantized one decoded, and converts to the old format at the next step."""
    net = model()
    cls, kwargs = OPTIMIZERS[opt_name]
    opt = cls(net.parameters(), **kwargs)
    assert opt.state_format.name == "fp32" and not opt.stochastic_rounding
    net, opt = amp.initialize(net, opt, opt_level="O2", half_dtype=torch.bfloat16, verbosity=0,
                              optimizer_state=state, master_weights=masters)
    assert opt.state_format.name == state and opt.stochastic_rounding == (masters == "bf16")
    for s in range(2):
        train_step(net, opt, s)

    quantized = state_values(opt)
    amp.deinitialize()
    assert opt.state_format.name == "fp32" and not opt.stochastic_rounding
    kept = state_values(opt)
    assert kept.keys() == quantized.keys()
    for key in kept:  # the masters' state moved to the model params, values unchanged
        assert torch.equal(kept[key], quantized[key]), key
    # The next step converts to the old format (fp32 state; SGD's buffers in the param's dtype).
    for p in net.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    assert not any(k.endswith(SCALE_SUFFIX) for s in opt.state.values() for k in s)
    assert state_codes(opt) <= {torch.float32, torch.bfloat16}
    assert all(torch.isfinite(p).all() for p in net.parameters())
