"""The C fast path of the O1 wrappers (amp_patch._C.CastWrapper) against the Python path.

One script of calls touches every branch of the wrappers: each policy with
nothing to cast, with plain tensors to cast, with kwargs and ``out=``, with
nested containers, tensor subclasses, an active TorchFunctionMode, refusals,
errors of the original, ``disable_casts``, and the weight cache's hits,
misses and invalidations. It runs once per path; the records (output dtypes
and values, exceptions, the cache's counters, entries and the identity of
its casts) must be identical.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.nn.utils.rnn import pack_padded_sequence
from torch.overrides import TorchFunctionMode

import amp_patch
from amp_patch import session as amp_session
from amp_patch.patching import wrappers

HALF = torch.bfloat16
needs_native = pytest.mark.skipif(not wrappers.native_available(), reason="extension not built")


class Recording(torch.Tensor):
    """A tensor subclass whose __torch_function__ counts the calls that reach it."""

    calls = 0

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        Recording.calls += 1
        return super().__torch_function__(func, types, args, kwargs or {})


class Names(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.names.append(getattr(func, "__name__", str(func)))
        return func(*args, **(kwargs or {}))


def _summary(out):
    if isinstance(out, torch.Tensor):
        return (type(out).__name__, out.dtype, tuple(out.shape), out.requires_grad,
                out.detach().double().flatten().tolist())
    if isinstance(out, (list, tuple)):
        return tuple(_summary(o) for o in out)
    return out


def _script():
    """The calls, run under the installed O1 wrappers; returns their records."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(4, 3)
    w, b = lin.weight, lin.bias
    x32, x16 = torch.rand(2, 4), torch.rand(2, 4).to(HALF)
    y32, y16 = torch.rand(2, 4), torch.rand(2, 4).to(HALF)
    cache = amp_session.current().casts.cache
    seen_casts: list = []  # identities of the cache's casts, in order of first sight
    records = []

    def state():
        entries = []
        for (pid, dtype), entry in sorted(cache._entries.items(), key=lambda kv: str(kv[0][1])):
            if not any(e is entry.cast for e in seen_casts):
                seen_casts.append(entry.cast)
            index = next(i for i, e in enumerate(seen_casts) if e is entry.cast)
            entries.append(({id(w): "w", id(b): "b"}.get(pid, "other"), dtype, index,
                            entry.made_with_grad))
        return cache.casts, cache.digest, entries

    def run(label, fn):
        try:
            result = ("ok", _summary(fn()))
        except Exception as exc:  # the exception is part of the record
            result = (type(exc).__name__, str(exc))
        records.append((label, result, state()))

    def bump():
        with torch.no_grad():
            w.mul_(1.0)

    # half policy: cache misses, hits, kwargs, out of place args, None
    run("linear fp32 input", lambda: F.linear(x32, w, b))
    run("linear again (hits)", lambda: F.linear(x32, w, b))
    run("linear kwargs", lambda: F.linear(input=x32, weight=w, bias=b))
    run("linear nothing to cast", lambda: F.linear(x16, w.detach().to(HALF)))
    run("linear None bias", lambda: F.linear(x32, w, None))
    run("linear float64", lambda: F.linear(x32.double(), w.detach().double()))
    run("linear bad shape", lambda: F.linear(torch.rand(2, 5), w))
    run("matmul operator", lambda: x32 @ w.t())
    run("reflected matmul", lambda: w.t().__rmatmul__(x32))
    with torch.no_grad():
        run("no_grad entry", lambda: F.linear(x32, w))
    run("grad after no_grad entry", lambda: F.linear(x32, w))
    bump()
    run("recast after version bump", lambda: F.linear(x32, w))
    w.data = w.data.clone()
    run("recast after new storage", lambda: F.linear(x32, w))
    run("einsum", lambda: torch.einsum("ij,kj->ik", x32, w))
    run("multi_dot (nested)", lambda: torch.linalg.multi_dot([x32, w.t(), torch.rand(3, 2)]))
    # fp32 policy, methods and operators
    run("exp half", lambda: torch.exp(x16))
    run("softmax method", lambda: x16.softmax(0))
    run("softmax unbound", lambda: torch.Tensor.softmax(x16, 0))
    bound = x16.softmax
    run("softmax bound", lambda: bound(dim=0))
    run("exp out=", lambda: torch.exp(x16, out=torch.empty(2, 4, dtype=HALF)))
    run("pow reflected", lambda: 2.0 ** x16)
    run("layer_norm kwargs", lambda: F.layer_norm(x16, (4,), weight=torch.ones(4)))
    # promote and sequence promote
    run("add mixed", lambda: torch.add(x32, y16))
    run("add same", lambda: torch.add(x32, y32))
    run("add scalar", lambda: x16 + 2)
    run("add nested mixed", lambda: torch.add(x32, other=y16))
    run("mul mixed, torch's promotion", lambda: x16 * y32)
    run("eq mixed, torch's promotion", lambda: torch.eq(x32, y16))
    run("add 0-dim beside dimensioned", lambda: torch.add(x16, y32[0, 0]))
    run("sub float64", lambda: torch.sub(x16, y32.double(), alpha=2))
    run("addcmul three", lambda: torch.addcmul(x32, y16, x16.to(torch.float16)))
    run("cat mixed", lambda: torch.cat([x32, y16]))
    run("cat same", lambda: torch.cat(tensors=[x16, y16]))
    run("stack tuple mixed", lambda: torch.stack((x32, y16), dim=1))
    run("integers", lambda: torch.add(torch.arange(3), torch.arange(3)))
    # in place
    run("exp_ half", lambda: x16.clone().exp_())
    run("exp_ fp32 self", lambda: x32.clone().exp_())
    run("add_ cast other", lambda: x16.clone().add_(y32))
    run("iadd", lambda: x32.clone().__iadd__(y16))
    run("torch.exp_ half", lambda: torch.exp_(x16.clone()))
    # banned
    run("bce half", lambda: F.binary_cross_entropy(x16, y16))
    run("bce fp32", lambda: F.binary_cross_entropy(x32, y32))
    # subclasses and modes go to the Python wrapper; both see the same calls
    sub = x32.as_subclass(Recording)
    Recording.calls = 0
    run("subclass input", lambda: F.linear(sub, w))
    run("subclass calls", lambda: Recording.calls)
    with Names() as mode:
        run("mode linear", lambda: F.linear(x32, w))
    run("mode names", lambda: mode.names)
    with amp_patch.disable_casts():
        run("disabled", lambda: F.linear(x32, w))
    # recurrent modules: nested parameter lists
    lstm = torch.nn.LSTM(4, 3)
    run("lstm", lambda: lstm(x32.unsqueeze(1))[0])
    packed = pack_padded_sequence(torch.rand(3, 2, 4).to(HALF), [3, 2])
    run("lstm packed half", lambda: lstm(packed)[0].data)
    return records


