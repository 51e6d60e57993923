"""initialize / deinitialize: return shapes, identity, bad calls (docs/design.md, "initialize") and exact undo."""

from __future__ import annotations

import inspect
import logging

import pytest
import torch
import torch.nn.functional as F

import amp_patch
import amp_patch.patching as patching
from amp_patch import session as amp_session


def _model():
    return torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.ReLU(), torch.nn.Linear(3, 1))


def _snapshot():
    """Every attribute that O1 could touch: torch, F, linalg, _VF and Tensor (inherited too)."""
    snap = {}
    for label, ns in (("torch", torch), ("F", F), ("linalg", torch.linalg)):
        snap.update({(label, k): v for k, v in vars(ns).items()})
    snap.update({("_VF", k): v for k, v in vars(torch._VF).items()})
    # Resolved without binding (a classmethod would give a new bound object per access),
    # so inherited methods are compared as the objects their defining class holds.
    for name in dir(torch.Tensor):
        snap[("Tensor", name)] = inspect.getattr_static(torch.Tensor, name)
    for cls in torch.Tensor.__mro__:
        snap.update({(cls.__qualname__ + ".__dict__", k): v for k, v in vars(cls).items()})
    return snap


@pytest.fixture(scope="module", autouse=True)
def _torch_warmed_up():
    """One O1 cycle before any snapshot is taken.

    torch imports some submodules lazily on first use, and importing ``torch._dynamo``
    rebinds ``torch.manual_seed``; after one cycle a snapshot sees amp's changes only,
    whichever test of this file runs first.
    """
    m = _model()
    amp_patch.initialize(m, torch.optim.SGD(m.parameters(), lr=0.1), opt_level="O1",
                         verbosity=0)
    amp_patch.deinitialize()


def _assert_same(before, after):
    changed = [k for k in before.keys() | after.keys()
               if k not in before or k not in after or before[k] is not after[k]]
    assert not changed, sorted(changed)[:20]


# --- return shapes and identity -------------------------------------------------------------

def test_shapes_and_identity():
    m, o = _model(), None
    o = torch.optim.SGD(m.parameters(), lr=0.1)
    params = list(m.parameters())
    rm, ro = amp_patch.initialize(m, o, opt_level="O1", verbosity=0)
    assert rm is m and ro is o and list(m.parameters()) == params
    assert all(a is b for a, b in zip(m.parameters(), params))
    amp_patch.deinitialize()

    rm, ro = amp_patch.initialize(m, [o], opt_level="O1", verbosity=0)
    assert rm is m and isinstance(ro, list) and ro[0] is o
    amp_patch.deinitialize()

    rm, ro = amp_patch.initialize([m], o, opt_level="O1", verbosity=0)
    assert isinstance(rm, list) and rm[0] is m and ro is o
    amp_patch.deinitialize()

    m2 = _model()
    o2 = torch.optim.SGD(m2.parameters(), lr=0.1)
    rm, ro = amp_patch.initialize([m, m2], [o, o2], opt_level="O1", verbosity=0)
    assert rm[0] is m and rm[1] is m2 and ro[0] is o and ro[1] is o2
    amp_patch.deinitialize()

    assert amp_patch.initialize(m, opt_level="O1", verbosity=0) is m
    amp_patch.deinitialize()
    assert amp_patch.initialize([m], opt_level="O1", verbosity=0)[0] is m


def test_enabled_false_is_a_no_op():
    m = _model()
    mm = torch.mm
    assert amp_patch.initialize(m, enabled=False, verbosity=0) is m
    assert torch.mm is mm and amp_session.current().casts is None


def test_half_dtype_default_and_explicit():
    amp_patch.initialize(_model(), opt_level="O1", verbosity=0)
    assert amp_session.current().casts.half_dtype == torch.bfloat16  # CPU model
    amp_patch.deinitialize()
    amp_patch.initialize(_model(), opt_level="O1", verbosity=0, half_dtype=torch.float16)
    assert amp_session.current().casts.half_dtype == torch.float16


