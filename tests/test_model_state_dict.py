"""Under O2/O3 ``model.state_dict()`` is fp32, as Apex's state-dict hook made it
(docs/design.md, "Model casting and master weights").

A checkpoint of a cast model therefore loads into an fp32 model, and loading
fp32 or half weights into the amp model keeps its fp32 masters consistent.
"""

from __future__ import annotations

import pytest
import torch

import amp_patch as amp
from training_utils import conv_batch, convnet, train

HALF = (torch.float16, torch.bfloat16)


def _amp_convnet(level, seed=0, **kw):
    model = convnet(seed)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    amp.initialize(model, opt, opt_level=level, verbosity=0, **kw)
    return model, opt


def _masters_by_param(opt):
    record = amp.session.current().record_for(opt)
    return {id(model_p): master for model_p, master in record.master_pairs()}


@pytest.mark.parametrize("level", ["O2", "O3"])
def test_state_dict_is_fp32_and_loads_into_an_fp32_model(level):
    model, opt = _amp_convnet(level)
    train(model, opt, 2, conv_batch)
    assert model[0].weight.dtype in HALF
    sd = model.state_dict()
    assert all(v.dtype == torch.float32 for v in sd.values() if v.is_floating_point())
    assert all(v.dtype == torch.float32 for v in model[0].state_dict().values())  # a submodule too
    masters = _masters_by_param(opt)
    for name, p in model.named_parameters():
        expected = masters.get(id(p), p.float()) if level == "O2" else p.float()
        assert torch.equal(sd[name], expected), name
    fresh = convnet(seed=5)
    fresh.load_state_dict(sd)  # strict: same keys, fp32 values
    amp.deinitialize()
    assert model.state_dict()["0.weight"].dtype in HALF  # the hook went with the session
    assert not any(m._state_dict_hooks or m._load_state_dict_pre_hooks for m in model.modules())


@pytest.mark.parametrize("source", ["fp32", "half"])
def test_loading_into_the_o2_model_sets_the_masters(source):
    model, opt = _amp_convnet("O2")
    pretrained = convnet(seed=3).state_dict()
    if source == "half":
        pretrained = {k: v.bfloat16() if v.is_floating_point() else v for k, v in pretrained.items()}
    model.load_state_dict(pretrained)
    masters = _masters_by_param(opt)
    for name, p in model.named_parameters():
        assert torch.equal(p, pretrained[name].to(p.dtype)), name
        if id(p) in masters:  # the exact loaded values, not their half rounding
            assert torch.equal(masters[id(p)], pretrained[name].float()), name
    train(model, opt, 1, conv_batch)
    for model_p, master in amp.session.current().record_for(opt).master_pairs():
        assert torch.equal(model_p, master.to(model_p.dtype))


def test_o2_state_dict_round_trip_restores_exact_masters():
    model, opt = _amp_convnet("O2")
    train(model, opt, 2, conv_batch)
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    train(model, opt, 2, conv_batch, start=2)
    model.load_state_dict(saved)
    assert all(torch.equal(saved[k], v) for k, v in model.state_dict().items())
    masters = _masters_by_param(opt)
    assert masters
    for name, p in model.named_parameters():
        if id(p) in masters:
            assert saved[name].dtype == torch.float32
            assert torch.equal(masters[id(p)], saved[name]), name
