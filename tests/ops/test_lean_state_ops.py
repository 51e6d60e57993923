"""The lean-state optimizer ops: compiled kernels against the Python reference, bit for bit.

``multi_tensor_adam_lean_`` and ``multi_tensor_sgd_lean_`` are run through
``torch.ops.amp_patch`` (the device's kernel) and through their reference
bodies in :mod:`amp_patch.ops.lean_state_ops`, on cloned inputs, over every
state code, param and grad dtype, block sizes that do and do not divide the
rows, odd shapes (1-D, 0-dim, empty, rows longer than a tile), non-contiguous
params and grads, inf/NaN, a set ``noop`` and several thread counts. Every
written tensor (params, codes, scales, model copies) must match to the bit.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from conftest import DEVICES
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_ops import assert_bitwise, clone_args

from amp_patch import ops
from amp_patch.ops import lean_state_ops as lean

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
I8, U8, E4M3 = torch.int8, torch.uint8, torch.float8_e4m3fn
FIRST_CODES = [F32, BF16, I8, E4M3]  # exp_avgs, momentum buffers
SECOND_CODES = [F32, BF16, U8, E4M3]  # exp_avg_sqs
PARAM_DTYPES = [F32, BF16, F16]
GRAD_DTYPES = [F32, BF16, F16]

# (shape, layout) per tensor: rows that are and are not whole blocks, a row
# longer than the 1024-element chunk, 1-D, 0-dim and empty tensors, 3-D.
SHAPES = [((7, 300), "contiguous"), ((1000,), "contiguous"), ((), "contiguous"),
          ((3, 0), "contiguous"), ((0,), "contiguous"), ((4, 5, 6), "contiguous"),
          ((2, 512), "contiguous"), ((3, 2100), "contiguous"), ((1,), "contiguous"),
          ((33, 17), "transposed"), ((9, 31), "sliced")]

ADAM_KW = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, step=3,
               adam_w_mode=True, bias_correction=True)
SGD_KW = dict(lr=0.1, weight_decay=0.01, momentum=0.9, dampening=0.1, nesterov=False,
              first_run=False, wd_after_momentum=False, step=5)


def _rand(shape, dtype, layout, gen, scale=1.0, positive=False):
    def make(*s):
        t = torch.rand(s, generator=gen) if positive else torch.randn(s, generator=gen)
        return (t * scale).to(dtype)

    if layout == "transposed":
        return make(*reversed(shape)).t()
    if layout == "sliced":
        return make(shape[0], 2 * shape[1])[:, ::2]
    return make(*shape)


def _state(shape, code, block_size, gen, scale, positive):
    """A state tensor in ``code`` (and its scales), from random fp32 values."""
    values = _rand(shape, F32, "contiguous", gen, scale, positive)
    if values.numel() == 0:  # lean.encode cannot reshape a tensor of 0 rows
        scales = (torch.zeros(lean.scale_shape(values, block_size)) if code in lean.SCALED_CODES
                  else None)
        return values.to(code), scales
    return lean.encode(values, code, block_size)


def _common(shapes, grad_dtypes, param_dtype, block_size, gen, model):
    grads, params, model_params = [], [], []
    for i, (shape, layout) in enumerate(shapes):
        grads.append(_rand(shape, grad_dtypes[i % len(grad_dtypes)], layout, gen, 3.0))
        params.append(_rand(shape, param_dtype, layout, gen))
        if model:
            model_params.append(_rand(shape, [BF16, F16, F32][i % 3], layout, gen))
    return grads, params, model_params


def _adam_args(m_code=I8, v_code=U8, param_dtype=BF16, grad_dtypes=GRAD_DTYPES, block_size=256,
               shapes=SHAPES, model=True, noop=None, inv_scale=True, seed=0, device="cpu", **kw):
    gen = torch.Generator().manual_seed(seed)
    grads, params, model_params = _common(shapes, grad_dtypes, param_dtype, block_size, gen, model)
    m = [_state(s, m_code, block_size, gen, 0.1, False) for s, _ in shapes]
    v = [_state(s, v_code, block_size, gen, 0.01, True) for s, _ in shapes]
    hyper = {**ADAM_KW, **kw}
    args = [grads, params, [c for c, _ in m], [s for _, s in m if s is not None],
            [c for c, _ in v], [s for _, s in v if s is not None], model_params, noop,
            torch.full((1,), 0.5) if inv_scale else None, hyper["lr"], hyper["beta1"],
            hyper["beta2"], hyper["eps"], hyper["weight_decay"], hyper["step"],
            hyper["adam_w_mode"], hyper["bias_correction"], block_size, 1234]
    return "multi_tensor_adam_lean_", _to(args, device)


def _sgd_args(code=I8, param_dtype=BF16, grad_dtypes=GRAD_DTYPES, block_size=256, shapes=SHAPES,
              model=True, noop=None, inv_scale=True, seed=0, device="cpu", **kw):
    gen = torch.Generator().manual_seed(seed)
    grads, params, model_params = _common(shapes, grad_dtypes, param_dtype, block_size, gen, model)
    hyper = {**SGD_KW, **kw}
    bufs = ([_state(s, code, block_size, gen, 0.3, False) for s, _ in shapes]
            if hyper["momentum"] != 0.0 else [])
    args = [grads, params, [c for c, _ in bufs], [s for _, s in bufs if s is not None],
            model_params, noop, torch.full((1,), 0.5) if inv_scale else None, hyper["lr"],
            hyper["weight_decay"], hyper["momentum"], hyper["dampening"], hyper["nesterov"],
            hyper["first_run"], hyper["wd_after_momentum"], hyper["step"], block_size, 99]
    return "multi_tensor_sgd_lean_", _to(args, device)


def _to(args, device):
    def move(x):
        if isinstance(x, torch.Tensor):
            return x.to(device)
        if isinstance(x, list):
            return [move(t) for t in x]
        return x

    return [move(a) for a in args] if device != "cpu" else args


def _assert_same(got, want):
    """Every tensor of every list: same dtype, shape and bits (NaN payloads aside)."""
    for a, b in zip(got, want):
        if not isinstance(a, list):
            continue
        for x, y in zip(a, b):
            if x.dtype == E4M3:  # NaN codes at the same places, the other codes equal
                assert y.dtype == E4M3 and x.shape == y.shape
                nan = torch.isnan(x.float())
                assert torch.equal(nan, torch.isnan(y.float()))
                assert torch.equal(x.view(U8)[~nan], y.view(U8)[~nan])
            elif x.is_floating_point():
                assert_bitwise([x], [y])
            else:
                assert x.dtype == y.dtype and torch.equal(x, y)


def _run_both(name, args):
    got, want = clone_args(list(args)), clone_args(list(args))
    getattr(torch.ops.amp_patch, name)(*got)
    lean._LEAN_REFERENCE[name](*want)
    return got, want


def _check(name, args):
    got, want = _run_both(name, args)
    _assert_same(got, want)
    return got


def _kernel_or_skip(device="cpu"):
    if not ops.has_native_kernel(device, "multi_tensor_adam_lean_"):
        pytest.skip(f"no compiled lean-state kernel for {device}")


# ------------------------------------------------------------ kernel against reference

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("param_dtype", PARAM_DTYPES)
@pytest.mark.parametrize("v_code", SECOND_CODES)
@pytest.mark.parametrize("m_code", FIRST_CODES)
def test_adam_matches_reference(device, m_code, v_code, param_dtype):
    _check(*_adam_args(m_code, v_code, param_dtype, device=device))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("param_dtype", PARAM_DTYPES)
@pytest.mark.parametrize("code", FIRST_CODES)
def test_sgd_matches_reference(device, code, param_dtype):
    _check(*_sgd_args(code, param_dtype, device=device))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("block_size", [1, 7, 16, 32, 100, 256, 2048, 5000])
@pytest.mark.parametrize("codes", [(I8, U8), (E4M3, BF16)], ids=["int8-uint8", "e4m3-bf16"])
def test_block_sizes(device, block_size, codes):
    """Blocks smaller than a vector, not dividing the rows, longer than the chunk or the row."""
    _check(*_adam_args(*codes, block_size=block_size, device=device))
    _check(*_sgd_args(codes[0], block_size=block_size, device=device))


ADAM_VARIANTS = [dict(adam_w_mode=False), dict(weight_decay=0.0), dict(bias_correction=False),
                 dict(inv_scale=False), dict(model=False), dict(step=1)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("variant", ADAM_VARIANTS, ids=lambda v: "-".join(f"{k}={x}" for k, x in v.items()))
def test_adam_variants(device, variant):
    _check(*_adam_args(device=device, **variant))


SGD_VARIANTS = [dict(nesterov=True), dict(first_run=True), dict(wd_after_momentum=True),
                dict(momentum=0.0), dict(weight_decay=0.0), dict(dampening=0.0),
                dict(inv_scale=False), dict(model=False), dict(first_run=True, code=E4M3),
                dict(first_run=True, code=BF16)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("variant", SGD_VARIANTS, ids=lambda v: "-".join(f"{k}={x}" for k, x in v.items()))
def test_sgd_variants(device, variant):
    _check(*_sgd_args(device=device, **variant))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("grad_dtype", GRAD_DTYPES)
def test_grad_dtypes(device, grad_dtype):
    _check(*_adam_args(grad_dtypes=[grad_dtype], device=device))
    _check(*_sgd_args(grad_dtypes=[grad_dtype], device=device))


@pytest.mark.slow
@pytest.mark.parametrize("device", DEVICES)
def test_many_tensors_across_tasks(device):
    """More than one task of small tensors, and one tensor over several tasks."""
    shapes = [((1 + (37 * i) % 700,), "contiguous") for i in range(150)] + [((70, 1111), "contiguous")]
    _check(*_adam_args(shapes=shapes, device=device))
    _check(*_sgd_args(shapes=shapes, device=device))


@pytest.mark.parametrize("device", DEVICES)
def test_grads_and_state_left_alone_where_read_only(device):
    name, args = _adam_args(device=device)
    grads = clone_args(args[0])
    torch.ops.amp_patch.multi_tensor_adam_lean_(*args)
    assert_bitwise(args[0], grads)


@pytest.mark.parametrize("device", DEVICES)
def test_empty_lists(device):
    torch.ops.amp_patch.multi_tensor_adam_lean_([], [], [], [], [], [], [], None, None, 1e-3, 0.9,
                                               0.999, 1e-8, 0.0, 1, True, True, 256, 0)
    torch.ops.amp_patch.multi_tensor_sgd_lean_([], [], [], [], [], None, None, 0.1, 0.0, 0.9, 0.0,
                                              False, False, False, 1, 256, 0)


# ------------------------------------------------------------ non-finite values

NONFINITE = [float("inf"), float("-inf"), float("nan")]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("value", NONFINITE, ids=["inf", "-inf", "nan"])
@pytest.mark.parametrize("target", ["grad", "param"])
@pytest.mark.parametrize("codes", [(I8, U8), (E4M3, E4M3), (BF16, BF16)],
                         ids=["int8-uint8", "e4m3", "bf16"])
def test_nonfinite_like_reference(device, value, target, codes):
    """An inf/NaN grad or param: its block's scale turns non-finite, codes follow the rules."""
    for build, kw in ((_adam_args, dict(m_code=codes[0], v_code=codes[1])), (_sgd_args, dict(code=codes[0]))):
        name, args = build(device=device, **kw)
        for t in (args[0] if target == "grad" else args[1])[:3]:  # contiguous ones
            t.view(-1)[t.numel() // 2] = value
        _check(name, args)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("codes", [(I8, U8), (E4M3, E4M3)], ids=["int8-uint8", "e4m3"])
def test_zero_and_tiny_blocks(device, codes):
    """All-zero blocks store codes 0; a block so small that max / s overflows keeps s, codes 0."""
    shapes = [((4, 600), "contiguous")]
    name, args = _adam_args(*codes, shapes=shapes, block_size=128, inv_scale=False,
                            grad_dtypes=[F32], device=device)
    for k in (2, 3, 4, 5):
        args[k][0].zero_()  # zero moments, zero scales: the old state reads back 0
    args[0][0][0].zero_()
    args[0][0][1].fill_(1e-41)  # m = 0.1 * g is subnormal: 127 / s overflows
    got = _check(name, args)
    for codes_, scales in ((got[2][0], got[3][0]), (got[4][0], got[5][0])):
        assert (codes_[0].view(torch.uint8) == 0).all() and (scales[0] == 0).all()
    assert (got[2][0][1].view(torch.uint8) == 0).all() and (got[3][0][1] > 0).all()

    name, args = _sgd_args(codes[0], shapes=shapes, block_size=128, inv_scale=False,
                           grad_dtypes=[F32], first_run=True, weight_decay=0.0, device=device)
    args[0][0][0].zero_()
    args[0][0][1].fill_(1e-41)
    got = _check(name, args)
    assert (got[2][0][:2].view(torch.uint8) == 0).all()
    assert (got[3][0][0] == 0).all() and (got[3][0][1] > 0).all()


# ------------------------------------------------------------ noop, threads, layouts

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("param_dtype", [F32, BF16])
def test_every_e4m3_code_like_reference(device, param_dtype):
    """Every finite e4m3 code (subnormals and both zeros among them) decodes, and the new values,
    down to the subnormal range, encode as torch's conversion does: the fused loop and the tiles."""
    codes = torch.arange(256, dtype=torch.int64)
    codes = codes[(codes & 0x7F) != 0x7F].to(U8).view(E4M3).reshape(2, 127)
    gen = torch.Generator().manual_seed(5)
    for block_size in (127, 32):  # a block per row (the tiles), blocks of 32 (the fused loop)
        name, args = _adam_args(E4M3, BF16, param_dtype, [BF16], block_size,
                                [((2, 127), "contiguous")], seed=9)
        args[0][0] = (torch.randn(2, 127, generator=gen) * 1e-6).to(BF16)  # small grads
        args[2][0] = codes.clone()
        args[3][0] = torch.rand(args[3][0].shape, generator=gen) + 0.5
        _check(name, _to(args, device))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("flag_dtype", [torch.float32, torch.int32])
def test_noop_writes_nothing(device, flag_dtype):
    for build in (_adam_args, _sgd_args):
        name, args = build(device=device, noop=torch.ones(1, dtype=flag_dtype, device=device))
        before = clone_args(list(args))
        got, want = _run_both(name, args)
        _assert_same(got, before)
        _assert_same(want, before)


@pytest.mark.parametrize("device", DEVICES)
def test_clear_noop_is_a_normal_step(device):
    for build in (_adam_args, _sgd_args):
        name, args = build(device=device, noop=torch.zeros(1, device=device))
        _, plain = build(device=device)
        got, _ = _run_both(name, args)
        want, _ = _run_both(name, plain)
        _assert_same(got, want)


@pytest.mark.slow
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_thread_counts(threads):
    """Any thread count gives the reference's bits (the rounding bits are per element)."""
    saved = torch.get_num_threads()
    shapes = [((1 + (379 * i) % 3000,), "contiguous") for i in range(60)] + [((40, 2000), "contiguous")]
    try:
        torch.set_num_threads(threads)
        _check(*_adam_args(shapes=shapes))
        _check(*_sgd_args(shapes=shapes))
    finally:
        torch.set_num_threads(saved)


@pytest.mark.parametrize("device", DEVICES)
def test_stochastic_rounding_changes_with_step_and_seed(device):
    """The rounding bits differ per step and seed: the same update rounds differently."""
    _, args = _adam_args(m_code=F32, v_code=F32, device=device, shapes=[((4096,), "contiguous")])
    outs = []
    for step, seed in ((3, 1234), (4, 1234), (3, 1)):
        a = clone_args(list(args))
        a[14], a[18] = step, seed
        a[2] = [torch.zeros_like(t) for t in a[2]]
        a[4] = [torch.ones_like(t) for t in a[4]]
        a[16] = False  # no bias correction: steps 3 and 4 compute the same update
        torch.ops.amp_patch.multi_tensor_adam_lean_(*a)
        outs.append(a[1][0].view(torch.int16))
    assert not torch.equal(outs[0], outs[1]) and not torch.equal(outs[0], outs[2])


def test_random_bits_pairs_and_spread():
    """Elements e and e ^ 16 take the halves of one murmur3 hash; the bits are uniform.

    The pairing lets the AVX-512 loop hash once for 32 aligned elements; this
    checks that it costs nothing in quality: the bits fill [0, 2**16) evenly,
    and neither the two halves of a hash nor neighbouring elements correlate.
    """
    n = 1 << 16
    bits = lean.random_bits(seed=5, step=7, index=3, numel=n)
    assert bits.dtype == torch.int64 and int(bits.min()) >= 0 and int(bits.max()) < 2**16
    e = torch.arange(n)
    key = lean._tensor_key(5, 7, 3)
    first = (e & 16) == 0
    h = lean._fmix32(key ^ ((e[first] * lean._K0) & lean._MASK32))
    assert torch.equal(bits[first], h >> 16)
    assert torch.equal(bits[e[first] + 16], h & 0xFFFF)
    u = bits.double() / 2**16
    assert abs(float(u.mean()) - 0.5) < 0.01
    counts = torch.bincount(bits >> 12, minlength=16).double()  # 16 bins of 4096 each
    assert float(((counts - n / 16) ** 2 / (n / 16)).sum()) < 50  # chi-square, 15 dof
    pairs = torch.corrcoef(torch.stack([u[first], u[e[first] + 16]]))[0, 1]
    neighbours = torch.corrcoef(torch.stack([u[:-1], u[1:]]))[0, 1]
    assert abs(float(pairs)) < 0.02 and abs(float(neighbours)) < 0.02


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("seed,step", [(-7, 3), (2**40 + 3, 2**33 + 5), (0, 0), (2**31, -1)])
def test_rounding_key_wraps_like_python(device, seed, step):
    """Seeds and steps beyond 32 bits (or negative) enter the hash modulo 2**32."""
    name, args = _adam_args(device=device, shapes=[((3, 700), "contiguous")], bias_correction=False)
    args[14], args[18] = step, seed
    _check(name, args)
    name, args = _sgd_args(device=device, shapes=[((3, 700), "contiguous")])
    args[14], args[16] = step, seed
    _check(name, args)


# ------------------------------------------------------------ hypothesis

@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    rows=st.integers(0, 5), cols=st.integers(0, 700), one_d=st.booleans(),
    block_size=st.sampled_from([1, 3, 16, 64, 255, 256, 1024]),
    m_code=st.sampled_from(FIRST_CODES), v_code=st.sampled_from(SECOND_CODES),
    param_dtype=st.sampled_from(PARAM_DTYPES), grad_dtype=st.sampled_from(GRAD_DTYPES),
    seed=st.integers(0, 2**31 - 1),
)
def test_random_cases_match_reference(rows, cols, one_d, block_size, m_code, v_code, param_dtype,
                                      grad_dtype, seed):
    shape = (rows * cols,) if one_d else (rows, cols)
    shapes = [(shape, "contiguous"), ((cols,), "contiguous")]
    _check(*_adam_args(m_code, v_code, param_dtype, [grad_dtype], block_size, shapes, seed=seed))
    _check(*_sgd_args(m_code, param_dtype, [grad_dtype], block_size, shapes, seed=seed))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    rows=st.integers(1, 4), cols=st.integers(1, 2100),
    block_size=st.sampled_from([32, 64, 96, 256, 512]),
    codes=st.sampled_from([(I8, U8), (I8, BF16), (BF16, U8), (F32, F32)]),
    param_dtype=st.sampled_from(PARAM_DTYPES),
    bad=st.lists(st.tuples(st.floats(0, 1, exclude_max=True), st.sampled_from(NONFINITE)),
                 max_size=3),
    seed=st.integers(0, 2**31 - 1),
)
def test_fused_adam_blocks_match_reference(rows, cols, block_size, codes, param_dtype, bad, seed):
    """The fused CPU loop codes each block during the next one's steps: rows of several blocks
    with a short last one, and non-finite values in any block, still match the reference."""
    shapes = [((rows, cols), "contiguous")]
    name, args = _adam_args(codes[0], codes[1], param_dtype, [BF16], block_size, shapes, seed=seed)
    _spoil(args[0][0], bad)
    _check(name, args)


