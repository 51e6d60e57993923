"""The multi-tensor ops: the dispatched kernels against the Python reference, bit for bit.

``torch.ops.amp_patch.*`` routes to the compiled kernel of the tensors' device
when one is built, and to the reference body otherwise; the reference bodies in
``amp_patch.ops`` are called directly as the oracle.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap

import pytest
import torch
from conftest import DEVICES
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import amp_patch
from amp_patch import ops
from amp_patch.ops import scaling_ops

F32, F16, BF16, F64 = torch.float32, torch.float16, torch.bfloat16, torch.float64

# Sizes around the vector widths (8/16 floats, 16/32 halves) and their blocks.
ODD_SIZES = [1, 7, 15, 16, 17, 31, 33, 63, 65, 1023, 4099]


def _make(shape, dtype, device, layout="contiguous", gen=None):
    """A random tensor of ``shape`` whose memory layout is ``layout``.

    ``transposed`` and ``sliced`` are not contiguous (sliced is not even dense);
    ``channels_last`` is dense but not contiguous.
    """
    def rand(*s):
        return (torch.randn(s, generator=gen) * 100).to(dtype).to(device)

    if layout == "contiguous":
        return rand(*shape)
    if layout == "transposed":
        return rand(*reversed(shape)).t()
    if layout == "sliced":
        return rand(shape[0], 2 * shape[1])[:, ::2]
    if layout == "channels_last":
        return rand(*shape).contiguous(memory_format=torch.channels_last)
    raise ValueError(layout)


# Each case: a list of (shape, dtype, layout) tensor specs.
CASES = {
    "fp32": [((n,), F32, "contiguous") for n in ODD_SIZES],
    "bf16": [((n,), BF16, "contiguous") for n in ODD_SIZES],
    "fp16": [((n,), F16, "contiguous") for n in ODD_SIZES[:8]],
    "mixed": [((n,), dt, "contiguous") for n, dt in zip(ODD_SIZES, [F32, BF16, F16] * 4)],
    "transposed": [((33, 17), F32, "transposed"), ((5, 9), BF16, "transposed"), ((3, 7), F16, "transposed")],
    "sliced": [((9, 31), F32, "sliced"), ((4, 17), BF16, "sliced"), ((3, 5), F16, "sliced")],
    "channels_last": [((2, 3, 5, 7), F32, "channels_last"), ((2, 5, 3, 3), BF16, "channels_last")],
    "empty_tensors": [((0,), F32, "contiguous"), ((3,), BF16, "contiguous"), ((5, 0), BF16, "contiguous"),
                      ((0, 4), F16, "transposed")],
    # More tensors than one launch holds (CUDA: about 110), sizes crossing task boundaries on CPU.
    "many": [((1 + (37 * i) % 700,), [F32, BF16][i % 2], "contiguous") for i in range(230)],
    "large": [((3,), F32, "contiguous"), ((150_001,), F32, "contiguous"), ((70_003,), BF16, "contiguous"),
              ((5,), BF16, "contiguous")],
    # 0-dim tensors: a scalar parameter (a learned temperature, say) has a 0-dim grad.
    "scalars": [((), F32, "contiguous"), ((), BF16, "contiguous"), ((5,), F32, "contiguous"),
                ((), F16, "contiguous")],
    # fp64 grads (a parameter kept in double) among the usual dtypes; opmath is fp64 for them.
    "fp64": [((n,), F64, "contiguous") for n in ODD_SIZES[:7]] + [((), F64, "contiguous"),
                                                                 ((9, 5), F64, "transposed")],
    "mixed_fp64": [((n,), dt, "contiguous") for n, dt in zip(ODD_SIZES, [F64, F32, BF16, F64, F16] * 3)],
}


def _tensors(case, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [_make(shape, dt, device, layout, gen) for shape, dt, layout in CASES[case]]


def _like(tensors, dtype, contiguous=False, seed=1):
    """Fresh random tensors shaped like ``tensors``, in ``dtype`` (None: each one's own)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for t in tensors:
        new = (torch.randn(t.shape, generator=gen) * 100).to(dtype or t.dtype).to(t.device)
        if not contiguous and not t.is_contiguous() and t.dim() == 2 and t.numel():
            new = new.t().contiguous().t()
        out.append(new)
    return out


def clone_args(x):
    """A copy of an op's argument: tensors with the same strides (so non-dense, sliced cases
    stay non-dense), lists and tuples element by element (as a list), anything else as it is."""
    if isinstance(x, torch.Tensor):
        return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=x.device).copy_(x)
    if isinstance(x, (list, tuple)):
        return [clone_args(t) for t in x]
    return x


def _int_view(t):
    return t.view({F32: torch.int32, F16: torch.int16, BF16: torch.int16, F64: torch.int64}[t.dtype])


def assert_bitwise(actual, expected):
    """Same dtype, shape and bits; NaNs must sit at the same places (payloads may differ)."""
    assert len(actual) == len(expected)
    for i, (a, e) in enumerate(zip(actual, expected)):
        assert a.dtype == e.dtype and a.shape == e.shape, f"tensor {i}"
        nan = torch.isnan(a)
        assert torch.equal(nan, torch.isnan(e)), f"tensor {i}: NaN positions differ"
        assert torch.equal(_int_view(a.contiguous())[~nan], _int_view(e.contiguous())[~nan]), (
            f"tensor {i}: values differ from the reference"
        )


def _flag(device, value=0.0):
    return torch.full((1,), value, dtype=torch.float32, device=device)


def _scale(device, value=1.0 / 1024.0 * 3.0):
    return torch.full((1,), value, dtype=torch.float32, device=device)


# ---------------------------------------------------------------- case tables

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", list(CASES))
def test_unscale_matches_reference(device, case):
    got = _tensors(case, device)
    want = clone_args(got)
    f_got, f_want = _flag(device), _flag(device)
    ops.multi_tensor_unscale_(got, f_got, _scale(device))
    scaling_ops._unscale_ref(want, f_want, _scale(device))
    assert_bitwise(got, want)
    assert f_got.item() == f_want.item() == 0.0


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("dst_dtype", [F32, BF16, F64, None], ids=["to_fp32", "to_bf16", "to_fp64", "same"])
def test_unscale_copy_matches_reference(device, case, dst_dtype):
    src = _tensors(case, device)
    got = _like(src, dst_dtype)
    want = clone_args(got)
    f_got, f_want = _flag(device), _flag(device)
    ops.multi_tensor_unscale_copy_(src, got, f_got, _scale(device))
    scaling_ops._unscale_copy_ref(src, want, f_want, _scale(device))
    assert_bitwise(got, want)
    assert f_got.item() == f_want.item() == 0.0


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("y_dtype", [F32, None], ids=["y_fp32", "y_same"])
@pytest.mark.parametrize("a,b", [(1.0 / 3.0, 0.7), (0.125, 1.0)])
def test_axpby_matches_reference(device, case, y_dtype, a, b):
    x = _tensors(case, device)
    got = _like(x, y_dtype, contiguous=True)
    want = clone_args(got)
    f_got, f_want = _flag(device), _flag(device)
    ops.multi_tensor_axpby_(x, got, f_got, a, b)
    scaling_ops._axpby_ref(x, want, f_want, a, b)
    assert_bitwise(got, want)
    assert f_got.item() == f_want.item() == 0.0


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("dst_dtype", [F32, BF16, F16, F64], ids=["to_fp32", "to_bf16", "to_fp16", "to_fp64"])
def test_copy_matches_reference(device, case, dst_dtype):
    src = _tensors(case, device)
    got = _like(src, dst_dtype)
    want = clone_args(got)
    ops.multi_tensor_copy_(src, got)
    scaling_ops._copy_ref(src, want)
    assert_bitwise(got, want)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("per_tensor", [True, False])
