"""The one-pass O2 step: amp_patch's fused optimizers read the half grads themselves.

Under O2 with a fused optimizer, ``scale_loss`` exit only reads the grads (one
L2 norm per device feeds the overflow flag) and ``step()`` reads them, still
scaled, times the inverse scale, updating the fp32 masters and writing the half
params in one pass. Every test compares it, to the bit, with the paths that
materialize fp32 master grads: on demand (``amp.master_params``), and the
classic one (the same optimizer without step inputs, stepped on master grads
and copied into the model afterwards).
"""

from __future__ import annotations

import io

import pytest
import torch
from torch import nn

import amp_patch as amp
from amp_patch import ops
from amp_patch import optimizers as fused
from amp_patch.optim.amp.master_weights import MasterWeights
from training_utils import assert_identical, count_host_syncs, mlp_batch, snapshot, xent

#: Each fused optimizer, with arguments that exercise its options (LAMB's clipping included).
OPTIMIZERS = {
    "adam": (fused.FusedAdam, dict(lr=1e-2, weight_decay=0.01)),
    "adam-l2": (fused.FusedAdam, dict(lr=1e-2, weight_decay=0.01, adam_w_mode=False)),
    "lamb": (fused.FusedLAMB, dict(lr=1e-2, weight_decay=0.01, max_grad_norm=0.5)),
    "mp-lamb": (fused.FusedMixedPrecisionLamb, dict(lr=1e-2, weight_decay=0.01,
                                                    max_grad_norm=0.5)),
    # set_grad_none=False, Apex's default: zero_grad zeroes the batch norm's fp32 grads.
    "sgd": (fused.FusedSGD, dict(lr=0.1, momentum=0.9)),
    "novograd": (fused.FusedNovoGrad, dict(lr=1e-2, weight_decay=0.01)),
    "adagrad": (fused.FusedAdagrad, dict(lr=1e-2)),
}
#: (half dtype, loss scale, steps whose grads get an inf injected)
PRECISIONS = {
    "bf16": (torch.bfloat16, None, ()),
    "fp16-dynamic": (torch.float16, "dynamic", (3, 7)),
}
STEPS = 10


def _model(seed: int = 0) -> nn.Module:
    # The batch norm stays fp32 under O2: stepped directly, next to the masters.
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4))


def _without_step_inputs(cls):
    """The same optimizer, stepped the classic way: amp unscales into fp32 master grads and
    copies the masters into the model after the step."""
    return type(f"Classic{cls.__name__}", (cls,), {"fused_step_inputs": None})


class _Counts:
    """Calls that mark fp32 master grads or a separate pass: the one-pass step makes none."""

    def __init__(self, monkeypatch):
        self.calls: list[str] = []
        for name in ("multi_tensor_unscale_copy_", "multi_tensor_copy_", "multi_tensor_unscale_"):
            real = getattr(ops, name)
            monkeypatch.setattr(ops, name, lambda *a, _n=name, _r=real: (self.calls.append(_n),
                                                                          _r(*a))[1])
        real_storage = MasterWeights.grad_storage
        monkeypatch.setattr(MasterWeights, "grad_storage",
                            lambda s, m: (self.calls.append("grad_storage"), real_storage(s, m))[1])