def _spoil(grad, bad):
    flat = grad.view(-1)
    for where, value in bad:
        flat[int(where * flat.numel())] = value


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    rows=st.integers(1, 4), cols=st.integers(1, 2100),
    block_size=st.sampled_from([32, 64, 96, 256, 512]),
    code=st.sampled_from([I8, BF16, E4M3, F32]), param_dtype=st.sampled_from([F32, BF16]),
    grad_dtype=st.sampled_from(GRAD_DTYPES),
    variant=st.sampled_from(SGD_VARIANTS[:6]),
    bad=st.lists(st.tuples(st.floats(0, 1, exclude_max=True), st.sampled_from(NONFINITE)),
                 max_size=2),
    seed=st.integers(0, 2**31 - 1),
)
def test_fused_sgd_blocks_match_reference(rows, cols, block_size, code, param_dtype, grad_dtype,
                                          variant, bad, seed):
    """FusedSGD's fused CPU loop (the momentum as its one state, or none at momentum 0): every
    code, Nesterov, a first step, decay after the momentum, with blocks coded late as in Adam's."""
    shapes = [((rows, cols), "contiguous")]
    name, args = _sgd_args(code, param_dtype, [grad_dtype], block_size, shapes, seed=seed,
                           **variant)
    _spoil(args[0][0], bad)
    _check(name, args)


