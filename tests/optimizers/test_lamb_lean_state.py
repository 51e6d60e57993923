"""FusedLAMB over low-precision state (``state_format``): codes, training, resuming exactly."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from amp_patch.optim.fused import FusedLAMB

FORMATS = ("bf16", "int8", "fp8")


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64))


def _train(model: nn.Module, opt: FusedLAMB, steps: int, start: int = 0) -> float:
    loss = torch.zeros(())
    for i in range(start, start + steps):
        g = torch.Generator().manual_seed(i)
        x = torch.randn(128, 64, generator=g)
        opt.zero_grad()
        loss = (model(x) - x.flip(1)).pow(2).mean()
        loss.backward()
        opt.step()
    return float(loss.detach())


@pytest.mark.parametrize("fmt", FORMATS)
def test_state_is_stored_in_the_formats_codes(fmt):
    model = _model()
    opt = FusedLAMB(model.parameters(), lr=1e-2, state_format=fmt)
    _train(model, opt, 2)
    big, bias = opt.state[model[0].weight], opt.state[model[0].bias]
    first = {"bf16": torch.bfloat16, "int8": torch.int8, "fp8": torch.float8_e4m3fn}[fmt]
    second = {"bf16": torch.bfloat16, "int8": torch.uint8, "fp8": torch.bfloat16}[fmt]
    assert (big["exp_avg"].dtype, big["exp_avg_sq"].dtype) == (first, second)
    assert ("exp_avg_scale" in big) == (fmt != "bf16")
    # A 1-D tensor keeps fp32 state under the block-scaled formats.
    assert bias["exp_avg"].dtype == (torch.bfloat16 if fmt == "bf16" else torch.float32)


@pytest.mark.slow
@pytest.mark.parametrize("fmt", FORMATS)
def test_trains_as_fp32_state_does(fmt):
    ref_model, model = _model(), _model()
    ref = _train(ref_model, FusedLAMB(ref_model.parameters(), lr=1e-2), 60)
    lean = _train(model, FusedLAMB(model.parameters(), lr=1e-2, state_format=fmt), 60)
    # 60 steps of a regression whose loss falls ~4x: the codes' rounding stays within 10%.
    assert abs(lean - ref) <= 0.1 * ref, (lean, ref)


@pytest.mark.parametrize("fmt", ("int8", "fp8"))
def test_state_dict_resumes_bit_for_bit(fmt):
    model = _model()
    opt = FusedLAMB(model.parameters(), lr=1e-2, state_format=fmt)
    _train(model, opt, 3)
    saved_model, saved_opt = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
    _train(model, opt, 3, start=3)

    resumed = _model(seed=1)
    resumed.load_state_dict(saved_model)
    opt2 = FusedLAMB(resumed.parameters(), lr=1e-2, state_format=fmt)
    opt2.load_state_dict(saved_opt)
    assert opt2.state[resumed[0].weight]["exp_avg"].dtype == opt.state[model[0].weight]["exp_avg"].dtype
    _train(resumed, opt2, 3, start=3)
    for a, b in zip(model.parameters(), resumed.parameters()):
        assert torch.equal(a, b)


def test_switching_back_to_fp32_converts_the_state():
    model = _model()
    opt = FusedLAMB(model.parameters(), lr=1e-2, state_format="int8")
    _train(model, opt, 2)
    assert opt.set_state_format("fp32").name == "int8"
    _train(model, opt, 1, start=2)
    state = opt.state[model[0].weight]
    assert state["exp_avg"].dtype == torch.float32 and "exp_avg_scale" not in state


def test_groups_without_trust_ratio_skip_stage_one(monkeypatch):
    """Without weight decay or NVLAMB stage 2 steps by lr alone: stage 1 is not run for such a
    group, and the step is bit for bit the one that runs it."""
    from amp_patch import ops
    from amp_patch.optim.fused.lamb import _LambBase

    calls = []
    stage1 = ops.multi_tensor_lamb_lean_stage1_

    def counted(*args, **kwargs):
        calls.append(1)
        return stage1(*args, **kwargs)

    monkeypatch.setattr(ops, "multi_tensor_lamb_lean_stage1_", counted)
    models = [_model(), _model()]
    skipped, run = (FusedLAMB(m.parameters(), lr=1e-2, weight_decay=0.0, state_format="int8")
                    for m in models)
    _train(models[0], skipped, 3)
    assert not calls
    monkeypatch.setattr(_LambBase, "_trust_ratio", staticmethod(lambda hyper: True))
    _train(models[1], run, 3)
    assert calls
    for a, b in zip(models[0].parameters(), models[1].parameters()):
        assert torch.equal(a, b)
    for p, q in zip(models[0].parameters(), models[1].parameters()):
        for key, value in skipped.state[p].items():
            assert torch.equal(value, run.state[q][key]), key