def _train(opt_cls, kwargs, precision, mode, steps=STEPS, on_step=None):
    half, loss_scale, overflow_steps = PRECISIONS[precision]
    model = _model()
    opt = opt_cls(model.parameters(), **kwargs)
    amp.initialize(model, opt, opt_level="O2", half_dtype=half, loss_scale=loss_scale,
                   verbosity=0)
    history = []
    stepped = []
    opt.register_step_post_hook(lambda *_: stepped.append(1))
    for step in range(steps):
        x, y = mlp_batch(step)
        # Parameters, masters and optimizer state (a forward moves the batch norm's buffers).
        before = _trained(model, opt) if step in overflow_steps else None
        syncs = None
        with count_host_syncs() as counted:
            with amp.scale_loss(xent(model(x.to(half)), y), opt) as scaled:
                scaled.backward()
                if step in overflow_steps:
                    model[0].weight.grad[0, 0] = float("inf")
            if mode == "materialized":
                for _ in amp.master_params(opt):
                    pass
            if on_step is not None:
                on_step(model, opt)
            opt.step()
            opt.zero_grad()
            # The optimizer's own host reads (MP-LAMB's lr and step) count only when it stepped.
            syncs = counted["n"], bool(stepped and stepped.pop())
        if before is not None:
            assert_identical(before, _trained(model, opt))
        history.append((snapshot([model], [opt]), syncs))
    scale = amp.state_dict()["loss_scaler0"]["loss_scale"]
    amp.deinitialize()
    return history, scale


def _trained(model, opt) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()] + snapshot([], [opt])


def _own_syncs(opt_cls, kwargs) -> int:
    """Host syncs the optimizer's own step makes without amp (MP-LAMB reads its lr and step)."""
    params = [nn.Parameter(torch.randn(4)) for _ in range(2)]
    for p in params:
        p.grad = torch.randn(4)
    opt = opt_cls(params, **kwargs)
    with count_host_syncs() as counted:
        opt.step()
    return counted["n"]


@pytest.mark.slow
@pytest.mark.parametrize("precision", sorted(PRECISIONS))
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_one_pass_equals_materialized_master_grads(monkeypatch, name, precision):
    opt_cls, kwargs = OPTIMIZERS[name]
    classic, classic_scale = _train(_without_step_inputs(opt_cls), kwargs, precision, "one-pass")
    materialized, _ = _train(opt_cls, kwargs, precision, "materialized")
    own = _own_syncs(opt_cls, kwargs)
    flag_reads = int(opt_cls([nn.Parameter(torch.zeros(1))], **kwargs).READS_FOUND_INF)
    counts = _Counts(monkeypatch)
    grads_at_step = []

    def no_master_grads(model, opt):
        grads_at_step.append([p.grad for p in opt.param_groups[0]["params"]
                              if p.dtype == torch.float32 and p.dim() == 2])

    one_pass, scale = _train(opt_cls, kwargs, precision, "one-pass", on_step=no_master_grads)
    assert counts.calls == []  # no fp32 master grad, no unscale pass, no copy into the model
    assert all(g is None for grads in grads_at_step for g in grads)
    assert scale == classic_scale
    for step, ((ours, syncs), (theirs, _), (mat, _)) in enumerate(
            zip(one_pass, classic, materialized)):
        assert_identical(ours, theirs)
        assert_identical(ours, mat)
        # The step reads the device's skip flag once where its step counters are on the host
        # (READS_FOUND_INF; FusedAdam keeps them on the device); an overflowed step is called
        # with the flag and returns before the optimizer's own reads.
        stepped = syncs[1] and step not in PRECISIONS[precision][2]
        assert syncs[0] == flag_reads + own * stepped, f"step {step}: {syncs[0]} host syncs"
    if PRECISIONS[precision][2]:
        assert scale < 2.0**16  # the injected overflows halved it


#: The two ways to clip under O2: torch's on amp.master_params, and amp's on the optimizer.
CLIPS = {
    "torch": lambda opt: torch.nn.utils.clip_grad_norm_(amp.master_params(opt), 0.05),
    "amp": lambda opt: amp.clip_grad_norm_(opt, 0.05),
}