# ------------------------------------------------------------ errors

def _impls(name):
    return [getattr(torch.ops.amp_patch, name), lean._LEAN_REFERENCE[name]]


def _with(args, index, value):
    args = list(args)
    args[index] = value
    return args


ADAM_ERRORS = [
    (lambda a: _with(a, 2, a[2][:-1]), r"list lengths differ \(grads has 11, exp_avgs has 10\)"),
    (lambda a: _with(a, 1, [torch.zeros(5, dtype=BF16)] + a[1][1:]),
     r"params\[0\] has shape \(5,\) but grads\[0\] has \(7, 300\)"),
    (lambda a: _with(a, 17, 0), "block_size must be positive, got 0"),
    (lambda a: _with(a, 1, [a[1][0].double()] + a[1][1:]),
     r"params\[0\] has dtype torch.float64; params are float32, bfloat16 or float16"),
    (lambda a: _with(a, 2, [a[2][0].to(torch.int16)] + a[2][1:]),
     r"exp_avgs\[0\] has dtype torch.int16; state codes are"),
    (lambda a: _with(a, 2, [a[2][0].view(torch.uint8)] + a[2][1:]),
     r"exp_avgs\[0\] is uint8, the code of a second moment"),
    (lambda a: _with(a, 3, a[3][:-1]), r"exp_avg_scales has 10 tensors for 11 exp_avgs"),
    (lambda a: _with(a, 3, []), r"exp_avgs\[0\] is torch.int8 but exp_avg_scales is empty"),
    (lambda a: _with(a, 5, [torch.zeros(7, 3)] + a[5][1:]),
     r"exp_avg_sq_scales\[0\] must be float32 of shape \(7, 2\) for block_size 256, got "
     r"torch.float32 \(7, 3\)"),
    (lambda a: _with(a, 5, [a[5][0].double()] + a[5][1:]),
     r"exp_avg_sq_scales\[0\] must be float32 of shape \(7, 2\)"),
    (lambda a: _with(a, 4, [torch.zeros(300, 7, dtype=U8).t()] + a[4][1:]),
     r"exp_avg_sqs\[0\] and its scales must be contiguous"),
]


