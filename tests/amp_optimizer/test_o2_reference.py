"""O2 against a hand-written reference: a half model, fp32 masters made from it, torch's
optimizer stepping the masters, the masters copied back. Bit for bit, every step."""

from __future__ import annotations

import copy

import pytest
import torch

import amp_patch as amp
from training_utils import tiny_lm


@pytest.mark.slow
@pytest.mark.parametrize("make_opt", [
    lambda ps: torch.optim.AdamW(ps, lr=3e-3, weight_decay=0.01),
    lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9),
], ids=["adamw", "sgd"])
def test_o2_bf16_matches_hand_written_master_weights(make_opt):
    model, batch_fn, loss_fn = tiny_lm(batch=4)
    ref_model = copy.deepcopy(model).bfloat16()
    # Masters come from the half model, as amp (and Apex) make them after the cast.
    masters = [p.detach().float().requires_grad_(True) for p in ref_model.parameters()]
    ref_opt = make_opt(masters)
    opt = make_opt(model.parameters())
    model, opt = amp.initialize(model, opt, opt_level="O2", half_dtype=torch.bfloat16,
                                verbosity=0)
    for step in range(5):
        batch = batch_fn(step)
        opt.zero_grad()
        loss = loss_fn(model, batch)
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()

        ref_opt.zero_grad()
        ref_loss = loss_fn(ref_model, batch)
        ref_loss.backward()
        with torch.no_grad():
            for master, p in zip(masters, ref_model.parameters()):
                master.grad = p.grad.float()
                p.grad = None
            ref_opt.step()
            for master, p in zip(masters, ref_model.parameters()):
                p.copy_(master)

        assert torch.equal(loss, ref_loss), f"step {step}"
        for (name, p), ref in zip(model.named_parameters(), ref_model.parameters()):
            assert torch.equal(p, ref), f"step {step}: {name}"
        for master, ref in zip(amp.master_params(opt), masters):
            assert torch.equal(master, ref), f"step {step}: master"
