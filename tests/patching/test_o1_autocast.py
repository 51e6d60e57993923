"""O1's casting decisions against ``torch.autocast``'s, derived by running both.

For every spelling of the half and fp32 lists (torch, F, Tensor methods,
torch.special / torch.linalg, aliases), the sample is run three ways:
unpatched, unpatched under ``torch.autocast("cpu", half)``, and under O1.
A spelling "casts" in a regime when its output dtype differs from the
unpatched run. Run with fp32 inputs (the half list) and with half inputs
(the fp32 list). Where both cast, the output dtypes must agree. Where only
one casts, the op must be among the documented differences below (and each
documented difference must still be one, so the list stays true):

- O1 casts, autocast does not. Half: ``addmv addr mv convolution
  _convolution gru lstm_cell gru_cell`` (the CUDA lists and Apex's are
  longer than CPU autocast's lower-precision list; CPU autocast casts only
  the deprecated overload of ``_convolution``; ``einsum``, ``chain_matmul``,
  ``linalg.multi_dot`` and the tanh/relu cells agree because autocast
  reaches them through ``matmul``/``linear``). fp32: the pointwise and
  reduction ops, norms and ``F`` ops that CPU autocast runs in the input
  dtype (:data:`O1_ONLY_FP32`): O1 keeps Apex's and the CUDA list's rule that
  they run in fp32. ``pdist`` has no bf16 kernel: it fails unpatched and
  under autocast, and runs (in fp32) under O1.
- autocast casts, O1 does not: none.
"""

from __future__ import annotations

import pytest
import torch

import amp_patch
from amp_patch.patching import spellings
from amp_patch.patching.wrappers import Policy

from _o1_samples import NO_CPU_KERNEL, call, floating, sample

HALF = torch.bfloat16
pytestmark = pytest.mark.filterwarnings("ignore:.*is deprecated and it is just left for JIT")


def _ops():
    """Every out-of-place spelling of the half and fp32 lists that runs on the CPU."""
    return [s for s in spellings()
            if s.policy in (Policy.HALF, Policy.FP32) and s.prefix != "torch._VF"
            and s.op not in NO_CPU_KERNEL]


def _dtype(out):
    ts = floating(out)
    return ts[0].dtype if ts else None


def _run(spelling, args, kwargs):
    # Some ops lack a kernel for the half input (pdist in bf16): that is a result too.
    try:
        return _dtype(call(spelling, args, kwargs))
    except (RuntimeError, NotImplementedError) as exc:
        return f"error: {type(exc).__name__}"


#: RNNs whose bf16 kernel under CPU autocast is oneDNN's RNN primitive, which oneDNN cannot
#: create on a host without native bf16 ("could not create a primitive descriptor"): there
#: autocast's cast to bf16 ends in that error, while O1 runs the op (docs/design.md).
ONEDNN_RNN = {"lstm", "gru", "rnn_tanh", "rnn_relu"}


def _decisions():
    """{spelling: (input dtype, unpatched, autocast, O1)} for every spelling, all run here."""
    ops = _ops()
    rows = {}
    inputs = {Policy.HALF: torch.float32, Policy.FP32: HALF}
    native = amp_patch.cpu_half_support().bfloat16.kind == "native"
    for s in ops:
        args, kwargs = sample(s, inputs[s.policy])
        plain = _run(s, args, kwargs)
        with torch.autocast("cpu", dtype=HALF):
            auto = _run(s, args, kwargs)
        if isinstance(auto, str) and s.op in ONEDNN_RNN and not native:
            auto = HALF  # the cast was made; the kernel it reached fails on this host
        rows[s] = [inputs[s.policy], plain, auto, None]
    amp_patch.initialize(torch.nn.Linear(1, 1), opt_level="O1", half_dtype=HALF, verbosity=0)
    try:
        for s in ops:
            args, kwargs = sample(s, inputs[s.policy])
            rows[s][3] = _dtype(call(s, args, kwargs))
    finally:
        amp_patch.deinitialize()
    return rows


#: Half-list ops that CPU autocast leaves in fp32 (see the module docstring).
O1_ONLY_HALF = {"addmv", "addr", "mv", "convolution", "_convolution", "gru", "lstm_cell",
                "gru_cell"}
#: fp32-list ops that CPU autocast runs in the input dtype.
O1_ONLY_FP32 = {
    "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log1p", "log2",
    "reciprocal", "rsqrt", "sinh", "tan", "pow", "cumprod", "cumsum", "dist", "logsumexp",
    "norm", "frobenius_norm", "nuclear_norm", "linalg_vector_norm", "linalg_matrix_norm",
    "renorm", "std", "sum", "var", "softmax", "log_softmax", "softmin", "softplus", "gelu",
    "layer_norm", "native_layer_norm", "group_norm", "rms_norm", "local_response_norm",
    "normalize", "cosine_similarity", "interpolate", "multilabel_soft_margin_loss", "pdist",
    "cpu",
}


@pytest.fixture(scope="module")
def decisions():
    return _decisions()


def test_where_both_cast_they_agree(decisions):
    both = {k: v for k, v in decisions.items() if v[2] != v[1] and v[3] != v[1]}
    assert both, "expected ops that both autocast and O1 cast"
    disagree = {k.qualname: v for k, v in both.items() if v[2] != v[3]}
    assert not disagree


def test_autocast_never_casts_where_o1_does_not(decisions):
    only_auto = sorted(k.qualname for k, v in decisions.items() if v[2] != v[1] and v[3] == v[1])
    assert only_auto == []


def test_o1_only_casts_are_the_documented_ones(decisions):
    only_o1 = {k for k, v in decisions.items() if v[3] != v[1] and v[2] == v[1]}
    assert {k.op for k in only_o1 if decisions[k][0] == torch.float32} == O1_ONLY_HALF
    assert {k.op for k in only_o1 if decisions[k][0] == HALF} == O1_ONLY_FP32


def test_spellings_of_one_op_agree_with_autocast_alike(decisions):
    # Where autocast casts one spelling of an op, it casts them all, and so does O1.
    by_op = {}
    for s, v in decisions.items():
        by_op.setdefault(s.op, set()).add((v[2] != v[1], v[3] != v[1]))
    assert {op: d for op, d in by_op.items() if len(d) > 1} == {}


def test_every_listed_op_casts_under_o1(decisions):
    # O1 casts every listed op with these inputs; autocast agreement is checked above.
    assert all(v[3] != v[1] for v in decisions.values())
