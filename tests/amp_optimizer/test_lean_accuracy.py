"""The lean optimizer state trains the LM to within 1% of O2's final loss (docs/lean_state.md, Accuracy).

The compare LM (``amp_patch.cli.compare.models.lm`` with ``FusedAdam``), made smaller
so that four runs fit in about a minute on two CPU cores: ``d_model=128``,
``seq_len=64``, 150 steps, at ``lr=1e-3`` (``LMConfig``'s default, the
benchmark LM's). It trains in bf16 at O2 as today (fp32 state, fp32 masters)
and at the leanest settings, ``optimizer_state="int8"`` and ``"fp8"`` with
``master_weights="bf16"``; the final loss (mean of the last 20 steps) must stay
within 1% of O2's.

Why this length and learning rate, measured on a 2-core AMD EPYC (1 thread,
seed 0; gaps to O2):

- at lr 1e-3, 150 steps: int8 + bf16 masters +0.11%, fp8 + bf16 masters
  +0.33%; bf16 params rounded to nearest (O2 with ``master_weights=False``:
  what bf16 masters would be without stochastic rounding) **+8.35%**;
- at the compare LM's lr 3e-3, 150 steps: int8 -0.01%, fp8 -0.06%, but
  round-to-nearest -0.42%: its updates are large beside a bf16 ulp, so the
  test could not tell a broken rounding from a working one.

So the test can fail. Checked by hand: int8 state with bf16 masters through
the op's reference body, with its stochastic rounding of the param replaced
by round to nearest, ends +8.32% from O2 (with the rounding kept, the
reference gives the kernel's 2.0983, +0.11%). In the suite,
:func:`test_round_to_nearest_masters_would_fail` shows the same on the shipped
code: the run with bf16 params rounded to nearest misses the tolerance. The full-length evidence (300 steps, every setting, O2's
seed spread, a conv net with FusedSGD) is ``benchmarks/accuracy_lean_state.py``
and docs/lean_state.md.
"""

from __future__ import annotations

import functools

import pytest
import torch

import amp_patch as amp
from amp_patch.cli.compare import models

pytestmark = pytest.mark.slow

#: The issue's tolerance on the final loss, relative to O2's.
TOLERANCE = 0.01
STEPS = 150
#: Steps whose mean loss is the final loss.
TAIL = 20
CONFIG = {"d_model": 128, "seq_len": 64, "lr": 1e-3}


@functools.cache
def _final_loss(optimizer_state: str, master_weights: bool | str) -> float:
    """Mean loss of the last :data:`TAIL` of :data:`STEPS` O2 steps under these settings
    (cached: the O2 baseline is shared by every case)."""
    # One thread: on a busy 2-core machine two threads spin against each other several times
    # slower, and one thread gives the losses the docstring quotes.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _train(optimizer_state, master_weights)
    finally:
        torch.set_num_threads(threads)


def _train(optimizer_state: str, master_weights: bool | str) -> float:
    model, optimizer, batch_fn, loss_fn = models.lm(seed=0, fused_adam=True, **CONFIG)
    amp.initialize(model, optimizer, opt_level="O2", half_dtype=torch.bfloat16, verbosity=0,
                   optimizer_state=optimizer_state, master_weights=master_weights)
    losses = []
    try:
        for step in range(STEPS):
            optimizer.zero_grad()
            loss = loss_fn(model, batch_fn(step))
            with amp.scale_loss(loss, optimizer) as scaled:
                scaled.backward()
            optimizer.step()
            losses.append(loss.item())
    finally:
        amp.deinitialize()
    return sum(losses[-TAIL:]) / TAIL


def _gap(optimizer_state: str, master_weights: bool | str) -> float:
    base = _final_loss("fp32", True)
    return (_final_loss(optimizer_state, master_weights) - base) / base


@pytest.mark.parametrize("optimizer_state", ["int8", "fp8"])
def test_lean_state_with_bf16_masters_is_within_tolerance_of_O2(optimizer_state):
    gap = _gap(optimizer_state, "bf16")
    assert abs(gap) <= TOLERANCE, (
        f"optimizer_state={optimizer_state!r}, master_weights='bf16': final loss "
        f"{_final_loss(optimizer_state, 'bf16'):.4f} is {100 * gap:+.2f}% from O2's "
        f"{_final_loss('fp32', True):.4f} (tolerance {100 * TOLERANCE:.0f}%)")


def test_round_to_nearest_masters_would_fail():
    """bf16 params stepped without masters are rounded to nearest: they miss the tolerance,
    so the cases above can fail (stochastic rounding is what holds the loss)."""
    gap = _gap("fp32", False)
    assert gap > TOLERANCE, (
        f"bf16 params rounded to nearest ended {100 * gap:+.2f}% from O2: this run no longer "
        "tells broken rounding from stochastic rounding; choose a longer run or a lower lr")
