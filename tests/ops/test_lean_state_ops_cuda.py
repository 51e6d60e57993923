"""The CUDA kernels of the lean optimizer ops against their reference bodies, bit for bit.

``multi_tensor_adam_lean_`` and ``multi_tensor_sgd_lean_`` run through
``torch.ops.amp_patch`` (the compiled CUDA kernel, csrc/cuda/optim_lean.cu)
and through the reference body of :mod:`amp_patch.ops.lean_state_ops` on
copies of the same CUDA tensors, for several steps in a row; params, model
copies, state codes and block scales must agree in every bit (NaN payloads
aside). The cases cover every state code, param and grad dtype, block sizes
that do not divide the rows (and blocks longer than the kernel keeps in
registers), non-contiguous tensors, noop, inv_scale, more tensors than one
launch holds, and non-finite grads, states and scales.

Every case skips without CUDA.
"""

from __future__ import annotations

import pytest
import torch
from test_ops import assert_bitwise, clone_args

from amp_patch import ops
from amp_patch.ops import lean_state_ops
from amp_patch.ops.lean_state_ops import encode

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA not available")

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
I8, U8, E4M3 = torch.int8, torch.uint8, torch.float8_e4m3fn
DEV = "cuda"

ADAM = "multi_tensor_adam_lean_"
SGD = "multi_tensor_sgd_lean_"

# (exp_avg code, exp_avg_sq code)
ADAM_CODES = [(F32, F32), (BF16, BF16), (I8, U8), (E4M3, E4M3), (I8, E4M3), (E4M3, U8),
              (I8, I8), (BF16, U8), (F32, U8)]
SGD_CODES = [F32, BF16, I8, E4M3]
PARAM_DTYPES = [F32, BF16, F16]

# Shapes: one-row tensors (0-dim, 1-D), rows of 2-D and 3-D tensors, empty ones.
# The kernel reads a tensor in vectors of 8 when its rows and blocks are multiples of 8
# ((2, 1000), (2, 3000), (2, 4096) with an even block size), else element by element.
# (2, 3000), (2, 4096): rows longer than the kernel keeps in registers (256 per warp).
SHAPES = [(), (1,), (7,), (300,), (3, 257), (4, 5, 7), (0,), (2, 1000), (5, 0), (2, 3, 130),
          (2, 3000), (2, 4096)]
# 1: a scale per element; 33 and 100: blocks that do not divide the rows; 2048 and
# 5000: blocks longer than the kernel keeps in registers (in vectors: 2048, 5000 does not
# divide by 8).
BLOCK_SIZES = [1, 33, 100, 256, 2048, 5000]


# ------------------------------------------------------------------ helpers

def _assert_same(got, want, what):
    """Tensor lists equal bit for bit: floats through assert_bitwise, codes exactly."""
    assert len(got) == len(want), what
    for i, (a, b) in enumerate(zip(got, want)):
        assert a.dtype == b.dtype and a.shape == b.shape, f"{what}[{i}]"
        if a.dtype == E4M3:  # exact in fp32, NaN stays NaN
            a, b = a.float(), b.float()
        if a.is_floating_point():
            assert_bitwise([a], [b])
        else:
            assert torch.equal(a, b), f"{what}[{i}]: codes differ from the reference"


def _rand(shape, dtype, gen, scale=1.0, positive=False):
    t = torch.rand(shape, generator=gen) + 0.01 if positive else torch.randn(shape, generator=gen)
    return (t * scale).to(dtype).to(DEV)


def _state(shape, code, block_size, gen, positive):
    """A state tensor in `code` (and its scales, or None) holding random values."""
    x = torch.rand(shape, generator=gen) * 1e-2 if positive else torch.randn(shape, generator=gen) * 1e-2
    codes, scales = encode(x, code, block_size)
    return codes.to(DEV), (None if scales is None else scales.to(DEV))


def _scales_list(scales):
    """One scale tensor per state tensor (a placeholder for the unscaled codes), or []."""
    if all(s is None for s in scales):
        return []
    return [torch.empty(0, device=DEV) if s is None else s for s in scales]


def _strided(t, layout):
    """`t` (2-D or more) as a transposed view with the same shape and values."""
    if layout != "transposed" or t.dim() < 2:
        return t
    return t.transpose(0, 1).contiguous().transpose(0, 1)


def _run(name, args):
    """The CUDA kernel and the reference on separate copies of args; returns both copies."""
    got, want = clone_args(list(args)), clone_args(list(args))
    getattr(torch.ops.amp_patch, name)(*got)
    lean_state_ops._LEAN_REFERENCE[name](*want)
    return got, want


# Written lists, by position in each op's arguments.
_ADAM_OUT = {"params": 1, "exp_avgs": 2, "exp_avg_scales": 3, "exp_avg_sqs": 4,
             "exp_avg_sq_scales": 5, "model_params": 6}
