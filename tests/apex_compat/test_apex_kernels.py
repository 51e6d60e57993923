"""The Apex-compatible kernel surface: ``multi_tensor_applier`` and ``amp_C``, against plain torch math."""

from __future__ import annotations

import itertools
import math
import random

import pytest
import torch
from conftest import DEVICES

import amp_patch
from amp_patch import ops
from amp_patch.apex_compat import amp_C
from amp_patch.ops.multi_tensor_apply import MultiTensorApply, multi_tensor_applier

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


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ["multi_tensor_l2norm", "multi_tensor_unscale_l2norm"])
@pytest.mark.parametrize("value", [float("inf"), float("nan")], ids=["inf", "nan"])
def test_norms_set_noop_flag_on_nonfinite_input(device, name, value):
    """Apex's norm kernels set noop_flag when a chunk's sum of squares is not finite."""
    x = _lists(device, [F32, BF16, F16, F32])
    scale_args = (torch.full((1,), 0.5, device=device),) if name == "multi_tensor_unscale_l2norm" else ()
    noop = _noop(device)
    multi_tensor_applier(getattr(amp_C, name), noop, [x], *scale_args, None)
    assert noop.item() == 0
    x[2][9] = value
    total, _ = multi_tensor_applier(getattr(amp_C, name), noop, [x], *scale_args, True)
    assert noop.item() == 1 and not torch.isfinite(total).item()


# Apex's tests/L0/run_amp/test_multi_tensor_unscale_l2norm.py, translated. Apex
# varied the applier's chunk size too (2048*32, 333, 33333); amp_patch ignores
# it, so one other size is enough to show that.
_UNSCALE_SIZES = [(777, 555), (555, 2048 * 32 + 1), (2048 * 32 + 1, 555), (555, 2048 * 32),
                  (2048 * 32, 555), (33333, 555), (555, 33333),
                  pytest.param(7777 * 77, 555 * 555, marks=pytest.mark.slow)]


@pytest.mark.slow
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("sizea,sizeb", _UNSCALE_SIZES)
@pytest.mark.parametrize("repeat", [1, 55])
@pytest.mark.parametrize("in_type", [F32, F16])
def test_unscale_l2norm_apex_fuzz(device, sizea, sizeb, repeat, in_type):
    val, inv_scale = 4.0, 0.5
    inv = torch.tensor([inv_scale], dtype=F32, device=device)
    a = torch.full([sizea], val, dtype=F32, device=device)
    b = torch.full([sizeb], val, dtype=F32, device=device)
    in_list = [t.clone().to(in_type) for _ in range(repeat) for t in (a, b)]
    reference = torch.full([(sizea + sizeb) * repeat], val * inv_scale, dtype=F32, device=device).norm()
    normab = torch.cat(((a * inv_scale).norm().view(1), (b * inv_scale).norm().view(1)))
    for applier in (multi_tensor_applier, MultiTensorApply(333)):
        for per_tensor in (False, True):
            noop = _noop(device)
            norm, norm_per_tensor = applier(amp_C.multi_tensor_unscale_l2norm, noop, [in_list], inv, per_tensor)
            torch.testing.assert_close(norm, reference.reshape(1))
            if per_tensor:
                torch.testing.assert_close(norm_per_tensor.view(-1, 2), normab.expand(repeat, 2))
            else:
                assert norm_per_tensor.numel() == 0
            assert noop.item() == 0
    assert all(torch.equal(t, torch.full_like(t, val)) for t in in_list), "the inputs were changed"


def _fp32(x: float) -> float:
    """x rounded to fp32, as the kernel rounds each product of the scale."""
    return torch.tensor(x, dtype=F32).item()


def _hysteresis_body(device, rng, init_scale, growth_factor, backoff_factor, growth_interval, hysteresis):
    scale = torch.tensor([init_scale], dtype=F32, device=device)
    growth_tracker = torch.tensor([0], dtype=torch.int32, device=device)
    hysteresis_tracker = torch.tensor([hysteresis], dtype=torch.int32, device=device)
    found_inf = torch.tensor([1], dtype=F32, device=device)

    def run(n):
        for _ in range(n):
            out = amp_C.update_scale_hysteresis(scale, growth_tracker, hysteresis_tracker, found_inf,
                                                growth_factor, backoff_factor, growth_interval, hysteresis)
            assert out is scale

    # Infs for hysteresis - 1 iterations: the scale holds.
    run(hysteresis - 1)
    assert scale.item() == init_scale
    # No infs for growth_interval - 1 iterations: the scale holds.
    found_inf.zero_()
    run(growth_interval - 1)
    assert scale.item() == init_scale
    # Infs for more than hysteresis iterations: the scale backs off on each
    # one past the hysteresis, and, as Apex's --use_fast_math kernel flushed
    # denormals, becomes 0 as soon as it would fall below fp32's smallest normal.
    found_inf.fill_(1)
    extra = rng.randint(0, 1000)
    scale_ref = scale.item()
    run(hysteresis + extra)
    for _ in range(1 + extra):
        scale_ref = _fp32(scale_ref * backoff_factor)
        if scale_ref < torch.finfo(F32).tiny:
            scale_ref = 0.0
    assert scale.item() == scale_ref
    # No infs for more than growth_interval iterations: the scale grows every
    # growth_interval of them, unless that overflows fp32.
    found_inf.fill_(0)
    extra = rng.randint(0, 1000)
    scale_ref = scale.item()
    run(growth_interval + extra)
    for _ in range(1 + extra // growth_interval):
        grown = _fp32(scale_ref * growth_factor)
        if math.isfinite(grown):
            scale_ref = grown
    assert scale.item() == scale_ref


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("init_scale", [1, 1024, 65536])
def test_update_scale_hysteresis_apex_fuzz(device, init_scale):
    """Apex's tests/L0/run_amp/test_update_scale_hysteresis.py, translated (seeded)."""
    rng = random.Random(init_scale)
    for growth_factor, backoff_factor, growth_interval, hysteresis in itertools.product(
            [1.0, 2.0, 4.0], [0.5, 0.25], [10, 100], [10, 100]):
        _hysteresis_body(device, rng, init_scale, growth_factor, backoff_factor, growth_interval, hysteresis)


@pytest.mark.parametrize("device", DEVICES)
def test_update_scale_hysteresis_flushes_denormal_scales_as_apex(device):
    """Apex's kernel (--use_fast_math) flushed a backed-off scale below fp32's smallest normal to
    0; amp_patch's own op keeps IEEE denormals, the amp_C one matches Apex."""
    tiny = torch.finfo(F32).tiny

    def back_off(update, start):
        scale = torch.tensor([start], dtype=F32, device=device)
        growth = torch.zeros(1, dtype=torch.int32, device=device)
        hyst = torch.ones(1, dtype=torch.int32, device=device)
        update(scale, growth, hyst, torch.ones(1, dtype=F32, device=device), 2.0, 0.5, 10, 1)
        return scale.item()

    assert back_off(amp_C.update_scale_hysteresis, 4 * tiny) == 2 * tiny  # still normal
    assert back_off(amp_C.update_scale_hysteresis, tiny) == 0.0
    assert back_off(amp_C.update_scale_hysteresis, 2 * tiny) == tiny
    assert back_off(ops.update_scale_hysteresis, tiny) == tiny / 2  # IEEE: a denormal