def test_o1_end_to_end_training_step():
    m = _model()
    o = torch.optim.SGD(m.parameters(), lr=0.1)
    m, o = amp_patch.initialize(m, o, opt_level="O1", verbosity=0)
    before = m[0].weight.detach().clone()
    out = m(torch.randn(4, 3))
    assert out.dtype == torch.bfloat16
    loss = F.mse_loss(out, torch.zeros(4, 1))
    assert loss.dtype == torch.float32
    with amp_patch.scale_loss(loss, o) as scaled:
        scaled.backward()
    o.step()
    assert m[0].weight.dtype == torch.float32 and not torch.equal(before, m[0].weight)


def test_properties_are_logged(caplog):
    with caplog.at_level(logging.INFO, logger="amp_patch"):
        amp_patch.initialize(_model(), opt_level="O1", verbosity=1)
    assert "O1" in caplog.text and "patch_torch_functions" in caplog.text


@pytest.fixture
def amp_logger(monkeypatch):
    """The amp_patch logger at level ERROR with a handler list of its own; the old settings
    come back at the end."""
    log = logging.getLogger("amp_patch")
    level = log.level
    monkeypatch.setattr(log, "handlers", [])
    log.setLevel(logging.ERROR)
    yield log
    log.setLevel(level)


def _fail(session):
    raise RuntimeError("build failed on purpose")


@pytest.mark.parametrize("how", ["initialize", "legacy init", "apex verbosity", "bad optimizer",
                                 "failed build", "already live"])
@pytest.mark.parametrize("handlers", ["none anywhere", "own handler"])
def test_logger_left_as_found(how, handlers, amp_logger, monkeypatch):
    """initialize (and legacy init, and Apex's _amp_state.verbosity during a session) set the
    amp_patch logger's level and may add a handler; closing the session, or a failed
    initialize, puts back the very same level, handler list and propagate flag."""
    from amp_patch.apex_compat.amp_state import amp_state

    log = amp_logger
    # Set here, not in the fixture: pytest attaches its capture handlers to loggers that do
    # not propagate when a test phase starts.
    monkeypatch.setattr(log, "propagate", False)
    if handlers == "own handler":
        log.addHandler(logging.NullHandler())
    else:  # nothing anywhere: amp adds its stderr handler
        monkeypatch.setattr(logging.getLogger(), "handlers", [])
    found = (log.level, log.handlers, list(log.handlers))
    if how == "already live":
        amp_patch.initialize(_model(), opt_level="O0", verbosity=0)
    live = (log.level, log.handlers, list(log.handlers))
    model = _model()
    stranger = torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=1.0)
    if how == "failed build":
        monkeypatch.setattr(amp_patch.frontend.lifecycle, "_build", _fail)
    if how in ("bad optimizer", "failed build", "already live"):
        with pytest.raises((ValueError, RuntimeError)):
            amp_patch.initialize(model, stranger if how == "bad optimizer" else None,
                                 opt_level="O2", verbosity=2)
        assert (log.level, log.handlers, list(log.handlers)) == live
        assert log.handlers is found[1]
        amp_patch.deinitialize()
    else:
        if how == "legacy init":
            amp_patch.init(verbose=True)
        else:
            amp_patch.initialize(model, opt_level="O1", verbosity=0 if how == "apex verbosity"
                                 else 2)
        if how == "apex verbosity":
            amp_state.verbosity = 2
        assert log.level == logging.DEBUG
        added = [type(h) for h in log.handlers if h not in found[2]]
        assert added == ([logging.StreamHandler] if handlers == "none anywhere" else [])
        assert log.propagate is False
        amp_patch.deinitialize()
    assert log.level == logging.ERROR and log.propagate is False
    assert log.handlers is found[1] and log.handlers == found[2]
    assert len(found[2]) == (handlers == "own handler")


# --- bad calls ------------------------------------------------------------------------------

def test_unknown_level():
    with pytest.raises(ValueError, match="letter O"):
        amp_patch.initialize(_model(), opt_level="01", verbosity=0)
    assert amp_session.current() is None


