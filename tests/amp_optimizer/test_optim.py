"""Master weights, the patched optimizer methods, lr_scheduler interplay, deinitialize."""

from __future__ import annotations

import contextlib
import warnings

import pytest
import torch
from torch import nn

import amp_patch as amp
from amp_patch.settings.levels import NAMES as LEVELS
from training_utils import convnet, conv_batch, mlp, mlp_batch, train, xent



def test_o2_masters_state_and_model_equals_half_master():
    model = convnet()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    amp.initialize(model, opt, opt_level="O2", verbosity=0)
    masters = list(amp.master_params(opt))
    assert all(p.dtype == torch.float32 for p in masters)
    assert model[0].weight.dtype == torch.bfloat16
    assert not any(p is model[0].weight for p in masters)
    assert any(p is model[1].weight for p in masters)  # fp32 batch norm is stepped directly
    for step in range(5):
        train(model, opt, 1, conv_batch, start=step)
        for master in masters:
            for v in opt.state[master].values():
                assert v.dtype == torch.float32
        record = amp.session.current().record_for(opt)
        for master in masters:
            model_p = record.model_param(master)
            assert torch.equal(model_p, master.to(model_p.dtype))


def test_step_before_any_backward_and_zero_grad():
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    amp.initialize(model, opt, opt_level="O2", verbosity=0)
    before = [p.clone() for p in model.parameters()]
    opt.step()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    x, y = mlp_batch(0)
    with amp.scale_loss(xent(model(x), y), opt) as scaled:
        scaled.backward()
    assert all(p.grad is not None for p in model.parameters())
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in amp.master_params(opt))
    opt.zero_grad(set_to_none=False)
    assert all(p.grad is not None and not p.grad.any() for p in model.parameters())
    # master grads are amp's: released either way, as Apex's zero_grad did
    assert all(p.grad is None for p in amp.master_params(opt))
    opt.zero_grad()
    assert all(p.grad is None for p in model.parameters())
    assert all(p.grad is None for p in amp.master_params(opt))


def test_add_param_group_after_initialize():
    a, b = mlp(0), mlp(1)
    opt = torch.optim.Adam(a.parameters(), lr=1e-2)
    amp.initialize([a, b], opt, opt_level="O2", verbosity=0)
    opt.add_param_group({"params": list(b.parameters()), "lr": 1e-3})
    assert all(p.dtype == torch.float32 for p in opt.param_groups[1]["params"])
    with pytest.raises(ValueError):
        opt.add_param_group({"params": list(b.parameters())})  # torch's duplicate check still runs
    x, y = mlp_batch(0)
    before = b[0].weight.clone()
    with amp.scale_loss(xent(a(x), y) + xent(b(x), y), opt) as scaled:
        scaled.backward()
    opt.step()
    assert not torch.equal(before, b[0].weight)


@pytest.mark.parametrize("order", ["before", "after"])
@pytest.mark.parametrize("level", ["O1", "O2"])
def test_lr_scheduler_either_order_no_warning(order, level):
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        if order == "before":
            sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        amp.initialize(model, opt, opt_level=level, verbosity=0)
        if order == "after":
            sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        losses = []
        for step in range(3):
            losses += train(model, opt, 1, start=step)
            sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(0.1 * 0.5**3)
    # the step still goes through amp: under O2 the model follows its masters
    if level == "O2":
        record = amp.session.current().record_for(opt)
        for master in amp.master_params(opt):
            assert torch.equal(record.model_param(master), master.to(torch.bfloat16))


@pytest.mark.parametrize("kind", ["fused", "foreach"])
@pytest.mark.parametrize("level", LEVELS)
def test_fused_and_foreach_adam_every_level(level, kind):
    model = mlp()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, **{kind: True})
    amp.initialize(model, opt, opt_level=level, verbosity=0)
    losses = train(model, opt, 12)
    assert losses[-1] < losses[0]


def test_deinitialize_restores_methods_and_param_groups():
    model = mlp()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    params = list(model.parameters())
    amp.initialize(model, opt, opt_level="O2", verbosity=0)
    assert "step" in opt.__dict__
    train(model, opt, 3)
    amp.deinitialize()
    for name in ("step", "zero_grad", "add_param_group"):
        assert name not in opt.__dict__
        assert getattr(opt, name) == getattr(torch.optim.Adam, name).__get__(opt)
    assert all(a is b for a, b in zip(opt.param_groups[0]["params"], params))
    assert all(opt.state[p]["exp_avg"].dtype == torch.bfloat16 for p in params)
    assert all(opt.state[p]["step"].item() == 3 for p in params)
    assert "amp_master_params" not in opt.state_dict()
    train_plain = model(torch.randn(2, 8).bfloat16()).float().sum()
    train_plain.backward()
    opt.step()  # the plain optimizer still works on the half model


def test_deinitialize_with_scheduler_made_before_restores_its_step():
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.optim.lr_scheduler.StepLR(opt, step_size=1)
    sched_step = opt.__dict__["step"]
    amp.initialize(model, opt, opt_level="O2", verbosity=0)
    assert opt.step._wrapped_by_lr_sched
    amp.deinitialize()
    assert opt.__dict__["step"] is sched_step


