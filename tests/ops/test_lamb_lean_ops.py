"""LAMB's lean stages: the compiled kernels against their reference bodies.

``multi_tensor_lamb_lean_stage1_`` reads the moments' codes and returns each
tensor's ``||p||`` and ``||u||`` (compared with the reference's float64 sums to
1e-5, as the fp32 stage 1's); ``multi_tensor_lamb_lean_stage2_`` computes the
same new moments again, steps along them and writes params, codes, scales and
model copies, which must match the reference to the bit. The cases cover every
state code, param dtype, the rule's variants (L2, no decay, NVLAMB, clipping
on and off), block sizes, a set ``noop``, thread counts and the error checks,
on every device with a compiled kernel for the stages (on CUDA the reference
runs LAMB's compiled fp32 stages on the decoded state); the cases skip where
the reference would be compared with itself.
"""

from __future__ import annotations

import pytest
import torch
from conftest import DEVICES
from test_lean_state_ops import (
    BF16,
    E4M3,
    F16,
    F32,
    FIRST_CODES,
    GRAD_DTYPES,
    I8,
    PARAM_DTYPES,
    SECOND_CODES,
    SHAPES,
    U8,
    _assert_same,
    _common,
    _state,
    _to,
)
from test_ops import assert_bitwise, clone_args

from amp_patch import ops
from amp_patch.ops import lean_state_ops as lean
from amp_patch.ops import optimizer_ops

STAGE1, STAGE2 = "multi_tensor_lamb_lean_stage1_", "multi_tensor_lamb_lean_stage2_"
LAMB_KW = dict(max_grad_norm=1.0, beta1=0.9, beta2=0.999, eps=1e-6, weight_decay=0.01, step=3,
               bias_correction=True, grad_averaging=True, adam_w_mode=True, use_nvlamb=False)

pytestmark = pytest.mark.skipif(not ops.has_native_kernel("cpu", STAGE1),
                                reason="no compiled CPU kernel for LAMB's lean stages")


def _lists(m_code=I8, v_code=U8, param_dtype=BF16, block_size=256, shapes=SHAPES, seed=0):
    """grads, params, the moments' codes and scales, and model copies."""
    gen = torch.Generator().manual_seed(seed)
    grads, params, model = _common(shapes, GRAD_DTYPES, param_dtype, block_size, gen, True)
    m = [_state(s, m_code, block_size, gen, 0.1, False) for s, _ in shapes]
    v = [_state(s, v_code, block_size, gen, 0.01, True) for s, _ in shapes]
    return (grads, params, [c for c, _ in m], [s for _, s in m if s is not None],
            [c for c, _ in v], [s for _, s in v if s is not None], model)


def _stage1_args(lists, noop=None, inv_scale=True, norm=40.0, block_size=256, device="cpu",
                 **kw):
    h = {**LAMB_KW, **kw}
    return _to([*lists[:6], noop, torch.full((1,), 0.5) if inv_scale else None,
                torch.tensor([norm]), h["max_grad_norm"], h["beta1"], h["beta2"], h["eps"],
                h["weight_decay"], h["step"], h["bias_correction"], h["grad_averaging"],
                h["adam_w_mode"], h["use_nvlamb"], block_size], device)


def _stage2_args(lists, norms, model=True, noop=None, inv_scale=True, norm=40.0, block_size=256,
                 lr=1e-2, seed=7, device="cpu", **kw):
    h = {**LAMB_KW, **kw}
    return _to([*lists[:6], *norms, lists[6] if model else [], noop,
                torch.full((1,), 0.5) if inv_scale else None, torch.tensor([norm]),
                h["max_grad_norm"], lr, h["beta1"], h["beta2"], h["eps"], h["weight_decay"],
                h["step"], h["bias_correction"], h["grad_averaging"], h["adam_w_mode"],
                h["use_nvlamb"], block_size, seed], device)


def _kernel_or_skip(device):
    """Skips where the reference would be compared with itself."""
    if not ops.has_native_kernel(device, STAGE1):
        pytest.skip(f"no compiled kernel for LAMB's lean stages on {device}")


def _step_both(lists, steps=2, block_size=256, device="cpu", **kw):
    """`steps` steps through the kernels and through the references, from the same inputs
    (on `device`); each side's stage 2 takes its own stage 1's norms. Checks every step and
    returns the kernels' lists."""
    _kernel_or_skip(device)
    lists = _to(list(lists), device)
    got, want = clone_args(list(lists)), clone_args(list(lists))
    for step in range(3, 3 + steps):
        args1 = _stage1_args(got, block_size=block_size, step=step, device=device, **kw)
        before = clone_args(args1)
        norms = torch.ops.amp_patch.multi_tensor_lamb_lean_stage1_(*args1)
        _assert_same(args1, before)  # stage 1 writes nothing
        ref_norms = lean._LEAN_REFERENCE[STAGE1](*_stage1_args(want, block_size=block_size,
                                                               step=step, device=device, **kw))
        for a, b in zip(norms, ref_norms):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, equal_nan=True)
        # The same norms into both stage 2s, so that their bits can be compared.
        args2 = _stage2_args(got, norms, block_size=block_size, step=step, device=device, **kw)
        torch.ops.amp_patch.multi_tensor_lamb_lean_stage2_(*args2)
        lean._LEAN_REFERENCE[STAGE2](*_stage2_args(want, norms, block_size=block_size, step=step,
                                                   device=device, **kw))
        _assert_same(got, want)
    return got


