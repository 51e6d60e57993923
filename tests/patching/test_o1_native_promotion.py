"""O1's promote ops left to torch's own type promotion (lists.NATIVE_PROMOTION).

Where the two tensors are both 0-dim or neither, ``add``, ``sub``, ``mul``,
``div`` and the comparisons are called uncast: the outputs, their dtypes and
the grads reaching each input must be bitwise those of Apex's rule (cast both
to the widest, then call), and the forward dispatches no cast. Elsewhere
(a 0-dim tensor beside a dimensioned one, a third tensor, a float64) the
explicit cast stays. Both the C wrapper and the Python wrapper are checked.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import amp_patch
from amp_patch.patching import lists, wrappers

from tests.conftest import DEVICES

PAIRS = [(torch.float32, torch.bfloat16), (torch.bfloat16, torch.float32),
         (torch.float32, torch.float16), (torch.float16, torch.bfloat16)]
PAIR_IDS = ["f32-bf16", "bf16-f32", "f32-f16", "f16-bf16"]

#: (label, call, differentiable): each spelling family of the native ops.
CALLS = [
    ("torch.add", lambda a, b: torch.add(a, b), True),
    ("add alpha", lambda a, b: torch.add(a, b, alpha=0.3), True),
    ("Tensor.__add__", lambda a, b: a + b, True),
    ("Tensor.__radd__", lambda a, b: b.__radd__(a), True),
    ("torch.sub alpha", lambda a, b: torch.sub(a, b, alpha=1.7), True),
    ("Tensor.__rsub__", lambda a, b: b.__rsub__(a), True),
    ("torch.mul", lambda a, b: torch.mul(a, b), True),
    ("Tensor.__mul__", lambda a, b: a * b, True),
    ("torch.div", lambda a, b: torch.div(a, b), True),
    ("Tensor.__truediv__", lambda a, b: a / b, True),
    ("div floor", lambda a, b: torch.div(a, b, rounding_mode="floor"), False),
    ("torch.true_divide", lambda a, b: torch.true_divide(a, b), True),
    ("eq", lambda a, b: torch.eq(a, b), False),
    ("Tensor.__lt__", lambda a, b: a < b, False),
    ("ge", lambda a, b: a.ge(b), False),
    ("ne", lambda a, b: torch.ne(a, b), False),
]
CALL_IDS = [c[0] for c in CALLS]


class CastCounter(TorchDispatchMode):
    """Counts ``aten::_to_copy`` calls."""

    def __init__(self):
        super().__init__()
        self.casts = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ == "_to_copy":
            self.casts += 1
        return func(*args, **(kwargs or {}))


@pytest.fixture(params=[True, False], ids=["c-wrapper", "python-wrapper"])
def o1(request, monkeypatch):
    """O1 installed through the C wrapper or the Python one."""
    if request.param and not wrappers.native_available():
        pytest.skip("extension not built: the C wrapper is not there")
    monkeypatch.setattr(wrappers, "_use_native", request.param)
    amp_patch.initialize(torch.nn.Linear(1, 1), opt_level="O1", half_dtype=torch.bfloat16,
                         verbosity=0)
    yield
    amp_patch.deinitialize()


def _inputs(device, dtypes, shapes, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for dtype, shape in zip(dtypes, shapes):
        t = (torch.rand(shape, generator=g) * 4 - 2).to(dtype)
        t = torch.where(t.abs() < 0.05, torch.full_like(t, 0.5), t)  # no near-zero divisors
        out.append(t.to(device).requires_grad_(True))
    return out


def _run(call, a, b, differentiable):
    counter = CastCounter()
    with counter:
        out = call(a, b)
    grads = None
    if differentiable:
        grads = torch.autograd.grad(out, (a, b), torch.ones_like(out) * 0.37)
    return out.detach(), grads, counter.casts


def _reference(call, a, b, differentiable):
    """Apex's rule with O1 off: both cast to the widest, the op, grads back through the casts."""
    widest = torch.float32
    with amp_patch.disable_casts():
        out = call(a.to(widest), b.to(widest))
        grads = (torch.autograd.grad(out, (a, b), torch.ones_like(out) * 0.37)
                 if differentiable else None)
    return out.detach(), grads


def _same(x, y):
    return x.dtype == y.dtype and x.shape == y.shape and torch.equal(
        x.double().nan_to_num(7.0), y.double().nan_to_num(7.0))


def test_native_ops_are_listed_promote_ops():
    """Only ops that O1 promotes can skip the cast."""
    assert lists.NATIVE_PROMOTION <= set(lists.O1.promote)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("pair", PAIRS, ids=PAIR_IDS)
@pytest.mark.parametrize("label,call,differentiable", CALLS, ids=CALL_IDS)
@pytest.mark.parametrize("shapes", [((3, 5), (3, 5)), ((3, 5), (5,)), ((), ())],
                         ids=["same", "broadcast", "0-dim"])
def test_uncast_equals_apex_rule(o1, device, pair, label, call, differentiable, shapes):
    a, b = _inputs(device, pair, shapes)
    out, grads, casts = _run(call, a, b, differentiable)
    ref_out, ref_grads = _reference(call, a, b, differentiable)
    assert casts == 0, f"{label}: torch's own promotion needs no cast"
    assert _same(out, ref_out), label
    if differentiable:
        for g, r, t in zip(grads, ref_grads, (a, b)):
            assert g.dtype == t.dtype and _same(g, r), label


@pytest.mark.parametrize("pair", PAIRS, ids=PAIR_IDS)
@pytest.mark.parametrize("label,call,differentiable", CALLS, ids=CALL_IDS)
def test_zero_dim_beside_dimensioned_still_casts(o1, pair, label, call, differentiable):
    """torch would keep the dimensioned tensor's dtype here; Apex's rule gives the widest."""
    a, b = _inputs("cpu", pair, [(4,), ()])
    out, grads, casts = _run(call, a, b, differentiable)
    ref_out, ref_grads = _reference(call, a, b, differentiable)
    halves = sum(t.dtype != torch.float32 for t in (a, b))
    assert casts == halves and _same(out, ref_out), label
    if differentiable:
        for g, r in zip(grads, ref_grads):
            assert _same(g, r), label


def test_other_cases(o1):
    x32, x16 = torch.rand(3), torch.rand(3).to(torch.bfloat16)

    def casts(fn):
        counter = CastCounter()
        with counter:
            out = fn()
        return counter.casts, out.dtype

    # out= receives the result and is no input: still two tensors, uncast.
    assert casts(lambda: torch.add(x32, x16, out=torch.empty(3))) == (0, torch.float32)
    # float64 is not O1's to cast: torch's promotion, as before.
    assert casts(lambda: torch.add(x16, x32.double()))[1] == torch.float64
    # Three tensors: addcmul is no native op, both halves cast.
    assert casts(lambda: torch.addcmul(x32, x16, x16)) == (2, torch.float32)
