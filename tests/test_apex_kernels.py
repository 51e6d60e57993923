"""The Apex-compatible kernel surface: ``multi_tensor_applier`` and ``amp_C``, against plain torch math."""

from __future__ import annotations

import pytest
import torch
from conftest import DEVICES

import amp_patch
from amp_patch.apex_compat import amp_C
from amp_patch.apex_compat.multi_tensor_apply import MultiTensorApply, multi_tensor_applier

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16


def _lists(device, dtypes, sizes=(1, 17, 1023, 40_001), seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=gen).to(dt).to(device) for n, dt in zip(sizes, dtypes)]


def _noop(device, value=0):
    return torch.full((1,), value, dtype=torch.int32, device=device)


def test_applier_is_exported_and_prepends_chunk_size():
    assert amp_patch.multi_tensor_applier is multi_tensor_applier
    assert multi_tensor_applier.chunk_size == 2048 * 32 and MultiTensorApply.available
    seen = []
    MultiTensorApply(123)(lambda *args: seen.append(args), "flag", [["lists"]], 1.5, 2)
    assert seen == [(123, "flag", [["lists"]], 1.5, 2)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("src_dtype,dst_dtype", [(F32, F32), (BF16, F32), (F32, BF16), (F16, F32)])
def test_scale(device, src_dtype, dst_dtype):
    src = _lists(device, [src_dtype] * 4)
    dst = [torch.empty_like(t, dtype=dst_dtype) for t in src]
    noop = _noop(device)
    multi_tensor_applier(amp_C.multi_tensor_scale, noop, [src, dst], 0.125)
    for s, d in zip(src, dst):
        assert torch.equal(d, (s.float() * 0.125).to(dst_dtype))
    assert noop.item() == 0


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("value", [float("inf"), float("nan")], ids=["inf", "nan"])
def test_scale_sets_noop_flag_and_never_clears_it(device, value):
    src = _lists(device, [F32, BF16, F32, BF16])
    src[2][5] = value
    noop = _noop(device)
    multi_tensor_applier(amp_C.multi_tensor_scale, noop, [src, [t.float() for t in src]], 2.0)
    assert noop.dtype == torch.int32 and noop.item() == 1
    clean = _lists(device, [F32] * 4, seed=1)
    multi_tensor_applier(amp_C.multi_tensor_scale, noop, [clean, [t.clone() for t in clean]], 2.0)
    assert noop.item() == 1


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("x_dtype,y_dtype,out_dtype", [(F32, F32, F32), (BF16, F32, F32), (F32, F32, BF16),
                                                       (BF16, BF16, BF16), (F16, F32, F16)])
def test_axpby(device, x_dtype, y_dtype, out_dtype):
    x = _lists(device, [x_dtype] * 4, seed=0)
    y = _lists(device, [y_dtype] * 4, seed=1)
    out = [torch.empty_like(t, dtype=out_dtype) for t in x]
    noop = _noop(device)
    multi_tensor_applier(amp_C.multi_tensor_axpby, noop, [x, y, out], 0.5, -2.0, -1)
    for xi, yi, oi in zip(x, y, out):
        torch.testing.assert_close(oi, (0.5 * xi.float() + -2.0 * yi.float()).to(out_dtype))
    assert noop.item() == 0


@pytest.mark.parametrize("device", DEVICES)
def test_axpby_in_place_into_y(device):
    x = _lists(device, [BF16] * 4)
    y = _lists(device, [F32] * 4, seed=1)
    expected = [0.25 * xi.float() + yi for xi, yi in zip(x, y)]
    multi_tensor_applier(amp_C.multi_tensor_axpby, _noop(device), [x, y, y], 0.25, 1.0, 0)
    for yi, e in zip(y, expected):
        torch.testing.assert_close(yi, e)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bad_in,arg_to_check,flagged", [
    ("x", 0, True), ("y", 0, False), ("x", 1, False), ("y", 1, True), ("x", -1, True), ("y", -1, True),
])
def test_axpby_checks_the_requested_argument(device, bad_in, arg_to_check, flagged):
    x = _lists(device, [F32, BF16, F32, F32])
    y = _lists(device, [F32] * 4, seed=1)
    (x if bad_in == "x" else y)[1][3] = float("inf")
    out = [torch.empty_like(t) for t in y]
    noop = _noop(device)
    multi_tensor_applier(amp_C.multi_tensor_axpby, noop, [x, y, out], 2.0, 3.0, arg_to_check)
    assert noop.item() == int(flagged)
    torch.testing.assert_close(out[0], 2.0 * x[0] + 3.0 * y[0])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("per_tensor", [True, False])
def test_l2norm(device, per_tensor):
    x = _lists(device, [F32, BF16, F16, F32])
    noop = _noop(device)
    total, norms = multi_tensor_applier(amp_C.multi_tensor_l2norm, noop, [x], per_tensor)
    exact = torch.stack([t.double().norm() for t in x])
    assert total.shape == (1,) and total.dtype == F32
    torch.testing.assert_close(total.double(), exact.norm().reshape(1), rtol=1e-5, atol=0)
    if per_tensor:
        torch.testing.assert_close(norms.double(), exact, rtol=1e-5, atol=0)
    else:
        assert norms.numel() == 0
    assert noop.item() == 0


def test_errors_name_the_function():
    with pytest.raises(RuntimeError, match="multi_tensor_scale: expected 2 tensor lists"):
        amp_C.multi_tensor_scale(2048, _noop("cpu"), [[torch.ones(2)]], 1.0)
    with pytest.raises(RuntimeError, match="arg_to_check"):
        amp_C.multi_tensor_axpby(2048, _noop("cpu"), [[], [], []], 1.0, 1.0, 2)
