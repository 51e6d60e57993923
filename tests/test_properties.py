"""Properties: opt-level presets, half_dtype, and every override rule of docs/design.md, "Opt levels"."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from amp_patch.settings.properties import DYNAMIC, Properties

FP16, BF16 = torch.float16, torch.bfloat16


@pytest.mark.parametrize("level,cast,patch,bn,master,scale", [
    ("O0", torch.float32, False, None, False, 1.0),
    ("O1", None, True, None, None, DYNAMIC),
    ("O2", FP16, False, True, True, DYNAMIC),
    ("O3", FP16, False, False, False, 1.0),
])
def test_presets_fp16(level, cast, patch, bn, master, scale):
    p = Properties.from_opt_level(level, FP16)
    assert (p.cast_model_type, p.patch_torch_functions, p.keep_batchnorm_fp32,
            p.master_weights, p.loss_scale) == (cast, patch, bn, master, scale)


@pytest.mark.parametrize("level", ["O0", "O1", "O2", "O3"])
def test_bf16_defaults_to_static_scale_one_and_explicit_wins(level):
    p = Properties.from_opt_level(level, BF16)
    assert p.loss_scale == 1.0 and p.half_dtype == BF16
    if level in ("O2", "O3"):
        assert p.cast_model_type == BF16
    assert Properties.from_opt_level(level, BF16, loss_scale="dynamic").loss_scale == DYNAMIC
    assert Properties.from_opt_level(level, BF16, loss_scale=128).loss_scale == 128.0


def test_frozen():
    p = Properties.from_opt_level("O1", BF16)
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.opt_level = "O2"


@pytest.mark.parametrize("level", ["O4", "o1", "01", "", None, 1])
def test_unknown_level_hints_at_letter_o(level):
    with pytest.raises(ValueError, match="letter O"):
        Properties.from_opt_level(level, BF16)


def test_bad_half_dtype():
    with pytest.raises(ValueError, match="half_dtype"):
        Properties.from_opt_level("O1", torch.float32)


@pytest.mark.parametrize("override", [
    dict(cast_model_type=FP16), dict(cast_model_type=BF16),
    dict(keep_batchnorm_fp32=True), dict(keep_batchnorm_fp32="False"),
    dict(master_weights=True), dict(master_weights=False),
])
def test_o1_override_rules(override):
    with pytest.raises(ValueError, match="O1"):
        Properties.from_opt_level("O1", FP16, **override)


@pytest.mark.parametrize("value", [None, False, torch.float32])
def test_o1_accepts_cast_model_type(value):
    assert Properties.from_opt_level("O1", FP16, cast_model_type=value).cast_model_type is value


@pytest.mark.parametrize("level", ["O0", "O2", "O3"])
def test_patch_torch_functions_only_with_o1(level):
    with pytest.raises(ValueError, match="only allowed with O1"):
        Properties.from_opt_level(level, FP16, patch_torch_functions=True)
    assert not Properties.from_opt_level(level, FP16, patch_torch_functions=False).patch_torch_functions


@pytest.mark.parametrize("value,parsed", [(True, True), (False, False), ("True", True),
                                          ("False", False), (None, True)])
def test_keep_batchnorm_fp32_values(value, parsed):
    assert Properties.from_opt_level("O2", FP16, keep_batchnorm_fp32=value).keep_batchnorm_fp32 is parsed


@pytest.mark.parametrize("value", ["true", 1, "yes"])
def test_keep_batchnorm_fp32_bad(value):
    with pytest.raises(ValueError, match="keep_batchnorm_fp32"):
        Properties.from_opt_level("O2", FP16, keep_batchnorm_fp32=value)


@pytest.mark.parametrize("value,parsed", [("dynamic", DYNAMIC), (128, 128.0), ("512.0", 512.0),
                                          (1, 1.0), (2.0**10, 1024.0)])
def test_loss_scale_values(value, parsed):
    assert Properties.from_opt_level("O2", FP16, loss_scale=value).loss_scale == parsed


@pytest.mark.parametrize("value", ["static", [1], object(), -1.0, 0, float("inf"), float("nan")])
def test_loss_scale_bad(value):
    with pytest.raises(ValueError, match="loss_scale"):
        Properties.from_opt_level("O2", FP16, loss_scale=value)


def test_cast_model_type_false_disables_model_casting():
    p = Properties.from_opt_level("O2", FP16, cast_model_type=False)
    assert p.cast_model_type is False and not p.casts_model


def test_unknown_override_and_bad_numbers():
    with pytest.raises(TypeError, match="unknown"):
        Properties.from_opt_level("O1", FP16, loss_scael=1.0)
    with pytest.raises(ValueError, match="num_losses"):
        Properties.from_opt_level("O1", FP16, num_losses=0)
    with pytest.raises(ValueError, match="min_loss_scale"):
        Properties.from_opt_level("O1", FP16, min_loss_scale=4.0, max_loss_scale=2.0)
    with pytest.raises(ValueError, match="cast_model_outputs"):
        Properties.from_opt_level("O2", FP16, cast_model_outputs=torch.int32)


def test_fast_path_property():
    assert Properties.from_opt_level("O0", FP16).skips_unscale
    assert Properties.from_opt_level("O1", BF16).skips_unscale
    assert not Properties.from_opt_level("O1", FP16).skips_unscale
    assert not Properties.from_opt_level("O2", BF16).skips_unscale
