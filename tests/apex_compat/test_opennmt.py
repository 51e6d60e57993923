"""OpenNMT-py 3.5.1's fp16 recipes, unchanged, under ``amp-patch run --device cpu``.

``onmt_train`` with ``gpu_ranks: [0]`` trains a toy copy-reversal corpus (a
tiny transformer, a few steps) with the recipes behind OpenNMT-py's published
Apex benchmark: ``-model_dtype fp16 -optim fusedadam`` at ``-apex_opt_level``
O1, O2 and ``""`` (Apex's contrib ``FP16_Optimizer`` around OpenNMT's own
``FusedAdam``, which calls ``fused_adam_cuda``), and ``-optim adam -model_dtype
fp16`` (torch's GradScaler). Each lands near the fp32 run's perplexity, and
O2 resumes from its checkpoint. The packages come from requirements-onmt*.txt
(``make install``); without them the tests skip, naming what is missing.
"""

from __future__ import annotations

import importlib.util
import os
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest

#: What `onmt_train` imports (module names), from requirements-onmt*.txt.
_NEEDED = ("onmt", "pyonmttok", "configargparse", "yaml", "spacy", "ahocorasick", "rapidfuzz",
           "regex", "fasttext", "sacrebleu")
_MISSING = [m for m in _NEEDED if importlib.util.find_spec(m) is None]

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(bool(_MISSING), reason=f"OpenNMT-py 3.5.1 or its dependencies are not "
                       f"installed (missing: {', '.join(_MISSING)}); `make install` installs "
                       "requirements-onmt.txt and requirements-onmt-nodeps.txt"),
]

STEPS, SAVE = 10, 5

CONFIG = f"""
src_vocab: vocab.txt
tgt_vocab: vocab.txt
share_vocab: true
overwrite: true
data:
  corpus_1:
    path_src: src-train.txt
    path_tgt: tgt-train.txt
save_checkpoint_steps: {SAVE}
train_steps: {STEPS}
valid_steps: 100000
world_size: 1
gpu_ranks: [0]
encoder_type: transformer
decoder_type: transformer
layers: 2
hidden_size: 32
word_vec_size: 32
transformer_ff: 64
heads: 2
batch_size: 32
batch_type: sents
bucket_size: 512
num_workers: 0
position_encoding: true
learning_rate: 0.002
decay_method: none
report_every: 5
seed: 1
"""

_STEP = re.compile(r"Step\s+(\d+)/\s*\d+; acc:\s*[\d.]+; ppl:\s*([\d.]+);")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """A toy corpus (reverse a sentence of a 16-word vocabulary), its vocab and the config."""
    root = tmp_path_factory.mktemp("onmt")
    rng = random.Random(0)
    words = [f"w{i}" for i in range(16)]
    with open(root / "src-train.txt", "w") as src, open(root / "tgt-train.txt", "w") as tgt:
        for _ in range(300):
            toks = [rng.choice(words) for _ in range(rng.randint(3, 8))]
            src.write(" ".join(toks) + "\n")
            tgt.write(" ".join(reversed(toks)) + "\n")
    (root / "vocab.txt").write_text("".join(f"{w}\t100\n" for w in words))
    (root / "cfg.yaml").write_text(CONFIG)
    return root


def _onmt_train(corpus: Path, name: str, *args: str) -> tuple[dict[int, float], str]:
    """Run onmt_train under `amp-patch run --device cpu`; the perplexity at each reported step."""
    script = Path(sys.executable).parent / "onmt_train"
    target = [str(script)] if script.is_file() else ["-m", "onmt.bin.train"]
    env = dict(os.environ, TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD="1")  # OpenNMT's own torch.load
    proc = subprocess.run(
        [sys.executable, "-m", "amp_patch", "run", "--device", "cpu", *target, "-config",
         "cfg.yaml", "-save_model", f"out/{name}", *args],
        cwd=corpus, env=env, capture_output=True, text=True, timeout=600)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-4000:]
    assert "not served by amp_patch" not in log, log[-2000:]
    return {int(step): float(ppl) for step, ppl in _STEP.findall(log)}, log


@pytest.fixture(scope="module")
def runs(corpus):
    """Each run once per module: ``runs(name, *args)`` (the O2 run serves both of its tests)."""
    done: dict[str, tuple[dict[int, float], str]] = {}

    def run(name: str, *args: str) -> tuple[dict[int, float], str]:
        if name not in done:
            done[name] = _onmt_train(corpus, name, *args)
        return done[name]

    return run


@pytest.fixture(scope="module")
def fp32(runs) -> dict[int, float]:
    ppl, _ = runs("fp32", "-optim", "adam")
    assert sorted(ppl) == [5, STEPS] and ppl[STEPS] < ppl[5]  # it learns
    return ppl


RECIPES = {
    "fusedadam-O1": ("-model_dtype", "fp16", "-optim", "fusedadam", "-apex_opt_level", "O1"),
    "fusedadam-O2": ("-model_dtype", "fp16", "-optim", "fusedadam", "-apex_opt_level", "O2"),
    "fusedadam-legacy": ("-model_dtype", "fp16", "-optim", "fusedadam", "-apex_opt_level", ""),
    "adam-amp": ("-model_dtype", "fp16", "-optim", "adam"),
}


def _near(got: float, want: float) -> bool:
    return abs(got - want) <= 0.03 * want  # the half run's loss is the fp32 one's, within 3%


@pytest.mark.parametrize("recipe", RECIPES)
def test_recipe_trains_unchanged_near_fp32(runs, fp32, recipe):
    ppl, log = runs(recipe, *RECIPES[recipe])
    assert sorted(ppl) == [5, STEPS], log[-3000:]
    assert all(_near(ppl[s], fp32[s]) for s in ppl), (ppl, fp32)
    if recipe == "fusedadam-O2":
        assert "opt_level             : O2" in log


def test_o2_resumes_from_its_checkpoint(corpus, runs, fp32):
    runs("fusedadam-O2", *RECIPES["fusedadam-O2"])
    checkpoint = corpus / "out" / f"fusedadam-O2_step_{SAVE}.pt"
    assert checkpoint.is_file()
    ppl, log = _onmt_train(corpus, "o2-resumed", *RECIPES["fusedadam-O2"], "-train_from",
                           str(checkpoint))
    assert f"Loading checkpoint from {checkpoint}" in log
    assert sorted(ppl) == [STEPS]  # it went on from step 5
    assert _near(ppl[STEPS], fp32[STEPS]), (ppl, fp32)
