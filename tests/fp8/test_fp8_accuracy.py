"""FP8's accuracy targets at a reduced size: final loss within 1.5% of O2 bf16, gradient cosine >= 0.95.

benchmarks/accuracy_fp8.py runs the full study (docs/fp8.md, Accuracy); this
runs its training function at 100 steps with seed 0: past the steep fall of the
first 70 steps, where a step's shift of the curve moves the mean of the last 20
losses by more than 1.5% (at 60 steps, tensorwise and delayed read -1.5% and
+2.0% on the very curves that end within 0.1% of O2's). The cosine target holds
at every probe, step 0 included: before it has an amax history the delayed recipe
scales by the current amax (docs/fp8.md, The recipes).
"""

from __future__ import annotations


import pytest

from _scripts import load_script

STEPS = 100


study = load_script("accuracy_fp8")


@pytest.fixture(scope="module")
def o2_final():
    run = study.train(None, 0, STEPS, lambda step, loss: None)
    return study.final_loss(run["losses"])


@pytest.mark.slow
@pytest.mark.parametrize("recipe", study.RECIPES)
def test_fp8_trains_as_o2_and_its_gradients_agree(recipe, o2_final):
    run = study.train(recipe, 0, STEPS, lambda step, loss: None)
    assert run["converted"] == ["blocks.0.qkv", "blocks.0.proj", "blocks.0.fc1", "blocks.0.fc2",
                                "blocks.1.qkv", "blocks.1.proj", "blocks.1.fc1", "blocks.1.fc2",
                                "head"]
    gap = abs(study.final_loss(run["losses"]) - o2_final) / o2_final
    assert gap <= study.LOSS_GAP_PCT / 100, f"{recipe}: final loss {100 * gap:.2f}% from O2's"
    for step, probe in run["probes"].items():
        assert probe["logits_rel_err"] < 0.25, (step, probe["logits_rel_err"])
        worst = min(probe["cosine"], key=probe["cosine"].get)
        assert probe["cosine"][worst] >= study.COSINE, (step, worst, probe["cosine"][worst])
