"""Every spelling of every op on the O1 cast lists that the installed torch has: the
dtype its policy promises, for function, method, operator, alias and in-place forms;
float64 and integer inputs untouched; fp32 leaves get fp32 gradients.

Per spelling, the checks run on the wrappers the session installs (the C fast path when
built). What tells the two wrapper paths apart is the policy and how the wrapper is reached
(a function, a Tensor method, an operator), not the op: each path runs one spelling of
each such group (:func:`_one_per_group`), and test_o1_native.py runs every branch of
both paths side by side.
"""

from __future__ import annotations

import pytest
import torch
import wrapt

import amp_patch
from amp_patch.patching import spellings
from amp_patch.patching.wrappers import Policy

from _o1_samples import NO_CPU_KERNEL, SAMPLES, call, floating, retype, sample
from _o1_samples import wrapper_path  # noqa: F401  (fixture: both wrapper paths)

# torch implements ``other / self`` as ``self.reciprocal() * other``, and reciprocal is on
# the fp32 list, so even a pure-half ``__rtruediv__`` comes out fp32 (as under Apex).
_VIA_FP32_OP = {"__rtruediv__", "__rdiv__"}
# frobenius_norm and nuclear_norm are on autocast's list but deprecated in torch.
pytestmark = pytest.mark.filterwarnings("ignore:.*is deprecated and it is just left for JIT")


def _cases():
    out = []
    for s in spellings():
        if s.op in NO_CPU_KERNEL:
            continue  # test_o1_spellings.py checks what reaches their kernels
        original = wrapt.resolve_path(s.target, s.name)[2]
        out.append(pytest.param(s, original, id=s.qualname))
    return out


CASES = _cases()


def _kind(spelling) -> str:
    if spelling.name.startswith("__"):
        return "operator"
    return "method" if spelling.target is torch.Tensor else "function"


def _one_per_group(cases, dtype=torch.float32, candidates=False):
    """One case per (policy, function/method/operator): the one whose sample has the most
    floating tensors (the most for the wrapper to scan), or with ``candidates`` the whole
    group in that order, as one param."""
    groups = {}
    for case in cases:
        spelling = case.values[0]
        groups.setdefault((spelling.policy, _kind(spelling)), []).append(case)
    out = []
    for (policy, kind), group in groups.items():
        group = sorted(group, key=lambda c: -len(floating(sample(c.values[0], dtype))))
        if candidates:
            out.append(pytest.param([c.values for c in group], id=f"{policy.value}-{kind}"))
        else:
            out.append(pytest.param(*group[0].values, id=f"{policy.value}-{kind}"))
    return out


def _start_o1(half):
    amp_patch.initialize(torch.nn.Linear(1, 1), opt_level="O1", half_dtype=half, verbosity=0)
    return half


@pytest.fixture
def o1(request, wrapper_path):
    """O1 on each wrapper path in turn."""
    return _start_o1(getattr(request, "param", torch.bfloat16))


@pytest.fixture
def o1_default(request):
    """O1 with the wrappers a session installs by default."""
    return _start_o1(getattr(request, "param", torch.bfloat16))


def test_every_spelling_has_a_sample():
    missing = sorted(s.qualname for s in spellings()
                     if s.qualname not in SAMPLES and s.op not in SAMPLES)
    assert not missing


def test_lists_cover_the_spec_sizes():
    # A guard against a list silently emptying: hundreds of patches are expected.
    assert len(CASES) > 300


def _first_half_rest_fp32(args, half):
    seen = []

    def fn(t):
        seen.append(t)
        return t.to(half) if len(seen) == 1 else t.float()
    return retype(args, fn)


@pytest.mark.parametrize("spelling,original", CASES)
def test_policy_dtype(o1_default, spelling, original):
    _check_policy(o1_default, spelling, original)


@pytest.mark.parametrize("spelling,original", _one_per_group(CASES))
def test_policy_dtype_on_each_wrapper_path(o1, spelling, original):
    _check_policy(o1, spelling, original)