_SGD_OUT = {"params": 1, "momentum_buffers": 2, "momentum_scales": 3, "model_params": 4}


def _check(name, args, steps=3, step_at=14):
    """Runs `steps` steps of the op; the kernel's outputs feed the next step of both sides."""
    out = _ADAM_OUT if name == ADAM else _SGD_OUT
    args = list(args)
    for _ in range(steps):
        got, want = _run(name, args)
        for what, k in out.items():
            _assert_same(got[k], want[k], f"{what} at step {args[step_at]}")
        args = got
        args[step_at] = args[step_at] + 1
    return args


def _adam_args(shapes, codes, param_dtype, block_size, grad_dtype=None, model=True,
               inv_scale=True, noop=None, layout="contiguous", seed=11, adam_w_mode=True,
               weight_decay=0.01, bias_correction=True):
    gen = torch.Generator().manual_seed(seed)
    grads, params, ms, mss, vs, vss, models = [], [], [], [], [], [], []
    for j, shape in enumerate(shapes):
        gd = grad_dtype or [F32, BF16, F16][j % 3]
        grads.append(_strided(_rand(shape, gd, gen, scale=300.0 if inv_scale else 1.0), layout))
        params.append(_strided(_rand(shape, param_dtype, gen), layout))
        m, ms_ = _state(shape, codes[0], block_size, gen, positive=False)
        v, vs_ = _state(shape, codes[1], block_size, gen, positive=True)
        ms.append(m), mss.append(ms_), vs.append(v), vss.append(vs_)
        if model:
            models.append(_strided(_rand(shape, [BF16, F16][j % 2], gen), layout))
    scale = torch.full((1,), 1.0 / 300.0, device=DEV) if inv_scale else None
    return [grads, params, ms, _scales_list(mss), vs, _scales_list(vss), models, noop, scale,
            2e-2, 0.9, 0.999, 1e-8, weight_decay, 1, adam_w_mode, bias_correction, block_size,
            seed]


def _sgd_args(shapes, code, param_dtype, block_size, momentum=0.9, nesterov=False,
              first_run=False, wd_after_momentum=False, model=True, inv_scale=True, noop=None,
              layout="contiguous", seed=5):
    gen = torch.Generator().manual_seed(seed)
    grads, params, bufs, scales, models = [], [], [], [], []
    for j, shape in enumerate(shapes):
        grads.append(_strided(_rand(shape, [F32, BF16, F16][j % 3], gen,
                                    scale=300.0 if inv_scale else 1.0), layout))
        params.append(_strided(_rand(shape, param_dtype, gen), layout))
        if momentum != 0.0:
            b, s = _state(shape, code, block_size, gen, positive=False)
            bufs.append(b), scales.append(s)
        if model:
            models.append(_strided(_rand(shape, [BF16, F16][j % 2], gen), layout))
    scale = torch.full((1,), 1.0 / 300.0, device=DEV) if inv_scale else None
    return [grads, params, bufs, _scales_list(scales), models, noop, scale, 5e-2, 1e-4,
            momentum, 0.0 if nesterov else 0.1, nesterov, first_run, wd_after_momentum, 1,
            block_size, seed]


# ------------------------------------------------------------------ registration

def test_cuda_kernels_serve_the_lean_ops():
    """A build that dropped optim_lean.cu would compare the reference with itself (LAMB's
    stages are compared in test_lamb_lean_ops.py)."""
    for name in lean_state_ops._CUDA_KERNELS:
        assert ops.has_native_kernel("cuda", name), name


# ------------------------------------------------------------------ Adam

@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("param_dtype", PARAM_DTYPES, ids=str)
@pytest.mark.parametrize("codes", ADAM_CODES, ids=lambda c: f"{c[0]}-{c[1]}")
def test_adam_lean_matches_reference(codes, param_dtype, block_size):
    _check(ADAM, _adam_args(SHAPES, codes, param_dtype, block_size))


@pytest.mark.parametrize("variant", [
    {"adam_w_mode": False},
    {"weight_decay": 0.0, "bias_correction": False, "inv_scale": False, "model": False},
    {"layout": "transposed"},
    {"grad_dtype": F32, "model": False},
], ids=["l2", "plain", "transposed", "fp32_grads"])
@pytest.mark.parametrize("param_dtype", PARAM_DTYPES, ids=str)
@pytest.mark.parametrize("codes", [(I8, U8), (E4M3, E4M3), (BF16, BF16)], ids=lambda c: f"{c[0]}-{c[1]}")
def test_adam_lean_variants_match_reference(codes, param_dtype, variant):
    _check(ADAM, _adam_args(SHAPES, codes, param_dtype, 64, **variant))


