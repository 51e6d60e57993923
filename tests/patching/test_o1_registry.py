"""disable_casts, the user-function decorators and registrations, and the legacy handle."""

from __future__ import annotations

import threading
import types

import pytest
import torch

import amp_patch
from amp_patch.patching.registry import REGISTRY

HALF = torch.bfloat16


@pytest.fixture
def o1():
    amp_patch.initialize(torch.nn.Linear(1, 1), opt_level="O1", half_dtype=HALF, verbosity=0)


@pytest.fixture
def registry():
    REGISTRY.clear()
    yield REGISTRY
    REGISTRY.clear()


def test_disable_casts_nests_and_restores_on_exception(o1):
    a = torch.randn(2, 2)
    assert torch.mm(a, a).dtype == HALF
    with amp_patch.disable_casts():
        assert torch.mm(a, a).dtype == torch.float32
        with amp_patch.disable_casts():
            assert torch.mm(a, a).dtype == torch.float32
        assert torch.mm(a, a).dtype == torch.float32
    with pytest.raises(KeyError):
        with amp_patch.disable_casts():
            raise KeyError
    assert torch.mm(a, a).dtype == HALF


def test_disable_casts_interleaved_across_threads(o1):
    # A enters, B enters, A exits, B exits: casting stays off until the last block
    # ends and is back on afterwards (a saved-and-restored flag ends up off for good).
    casts = amp_patch.session.current().casts
    a_in, b_in, a_out = threading.Event(), threading.Event(), threading.Event()
    seen = {}

    def thread_a():
        with amp_patch.disable_casts():
            a_in.set()
            b_in.wait(5)
        a_out.set()

    def thread_b():
        a_in.wait(5)
        with amp_patch.disable_casts():
            b_in.set()
            a_out.wait(5)
            seen["after_a"] = casts.enabled

    threads = [threading.Thread(target=thread_a), threading.Thread(target=thread_b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert seen == {"after_a": False}
    assert casts.enabled
    a = torch.randn(2, 2)
    assert torch.mm(a, a).dtype == HALF


def test_disable_casts_is_a_no_op_outside_o1():
    with amp_patch.disable_casts():
        pass
    amp_patch.initialize(torch.nn.Linear(1, 1), opt_level="O2", verbosity=0)
    with amp_patch.disable_casts():
        assert torch.mm(torch.randn(2, 2), torch.randn(2, 2)).dtype == torch.float32


def test_optimizer_step_runs_without_casts():
    lin = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(lin.parameters(), lr=0.1)
    amp_patch.initialize(lin, opt, opt_level="O1", half_dtype=HALF, verbosity=0)
    casts = amp_patch.session.current().casts
    seen = []
    opt.register_step_pre_hook(lambda *_: seen.append(casts.enabled))
    lin(torch.randn(1, 2)).float().sum().backward()
    opt.step()
    assert seen == [False] and casts.enabled


@pytest.mark.parametrize("deco,args_dtypes,expected", [
    ("half_function", (torch.float32, torch.float32), HALF),
    ("float_function", (HALF, HALF), torch.float32),
    ("promote_function", (HALF, torch.float32), torch.float32),
    ("promote_function", (HALF, HALF), HALF),
])
def test_decorators_cast_nested_args(o1, deco, args_dtypes, expected):
    seen = {}

    @getattr(amp_patch, deco)
    def fn(a, pair, named=None):
        seen["dtypes"] = (a.dtype, pair[0].dtype, pair[1].dtype, named["x"].dtype)
        return a

    x, y = (torch.ones(2, dtype=d) for d in args_dtypes)
    fn(x, (y, x), named={"x": y})
    assert seen["dtypes"] == (expected,) * 4
    amp_patch.deinitialize()
    fn(x, (y, x), named={"x": y})  # outside O1: untouched
    assert seen["dtypes"] == (x.dtype, y.dtype, x.dtype, y.dtype)


def test_decorated_int_and_float64_untouched(o1):
    @amp_patch.half_function
    def fn(a, b):
        return a.dtype, b.dtype
    assert fn(torch.ones(2, dtype=torch.float64), torch.ones(2, dtype=torch.int64)) == (
        torch.float64, torch.int64)


def test_register_patches_next_initialize_and_undoes(registry):
    ns = types.SimpleNamespace()
    ns.op = lambda a, b: a + b
    original = ns.op
    amp_patch.register_half_function(ns, "op")
    amp_patch.initialize(torch.nn.Linear(1, 1), opt_level="O1", half_dtype=HALF, verbosity=0)
    assert ns.op(torch.ones(2), torch.ones(2)).dtype == HALF
    amp_patch.deinitialize()
    assert ns.op is original


@pytest.mark.parametrize("register,expected", [
    ("register_half_function", HALF), ("register_float_function", torch.float32),
    ("register_promote_function", torch.float32)])
def test_register_variants(registry, register, expected):
    module = types.ModuleType("user_ext")
    module.op = lambda a, b: a + b if a.dtype == b.dtype else torch.ones(1, dtype=torch.float64)
    getattr(amp_patch, register)(module, "op")
    amp_patch.initialize(torch.nn.Linear(1, 1), opt_level="O1", half_dtype=HALF, verbosity=0)
    assert module.op(torch.ones(2, dtype=HALF), torch.ones(2)).dtype == expected


def test_register_missing_attribute_raises(registry):
    with pytest.raises(ValueError, match="no_such"):
        amp_patch.register_half_function(torch, "no_such")


def test_legacy_init_handle():
    a = torch.randn(2, 2)
    original = torch.mm
    handle = amp_patch.init(verbose=False)
    assert handle.is_active()
    assert torch.mm(a, a).dtype in (torch.float16, torch.bfloat16)
    with pytest.raises(RuntimeError, match="deinitialize"):
        amp_patch.initialize(torch.nn.Linear(1, 1), verbosity=0)
    handle._deactivate()
    assert not handle.is_active() and torch.mm is original
    handle._deactivate()
    assert not amp_patch.init(enabled=False).is_active()


def test_legacy_allow_banned():
    p, t = torch.rand(3, dtype=HALF), torch.rand(3, dtype=HALF)
    handle = amp_patch.init(allow_banned=True)
    assert torch.nn.functional.binary_cross_entropy(p, t).dtype == torch.float32
    handle._deactivate()
    amp_patch.init()
    with pytest.raises(RuntimeError, match="BCEWithLogitsLoss"):
        torch.nn.functional.binary_cross_entropy(p, t)


def test_registration_wins_over_the_o1_lists(registry):
    # torch.mm is on the half list; the user's fp32 registration must decide for
    # torch.mm (no half round trip: bit-equal to fp32), while Tensor.mm, which the
    # registration does not name, keeps the list's policy.
    a = torch.randn(8, 8)
    expected = torch.mm(a, a)
    amp_patch.register_float_function(torch, "mm")
    amp_patch.initialize(torch.nn.Linear(1, 1), opt_level="O1", half_dtype=HALF, verbosity=0)
    out = torch.mm(a, a.to(HALF))
    assert out.dtype == torch.float32
    assert torch.equal(torch.mm(a, a), expected)
    assert a.mm(a).dtype == HALF


def test_registrations_are_consumed_by_the_o1_initialize(registry):
    # As Apex's init() did: an O1 initialize patches the registrations, then forgets
    # them; a later session needs them registered again. Other levels keep them.
    amp_patch.register_float_function(torch, "mm")
    amp_patch.initialize(torch.nn.Linear(1, 1), opt_level="O2", verbosity=0)
    amp_patch.deinitialize()
    assert len(registry.entries) == 1
    amp_patch.initialize(torch.nn.Linear(1, 1), opt_level="O1", half_dtype=HALF, verbosity=0)
    assert registry.entries == []
    amp_patch.deinitialize()
    amp_patch.initialize(torch.nn.Linear(1, 1), opt_level="O1", half_dtype=HALF, verbosity=0)
    a = torch.randn(2, 2)
    assert torch.mm(a, a).dtype == HALF
