"""Overflow injection: the step is skipped, nothing changes, the scale halves, training continues.

Every case runs twice from the same seed: once with an inf/NaN injected at
step ``BAD`` and once as a reference that never sees batch ``BAD``. After the
run both must be bit-identical (powers of two round-trip exactly, so the
halved scale does not change any unscaled gradient).
"""

from __future__ import annotations

import pytest
import torch

import amp_patch as amp
from amp_patch.scaler import LossScaleCollapseError
from training_utils import assert_identical, mlp, mlp_batch, snapshot, xent

BAD = 2
STEPS = 5

# (models, optimizers, losses): which models each optimizer holds, which each loss uses.
SETUPS = {
    "1m1o1l": dict(models=1, opt_models=[[0]], loss_models=[[0]], loss_opts=[[0]]),
    "2m2o2l": dict(models=2, opt_models=[[0], [1]], loss_models=[[0], [1]], loss_opts=[[0], [1]]),
    "3m2o2l": dict(models=3, opt_models=[[0, 1], [2]], loss_models=[[0, 1], [1, 2]],
                   loss_opts=[[0], [0, 1]]),
}


def build(setup, level, dtype):
    models = [mlp(seed=i, d_in=4, hidden=4, d_out=2) for i in range(setup["models"])]
    opts = [torch.optim.Adam([p for m in om for p in models[m].parameters()], lr=1e-2)
            for om in setup["opt_models"]]
    kwargs = dict(opt_level=level, loss_scale="dynamic", num_losses=len(setup["loss_models"]),
                  verbosity=0)
    if level != "O1":
        kwargs["half_dtype"] = dtype
    amp.initialize(models, opts, **kwargs)
    return models, opts


def batch(step):
    x, y = mlp_batch(step, batch=4, d_in=4, d_out=2)
    return x, y