# ------------------------------------------------------------ kernel against reference

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("param_dtype", PARAM_DTYPES)
@pytest.mark.parametrize("v_code", SECOND_CODES)
@pytest.mark.parametrize("m_code", FIRST_CODES)
def test_stages_match_reference(m_code, v_code, param_dtype, device):
    _step_both(_lists(m_code, v_code, param_dtype), device=device)


@pytest.mark.parametrize("variant", [
    {"adam_w_mode": False},
    {"weight_decay": 0.0},
    {"weight_decay": 0.0, "use_nvlamb": True},
    {"max_grad_norm": 0.0, "inv_scale": False},
    {"norm": 1e-3},
    {"grad_averaging": False, "bias_correction": False},
], ids=["l2", "no_decay", "nvlamb", "no_clipping", "unclipped", "plain"])
@pytest.mark.parametrize("codes", [(I8, U8), (E4M3, BF16)], ids=["int8-uint8", "e4m3-bf16"])
@pytest.mark.parametrize("device", DEVICES)
def test_variants_match_reference(device, codes, variant):
    _step_both(_lists(*codes), device=device, **variant)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("block_size", [1, 32, 100, 2048])
def test_block_sizes_match_reference(block_size, device):
    _step_both(_lists(block_size=block_size), block_size=block_size, device=device)


@pytest.mark.slow
@pytest.mark.parametrize("device", DEVICES)
def test_many_tensors_and_nonfinite_grads_match_reference(device):
    """More tensors than one CUDA launch holds, and inf/NaN grads (non-finite norms and scales)."""
    shapes = [((1 + (379 * i) % 3000,), "contiguous") for i in range(150)] + [
        ((40, 2000), "contiguous")]
    lists = _lists(shapes=shapes)
    lists[0][3].view(-1)[5] = float("inf")
    lists[0][150].view(-1)[77] = float("nan")
    _step_both(lists, steps=1, device=device)


@pytest.mark.parametrize("device", DEVICES)
def test_norms_are_the_same_every_run(device):
    _kernel_or_skip(device)
    lists = _to(list(_lists()), device)
    runs = [torch.ops.amp_patch.multi_tensor_lamb_lean_stage1_(*_stage1_args(lists, device=device))
            for _ in range(3)]
    for other in runs[1:]:
        assert_bitwise(list(runs[0]), list(other))


@pytest.mark.slow
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_thread_counts_change_no_bit(threads):
    """The norms are summed per chunk and added in chunk order: any thread count, same bits."""
    shapes = [((1 + (379 * i) % 3000,), "contiguous") for i in range(40)] + [
        ((40, 2000), "contiguous")]
    lists = _lists(shapes=shapes)
    saved = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = torch.ops.amp_patch.multi_tensor_lamb_lean_stage1_(*_stage1_args(lists))
        torch.set_num_threads(threads)
        many = torch.ops.amp_patch.multi_tensor_lamb_lean_stage1_(*_stage1_args(lists))
        _step_both(lists, steps=1)
    finally:
        torch.set_num_threads(saved)
    assert_bitwise(list(one), list(many))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("flag_dtype", [torch.float32, torch.int32])
def test_noop_writes_nothing(flag_dtype, device):
    _kernel_or_skip(device)
    lists = _to(list(_lists()), device)
    noop = torch.ones(1, dtype=flag_dtype)
    norms = torch.ops.amp_patch.multi_tensor_lamb_lean_stage1_(
        *_stage1_args(lists, noop=noop, device=device))
    assert not norms[0].any() and not norms[1].any()
    before = clone_args(list(lists))
    ones = (torch.ones(11), torch.ones(11))
    for run in (torch.ops.amp_patch.multi_tensor_lamb_lean_stage2_, lean._LEAN_REFERENCE[STAGE2]):
        args = _stage2_args(clone_args(list(lists)), ones, noop=noop, device=device)
        run(*args)
        _assert_same(args, _stage2_args(before, ones, noop=noop, device=device))


@pytest.mark.parametrize("device", DEVICES)
def test_empty_lists(device):
    _kernel_or_skip(device)
    empty = tuple([] for _ in range(7))
    pn, un = torch.ops.amp_patch.multi_tensor_lamb_lean_stage1_(*_stage1_args(empty, device=device))
    assert pn.shape == un.shape == (0,) and pn.device.type == device
    torch.ops.amp_patch.multi_tensor_lamb_lean_stage2_(*_stage2_args(empty, (pn, un),
                                                                     device=device))


