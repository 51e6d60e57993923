"""What the fused optimizers, and amp's patched methods of torch's optimizers, do in place of
``torch.optim.Optimizer``'s own machinery.

Their ``step()`` entry (``amp_patch.optim.fused.step_entry``) stands in for
torch's ``profile_hook_step`` wrapper, their ``zero_grad`` skips torch's
``record_function`` outside a profiler, and their ``__getstate__`` keeps the
settings that torch's drops. Every test holds them to what torch's own
optimizers do: the hooks, their order and their power to change the
arguments, the profiler's labels, grad mode, and copies that step the same.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)

from amp_patch.optim.fused import (
    FusedAdagrad,
    FusedAdam,
    FusedLAMB,
    FusedNovoGrad,
    FusedSGD,
)

OPTIMIZERS = [FusedAdam, FusedSGD, FusedLAMB, FusedNovoGrad, FusedAdagrad]


def _param():
    p = torch.nn.Parameter(torch.arange(4.0))
    p.grad = torch.full((4,), 0.5)
    return p


def _amp_sgd(params):
    """torch's SGD as amp's O1 patched it: its step reaches torch's body through amp's entry."""
    import amp_patch as amp

    params = list(params)
    model = torch.nn.Module()
    model.params = torch.nn.ParameterList(params)  # amp warns of params no model passed holds
    opt = torch.optim.SGD(params, lr=0.1)
    amp.initialize(model, opt, opt_level="O1", half_dtype=torch.bfloat16, verbosity=0)
    return opt


def _hook_order(opt):
    calls = []
    handles = [
        register_optimizer_step_pre_hook(lambda o, a, k: calls.append(("global pre", o))),
        opt.register_step_pre_hook(lambda o, a, k: calls.append(("pre", o))),
        opt.register_step_post_hook(lambda o, a, k: calls.append(("post", o))),
        register_optimizer_step_post_hook(lambda o, a, k: calls.append(("global post", o))),
    ]
    try:
        opt.step()
    finally:
        for h in handles:
            h.remove()
    return [(name, o is opt) for name, o in calls]


@pytest.mark.parametrize("cls", [*OPTIMIZERS, "amp-torch"],
                         ids=lambda c: getattr(c, "__name__", c))
def test_the_hooks_run_once_each_in_torchs_order(cls):
    """A subclass's own step (FusedAdam's, FusedSGD's) calls the base's: the hooks still run
    once, in the order torch's own optimizers run them; so does torch's step under amp."""
    ours = _hook_order(_amp_sgd([_param()]) if cls == "amp-torch" else cls([_param()], lr=0.1))
    theirs = _hook_order(torch.optim.SGD([_param()], lr=0.1))
    assert ours == theirs == [("global pre", True), ("pre", True), ("post", True),
                              ("global post", True)]


def test_torch_does_not_wrap_the_entry_again():
    opt = FusedAdam([_param()])
    assert type(opt).step.hooked
    assert type(opt).step is FusedAdam.step  # torch's Optimizer.__init__ left it alone


#: The step entries held to torch's own: torch's SGD, a fused one, and torch's under amp.
ENTRIES = {
    "torch": lambda ps: torch.optim.SGD(ps, lr=0.1),
    "fused": lambda ps: FusedSGD(ps, lr=0.1),
    "amp-torch": _amp_sgd,
}


@pytest.mark.parametrize("entry", list(ENTRIES))
def test_the_hooks_get_the_arguments_as_torch_hands_them(entry):
    """torch calls ``hook(opt, args, kwargs)`` with the optimizer first in ``args``."""
    opt = ENTRIES[entry]([_param()])
    seen = []
    opt.register_step_pre_hook(lambda o, args, kwargs: seen.append(("pre", args, kwargs)))
    opt.register_step_post_hook(lambda o, args, kwargs: seen.append(("post", args, kwargs)))
    opt.step(closure=None)
    assert seen == [("pre", (opt,), {"closure": None}), ("post", (opt,), {"closure": None})]


@pytest.mark.parametrize("entry", list(ENTRIES))
def test_a_pre_hook_may_replace_the_arguments(entry):
    opt = ENTRIES[entry]([_param()])
    closure_calls = []

    def closure():
        closure_calls.append(torch.is_grad_enabled())
        return torch.tensor(3.0)

    opt.register_step_pre_hook(lambda o, args, kwargs: ((o,), {"closure": closure}))
    assert opt.step().item() == 3.0
    assert closure_calls == [True]  # the closure runs with grad mode on


def test_a_pre_hook_returning_something_else_is_an_error():
    opt = FusedAdam([_param()])
    opt.register_step_pre_hook(lambda o, args, kwargs: "new args")
    with pytest.raises(RuntimeError, match="must return None or a tuple"):
        opt.step()


def test_the_body_runs_without_grad_and_grad_mode_comes_back():
    seen = []

    class Watching(FusedSGD):
        def _fused_step(self):
            seen.append(torch.is_grad_enabled())
            super()._fused_step()

    opt = Watching([_param()], lr=0.1)
    opt.step()
    assert seen == [False] and torch.is_grad_enabled()
    with torch.no_grad():
        opt.step()
        assert not torch.is_grad_enabled()
    assert seen == [False, False] and torch.is_grad_enabled()


def test_an_error_in_the_step_restores_grad_mode():
    class Failing(FusedSGD):
        def _fused_step(self):
            raise ValueError("inside the step")

    with pytest.raises(ValueError, match="inside the step"):
        Failing([_param()], lr=0.1).step()
    assert torch.is_grad_enabled()


def test_a_subclass_step_gets_the_entry_too():
    calls = []

    class Counting(FusedAdam):
        def step(self, closure=None):
            calls.append("subclass body")
            return super().step(closure)

    opt = Counting([_param()])
    opt.register_step_pre_hook(lambda o, a, k: calls.append("pre"))
    opt.step()
    assert calls == ["pre", "subclass body"]
    assert Counting.step.hooked


@pytest.mark.parametrize("make", [FusedAdam, FusedSGD, _amp_sgd],
                         ids=["FusedAdam", "FusedSGD", "amp-torch-SGD"])
def test_a_profiler_sees_the_step_label(make):
    opt = make([_param()], lr=0.1) if make is not _amp_sgd else make([_param()])
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        opt.step()
    names = [e.name for e in prof.events()]
    assert names.count(f"Optimizer.step#{type(opt).__name__}.step") == 1
    param = opt.param_groups[0]["params"][0]
    before = param.detach().clone()
    opt.step()  # and without a profiler the step still runs, unlabelled
    assert not torch.equal(param.detach(), before)


def test_the_step_changes_the_params_as_before():
    """The entry only wraps: the same bits as calling the body with grad mode off."""
    a, b = _param(), _param()
    FusedAdam([a], lr=0.1).step()
    body_only = FusedAdam([b], lr=0.1)
    with torch.no_grad():
        FusedAdam.step.__wrapped__(body_only)
    assert torch.equal(a, b)


@pytest.mark.parametrize("make", [FusedAdam, _amp_sgd], ids=["FusedAdam", "amp-torch-SGD"])
@pytest.mark.parametrize("set_to_none", [True, False])
def test_zero_grad_clears_as_torchs_and_is_labelled_only_under_a_profiler(set_to_none, make):
    p, q = _param(), torch.nn.Parameter(torch.ones(3))  # q has no grad
    opt = make([p, q])
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        opt.zero_grad(set_to_none=set_to_none)
    label = f"Optimizer.zero_grad#{type(opt).__name__}.zero_grad"
    assert [e.name for e in prof.events()].count(label) == 1
    assert (p.grad is None) if set_to_none else torch.equal(p.grad, torch.zeros(4))
    assert q.grad is None
    p.grad = torch.ones(4)
    opt.zero_grad(set_to_none=set_to_none)  # no profiler: the plain loop when set to None
    assert (p.grad is None) if set_to_none else torch.equal(p.grad, torch.zeros(4))


COPIED = {
    "adam": lambda ps: FusedAdam(ps, lr=1e-2, adam_w_mode=False, weight_decay=0.1),
    "adam-int8": lambda ps: FusedAdam(ps, lr=1e-2, state_format="int8"),
    "sgd": lambda ps: FusedSGD(ps, lr=1e-2, momentum=0.9, wd_after_momentum=True),
    "lamb": lambda ps: FusedLAMB(ps, lr=1e-2, use_nvlamb=True),
    "novograd": lambda ps: FusedNovoGrad(ps, lr=1e-2, reg_inside_moment=True),
    "adagrad": lambda ps: FusedAdagrad(ps, lr=1e-2, adagrad_w_mode=True),
}


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
@pytest.mark.parametrize("name", list(COPIED))
def test_a_copied_optimizer_keeps_its_settings_and_steps_the_same(name, how):
    """torch's own __getstate__ keeps only defaults, state and param_groups; a fused
    optimizer's settings (Adam's mode, the state format...) must survive a copy too."""
    import copy
    import pickle

    def params():
        gen = torch.Generator().manual_seed(0)
        return [torch.nn.Parameter(torch.randn(64, 8, generator=gen)) for _ in range(2)]

    def grads(step):
        gen = torch.Generator().manual_seed(100 + step)
        return [torch.randn(64, 8, generator=gen) for _ in range(2)]

    opt = COPIED[name](params())
    opt.register_step_pre_hook(lambda *_: None)  # hooks are not carried, as torch's are not
    for g, p in zip(grads(0), opt.param_groups[0]["params"]):
        p.grad = g
    opt.step()
    twin = copy.deepcopy(opt) if how == "deepcopy" else pickle.loads(pickle.dumps(opt))
    own = {k: v for k, v in vars(opt).items()
           if not k.startswith("_") and k not in ("defaults", "state", "param_groups")}
    assert own  # the settings torch's own __getstate__ drops
    assert {k: getattr(twin, k) for k in own} == own
    assert not twin._optimizer_step_pre_hooks
    for step in (1, 2):
        for o in (opt, twin):
            for g, p in zip(grads(step), o.param_groups[0]["params"]):
                p.grad = g
            o.step()
    for a, b in zip(opt.param_groups[0]["params"], twin.param_groups[0]["params"]):
        assert torch.equal(a, b)


class _LabelOps(TorchDispatchMode):
    """Counts the ``record_function`` ops (a label opened) that reach the dispatcher."""

    def __init__(self) -> None:
        super().__init__()
        self.labels = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ == "_record_function_enter_new":
            self.labels += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("scheduler", ["none", "before", "after"])
def test_amps_torch_step_opens_no_label_outside_a_profiler(scheduler):
    """amp's step and zero_grad of a torch optimizer run torch's body and loop unlabelled,
    also when an LR scheduler made after initialize binds the step again; one made before
    initialize put its own function on the instance, which is called as it is."""
    import amp_patch as amp

    model = torch.nn.Linear(4, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    made = []
    if scheduler == "before":
        made.append(torch.optim.lr_scheduler.StepLR(opt, step_size=1))
    amp.initialize(model, opt, opt_level="O1", half_dtype=torch.bfloat16, verbosity=0)
    if scheduler == "after":
        made.append(torch.optim.lr_scheduler.StepLR(opt, step_size=1))
    hooks = []
    opt.register_step_pre_hook(lambda o, args, kwargs: hooks.append(args[0] is o))
    model(torch.ones(3, 4)).sum().backward()
    counter = _LabelOps()
    with counter:
        opt.step()
        opt.zero_grad()
    assert hooks == [True]
    # torch's step wrapper, reached through the function a scheduler made before put on the
    # instance, opens its label; nothing else does.
    assert counter.labels == (1 if scheduler == "before" else 0)
    assert all(p.grad is None for p in model.parameters())
    for sched in made:
        sched.step()  # no "lr_scheduler.step() before optimizer.step()" warning: it saw the step


def _trained_o2(make, scheduler=None):
    """A Linear and its optimizer at O2 (bf16), a backward taken, ready to step."""
    import amp_patch as amp

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = make(model.parameters())
    made = torch.optim.lr_scheduler.StepLR(opt, step_size=1) if scheduler == "before" else None
    model, opt = amp.initialize(model, opt, opt_level="O2", half_dtype=torch.bfloat16,
                                verbosity=0)
    if scheduler == "after":
        made = torch.optim.lr_scheduler.StepLR(opt, step_size=1)
    with amp.scale_loss(model(torch.randn(2, 4)).float().sum(), opt) as scaled:
        scaled.backward()
    return model, opt, made


O2_OPTIMIZERS = {
    "SGD": lambda ps: torch.optim.SGD(ps, lr=0.1),
    "AdamW-fused": lambda ps: torch.optim.AdamW(ps, lr=0.1, fused=True),
    "FusedAdam": lambda ps: FusedAdam(ps, lr=0.1),
    "FusedSGD": lambda ps: FusedSGD(ps, lr=0.1),
}


@pytest.mark.parametrize("scheduler", [None, "before", "after"])
@pytest.mark.parametrize("name", list(O2_OPTIMIZERS))
def test_step_post_hooks_see_and_write_the_model_after_the_step(name, scheduler):
    """Without amp a post-hook (an EMA, a clamp) reads and writes the updated params; at O2
    the masters reach the model before any hook runs, and what a hook writes stays."""
    model, opt, _ = _trained_o2(O2_OPTIMIZERS[name], scheduler)
    before = model.weight.detach().clone()
    seen = []

    def clamp(o, args, kwargs):
        seen.append(model.weight.detach().clone())
        with torch.no_grad():
            model.weight.clamp_(-0.01, 0.01)

    opt.register_step_post_hook(clamp)
    opt.step()
    assert not torch.equal(seen[0], before)  # the hook saw the stepped weights
    clamped = model.weight.detach().clamp(-0.01, 0.01)  # in the weights' dtype, as the hook
    assert torch.equal(model.weight.detach(), clamped)  # and its write was not overwritten


@pytest.mark.parametrize("level", ["O0", "O1", "O2", "O3"])
@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_a_copy_of_a_fused_optimizer_under_amp_leaves_amp_behind(level, how):
    """torch's copy of an optimizer keeps defaults, state and param_groups; a fused one's
    keeps its settings too, but not what amp (or a scheduler) put on the instance: it
    pickles, and after deinitialize the copy may be passed to initialize."""
    import copy
    import pickle

    import amp_patch as amp

    model = torch.nn.Linear(4, 3)
    opt = FusedAdam(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level=level, half_dtype=torch.bfloat16,
                                verbosity=0)
    twin = copy.deepcopy(opt) if how == "deepcopy" else pickle.loads(pickle.dumps(opt))
    assert not [k for k in vars(twin) if k.startswith("_amp")]
    assert twin.adam_w_mode == opt.adam_w_mode
    amp.deinitialize()
    holder = torch.nn.Module()
    holder.params = torch.nn.ParameterList(twin.param_groups[0]["params"])
    amp.initialize(holder, twin, opt_level="O0", verbosity=0)


@pytest.mark.parametrize("level", [None, "O0", "O2"])
def test_add_param_group_stores_the_callers_dict_and_refuses_as_torch(level):
    import amp_patch as amp

    def made():
        model = torch.nn.Linear(4, 3)
        extra = torch.nn.Linear(2, 2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        if level is not None:
            amp.initialize([model, extra], opt, opt_level=level, half_dtype=torch.bfloat16,
                           verbosity=0)
        return extra, opt

    extra, opt = made()
    group = {"params": (p for p in extra.parameters())}  # a generator, read once
    opt.add_param_group(group)
    assert opt.param_groups[-1] is group and group["lr"] == 0.1  # torch fills in its defaults
    group["lr"] = 0.01  # and a later edit of the caller's dict is the optimizer's
    assert opt.param_groups[-1]["lr"] == 0.01
    with pytest.raises(TypeError, match="ordered collections"):
        opt.add_param_group({"params": {torch.nn.Parameter(torch.ones(1))}})
    with pytest.raises(KeyError):
        opt.add_param_group({"lr": 0.1})
    if level is not None:
        amp.deinitialize()


@pytest.mark.parametrize("make, key", [
    (lambda ps: torch.optim.AdamW(ps, lr=0.1), "exp_avg"),
    (lambda ps: FusedAdam(ps, lr=0.1), "exp_avg"),
    (lambda ps: FusedAdam(ps, lr=0.1), "exp_avg_sq"),
    (lambda ps: FusedSGD(ps, lr=0.1, momentum=0.9), "momentum_buffer"),
    (lambda ps: FusedNovoGrad(ps, lr=0.1), "exp_avg_sq"),
], ids=["torch-AdamW", "FusedAdam-m", "FusedAdam-v", "FusedSGD", "FusedNovoGrad"])
def test_load_state_dict_hooks_work_as_torchs(make, key):
    """What a pre-hook returns is what loads, and a post-hook sees the loaded state and keeps
    its edits, also for the state a fused optimizer keeps in its saved dtype."""
    p = _param()
    opt = make([p])
    opt.step()
    saved = opt.state_dict()

    def zeroed(o, state_dict):
        state = {i: {k: torch.zeros_like(v) if k == key else v for k, v in s.items()}
                 for i, s in state_dict["state"].items()}
        return {**state_dict, "state": state}

    seen = []

    def edit(o):
        seen.append(o.state[p][key].abs().sum().item())
        o.state[p][key].fill_(7.0)

    opt.register_load_state_dict_pre_hook(zeroed)
    opt.register_load_state_dict_post_hook(edit)
    opt.load_state_dict(saved)
    assert seen == [0.0]
    assert torch.equal(opt.state[p][key], torch.full_like(opt.state[p][key], 7.0))
    # the fused optimizers' own hooks lived for the call only
    assert list(opt._optimizer_load_state_dict_pre_hooks.values()) == [zeroed]
    assert list(opt._optimizer_load_state_dict_post_hooks.values()) == [edit]