@pytest.mark.slow
@pytest.mark.parametrize("clip_with", sorted(CLIPS))
@pytest.mark.parametrize("name", ["adam", "lamb"])
def test_clipping_master_params_materializes_them(monkeypatch, name, clip_with):
    """Clipping each step (fp16, dynamic scale, two injected overflows, whose skipped steps
    _train checks change nothing) gives the bits of the classic path clipped the same way."""
    opt_cls, kwargs = OPTIMIZERS[name]
    norms = []

    def clip(model, opt):
        norms.append(CLIPS[clip_with](opt))

    classic, _ = _train(_without_step_inputs(opt_cls), kwargs, "fp16-dynamic", "one-pass",
                        on_step=clip)
    ref_norms, norms[:] = list(norms), []
    counts = _Counts(monkeypatch)
    ours, _ = _train(opt_cls, kwargs, "fp16-dynamic", "one-pass", on_step=clip)
    assert counts.calls.count("multi_tensor_unscale_copy_") == STEPS
    assert "multi_tensor_copy_" not in counts.calls  # the step still writes the model itself
    for (a, _), (b, _) in zip(ours, classic):
        assert_identical(a, b)
    assert [n.item() for n in norms] == [n.item() for n in ref_norms]
    finite = [n.item() for n in norms if torch.isfinite(n)]
    assert len(finite) == STEPS - 2 and min(finite) > 0.05  # every stepped iteration clipped


def _accumulating_run(opt_cls, kwargs, models_and_opts, pattern, steps=4):
    """Several backward passes per step: ``pattern`` is a list of (loss_id, delay_unscale)."""
    history = []
    for step in range(steps):
        for i, (loss_id, delay) in enumerate(pattern):
            x, y = mlp_batch(10 * step + i)
            loss = sum(xent(m(x.half()), y) for m, _ in models_and_opts)
            with amp.scale_loss(loss, [o for _, o in models_and_opts], loss_id=loss_id,
                                delay_unscale=delay) as scaled:
                scaled.backward()
        for _, opt in models_and_opts:
            opt.step()
            opt.zero_grad()
        history.append(snapshot([m for m, _ in models_and_opts], [o for _, o in models_and_opts]))
    amp.deinitialize()
    return history


@pytest.mark.slow
@pytest.mark.parametrize("pattern", [
    [(0, True), (0, True), (0, False)],   # gradient accumulation with delay_unscale
    [(0, False), (1, False)],             # two losses, each with its scaler, one step
    [(0, False), (0, False)],             # two backward passes that each unscale
], ids=["delay-unscale", "two-losses", "two-exits"])
@pytest.mark.parametrize("sync_free", [True, False], ids=["sync-free", "host-read"])
def test_accumulation_several_losses_and_optimizers(monkeypatch, pattern, sync_free):
    def run(cls):
        pairs = []
        for seed in (0, 1):
            model = _model(seed)
            pairs.append((model, cls(model.parameters(), lr=1e-2, weight_decay=0.01)))
        models, opts = amp.initialize([m for m, _ in pairs], [o for _, o in pairs],
                                      opt_level="O2", half_dtype=torch.float16,
                                      loss_scale="dynamic", num_losses=2, sync_free=sync_free,
                                      verbosity=0)
        return _accumulating_run(cls, {}, list(zip(models, opts)), pattern)

    theirs = run(_without_step_inputs(fused.FusedLAMB))
    counts = _Counts(monkeypatch)
    ours = run(fused.FusedLAMB)
    for a, b in zip(ours, theirs):
        assert_identical(a, b)
    # A second exit before the step needs the first one's grads unscaled: made then. (Sync-free,
    # the accumulating pass unscales into temporaries by the same op: counted apart here.)
    unscaled = counts.calls.count("multi_tensor_unscale_copy_")
    if not sync_free:
        assert unscaled == (0 if pattern[-2][1] else 4 * 2)


