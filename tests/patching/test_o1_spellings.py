"""O1 casts by op, not by spelling: every spelling of a listed op casts alike.

The spellings are derived (amp_patch.patching.op_spellings): torch, F, the Tensor
method and operators, in-place forms, torch.special / torch.linalg and the
aliases torch documents. The lists themselves are checked against the
autocast lists of the installed torch's headers.
"""

from __future__ import annotations

import collections
import importlib.util
import pathlib
import re

import pytest
import torch
import torch.nn.functional as F

import amp_patch
from amp_patch.patching import lists, op_spellings
from amp_patch.patching import spellings
from amp_patch.patching.wrappers import Policy

from _o1_samples import NO_CPU_KERNEL, call, floating, reached_dtypes, retype, sample

HALF = torch.bfloat16
pytestmark = pytest.mark.filterwarnings("ignore:.*is deprecated and it is just left for JIT")

#: torch computes ``other / self`` as ``self.reciprocal() * other``; reciprocal is on the
#: fp32 list, so the reflected division of two half tensors comes out fp32 (so it did
#: under Apex, and autocast's CUDA list has reciprocal too).
_REFLECTED_DIVISION = {"__rtruediv__", "__rdiv__"}


@pytest.fixture
def o1():
    amp_patch.initialize(torch.nn.Linear(1, 1), opt_level="O1", half_dtype=HALF, verbosity=0)


def _outcome(spelling, args, kwargs):
    """What a call did: the dtypes of its floating outputs (or of what reached the kernel
    of an op without a CPU kernel), or the error type."""
    if spelling.op in NO_CPU_KERNEL:
        return ("reached",) + reached_dtypes(spelling, args, kwargs)
    try:
        out = call(spelling, args, kwargs)
    except (RuntimeError, TypeError) as exc:
        return (type(exc).__name__,)
    return tuple(t.dtype for t in floating(out)) or (type(out).__name__,)


def _inputs(spelling, kind):
    args, kwargs = sample(spelling, torch.float32)
    if kind == "fp32":
        return args, kwargs
    if kind == "half":
        return retype(args, lambda t: t.to(HALF)), kwargs
    seen = []  # mixed: the first floating tensor half, the rest fp32

    def first_half(t):
        seen.append(t)
        return t.to(HALF) if len(seen) == 1 else t
    return retype(args, first_half), kwargs


_EXPECTED = {
    Policy.HALF: {"fp32": HALF, "half": HALF},
    Policy.FP32: {"fp32": torch.float32, "half": torch.float32},
    Policy.BANNED: {"fp32": torch.float32, "half": "NotImplementedError"},
}


def _by_op():
    groups = collections.defaultdict(list)
    for s in spellings():
        if s.policy not in (Policy.IN_PLACE, Policy.IN_PLACE_FP32):
            groups[s.op].append(s)
    return sorted(groups.items())


@pytest.mark.parametrize("op,group", _by_op(), ids=[op for op, _ in _by_op()])
def test_every_spelling_of_an_op_casts_alike(o1, op, group):
    policy = group[0].policy
    kinds = ("fp32", "half", "mixed") if policy in (Policy.PROMOTE, Policy.SEQUENCE_PROMOTE) \
        else ("fp32", "half")
    for kind in kinds:
        outcomes = {}
        for s in group:
            if kind == "half" and s.name in _REFLECTED_DIVISION:
                continue
            args, kwargs = _inputs(s, kind)
            try:
                outcomes[s.qualname] = _outcome(s, args, kwargs)
            except NotImplementedError:
                outcomes[s.qualname] = ("NotImplementedError",)
        assert len(set(outcomes.values())) == 1, (kind, outcomes)
        outcome = next(iter(outcomes.values()))
        expected = _EXPECTED.get(policy, {}).get(kind)
        if isinstance(expected, str):
            assert outcome == (expected,)
        elif expected is not None:
            assert set(outcome) - {"reached"} == {expected}, (kind, outcome)
        elif kind == "mixed":  # promote: the widest, fp32
            assert torch.bfloat16 not in outcome, outcome


def test_the_issue_examples(o1):
    x = torch.rand(4, 3, dtype=HALF)
    t = torch.rand(4, 3, dtype=HALF)
    y = torch.tensor([1, -1, 1, 1])
    fp32 = {
        "F.softmax": F.softmax(x, 0), "torch.softmax": torch.softmax(x, 0),
        "Tensor.softmax": x.softmax(0), "torch.special.softmax": torch.special.softmax(x, 0),
        "torch.log_softmax": torch.log_softmax(x, 0), "Tensor.log_softmax": x.log_softmax(0),
        "torch.layer_norm": torch.layer_norm(x, (3,)),
        "torch.group_norm": torch.group_norm(x.reshape(2, 2, 3), 2),
        "torch.rms_norm": torch.rms_norm(x, (3,)),
        "torch.cosine_similarity": torch.cosine_similarity(x, t),
        "torch.kl_div": torch.kl_div(x, t),
        "torch.poisson_nll_loss": torch.poisson_nll_loss(x, t, True, False, 1e-8, 1),
        "torch.cosine_embedding_loss": torch.cosine_embedding_loss(x, t, y),
        "torch.hinge_embedding_loss": torch.hinge_embedding_loss(x, t.sign()),
        "torch.margin_ranking_loss": torch.margin_ranking_loss(x, t, t.sign()),
        "torch.triplet_margin_loss": torch.triplet_margin_loss(x, t, x),
        "torch.binary_cross_entropy_with_logits": torch.binary_cross_entropy_with_logits(x, t),
        "torch.arccos": torch.arccos(x), "torch.special.expm1": torch.special.expm1(x),
        "torch.linalg.vector_norm": torch.linalg.vector_norm(x),
    }
    assert {k: v.dtype for k, v in fp32.items() if v.dtype != torch.float32} == {}
    grid = torch.rand(1, 2, 2, 2) * 2 - 1
    out = torch.grid_sampler(torch.rand(1, 2, 3, 3, dtype=HALF), grid, 0, 0, False)
    assert out.dtype == torch.float32
    assert (x.float() @ x.t()).dtype == HALF and torch.concat([x, x.float()]).dtype == torch.float32