@pytest.mark.parametrize("codes", ADAM_CODES, ids=lambda c: f"{c[0]}-{c[1]}")
def test_adam_lean_more_tensors_than_one_launch(codes):
    """Hundreds of small tensors: several launches, tensors found by their first block."""
    shapes = [(1 + (37 * i) % 700,) if i % 3 else (2, 1 + (13 * i) % 90) for i in range(700)]
    _check(ADAM, _adam_args(shapes, codes, BF16, 128), steps=2)


@pytest.mark.parametrize("codes", [(I8, U8), (E4M3, BF16)], ids=lambda c: f"{c[0]}-{c[1]}")
def test_adam_lean_more_blocks_than_the_grid(codes):
    """block_size 1 over 1.1 M elements: more state blocks than one grid, which loops."""
    _check(ADAM, _adam_args([(1_100_000,), (3,)], codes, BF16, 1), steps=1)


@pytest.mark.parametrize("noop_dtype", [torch.float32, torch.int32], ids=str)
@pytest.mark.parametrize("codes", ADAM_CODES, ids=lambda c: f"{c[0]}-{c[1]}")
def test_adam_lean_noop_writes_nothing(codes, noop_dtype):
    args = _adam_args(SHAPES, codes, BF16, 33, noop=torch.ones(1, dtype=noop_dtype, device=DEV))
    before = clone_args(args)
    got, want = _run(ADAM, args)
    for what, k in _ADAM_OUT.items():
        _assert_same(got[k], before[k], what)
        _assert_same(want[k], before[k], what)


def _nonfinite_adam(codes, param_dtype):
    """Blocks with inf and NaN grads, an inf old scale, and blocks too small to scale."""
    shapes = [(3, 257), (300,), (2, 64), (2, 512)]
    args = _adam_args(shapes, codes, param_dtype, 32)
    grads, params = args[0], args[1]
    # Tensor 0 is read element by element, tensor 3 in vectors.
    for t, (r, c) in ((0, (1, 40)), (3, (1, 300))):
        grads[t][r, c] = float("inf")   # m and v of that block become inf: scale inf, factor 0
        grads[t][r + 1 if t == 0 else 0, 5] = float("nan")  # NaN scale: the block's codes are 0
    grads[0][0, 100] = -float("inf")
    for t, i in ((1, 7), (3, 900)):
        params[t].view(-1)[i] = float("inf")      # non-finite params round to nearest
        params[t].view(-1)[i + 1] = float("nan")
    # Tensor 2: grads of 1e-39 on zero state, so the new first moments are
    # subnormal and 127 / s overflows (the codes stay 0), and the second are 0.
    grads[2] = torch.full((2, 64), 1e-39, device=DEV)
    for k in (2, 4):
        code = args[k][2].dtype
        codes_, scales = encode(torch.zeros(2, 64), code, 32)
        args[k][2] = codes_.to(DEV)
        if scales is not None:
            args[k + 1][2] = scales.to(DEV)
    # An inf and a NaN old scale: that block decodes to NaN (0 * inf) or inf.
    for k in (3, 5):
        for t in (1, 3):
            if args[k] and args[k][t].numel():
                args[k][t][0, 2] = float("inf")
                args[k][t][0, 4] = float("nan")
    return args


@pytest.mark.parametrize("param_dtype", PARAM_DTYPES, ids=str)
@pytest.mark.parametrize("codes", ADAM_CODES, ids=lambda c: f"{c[0]}-{c[1]}")
def test_adam_lean_nonfinite_match_reference(codes, param_dtype):
    _check(ADAM, _nonfinite_adam(codes, param_dtype), steps=2)


def _misaligned(t):
    """A copy of `t`, contiguous but starting one element into its storage: not 16-byte aligned."""
    if t.numel() == 0:
        return t.clone()
    buf = torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)
    return buf[1:].view(t.shape).copy_(t)


@pytest.mark.parametrize("which", ["all", "model"])
@pytest.mark.parametrize("codes", [(I8, U8), (E4M3, BF16), (F32, F32)],
                         ids=lambda c: f"{c[0]}-{c[1]}")
def test_adam_lean_misaligned_tensors_match_reference(codes, which):
    """Rows of 8s whose data do not start on 16 bytes take the element path, and agree.

    `all`: every list is misaligned; `model`: only the model copies, so each
    tensor's other lists would allow vectors.
    """
    args = _adam_args([(2, 1024), (4, 512), (8,)], codes, BF16, 256)
    want = clone_args(args)
    got = clone_args(args)
    lists = (0, 1, 2, 4, 6) if which == "all" else (6,)
    for k in lists:
        got[k] = [_misaligned(t) for t in got[k]]
    assert all(t.data_ptr() % 16 for k in lists for t in got[k])
    for _ in range(2):
        torch.ops.amp_patch.multi_tensor_adam_lean_(*got)
        lean_state_ops._LEAN_REFERENCE[ADAM](*want)
        for what, k in _ADAM_OUT.items():
            _assert_same(got[k], want[k], what)
        got[14] = want[14] = got[14] + 1


