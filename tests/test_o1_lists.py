"""Every name of every O1 cast list that the installed torch has: the dtype its
policy promises, for the function and the method forms; float64 and integer
inputs untouched; fp32 leaves get fp32 gradients."""

from __future__ import annotations

import functools

import pytest
import torch
import wrapt

import amp_patch
from amp_patch.patching import namespaces
from amp_patch.patching.wrappers import Policy

from _o1_samples import SAMPLES, floating, retype, sample

_SKIP_HERE = {"lstm", "gru", "rnn_tanh", "rnn_relu"}  # whole-sequence RNNs: test_o1_rnn.py
# torch implements ``other / self`` as ``self.reciprocal() * other``, and reciprocal is on
# the fp32 list, so even a pure-half ``__rtruediv__`` comes out fp32 (as under Apex).
_VIA_FP32_OP = {"__rtruediv__", "__rdiv__"}


def _resolve(target, name):
    return functools.reduce(getattr, name.split("."), target)


def _cases():
    out = []
    for target, prefix, lists in namespaces():
        for policy in Policy:
            names = ([n for n, _ in lists.banned] if policy is Policy.BANNED
                     else getattr(lists, policy.value))
            for name in names:
                if name in _SKIP_HERE:
                    continue
                try:
                    original = wrapt.resolve_path(target, name)[2]
                except (wrapt.PathResolutionError, AttributeError):
                    continue  # not in this torch: skipped, as install skips it
                out.append(pytest.param(target, name, policy, original, id=f"{prefix}.{name}"))
    return out


CASES = _cases()


def _call(target, name, args, kwargs):
    if target is torch.Tensor:
        return getattr(args[0], name)(*args[1:], **kwargs)
    return _resolve(target, name)(*args, **kwargs)


@pytest.fixture
def o1(request):
    half = getattr(request, "param", torch.bfloat16)
    amp_patch.initialize(torch.nn.Linear(1, 1), opt_level="O1", half_dtype=half, verbosity=0)
    return half


def test_every_listed_name_has_a_sample():
    missing = sorted({p.values[1].rstrip("_") if not p.values[1].startswith("__") else p.values[1]
                      for p in CASES} - set(SAMPLES))
    assert not missing


def test_lists_cover_the_spec_sizes():
    # A guard against a list silently emptying: hundreds of patches are expected.
    assert len(CASES) > 200


def _first_half_rest_fp32(args, half):
    seen = []

    def fn(t):
        seen.append(t)
        return t.to(half) if len(seen) == 1 else t.float()
    return retype(args, fn)


@pytest.mark.parametrize("target,name,policy,original", CASES)
def test_policy_dtype(o1, target, name, policy, original):
    half = o1
    if policy is Policy.HALF:
        args, kwargs = sample(name, torch.float32)
        out = _call(target, name, args, kwargs)
        assert floating(out) and all(t.dtype == half for t in floating(out))
    elif policy is Policy.FP32:
        args, kwargs = sample(name, half)
        out = _call(target, name, args, kwargs)
        assert floating(out) and all(t.dtype == torch.float32 for t in floating(out))
    elif policy is Policy.PROMOTE or policy is Policy.SEQUENCE_PROMOTE:
        args, kwargs = sample(name, torch.float32)
        mixed = _first_half_rest_fp32(args, half)
        out = _call(target, name, mixed, kwargs)
        for t in floating(out):
            assert t.dtype == torch.float32
        if not floating(out):  # comparisons: the same answer as in fp32
            assert torch.equal(out, original(*retype(mixed, torch.Tensor.float), **kwargs))
        if name not in _VIA_FP32_OP:
            same = retype(args, lambda t: t.to(half))
            assert all(t.dtype == half for t in floating(_call(target, name, same, kwargs)))
    elif policy is Policy.BANNED:
        args, kwargs = sample(name, half)
        with pytest.raises(NotImplementedError, match="binary_cross_entropy_with_logits"):
            _call(target, name, args, kwargs)
        args32, kwargs = sample(name, torch.float32)
        assert _call(target, name, args32, kwargs).dtype == torch.float32
    elif policy is Policy.IN_PLACE_FP32:
        args, kwargs = sample(name, half)
        with pytest.raises(NotImplementedError, match="in-place|in place"):
            _call(target, name, args, kwargs)
        args, kwargs = sample(name, torch.float32)
        mixed = (args[0],) + tuple(retype(list(args[1:]), lambda t: t.to(half)))
        out = _call(target, name, mixed, kwargs)
        assert out is args[0] and out.dtype == torch.float32
    else:
        args, kwargs = sample(name, torch.float32)
        mixed = (args[0].to(half),) + tuple(args[1:])
        out = _call(target, name, mixed, kwargs)
        assert out is mixed[0] and out.dtype == half


