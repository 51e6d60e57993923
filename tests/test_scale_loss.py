"""scale_loss: what it yields, the fused passes it makes, its flags, its errors, its host syncs."""

from __future__ import annotations

import logging

import pytest
import torch

import amp_patch as amp
from amp_patch import ops
from training_utils import count_host_syncs, mlp, mlp_batch, xent

FUSED = ("multi_tensor_unscale_", "multi_tensor_unscale_copy_", "multi_tensor_axpby_",
         "multi_tensor_copy_")


@pytest.fixture
def op_calls(monkeypatch):
    calls: list[tuple[str, int]] = []
    for name in FUSED:
        orig = getattr(ops, name)
        monkeypatch.setattr(ops, name,
                            lambda *a, _n=name, _o=orig: (calls.append((_n, len(a[0]))), _o(*a))[1])
    return calls


def one_backward(model, opt, **kw):
    x, y = mlp_batch(0)
    loss = xent(model(x), y)
    with amp.scale_loss(loss, opt, **kw) as scaled:
        scaled.backward()
    return loss, scaled


def test_errors_before_initialize_bad_loss_id_foreign_optimizer():
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(RuntimeError, match="initialize"):
        with amp.scale_loss(torch.tensor(1.0), opt):
            pass
    amp.initialize(model, opt, opt_level="O2", num_losses=2, verbosity=0)
    for bad in (2, -1, "0"):
        with pytest.raises(RuntimeError, match="loss_id"):
            with amp.scale_loss(torch.tensor(1.0), opt, loss_id=bad):
                pass
    other = torch.optim.SGD(mlp().parameters(), lr=0.1)
    with pytest.raises(RuntimeError, match="not passed to amp_patch.initialize"):
        with amp.scale_loss(torch.tensor(1.0), [opt, other]):
            pass
    with pytest.raises(TypeError):
        with amp.scale_loss(torch.tensor(1.0), "opt"):
            pass


def test_disabled_yields_loss_untouched():
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    amp.initialize(model, opt, opt_level="O2", enabled=False, verbosity=0)
    loss = torch.tensor(2.0, dtype=torch.float64)
    with amp.scale_loss(loss, opt) as scaled:
        assert scaled is loss


@pytest.mark.parametrize("level", ["O0", "O3", "O1"])
def test_fast_path_makes_no_pass(level, op_calls):
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    amp.initialize(model, opt, opt_level=level, verbosity=0)  # bf16: static 1.0, no masters
    _, scaled = one_backward(model, opt)
    assert op_calls == [] and scaled.dtype == torch.float32
    grads = [p.grad.clone() for p in model.parameters()]
    grads[0][0] = float("inf")  # the fast path checks nothing, as plain torch
    opt.step()


def test_yields_scaled_float_loss_and_unscales():
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref = mlp()
    amp.initialize(model, opt, opt_level="O0", loss_scale=1024.0, verbosity=0)
    loss, scaled = one_backward(model, opt)
    assert scaled.dtype == torch.float32
    assert torch.equal(scaled.detach(), loss.float().detach() * 1024.0)
    amp.deinitialize()
    x, y = mlp_batch(0)
    xent(ref(x), y).backward()
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p.grad, q.grad)  # a power-of-two scale round-trips exactly


