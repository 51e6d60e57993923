"""AmpScaler: the update rule, floors and ceilings, collapse, device tensors, checkpoint state."""

from __future__ import annotations

import logging

import pytest
import torch

from amp_patch.settings.properties import Properties
from amp_patch.helpers.tensors import group_by_device_and_dtype
from amp_patch.scaler import LossScaleCollapseError, AmpScaler


def overflow(scaler: AmpScaler, device="cpu") -> bool:
    scaler.device_tensors(torch.device(device)).found_inf.fill_(1.0)
    return scaler.update()


def clean(scaler: AmpScaler, device="cpu") -> bool:
    scaler.device_tensors(torch.device(device))
    return scaler.update()


def test_dynamic_start_halve_double_and_cap():
    s = AmpScaler("dynamic")
    assert s.loss_scale == 2.0**16
    assert overflow(s) is True and s.loss_scale == 2.0**15
    for _ in range(1999):
        assert clean(s) is False
    assert s.loss_scale == 2.0**15
    clean(s)
    assert s.loss_scale == 2.0**16 and s.state_dict()["unskipped"] == 0
    capped = AmpScaler("dynamic", max_loss_scale=2.0**10)
    assert capped.loss_scale == 2.0**10
    for _ in range(2000):
        clean(capped)
    assert capped.loss_scale == 2.0**10


def test_overflow_resets_the_clean_count():
    s = AmpScaler("dynamic", scale_window=3)
    clean(s), clean(s), overflow(s), clean(s), clean(s)
    assert s.loss_scale == 2.0**15
    clean(s)
    assert s.loss_scale == 2.0**16


def test_static_scale_never_changes_but_reports_overflow():
    s = AmpScaler(128.0)
    assert overflow(s) and s.loss_scale == 128.0
    for _ in range(2000):
        clean(s)
    assert s.loss_scale == 128.0


def test_min_loss_scale_floors_then_collapses():
    s = AmpScaler("dynamic", min_loss_scale=2.0**14)
    overflow(s), overflow(s)
    assert s.loss_scale == 2.0**14
    with pytest.raises(LossScaleCollapseError, match="non-finite"):
        overflow(s)


def test_default_floor_collapse_names_parameters():
    s = AmpScaler("dynamic", max_loss_scale=2.0**-23)
    overflow(s)
    assert s.loss_scale == 2.0**-24
    with pytest.raises(LossScaleCollapseError, match=r"fc\.weight"):
        s.device_tensors(torch.device("cpu")).found_inf.fill_(1.0)
        s.update(lambda: ["fc.weight"])


def test_overflow_message_exact(caplog):
    s = AmpScaler("dynamic", loss_id=1)
    logging.getLogger("amp_patch").setLevel(logging.INFO)
    with caplog.at_level(logging.INFO, logger="amp_patch"):
        overflow(s)
    assert "Gradient overflow.  Skipping step, loss scaler 1 reducing loss scale to 32768.0" in [
        r.getMessage() for r in caplog.records]


def test_device_tensors_lazy_and_follow_scale():
    s = AmpScaler("dynamic")
    assert not s._devices
    dev = s.device_tensors(torch.device("cpu"))
    assert dev.inv_scale.item() == 2.0**-16 and dev.found_inf.item() == 0.0
    overflow(s)
    assert dev.inv_scale.item() == 2.0**-15 and dev.found_inf.item() == 0.0


def test_no_flags_means_no_overflow():
    assert AmpScaler("dynamic").update() is False


def test_check_loss_flags_nonfinite_loss():
    s = AmpScaler("dynamic")
    s.check_loss(torch.tensor(1.0))
    assert s.update() is False
    s.check_loss(torch.tensor(float("nan")))
    assert s.update() is True