@pytest.mark.parametrize("case", range(len(ADAM_ERRORS)))
def test_adam_errors_match_reference(case):
    make, message = ADAM_ERRORS[case]
    _, args = _adam_args()
    for run in _impls("multi_tensor_adam_lean_"):
        with pytest.raises(RuntimeError, match=message):
            run(*make(clone_args(list(args))))


def test_sgd_errors_match_reference():
    _, args = _sgd_args()
    for run in _impls("multi_tensor_sgd_lean_"):
        with pytest.raises(RuntimeError, match="momentum is 0.9 but momentum_buffers has 0 tensors"):
            run(*_with(args, 2, []))
        with pytest.raises(RuntimeError, match=r"momentum_buffers\[0\] is uint8"):
            run(*_with(args, 2, [args[2][0].view(U8)] + args[2][1:]))
        with pytest.raises(RuntimeError, match=r"momentum_scales has 1 tensors for 11"):
            run(*_with(args, 3, args[3][:1]))


# ------------------------------------------------------------ registration

@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    for build in (_adam_args, _sgd_args):
        name, args = build(shapes=[((3, 40), "contiguous"), ((50,), "contiguous")], block_size=16,
                           device=device)
        torch.library.opcheck(getattr(torch.ops.amp_patch, name).default, args)