def _check_policy(half, spelling, original):
    name, policy = spelling.name, spelling.policy
    if policy is Policy.HALF:
        args, kwargs = sample(spelling, torch.float32)
        out = call(spelling, args, kwargs)
        assert floating(out) and all(t.dtype == half for t in floating(out))
    elif policy is Policy.FP32:
        args, kwargs = sample(spelling, half)
        out = call(spelling, args, kwargs)
        assert floating(out) and all(t.dtype == torch.float32 for t in floating(out))
    elif policy is Policy.PROMOTE or policy is Policy.SEQUENCE_PROMOTE:
        args, kwargs = sample(spelling, torch.float32)
        mixed = _first_half_rest_fp32(args, half)
        out = call(spelling, mixed, kwargs)
        for t in floating(out):
            assert t.dtype == torch.float32
        if not floating(out):  # comparisons: the same answer as in fp32
            expected = original(*retype(mixed, torch.Tensor.float), **kwargs)
            assert torch.equal(out, expected) if torch.is_tensor(out) else out == expected
        if name not in _VIA_FP32_OP:
            same = retype(args, lambda t: t.to(half))
            assert all(t.dtype == half for t in floating(call(spelling, same, kwargs)))
    elif policy is Policy.BANNED:
        args, kwargs = sample(spelling, half)
        with pytest.raises(NotImplementedError, match="binary_cross_entropy_with_logits"):
            call(spelling, args, kwargs)
        args32, kwargs = sample(spelling, torch.float32)
        assert call(spelling, args32, kwargs).dtype == torch.float32
    elif policy is Policy.IN_PLACE_FP32:
        args, kwargs = sample(spelling, half)
        with pytest.raises(NotImplementedError, match="in-place|in place"):
            call(spelling, args, kwargs)
        args, kwargs = sample(spelling, torch.float32)
        mixed = (args[0],) + tuple(retype(list(args[1:]), lambda t: t.to(half)))
        out = call(spelling, mixed, kwargs)
        assert out is args[0] and out.dtype == torch.float32
    else:
        args, kwargs = sample(spelling, torch.float32)
        mixed = (args[0].to(half),) + tuple(args[1:])
        out = call(spelling, mixed, kwargs)
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


@pytest.mark.parametrize("o1_default", [torch.float16], indirect=True, ids=["fp16"])
@pytest.mark.parametrize("spelling,original",
                         [c for c in CASES if c.values[0].policy is Policy.HALF])
def test_half_list_fp16(o1_default, spelling, original):
    args, kwargs = sample(spelling, torch.float32)
    out = call(spelling, args, kwargs)
    assert all(t.dtype == torch.float16 for t in floating(out))


@pytest.mark.parametrize("group", _one_per_group(CASES, torch.float64, candidates=True))
def test_float64_passes_untouched(o1, group):
    # The first spelling of the group whose op takes float64 on this device.
    for spelling, original in group:
        args, kwargs = sample(spelling, torch.float64)
        try:
            expected = original(*sample(spelling, torch.float64)[0], **kwargs)
            break
        except (RuntimeError, TypeError, NotImplementedError):
            continue
    else:
        pytest.skip("no op of this group takes float64 here")
    out = call(spelling, args, kwargs)
    for got, want in zip(floating(out), floating(expected)):
        assert got.dtype == torch.float64
        torch.testing.assert_close(got, want, rtol=0, atol=0)


_INT_OK = {"add", "sub", "mul", "eq", "ne", "lt", "le", "gt", "ge", "sum", "prod", "cumsum",
           "cat", "stack", "__add__", "__mul__", "__eq__", "dot", "mm", "matmul", "cpu"}


@pytest.mark.parametrize("spelling,original",
                         _one_per_group([c for c in CASES if c.values[0].name in _INT_OK]))
def test_integers_pass_untouched(o1, spelling, original):
    args, kwargs = sample(spelling, torch.float32)
    ints = retype(args, lambda t: (t * 10).long())
    expected = original(*ints, **kwargs)
    out = call(spelling, ints, kwargs)
    assert out.dtype == expected.dtype and torch.equal(out, expected)


@pytest.mark.parametrize("spelling,original",
                         _one_per_group([c for c in CASES
                                         if c.values[0].policy in (Policy.HALF, Policy.FP32)
                                         and c.values[0].name not in ("cpu",)]))
def test_fp32_leaves_get_fp32_grads(o1, spelling, original):
    args, kwargs = sample(spelling, torch.float32, requires_grad=True)
    leaves = [t for t in floating(args) if t.is_leaf]
    out = call(spelling, args, kwargs)
    total = sum(t.float().sum() for t in floating(out) if t.requires_grad)
    if not torch.is_tensor(total):
        pytest.skip("no differentiable output")
    total.backward()
    assert any(leaf.grad is not None for leaf in leaves)
    for leaf in leaves:
        assert leaf.grad is None or leaf.grad.dtype == torch.float32