def test_checkpoint_between_one_pass_steps_resumes_exactly():
    def start():
        model = _model()
        opt = fused.FusedAdam(model.parameters(), lr=1e-2, weight_decay=0.01)
        model, opt = amp.initialize(model, opt, opt_level="O2", half_dtype=torch.float16,
                                    loss_scale="dynamic", verbosity=0)
        return model, opt

    def steps(model, opt, first, n):
        for step in range(first, first + n):
            x, y = mlp_batch(step)
            with amp.scale_loss(xent(model(x.half()), y), opt) as scaled:
                scaled.backward()
            opt.step()
            opt.zero_grad()

    model, opt = start()
    steps(model, opt, 0, 3)
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "amp": amp.state_dict()},
               buf)
    steps(model, opt, 3, 3)
    expected = snapshot([model], [opt])
    amp.deinitialize()

    model, opt = start()
    buf.seek(0)
    ckpt = torch.load(buf, weights_only=True)
    model.load_state_dict(ckpt["model"])
    opt.load_state_dict(ckpt["opt"])
    amp.load_state_dict(ckpt["amp"])
    steps(model, opt, 3, 3)
    assert_identical(snapshot([model], [opt]), expected)


def test_zero_grad_between_exit_and_step_drops_the_deferred_grads():
    model = _model()
    opt = fused.FusedAdam(model.parameters(), lr=1e-2)
    amp.initialize(model, opt, opt_level="O2", verbosity=0)
    before = _trained(model, opt)
    x, y = mlp_batch(0)
    with amp.scale_loss(xent(model(x.bfloat16()), y), opt) as scaled:
        scaled.backward()
    opt.zero_grad()
    opt.step()  # no grads left: nothing moves
    assert_identical(_trained(model, opt), before)


def test_writing_model_grads_before_the_step_warns(caplog):
    model = _model()
    opt = fused.FusedAdam(model.parameters(), lr=1e-2)
    amp.initialize(model, opt, opt_level="O2", half_dtype=torch.float16, loss_scale="dynamic",
                   verbosity=0)
    x, y = mlp_batch(0)
    with amp.scale_loss(xent(model(x.half()), y), opt) as scaled:
        scaled.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # the scaled half grads
    with caplog.at_level("WARNING", logger="amp_patch"):
        opt.step()
    assert "amp.master_params(optimizer)" in caplog.text


def _one_pass_run(scale_between: float | None = None, clip_overflow: bool = False) -> list:
    """Three one-pass O2 steps at a static fp16 scale of 128; step 0's grads hold an inf.

    ``scale_between``: the scale set between step 1's exit and its step. ``clip_overflow``:
    :func:`amp.master_params` is read between step 0's exit and its (skipped) step.
    """
    model = _model()
    opt = fused.FusedAdam(model.parameters(), lr=1e-2, weight_decay=0.01)
    amp.initialize(model, opt, opt_level="O2", half_dtype=torch.float16, loss_scale=128.0,
                   verbosity=0)
    history = []
    for step in range(3):
        x, y = mlp_batch(step)
        with amp.scale_loss(xent(model(x.half()), y), opt) as scaled:
            scaled.backward()
            if step == 0:
                model[0].weight.grad[0, 0] = float("inf")
        if step == 0 and clip_overflow:
            for _ in amp.master_params(opt):  # the deferred unscale, over the inf grads
                pass
        if step == 1 and scale_between is not None:
            amp.session.current().scalers[0].loss_scale = scale_between
        opt.step()
        opt.zero_grad()
        history.append(_trained(model, opt))
    amp.deinitialize()
    return history


def test_a_scale_set_between_exit_and_step_leaves_that_step_alone():
    """The step reads the grads times the inverse of the scale they were made with, kept at
    the exit: a scale set after the exit is for the next iteration only."""
    plain = _one_pass_run()
    rescaled = _one_pass_run(scale_between=1000.0)
    assert_identical(rescaled[1], plain[1])
    assert not all(torch.equal(a, b) for a, b in zip(rescaled[2], plain[2]))  # then it differs


def test_unscaling_overflowed_grads_after_the_exit_leaves_the_next_step_alone():
    """The deferred unscale that master_params() runs over grads whose overflow the exit
    already decided raises a flag nobody reads: the next iterations step as without it."""
    plain = _one_pass_run()
    clipped = _one_pass_run(clip_overflow=True)
    for a, b in zip(clipped, plain):
        assert_identical(a, b)
    assert not all(torch.equal(a, b) for a, b in zip(plain[1], plain[0]))  # step 1 stepped
