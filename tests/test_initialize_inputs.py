"""initialize on inputs that Apex-era scripts get wrong: each is a clear error or warning (issue 9)."""

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