def test_l2norm_matches_float64(device, case, per_tensor):
    x = _tensors(case, device)
    total, norms = ops.multi_tensor_l2norm(x, per_tensor)
    exact = torch.stack([t.double().pow(2).sum() for t in x]).sqrt() if x else torch.zeros(0)
    assert total.dtype == norms.dtype == torch.float32
    assert total.shape == () and total.device.type == torch.device(device).type
    torch.testing.assert_close(total.double().cpu(), exact.norm().cpu(), rtol=1e-5, atol=1e-6)
    if per_tensor:
        torch.testing.assert_close(norms.double().cpu(), exact.cpu(), rtol=1e-5, atol=1e-6)
    else:
        assert norms.numel() == 0
    ref_total, ref_norms = scaling_ops._l2norm_ref(x, per_tensor)
    torch.testing.assert_close(total.cpu(), ref_total.cpu(), rtol=1e-5, atol=1e-6)
    assert norms.shape == ref_norms.shape


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", list(CASES))
def test_unscale_l2norm_matches_float64(device, case):
    """The norm of x * inv_scale, x untouched; like l2norm, checked against fp64 (the order of sums differs)."""
    x = _tensors(case, device)
    before = clone_args(x)
    inv = _scale(device, 2.0**-7)
    total, norms = ops.multi_tensor_unscale_l2norm(x, inv, True)
    assert_bitwise(x, before)
    scaled = [t.to(torch.float64 if t.dtype == F64 else F32) * inv.reshape(()) for t in x]
    exact = torch.stack([t.double().pow(2).sum() for t in scaled]).sqrt()
    assert total.dtype == norms.dtype == F32 and total.shape == ()
    torch.testing.assert_close(norms.double().cpu(), exact.cpu(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(total.double().cpu(), exact.norm().cpu(), rtol=1e-5, atol=1e-6)
    ref_total, ref_norms = scaling_ops._unscale_l2norm_ref(x, inv, True)
    torch.testing.assert_close(norms.cpu(), ref_norms.cpu(), rtol=1e-5, atol=1e-6)
    total_only, none = ops.multi_tensor_unscale_l2norm(x, inv, False)
    assert none.numel() == 0 and torch.equal(total_only, total)


@pytest.mark.parametrize("device", DEVICES)
def test_unscale_l2norm_unscales_before_squaring(device):
    """Scaled fp32 grads whose squares overflow fp32 still have a finite unscaled norm."""
    x = [torch.full((100,), 1e25, device=device), torch.full((3,), 65504.0, device=device, dtype=F16)]
    total, norms = ops.multi_tensor_unscale_l2norm(x, _scale(device, 2.0**-24), True)
    assert torch.isfinite(total).item() and not torch.isfinite(x[0].square()).any()
    torch.testing.assert_close(norms.cpu(), torch.tensor([1e25 * 2.0**-24 * 10, 65504.0 * 2.0**-24 * 3**0.5]))
    x[0][7] = float("nan")
    total, norms = ops.multi_tensor_unscale_l2norm(x, _scale(device), True)
    assert torch.isnan(total).item() and torch.isnan(norms[0]).item()


def _hysteresis_state(device, scale, growth, hyst):
    return (torch.full((1,), scale, dtype=F32, device=device),
            torch.full((1,), growth, dtype=torch.int32, device=device),
            torch.full((1,), hyst, dtype=torch.int32, device=device))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("seed", range(4))
def test_update_scale_hysteresis_matches_reference(device, seed):
    """Bit-identical scale and trackers at every step of a random flag sequence (NaN and negative flags too)."""
    gen = torch.Generator().manual_seed(seed)
    growth_factor, backoff_factor = [(2.0, 0.5), (1.0001, 0.3), (3.0, 0.999), (2.0**100, 2.0**-100)][seed]
    interval, hysteresis = [(3, 2), (1, 1), (5, 4), (2, 3)][seed]
    flags = [0.0, 1.0, float("nan"), -1.0, float("inf"), 0.5]
    weights = torch.tensor([8.0, 4.0, 0.5, 0.5, 0.5, 0.5])
    got = _hysteresis_state(device, 65536.0, 0, hysteresis)
    want = _hysteresis_state(device, 65536.0, 0, hysteresis)
    for step in range(300):
        found = _flag(device, flags[int(torch.multinomial(weights, 1, generator=gen))])
        ops.update_scale_hysteresis(*got, found, growth_factor, backoff_factor, interval, hysteresis)
        scaling_ops._update_scale_hysteresis_ref(*want, found, growth_factor, backoff_factor, interval, hysteresis)
        for g, w, name in zip(got, want, ["scale", "growth_tracker", "hysteresis_tracker"]):
            assert torch.equal(g, w), f"step {step} ({found.item()}): {name} {g.item()} != {w.item()}"


@pytest.mark.parametrize("device", DEVICES)
def test_update_scale_hysteresis_rules(device):
    scale, growth, hyst = _hysteresis_state(device, 1024.0, 0, 2)
    inf, clean = _flag(device, 1.0), _flag(device, 0.0)

    def step(found):
        ops.update_scale_hysteresis(scale, growth, hyst, found, 2.0, 0.5, 3, 2)
        return scale.item(), growth.item(), hyst.item()

    assert step(clean) == (1024.0, 1, 2)
    assert step(inf) == (1024.0, 0, 1)    # hysteresis absorbs the first inf
    assert step(inf) == (512.0, 0, 0)     # used up: back off
    assert step(inf) == (256.0, 0, -1)    # and keep backing off
    assert step(clean) == (256.0, 1, 2)   # a clean step restores it
    assert step(clean) == (256.0, 2, 2)
    assert step(clean) == (512.0, 0, 2)   # growth_interval clean steps: grow
    scale.fill_(3e38)
    step(clean), step(clean)
    assert step(clean) == (torch.tensor(3e38).item(), 0, 2)  # no growth to inf


@pytest.mark.parametrize("device", DEVICES)
def test_update_scale_hysteresis_checks_its_state(device):
    scale, growth, hyst = _hysteresis_state(device, 1024.0, 0, 2)
    with pytest.raises(RuntimeError, match="growth_tracker must be a one-element Int tensor"):
        ops.update_scale_hysteresis(scale, growth.float(), hyst, _flag(device), 2.0, 0.5, 3, 2)
    with pytest.raises(RuntimeError, match="current_scale must be a one-element Float tensor"):
        ops.update_scale_hysteresis(torch.ones(2, device=device), growth, hyst, _flag(device), 2.0, 0.5, 3, 2)


def _loss_scale_tensors(device, scale, found=1.0):
    """state, inv_scale, scale, found_inf, overflow for loss_scale_update_."""
    state = torch.tensor([scale, 0, 0, 0, 0, 0, 0], dtype=torch.float64, device=device)
    return (state, _flag(device), torch.zeros((), device=device), _flag(device, found),
            _flag(device))


_LOSS_SCALE_CONFIGS = [  # scale_window, floor, floor_is_min, max_scale, dynamic, max_consecutive
    (3.0, 2.0**-24, False, 2.0**17, True, 50.0),
    (1.0, 2.0**10, True, 2.0**24, True, 50.0),    # a user's floor, reached and then collapsing
    (2000.0, 2.0**13, False, 2.0**16, True, 50.0),  # halves below the floor collapse at once
    (3.0, 2.0**-24, False, 2.0**24, False, 2.0),  # static: three overflows in a row collapse
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("config", range(len(_LOSS_SCALE_CONFIGS)))
def test_loss_scale_update_matches_reference(device, config):
    """The fused update and its reference body agree to the bit at every step of a random flag
    sequence (NaN, inf and negative flags count as overflows), every field and output."""
    args = _LOSS_SCALE_CONFIGS[config]
    gen = torch.Generator().manual_seed(config)
    flags = [0.0, 1.0, float("nan"), -1.0, float("inf")]
    weights = torch.tensor([8.0, 2.0, 0.5, 0.5, 0.5])
    got = _loss_scale_tensors(device, 65536.0 if args[4] else 4.0, 0.0)
    want = tuple(t.clone() for t in got)
    for step in range(200):
        value = flags[int(torch.multinomial(weights, 1, generator=gen))]
        got[3].fill_(value), want[3].fill_(value)
        ops.loss_scale_update_(*got, scale_window=args[0], floor=args[1], floor_is_min=args[2],
                               max_scale=args[3], dynamic=args[4], max_consecutive=args[5])
        scaling_ops._loss_scale_update_ref(*want, *args)
        for g, w, name in zip(got, want, ["state", "inv_scale", "scale", "found_inf", "overflow"]):
            assert torch.equal(g, w), f"step {step} (flag {value}): {name} {g} != {w}"
        assert got[3].item() == 0.0 and got[4].item() == float(value != 0.0)


@pytest.mark.parametrize("device", DEVICES)
def test_loss_scale_update_rules(device):
    state, inv, scale, found, overflow = _loss_scale_tensors(device, 4.0, 0.0)

    def step(flag):
        found.fill_(flag)
        ops.loss_scale_update_(state, inv, scale, found, overflow, scale_window=2.0, floor=1.0,
                               floor_is_min=True, max_scale=8.0, dynamic=True,
                               max_consecutive=50.0)
        return state.tolist()

    assert step(0.0) == [4.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    assert step(0.0) == [8.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]   # the window: doubled
    assert step(0.0) == [8.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    assert step(0.0) == [8.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]   # capped at max_scale
    assert step(1.0) == [4.0, 0.0, 1.0, 1.0, 1.0, 1.0, 0.0]   # halved, counted
    assert (inv.item(), scale.item(), overflow.item()) == (0.25, 4.0, 1.0)
    step(1.0), step(1.0)
    assert step(1.0) == [1.0, 0.0, 4.0, 4.0, 1.0, 4.0, 1.0]   # at the floor, one more collapses


@pytest.mark.parametrize("device", DEVICES)
def test_loss_scale_update_checks_its_tensors(device):
    state, inv, scale, found, overflow = _loss_scale_tensors(device, 4.0)
    kwargs = dict(scale_window=2.0, floor=1.0, floor_is_min=True, max_scale=8.0, dynamic=True,
                  max_consecutive=50.0)
    with pytest.raises(RuntimeError, match="state must be a contiguous float64 tensor of 7"):
        ops.loss_scale_update_(state.float(), inv, scale, found, overflow, **kwargs)
    with pytest.raises(RuntimeError, match="overflow must be a one-element float32 tensor"):
        ops.loss_scale_update_(state, inv, scale, found, torch.zeros(2, device=device), **kwargs)


@pytest.mark.parametrize("device", DEVICES)
def test_empty_lists(device):
    found_inf = _flag(device)
    ops.multi_tensor_unscale_([], found_inf, _scale(device))
    ops.multi_tensor_unscale_copy_([], [], found_inf, _scale(device))
    ops.multi_tensor_axpby_([], [], found_inf, 2.0, 1.0)
    ops.multi_tensor_copy_([], [])
    total, norms = ops.multi_tensor_l2norm([], True)
    assert found_inf.item() == 0.0
    assert total.item() == 0.0 and norms.numel() == 0


# ------------------------------------------------------------ inf/NaN and found_inf

POSITIONS = ["first", "middle", "last"]


def _index(n, where):
    return {"first": 0, "middle": n // 2, "last": n - 1}[where]


def _poison(tensors, value, which, where):
    """Put ``value`` at element ``where`` of tensor ``which``; returns that tensor's index."""
    i = _index(len(tensors), which)
    flat = tensors[i].view(-1)
    flat[_index(flat.numel(), where)] = value
    return i


def _nonfinite_case(device):
    # Mixed dtypes and sizes that straddle vector blocks and CPU tasks.
    gen = torch.Generator().manual_seed(3)
    specs = [(33, F32), (40_000, BF16), (17, F16), (70_001, F32), (1023, BF16), (301, F64)]
    return [_make((n,), dt, device, gen=gen) for n, dt in specs]


@pytest.mark.parametrize("device", DEVICES)
# -inf is slow: it fails the same finiteness check as inf, whose cases stay in test-fast.
@pytest.mark.parametrize("value", [
    float("inf"), pytest.param(float("-inf"), marks=pytest.mark.slow), float("nan")],
    ids=["inf", "-inf", "nan"])
@pytest.mark.parametrize("which", POSITIONS)
@pytest.mark.parametrize("where", POSITIONS)
def test_nonfinite_sets_found_inf(device, value, which, where):
    x = _nonfinite_case(device)
    _poison(x, value, which, where)

    got, want = clone_args(x), clone_args(x)
    f_got, f_want = _flag(device), _flag(device)
    ops.multi_tensor_unscale_(got, f_got, _scale(device))
    scaling_ops._unscale_ref(want, f_want, _scale(device))
    assert_bitwise(got, want)
    assert f_got.item() == f_want.item() == 1.0

    dst_got, dst_want = _like(x, F32), _like(x, F32)
    f_got, f_want = _flag(device), _flag(device)
    ops.multi_tensor_unscale_copy_(x, dst_got, f_got, _scale(device))
    scaling_ops._unscale_copy_ref(x, dst_want, f_want, _scale(device))
    assert_bitwise(dst_got, dst_want)
    assert f_got.item() == f_want.item() == 1.0

    y_got, y_want = _like(x, F32), _like(x, F32)
    f_got, f_want = _flag(device), _flag(device)
    ops.multi_tensor_axpby_(x, y_got, f_got, 0.5, 1.0)
    scaling_ops._axpby_ref(x, y_want, f_want, 0.5, 1.0)
    assert_bitwise(y_got, y_want)
    assert f_got.item() == f_want.item() == 1.0


@pytest.mark.parametrize("device", DEVICES)
def test_axpby_checks_only_x(device):
    x = _nonfinite_case(device)
    y = _like(x, F32)
    y[1][5] = float("inf")
    found_inf = _flag(device)
    ops.multi_tensor_axpby_(x, y, found_inf, 0.5, 1.0)
    assert found_inf.item() == 0.0


@pytest.mark.parametrize("device", DEVICES)
def test_found_inf_is_never_cleared(device):
    x = _nonfinite_case(device)
    found_inf = _flag(device, 1.0)
    ops.multi_tensor_unscale_(clone_args(x), found_inf, _scale(device))
    ops.multi_tensor_unscale_copy_(x, _like(x, F32), found_inf, _scale(device))
    ops.multi_tensor_axpby_(x, _like(x, F32), found_inf, 1.0, 1.0)
    assert found_inf.item() == 1.0


@pytest.mark.parametrize("device", DEVICES)
def test_l2norm_propagates_nonfinite(device):
    x = _nonfinite_case(device)
    i = _poison(x, float("inf"), "middle", "last")
    total, norms = ops.multi_tensor_l2norm(x, True)
    assert total.item() == float("inf") and norms[i].item() == float("inf")
    _poison(x, float("nan"), "first", "first")
    total, norms = ops.multi_tensor_l2norm(x, True)
    assert torch.isnan(total).item() and torch.isnan(norms[0]).item()


@pytest.mark.parametrize("device", DEVICES)
def test_fp64_is_computed_in_fp64(device):
    """fp64 values beyond fp32's range are finite, and keep their precision through every op."""
    x = torch.tensor([1e300, -3e-310, 1.0 + 2.0**-40, 0.1], dtype=F64, device=device)
    inv = _scale(device, 2.0**-16)
    found_inf = _flag(device)
    got = [x.clone()]
    ops.multi_tensor_unscale_(got, found_inf, inv)
    assert found_inf.item() == 0.0
    assert torch.equal(got[0], x * 2.0**-16)
    y = [torch.full((4,), 1.0 + 2.0**-45, dtype=F64, device=device)]
    ops.multi_tensor_axpby_([x], y, found_inf, 0.1, 3.0)
    assert torch.equal(y[0], 0.1 * x + 3.0 * (1.0 + 2.0**-45))
    total, norms = ops.multi_tensor_l2norm([x[1:]], True)
    torch.testing.assert_close(total.double(), x[1:].norm(), rtol=1e-6, atol=0)


class _ScaledModel(torch.nn.Module):
    """An fp32 layer with fp64 parameters around it: a 0-dim temperature and a bias."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(6, 4)
        self.temperature = torch.nn.Parameter(torch.tensor(1.5, dtype=F64))
        self.bias = torch.nn.Parameter(torch.linspace(-1, 1, 4, dtype=F64))

    def forward(self, x):
        return ((self.lin(x).double() + self.bias) / self.temperature).pow(2).mean()


def _train_fp64(opt_level, loss_scale, steps=3):
    model = _ScaledModel()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp_patch.initialize(model, opt, opt_level=opt_level, loss_scale=loss_scale, verbosity=0)
    gen = torch.Generator().manual_seed(5)
    grads = []
    for _ in range(steps):
        opt.zero_grad()
        loss = model(torch.randn(8, 6, generator=gen))
        with amp_patch.scale_loss(loss, opt) as scaled:
            scaled.backward()
        grads.append([p.grad.clone() for p in model.parameters()])
        opt.step()
    scale = amp_patch.state_dict()["loss_scaler0"]["loss_scale"]
    assert scale == (65536.0 if loss_scale == "dynamic" else loss_scale), "a step was skipped"
    amp_patch.deinitialize()
    return [p.detach().clone() for p in model.parameters()], grads


@pytest.mark.parametrize("opt_level", ["O0", "O1"])
def test_fp64_parameter_trains_under_dynamic_scale(opt_level):
    """Scaling by a power of two is exact, so the dynamic scale changes no bit of an fp64 grad."""
    params, grads = _train_fp64(opt_level, "dynamic")
    ref_params, ref_grads = _train_fp64(opt_level, 1.0)
    assert params[0].dtype == F64 and params[0].dim() == 0  # the temperature
    for g, r in zip(grads, ref_grads):
        assert_bitwise(g, r)
    assert_bitwise(params, ref_params)
    assert not torch.equal(params[0], torch.tensor(1.5, dtype=F64)), "no step was taken"


# ------------------------------------------------------------ errors

@pytest.mark.parametrize("device", DEVICES)
def test_mismatched_lists_raise(device):
    a = [torch.zeros(3, device=device), torch.zeros(4, device=device)]
    with pytest.raises(RuntimeError, match="list lengths differ"):
        ops.multi_tensor_copy_(a, a[:1])
    with pytest.raises(RuntimeError, match="shape"):
        ops.multi_tensor_unscale_copy_(a, [a[0], torch.zeros(5, device=device)], _flag(device), _scale(device))


@pytest.mark.parametrize("device", DEVICES)
def test_native_error_messages_spell_numbers_shapes_and_floats(device):
    """csrc/check.h builds the kernels' messages without streams, as c10::str would print them.

    Streams crashed the process instead of raising on a GPU image whose compiler linked the C++
    runtime into amp_patch._C (every message that printed a number), so no check uses them.
    """
    if not ops.has_native_kernel(device):
        pytest.skip("extension not built")
    x = [torch.ones(2, 3, device=device)]
    with pytest.raises(RuntimeError, match=re.escape(
            "multi_tensor_copy_: tensor 0 has shape [2, 3] in the first list but [3, 2] in the second")):
        torch.ops.amp_patch.multi_tensor_copy_(x, [torch.ones(3, 2, device=device)])
    with pytest.raises(RuntimeError, match=re.escape("multi_tensor_copy_: list lengths differ (1 vs 0)")):
        torch.ops.amp_patch.multi_tensor_copy_(x, [])
    with pytest.raises(RuntimeError, match=re.escape(
            "multi_tensor_sgd_: momentum is 0.875 but momentum_buffers has 0 tensors for 1 grads")):
        torch.ops.amp_patch.multi_tensor_sgd_(x, x, [], [], None, None, 0.1, 0.0, 0.875, 0.0, False,
                                               False, False)


@pytest.mark.parametrize("device", DEVICES)
def test_unsupported_dtype_is_named_by_native_kernel(device):
    if not ops.has_native_kernel(device):
        pytest.skip("extension not built")
    with pytest.raises(RuntimeError, match="multi_tensor_unscale_.*Int"):
        ops.multi_tensor_unscale_([torch.ones(3, dtype=torch.int32, device=device)], _flag(device),
                                  _scale(device))


# ------------------------------------------------------------ registration

def _opcheck_args(name, device):
    x = [_make((n,), dt, device) for n, dt in [(7, F32), (33, BF16), (4, F32)]]
    y = _like(x, F32)
    return {
        "multi_tensor_unscale_": (x, _flag(device), _scale(device)),
        "multi_tensor_unscale_copy_": (x, y, _flag(device), _scale(device)),
        "multi_tensor_axpby_": (x, y, _flag(device), 0.5, 2.0),
        "multi_tensor_l2norm": (x, True),
        "multi_tensor_copy_": (x, y),
        "multi_tensor_unscale_l2norm": (x, _scale(device), True),
        "update_scale_hysteresis": (_flag(device, 1024.0), torch.zeros(1, dtype=torch.int32, device=device),
                                    torch.full((1,), 2, dtype=torch.int32, device=device), _flag(device, 1.0),
                                    2.0, 0.5, 100, 2),
        "loss_scale_update_": (*_loss_scale_tensors(device, 1024.0), 2000.0, 2.0**-24, False,
                               2.0**24, True, 50.0),
    }[name]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", sorted(scaling_ops._SCHEMAS))
def test_opcheck(device, name):
    op = getattr(torch.ops.amp_patch, name).default
    torch.library.opcheck(op, _opcheck_args(name, device))


def test_native_cpu_kernel_serves_cpu():
    if not ops.has_native_kernel("cpu"):
        if os.environ.get("AMP_PATCH_REQUIRE_EXT") == "1":
            pytest.fail("AMP_PATCH_REQUIRE_EXT=1 but the CPU kernels are not registered: extension not built")
        pytest.skip("extension not built")
    assert ops.native_extension_loaded()
    for name in scaling_ops._SCHEMAS:
        assert ops.has_native_kernel("cpu", name), name


def _run_python(code, **env):
    full_env = {**os.environ, **env}
    # cwd: not the checkout's root, whose amp_patch/ would shadow an installed (non-editable)
    # package, which has the compiled _C where the checkout may have none.
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=full_env,
                          capture_output=True, text=True, timeout=120,
                          cwd=os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_reference_serves_when_extension_absent():
    proc = _run_python(
        """
        import torch
        import amp_patch
        from amp_patch import ops
        assert not ops.native_extension_loaded()
        assert not ops.has_native_kernel("cpu")
        g = [torch.tensor([1.0, 2.0, float("inf")]), torch.tensor([4.0], dtype=torch.bfloat16)]
        found_inf = torch.zeros(1)
        ops.multi_tensor_unscale_(g, found_inf, torch.full((1,), 0.5))
        assert found_inf.item() == 1.0
        assert g[0][:2].tolist() == [0.5, 1.0] and g[1].item() == 2.0
        total, _ = ops.multi_tensor_l2norm([torch.tensor([3.0, 4.0])], False)
        assert total.item() == 5.0
        print("ok")
        """,
        AMP_PATCH_NO_EXT="1",
    )
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr


@pytest.mark.slow
@pytest.mark.parametrize("capability", ["AVX2", "DEFAULT"])
def test_every_cpu_isa_matches_reference(capability):
    """Forcing torch onto a lower ISA (ATEN_CPU_CAPABILITY) selects our matching loops."""
    if not ops.has_native_kernel("cpu"):
        pytest.skip("extension not built")
    proc = _run_python(
        """
        import torch
        from amp_patch import _C, ops
        from amp_patch.ops import scaling_ops
        print(_C.cpu_capability())
        gen = torch.Generator().manual_seed(0)
        dts = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
        x = [(torch.randn(n, generator=gen) * 100).to(dts[i % 4]) for i, n in enumerate([1, 17, 33, 1023, 40001, 65])]
        x[3][7] = float("inf")
        for dst_dt in dts:
            y = [torch.randn(t.shape, generator=gen).to(dst_dt) for t in x]
            y2 = [t.clone() for t in y]
            f1, f2 = torch.zeros(1), torch.zeros(1)
            ops.multi_tensor_unscale_copy_(x, y, f1, torch.full((1,), 0.3))
            scaling_ops._unscale_copy_ref(x, y2, f2, torch.full((1,), 0.3))
            assert f1.item() == f2.item() == 1.0
            assert all(torch.equal(a.nan_to_num(), b.nan_to_num()) for a, b in zip(y, y2))
            ops.multi_tensor_axpby_(x, y, f1, 0.3, 0.9)
            scaling_ops._axpby_ref(x, y2, f2, 0.3, 0.9)
            assert all(torch.equal(a.nan_to_num(), b.nan_to_num()) for a, b in zip(y, y2))
            ops.multi_tensor_copy_(x, y)
            scaling_ops._copy_ref(x, y2)
            assert all(torch.equal(a.nan_to_num(), b.nan_to_num()) for a, b in zip(y, y2))
        x[3][7] = 0.0
        total, _ = ops.multi_tensor_l2norm(x, False)
        exact = torch.cat([t.double() for t in x]).norm()
        torch.testing.assert_close(total.double(), exact, rtol=1e-5, atol=0)
        total, _ = ops.multi_tensor_unscale_l2norm(x, torch.full((1,), 0.25), False)
        torch.testing.assert_close(total.double(), exact * 0.25, rtol=1e-5, atol=0)
        print("ok")
        """,
        ATEN_CPU_CAPABILITY=capability.lower(),
    )
    assert proc.returncode == 0 and proc.stdout.split() == [capability, "ok"], proc.stdout + proc.stderr


# ------------------------------------------------------------ property

_DTYPE = st.sampled_from([F32, BF16, F16, F64])
_TENSOR = st.tuples(st.integers(0, 3000), _DTYPE, st.sampled_from(["contiguous", "sliced"]))


@pytest.mark.parametrize("device", DEVICES)
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(specs=st.lists(_TENSOR, max_size=8), dst_dtype=_DTYPE, seed=st.integers(0, 2**16))
def test_property_random_lists(device, specs, dst_dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    x = [_make((2, (n + 1) // 2) if layout == "sliced" else (n,), dt, device, layout, gen)
         for n, dt, layout in specs]
    got, want = clone_args(x), clone_args(x)
    f_got, f_want = _flag(device), _flag(device)
    ops.multi_tensor_unscale_(got, f_got, _scale(device))
    scaling_ops._unscale_ref(want, f_want, _scale(device))
    assert_bitwise(got, want)
    y_got = _like(x, dst_dtype, seed=seed)
    y_want = clone_args(y_got)
    ops.multi_tensor_axpby_(x, y_got, f_got, 0.25, 0.5)
    scaling_ops._axpby_ref(x, y_want, f_want, 0.25, 0.5)
    assert_bitwise(y_got, y_want)
    assert f_got.item() == f_want.item()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("offset", [0, 1, 3, 7, 15, 17])
def test_unscale_copy_into_misaligned_contiguous_views(device, offset):
    """fp32 outputs that start off a vector boundary: a short head, then streamed stores."""
    gen = torch.Generator().manual_seed(offset)
    storage = torch.zeros(40_000 + 64, device=device)
    sizes = [5_003, 1, 33, 20_000]
    dst, start = [], offset
    for n in sizes:
        dst.append(storage[start:start + n])  # contiguous, base not 64-byte aligned
        start += n + 5
    src = [torch.randn(n, generator=gen).bfloat16().to(device) for n in sizes]
    src[0][2] = float("inf")     # inside the unaligned head
    src[3][-1] = float("nan")    # in the streamed part's tail
    want = [torch.empty_like(d) for d in dst]
    got_flag, want_flag = torch.zeros(1, device=device), torch.zeros(1, device=device)
    inv = torch.full((1,), 0.25, device=device)
    ops.multi_tensor_unscale_copy_(src, dst, got_flag, inv)
    scaling_ops._unscale_copy_ref(src, want, want_flag, inv)
    for g, w in zip(dst, want):
        assert torch.equal(g.nan_to_num(), w.nan_to_num())
        assert torch.equal(g.isnan(), w.isnan())
    assert got_flag.item() == want_flag.item() == 1.0
    outside = torch.ones_like(storage, dtype=torch.bool)
    start = offset
    for n in sizes:
        outside[start:start + n] = False
        start += n + 5
    assert not storage[outside].any(), "a store reached outside its tensor"


# ------------------------------------------------------------ aliasing lists

# DEVICES[1] carries the skip-without-CUDA mark.
BACKENDS = ["reference", "native-cpu", pytest.param("native-cuda", marks=DEVICES[1].marks)]

_ALIAS_MSG = "overlap in memory"


def _call(backend, name, *args):
    """Call op ``name`` through the reference body or through the dispatcher."""
    if backend == "reference":
        return getattr(scaling_ops, {"multi_tensor_unscale_": "_unscale_ref",
                             "multi_tensor_unscale_copy_": "_unscale_copy_ref",
                             "multi_tensor_axpby_": "_axpby_ref",
                             "multi_tensor_copy_": "_copy_ref"}[name])(*args)
    return getattr(ops, name)(*args)


def _backend_device(backend):
    if backend == "native-cpu" and not ops.has_native_kernel("cpu"):
        pytest.skip("extension not built")
    return "cuda" if backend == "native-cuda" else "cpu"


@pytest.mark.parametrize("backend", BACKENDS)
def test_aliasing_lists_raise(backend):
    device = _backend_device(backend)
    buf = torch.randn(64, device=device)
    a, b, c = buf[:8], buf[8:16], buf[16:24]
    g = torch.randn(10, device=device)
    flag, inv = _flag(device), _scale(device)
    bad = [
        # The same grad twice would be unscaled twice.
        ("multi_tensor_unscale_", ([g, g], flag, inv)),
        ("multi_tensor_unscale_", ([buf[:10], buf[5:15]], flag, inv)),
        # dst[0] is src[1]: src[1] is read before or after it is overwritten.
        ("multi_tensor_unscale_copy_", ([a, b], [b, c], flag, inv)),
        ("multi_tensor_unscale_copy_", ([a, b], [buf[4:12], c], flag, inv)),
        # Two writes into one place.
        ("multi_tensor_copy_", ([a, b], [c, c])),
        ("multi_tensor_copy_", ([a, b], [buf[24:32], buf[30:38]])),
        # A dst that overlaps its own src but is not the very same view.
        ("multi_tensor_copy_", ([a], [buf[1:9]])),
        # y[0] overlaps x[1].
        ("multi_tensor_axpby_", ([a, buf[20:28]], [buf[16:24], buf[40:48]], flag, 0.5, 1.0)),
        # An fp32 dst laid over the bytes of a bf16 src from the same address.
        ("multi_tensor_unscale_copy_", ([buf.view(torch.bfloat16)[:8]], [buf[:8]], flag, inv)),
    ]
    for name, args in bad:
        before = buf.clone()
        with pytest.raises(RuntimeError, match=f"amp_patch::{name}: .*{_ALIAS_MSG}"):
            _call(backend, name, *args)
        assert torch.equal(buf, before), f"{name} wrote before raising"
    assert flag.item() == 0.0


@pytest.mark.parametrize("backend", BACKENDS)
def test_disjoint_and_identical_lists_are_accepted(backend):
    """Adjacent slices of one buffer, a source read twice, and dst[i] that *is* src[i] are fine."""
    device = _backend_device(backend)
    inv = _scale(device)
    buf = torch.randn(64, device=device)
    slices = [buf[:10], buf[10:20], buf[20:20], buf[20:21]]
    want = [t.clone() for t in slices]
    _call(backend, "multi_tensor_unscale_", slices, _flag(device), inv)
    scaling_ops._unscale_ref(want, _flag(device), inv)
    assert_bitwise(slices, want)

    g = [torch.randn(7, device=device), torch.randn(3, device=device).bfloat16()]
    want = [t.clone() for t in g]
    _call(backend, "multi_tensor_unscale_copy_", g, g, _flag(device), inv)  # Apex's O1 [grads, grads]
    scaling_ops._unscale_ref(want, _flag(device), inv)
    assert_bitwise(g, want)

    w = torch.randn(5, device=device)
    out = [torch.empty(5, device=device), torch.empty(5, device=device, dtype=BF16)]
    _call(backend, "multi_tensor_copy_", [w, w], out)
    assert_bitwise(out, [w.clone(), w.bfloat16()])

    y = [torch.randn(9, device=device)]
    want = [2.0 * y[0] + 0.5 * y[0]]
    _call(backend, "multi_tensor_axpby_", y, y, _flag(device), 2.0, 0.5)
    assert_bitwise(y, want)


# ------------------------------------------------------------ CUDA launcher and hardware cases
#
# These reach paths that the case tables do not: the launcher's argument-table
# flushes, 64-bit element indices, vector alignment per pointer, streams and
# graph capture. They need a GPU and skip without one.

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA not available")

# What one launch holds (csrc/cuda/multi_tensor_apply.cuh): 710 tensors and
# 3072 chunks of 65536 elements with CUDA 13's 32 KB of kernel parameters,
# 102 tensors and 320 chunks with older toolkits. The cases below cross both.
_CHUNK = 65536
_TABLE_BLOCKS = 3072


def _rand_cuda(n, dtype, offset=0, gen=None, scale=100.0):
    """n random values of dtype on the GPU; ``offset`` elements into its storage (misaligned views)."""
    return (torch.randn(n + offset, device="cuda", generator=gen) * scale).to(dtype)[offset:]


def _clone_at_offset(t):
    """A copy at the same storage offset, so a misaligned view stays misaligned."""
    off = t.storage_offset()
    return torch.empty(off + t.numel(), dtype=t.dtype, device=t.device)[off:].copy_(t)


def _check_every_op(xs, label):
    """Every op on the list against the reference (norms against fp64), flags included."""
    inv = _scale("cuda")
    got, want = [_clone_at_offset(x) for x in xs], [_clone_at_offset(x) for x in xs]
    f_got, f_want = _flag("cuda"), _flag("cuda")
    ops.multi_tensor_unscale_(got, f_got, inv)
    scaling_ops._unscale_ref(want, f_want, inv)
    assert_bitwise(got, want)
    assert f_got.item() == f_want.item(), f"{label}: unscale_ flag"
    for dst_dtype in (F32, BF16):
        got = [torch.empty_like(x, dtype=dst_dtype) for x in xs]
        want = [torch.empty_like(x, dtype=dst_dtype) for x in xs]
        f_got, f_want = _flag("cuda"), _flag("cuda")
        ops.multi_tensor_unscale_copy_(xs, got, f_got, inv)
        scaling_ops._unscale_copy_ref(xs, want, f_want, inv)
        assert_bitwise(got, want)
        assert f_got.item() == f_want.item(), f"{label}: unscale_copy_ flag"
        ops.multi_tensor_copy_(xs, got)
        scaling_ops._copy_ref(xs, want)
        assert_bitwise(got, want)
    y = [_rand_cuda(x.numel(), F32) for x in xs]
    got, want = clone_args(y), clone_args(y)
    f_got, f_want = _flag("cuda"), _flag("cuda")
    ops.multi_tensor_axpby_(xs, got, f_got, 0.25, 1.5)
    scaling_ops._axpby_ref(xs, want, f_want, 0.25, 1.5)
    assert_bitwise(got, want)
    assert f_got.item() == f_want.item(), f"{label}: axpby_ flag"
    exact = torch.stack([x.double().pow(2).sum() for x in xs]).sqrt()
    close = dict(rtol=1e-5, atol=1e-6, equal_nan=True)
    total, norms = ops.multi_tensor_l2norm(xs, True)
    torch.testing.assert_close(norms.double(), exact, **close)
    torch.testing.assert_close(total.double(), exact.norm(), **close)
    total, norms = ops.multi_tensor_unscale_l2norm(xs, inv, True)
    torch.testing.assert_close(norms.double(), exact * inv.item(), **close)
    torch.testing.assert_close(total.double(), exact.norm() * inv.item(), **close)


@requires_cuda
@pytest.mark.parametrize("poison", [False, True], ids=["finite", "one_inf"])
def test_cuda_argument_table_flush(poison):
    """1500 tensors of one dtype group (more than the 710 one launch holds), some misaligned."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    xs = [_rand_cuda(1 + (97 * i) % 3000, F32, offset=int(i % 5 == 0), gen=gen) for i in range(1500)]
    if poison:
        xs[777].view(-1)[-1] = float("inf")
    _check_every_op(xs, "1500 fp32 tensors")
    mixed = [_rand_cuda(1 + (31 * i) % 900, [F32, BF16, F16, F64][i % 4], gen=gen) for i in range(3000)]
    _check_every_op(mixed, "3000 tensors in 4 dtype groups")


@requires_cuda
@pytest.mark.slow
def test_cuda_split_tensor_at_nonzero_table_index():
    """A tensor whose chunks span launches while it sits at table index 5 (carried over as entry 0)."""
    gen = torch.Generator(device="cuda").manual_seed(1)
    xs = [_rand_cuda(n, BF16, gen=gen) for n in (5, 70_001, 3, 65_536, 131_073)]
    xs.append(_rand_cuda((_TABLE_BLOCKS + 100) * _CHUNK + 777, BF16, gen=gen))
    xs.append(_rand_cuda(70_001, BF16, gen=gen))
    _check_every_op(xs, "a split tensor at index 5")
    xs[5][-1] = float("nan")
    _check_every_op(xs, "a split tensor at index 5, NaN in its last chunk")


@requires_cuda
@pytest.mark.slow
def test_cuda_l2norm_of_a_large_tensor_against_fp64():
    """fp32 accumulation over 2**27 elements (2048 chunks) stays within fp32 rounding of fp64."""
    gen = torch.Generator(device="cuda").manual_seed(2)
    x = torch.randn(2**27, device="cuda", generator=gen) * 1e3 + 5e2
    exact = x.double().norm()
    total, norms = ops.multi_tensor_l2norm([x], True)
    torch.testing.assert_close(total.double(), exact, rtol=1e-5, atol=0)
    torch.testing.assert_close(norms.double(), exact.reshape(1), rtol=1e-5, atol=0)
    total, _ = ops.multi_tensor_unscale_l2norm([x], _scale("cuda", 2.0**-10), False)
    torch.testing.assert_close(total.double(), exact * 2.0**-10, rtol=1e-5, atol=0)


@requires_cuda
@pytest.mark.slow
def test_cuda_tensor_over_2_31_elements():
    """64-bit element indices: a bf16 tensor of 2**31 + 4099 elements, an inf in its very last one."""
    n = 2**31 + 4099
    if torch.cuda.mem_get_info()[0] < 16 * 2**30:
        pytest.skip("needs 16 GiB of free GPU memory")
    x = torch.empty(n, dtype=BF16, device="cuda")
    slices = [slice(i, min(i + 2**28, n)) for i in range(0, n, 2**28)]
    gen = torch.Generator(device="cuda").manual_seed(3)
    for sl in slices:
        x[sl] = torch.randn(sl.stop - sl.start, device="cuda", generator=gen).to(BF16)
    x[-1] = float("inf")
    before = x.clone()
    total, norms = ops.multi_tensor_l2norm([x], True)
    assert total.item() == float("inf") == norms.item()
    x[-1] = 1.0
    before[-1] = 1.0
    exact = torch.stack([before[sl].double().pow(2).sum() for sl in slices]).sum().sqrt()
    total, _ = ops.multi_tensor_l2norm([x], False)
    torch.testing.assert_close(total.double(), exact, rtol=1e-4, atol=0)
    x[-1] = float("inf")
    found_inf, inv = _flag("cuda"), _scale("cuda", 0.5)
    ops.multi_tensor_unscale_([x], found_inf, inv)
    assert found_inf.item() == 1.0
    for sl in slices[:-1] + [slice(slices[-1].start, n - 1)]:
        assert torch.equal(x[sl], (before[sl].float() * 0.5).to(BF16)), sl
    assert x[-1].item() == float("inf")
    del before
    dst = torch.empty_like(x)
    ops.multi_tensor_copy_([x], [dst])
    assert torch.equal(dst[-4099:], x[-4099:]) and torch.equal(dst[:4099], x[:4099])


@requires_cuda
def test_cuda_ops_run_on_the_current_stream():
    """Work goes to the current (non-default) stream, and nothing waits for it on the host."""
    gen = torch.Generator(device="cuda").manual_seed(4)
    xs = [_rand_cuda(n, dt, gen=gen) for n, dt in [(70_001, F32), (33, BF16), (4099, F16), (9, F64)]]
    ys = [_rand_cuda(x.numel(), F32, gen=gen) for x in xs]
    inv = _scale("cuda")
    want_x, want_y = clone_args(xs), clone_args(ys)
    f_want = _flag("cuda")
    scaling_ops._unscale_ref(want_x, f_want, inv)
    scaling_ops._axpby_ref(want_x, want_y, f_want, 0.5, 2.0)
    want_total = scaling_ops._l2norm_ref(want_y, True)
    torch.cuda.synchronize()  # so that the default stream is idle before the calls below
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    found_inf = _flag("cuda")
    with torch.cuda.stream(side):
        torch.cuda._sleep(200_000_000)  # keeps the side stream busy well past the calls below
        ops.multi_tensor_unscale_(xs, found_inf, inv)
        ops.multi_tensor_axpby_(xs, ys, found_inf, 0.5, 2.0)
        total, norms = ops.multi_tensor_l2norm(ys, True)
        hysteresis = _hysteresis_state("cuda", 1024.0, 0, 2)
        ops.update_scale_hysteresis(*hysteresis, found_inf, 2.0, 0.5, 3, 2)
        assert not side.query(), "an op waited for the GPU"
    assert torch.cuda.default_stream().query(), "an op launched on the default stream"
    torch.cuda.current_stream().wait_stream(side)
    assert_bitwise(xs, want_x)
    assert_bitwise(ys, want_y)
    torch.testing.assert_close(norms, want_total[1], rtol=1e-5, atol=1e-6)
    assert found_inf.item() == 0.0 and hysteresis[1].item() == 1


@requires_cuda
def test_cuda_denormal_inputs_and_outputs():
    """No flush to zero: denormal inputs and products stay bit-equal to the reference."""
    tiny = {F32: 1e-39, BF16: 1e-39, F16: 3e-6, F64: 1e-310}
    xs = [torch.linspace(-tiny[dt], tiny[dt], n, device="cuda", dtype=F64).to(dt)
          for dt, n in [(F32, 4099), (BF16, 1027), (F16, 515), (F64, 33)]]
    assert all((x != 0).any() and (x.abs() < torch.finfo(x.dtype).tiny).all() for x in xs)
    inv = _scale("cuda", 0.375)
    got, want = clone_args(xs), clone_args(xs)
    f_got, f_want = _flag("cuda"), _flag("cuda")
    ops.multi_tensor_unscale_(got, f_got, inv)
    scaling_ops._unscale_ref(want, f_want, inv)
    assert_bitwise(got, want)
    assert all((g != 0).any() for g in got), "denormal results were flushed to zero"
    for dst_dtype in (F32, BF16, F16, F64):
        got = [torch.empty_like(x, dtype=dst_dtype) for x in xs]
        want = [torch.empty_like(x, dtype=dst_dtype) for x in xs]
        ops.multi_tensor_unscale_copy_(xs, got, f_got, _scale("cuda", 3.0))
        scaling_ops._unscale_copy_ref(xs, want, f_want, _scale("cuda", 3.0))
        assert_bitwise(got, want)
        ops.multi_tensor_copy_(xs, got)
        scaling_ops._copy_ref(xs, want)
        assert_bitwise(got, want)
    y = [torch.full_like(x, 1e-39, dtype=F32) for x in xs]
    got, want = clone_args(y), clone_args(y)
    ops.multi_tensor_axpby_(xs, got, f_got, 0.5, 0.25)
    scaling_ops._axpby_ref(xs, want, f_want, 0.5, 0.25)
    assert_bitwise(got, want)
    assert f_got.item() == f_want.item() == 0.0


@requires_cuda
@pytest.mark.parametrize("x_offset,y_offset", [(0, 1), (0, 3), (1, 0), (2, 5)])
def test_cuda_axpby_with_misaligned_operands(x_offset, y_offset):
    """A y (or x) that starts off a 16-byte boundary takes the scalar path, and still matches."""
    gen = torch.Generator(device="cuda").manual_seed(x_offset * 10 + y_offset)
    sizes = [70_001, 65_536, 17, 4099]
    for x_dtype in (F32, BF16):
        x = [_rand_cuda(n, x_dtype, offset=x_offset, gen=gen) for n in sizes]
        y = [_rand_cuda(n, F32, offset=y_offset, gen=gen) for n in sizes]
        got, want = [_clone_at_offset(t) for t in y], [_clone_at_offset(t) for t in y]
        f_got, f_want = _flag("cuda"), _flag("cuda")
        ops.multi_tensor_axpby_(x, got, f_got, 1.0 / 3.0, 0.7)
        scaling_ops._axpby_ref(x, want, f_want, 1.0 / 3.0, 0.7)
        assert [t.storage_offset() for t in got] == [y_offset] * len(sizes)
        assert_bitwise(got, want)


@requires_cuda
def test_cuda_l2norm_is_deterministic():
    """A fixed order of summation: the same bits from run to run, whatever the scheduling."""
    gen = torch.Generator(device="cuda").manual_seed(5)
    xs = [_rand_cuda(1 + (7919 * i) % 400_000, [F32, BF16][i % 2], gen=gen) for i in range(300)]
    runs = [ops.multi_tensor_l2norm(xs, True) for _ in range(3)]
    runs += [ops.multi_tensor_unscale_l2norm(xs, _scale("cuda"), True) for _ in range(2)]
    for total, norms in runs[1:3]:
        assert torch.equal(_int_view(total), _int_view(runs[0][0]))
        assert torch.equal(_int_view(norms), _int_view(runs[0][1]))
    assert torch.equal(_int_view(runs[3][0]), _int_view(runs[4][0]))
    assert torch.equal(_int_view(runs[3][1]), _int_view(runs[4][1]))


@requires_cuda
@pytest.mark.parametrize("name", ["multi_tensor_l2norm", "multi_tensor_unscale_l2norm"])
def test_cuda_per_tensor_norms_under_graph_capture(name):
    """per_tensor norms captured in a CUDA graph replay right after the host memory is reused.

    More tensors than one stage-2 launch holds, so the capture has several.
    """
    gen = torch.Generator(device="cuda").manual_seed(6)
    xs = [_rand_cuda(1 + (13 * i) % 300, F32, gen=gen) for i in range(9000)]
    extra = (_scale("cuda"),) if name == "multi_tensor_unscale_l2norm" else ()
    op = getattr(ops, name)
    eager_total, eager_norms = op(xs, *extra, True)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        op(xs, *extra, True)  # warm-up, as graph capture wants
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        total, norms = op(xs, *extra, True)
    # Churn the pinned host allocator, which a host-side buffer would live in.
    for _ in range(20):
        torch.empty(10_000, dtype=torch.int32, pin_memory=True).fill_(-1)
    for x in xs:
        x.mul_(2.0)
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(norms, 2.0 * eager_norms, rtol=1e-6, atol=0)
    torch.testing.assert_close(total, 2.0 * eager_total, rtol=1e-6, atol=0)


@requires_cuda
def test_cuda_kernels_are_registered_whenever_cuda_is_available():
    """A build that silently dropped the CUDA sources would serve the slow reference on the GPU."""
    if os.environ.get("AMP_PATCH_NO_EXT") == "1":
        pytest.skip("AMP_PATCH_NO_EXT=1: the reference ops serve on purpose")
    assert ops.native_extension_loaded(), "CUDA is available but amp_patch._C is not built"
    missing = [name for name in scaling_ops._SCHEMAS if not ops.has_native_kernel("cuda", name)]
    assert not missing, f"no CUDA kernel registered for {missing}: the extension was built without CUDA"