def _run_script(native: bool, monkeypatch):
    monkeypatch.setattr(wrappers, "_use_native", native)
    amp_patch.initialize(torch.nn.Linear(1, 1), opt_level="O1", half_dtype=HALF, verbosity=0)
    try:
        assert (type(F.linear).__name__ == "CastWrapper") is native
        return _script()
    finally:
        amp_patch.deinitialize()


@needs_native
def test_c_and_python_paths_decide_alike(monkeypatch):
    python = _run_script(False, monkeypatch)
    native = _run_script(True, monkeypatch)
    assert len(python) == len(native)
    for p, n in zip(python, native):
        assert p == n, p[0]
    # The script did exercise the cache and the refusals.
    assert python[-1][2][0] > 5
    assert any(r[1][0] == "NotImplementedError" for r in python)


@needs_native
def test_native_wrapper_describes_itself(monkeypatch):
    monkeypatch.setattr(wrappers, "_use_native", True)
    original = F.softmax
    amp_patch.initialize(torch.nn.Linear(1, 1), opt_level="O1", half_dtype=HALF, verbosity=0)
    assert type(torch.Tensor.softmax).__name__ == "CastWrapper"
    assert F.softmax.__wrapped__ is original and F.softmax.__name__ == "softmax"
    assert F.softmax._amp_patch_policy is wrappers.Policy.FP32
    assert "softmax" in repr(F.softmax)
    amp_patch.deinitialize()
    assert F.softmax is original


@needs_native
def test_native_wrapper_rejects_bad_construction():
    from amp_patch import _C
    state = type("S", (), {"enabled": True})()
    with pytest.raises(ValueError, match="need a target dtype"):
        _C.CastWrapper(torch.exp, torch.exp, state, None, 0, None)
    with pytest.raises(TypeError, match="target must be"):
        _C.CastWrapper(torch.exp, torch.exp, state, None, 1, torch.int64)
    with pytest.raises(ValueError, match="policy must be"):
        _C.CastWrapper(torch.exp, torch.exp, state, None, 9, None)
    with pytest.raises(TypeError, match="callable"):
        _C.CastWrapper(1, torch.exp, state, None, 2, None)