def test_native_cpu_kernels_serve_the_lean_ops():
    if not ops.native_extension_loaded():
        pytest.skip("extension not built")
    for name in lean._LEAN_SCHEMAS:
        assert ops.has_native_kernel("cpu", name), name


@pytest.mark.slow
@pytest.mark.parametrize("capability", ["AVX2", "DEFAULT"])
def test_every_cpu_isa_matches_reference(capability):
    """The lean loops of each instruction set (ATEN_CPU_CAPABILITY) give the reference's bits."""
    _kernel_or_skip()
    code = textwrap.dedent(
        """
        import sys
        sys.path[:0] = ["tests", "tests/ops"]
        import torch
        from amp_patch import _C
        import test_lean_state_ops as t
        print(_C.cpu_capability())
        for m_code, v_code in zip(t.FIRST_CODES, t.SECOND_CODES):
            for param_dtype in t.PARAM_DTYPES:
                t._check(*t._adam_args(m_code, v_code, param_dtype))
            t._check(*t._sgd_args(m_code))
            t._check(*t._sgd_args(m_code, first_run=True, nesterov=True))
            t._check(*t._adam_args(m_code, v_code, block_size=7))
        t._check(*t._adam_args(block_size=1))
        t._check(*t._sgd_args(momentum=0.0))
        print("ok")
        """
    )
    env = {**os.environ, "ATEN_CPU_CAPABILITY": capability.lower()}
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=300, cwd=root)
    assert proc.returncode == 0 and proc.stdout.split() == [capability, "ok"], proc.stdout + proc.stderr