def test_closure_rejected_with_master_weights():
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    amp.initialize(model, opt, opt_level="O2", verbosity=0)
    with pytest.raises(RuntimeError, match="closure"):
        opt.step(lambda: None)


def test_existing_optimizer_state_moves_to_masters():
    model = mlp()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    amp.initialize(model, opt, opt_level="O2", verbosity=0)
    for p in amp.master_params(opt):
        assert opt.state[p]["exp_avg"].dtype == torch.float32
        assert opt.state[p]["step"].item() == 1
    assert len(opt.state) == len(list(model.parameters()))


def test_master_params_without_amp_yields_params():
    model = nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    assert list(amp.master_params(opt)) == list(model.parameters())


def test_optim_package_imports_neither_the_session_nor_the_patching():
    """The optimizer code is handed what it needs; importing it closes no circle."""
    import ast
    from pathlib import Path

    import amp_patch.optim.amp as optim

    for path in Path(optim.__file__).parent.glob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            for name in names:
                assert not name.startswith(("amp_patch.session", "amp_patch.patching",
                                            "amp_patch.frontend.lifecycle", "amp_patch.frontend.loss_scaling")), (path, name)


class _StepInputsSGD(torch.optim.Optimizer):
    """A stand-in for a third-party optimizer that takes amp's step inputs (``fused_step_inputs``):
    plain SGD that reads each grad from the inputs, times their inverse scale, and writes the
    model copy itself."""

    def __init__(self, params, lr):
        super().__init__(params, dict(lr=lr))
        self.inputs = None
        self.seen = []

    @contextlib.contextmanager
    def fused_step_inputs(self, inputs):
        self.inputs = inputs
        try:
            yield inputs
        finally:
            self.inputs = None

    @torch.no_grad()
    def step(self, closure=None):
        inputs = self.inputs
        self.seen.append(inputs)
        for group in self.param_groups:
            for p in group["params"]:
                grad = inputs.grads.get(p) if inputs.grads is not None else None
                grad = p.grad if grad is None else grad.float() * inputs.inv_scale
                if grad is not None:
                    p.add_(grad, alpha=-group["lr"])
                    if p in inputs.model_params:
                        inputs.model_params[p].copy_(p)


@pytest.mark.parametrize("clip", [False, True], ids=["one-pass", "materialized"])
def test_optimizer_that_takes_step_inputs_writes_the_model_itself(monkeypatch, clip):
    from amp_patch import ops

    def run(cls, calls=None):
        model = mlp()
        opt = cls(model.parameters(), lr=0.1)
        amp.initialize(model, opt, opt_level="O2", loss_scale="dynamic", verbosity=0)
        for step in range(3):
            x, y = mlp_batch(step)
            with amp.scale_loss(xent(model(x), y), opt) as scaled:
                scaled.backward()
            if clip:
                torch.nn.utils.clip_grad_norm_(amp.master_params(opt), 1e9)
            opt.step()
            opt.zero_grad()
        out = [p.detach().clone() for p in model.parameters()]
        masters = list(amp.master_params(opt))
        amp.deinitialize()
        return model, opt, masters, out

    _, _, _, ref = run(lambda params, lr: torch.optim.SGD(params, lr=lr, foreach=False))
    calls = []
    for name in ("multi_tensor_copy_", "multi_tensor_unscale_copy_"):
        real = getattr(ops, name)
        monkeypatch.setattr(ops, name, lambda *a, _n=name, _r=real: (calls.append(_n), _r(*a)))
    model, opt, masters, got = run(_StepInputsSGD)
    assert all(torch.equal(a, b) for a, b in zip(ref, got))
    # The optimizer wrote the model: no copy. The one-pass step read the half grads itself:
    # no unscale into master grads, unless clipping asked for them.
    assert calls == (["multi_tensor_unscale_copy_"] * 3 if clip else [])
    assert len(opt.seen) == 3
    for inputs in opt.seen:
        assert list(inputs.model_params) == masters
        assert list(inputs.model_params.values()) == list(model.parameters())
        assert (inputs.grads is None) == clip


@pytest.mark.parametrize("first, second", [("O2", "O0"), ("O3", "O0"), ("O0", "O3")])
def test_reused_optimizer_state_follows_the_params_new_dtype(first, second):
    """Found by the stress test: a second session casts the model, and the state an earlier
    session left behind must follow, as Apex's state-dict round trip made it."""
    model = mlp()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    amp.initialize(model, opt, opt_level=first, verbosity=0)
    train(model, opt, 2)
    amp.deinitialize()
    amp.initialize(model, opt, opt_level=second, verbosity=0)
    losses = train(model, opt, 2, start=2)
    assert all(v.dtype == p.dtype for p in amp.master_params(opt)
               for k, v in opt.state[p].items() if k != "step")
    assert all(loss == loss for loss in losses)
