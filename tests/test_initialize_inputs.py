"""initialize on inputs that Apex-era scripts get wrong: each is a clear error or warning
(docs/design.md, "initialize")."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import amp_patch as amp
from training_utils import mlp


# --- optimizer params outside every model (9.11) -------------------------------------------

@pytest.mark.parametrize("level", ["O2", "O3"])
def test_foreign_optimizer_params_are_an_error_at_o2_o3(level):
    model, other = mlp(0), mlp(1)
    opt = torch.optim.SGD([{"params": model.parameters()}, {"params": other[0].parameters()}],
                          lr=0.1)
    with pytest.raises(ValueError, match=r"2 parameters.*param_groups\[1\]\['params'\]\[0\]"):
        amp.initialize(model, opt, opt_level=level, verbosity=0)
    assert model[0].weight.dtype == torch.float32  # nothing was applied
    assert "step" not in vars(opt)


@pytest.mark.parametrize("level", ["O0", "O1"])
def test_foreign_optimizer_params_are_a_warning_at_o0_o1(level):
    model, other = mlp(0), mlp(1)
    opt = torch.optim.SGD(list(model.parameters()) + [other[2].bias], lr=0.1)
    with pytest.warns(UserWarning, match=r"1 parameter .*param_groups\[0\]\['params'\]\[4\]"):
        amp.initialize(model, opt, opt_level=level, verbosity=0)


def test_optimizer_over_the_models_params_gives_no_warning():
    a, b = mlp(0), mlp(1)
    opt = torch.optim.SGD(list(a.parameters()) + list(b.parameters()), lr=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        amp.initialize([a, b], opt, opt_level="O1", verbosity=0)


# --- float64 params (9.12) -----------------------------------------------------------------

@pytest.mark.parametrize("level", ["O2", "O3"])
def test_float64_params_are_an_error_where_the_model_is_cast_to_half(level):
    model = mlp()
    model[2].double()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"float64.*2\.weight, 2\.bias"):
        amp.initialize(model, opt, opt_level=level, verbosity=0)
    assert model[0].weight.dtype == torch.float32  # nothing was applied
    assert "step" not in vars(opt)


def test_float64_params_pass_at_o1():
    model = nn.Sequential(nn.Linear(2, 2).double())
    amp.initialize(model, opt_level="O1", verbosity=0)
    assert model(torch.ones(1, 2, dtype=torch.float64)).dtype == torch.float64


# --- a failed initialize leaves nothing half-applied (9.13) ---------------------------------

def _fail_in_process(monkeypatch):
    import amp_patch.optim.amp as optim

    def boom(*_, **__):
        raise RuntimeError("injected failure")
    monkeypatch.setattr(optim, "process", boom)


def _fail_after_masters(monkeypatch):
    from amp_patch.optim.amp.patched_methods import PatchedMethods

    def boom(self):
        raise RuntimeError("injected failure")
    monkeypatch.setattr(PatchedMethods, "install", boom)


def _fail_in_scalers(monkeypatch):
    from amp_patch.scaler import AmpScaler

    def boom(*_, **__):
        raise RuntimeError("injected failure")
    monkeypatch.setattr(AmpScaler, "from_properties", boom)


def _state(model, opt):
    tensors = {("model", k): (v, v.dtype, v.detach().clone())
               for k, v in model.state_dict(keep_vars=True).items()}
    tensors.update({("grad", k): (p.grad, p.grad.dtype, p.grad.clone())
                    for k, p in model.named_parameters() if p.grad is not None})
    groups = [list(g["params"]) for g in opt.param_groups]
    state = {id(p): dict(opt.state[p]) for g in groups for p in g if p in opt.state}
    hooks = [(len(m._forward_pre_hooks), len(m._forward_hooks), len(m._state_dict_hooks),
              len(m._load_state_dict_pre_hooks)) for m in model.modules()]
    return tensors, groups, state, hooks, set(vars(opt))


def _assert_unchanged(before, after):
    (t0, g0, s0, h0, d0), (t1, g1, s1, h1, d1) = before, after
    assert t0.keys() == t1.keys()
    for k, (obj, dtype, value) in t0.items():
        obj1, dtype1, value1 = t1[k]
        assert obj1 is obj and dtype1 == dtype and torch.equal(value1, value), k
    assert all(a is b for ga, gb in zip(g0, g1) for a, b in zip(ga, gb)) and len(g0) == len(g1)
    assert s0.keys() == s1.keys()
    for pid, st in s0.items():
        assert st.keys() == s1[pid].keys()
        assert all(s1[pid][k] is v for k, v in st.items()), pid
    assert h0 == h1 and d0 == d1


@pytest.mark.parametrize("fail", [_fail_in_process, _fail_after_masters, _fail_in_scalers])
@pytest.mark.parametrize("level", ["O2", "O3"])
def test_failed_initialize_leaves_model_and_optimizer_as_they_were(level, fail, monkeypatch):
    from training_utils import conv_batch, convnet, xent

    model = convnet()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    x, y = conv_batch(0)
    xent(model(x), y).backward()
    opt.step()  # optimizer state exists, and grads stay in the params
    before = _state(model, opt)
    fail(monkeypatch)
    with pytest.raises(RuntimeError, match="injected failure"):
        amp.initialize(model, opt, opt_level=level, verbosity=0)
    _assert_unchanged(before, _state(model, opt))
    monkeypatch.undo()
    amp.initialize(model, opt, opt_level=level, verbosity=0)  # and it can be initialized


# --- bad input to scale_loss and load_state_dict (9.14) -------------------------------------

def test_scale_loss_of_a_number_names_the_expected_form():
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    amp.initialize(model, opt, opt_level="O2", verbosity=0)
    with pytest.raises(TypeError, match="loss must be a torch.Tensor.*got float"):
        with amp.scale_loss(3.0, opt):
            pass


@pytest.mark.parametrize("state, exc, match", [
    (None, TypeError, r"dict.*loss_scaler0.*got NoneType"),
    ({"loss_scaler0": {}}, ValueError, r"loss_scaler0.*'loss_scale'.*'unskipped'"),
    ({"loss_scaler0": 3.0}, TypeError, r"loss_scaler0.*dict.*got float"),
    ({"loss_scaler0": {"loss_scale": "big", "unskipped": 0}}, ValueError, r"loss_scale"),
    ({"loss_scalerX": {}}, ValueError, r"'loss_scalerX'.*loss_scaler0"),
    ({"loss_scaler1": {"loss_scale": 1.0, "unskipped": 0}}, RuntimeError, r"loss_scaler0"),
], ids=["none", "empty_scaler", "scaler_not_dict", "bad_scale", "bad_key", "wrong_index"])
def test_load_state_dict_bad_input_names_the_expected_form_and_loses_nothing(state, exc, match):
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    amp.initialize(model, opt, opt_level="O2", loss_scale="dynamic", verbosity=0)
    before = amp.state_dict()
    with pytest.raises(exc, match=match):
        amp.load_state_dict(state)
    assert amp.state_dict() == before


def test_load_state_dict_checks_every_scaler_before_loading_any():
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    amp.initialize(model, opt, opt_level="O2", loss_scale="dynamic", num_losses=2, verbosity=0)
    before = amp.state_dict()
    with pytest.raises(ValueError, match="loss_scaler1"):
        amp.load_state_dict({"loss_scaler0": {"loss_scale": 8.0, "unskipped": 3},
                             "loss_scaler1": {"loss_scale": -1.0, "unskipped": 0}})
    assert amp.state_dict() == before
