"""Edge cases found in review: each once produced a silent wrong result or a spurious warning."""

from __future__ import annotations

import warnings

import pytest
import torch

import amp_patch as amp
from amp_patch.scaler import LossScaleCollapseError
from training_utils import mlp, mlp_batch, xent


@pytest.mark.parametrize("how", ["load_state_dict", "by_hand"])
def test_o2_weights_loaded_after_initialize_are_not_undone_by_step(how):
    model = mlp(seed=0)
    pretrained = {k: v.clone() for k, v in mlp(seed=1).state_dict().items()}
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    amp.initialize(model, opt, opt_level="O2", half_dtype=torch.bfloat16, verbosity=0)
    if how == "load_state_dict":  # fine-tuning: load after initialize
        model.load_state_dict(pretrained)
    else:  # written past amp's hooks: the masters follow the half params
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(pretrained[name])
    x, y = mlp_batch(0)
    with amp.scale_loss(xent(model(x), y), opt) as scaled:
        scaled.backward()
    opt.step()  # lr 0: the weights must stay the loaded ones
    for name, p in model.named_parameters():
        assert torch.equal(p, pretrained[name].to(p.dtype)), name
    for master, (name, p) in zip(amp.master_params(opt), model.named_parameters()):
        # a load hands the masters the checkpoint's exact fp32 values
        assert torch.equal(master, pretrained[name] if how == "load_state_dict" else p.float())


def _train(model, opt, steps):
    for step in range(steps):
        x, y = mlp_batch(step)
        with amp.scale_loss(xent(model(x), y), opt) as scaled:
            scaled.backward()
        opt.step()
        opt.zero_grad()


@pytest.mark.parametrize("optimizer", ["fused_adam", "sgd"])
def test_o2_weights_written_by_hand_between_steps_reach_the_masters(optimizer):
    """After steps that wrote the half params (the one-pass step writes them itself), a write
    from outside still reaches the masters before the next step."""
    from amp_patch.optimizers import FusedAdam

    model = mlp(seed=0)
    opt = (FusedAdam(model.parameters(), lr=0.01) if optimizer == "fused_adam"
           else torch.optim.SGD(model.parameters(), lr=0.01))
    amp.initialize(model, opt, opt_level="O2", half_dtype=torch.bfloat16, verbosity=0)
    _train(model, opt, steps=2)
    written = {name: p.detach().clone() + 1.0 for name, p in model.named_parameters()}
    with torch.no_grad():
        for name, p in list(model.named_parameters())[:2]:  # some params only
            p.copy_(written[name])
    for group in opt.param_groups:
        group["lr"] = 0.0
    opt.step()  # no grads, lr 0: nothing moves, and the masters hold the written values
    for master, (name, p) in zip(amp.master_params(opt), model.named_parameters()):
        assert torch.equal(master.to(p.dtype), p), name
    for master, (name, _) in list(zip(amp.master_params(opt), model.named_parameters()))[:2]:
        assert torch.equal(master, written[name].float()), name


def test_o2_consistent_checkpoint_keeps_exact_fp32_masters():
    model = mlp(seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    amp.initialize(model, opt, opt_level="O2", half_dtype=torch.bfloat16, verbosity=0)
    _train(model, opt, steps=3)
    masters = [m.detach().clone() for m in amp.master_params(opt)]
    model.load_state_dict(model.state_dict())  # bumps versions, same values
    opt.step()  # no grads: nothing moves, and masters keep their fp32 bits
    for before, after in zip(masters, amp.master_params(opt)):
        assert torch.equal(before, after)


@pytest.mark.parametrize("op", ["mm", "add", "exp"])
def test_o1_out_argument_receives_the_result(op):
    amp.initialize(mlp(), opt_level="O1", half_dtype=torch.bfloat16, verbosity=0)
    a, b = torch.randn(3, 3), torch.randn(3, 3)
    if op == "mm":
        out = torch.zeros(3, 3, dtype=torch.bfloat16)  # mm runs in bf16 under O1
        result = torch.mm(a, b, out=out)
        expected = torch.mm(a.bfloat16(), b.bfloat16())
    elif op == "add":
        out = torch.zeros(3, 3, dtype=torch.bfloat16)
        result = torch.add(a, b.bfloat16(), out=out)  # promoted to fp32, stored in bf16
        expected = (a + b.bfloat16().float()).bfloat16()
    else:
        out = torch.zeros(3, 3, dtype=torch.bfloat16)
        result = torch.exp(a.bfloat16(), out=out)  # fp32 op, stored in bf16
        expected = torch.exp(a.bfloat16().float()).bfloat16()
    assert result is out
    assert torch.equal(out, expected)


def test_o1_out_of_a_dtype_the_op_cannot_write_is_an_error_not_a_silent_copy():
    amp.initialize(mlp(), opt_level="O1", half_dtype=torch.bfloat16, verbosity=0)
    with pytest.raises(RuntimeError, match="out"):
        torch.mm(torch.randn(2, 2), torch.randn(2, 2), out=torch.zeros(2, 2))


def test_exception_after_backward_leaves_no_scaled_grads():
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    amp.initialize(model, opt, opt_level="O1", loss_scale=1024.0, verbosity=0)
    x, y = mlp_batch(0)
    with pytest.raises(ValueError):
        with amp.scale_loss(xent(model(x), y), opt) as scaled:
            scaled.backward()
            raise ValueError("user code failed after backward")
    assert all(p.grad is None for p in model.parameters())
    with amp.scale_loss(xent(model(x), y), opt) as scaled:
        scaled.backward()
    ref = mlp()
    xent(ref(x), y).backward()
    for p, r in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, r.grad)


