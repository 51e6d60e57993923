"""Transformer Engine's spelling served by amp_patch: the modules, the recipes, the region, the refusals.

In process, through the import hook (docs/run.md, "Transformer Engine
scripts"); tests/cli/test_cli_run_te.py runs whole TE scripts under
``amp-patch run``.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from amp_patch.apex_compat import import_hook
from amp_patch.apex_compat import transformer_engine as shim
from amp_patch.ops import fp8_ops


@pytest.fixture
def te():
    with import_hook.apex_import_hook(shadow_apex=True):
        import transformer_engine.pytorch as te_pytorch

        yield te_pytorch


def test_hook_serves_te_names(te):
    import transformer_engine.common.recipe as recipe
    from transformer_engine.common.recipe import DelayedScaling, Format

    assert te.Linear is shim.Linear and te.fp8_autocast is shim.fp8_autocast
    assert DelayedScaling is shim.DelayedScaling and Format.HYBRID is shim.Format.HYBRID
    assert set(te.__all__) >= {"Linear", "LayerNorm", "LayerNormLinear", "fp8_autocast"}
    assert set(recipe.__all__) >= {"DelayedScaling", "Float8CurrentScaling", "Format"}
    assert issubclass(te.Linear, torch.nn.Linear) and issubclass(te.LayerNorm, torch.nn.LayerNorm)


@pytest.mark.parametrize("stmt, name, hint", [
    ("import transformer_engine.pytorch as te; te.TransformerLayer",
     "transformer_engine.pytorch.TransformerLayer", "scaled_dot_product_attention"),
    ("from transformer_engine.pytorch import LayerNormMLP",
     "transformer_engine.pytorch.LayerNormMLP", "te.LayerNormLinear, an activation"),
    ("from transformer_engine.common.recipe import MXFP8BlockScaling",
     "transformer_engine.common.recipe.MXFP8BlockScaling", "DelayedScaling"),
    ("import transformer_engine.jax", "transformer_engine.jax", "transformer_engine.pytorch"),
])
def test_other_te_names_fail_naming_what_to_use(stmt, name, hint):
    with import_hook.apex_import_hook(shadow_apex=True) as finder:
        with pytest.raises((ImportError, AttributeError)) as exc:
            exec(stmt, {})
    message = str(exc.value)
    assert message.startswith(f"{name} is not supported by amp_patch's Transformer Engine")
    assert hint in message and "docs/fp8.md" in message
    assert "apex.optimizers" not in message  # the TE layer's names, not Apex's
    assert name in finder.misses


def test_delayed_scaling_maps_to_the_recipe():
    r = shim.to_fp8_recipe(shim.DelayedScaling(margin=1, fp8_format=shim.Format.E4M3,
                                               amax_history_len=8,
                                               amax_compute_algo="most_recent"))
    assert (r.scaling, r.format, r.amax_history_len, r.amax_compute_algo, r.margin) == \
        ("delayed", "e4m3", 8, "most_recent", 1)
    default = shim.to_fp8_recipe(None)
    assert (default.scaling, default.format, default.amax_history_len) == ("delayed", "hybrid", 1024)
    current = shim.to_fp8_recipe(shim.Float8CurrentScaling())
    assert (current.scaling, current.format) == ("tensorwise", "hybrid")


@pytest.mark.parametrize("kwargs, match", [
    ({"fp8_format": shim.Format.E5M2}, "Format.HYBRID"),
    ({"amax_compute_algo": lambda history: history.max()}, "'max' or 'most_recent'"),
    ({"scaling_factor_compute_algo": lambda *a: 1.0}, "scaling_factor_compute_algo"),
    ({"fp8_mha": True}, "FP8 attention"),
])
def test_recipe_refusals_are_clear(kwargs, match):
    with pytest.raises(shim.TransformerEngineUnsupported, match=match):
        shim.DelayedScaling(**kwargs)


def test_linear_takes_te_arguments_and_refuses_parallelism():
    calls = []
    layer = shim.Linear(32, 16, bias=False, params_dtype=torch.bfloat16, device="cpu",
                        tp_group=None, init_method=lambda w: calls.append(w.shape),
                        sequence_parallel=False, tp_size=1)
    assert layer.weight.dtype == torch.bfloat16 and layer.bias is None
    assert calls == [torch.Size([16, 32])]
    with pytest.raises(shim.TransformerEngineUnsupported, match="tensor and sequence parallel"):
        shim.Linear(32, 16, device="cpu", tp_size=2)
    with pytest.raises(TypeError, match="unexpected keyword argument 'frobnicate'"):
        shim.Linear(32, 16, device="cpu", frobnicate=True)


def test_linear_outside_the_region_is_plain():
    torch.manual_seed(0)
    layer = shim.Linear(32, 16, device="cpu")
    x = torch.randn(5, 32)
    assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))
    with shim.fp8_autocast(enabled=False):
        assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))


def test_linear_in_the_region_runs_the_fp8_op():
    """Current scaling: the very op amp_patch's FP8 uses, bitwise; a nested region turns it off."""
    torch.manual_seed(0)
    layer = shim.Linear(32, 16, device="cpu")
    x = torch.randn(5, 32)
    with shim.fp8_autocast(fp8_recipe=shim.Float8CurrentScaling()):
        assert shim.is_fp8_enabled()
        y = layer(x)
        with shim.fp8_autocast(enabled=False):
            assert not shim.is_fp8_enabled()
            assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))
    assert not shim.is_fp8_enabled()
    assert torch.equal(y, fp8_ops.fp8_linear(x, layer.weight, layer.bias))
    assert not torch.equal(y, F.linear(x, layer.weight, layer.bias))
    assert (y - F.linear(x, layer.weight, layer.bias)).abs().max() < 0.1


