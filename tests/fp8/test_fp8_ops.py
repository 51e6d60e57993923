"""amp_patch.ops.fp8_ops: the FP8 maths, ``torch._scaled_mm`` against the reference body, the FP8 linear.

Tolerances, from the formats:

- **fast path vs reference.** On the CPU from torch 2.13, ``torch._scaled_mm``
  dequantizes and multiplies in fp32 as the reference does: bitwise equal
  (torch 2.11's oneDNN kernel sums in another order: ``2 K 2**-24 (|A| @ |B|)``,
  fp32's accumulation bound). On CUDA the scales are applied after the
  accumulation, and the FP8 tensor cores do not keep full fp32 within a block:
  measured on an H200 (torch 2.11), ``|fast - ref|`` reached ``2**-13.4 (|A| @ |B|)``,
  so the bound is ``2**-11 (|A| @ |B|)``. Each bound adds one rounding to the
  output dtype, ``eps_out |ref|`` (2**-7 for bf16, 2**-10 for fp16).
- **FP8 vs the fp32 linear.** Rounding to nearest in a format with ``p``
  mantissa bits errs by at most ``u = 2**-(p+1)`` relatively: 2**-4 for E4M3
  (3 bits), 2**-3 for E5M2 (2 bits). Below the smallest normal the spacing is
  fixed (2**-9 for E4M3, 2**-16 for E5M2), so a value cast with scale ``s``
  errs by at most ``e = u |v| + spacing / (2 s)``. A product's error is then
  at most ``e_a |b| + |a| e_b + e_a e_b``, summed over K; the test adds the
  output's rounding (``eps_out |ref|``) and asserts every element within that
  bound, and that the bound is not vacuous (the mean error well below it).
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from amp_patch.ops import fp8_ops as F8
from amp_patch.ops.fp8_ops import E4M3, E5M2, Fp8Format
from conftest import DEVICES
from training_utils import count_device_reads

HALF = [torch.bfloat16, torch.float16]
HALF_IDS = ["bf16", "fp16"]
#: The relative rounding bound u and the subnormal spacing of each format.
UNIT = {E4M3: 2.0 ** -4, E5M2: 2.0 ** -3}
SUBNORMAL = {E4M3: 2.0 ** -9, E5M2: 2.0 ** -16}
#: Unit roundoff of the fp32 accumulation.
FP32_U = 2.0 ** -24


#: Measured: torch 2.13's CPU kernel dequantizes and multiplies in fp32 as the reference
#: does (bitwise equal); torch 2.11's (oneDNN) accumulates in another order.
CPU_BITWISE = tuple(int(v) for v in torch.__version__.split(".")[:2]) >= (2, 13)
#: On CUDA, |fast - ref| / (|A| @ |B|) was at most 2**-13.4 on an H200 (torch 2.11, K = 64
#: to 4096, fp32 output): the FP8 tensor cores do not accumulate in full fp32 within a
#: block. 2**-11 leaves a factor of 5.
CUDA_ACCUM = 2.0 ** -11


def _fast(device: str, rowwise: bool = False) -> bool:
    """Whether the device runs ``torch._scaled_mm`` itself (else only the emulation is tested)."""
    return F8.fp8_gemm_available(device, rowwise)


def _skip_unless_fast(device: str, rowwise: bool = False) -> None:
    if not _fast(device, rowwise):
        pytest.skip(f"torch._scaled_mm does not serve {device} {'rowwise ' if rowwise else ''}"
                    "here (GPU below sm_89, or a CPU kernel before torch 2.13)")


def _accum(device_type: str, k: int) -> float:
    """The accumulation's error relative to |A| @ |B|: fp32 rounding, or CUDA's measured bound."""
    return CUDA_ACCUM if device_type == "cuda" else 2 * k * FP32_U


def _rand(*shape, device="cpu", dtype=torch.float32, seed=0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(device=device, dtype=dtype)


def _assert_fast_matches_ref(fast: torch.Tensor, ref: torch.Tensor, a_abs: torch.Tensor,
                             b_abs: torch.Tensor) -> None:
    """Bitwise on the CPU; on CUDA within fp32 accumulation plus one output rounding (module doc)."""
    if fast.device.type == "cpu" and CPU_BITWISE:
        torch.testing.assert_close(fast, ref, rtol=0, atol=0, equal_nan=True)
        return
    bound = _accum(fast.device.type, a_abs.shape[1]) * (a_abs.double() @ b_abs.double()) \
        + torch.finfo(ref.dtype).eps * ref.double().abs()
    assert ((fast.double() - ref.double()).abs() <= bound).all()


def _quant_err(v: torch.Tensor, dtype: torch.dtype, scale: torch.Tensor) -> torch.Tensor:
    """The largest error of casting ``v`` with ``scale`` to ``dtype`` (module doc), in fp64."""
    return UNIT[dtype] * v.double().abs() + SUBNORMAL[dtype] / (2 * scale.double())


def _product_bound(a: torch.Tensor, ea: torch.Tensor, b: torch.Tensor, eb: torch.Tensor,
                   ref: torch.Tensor) -> torch.Tensor:
    """Bound on ``|fp8(a) @ fp8(b) - a @ b|`` given the elementwise cast errors, plus rounding."""
    a, b = a.double().abs(), b.double().abs()
    k = a.shape[1]
    quant = ea @ b + a @ eb + ea @ eb
    accum = _accum(ref.device.type, k) * ((a + ea) @ (b + eb))
    return quant + accum + torch.finfo(ref.dtype).eps * ref.double().abs()


def _assert_within(got: torch.Tensor, ref: torch.Tensor, bound: torch.Tensor) -> None:
    err = (got.double() - ref.double()).abs()
    assert (err <= bound).all(), f"max excess {(err - bound).max().item()}"
    # The bound is a worst case; a real cast errs by about a quarter of it on average.
    assert err.mean() < 0.5 * bound.mean()
    # Round to nearest is unbiased, so the errors average out over the elements: the
    # least-squares factor from ref to got is 1 within 2**-6 (at most 0.006 seen over these
    # cases). A scale applied wrongly is a bias, which the elementwise bound (up to 2u per
    # product) would let pass: a 3% error in one scale is caught here, not there.
    g, r = got.double().flatten(), ref.double().flatten()
    slope = (g @ r) / (r @ r)
    assert abs(slope - 1) < 2 ** -6, f"least-squares factor {slope.item()}"


# ---------------------------------------------------------------------------------------
# formats and scaling maths


def test_format_constants():
    assert F8.fp8_max(E4M3) == torch.finfo(E4M3).max == 448
    assert F8.fp8_max(E5M2) == torch.finfo(E5M2).max == 57344
    assert (Fp8Format.HYBRID.forward_dtype, Fp8Format.HYBRID.backward_dtype) == (E4M3, E5M2)
    assert (Fp8Format.E4M3.forward_dtype, Fp8Format.E4M3.backward_dtype) == (E4M3, E4M3)
    with pytest.raises(TypeError, match="not an FP8 format"):
        F8.fp8_max(torch.float16)


def test_scale_from_amax_rule():
    amax = torch.tensor([1.0, 448.0, 0.0, float("inf"), float("nan"), 1e-45])
    prev = torch.tensor([3.0, 3.0, 3.0, 3.0, 3.0, 3.0])
    got = F8.scale_from_amax(amax, E4M3, margin=2, previous=prev)
    # 448 / amax / 2**2; the previous scale where amax is 0, not finite, or the quotient overflows.
    assert got.tolist() == [112.0, 0.25, 3.0, 3.0, 3.0, 3.0]
    assert F8.scale_from_amax(torch.tensor(0.0), E5M2).item() == 1.0
    assert F8.scale_from_amax(torch.tensor(2.0), E5M2).item() == 57344 / 2


@pytest.mark.parametrize("dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
def test_saturation_at_format_max(dtype):
    top = F8.fp8_max(dtype)
    x = torch.tensor([top * 4, -top * 4, 1e30, float("inf"), -float("inf"), top])
    q = F8.quantize(x, torch.tensor(1.0), dtype)
    assert q.data.float().tolist() == [top, -top, top, top, -top, top]
    # Without the clamp, E5M2 would turn these into inf: the saturation is ours.
    assert torch.isinf(x[:3].to(E5M2)).all() if dtype == E5M2 else True


@pytest.mark.parametrize("dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("where", [0, 7, -1], ids=["first", "middle", "last"])
@pytest.mark.parametrize("bad", [float("inf"), -float("inf"), float("nan")], ids=["inf", "-inf", "nan"])
def test_nonfinite_reaches_scale_inv(dtype, where, bad):
    x = _rand(16)
    x[where] = bad
    q, a = F8.quantize_tensorwise(x, dtype)
    assert not torch.isfinite(a) and torch.isnan(q.scale_inv)
    assert torch.isnan(F8.dequantize(q)).all()
    # The scale itself fell back to 1.0 rather than to 0 or NaN.
    assert torch.isfinite(q.data.float()[torch.arange(16) != (where % 16)]).all()


def test_amax_history_hand_sequence():
    """Four steps of the delayed recipe against a sequence computed by hand."""
    h, s = torch.zeros(3), torch.ones(())
    seen = []
    for a in (2.0, 8.0, 0.0, 1.0, float("inf"), 4.0):
        h[0] = a
        used = F8.update_amax_history_(h, s, E4M3, margin=1, algo="max")
        seen.append((used.item(), s.item(), h.tolist()))
    # window = this step's amax and the two before it; scale = 448 / amax / 2.
    assert seen == [
        (2.0, 112.0, [0.0, 0.0, 2.0]),
        (8.0, 28.0, [0.0, 2.0, 8.0]),
        (8.0, 28.0, [0.0, 8.0, 0.0]),
        (8.0, 28.0, [0.0, 0.0, 1.0]),
        (float("inf"), 28.0, [0.0, 1.0, float("inf")]),   # overflow: the scale stays
        (float("inf"), 28.0, [0.0, float("inf"), 4.0]),   # the inf stays in the window
    ]


def test_amax_history_most_recent_and_rows():
    h, s = torch.zeros(4, 2), torch.ones(2)
    for a, want in (((2.0, 0.0), [28672.0, 1.0]), ((4.0, 1.0), [14336.0, 57344.0]),
                    ((0.0, 8.0), [14336.0, 7168.0])):
        h[0] = torch.tensor(a)
        F8.update_amax_history_(h, s, E5M2, algo="most_recent")
        assert s.tolist() == want
    assert h[-1].tolist() == [0.0, 8.0] and h[0].tolist() == [0.0, 0.0]
    with pytest.raises(ValueError, match="algo"):
        F8.update_amax_history_(h, s, E5M2, algo="mean")
    with pytest.raises(ValueError, match="does not fit"):
        F8.update_amax_history_(torch.zeros(4, 3), s, E5M2)


def test_linear_state_update_uses_each_format():
    st_ = F8.Fp8LinearState(Fp8Format.HYBRID, history_len=2, margin=0)
    slots = st_.slots()
    slots["amax_x"].fill_(4.0)
    slots["amax_w"].fill_(2.0)
    slots["amax_grad"].fill_(8.0)
    st_.update_()
    assert st_.scale.tolist() == [112.0, 224.0, 57344 / 8]
    assert st_.history.tolist() == [[0.0, 0.0, 0.0], [4.0, 2.0, 8.0]]
    restored = F8.Fp8LinearState(Fp8Format.HYBRID, history_len=2)
    restored.load_state_dict(st_.state_dict())
    assert torch.equal(restored.history, st_.history) and torch.equal(restored.scale, st_.scale)


def test_rowwise_scales_shapes():
    x = _rand(32, 16)
    qr, ar = F8.quantize_rowwise(x, E4M3, dim=1)
    qc, ac = F8.quantize_rowwise(x, E4M3, dim=0)
    assert qr.scale_inv.shape == ar.shape == (32, 1)
    assert qc.scale_inv.shape == ac.shape == (1, 16)
    torch.testing.assert_close(ar.flatten(), x.abs().amax(1))
    # Every row reaches the format's max exactly once its own scale is applied.
    assert (qr.data.float().abs().amax(1) == 448).all()
    x[3, 5] = float("inf")
    qr, _ = F8.quantize_rowwise(x, E4M3, dim=1)
    bad = torch.isnan(qr.scale_inv.flatten())
    assert bad.tolist() == [i == 3 for i in range(32)]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(-1e6, 1e6, allow_nan=False, width=32), min_size=1, max_size=40),
       st.sampled_from([E4M3, E5M2]), st.integers(0, 3))
def test_roundtrip_error_bound(values, dtype, margin):
    """Property: a current-scaled cast errs by at most u |v| + spacing / (2 s), and never saturates."""
    x = torch.tensor(values, dtype=torch.float32)
    q, a = F8.quantize_tensorwise(x, dtype, margin)
    scale = q.scale_inv.reciprocal()
    err = (F8.dequantize(q).double() - x.double()).abs()
    # fp32's own rounding of x * scale and of the read-back adds at most a few 2**-24.
    bound = _quant_err(x, dtype, scale) * (1 + 4 * FP32_U) + 4 * FP32_U * x.double().abs()
    assert (err <= bound).all()
    assert (q.data.float().abs() <= F8.fp8_max(dtype) / 2 ** margin * (1 + UNIT[dtype])).all()


# ---------------------------------------------------------------------------------------
# torch._scaled_mm: signature, availability, CUDA's rules


def test_scaled_mm_signature_found():
    # torch 2.13: _scaled_mm(self, mat2, scale_a, scale_b, bias, scale_result, out_dtype,
    # use_fast_accum) -> Tensor
    assert F8.SCALED_MM_SIGNATURE is not None
    assert "scale_a" in F8.SCALED_MM_SIGNATURE


def test_missing_device_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(F8, "SCALED_MM_SIGNATURE", None)
    with pytest.raises(RuntimeError, match=r"emulate=True"):
        F8.require_fp8_gemm("cpu")


def test_cpu_rowwise_before_2_13_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(F8, "_CPU_ROWWISE", False)
    assert F8.fp8_gemm_available("cpu") and not F8.fp8_gemm_available("cpu", rowwise=True)
    qa, _ = F8.quantize_rowwise(_rand(16, 32), E4M3)
    qb, _ = F8.quantize_rowwise(_rand(16, 32), E4M3)
    with pytest.raises(RuntimeError, match="tensorwise scales only.*emulate=True"):
        F8.fp8_gemm(qa, qb.t(), torch.bfloat16)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a torch without a CUDA kernel")
def test_no_cuda_kernel_is_a_clear_error():
    assert not F8.fp8_gemm_available("cuda")
    with pytest.raises(RuntimeError, match=r"no kernel for 'cuda'.*emulate=True"):
        F8.require_fp8_gemm("cuda")


def _codes(m, n, dtype=E4M3, device="cpu"):
    return _rand(m, n, device=device).to(dtype)


@pytest.mark.parametrize("device", DEVICES)
def test_cuda_rules_refused_on_every_device(device):
    one = torch.ones((), device=device)
    a, w = _codes(16, 32, device=device), _codes(48, 32, device=device)
    F8.check_scaled_mm_args(a, w.t(), one, one, torch.bfloat16)
    cases = [
        ((a, w.t().contiguous(), one, one, torch.bfloat16), "column-major"),
        ((a.t().contiguous().t(), w.t(), one, one, torch.bfloat16), "row-major"),
        ((_codes(16, 24, device=device), _codes(48, 24, device=device).t(), one, one,
          torch.bfloat16), "K=24"),
        ((_codes(20, 32, device=device), w.t(), one, one, torch.bfloat16), "M=20"),
        ((a, _codes(40, 32, device=device).t(), one, one, torch.bfloat16), "N=40"),
        ((a.to(E5M2), w.to(E5M2).t(), one, one, torch.bfloat16), "E5M2 x E5M2"),
        ((a, w.t(), one.double(), one, torch.bfloat16), "fp32"),
        ((a, w.t(), one, one, torch.int8), "out_dtype"),
        ((a, w.t(), torch.ones(16, 1, device=device), torch.ones(1, 48, device=device),
          torch.float16), "bf16 only"),
        ((a.to(E5M2), w.t(), torch.ones(16, 1, device=device), torch.ones(1, 48, device=device),
          torch.bfloat16), "E4M3 operands only"),
        ((a, w.t(), torch.ones(2, device=device), one, torch.bfloat16), "scales must have"),
    ]
    for args, msg in cases:
        with pytest.raises(ValueError, match=msg):
            F8.check_scaled_mm_args(*args)
    with pytest.raises(ValueError, match="bias needs"):
        F8.check_scaled_mm_args(a, w.t(), one, one, torch.float32, torch.zeros(48, device=device))


def test_cpu_kernel_itself_is_lax():
    """Why the rules are ours: the CPU kernel runs what CUDA refuses."""
    one = torch.ones(())
    a, b = _codes(20, 24, E5M2), _codes(24, 40, E5M2)   # row-major b, odd dims, E5M2 x E5M2
    assert torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.float32).shape == (20, 40)
    with pytest.raises(ValueError):
        F8.fp8_gemm(F8.Fp8Tensor(a, one), F8.Fp8Tensor(b, one), torch.float32)


# ---------------------------------------------------------------------------------------
# the GEMM: fast path vs reference


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("out_dtype", HALF + [torch.float32], ids=HALF_IDS + ["fp32"])
@pytest.mark.parametrize("pair", [(E4M3, E4M3), (E5M2, E4M3), (E4M3, E5M2)],
                         ids=["e4m3xe4m3", "e5m2xe4m3", "e4m3xe5m2"])
def test_gemm_fast_vs_reference(device, out_dtype, pair):
    _skip_unless_fast(device)
    qa, _ = F8.quantize_tensorwise(_rand(32, 64, device=device, seed=1), pair[0])
    qb, _ = F8.quantize_tensorwise(_rand(48, 64, device=device, seed=2), pair[1])
    bias = _rand(48, device=device, seed=3).to(out_dtype)
    for b in (None, bias):
        fast = F8.fp8_gemm(qa, qb.t(), out_dtype, b)
        ref = F8.fp8_gemm_reference(qa, qb.t(), out_dtype, b)
        assert fast.dtype == out_dtype and fast.shape == (32, 48)
        _assert_fast_matches_ref(fast, ref, F8.dequantize(qa).abs(), F8.dequantize(qb).abs().t())


@pytest.mark.parametrize("device", DEVICES)
def test_gemm_rowwise_fast_vs_reference(device):
    _skip_unless_fast(device, rowwise=True)
    qa, _ = F8.quantize_rowwise(_rand(32, 64, device=device, seed=1), E4M3, dim=1)
    qw, _ = F8.quantize_rowwise(_rand(48, 64, device=device, seed=2), E4M3, dim=1)
    fast = F8.fp8_gemm(qa, qw.t(), torch.bfloat16)
    ref = F8.fp8_gemm(qa, qw.t(), torch.bfloat16, emulate=True)
    _assert_fast_matches_ref(fast, ref, F8.dequantize(qa).abs(), F8.dequantize(qw).abs().t())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("emulate", [False, True], ids=["fast", "emulated"])
def test_gemm_nonfinite_propagates(device, emulate):
    if not emulate:
        _skip_unless_fast(device)
    x = _rand(32, 64, device=device)
    x[0, 0] = float("inf")
    qx, _ = F8.quantize_tensorwise(x, E4M3)
    qw, _ = F8.quantize_tensorwise(_rand(48, 64, device=device), E4M3)
    assert qx.data.float().abs().max() == 448   # the cast hid the inf ...
    y = F8.fp8_gemm(qx, qw.t(), torch.bfloat16, emulate=emulate)
    assert torch.isnan(y).all()                 # ... its amax did not
    if not (emulate or _fast(device, rowwise=True)):
        return
    x[0, 0] = float("nan")
    qx, _ = F8.quantize_rowwise(x, E4M3)
    y = F8.fp8_gemm(qx, F8.quantize_rowwise(_rand(48, 64, device=device), E4M3)[0].t(),
                    torch.bfloat16, emulate=emulate)
    assert torch.isnan(y[0]).all() and torch.isfinite(y[1:]).all()


# ---------------------------------------------------------------------------------------
# the FP8 linear


def _linear_pair(device, dtype, m=32, k=64, n=48, lead=()):
    torch.manual_seed(0)
    lin = nn.Linear(k, n).to(device)
    x = _rand(*lead, m, k, device=device, dtype=dtype, seed=5).requires_grad_()
    dy = _rand(*lead, m, n, device=device, dtype=dtype, seed=6)
    return lin, x, dy


def _run(lin, x, dy, **kw):
    for t in (x, lin.weight, lin.bias):
        t.grad = None
    y = F8.fp8_linear(x, lin.weight, lin.bias, **kw)
    y.backward(dy)
    return y.detach(), x.grad.clone(), lin.weight.grad.clone(), lin.bias.grad.clone()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", HALF, ids=HALF_IDS)
@pytest.mark.parametrize("fmt", list(Fp8Format), ids=[f.value for f in Fp8Format])
@pytest.mark.parametrize("m", [32, 20], ids=["M32", "M20-padded"])
def test_linear_fast_vs_reference_all_three_gemms(device, dtype, fmt, m):
    _skip_unless_fast(device)
    lin, x, dy = _linear_pair(device, dtype, m=m)
    fast = _run(lin, x, dy, fmt=fmt)
    ref = _run(lin, x, dy, fmt=fmt, emulate=True)
    assert [t.dtype for t in fast] == [dtype, dtype, torch.float32, torch.float32]
    if device == "cpu" and CPU_BITWISE:
        for f, r in zip(fast, ref):
            torch.testing.assert_close(f, r, rtol=0, atol=0)
    else:
        xa, wa, dya = x.detach().abs().float() * 1.2, lin.weight.detach().abs() * 1.2, \
            dy.abs().float() * 1.2   # 1.2 covers the casts' rounding (u <= 1/8)
        _assert_fast_matches_ref(fast[0], ref[0], xa, wa.t())
        _assert_fast_matches_ref(fast[1], ref[1], dya, wa)
        _assert_fast_matches_ref(fast[2], ref[2], dya.t(), xa)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", HALF, ids=HALF_IDS)
@pytest.mark.parametrize("fmt", list(Fp8Format), ids=[f.value for f in Fp8Format])
def test_linear_against_fp32_within_format_bound(device, dtype, fmt):
    """Forward, grad-input and grad-weight vs the fp32 linear, each within the bound of the module doc."""
    lin, x, dy = _linear_pair(device, dtype, lead=(2,), m=16)
    y, gx, gw, gb = _run(lin, x, dy, fmt=fmt, emulate=not _fast(device))
    x2, w, dy2 = x.detach().float().reshape(-1, 64), lin.weight.detach(), dy.float().reshape(-1, 48)
    sx = F8.scale_from_amax(F8.amax(x2), E4M3)
    sw = F8.scale_from_amax(F8.amax(w), E4M3)
    gdt = fmt.backward_dtype
    sdy = F8.scale_from_amax(F8.amax(dy2), gdt)
    ex, ew, edy = _quant_err(x2, E4M3, sx), _quant_err(w, E4M3, sw), _quant_err(dy2, gdt, sdy)
    y_ref = (x2 @ w.t() + lin.bias.detach()).to(dtype)
    _assert_within(y.reshape(-1, 48), y_ref,
                   _product_bound(x2, ex, w.t(), ew.t(), y_ref))
    gx_ref = (dy2 @ w).to(dtype)
    _assert_within(gx.reshape(-1, 64), gx_ref, _product_bound(dy2, edy, w, ew, gx_ref))
    gw_ref = dy2.t() @ x2
    _assert_within(gw, gw_ref, _product_bound(dy2.t(), edy.t(), x2, ex, gw_ref))
    torch.testing.assert_close(gb, dy2.sum(0), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", HALF, ids=HALF_IDS)
def test_linear_rowwise(device, dtype):
    lin, x, dy = _linear_pair(device, dtype)
    emulate = not _fast(device, rowwise=True)
    y, gx, gw, gb = _run(lin, x, dy, fmt=Fp8Format.E4M3, scaling="rowwise", emulate=emulate)
    if not emulate:
        ref = _run(lin, x, dy, fmt=Fp8Format.E4M3, scaling="rowwise", emulate=True)
        if device == "cpu" and CPU_BITWISE:
            for f, r in zip((y, gx, gw, gb), ref):
                torch.testing.assert_close(f, r, rtol=0, atol=0)
    x2, w = x.detach().float(), lin.weight.detach()
    sx = F8.scale_from_amax(F8.amax(x2, dim=1), E4M3)        # (M, 1)
    sw = F8.scale_from_amax(F8.amax(w, dim=1), E4M3)         # (N, 1)
    y_ref = (x2 @ w.t() + lin.bias.detach()).to(dtype)
    # The GEMM writes bf16, then the output is cast to dtype: one more rounding.
    bound = _product_bound(x2, _quant_err(x2, E4M3, sx), w.t(), _quant_err(w, E4M3, sw).t(), y_ref)
    _assert_within(y, y_ref, bound + 2 ** -8 * y_ref.double().abs())
    # The backward scales along the other dims: dY per row and W per column for
    # grad-input (contracting N), dY and x per column for grad-weight (contracting M).
    dy2 = dy.float()

    def err(v, dim):
        return _quant_err(v, E4M3, F8.scale_from_amax(F8.amax(v, dim=dim), E4M3))

    gx_ref = (dy2 @ w).to(dtype)
    bound = _product_bound(dy2, err(dy2, 1), w, err(w, 0), gx_ref)
    _assert_within(gx, gx_ref, bound + 2 ** -8 * gx_ref.double().abs())
    gw_ref = dy2.t() @ x2
    bound = _product_bound(dy2.t(), err(dy2, 0).t(), x2, err(x2, 0), gw_ref)
    _assert_within(gw, gw_ref, bound + 2 ** -8 * gw_ref.double().abs())
    with pytest.raises(ValueError, match="E4M3 everywhere"):
        F8.fp8_linear(x, lin.weight, scaling="rowwise")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("emulate", [False, True], ids=["fast", "emulated"])
@pytest.mark.parametrize("where", ["x", "weight", "grad"])
@pytest.mark.parametrize("bad", [float("inf"), float("nan")], ids=["inf", "nan"])
def test_linear_nonfinite_reaches_output_or_grads(device, emulate, where, bad):
    if not emulate:
        _skip_unless_fast(device)
    lin, x, dy = _linear_pair(device, torch.bfloat16)
    with torch.no_grad():
        {"x": x, "weight": lin.weight, "grad": dy}[where][5, 7] = bad
    y, gx, gw, _ = _run(lin, x, dy, emulate=emulate)
    if where == "grad":
        assert torch.isfinite(y).all()
        assert not torch.isfinite(gx).all() and not torch.isfinite(gw).all()
    else:
        assert not torch.isfinite(y).all()


def test_linear_delayed_with_cached_weight_records_amaxes():
    lin, x, dy = _linear_pair("cpu", torch.bfloat16)
    st_ = F8.Fp8LinearState(Fp8Format.HYBRID, history_len=4)
    st_.scale.copy_(torch.tensor([2.0, 16.0, 0.5]))
    slots = st_.slots()
    wq = F8.quantize_weight(lin.weight, st_.fmt, st_.scale[1], slots["amax_w"])
    kw = dict(scaling="delayed", weight_fp8=wq, x_scale=st_.scale[0], grad_scale=st_.scale[2],
              amax_x=slots["amax_x"], amax_grad=slots["amax_grad"])
    y, gx, gw, _ = _run(lin, x, dy, **kw)
    want = [x.detach().float().abs().max(), lin.weight.detach().abs().max(), dy.float().abs().max()]
    assert st_.history[0].tolist() == [float(v) for v in want]
    # The given scales were used: the same as quantizing by hand with them.
    qx = F8.quantize(x.detach().float(), torch.tensor(2.0), E4M3)
    y_hand = F8.fp8_gemm(qx, wq.t(), torch.bfloat16, lin.bias.detach().bfloat16())
    torch.testing.assert_close(y, y_hand, rtol=0, atol=0)
    st_.update_()
    # fp32 quotients, as the device computes them.
    assert st_.scale.tolist() == (torch.tensor([448.0, 448.0, 57344.0]) / torch.stack(want)).tolist()
    with pytest.raises(ValueError, match="delayed scaling takes"):
        F8.fp8_linear(x, lin.weight, scaling="delayed")


def test_linear_no_host_sync():
    lin, x, dy = _linear_pair("cpu", torch.bfloat16)
    st_ = F8.Fp8LinearState(history_len=4)
    slots = st_.slots()
    with count_device_reads() as reads:
        wq = F8.quantize_weight(lin.weight, st_.fmt, st_.scale[1], slots["amax_w"])
        F8.fp8_linear(x, lin.weight, lin.bias, scaling="delayed", weight_fp8=wq,
                      x_scale=st_.scale[0], grad_scale=st_.scale[2], amax_x=slots["amax_x"],
                      amax_grad=slots["amax_grad"]).backward(dy)
        F8.fp8_linear(x, lin.weight, lin.bias).backward(dy)
        F8.fp8_linear(x, lin.weight, lin.bias, fmt=Fp8Format.E4M3, scaling="rowwise",
                      emulate=not _fast("cpu", rowwise=True)).backward(dy)
        st_.update_()
    assert reads["n"] == 0, reads["ops"]


def test_linear_argument_errors():
    lin, x, _ = _linear_pair("cpu", torch.bfloat16)
    with pytest.raises(ValueError, match="scaling must be"):
        F8.fp8_linear(x, lin.weight, scaling="blockwise")
    with pytest.raises(ValueError, match="multiple of 16"):
        F8.fp8_linear(x[:, :60], nn.Linear(60, 48).weight)


@pytest.mark.slow
def test_linear_compiles_fullgraph_without_breaks():
    """torch.compile(fullgraph=True) of a model using the delayed FP8 linear: 0 breaks, eager's result."""
    import torch._dynamo

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(64, 48)
            self.state = F8.Fp8LinearState(history_len=4)

        def forward(self, x):
            s = self.state.slots()
            wq = F8.quantize_weight(self.lin.weight, self.state.fmt, self.state.scale[1], s["amax_w"])
            h = F8.fp8_linear(x, self.lin.weight, self.lin.bias, scaling="delayed", weight_fp8=wq,
                              x_scale=self.state.scale[0], grad_scale=self.state.scale[2],
                              amax_x=s["amax_x"], amax_grad=s["amax_grad"])
            return F8.fp8_linear(torch.relu(h), self.lin.weight[:, :48], None)

    torch._dynamo.reset()
    model = Model()
    x = _rand(32, 64).requires_grad_()
    explained = torch._dynamo.explain(model)(x)
    assert explained.graph_break_count == 0
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    y = compiled(x)
    y.sum().backward()
    history, grad = model.state.history.clone(), x.grad.clone()
    x.grad = None
    model.state.history.zero_()
    y_eager = model(x)
    y_eager.sum().backward()
    assert torch.equal(y, y_eager) and torch.equal(x.grad, grad)
    assert torch.equal(model.state.history, history) and (history[0] > 0).all()
    assert not math.isnan(history[0, 2].item())
