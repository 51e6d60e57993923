"""OptimizerRecord's (model param, stepped tensor) pairs, kept between calls.

Every iteration walks them several times (scale_loss's entry and exit, step,
zero_grad), so the record keeps the lists and makes them again only when the
masters or the groups' param lists change. These tests change each and check
that the pairs follow, and that training through the changes matches a record
that never kept anything.
"""

from __future__ import annotations

import pytest
import torch

import amp_patch as amp
from amp_patch import session as amp_session


def _setup(opt_level="O2"):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))
    optimizer = torch.optim.SGD(model[0].parameters(), lr=0.1)
    model, optimizer = amp.initialize(model, optimizer, opt_level=opt_level,
                                      half_dtype=torch.bfloat16, verbosity=0)
    return model, optimizer, amp_session.current().record_for(optimizer)


def _expected(record, optimizer):
    return [(record.masters.model_param(p), p) for g in optimizer.param_groups for p in g["params"]]


def _same(a, b):
    return len(a) == len(b) and all(x is y and u is v for (x, u), (y, v) in zip(a, b))


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_pairs_are_kept_while_nothing_changes(opt_level):
    _, optimizer, record = _setup(opt_level)
    first = record._pairs()
    assert record._pairs() is first and _same(first, _expected(record, optimizer))
    masters = record.master_pairs()
    assert all(m is not s for m, s in masters) and len(masters) == (2 if opt_level == "O2" else 0)


def test_pairs_follow_add_param_group_and_edited_lists():
    model, optimizer, record = _setup()
    before = record._pairs()
    optimizer.add_param_group({"params": list(model[1].parameters())})
    after = record._pairs()
    assert after is not before and _same(after, _expected(record, optimizer))
    assert len(record.master_pairs()) == 4
    # A param list edited in place: the same list object, another tensor in it.
    params = optimizer.param_groups[1]["params"]
    extra = torch.nn.Parameter(torch.zeros(3))
    params[0], removed = extra, params[0]
    assert _same(record._pairs(), _expected(record, optimizer))
    assert all(s is not removed for _, s in record._pairs())
    params[0] = removed
    assert _same(record._pairs(), _expected(record, optimizer))


def test_deinitialize_forgets_the_pairs():
    _, _, record = _setup()
    assert record._pairs()
    amp.deinitialize()
    assert record._pairs_kept == [] and record._master_pairs_kept == []


def test_training_after_add_param_group_steps_every_param():
    model, optimizer, _ = _setup()
    x = torch.randn(5, 8)
    for step in range(3):
        if step == 1:
            optimizer.add_param_group({"params": list(model[1].parameters()), "lr": 0.05})
        before = [p.detach().clone() for p in model.parameters()]
        optimizer.zero_grad()
        with amp.scale_loss(model(x.bfloat16()).float().pow(2).mean(), optimizer) as scaled:
            scaled.backward()
        optimizer.step()
        moved = [not torch.equal(b, p) for b, p in zip(before, model.parameters())]
        assert moved == [True, True] + [step >= 1] * 2
