"""Many initialize/train/deinitialize cycles in one process.

One long process used to make a later initialize look as if it had not
registered its optimizer. The cycles here mix opt levels, numbers of losses,
fresh and reused models and optimizers, LR schedulers, the legacy ``init()``
handle and garbage collection, and check after each that the session worked and
that deinitialize left torch and the optimizer clean.
"""

from __future__ import annotations

import gc
import random

import pytest
import torch

import amp_patch as amp
from amp_patch import session as amp_session
from amp_patch.settings.levels import NAMES as LEVELS
from training_utils import mlp, mlp_batch, single_thread, xent

CLEARERS = ["optimizer", "model", "none_by_hand"]


def test_optimizer_of_a_deinitialized_session_is_named_as_such():
    old_model = mlp(0)
    old_opt = torch.optim.SGD(old_model.parameters(), lr=0.1)
    amp.initialize(old_model, old_opt, opt_level="O2", verbosity=0)
    amp.deinitialize()
    model = mlp(1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    amp.initialize(model, opt, opt_level="O2", verbosity=0)
    x, y = mlp_batch(0)
    with pytest.raises(RuntimeError, match="earlier amp_patch session that has been "
                                           "deinitialized; pass it to initialize"):
        with amp.scale_loss(torch.tensor(1.0), old_opt):  # (the old model is half now)
            pass
    never = torch.optim.SGD(mlp(2).parameters(), lr=0.1)
    with pytest.raises(RuntimeError, match="was not passed to amp_patch.initialize"):
        with amp.scale_loss(xent(model(x), y), never):
            pass


def test_record_lookup_checks_identity_not_just_id():
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    amp.initialize(model, opt, opt_level="O1", verbosity=0)
    session = amp_session.current()
    impostor = torch.optim.SGD(mlp(1).parameters(), lr=0.1)
    # What a recycled id looks like to an id-keyed table.
    session.optimizer_records[id(impostor)] = session.optimizer_records[id(opt)]
    with pytest.raises(RuntimeError, match="not passed"):
        session.record_for(impostor)


def _cycle(rng: random.Random, pool: dict, original_mm) -> None:
    level = rng.choice(LEVELS)
    num_losses = rng.choice([1, 2, 3])
    if "model" not in pool or rng.random() < 0.4:
        pool["model"] = mlp(rng.randrange(100), d_in=4, hidden=8, d_out=3)
        pool.pop("opt", None)
    model = pool["model"]
    if "opt" not in pool or rng.random() < 0.4:
        kind = rng.choice(["sgd", "adam"])
        params = model.parameters()
        pool["opt"] = (torch.optim.SGD(params, lr=0.05, momentum=0.9) if kind == "sgd"
                       else torch.optim.Adam(params, lr=1e-3))
    opt = pool["opt"]
    scheduler = rng.random() < 0.3
    methods = ("step", "zero_grad", "add_param_group")
    before = {name: vars(opt).get(name) for name in methods}
    loss_scale = rng.choice([None, "dynamic"])
    amp.initialize(model, opt, opt_level=level, num_losses=num_losses, loss_scale=loss_scale,
                   verbosity=0)
    if scheduler:
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9)
    stale = pool.get("stale")
    if stale is not None and stale is not opt and rng.random() < 0.3:
        with pytest.raises(RuntimeError, match="earlier amp_patch session"):
            with amp.scale_loss(torch.ones(()), stale):
                pass
    for step in range(2):
        x, y = mlp_batch(rng.randrange(50), batch=4, d_in=4, d_out=3)
        out = model(x)
        for loss_id in range(num_losses):
            loss = xent(out, y) * (loss_id + 1)
            with amp.scale_loss(loss, opt, loss_id=loss_id) as scaled:
                scaled.backward(retain_graph=loss_id < num_losses - 1)
        opt.step()
        if scheduler:
            sched.step()
        clear = rng.choice(CLEARERS)
        if clear == "optimizer":
            opt.zero_grad()
        elif clear == "model":
            model.zero_grad()
        else:
            for p in model.parameters():
                p.grad = None
        assert torch.isfinite(loss)
    assert all(m.grad is None for m in amp.master_params(opt) if m.dtype == torch.float32
               and level == "O2" and clear != "none_by_hand")
    amp.deinitialize()
    assert torch.mm is original_mm and amp_session.current() is None
    after = {name: vars(opt).get(name) for name in methods}
    if scheduler:  # a scheduler made after initialize wraps our step, which then stays inactive
        del before["step"], after["step"]
    assert all(after[name] is before[name] for name in before)
    pool["stale"] = opt


def _legacy_cycle(rng: random.Random, original_mm) -> None:
    handle = amp.init(loss_scale=rng.choice(["dynamic", 128.0]))
    a = torch.randn(2, 2)
    assert handle.is_active() and torch.mm(a, a).dtype != torch.float32
    if rng.random() < 0.5:
        handle._deactivate()
    else:
        amp.deinitialize()
    assert not handle.is_active() and torch.mm is original_mm


@pytest.fixture
def one_thread():
    with single_thread():
        yield


@pytest.mark.slow
def test_hundreds_of_cycles_in_one_process(one_thread):
    rng = random.Random(0)
    original_mm = torch.mm
    pool: dict = {}
    for i in range(300):
        if rng.random() < 0.1:
            _legacy_cycle(rng, original_mm)
        else:
            _cycle(rng, pool, original_mm)
        if i % 7 == 0:
            if rng.random() < 0.5:
                pool.clear()  # drop everything: ids get recycled by the next objects
            gc.collect()