def test_state_dict_roundtrip():
    s = AmpScaler("dynamic")
    overflow(s), clean(s), clean(s)
    sd = s.state_dict()
    assert sd["loss_scale"] == 2.0**15 and sd["unskipped"] == 2 and sd["skipped"] == 1
    t = AmpScaler("dynamic")
    t.device_tensors(torch.device("cpu"))
    t.load_state_dict(sd)
    assert t.state_dict() == sd
    assert t.device_tensors(torch.device("cpu")).inv_scale.item() == 2.0**-15
    with pytest.raises(ValueError):
        t.load_state_dict({"loss_scale": 0.0, "unskipped": 0})


def test_from_properties():
    props = Properties.from_opt_level("O2", torch.float16, min_loss_scale=1.0, max_loss_scale=2.0**20)
    s = AmpScaler.from_properties(props, loss_id=2)
    assert s.dynamic and s.loss_id == 2 and s.min_loss_scale == 1.0 and s.loss_scale == 2.0**16
    assert not AmpScaler.from_properties(Properties.from_opt_level("O2", torch.bfloat16)).dynamic


def test_unscale_one_call_per_kind_and_group(monkeypatch):
    from amp_patch import ops

    calls = []
    for name in ("multi_tensor_unscale_", "multi_tensor_unscale_copy_", "multi_tensor_axpby_"):
        orig = getattr(ops, name)
        monkeypatch.setattr(ops, name, lambda *a, _n=name, _o=orig: (calls.append((_n, len(a[0]))), _o(*a)))
    s = AmpScaler(4.0)
    g32 = [torch.full((3,), 4.0) for _ in range(3)]
    g16 = [torch.full((2,), 4.0, dtype=torch.bfloat16) for _ in range(2)]
    src = [torch.full((2,), 4.0, dtype=torch.bfloat16) for _ in range(2)]
    dst = [torch.empty(2) for _ in range(2)]
    acc = [torch.ones(3)]
    s.unscale(g32[:2] + g16, (src, dst), ([g32[2]], acc))
    assert sorted(calls) == sorted([("multi_tensor_unscale_", 2), ("multi_tensor_unscale_", 2),
                                    ("multi_tensor_unscale_copy_", 2), ("multi_tensor_axpby_", 1)])
    assert all(torch.equal(g, torch.ones(3)) for g in g32[:2]) and torch.equal(acc[0], torch.full((3,), 2.0))
    assert all(torch.equal(d, torch.ones(2)) and torch.equal(g, torch.ones(2, dtype=torch.bfloat16))
               for d, g in zip(dst, g16))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("scale", [65536.0, 3.0, 1 / 7])
def test_accumulate_matches_axpby_bitwise(dtype, scale):
    """The accumulating unscale (a temporary, then an add) gives axpby's bits: a*x + y in fp32."""
    from amp_patch import ops

    gen = torch.Generator().manual_seed(0)
    x = [(torch.randn(n, generator=gen) * 100).to(dtype) for n in (1, 257, 1000)]
    y = [torch.randn(n, generator=gen) for n in (1, 257, 1000)]
    expected = [t.clone() for t in y]
    ops.multi_tensor_axpby_(x, expected, torch.zeros(1), 1.0 / scale, 1.0)
    s = AmpScaler("dynamic")
    s.loss_scale = scale
    s.device_tensors(torch.device("cpu"))
    s.update_on_device()  # the host's copy is now behind: the device's inv_scale is read
    s.loss_scale = scale
    s.update_on_device()
    assert s._unread
    s.unscale(accumulate=(x, y))
    assert all(torch.equal(a, b) for a, b in zip(y, expected))


def test_group_by_device_and_dtype_keeps_order_and_parallel_lists():
    a = [torch.zeros(1), torch.zeros(1, dtype=torch.bfloat16), torch.zeros(2)]
    b = ["x", "y", "z"]
    groups = group_by_device_and_dtype(a, b)
    assert groups[(torch.device("cpu"), torch.float32)] == ([a[0], a[2]], ["x", "z"])
    assert groups[(torch.device("cpu"), torch.bfloat16)][1] == ["y"]
    with pytest.raises(ValueError):
        group_by_device_and_dtype(a, b[:1])