def test_o2_one_fused_call_per_group(op_calls):
    model = torch.nn.Sequential(mlp(), torch.nn.LayerNorm(4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    amp.initialize(model, opt, opt_level="O2", verbosity=0)
    model[1].float()  # an fp32 param stepped directly, next to the bf16 ones with masters
    opt.param_groups[0]["params"][-2:] = list(model[1].parameters())
    one_backward(model, opt)
    assert sorted(op_calls) == [("multi_tensor_unscale_", 2), ("multi_tensor_unscale_copy_", 4)]
    op_calls.clear()
    opt.step()
    assert op_calls == [("multi_tensor_copy_", 4)]


def test_delay_unscale_leaves_grads_scaled_then_accumulates(op_calls):
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    amp.initialize(model, opt, opt_level="O2", loss_scale="dynamic", verbosity=0)
    one_backward(model, opt, delay_unscale=True)
    assert op_calls == []
    assert all(p.grad is None for p in amp.master_params(opt))
    first = [p.grad.float() for p in model.parameters()]
    one_backward(model, opt)  # accumulates onto the scaled grads, then unscales all
    assert [n for n, _ in op_calls] == ["multi_tensor_unscale_copy_"]
    for g, master in zip(first, amp.master_params(opt)):
        torch.testing.assert_close(master.grad, 2 * g / 2.0**16, rtol=0.02, atol=1e-6)


@pytest.mark.parametrize("sync_free, second", [
    (False, "multi_tensor_axpby_"),  # the host knows the scale: axpby takes 1 / scale
    (True, "multi_tensor_unscale_copy_"),  # it does not: a temporary by the device's inv_scale
])
def test_second_unscale_accumulates(op_calls, sync_free, second):
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    amp.initialize(model, opt, opt_level="O2", loss_scale="dynamic", sync_free=sync_free,
                   verbosity=0)
    one_backward(model, opt)
    first = [p.grad.clone() for p in amp.master_params(opt)]
    one_backward(model, opt)
    assert [n for n, _ in op_calls] == ["multi_tensor_unscale_copy_", second]
    for g, master in zip(first, amp.master_params(opt)):
        torch.testing.assert_close(master.grad, 2 * g)


def test_two_losses_one_optimizer_without_masters_do_not_mix_scales():
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    amp.initialize(model, opt, opt_level="O1", loss_scale="dynamic", num_losses=2, verbosity=0)
    session = amp.session.current()
    session.scalers[1].load_state_dict({"loss_scale": 8.0, "unskipped": 0})
    x, y = mlp_batch(0)
    with amp.scale_loss(xent(model(x), y), opt, loss_id=0) as s:
        s.backward()
    g0 = [p.grad.clone() for p in model.parameters()]
    with amp.scale_loss(xent(model(x), y), opt, loss_id=1) as s:
        s.backward()
    for g, p in zip(g0, model.parameters()):
        torch.testing.assert_close(p.grad, 2 * g, rtol=0.02, atol=1e-5)


def test_delay_overflow_check_unscales_without_update_or_skip():
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    amp.initialize(model, opt, opt_level="O2", loss_scale="dynamic", verbosity=0)
    scaler = amp.session.current().scalers[0]
    x, y = mlp_batch(0)
    with amp.scale_loss(xent(model(x), y), opt, delay_overflow_check=True) as s:
        s.backward()
        model[0].weight.grad[0, 0] = float("inf")
    assert all(p.grad is not None for p in amp.master_params(opt))
    assert scaler.loss_scale == 2.0**16 and scaler.state_dict()["unskipped"] == 0
    before = [p.clone() for p in model.parameters()]
    opt.step()  # not skipped: the check was delayed
    assert not torch.equal(before[1], model[0].bias)
    opt.zero_grad()
    one_backward(model, opt)  # the raised flag is read by the next checking exit
    assert scaler.loss_scale == 2.0**15


def test_overflow_message_logged(caplog):
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    # Read at the exit itself; sync-free, it comes at the next host read (tests/test_sync_free.py).
    amp.initialize(model, opt, opt_level="O2", loss_scale="dynamic", sync_free=False,
                   verbosity=1)
    x, y = mlp_batch(0)
    with caplog.at_level(logging.INFO, logger="amp_patch"):
        with amp.scale_loss(xent(model(x), y) * float("nan"), opt) as s:
            s.backward()
    assert "Gradient overflow.  Skipping step, loss scaler 0 reducing loss scale to 32768.0" in [
        r.getMessage() for r in caplog.records]


_BYPASS = "backward ran outside scale_loss"


@pytest.mark.parametrize("make_opt", [
    lambda params: torch.optim.AdamW(params, lr=0.1),
    lambda params: amp.optimizers.FusedAdam(params, lr=0.1),
], ids=["AdamW", "FusedAdam"])
@pytest.mark.parametrize("set_to_none", [True, False])
def test_o2_backward_outside_scale_loss_is_warned_once(caplog, make_opt, set_to_none):
    """Under master weights a plain backward's grads never reach the masters: the step changes
    nothing (Apex's behaviour), and says so once. Zeros left by zero_grad are not grads."""
    import amp_patch.optimizers  # noqa: F401  (amp.optimizers)
    model = mlp()
    opt = make_opt(model.parameters())
    amp.initialize(model, opt, opt_level="O2", half_dtype=torch.bfloat16, verbosity=0)
    x, y = mlp_batch(0)
    with caplog.at_level(logging.WARNING, logger="amp_patch"):
        with amp.scale_loss(xent(model(x), y), opt) as scaled:
            scaled.backward()
        opt.step()
        opt.zero_grad(set_to_none=set_to_none)
        opt.step()  # no backward since: nothing to say (zeros, or no grads)
        assert not [r for r in caplog.records if _BYPASS in r.getMessage()]
        before = [p.detach().clone() for p in model.parameters()]
        for _ in range(2):
            opt.zero_grad(set_to_none=set_to_none)
            xent(model(x), y).backward()
            opt.step()
        assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    warned = [r for r in caplog.records if _BYPASS in r.getMessage()]
    assert len(warned) == 1 and type(opt).__name__ in warned[0].getMessage()


def test_o2_no_bypass_warning_in_a_normal_loop(caplog):
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    amp.initialize(model, opt, opt_level="O2", verbosity=0)
    with caplog.at_level(logging.WARNING, logger="amp_patch"):
        for i in range(3):
            if i:  # the first step comes straight after initialize
                opt.zero_grad(set_to_none=i % 2 == 0)
            one_backward(model, opt)
            opt.step()
            opt.step()  # a second step over the consumed grads
    assert not [r for r in caplog.records if _BYPASS in r.getMessage()]


def test_o1_cache_cleared_on_entry_and_exit():
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    amp.initialize(model, opt, opt_level="O1", verbosity=0)
    session = amp.session.current()
    cleared = []
    orig = session.casts.cache.clear
    session.casts.cache.clear = lambda: (cleared.append(1), orig())[1]
    one_backward(model, opt)
    one_backward(model, opt, delay_unscale=True)
    assert cleared == [1, 1, 1, 1]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_exactly_one_host_sync_per_iteration_o2_dynamic(dtype):
    model = mlp(d_in=4, hidden=4, d_out=2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    amp.initialize(model, opt, opt_level="O2", half_dtype=dtype, loss_scale="dynamic", verbosity=0)
    x, y = torch.randn(4, 4), torch.tensor([0, 1, 0, 1])
    for _ in range(3):
        with count_host_syncs() as syncs:
            loss = xent(model(x), y)
            with amp.scale_loss(loss, opt) as scaled:
                scaled.backward()
            opt.step()
            opt.zero_grad()
        assert syncs["n"] == 1


def _bad_initialize_cases():
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    two_devices = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2, device="meta"))
    return [
        ((model, opt), dict(opt_level="o2"), ValueError, "letter O"),
        ((torch.nn.DataParallel(model), opt), {}, TypeError, "after"),
        (((model,), opt), {}, TypeError, "tuple"),
        ((model, [opt, opt]), {}, ValueError, "twice"),
        ((two_devices,), {}, ValueError, "more than one device"),
        ((model, opt), dict(opt_level="O1", master_weights=True), ValueError, "master_weights"),
        ((model, opt), dict(opt_level="O2", loss_scale="big"), ValueError, "loss_scale"),
    ]


@pytest.mark.parametrize("case", range(7))
def test_initialize_bad_input_is_a_clear_error(case):
    args, kw, exc, match = _bad_initialize_cases()[case]
    with pytest.raises(exc, match=match):
        amp.initialize(*args, verbosity=0, **kw)
    amp.initialize(mlp(), verbosity=0)  # nothing was left half-built


def test_initialize_twice_needs_deinitialize():
    amp.initialize(mlp(), opt_level="O2", verbosity=0)
    with pytest.raises(RuntimeError, match="deinitialize"):
        amp.initialize(mlp(), opt_level="O2", verbosity=0)


def test_exception_inside_scale_loss_then_deinitialize_leaves_torch_clean():
    original_mm, original_linear = torch.mm, torch.nn.functional.linear
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    amp.initialize(model, opt, opt_level="O1", loss_scale="dynamic", verbosity=0)
    x, y = mlp_batch(0)
    with pytest.raises(ZeroDivisionError):
        with amp.scale_loss(xent(model(x), y), opt) as scaled:
            scaled.backward()
            1 / 0
    amp.deinitialize()
    assert torch.mm is original_mm and torch.nn.functional.linear is original_linear
    assert "step" not in opt.__dict__


@pytest.mark.parametrize("level", ["O0", "O1", "O2", "O3"])
def test_nested_scale_loss_is_a_clear_error_and_leaves_nothing_behind(level):
    def run(nest):
        model = mlp()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        amp.initialize(model, opt, opt_level=level, loss_scale="dynamic", num_losses=2,
                       verbosity=0)
        x, y = mlp_batch(0)
        if nest:
            with pytest.raises(RuntimeError, match="nested"):
                with amp.scale_loss(xent(model(x), y), opt) as outer:
                    outer.backward()
                    with amp.scale_loss(xent(model(x), y), opt, loss_id=1) as inner:
                        inner.backward()
            assert all(p.grad is None for p in amp.master_params(opt))
        one_backward(model, opt)
        opt.step()
        out = [p.detach().clone() for p in model.parameters()]
        amp.deinitialize()
        return out

    ref, got = run(False), run(True)
    assert all(torch.equal(a, b) for a, b in zip(ref, got))


def test_nested_scale_loss_is_an_error_on_the_fast_path_too():
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    amp.initialize(model, opt, opt_level="O3", verbosity=0)  # bf16: static 1.0, no masters
    x, y = mlp_batch(0)
    with pytest.raises(RuntimeError, match="nested"):
        with amp.scale_loss(xent(model(x), y), opt):
            with amp.scale_loss(xent(model(x), y), opt):
                pass
    one_backward(model, opt)  # the session is usable again


def _inf_loss_finite_grads(model, x, y):
    """A loss that is inf while every grad stays finite: only the loss's own check sees it."""
    return xent(model(x), y) + torch.tensor(float("inf"))


@pytest.mark.parametrize("level,optimizer", [
    ("O2", "fused_adam"),  # the one-pass step: the loss is checked with the grads' norm
    ("O2", "sgd"),         # the unscale passes, then the loss on its own
    ("O1", "sgd"),
], ids=lambda v: v)
@pytest.mark.parametrize("half", [torch.float16, torch.bfloat16], ids=str)
def test_a_nonfinite_loss_skips_the_step_whatever_checks_the_grads(level, optimizer, half):
    from amp_patch.optimizers import FusedAdam

    model = mlp()
    opt = (FusedAdam(model.parameters(), lr=0.1) if optimizer == "fused_adam"
           else torch.optim.SGD(model.parameters(), lr=0.1))
    model, opt = amp.initialize(model, opt, opt_level=level, half_dtype=half,
                                loss_scale=1.0 if half == torch.bfloat16 else "dynamic",
                                verbosity=0)
    if half == torch.bfloat16 and level == "O1":
        pytest.skip("O1 with a static scale of 1.0 and no masters checks nothing (the fast path)")
    x, y = mlp_batch(0)
    before = [p.detach().clone() for p in model.parameters()]
    with amp.scale_loss(_inf_loss_finite_grads(model, x, y), opt) as s:
        s.backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    opt.step()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert amp.session.current().scalers[0].skipped_steps == 1


@pytest.mark.parametrize("exit_kind", ["delay_unscale", "delay_overflow_check", "exception"])
def test_a_nonfinite_loss_stays_flagged_past_an_exit_that_does_not_update(exit_kind):
    """The loss is checked on every way out of the block; an exit that does not update leaves
    the flag raised for the next one that does."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O2", loss_scale="dynamic", verbosity=0)
    scaler = amp.session.current().scalers[0]
    x, y = mlp_batch(0)
    if exit_kind == "exception":
        with pytest.raises(KeyError):
            with amp.scale_loss(_inf_loss_finite_grads(model, x, y), opt) as s:
                raise KeyError("before backward")
    else:
        with amp.scale_loss(_inf_loss_finite_grads(model, x, y), opt, **{exit_kind: True}) as s:
            s.backward()
    assert scaler.loss_scale == 2.0**16
    opt.zero_grad()
    one_backward(model, opt)  # finite, but the raised flag is read here
    assert scaler.loss_scale == 2.0**15 and scaler.skipped_steps == 1