def test_as_the_fp32_stages_on_decoded_state():
    """On fp32 state and params the lean stages are the fp32 ones: the same norms to float
    rounding, and, given the same norms, the same moments and params bit for bit.

    The norms are sums of squares taken in pieces of each op's own work split (the lean
    op's 1024-element chunks, the fp32 op's tasks), each piece in fp32 vector lanes: their
    last bits depend on where the pieces end and on the vector width (AVX2 or AVX-512)."""
    lists = _lists(F32, F32, F32)
    fp32 = clone_args(list(lists))
    lean_norms = torch.ops.amp_patch.multi_tensor_lamb_lean_stage1_(
        *_stage1_args(clone_args(list(lists)), step=3))  # writes nothing: _step_both's norms
    got = _step_both(lists, steps=1)
    hyper = {k: v for k, v in LAMB_KW.items()}
    norm, inv = torch.tensor([40.0]), torch.full((1,), 0.5)
    pn, un = ops.multi_tensor_lamb_stage1_(fp32[0], fp32[1], fp32[2], fp32[4], None, inv, norm,
                                           **hyper)
    for a, b in zip(lean_norms, (pn, un)):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=0.0)
    hyper.pop("max_grad_norm"), hyper.pop("grad_averaging")
    ops.multi_tensor_lamb_stage2_(fp32[1], fp32[2], fp32[4], *lean_norms, fp32[6], None,
                                  lr=1e-2, **hyper)
    for k in (1, 2, 4, 6):
        assert_bitwise(got[k], fp32[k])


# ------------------------------------------------------------ errors and registration

def _with(args, index, value):
    args = list(args)
    args[index] = value
    return args


@pytest.mark.parametrize("make,message", [
    (lambda a: _with(a, 2, a[2][:-1]), r"list lengths differ \(grads has 11, exp_avgs has 10\)"),
    (lambda a: _with(a, 1, [a[1][0].double()] + a[1][1:]),
     r"params\[0\] has dtype torch.float64; params are float32, bfloat16 or float16"),
    (lambda a: _with(a, 2, [a[2][0].view(U8)] + a[2][1:]),
     r"exp_avgs\[0\] is uint8, the code of a second moment"),
    (lambda a: _with(a, 3, []), r"exp_avgs\[0\] is torch.int8 but exp_avg_scales is empty"),
], ids=["lengths", "param_dtype", "uint8_first", "no_scales"])
@pytest.mark.parametrize("stage", [STAGE1, STAGE2])
def test_errors_match_reference(stage, make, message):
    lists = _lists()
    args = (_stage1_args(lists) if stage == STAGE1
            else _stage2_args(lists, (torch.zeros(11), torch.zeros(11))))
    for run in (getattr(torch.ops.amp_patch, stage), lean._LEAN_REFERENCE[stage]):
        with pytest.raises(RuntimeError, match=message):
            run(*make(clone_args(args)))


def test_stage2_rejects_norms_of_another_length():
    args = _stage2_args(_lists(), (torch.zeros(3), torch.zeros(11)))
    for run in (torch.ops.amp_patch.multi_tensor_lamb_lean_stage2_, lean._LEAN_REFERENCE[STAGE2]):
        with pytest.raises(RuntimeError, match="param_norms"):
            run(*clone_args(args))


def test_opcheck():
    shapes = [((3, 40), "contiguous"), ((50,), "contiguous")]
    lists = _lists(shapes=shapes, block_size=16)
    torch.library.opcheck(torch.ops.amp_patch.multi_tensor_lamb_lean_stage1_.default,
                          _stage1_args(lists, block_size=16))
    norms = (torch.ones(2), torch.ones(2))
    torch.library.opcheck(torch.ops.amp_patch.multi_tensor_lamb_lean_stage2_.default,
                          _stage2_args(lists, norms, block_size=16))


@pytest.mark.parametrize("param_dtype", [BF16, F16])
def test_half_params_read_as_their_fp32_values(param_dtype):
    """bf16 and fp16 params widen exactly; their norms are the fp32 copies' norms."""
    lists = _lists(param_dtype=param_dtype)
    pn, _ = torch.ops.amp_patch.multi_tensor_lamb_lean_stage1_(*_stage1_args(lists))
    want = torch.stack([p.double().norm() for p in lists[1]]).float()
    torch.testing.assert_close(pn, want, rtol=1e-6, atol=0)


class _PureFp32Stages:
    """torch.ops.amp_patch with LAMB's fp32 stages swapped for their pure-PyTorch references."""

    multi_tensor_lamb_stage1_ = staticmethod(optimizer_ops._lamb_stage1_ref)
    multi_tensor_lamb_stage2_ = staticmethod(optimizer_ops._lamb_stage2_ref)


@pytest.mark.parametrize("codes,param_dtype", [((I8, U8), BF16), ((E4M3, BF16), F32),
                                               ((BF16, BF16), F16)], ids=str)
def test_stages_match_a_pure_pytorch_reference(monkeypatch, codes, param_dtype):
    """The reference bodies call LAMB's fp32 stage ops (compiled where built); with those swapped
    for their pure-PyTorch references the kernels still agree to the bit."""
    monkeypatch.setattr(lean, "_ops", _PureFp32Stages)
    _step_both(_lists(*codes, param_dtype))