def test_aliases_come_from_torch_docs():
    groups = op_spellings.aliases()
    assert {"acos", "arccos"} <= groups["acos"]
    assert {"cat", "concat", "concatenate"} <= groups["cat"]
    assert {"div", "divide", "true_divide"} <= groups["div"]
    names = {s.qualname for s in spellings() if s.op == "div"}
    assert {"torch.Tensor.__truediv__", "torch.Tensor.__rtruediv__", "torch.Tensor.__itruediv__",
            "torch.true_divide", "torch.Tensor.divide_"} <= names


def test_in_place_forms_follow_the_in_place_rules():
    by_name = {s.qualname: s.policy for s in spellings()}
    assert by_name["torch.Tensor.exp_"] is Policy.IN_PLACE_FP32
    assert by_name["torch.Tensor.arccos_"] is Policy.IN_PLACE_FP32
    assert by_name["torch.Tensor.__ipow__"] is Policy.IN_PLACE_FP32
    assert by_name["torch.Tensor.addmm_"] is Policy.IN_PLACE
    assert by_name["torch.Tensor.scatter_add_"] is Policy.IN_PLACE
    assert by_name["torch.Tensor.__iadd__"] is Policy.IN_PLACE
    # sequence promote and banned ops have no in-place rule: none is derived for them.
    assert not any(s.policy in (Policy.IN_PLACE, Policy.IN_PLACE_FP32)
                   and s.op in ("cat", "stack", "binary_cross_entropy") for s in spellings())


def test_a_spelling_of_two_policies_is_refused(monkeypatch):
    monkeypatch.setattr(lists, "O1", lists.OpLists(half=("acos",), fp32=("arccos",)))
    spellings.cache_clear()
    try:
        with pytest.raises(RuntimeError, match="spells 'acos' \\(half\\) and 'arccos' \\(fp32\\)"):
            spellings()
    finally:
        monkeypatch.undo()
        spellings.cache_clear()


def test_union_refuses_an_op_on_two_lists():
    with pytest.raises(ValueError, match="'exp' is on the fp32 and the half lists"):
        lists.union(lists.OpLists(fp32=("exp",)), lists.OpLists(half=("exp",)))


def test_o1_is_apex_plus_autocast():
    o1 = lists.O1.policies()
    for source in (lists.APEX, lists.AUTOCAST_CUDA):
        assert source.policies().items() <= o1.items()
    assert set(o1) == set(lists.APEX.policies()) | set(lists.AUTOCAST_CUDA.policies())


#: Ops in torch 2.13's autocast lists that torch 2.6's lack.
_AUTOCAST_OPS_SINCE_2_6 = {"rms_norm"}


def _header_lists(text):
    """{macro: op names} of the AT_FORALL_* op lists in ATen/autocast_mode.h."""
    out = {}
    for macro in ("LOWER_PRECISION_FP", "FP32", "FP32_SET_OPT_DTYPE", "PROMOTE",
                  "DIFFERENT_REDISPATCH_SIGNATURE"):
        body = re.search(rf"#define AT_FORALL_{macro}\(_\)(.*?)(?:\n\s*\n|#define|#else|\Z)", text, re.S)
        assert body, macro
        out[macro] = set(re.findall(r"_\((?:ADD_NS\()?(\w+)", body.group(1)))
    return out


def test_autocast_lists_match_the_installed_torch():
    header = pathlib.Path(torch.__file__).parent / "include" / "ATen" / "autocast_mode.h"
    if not header.exists():
        pytest.skip("the installed torch ships no ATen headers")
    found = _header_lists(header.read_text())
    cuda_only = {"cudnn_convolution", "cudnn_convolution_transpose"}  # in autocast_mode.cpp
    fp32 = found["FP32"] | found["FP32_SET_OPT_DTYPE"] | found["DIFFERENT_REDISPATCH_SIGNATURE"]
    # The lists are torch 2.13's; an older torch's autocast may lack ops added since.
    pairs = [("half", found["LOWER_PRECISION_FP"], set(lists.AUTOCAST_CUDA.half) - cuda_only),
             ("fp32", fp32, set(lists.AUTOCAST_CUDA.fp32)),
             ("promote", found["PROMOTE"], set(lists.AUTOCAST_CUDA.promote))]
    for name, theirs, ours in pairs:
        assert theirs <= ours, (name, theirs - ours)
        assert ours - theirs <= _AUTOCAST_OPS_SINCE_2_6, (name, ours - theirs)
        if torch.__version__ >= "2.13":
            assert theirs == ours, (name, ours - theirs)


def _o1_lists_doc():
    """tools/o1_lists_doc.py, the generator of docs/o1_lists.md (a script, not a module)."""
    tool = pathlib.Path(__file__).resolve().parents[2] / "tools" / "o1_lists_doc.py"
    spec = importlib.util.spec_from_file_location("o1_lists_doc", tool)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_docs_table_is_up_to_date():
    path = pathlib.Path(__file__).resolve().parents[2] / "docs" / "o1_lists.md"
    text = path.read_text()
    made_with = re.search(r"under torch ([\w.]+):", text).group(1)
    if made_with != torch.__version__.split("+")[0]:
        pytest.skip(f"docs/o1_lists.md lists torch {made_with}'s spellings")
    assert text == _o1_lists_doc().render(), "run python tools/o1_lists_doc.py"