def test_delayed_recipe_keeps_a_history_per_layer():
    torch.manual_seed(0)
    layer = shim.Linear(64, 32, device="cpu")
    recipe = shim.DelayedScaling(amax_history_len=4)
    x = torch.randn(16, 64, requires_grad=True)
    for _ in range(3):
        with shim.fp8_autocast(fp8_recipe=recipe):
            y = layer(x)
        y.square().mean().backward()
    state = layer._amp_patch_fp8.state
    assert state.history.shape == (4, 3)
    # Two updates have run: the scales left 1.0 for fp8_max / amax of x, W and dY.
    expected = torch.tensor([448.0, 448.0, 57344.0]) / state.history.amax(0)
    assert torch.allclose(state.scale, expected)
    assert layer.weight.grad is not None and torch.isfinite(layer.weight.grad).all()


def test_layer_norm_linear_names_and_outputs():
    torch.manual_seed(0)
    m = shim.LayerNormLinear(32, 48, device="cpu", return_layernorm_output=True)
    assert sorted(n for n, _ in m.named_parameters()) == [
        "bias", "layer_norm_bias", "layer_norm_weight", "weight"]
    x = torch.randn(3, 32)
    out, normed = m(x)
    assert torch.allclose(normed, F.layer_norm(x, (32,)))
    assert torch.allclose(out, F.linear(normed, m.weight, m.bias))
    rms = shim.LayerNormLinear(32, 48, device="cpu", normalization="RMSNorm",
                               zero_centered_gamma=True)
    assert rms.layer_norm_bias is None and not rms.layer_norm_weight.any()
    assert torch.allclose(rms(x), F.linear(F.rms_norm(x, (32,), eps=1e-5), rms.weight, rms.bias))


def test_layer_norm_zero_centered_gamma():
    ln = shim.LayerNorm(16, zero_centered_gamma=True, device="cpu")
    x = torch.randn(2, 16)
    assert not ln.weight.any() and torch.allclose(ln(x), F.layer_norm(x, (16,)))


def test_fp8_layer_with_odd_dims_is_refused():
    layer = shim.Linear(24, 16, device="cpu")
    with shim.fp8_autocast(), pytest.raises(ValueError, match="multiples of 16"):
        layer(torch.randn(4, 24))


def test_te_autocast_is_fp8_autocast():
    layer = shim.Linear(32, 16, device="cpu")
    x = torch.randn(4, 32)
    with shim.autocast(enabled=True, recipe=shim.Float8CurrentScaling()):
        y = layer(x)
    assert torch.equal(y, fp8_ops.fp8_linear(x, layer.weight, layer.bias))
    with pytest.raises(shim.TransformerEngineUnsupported, match="calibrating"):
        with shim.fp8_autocast(calibrating=True):
            pass


def test_te_region_is_amps_region():
    """TE's region is amp.fp8_autocast: a layer amp converted follows it, and amp's region
    drives TE's layers (with the session's recipe when it names none)."""
    import amp_patch as amp

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(32, 32), shim.Linear(32, 16, device="cpu"))
    amp.initialize(net, opt_level="O0", fp8=amp.Fp8Recipe(min_features=16), verbosity=0)
    try:
        plan = amp.fp8_plan()
        assert plan.converted == ("0",) and "overrides nn.Linear.forward" in plan.left_out["1"]
        x = torch.randn(4, 32)
        with shim.fp8_autocast(enabled=False):
            assert torch.equal(net(x), F.linear(F.linear(x, net[0].weight, net[0].bias),
                                                net[1].weight, net[1].bias))
        with amp.fp8_autocast():
            assert shim.is_fp8_enabled()
            h = fp8_ops.fp8_linear(x, net[0].weight, net[0].bias)
            assert torch.equal(net(x), fp8_ops.fp8_linear(h, net[1].weight, net[1].bias))
    finally:
        amp.deinitialize()