def test_adam_lean_bf16_params_round_stochastically():
    """The kernel's bf16 params are not the nearest rounding: the random bits are used."""
    args = _adam_args([(64, 512)], (I8, U8), BF16, 256, model=False)
    got, want = _run(ADAM, args)
    _assert_same(got[1], want[1], "params")
    p = got[1][0]
    # The same step on an fp32 copy of the params, with a bf16 model copy: the
    # nearest rounding of the same fp32 update.
    nearest = torch.empty_like(p)
    torch.ops.amp_patch.multi_tensor_adam_lean_(
        [args[0][0].clone()], [args[1][0].float()], [args[2][0].clone()], [args[3][0].clone()],
        [args[4][0].clone()], [args[5][0].clone()], [nearest], None, args[8], *args[9:])
    # Stochastic rounding leaves a good share of the elements on the other side.
    assert (p != nearest).float().mean().item() > 0.05


# ------------------------------------------------------------------ SGD

@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("param_dtype", PARAM_DTYPES, ids=str)
@pytest.mark.parametrize("code", SGD_CODES, ids=str)
def test_sgd_lean_matches_reference(code, param_dtype, block_size):
    _check(SGD, _sgd_args(SHAPES, code, param_dtype, block_size), step_at=14)


@pytest.mark.parametrize("variant", [
    {"nesterov": True, "first_run": True},
    {"wd_after_momentum": True, "inv_scale": False},
    {"momentum": 0.0, "model": False},
    {"layout": "transposed"},
], ids=["nesterov_first_run", "wd_after", "no_momentum", "transposed"])
@pytest.mark.parametrize("param_dtype", PARAM_DTYPES, ids=str)
@pytest.mark.parametrize("code", SGD_CODES, ids=str)
def test_sgd_lean_variants_match_reference(code, param_dtype, variant):
    _check(SGD, _sgd_args(SHAPES, code, param_dtype, 48, **variant), step_at=14)


@pytest.mark.parametrize("code", SGD_CODES, ids=str)
def test_sgd_lean_noop_writes_nothing(code):
    args = _sgd_args(SHAPES, code, BF16, 33, noop=torch.ones(1, device=DEV))
    before = clone_args(args)
    got, want = _run(SGD, args)
    for what, k in _SGD_OUT.items():
        _assert_same(got[k], before[k], what)
        _assert_same(want[k], before[k], what)


@pytest.mark.parametrize("code", SGD_CODES, ids=str)
def test_sgd_lean_nonfinite_match_reference(code):
    args = _sgd_args([(3, 257), (300,)], code, BF16, 32)
    args[0][0][1, 40] = float("inf")
    args[0][0][2, 5] = float("nan")
    if args[3]:
        args[3][1][0, 3] = float("inf")
    _check(SGD, args, steps=2, step_at=14)


# ------------------------------------------------------------------ errors and schema

@pytest.mark.parametrize("bad", ["uint8_first_moment", "scale_shape", "block_size", "param_dtype"])
def test_adam_lean_rejects_what_the_reference_rejects(bad):
    args = _adam_args([(3, 70)], (I8, U8), F32, 32)
    if bad == "uint8_first_moment":
        args[2] = [torch.zeros(3, 70, dtype=U8, device=DEV)]
    elif bad == "scale_shape":
        args[3] = [torch.zeros(3, 2, device=DEV)]
    elif bad == "block_size":
        args[17] = 0
    else:
        args[1] = [args[1][0].double()]
    with pytest.raises(RuntimeError) as ref:
        lean_state_ops._LEAN_REFERENCE[ADAM](*clone_args(args))
    with pytest.raises(RuntimeError) as kernel:
        torch.ops.amp_patch.multi_tensor_adam_lean_(*clone_args(args))
    # The same complaint: the message names the same list.
    for word in ("exp_avgs", "exp_avg_scales", "block_size", "params[0]"):
        assert (word in str(ref.value)) == (word in str(kernel.value)), word


@pytest.mark.parametrize("name", [ADAM, SGD])
def test_lean_ops_pass_opcheck_on_cuda(name):
    if name == ADAM:
        args = _adam_args([(3, 70), (40,)], (I8, U8), BF16, 32)
    else:
        args = _sgd_args([(3, 70), (40,)], I8, BF16, 32)
    torch.library.opcheck(getattr(torch.ops.amp_patch, name).default, args)
