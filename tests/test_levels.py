"""The opt-level registry and the half-dtype names: one definition that everything reads."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from amp_patch.settings import dtypes, levels
from amp_patch.cli.compare import trainer
from amp_patch.settings.properties import Properties

DOCS = Path(__file__).resolve().parent.parent / "docs"


def test_the_docs_table_is_the_registry():
    page = (DOCS / "opt_levels.md").read_text()
    assert levels.markdown_table() in page, (
        "docs/opt_levels.md's table is out of date; paste in `python -m amp_patch.settings.levels`")


@pytest.mark.parametrize("name", levels.NAMES)
@pytest.mark.parametrize("half", [torch.float16, torch.bfloat16])
def test_properties_take_the_registry_row(name: str, half: torch.dtype):
    props = Properties.from_opt_level(name, half)
    for field, value in levels.OPT_LEVELS[name].preset(half).items():
        assert getattr(props, field) == value, field


def test_a_new_row_is_a_new_level(monkeypatch: pytest.MonkeyPatch):
    row = levels.OptLevel("O4", "half model, fp32 masters, static scale", levels.HALF,
                          patch_torch_functions=False, keep_batchnorm_fp32=False,
                          master_weights=True, loss_scale=128.0)
    monkeypatch.setattr(levels, "OPT_LEVELS", {**levels.OPT_LEVELS, "O4": row})
    props = Properties.from_opt_level("O4", torch.float16)
    assert (props.cast_model_type, props.master_weights, props.loss_scale) == (
        torch.float16, True, 128.0)
    assert levels.markdown_table().splitlines()[-1] == "| **O4** | half | False | False | True | 128.0 |"


def test_unknown_levels_name_the_registry():
    with pytest.raises(ValueError, match="Options are 'O0', 'O1', 'O2', 'O3'"):
        Properties.from_opt_level("O5", torch.bfloat16)
    with pytest.raises(ValueError, match="letter O"):
        levels.get("02")


def test_every_reader_has_the_same_levels():
    assert levels.NAMES == tuple(levels.OPT_LEVELS)
    assert trainer.AMP_LEVELS == levels.NAMES
    # compare's rows: the registry's levels, then the presets over them (O2-lean), then autocast.
    assert trainer.AMP_ROWS == (*levels.NAMES, *trainer.PRESETS)
    assert trainer.LEVELS == (*levels.NAMES, *trainer.PRESETS, "autocast")


def test_half_dtype_names_are_one_table():
    assert dtypes.HALF_DTYPES == frozenset(dtypes.HALF_DTYPE_NAMES.values())
    assert list(dtypes.HALF_DTYPE_NAMES) == ["bf16", "fp16"]
    assert trainer.HALF_DTYPES is dtypes.HALF_DTYPE_NAMES
    for name, dtype in dtypes.HALF_DTYPE_NAMES.items():
        assert dtypes.half_dtype_name(dtype) == name
        assert dtypes.parse_half_dtype(name) is dtype
    assert dtypes.parse_half_dtype("float16") is torch.float16
    assert dtypes.parse_half_dtype("half") is torch.float16
    with pytest.raises(ValueError, match="unknown half dtype"):
        dtypes.parse_half_dtype("fp8")
    with pytest.raises(ValueError):
        dtypes.half_dtype_name(torch.float32)