@pytest.mark.parametrize("call", [
    lambda h: torch.nn.functional.binary_cross_entropy(torch.rand(3, dtype=h), torch.rand(3, dtype=h)),
    lambda h: torch.rand(3, dtype=h).exp_(),
    lambda h: torch.exp_(torch.rand(3, dtype=h)),
    lambda h: torch.rand(3, dtype=h).__ipow__(2),
], ids=["F.binary_cross_entropy", "Tensor.exp_", "torch.exp_", "Tensor.__ipow__"])
def test_refusals_are_not_implemented_errors(o1, call):
    # Apex raised NotImplementedError; it is a RuntimeError too, so callers of either kind work.
    with pytest.raises(NotImplementedError, match="amp_patch O1"):
        call(o1)
    with pytest.raises(RuntimeError):
        call(o1)


@pytest.mark.parametrize("o1", [torch.float16], indirect=True, ids=["fp16"])
@pytest.mark.parametrize("target,name,policy,original",
                         [c for c in CASES if c.values[2] is Policy.HALF])
def test_half_list_fp16(o1, target, name, policy, original):
    args, kwargs = sample(name, torch.float32)
    out = _call(target, name, args, kwargs)
    assert all(t.dtype == torch.float16 for t in floating(out))


@pytest.mark.parametrize("target,name,policy,original", CASES)
def test_float64_passes_untouched(o1, target, name, policy, original):
    args, kwargs = sample(name, torch.float64)
    try:
        expected = original(*sample(name, torch.float64)[0], **kwargs)
    except (RuntimeError, TypeError, NotImplementedError):
        pytest.skip("the op itself does not take float64 here")
    out = _call(target, name, args, kwargs)
    for got, want in zip(floating(out), floating(expected)):
        assert got.dtype == torch.float64
        torch.testing.assert_close(got, want, rtol=0, atol=0)


_INT_OK = {"add", "sub", "mul", "eq", "ne", "lt", "le", "gt", "ge", "sum", "prod", "cumsum",
           "cat", "stack", "__add__", "__mul__", "__eq__", "dot", "mm", "matmul", "cpu"}


@pytest.mark.parametrize("target,name,policy,original",
                         [c for c in CASES if c.values[1] in _INT_OK])
def test_integers_pass_untouched(o1, target, name, policy, original):
    args, kwargs = sample(name, torch.float32)
    ints = retype(args, lambda t: (t * 10).long())
    expected = original(*ints, **kwargs)
    out = _call(target, name, ints, kwargs)
    assert out.dtype == expected.dtype and torch.equal(out, expected)


@pytest.mark.parametrize("target,name,policy,original",
                         [c for c in CASES if c.values[2] in (Policy.HALF, Policy.FP32)
                          and c.values[1] not in ("cpu",)])
def test_fp32_leaves_get_fp32_grads(o1, target, name, policy, original):
    args, kwargs = sample(name, torch.float32, requires_grad=True)
    leaves = [t for t in floating(args) if t.is_leaf]
    out = _call(target, name, args, kwargs)
    total = sum(t.float().sum() for t in floating(out) if t.requires_grad)
    if not torch.is_tensor(total):
        pytest.skip("no differentiable output")
    total.backward()
    assert any(leaf.grad is not None for leaf in leaves)
    for leaf in leaves:
        assert leaf.grad is None or leaf.grad.dtype == torch.float32