def iteration(setup, models, opts, step, inject=None):
    x, y = batch(step)
    for loss_id, (lm, lo) in enumerate(zip(setup["loss_models"], setup["loss_opts"])):
        loss = sum(xent(models[m](x), y) for m in lm)
        # Every loss is hit, so that every optimizer must skip; partial hits are tested below.
        if inject == "nan_loss":
            loss = loss * float("nan")
        with amp.scale_loss(loss, [opts[o] for o in lo], loss_id=loss_id) as scaled:
            scaled.backward()
            if inject in ("inf", "nan"):
                grad = next(models[lm[-1]].parameters()).grad
                grad.view(-1)[grad.numel() // 2] = float(inject)
    for opt in opts:
        opt.step()
    for opt in opts:
        opt.zero_grad()


def run(setup, level, dtype, inject):
    models, opts = build(setup, level, dtype)
    scalers = amp.session.current().scalers
    for step in range(STEPS):
        if step == BAD and inject is None:
            continue
        if step == BAD:
            before = snapshot(models, opts)
            scales = [s.loss_scale for s in scalers]
            iteration(setup, models, opts, step, inject)
            assert_identical(before, snapshot(models, opts))
            assert [s.loss_scale for s in scalers] == [s / 2 for s in scales]
        else:
            iteration(setup, models, opts, step)
    out = snapshot(models, opts)
    amp.deinitialize()
    return out


@pytest.mark.slow
@pytest.mark.parametrize("inject", ["inf", "nan", "nan_loss"])
@pytest.mark.parametrize("setup", list(SETUPS))
@pytest.mark.parametrize("level", ["O1", "O2"])
def test_overflow_skips_and_matches_reference(level, setup, inject):
    cfg = SETUPS[setup]
    hit = run(cfg, level, torch.bfloat16, inject)
    ref = run(cfg, level, torch.bfloat16, None)
    assert_identical(hit, ref)


@pytest.mark.parametrize("inject", ["inf", "nan_loss"])
def test_fp16_tiny_o2_dynamic(inject):
    cfg = SETUPS["1m1o1l"]
    hit = run(cfg, "O2", torch.float16, inject)
    ref = run(cfg, "O2", torch.float16, None)
    assert_identical(hit, ref)


def test_adam_step_counters_untouched_by_skip():
    model = mlp()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    amp.initialize(model, opt, opt_level="O2", loss_scale="dynamic", verbosity=0)
    x, y = mlp_batch(0)
    for inject in (False, True):
        with amp.scale_loss(xent(model(x), y), opt) as s:
            s.backward()
            if inject:
                model[0].weight.grad[0, 0] = float("inf")
        opt.step()
        opt.zero_grad()
    assert all(opt.state[p]["step"].item() == 1 for p in amp.master_params(opt))


def test_static_scale_still_skips():
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    amp.initialize(model, opt, opt_level="O2", loss_scale=128.0, verbosity=0)
    before = snapshot([model], [opt])
    x, y = mlp_batch(0)
    with amp.scale_loss(xent(model(x), y), opt) as s:
        s.backward()
        model[2].bias.grad[0] = float("-inf")
    opt.step()
    assert_identical(before, snapshot([model], [opt]))
    assert amp.state_dict()["loss_scaler0"]["loss_scale"] == 128.0


def test_collapse_raises_naming_the_parameter():
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    amp.initialize(model, opt, opt_level="O2", loss_scale="dynamic", min_loss_scale=2.0**15,
                   sync_free=False, verbosity=0)  # read at every exit (tests/test_sync_free.py)
    x, y = mlp_batch(0)
    with pytest.raises(LossScaleCollapseError, match=r"2\.bias"):
        for _ in range(3):
            with amp.scale_loss(xent(model(x), y), opt) as s:
                s.backward()
                model[2].bias.grad[0] = float("nan")
            opt.step()
            opt.zero_grad()


def test_only_the_optimizers_of_the_overflowing_loss_skip():
    cfg = SETUPS["2m2o2l"]
    models, opts = build(cfg, "O2", torch.bfloat16)
    x, y = batch(0)
    for loss_id in (0, 1):
        with amp.scale_loss(xent(models[loss_id](x), y), opts[loss_id], loss_id=loss_id) as s:
            s.backward()
            if loss_id == 1:
                models[1][0].weight.grad[0, 0] = float("inf")
    before = [snapshot([m], [o]) for m, o in zip(models, opts)]
    for opt in opts:
        opt.step()
    assert_identical(before[1], snapshot([models[1]], [opts[1]]))
    assert not torch.equal(before[0][0], models[0][0].weight)
    scalers = amp.session.current().scalers
    assert [s.loss_scale for s in scalers] == [2.0**16, 2.0**15]


def _nan_every_step(model, opt, steps, bad=lambda step: True):
    x, y = mlp_batch(0)
    for step in range(steps):
        with amp.scale_loss(xent(model(x), y), opt) as s:
            s.backward()
            if bad(step):
                model[2].bias.grad[0] = float("nan")
        opt.step()
        opt.zero_grad()


def test_static_scale_skips_are_bounded_and_the_error_names_the_parameter(caplog):
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    # bf16 at O2: the default static 1.0, checked because of the masters
    amp.initialize(model, opt, opt_level="O2", max_consecutive_skips=3, sync_free=False,
                   verbosity=1)
    before = snapshot([model], [opt])
    with caplog.at_level("INFO", logger="amp_patch"):
        _nan_every_step(model, opt, 3)
        with pytest.raises(LossScaleCollapseError, match=r"2\.bias") as err:
            _nan_every_step(model, opt, 1)
    assert "static" in str(err.value) and "4 consecutive" in str(err.value)
    opt.step()  # a caller that caught the error: the step is still skipped
    assert_identical(before, snapshot([model], [opt]))
    lines = [r.getMessage() for r in caplog.records if "Gradient overflow" in r.getMessage()]
    assert len(lines) == 3 and "reducing" not in lines[0]
    assert lines[0].startswith("Gradient overflow.  Skipping step, loss scaler 0 keeps its "
                               "static loss scale 1.0")


def test_static_scale_count_restarts_after_a_clean_step():
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    amp.initialize(model, opt, opt_level="O2", loss_scale=128.0, max_consecutive_skips=2,
                   verbosity=0)
    _nan_every_step(model, opt, 9, bad=lambda step: step % 3 != 2)  # two bad, one clean, ...
    assert amp.state_dict()["loss_scaler0"]["skipped"] == 6


def test_max_consecutive_skips_default_and_validation():
    from amp_patch.settings.properties import Properties

    assert Properties.from_opt_level("O2", torch.bfloat16).max_consecutive_skips == 50
    with pytest.raises(ValueError, match="max_consecutive_skips"):
        Properties.from_opt_level("O2", torch.bfloat16, max_consecutive_skips=0)