def test_wrapped_models_are_refused():
    with pytest.raises(TypeError, match="after"):
        amp_patch.initialize(torch.nn.DataParallel(_model()), verbosity=0)
    ddp = object.__new__(torch.nn.parallel.DistributedDataParallel)  # no process group needed
    with pytest.raises(TypeError, match="DistributedDataParallel"):
        amp_patch.initialize([ddp], verbosity=0)


def test_tuples_are_refused():
    m = _model()
    o = torch.optim.SGD(m.parameters(), lr=0.1)
    with pytest.raises(TypeError, match="list, not a tuple"):
        amp_patch.initialize((m,), o, verbosity=0)
    with pytest.raises(TypeError, match="list, not a tuple"):
        amp_patch.initialize(m, (o,), verbosity=0)
    with pytest.raises(TypeError):
        amp_patch.initialize("model", verbosity=0)


def test_same_optimizer_twice():
    m = _model()
    o = torch.optim.SGD(m.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="twice"):
        amp_patch.initialize(m, [o, o], verbosity=0)


def test_initialize_twice():
    amp_patch.initialize(_model(), verbosity=0)
    with pytest.raises(RuntimeError, match="deinitialize"):
        amp_patch.initialize(_model(), verbosity=0)
    amp_patch.deinitialize()
    amp_patch.initialize(_model(), verbosity=0)


def test_params_on_two_device_types():
    m = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2, device="meta"))
    with pytest.raises(ValueError, match="more than one device type"):
        amp_patch.initialize(m, verbosity=0)
    with pytest.raises(ValueError, match="more than one device type"):
        amp_patch.initialize([_model(), torch.nn.Linear(2, 2, device="meta")], verbosity=0)


# --- deinitialize ---------------------------------------------------------------------------

@pytest.mark.parametrize("level", ["O0", "O1", "O2", "O3"])
def test_deinitialize_restores_every_attribute(level):
    before = _snapshot()
    m = _model()
    o = torch.optim.SGD(m.parameters(), lr=0.1)
    amp_patch.initialize(m, o, opt_level=level, verbosity=0)
    if level == "O1":
        assert torch.mm is not before[("torch", "mm")]
        assert torch.Tensor.__add__ is not before[("Tensor", "__add__")]
        assert "sum" in vars(torch.Tensor)  # inherited: installed on the class
    amp_patch.deinitialize()
    _assert_same(before, _snapshot())


def test_initialize_deinitialize_initialize():
    a = torch.randn(2, 2)
    for _ in range(3):
        amp_patch.initialize(_model(), opt_level="O1", verbosity=0)
        assert torch.mm(a, a).dtype == torch.bfloat16
        amp_patch.deinitialize()
        assert torch.mm(a, a).dtype == torch.float32


def test_failure_after_patching_leaves_torch_unpatched(monkeypatch):
    before = _snapshot()
    import amp_patch.optim.amp as optim

    def boom(*_, **__):
        raise RuntimeError("optimizer processing failed")
    monkeypatch.setattr(optim, "process", boom)
    m = _model()
    with pytest.raises(RuntimeError, match="processing failed"):
        amp_patch.initialize(m, torch.optim.SGD(m.parameters(), lr=0.1), opt_level="O1",
                             verbosity=0)
    assert amp_session.current() is None
    _assert_same(before, _snapshot())


def test_failure_in_the_middle_of_patching(monkeypatch):
    before = _snapshot()
    real = patching.make_wrapper
    calls = []

    def flaky(*args, **kwargs):
        calls.append(1)
        if len(calls) == 50:
            raise RuntimeError("wrapper factory failed")
        return real(*args, **kwargs)
    monkeypatch.setattr(patching, "make_wrapper", flaky)
    with pytest.raises(RuntimeError, match="factory failed"):
        amp_patch.initialize(_model(), opt_level="O1", verbosity=0)
    amp_patch.deinitialize()
    _assert_same(before, _snapshot())
