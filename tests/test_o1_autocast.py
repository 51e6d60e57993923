"""O1's casting decisions against ``torch.autocast``'s, derived by running both.

For every op of the O1 lists (function forms on ``torch`` and
``torch.nn.functional``), the sample is run three ways: unpatched, unpatched
under ``torch.autocast("cpu", half)``, and under O1. An op "casts" in a regime
when its output dtype differs from the unpatched run. Run with fp32 inputs
(the half list) and with half inputs (the fp32 list). Where both cast, the
output dtypes must agree. Where only one casts, the op must be among the
documented differences below (and each documented difference must still be
one, so the list stays true):

- O1 casts, autocast does not. Half: ``addmv addr mv convolution lstm_cell
  gru_cell`` (Apex's CUDA-era list is longer than CPU autocast's
  lower-precision list; ``einsum``, ``chain_matmul``, ``linalg.multi_dot``
  and the tanh/relu cells agree because autocast reaches them through
  ``matmul``/``linear``). fp32: the pointwise and reduction ops and the ``F``
  ops that CPU autocast runs in the input dtype (``exp log pow sum norm std
  var cumsum softmax log_softmax layer_norm group_norm rms_norm gelu
  softplus normalize interpolate``, ...): O1 keeps Apex's rule that they run
  in fp32. ``pdist`` has no bf16 kernel: it fails unpatched and under
  autocast, and runs (in fp32) under O1.
- autocast casts, O1 does not: none.
"""

from __future__ import annotations

import functools

import pytest
import torch

import amp_patch
from amp_patch.patching import namespaces
from amp_patch.patching.wrappers import Policy

from _o1_samples import floating, sample

HALF = torch.bfloat16


def _resolve(target, name):
    return functools.reduce(getattr, name.split("."), target)


def _ops():
    out = []
    for target, prefix, lists in namespaces():
        if target is torch.Tensor or prefix == "torch._VF":
            continue
        for policy in (Policy.HALF, Policy.FP32):
            for name in getattr(lists, policy.value):
                try:
                    fn = _resolve(target, name)
                except AttributeError:
                    continue
                out.append((f"{prefix}.{name}", target, name, policy, fn))
    return out


def _dtype(out):
    ts = floating(out)
    return ts[0].dtype if ts else None


def _run(fn, args, kwargs):
    # Some ops lack a kernel for the half input (pdist in bf16): that is a result too.
    try:
        return _dtype(fn(*args, **kwargs))
    except (RuntimeError, NotImplementedError) as exc:
        return f"error: {type(exc).__name__}"


def _decisions():
    """{op: (input dtype, unpatched, autocast, O1)} for every op, all run here."""
    ops = _ops()
    rows = {}
    inputs = {Policy.HALF: torch.float32, Policy.FP32: HALF}
    plain = {}
    for label, target, name, policy, fn in ops:
        args, kwargs = sample(name, inputs[policy])
        plain[label] = _run(fn, args, kwargs)
        with torch.autocast("cpu", dtype=HALF):
            auto = _run(fn, args, kwargs)
        rows[label] = [inputs[policy], plain[label], auto, None]
    amp_patch.initialize(torch.nn.Linear(1, 1), opt_level="O1", half_dtype=HALF, verbosity=0)
    try:
        for label, target, name, policy, _ in ops:
            args, kwargs = sample(name, inputs[policy])
            rows[label][3] = _dtype(_resolve(target, name)(*args, **kwargs))
    finally:
        amp_patch.deinitialize()
    return rows


O1_ONLY = {
    # half list: Apex's (CUDA-era) list is longer than CPU autocast's lower-precision list.
    # einsum, chain_matmul, multi_dot and the tanh/relu cells agree: autocast reaches
    # them through matmul/linear inside; these do not decompose that way.
    "torch.addmv", "torch.addr", "torch.mv", "torch.convolution", "torch.lstm_cell",
    "torch.gru_cell",
}
# fp32 list: everything that CPU autocast runs in the input dtype is an O1-only cast.
O1_ONLY_FP32_PREFIXES = ("torch.", "torch.nn.functional.")


@pytest.fixture(scope="module")
def decisions():
    return _decisions()


def test_where_both_cast_they_agree(decisions):
    both = {k: v for k, v in decisions.items() if v[2] != v[1] and v[3] != v[1]}
    assert both, "expected ops that both autocast and O1 cast"
    disagree = {k: v for k, v in both.items() if v[2] != v[3]}
    assert not disagree


def test_autocast_never_casts_where_o1_does_not(decisions):
    only_auto = sorted(k for k, v in decisions.items() if v[2] != v[1] and v[3] == v[1])
    assert only_auto == []


def test_o1_only_casts_are_the_documented_ones(decisions):
    only_o1 = {k for k, v in decisions.items() if v[3] != v[1] and v[2] == v[1]}
    half_only = {k for k in only_o1 if decisions[k][0] == torch.float32}
    fp32_only = only_o1 - half_only
    assert half_only == O1_ONLY & set(decisions)
    assert all(k.startswith(O1_ONLY_FP32_PREFIXES) for k in fp32_only)


def test_every_listed_op_casts_under_o1(decisions):
    # O1 casts every listed op with these inputs; autocast agreement is checked above.
    assert all(v[3] != v[1] for v in decisions.values())