def test_cast_model_outputs_applies_without_model_casting():
    model = mlp()
    amp.initialize(model, opt_level="O1", half_dtype=torch.bfloat16,
                   cast_model_outputs=torch.float32, verbosity=0)
    assert model(torch.randn(2, 8)).dtype == torch.float32
    amp.deinitialize()
    model = mlp()
    amp.initialize(model, opt_level="O2", cast_model_type=False,
                   cast_model_outputs=torch.bfloat16, verbosity=0)
    assert model(torch.randn(2, 8)).dtype == torch.bfloat16


def test_explicit_fp16_cast_model_type_means_fp16_half_and_dynamic_scale():
    model = mlp()
    amp.initialize(model, opt_level="O2", cast_model_type=torch.float16, verbosity=0)
    state = amp.state_dict()["loss_scaler0"]
    assert next(model.parameters()).dtype == torch.float16
    assert state["loss_scale"] == 2.0**16


@pytest.mark.parametrize("scheduler_first", [True, False])
def test_skipped_first_step_raises_no_scheduler_warning(scheduler_first):
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    if scheduler_first:
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1)
    amp.initialize(model, opt, opt_level="O2", half_dtype=torch.bfloat16,
                   loss_scale="dynamic", verbosity=0)
    if not scheduler_first:
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1)
    x, y = mlp_batch(0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with amp.scale_loss(xent(model(x), y) * float("inf"), opt) as scaled:
            scaled.backward()
        opt.step()  # skipped: overflow
        sched.step()


def test_collapse_error_still_skips_the_step():
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    amp.initialize(model, opt, opt_level="O1", loss_scale="dynamic", min_loss_scale=2.0**15,
                   sync_free=False, verbosity=0)
    before = [p.detach().clone() for p in model.parameters()]
    x, y = mlp_batch(0)
    with pytest.raises(LossScaleCollapseError):
        for _ in range(4):  # 2**16 -> 2**15 (floor), then the collapse
            with amp.scale_loss(xent(model(x), y) * float("nan"), opt) as scaled:
                scaled.backward()
            opt.step()
            opt.zero_grad()
    opt.step()  # a caller that caught the error and went on
    for b, p in zip(before, model.parameters()):
        assert torch.equal(b, p)


def test_o1_eval_forward_sees_weights_edited_through_data():
    """EMA/SWA-style weight swaps via param.data between no_grad forwards take effect."""
    model = mlp()
    amp.initialize(model, opt_level="O1", half_dtype=torch.bfloat16, verbosity=0)
    x = torch.randn(2, 8)
    with torch.no_grad():
        model(x)
        for p in model.parameters():
            p.data.zero_()
        assert not model(x).any()


def test_o1_eval_forward_casts_each_weight_once():
    from amp_patch import session as amp_session

    shared = torch.nn.Linear(8, 8)
    model = torch.nn.Sequential(shared, shared, shared)  # tied weights
    amp.initialize(model, opt_level="O1", half_dtype=torch.bfloat16, verbosity=0)
    cache = amp_session.current().casts.cache
    with torch.no_grad():
        model(torch.randn(2, 8))
        assert cache.casts == 2  # weight and bias, once for three uses
        model(torch.randn(2, 8))
        assert cache.casts == 4  # a new forward casts afresh


def test_deinitialize_frees_the_session_when_a_scheduler_wrapped_step_after_initialize():
    import gc
    import weakref

    from amp_patch import session as amp_session

    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    amp.initialize(model, opt, opt_level="O2", half_dtype=torch.bfloat16, verbosity=0)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1)  # wraps our step
    ref = weakref.ref(amp_session.current())
    amp.deinitialize()
    gc.collect()
    assert ref() is None
    opt.step()  # the inactive wrapper passes straight through
    sched.step()


@pytest.mark.parametrize("half", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_wrapper_kept_past_its_session_passes_calls_through(half):
    """Code that took an O1 wrapper during a session keeps it after deinitialize (torch's
    inductor keeps ``torch.mm`` as it was when first imported): it then calls the function it
    wraps untouched, and a disable_casts block does not turn it back on."""
    model = mlp()
    amp.initialize(model, opt_level="O1", half_dtype=half, verbosity=0)
    kept = torch.mm
    a = torch.ones(2, 2)
    assert kept(a, a).dtype == half
    amp.deinitialize()
    assert kept is not torch.mm
    assert kept(a, a).dtype == torch.float32
    amp.initialize(mlp(), opt_level="O1", half_dtype=half, verbosity=0)
    with amp.disable_casts():
        pass
    assert kept(a, a).dtype == torch.float32  # the old session's wrapper stays off
    assert torch.mm(a, a).dtype == half
