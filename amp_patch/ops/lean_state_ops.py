"""Fused optimizer ops over low-precision state: block-scaled 8-bit or bf16 moments, bf16 params.

The lean counterparts of ``multi_tensor_adam_`` and ``multi_tensor_sgd_``
(:mod:`amp_patch.ops.optimizer_ops`): the same update rules in fp32 arithmetic,
but each state tensor may be stored in a narrow *code* and each param may be a
bf16 tensor stepped directly. One pass per element reads the grad, decodes the
state, updates, encodes the state again and writes the param (and the half
model copy).

**Adam.** The moments are Apex's. The step is the same Adam written for one
division and one square root per element:
``p = p - (m * (lr / bc1)) / (sqrt(v) * (1 / sqrt(bc2)) + eps)``, where AdamW
first multiplies the param by ``1 - lr * weight_decay`` (as torch's AdamW
does). ``lr / bc1`` is the fp32 product of ``lr`` and ``1 / bc1``; ``1 / bc1``,
``1 / sqrt(bc2)`` and ``1 - lr * weight_decay`` are computed in float64 and
rounded to fp32 once. Apex's ``p - lr * ((m / bc1) / (sqrt(v / bc2) + eps) +
weight_decay * p)`` takes three divisions and more multiplications; the two
differ by rounding only (a few ulps of the update), and ``sqrt(v)`` is also
the value the second moment's square-root code stores. SGD is Apex's rule as
is.

**State codes**, chosen by the dtype of each state tensor:

- ``float32``, ``bfloat16``: the value itself (bf16 rounded to nearest even).
- ``int8`` (signed, for first moments and momentum): linear, block-scaled.
  Each block of ``block_size`` consecutive elements of a row keeps ``s``, the
  largest magnitude in it (fp32, in the scales tensor); an element is stored as
  ``q = rne(x * (127 / s))`` clamped to [-127, 127] and read as
  ``q * (s / 127)``.
- ``uint8`` (for second moments, which are never negative): the square root,
  linear, block-scaled. ``s`` is the block's largest ``sqrt(x)``; an element is
  stored as ``q = rne(sqrt(x) * (255 / s))`` clamped to [1, 255] and read as
  ``r * r`` with ``r = q * (s / 255)``. The square root halves the dynamic range
  a block must hold, and the code never reads back 0 in a block that is not all
  zero, so no element's denominator ``sqrt(v) + eps`` collapses to ``eps``.
- ``float8_e4m3fn`` (signed): block-scaled fp8, stored as
  ``e4m3(x * (448 / s))`` (round to nearest even) and read as ``e4m3 * (s / 448)``.

A block whose largest magnitude is 0 stores codes 0 (it reads back zeros); one
whose scale ``s`` or factor is not finite (an inf or NaN in the block, or a
block so small that ``127 / s`` overflows) stores codes 0 and keeps ``s`` as it
is, so a non-finite block reads back NaN (``0 * inf``) or stays NaN: visibly
non-finite.

**Rows and blocks.** A tensor of two or more dimensions is ``size(0)`` rows of
``numel / size(0)`` elements; any other tensor is one row. Blocks never cross
a row, so a block-scaled tensor's scales have shape ``(rows, ceil(row /
block_size))`` and shard along dim 0 with the tensor (FSDP2).

**Params.** A bfloat16 param (a bf16 master, stepped directly) is written with
*stochastic rounding*: the update is computed in fp32 and 16 pseudo-random bits
are added to its low bits before they are cut. The bits are a hash of
``(seed, step, i, e)`` for tensor ``i`` of the call and element ``e``
(:func:`random_bits`), so a run is reproducible, a resumed run continues with
the same bits, and a skipped step (which keeps ``step``) draws nothing.
float32 and float16 params are written rounded to nearest. ``model_params``
receive the param as stored, rounded to nearest to their dtype: the fp32
update (as in the fp32-state ops), or a bf16 master's value, so that a model
is always its master rounded (an fp16 model of bf16 masters holds them exactly
within fp16's range).

``noop`` and ``inv_scale`` are as in every optimizer op: a set ``noop`` writes
nothing at all, codes and scales included.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Sequence

import torch
from torch import Tensor

from amp_patch.ops import optim_reference as ref
from amp_patch.ops._library import _check_rows, _ops, register

__all__ = [
    "BLOCK_SIZE",
    "SCALED_CODES",
    "STATE_DTYPES",
    "multi_tensor_adam_lean_",
    "multi_tensor_sgd_lean_",
    "multi_tensor_lamb_lean_stage1_",
    "multi_tensor_lamb_lean_stage2_",
    "scale_shape",
    "encode",
    "decode",
    "stochastic_round_bf16",
    "random_bits",
]

#: The default number of elements that share one scale.
BLOCK_SIZE = 256

#: State dtypes stored as codes with one fp32 scale per block.
SCALED_CODES = (torch.int8, torch.uint8, torch.float8_e4m3fn)
#: Every dtype a state tensor of these ops may have.
STATE_DTYPES = (torch.float32, torch.bfloat16, *SCALED_CODES)

# The largest code of each block-scaled dtype, as the fp32 constant of its scale factor.
_CODE_MAX = {torch.int8: 127.0, torch.uint8: 255.0, torch.float8_e4m3fn: 448.0}

_LEAN_SCHEMAS = {
    "multi_tensor_adam_lean_": (
        "multi_tensor_adam_lean_(Tensor[] grads, Tensor(a!)[] params, Tensor(b!)[] exp_avgs, "
        "Tensor(c!)[] exp_avg_scales, Tensor(d!)[] exp_avg_sqs, Tensor(e!)[] exp_avg_sq_scales, "
        "Tensor(f!)[] model_params, Tensor? noop, Tensor? inv_scale, float lr, float beta1, "
        "float beta2, float eps, float weight_decay, int step, bool adam_w_mode, "
        "bool bias_correction, int block_size, int seed) -> ()"
    ),
    "multi_tensor_sgd_lean_": (
        "multi_tensor_sgd_lean_(Tensor[] grads, Tensor(a!)[] params, Tensor(b!)[] momentum_buffers, "
        "Tensor(c!)[] momentum_scales, Tensor(d!)[] model_params, Tensor? noop, Tensor? inv_scale, "
        "float lr, float weight_decay, float momentum, float dampening, bool nesterov, "
        "bool first_run, bool wd_after_momentum, int step, int block_size, int seed) -> ()"
    ),
    "multi_tensor_lamb_lean_stage1_": (
        "multi_tensor_lamb_lean_stage1_(Tensor[] grads, Tensor[] params, Tensor[] exp_avgs, "
        "Tensor[] exp_avg_scales, Tensor[] exp_avg_sqs, Tensor[] exp_avg_sq_scales, "
        "Tensor? noop, Tensor? inv_scale, Tensor global_grad_norm, float max_grad_norm, "
        "float beta1, float beta2, float eps, float weight_decay, int step, "
        "bool bias_correction, bool grad_averaging, bool adam_w_mode, bool use_nvlamb, "
        "int block_size) -> (Tensor, Tensor)"
    ),
    "multi_tensor_lamb_lean_stage2_": (
        "multi_tensor_lamb_lean_stage2_(Tensor[] grads, Tensor(a!)[] params, "
        "Tensor(b!)[] exp_avgs, Tensor(c!)[] exp_avg_scales, Tensor(d!)[] exp_avg_sqs, "
        "Tensor(e!)[] exp_avg_sq_scales, Tensor param_norms, Tensor update_norms, "
        "Tensor(f!)[] model_params, Tensor? noop, Tensor? inv_scale, Tensor global_grad_norm, "
        "float max_grad_norm, float lr, float beta1, float beta2, float eps, float weight_decay, "
        "int step, bool bias_correction, bool grad_averaging, bool adam_w_mode, "
        "bool use_nvlamb, int block_size, int seed) -> ()"
    ),
}

#: The lean ops with a compiled CUDA kernel (csrc/cuda/optim_lean.cu).
_CUDA_KERNELS = tuple(_LEAN_SCHEMAS)

_MASK32 = 0xFFFFFFFF
# Odd 32-bit constants of the hash (golden ratio, and murmur3's finaliser).
_K0, _K1, _K2 = 0x9E3779B9, 0x85EBCA6B, 0xC2B2AE35
_PAIR_BIT = 16  # elements e and e ^ 16 share one hash (random_bits)


# --------------------------------------------------------------------------- rows, blocks

def _rows(t: Tensor) -> tuple[int, int]:
    """``(rows, row length)`` of ``t`` as the codes see it."""
    rows = t.shape[0] if t.dim() >= 2 else 1
    return rows, (t.numel() // rows if rows else 0)


def scale_shape(t: Tensor | torch.Size, block_size: int = BLOCK_SIZE) -> tuple[int, int]:
    """The shape of the scales of a block-scaled state tensor shaped like ``t``.

    Args:
        t (Tensor or torch.Size): the state tensor, or its shape.
        block_size (int, optional): elements per block. Default: :data:`BLOCK_SIZE`.

    Returns:
        tuple of int: ``(rows, blocks per row)``.

    Example::

        >>> scale_shape(torch.Size([512, 1000]))
        (512, 4)
        >>> scale_shape(torch.Size([300]))
        (1, 2)
    """
    shape = t.shape if isinstance(t, Tensor) else torch.Size(t)
    rows = shape[0] if len(shape) >= 2 else 1
    numel = shape.numel()
    length = numel // rows if rows else 0
    return rows, -(-length // block_size)


def _blocked(x: Tensor, block_size: int) -> Tensor:
    """fp32 ``x`` as ``(rows, blocks, block_size)``, the last block of each row padded with 0."""
    rows, length = _rows(x)
    nb = -(-length // block_size)
    x = x.reshape(rows, length)
    pad = nb * block_size - length
    if pad:
        x = torch.nn.functional.pad(x, (0, pad))
    return x.reshape(rows, nb, block_size)


def _unblocked(xb: Tensor, like: Tensor) -> Tensor:
    rows, length = _rows(like)
    return xb.reshape(rows, xb.shape[-2] * xb.shape[-1])[:, :length].contiguous().reshape(like.shape)


def _factor(scale: Tensor, numerator: float, denominator: float) -> Tensor:
    """``numerator / denominator`` per block, one fp32 division (the kernels' order)."""
    num = torch.full((), numerator, dtype=torch.float32, device=scale.device)
    den = torch.full((), denominator, dtype=torch.float32, device=scale.device)
    if numerator == 1.0:  # the decode factor s / max: scale is the numerator
        return scale / den
    return num / scale


# --------------------------------------------------------------------------- codes

def encode(x: Tensor, dtype: torch.dtype, block_size: int = BLOCK_SIZE,
           ) -> tuple[Tensor, Tensor | None]:
    """Store fp32 ``x`` in the state code ``dtype``: ``(codes, scales)``.

    Args:
        x (Tensor): fp32 values (any shape).
        dtype (torch.dtype): one of :data:`STATE_DTYPES`.
        block_size (int, optional): elements per block. Default: :data:`BLOCK_SIZE`.

    Returns:
        tuple: the codes (shaped like ``x``) and, for the block-scaled codes, the
        fp32 scales of shape :func:`scale_shape` (else None).

    Example::

        >>> codes, scales = encode(torch.tensor([0.5, -1.0, 0.25]), torch.int8)
        >>> codes, scales
        (tensor([  64, -127,   32], dtype=torch.int8), tensor([[1.]]))
        >>> decode(codes, scales)
        tensor([ 0.5039, -1.0000,  0.2520])
    """
    x = x.float()
    if dtype not in SCALED_CODES:
        if dtype not in STATE_DTYPES:
            raise ValueError(f"state code {dtype} is not one of {STATE_DTYPES}")
        return x.to(dtype), None
    top = _CODE_MAX[dtype]
    xb = _blocked(x, block_size)
    if dtype == torch.uint8:
        xb = ref.sqrt_rn(xb)
    scale = (xb.abs().amax(dim=-1) if xb.numel() else xb.new_zeros(xb.shape[:-1])).contiguous()
    factor = _factor(scale, top, 1.0).unsqueeze(-1)  # top / s
    # An inf scale gives the finite factor 0: the block is as unusable as a NaN one.
    usable = torch.isfinite(factor) & torch.isfinite(scale).unsqueeze(-1)
    y = torch.where(usable, xb * torch.where(usable, factor, 0.0), 0.0)
    if dtype == torch.float8_e4m3fn:
        codes = y.to(torch.float8_e4m3fn)
    else:
        low = 1.0 if dtype == torch.uint8 else -top
        q = torch.round(y).clamp(low, top)
        q = torch.where(usable, q, 0.0)
        codes = q.to(dtype)
    return _unblocked(codes, x), scale


def decode(codes: Tensor, scales: Tensor | None, block_size: int = BLOCK_SIZE) -> Tensor:
    """The fp32 values that ``codes`` (and their ``scales``) stand for; see :func:`encode`.

    Args:
        codes (Tensor): a state tensor of one of :data:`STATE_DTYPES`.
        scales (Tensor, optional): its fp32 scales, for the block-scaled codes.
        block_size (int, optional): elements per block. Default: :data:`BLOCK_SIZE`.

    Returns:
        Tensor: fp32, shaped like ``codes``.

    Example::

        >>> decode(torch.tensor([255, 1], dtype=torch.uint8), torch.tensor([[2.0]]))
        tensor([4.0000e+00, 6.1515e-05])
    """
    if codes.dtype not in SCALED_CODES:
        return codes.float()
    if scales is None:
        raise ValueError(f"{codes.dtype} state needs its scales")
    factor = _factor(scales.float(), 1.0, _CODE_MAX[codes.dtype]).unsqueeze(-1)  # s / top
    y = _blocked(codes.float(), block_size) * factor
    if codes.dtype == torch.uint8:
        y = y * y
    return _unblocked(y, codes)


# --------------------------------------------------------------------------- rounding

def _fmix32(x: Tensor) -> Tensor:
    x = x ^ (x >> 16)
    x = (x * _K1) & _MASK32
    x = x ^ (x >> 13)
    x = (x * _K2) & _MASK32
    return x ^ (x >> 16)


def _tensor_key(seed: int, step: int, index: int) -> int:
    return (seed * _K0 + step * _K1 + index * _K2) & _MASK32


def random_bits(seed: int, step: int, index: int, numel: int,
                device: torch.device | str = "cpu") -> Tensor:
    """The 16 random bits that stochastic rounding adds to each element of tensor ``index``.

    Elements ``e`` and ``e ^ 16`` share one hash
    ``h = fmix32(key ^ ((e & ~16) * 0x9E3779B9 mod 2**32))``: the one with bit 4
    clear takes ``h >> 16``, the other ``h & 0xFFFF``, so that a vectorised
    kernel hashes once for 32 aligned elements. ``key = (seed*0x9E3779B9 +
    step*0x85EBCA6B + index*0xC2B2AE35) mod 2**32``, ``e`` is taken mod
    ``2**32``, and ``fmix32`` is murmur3's 32-bit finaliser: the kernels compute
    the same.

    Args:
        seed (int): the optimizer's rounding seed.
        step (int): the step number.
        index (int): the tensor's position in the op call.
        numel (int): how many elements.
        device (torch.device or str, optional): Default: the CPU.

    Returns:
        Tensor: int64 values in [0, 65536), one per element.

    Example::

        >>> random_bits(0, 1, 0, 4).tolist() == random_bits(0, 1, 0, 4).tolist()
        True
    """
    e = torch.arange(numel, dtype=torch.int64, device=device) & _MASK32
    x = _tensor_key(seed, step, index) ^ (((e & ~_PAIR_BIT) * _K0) & _MASK32)
    h = _fmix32(x)
    return torch.where((e & _PAIR_BIT) != 0, h & 0xFFFF, h >> 16)


def stochastic_round_bf16(x: Tensor, bits: Tensor) -> Tensor:
    """Round fp32 ``x`` to bfloat16, up or down with the probability of its distance.

    ``bits`` (int64 in [0, 65536), one per element of ``x`` in row-major order)
    is added to the low half of the fp32 bit pattern, which is then cut. A
    non-finite value is rounded to nearest.

    Args:
        x (Tensor): fp32 values.
        bits (Tensor): from :func:`random_bits`.

    Returns:
        Tensor: bfloat16, shaped like ``x``.

    Example::

        >>> x = torch.full((4096,), 1.0 + 2.0**-10)   # 1/8 of a bf16 ulp above 1
        >>> y = stochastic_round_bf16(x, random_bits(0, 1, 0, x.numel())).float()
        >>> abs(y.mean().item() - x[0].item()) < 2.0**-12
        True
    """
    flat = x.float().contiguous().reshape(-1)
    u = flat.view(torch.int32).to(torch.int64) & _MASK32
    hi = ((u + bits.reshape(-1)) >> 16) & 0xFFFF
    rounded = hi.to(torch.int32).to(torch.int16).view(torch.bfloat16)
    out = torch.where(torch.isfinite(flat), rounded, flat.to(torch.bfloat16))
    return out.reshape(x.shape)


def _store_param(param: Tensor, p: Tensor, seed: int, step: int, index: int) -> Tensor:
    """The new value of ``param`` (fp32 ``p``) in its dtype: stochastically rounded for a bf16
    param, to nearest for the others."""
    if param.dtype != torch.bfloat16:
        return p.to(param.dtype)
    return stochastic_round_bf16(p, random_bits(seed, step, index, p.numel(), p.device))


def _model_copy(model_params: Sequence[Tensor], i: int, stored: Tensor,
                ) -> list[tuple[Tensor, Tensor]]:
    """The model copy's new value: the param as stored (a bf16 master's own bits), rounded to
    the model's dtype, so that the model is always its master rounded."""
    return [(model_params[i], stored.float())] if model_params else []


# --------------------------------------------------------------------------- checks

def _check_state(op: str, name: str, states: Sequence[Tensor], scale_name: str,
                 scales: Sequence[Tensor], block_size: int) -> None:
    if scales and len(scales) != len(states):
        raise RuntimeError(f"amp_patch::{op}: {scale_name} has {len(scales)} tensors for "
                           f"{len(states)} {name} (give one per tensor, or none)")
    for i, t in enumerate(states):
        if t.dtype not in STATE_DTYPES:
            raise RuntimeError(f"amp_patch::{op}: {name}[{i}] has dtype {t.dtype}; state codes "
                               f"are {', '.join(str(d) for d in STATE_DTYPES)}")
        if t.dtype == torch.uint8 and name != "exp_avg_sqs":
            raise RuntimeError(f"amp_patch::{op}: {name}[{i}] is uint8, the code of a second "
                               "moment (never negative); signed state takes int8")
        if t.dtype not in SCALED_CODES:
            continue
        if not scales:
            raise RuntimeError(f"amp_patch::{op}: {name}[{i}] is {t.dtype} but {scale_name} "
                               "is empty")
        s = scales[i]
        want = scale_shape(t, block_size)
        if s.dtype != torch.float32 or tuple(s.shape) != want:
            raise RuntimeError(f"amp_patch::{op}: {scale_name}[{i}] must be float32 of shape "
                               f"{want} for block_size {block_size}, got {s.dtype} "
                               f"{tuple(s.shape)}")
        if not (t.is_contiguous() and s.is_contiguous()):
            raise RuntimeError(f"amp_patch::{op}: {name}[{i}] and its scales must be contiguous")


def _check_common(op: str, params: Sequence[Tensor], block_size: int) -> None:
    if block_size < 1:
        raise RuntimeError(f"amp_patch::{op}: block_size must be positive, got {block_size}")
    for i, p in enumerate(params):
        if p.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise RuntimeError(f"amp_patch::{op}: params[{i}] has dtype {p.dtype}; params are "
                               "float32, bfloat16 or float16")


def _scale_pairs(states: Sequence[Tensor], scales: Sequence[Tensor], i: int,
                 codes: Tensor, new_scale: Tensor | None) -> list[tuple[Tensor, Tensor]]:
    out = [(states[i], codes)]
    if new_scale is not None:
        out.append((scales[i], new_scale))
    return out


def _scale_of(states: Sequence[Tensor], scales: Sequence[Tensor], i: int) -> Tensor | None:
    return scales[i] if states[i].dtype in SCALED_CODES else None


# --------------------------------------------------------------------------- reference bodies

def _check_moment_lists(op, grads, params, exp_avgs, exp_avg_scales, exp_avg_sqs,
                        exp_avg_sq_scales, model_params, block_size) -> None:
    """The checks of the ops over Adam's two moments (Adam, LAMB's stages), in their order."""
    _check_rows(op, grads=grads, params=params, exp_avgs=exp_avgs, exp_avg_sqs=exp_avg_sqs,
                model_params=model_params or None)
    _check_common(op, params, block_size)
    _check_state(op, "exp_avgs", exp_avgs, "exp_avg_scales", exp_avg_scales, block_size)
    _check_state(op, "exp_avg_sqs", exp_avg_sqs, "exp_avg_sq_scales", exp_avg_sq_scales,
                 block_size)


def _lean_constants(b1: float, b2: float, step: int, enabled: bool, lr: float,
                    wd: float) -> tuple[float, float, float]:
    """The lean Adam's ``lr / bc1``, ``1 / sqrt(bc2)`` and ``1 - lr * wd`` as the kernels round
    them (see the module's "Adam"); ``lr`` and ``wd`` are fp32 values already."""
    inv_bc1, inv_sqrt_bc2 = 1.0, 1.0
    if enabled:
        inv_bc1 = ref.f32(1.0 / (1.0 - b1 ** step))
        inv_sqrt_bc2 = ref.f32(1.0 / math.sqrt(1.0 - b2 ** step))
    return ref.f32(lr * inv_bc1), inv_sqrt_bc2, ref.f32(1.0 - lr * wd)


def _adam_lean_param(p: Tensor, m: Tensor, v: Tensor, step_size: float, inv_sqrt_bc2: float,
                     eps: float, decay: float | None) -> Tensor:
    """The lean Adam's param ``p * decay - (m * step_size) / (sqrt(v) * inv_sqrt_bc2 + eps)``
    (no ``decay`` factor when None): one division and one square root per element."""
    step = (m * step_size) / (ref.sqrt_rn(v) * inv_sqrt_bc2 + eps)
    if decay is not None:
        p = p * decay
    return p - step


def _adam_lean_ref(grads, params, exp_avgs, exp_avg_scales, exp_avg_sqs, exp_avg_sq_scales,
                   model_params, noop, inv_scale, lr, beta1, beta2, eps, weight_decay, step,
                   adam_w_mode, bias_correction, block_size, seed) -> None:
    _check_moment_lists("multi_tensor_adam_lean_", grads, params, exp_avgs, exp_avg_scales,
                        exp_avg_sqs, exp_avg_sq_scales, model_params, block_size)
    skip = ref.skip_mask(noop)
    b1, b2, c1, c2, _, _, lr, eps, wd = ref.adam_constants(
        beta1, beta2, lr, eps, weight_decay, step, bias_correction)
    step_size, inv_sqrt_bc2, decay = _lean_constants(b1, b2, step, bias_correction, lr, wd)
    decoupled = decay if adam_w_mode and wd != 0.0 else None
    for i, grad in enumerate(grads):
        if grad.numel() == 0:
            continue
        p = params[i].float()
        m = decode(exp_avgs[i], _scale_of(exp_avgs, exp_avg_scales, i), block_size)
        v = decode(exp_avg_sqs[i], _scale_of(exp_avg_sqs, exp_avg_sq_scales, i), block_size)
        m, v = ref.adam_new_moments(ref.grad32(grad, inv_scale), p, m, v, b1, b2, c1, c2, wd,
                                    adam_w_mode)
        p = _adam_lean_param(p, m, v, step_size, inv_sqrt_bc2, eps, decoupled)
        m_codes, m_scale = encode(m, exp_avgs[i].dtype, block_size)
        v_codes, v_scale = encode(v, exp_avg_sqs[i].dtype, block_size)
        stored = _store_param(params[i], p, seed, step, i)
        ref.commit(skip, (params[i], stored),
                   *_scale_pairs(exp_avgs, exp_avg_scales, i, m_codes, m_scale),
                   *_scale_pairs(exp_avg_sqs, exp_avg_sq_scales, i, v_codes, v_scale),
                   *_model_copy(model_params, i, stored))


def _sgd_lean_ref(grads, params, momentum_buffers, momentum_scales, model_params, noop,
                  inv_scale, lr, weight_decay, momentum, dampening, nesterov, first_run,
                  wd_after_momentum, step, block_size, seed) -> None:
    op = "multi_tensor_sgd_lean_"
    ref.check_sgd_lists(op, grads, params, momentum_buffers, model_params, momentum)
    _check_common(op, params, block_size)
    if momentum != 0.0:
        _check_state(op, "momentum_buffers", momentum_buffers, "momentum_scales",
                     momentum_scales, block_size)
    skip = ref.skip_mask(noop)
    lr, wd, mu = ref.f32(lr), ref.f32(weight_decay), ref.f32(momentum)
    c_damp = ref.one_minus(ref.f32(dampening))
    for i, grad in enumerate(grads):
        if grad.numel() == 0:
            continue
        def old(i: int = i) -> Tensor:
            scales = _scale_of(momentum_buffers, momentum_scales, i)
            return decode(momentum_buffers[i], scales, block_size)

        p, buf = ref.sgd_update(ref.grad32(grad, inv_scale), params[i].float(), old, lr, wd, mu,
                                c_damp, nesterov, first_run, wd_after_momentum)
        state: list[tuple[Tensor, Tensor]] = []
        if buf is not None:
            codes, scale = encode(buf, momentum_buffers[i].dtype, block_size)
            state = _scale_pairs(momentum_buffers, momentum_scales, i, codes, scale)
        stored = _store_param(params[i], p, seed, step, i)
        ref.commit(skip, (params[i], stored), *state, *_model_copy(model_params, i, stored))


def _lamb_lean_inputs(i, params, exp_avgs, exp_avg_scales, exp_avg_sqs, exp_avg_sq_scales,
                      block_size) -> tuple[Tensor, Tensor, Tensor]:
    """fp32 copies of param ``i`` and of its decoded moments: what LAMB's fp32 stages step.
    One tensor at a time, so that the copies never hold more than one tensor's state."""
    def copy(states: Sequence[Tensor], scales: Sequence[Tensor]) -> Tensor:
        t = states[i]
        if t.numel() == 0:
            return torch.empty(t.shape, device=t.device)
        return decode(t, _scale_of(states, scales, i), block_size).to(torch.float32, copy=True)

    return (params[i].to(torch.float32, copy=True), copy(exp_avgs, exp_avg_scales),
            copy(exp_avg_sqs, exp_avg_sq_scales))


def _lamb_lean_stage1_ref(grads, params, exp_avgs, exp_avg_scales, exp_avg_sqs,
                          exp_avg_sq_scales, noop, inv_scale, global_grad_norm, max_grad_norm,
                          beta1, beta2, eps, weight_decay, step, bias_correction, grad_averaging,
                          adam_w_mode, use_nvlamb, block_size) -> tuple[Tensor, Tensor]:
    _check_moment_lists("multi_tensor_lamb_lean_stage1_", grads, params, exp_avgs,
                        exp_avg_scales, exp_avg_sqs, exp_avg_sq_scales, [], block_size)
    rule = (noop, inv_scale, global_grad_norm, max_grad_norm, beta1, beta2, eps, weight_decay,
            step, bias_correction, grad_averaging, adam_w_mode, use_nvlamb)
    if not grads:
        return _ops.multi_tensor_lamb_stage1_([], [], [], [], *rule)
    norms = []
    for i, grad in enumerate(grads):
        p, m, v = _lamb_lean_inputs(i, params, exp_avgs, exp_avg_scales, exp_avg_sqs,
                                    exp_avg_sq_scales, block_size)
        norms.append(_ops.multi_tensor_lamb_stage1_([grad], [p], [m], [v], *rule))
    return torch.cat([n[0] for n in norms]), torch.cat([n[1] for n in norms])


def _lamb_lean_stage2_ref(grads, params, exp_avgs, exp_avg_scales, exp_avg_sqs,
                          exp_avg_sq_scales, param_norms, update_norms, model_params, noop,
                          inv_scale, global_grad_norm, max_grad_norm, lr, beta1, beta2, eps,
                          weight_decay, step, bias_correction, grad_averaging, adam_w_mode,
                          use_nvlamb, block_size, seed) -> None:
    op = "multi_tensor_lamb_lean_stage2_"
    _check_moment_lists(op, grads, params, exp_avgs, exp_avg_scales, exp_avg_sqs,
                        exp_avg_sq_scales, model_params, block_size)
    for name, t in (("param_norms", param_norms), ("update_norms", update_norms)):
        if t.shape != (len(params),):
            raise RuntimeError(f"amp_patch::{op}: {name} must have one element per tensor "
                               f"({len(params)}), got shape {tuple(t.shape)}")
    skip = ref.skip_mask(noop)
    for i, grad in enumerate(grads):
        if grad.numel() == 0:
            continue
        p, m, v = _lamb_lean_inputs(i, params, exp_avgs, exp_avg_scales, exp_avg_sqs,
                                    exp_avg_sq_scales, block_size)
        # Stage 1's moments again (the same bits), then stage 2's step along them.
        _ops.multi_tensor_lamb_stage1_([grad], [p], [m], [v], None, inv_scale, global_grad_norm,
                                       max_grad_norm, beta1, beta2, eps, weight_decay, step,
                                       bias_correction, grad_averaging, adam_w_mode, use_nvlamb)
        _ops.multi_tensor_lamb_stage2_([p], [m], [v], param_norms[i:i + 1],
                                       update_norms[i:i + 1], [], None, lr, beta1, beta2, eps,
                                       weight_decay, step, bias_correction, adam_w_mode,
                                       use_nvlamb)
        m_codes, m_scale = encode(m, exp_avgs[i].dtype, block_size)
        v_codes, v_scale = encode(v, exp_avg_sqs[i].dtype, block_size)
        stored = _store_param(params[i], p, seed, step, i)
        ref.commit(skip, (params[i], stored),
                   *_scale_pairs(exp_avgs, exp_avg_scales, i, m_codes, m_scale),
                   *_scale_pairs(exp_avg_sqs, exp_avg_sq_scales, i, v_codes, v_scale),
                   *_model_copy(model_params, i, stored))


_LEAN_REFERENCE: dict[str, Callable[..., Any]] = {
    "multi_tensor_adam_lean_": _adam_lean_ref,
    "multi_tensor_sgd_lean_": _sgd_lean_ref,
    "multi_tensor_lamb_lean_stage1_": _lamb_lean_stage1_ref,
    "multi_tensor_lamb_lean_stage2_": _lamb_lean_stage2_ref,
}
register(_LEAN_SCHEMAS, _LEAN_REFERENCE, {"multi_tensor_lamb_lean_stage1_": ref.lamb_norms_fake})


# --------------------------------------------------------------------------- public wrappers

def multi_tensor_adam_lean_(
    grads: list[Tensor], params: list[Tensor], exp_avgs: list[Tensor],
    exp_avg_scales: list[Tensor], exp_avg_sqs: list[Tensor], exp_avg_sq_scales: list[Tensor],
    model_params: list[Tensor], noop: Tensor | None, inv_scale: Tensor | None, *, lr: float,
    beta1: float, beta2: float, eps: float, weight_decay: float, step: int,
    adam_w_mode: bool = True, bias_correction: bool = True, block_size: int = BLOCK_SIZE,
    seed: int = 0,
) -> None:
    """One Adam / AdamW step with low-precision moments and params, in one pass.

    The arithmetic is :func:`~amp_patch.ops.multi_tensor_adam_`'s, on the
    moments decoded to fp32; the new moments are encoded again (see the
    module's text for the codes) and a bf16 param is written with stochastic
    rounding.

    Args:
        grads (list of Tensor): gradients (fp32, fp16 or bf16), read only.
        params (list of Tensor): fp32 params or masters, or bf16 params (stochastic
            rounding), updated in place.
        exp_avgs (list of Tensor): first moments: float32, bfloat16, int8 or
            float8_e4m3fn codes, updated in place.
        exp_avg_scales (list of Tensor): the fp32 block scales of the block-scaled
            ``exp_avgs`` (one per tensor), or empty when none is block-scaled.
        exp_avg_sqs (list of Tensor): second moments: float32, bfloat16, uint8
            (square-root code) or float8_e4m3fn codes, updated in place.
        exp_avg_sq_scales (list of Tensor): their block scales, or empty.
        model_params (list of Tensor): empty, or the half model copies to write.
        noop (Tensor, optional): one-element flag; non-zero skips the whole step.
        inv_scale (Tensor, optional): one-element fp32 multiplier of the grads.
        lr (float): learning rate.
        beta1 (float): first-moment decay.
        beta2 (float): second-moment decay.
        eps (float): added to the denominator.
        weight_decay (float): weight decay.
        step (int): the step number, from 1 (bias corrections, rounding bits).
        adam_w_mode (bool, optional): decoupled weight decay. Default: True.
        bias_correction (bool, optional): Default: True.
        block_size (int, optional): elements per scale. Default: 256.
        seed (int, optional): the stochastic rounding seed. Default: 0.

    Example::

        >>> p = [torch.randn(64, 512)]
        >>> m, sm = encode(torch.zeros(64, 512), torch.int8)
        >>> v, sv = encode(torch.zeros(64, 512), torch.uint8)
        >>> multi_tensor_adam_lean_([torch.randn(64, 512)], p, [m], [sm], [v], [sv], [], None,
        ...     None, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, step=1)
        >>> sm[0].shape
        torch.Size([2])
    """
    _ops.multi_tensor_adam_lean_(grads, params, exp_avgs, exp_avg_scales, exp_avg_sqs,
                                 exp_avg_sq_scales, model_params, noop, inv_scale, lr, beta1,
                                 beta2, eps, weight_decay, step, adam_w_mode, bias_correction,
                                 block_size, seed)


def multi_tensor_sgd_lean_(
    grads: list[Tensor], params: list[Tensor], momentum_buffers: list[Tensor],
    momentum_scales: list[Tensor], model_params: list[Tensor], noop: Tensor | None,
    inv_scale: Tensor | None, *, lr: float, weight_decay: float = 0.0, momentum: float = 0.0,
    dampening: float = 0.0, nesterov: bool = False, first_run: bool = False,
    wd_after_momentum: bool = False, step: int = 1, block_size: int = BLOCK_SIZE, seed: int = 0,
) -> None:
    """One SGD step (Apex's momentum rule) with a low-precision momentum buffer and params.

    The arithmetic is :func:`~amp_patch.ops.multi_tensor_sgd_`'s on the decoded
    buffer; the buffer is encoded again (float32, bfloat16, int8 or
    float8_e4m3fn) and a bf16 param is written with stochastic rounding.

    Args:
        grads (list of Tensor): gradients, read only.
        params (list of Tensor): fp32 params or masters, or bf16 params.
        momentum_buffers (list of Tensor): one per param when ``momentum != 0``.
        momentum_scales (list of Tensor): the block scales of block-scaled buffers, or empty.
        model_params (list of Tensor): empty, or the half copies to write.
        noop (Tensor, optional): non-zero skips the whole step.
        inv_scale (Tensor, optional): one-element fp32 multiplier of the grads.
        lr (float): learning rate.
        weight_decay (float, optional): Default: 0.
        momentum (float, optional): Default: 0.
        dampening (float, optional): Default: 0.
        nesterov (bool, optional): Default: False.
        first_run (bool, optional): the buffers are new: set them to the grad. Default: False.
        wd_after_momentum (bool, optional): Default: False.
        step (int, optional): the step number (the rounding bits). Default: 1.
        block_size (int, optional): elements per scale. Default: 256.
        seed (int, optional): the stochastic rounding seed. Default: 0.

    Example::

        >>> p = [torch.ones(8, 300, dtype=torch.bfloat16)]
        >>> buf, scale = encode(torch.zeros(8, 300), torch.int8)
        >>> multi_tensor_sgd_lean_([torch.ones(8, 300)], p, [buf], [scale], [], None, None,
        ...                        lr=0.1, momentum=0.9, first_run=True)
        >>> round(p[0].float().mean().item(), 2)   # 0.9 on average: stochastic rounding
        0.9
    """
    _ops.multi_tensor_sgd_lean_(grads, params, momentum_buffers, momentum_scales, model_params,
                                noop, inv_scale, lr, weight_decay, momentum, dampening, nesterov,
                                first_run, wd_after_momentum, step, block_size, seed)


def multi_tensor_lamb_lean_stage1_(
    grads: list[Tensor], params: list[Tensor], exp_avgs: list[Tensor],
    exp_avg_scales: list[Tensor], exp_avg_sqs: list[Tensor], exp_avg_sq_scales: list[Tensor],
    noop: Tensor | None, inv_scale: Tensor | None, global_grad_norm: Tensor, *,
    max_grad_norm: float, beta1: float, beta2: float, eps: float, weight_decay: float,
    step: int, bias_correction: bool = True, grad_averaging: bool = True,
    adam_w_mode: bool = True, use_nvlamb: bool = False, block_size: int = BLOCK_SIZE,
) -> tuple[Tensor, Tensor]:
    """LAMB's first stage over low-precision moments: each tensor's ``||p||`` and ``||u||``.

    The moments are decoded and updated as
    :func:`~amp_patch.ops.multi_tensor_lamb_stage1_` updates fp32 ones, but
    nothing is written: :func:`multi_tensor_lamb_lean_stage2_` computes the
    same new moments again (the same bits), so no fp32 copy of them outlives
    the call.

    Args:
        grads (list of Tensor): gradients (fp32, fp16 or bf16), read only.
        params (list of Tensor): fp32, bf16 or fp16 params, read only.
        exp_avgs (list of Tensor): first moments in their codes (see the module's text).
        exp_avg_scales (list of Tensor): their block scales, or empty.
        exp_avg_sqs (list of Tensor): second moments in their codes.
        exp_avg_sq_scales (list of Tensor): their block scales, or empty.
        noop (Tensor, optional): non-zero skips the step (the norms are then 0).
        inv_scale (Tensor, optional): one-element fp32 multiplier of the grads.
        global_grad_norm (Tensor): one-element norm of every grad, for clipping.
        max_grad_norm (float): clipping threshold; 0 turns clipping off.
        beta1 (float): first-moment decay.
        beta2 (float): second-moment decay.
        eps (float): added to the denominator.
        weight_decay (float): weight decay.
        step (int): the step number, from 1.
        bias_correction (bool, optional): Default: True.
        grad_averaging (bool, optional): Default: True.
        adam_w_mode (bool, optional): decoupled weight decay. Default: True.
        use_nvlamb (bool, optional): the trust ratio for every tensor. Default: False.
        block_size (int, optional): elements per scale. Default: 256.

    Returns:
        tuple of Tensor: ``(param_norms, update_norms)``, fp32, one element per tensor.

    Example::

        >>> g, p = [torch.ones(4, 256)], [torch.ones(4, 256)]
        >>> m, sm = encode(torch.zeros(4, 256), torch.int8)
        >>> v, sv = encode(torch.zeros(4, 256), torch.uint8)
        >>> pn, un = multi_tensor_lamb_lean_stage1_(g, p, [m], [sm], [v], [sv], None, None,
        ...     torch.tensor([32.0]), max_grad_norm=0.0, beta1=0.9, beta2=0.999, eps=1e-6,
        ...     weight_decay=0.01, step=1)
        >>> round(pn.item(), 3)
        32.0
    """
    return _ops.multi_tensor_lamb_lean_stage1_(
        grads, params, exp_avgs, exp_avg_scales, exp_avg_sqs, exp_avg_sq_scales, noop, inv_scale,
        global_grad_norm, max_grad_norm, beta1, beta2, eps, weight_decay, step, bias_correction,
        grad_averaging, adam_w_mode, use_nvlamb, block_size)


def multi_tensor_lamb_lean_stage2_(
    grads: list[Tensor], params: list[Tensor], exp_avgs: list[Tensor],
    exp_avg_scales: list[Tensor], exp_avg_sqs: list[Tensor], exp_avg_sq_scales: list[Tensor],
    param_norms: Tensor, update_norms: Tensor, model_params: list[Tensor], noop: Tensor | None,
    inv_scale: Tensor | None, global_grad_norm: Tensor, *, max_grad_norm: float, lr: float,
    beta1: float, beta2: float, eps: float, weight_decay: float, step: int,
    bias_correction: bool = True, grad_averaging: bool = True, adam_w_mode: bool = True,
    use_nvlamb: bool = False, block_size: int = BLOCK_SIZE, seed: int = 0,
) -> None:
    """LAMB's second stage over low-precision moments: the step, and the moments encoded again.

    Computes stage 1's new moments again from the same inputs, steps each param
    along its update scaled by its trust ratio (from ``param_norms`` and
    ``update_norms``, as :func:`~amp_patch.ops.multi_tensor_lamb_stage2_`),
    encodes the moments and writes the param (stochastically rounded when it
    is bf16) and the model copy. Take the arguments of stage 1 unchanged, and
    its norms (summed over the shards of a sharded tensor).

    Args:
        grads (list of Tensor): gradients, read only.
        params (list of Tensor): fp32, bf16 or fp16 params, updated in place.
        exp_avgs (list of Tensor): first moments in their codes, updated in place.
        exp_avg_scales (list of Tensor): their block scales, or empty.
        exp_avg_sqs (list of Tensor): second moments in their codes, updated in place.
        exp_avg_sq_scales (list of Tensor): their block scales, or empty.
        param_norms (Tensor): ``||p||`` per tensor, from stage 1.
        update_norms (Tensor): ``||u||`` per tensor, from stage 1.
        model_params (list of Tensor): empty, or the half model copies to write.
        noop (Tensor, optional): non-zero skips the whole step.
        inv_scale (Tensor, optional): one-element fp32 multiplier of the grads.
        global_grad_norm (Tensor): one-element norm of every grad, for clipping.
        max_grad_norm (float): clipping threshold; 0 turns clipping off.
        lr (float): learning rate.
        beta1 (float): first-moment decay.
        beta2 (float): second-moment decay.
        eps (float): added to the denominator.
        weight_decay (float): weight decay.
        step (int): the step number, from 1 (bias corrections, rounding bits).
        bias_correction (bool, optional): Default: True.
        grad_averaging (bool, optional): Default: True.
        adam_w_mode (bool, optional): decoupled weight decay. Default: True.
        use_nvlamb (bool, optional): the trust ratio for every tensor. Default: False.
        block_size (int, optional): elements per scale. Default: 256.
        seed (int, optional): the stochastic rounding seed. Default: 0.

    Example::

        >>> g, p = [torch.ones(4, 256)], [torch.ones(4, 256)]
        >>> m, sm = encode(torch.zeros(4, 256), torch.int8)
        >>> v, sv = encode(torch.zeros(4, 256), torch.uint8)
        >>> hyper = dict(max_grad_norm=0.0, beta1=0.9, beta2=0.999, eps=1e-6,
        ...              weight_decay=0.01, step=1)
        >>> norm = torch.tensor([32.0])
        >>> pn, un = multi_tensor_lamb_lean_stage1_(g, p, [m], [sm], [v], [sv], None, None,
        ...                                         norm, **hyper)
        >>> multi_tensor_lamb_lean_stage2_(g, p, [m], [sm], [v], [sv], pn, un, [], None, None,
        ...                                norm, lr=0.01, **hyper)
        >>> round(p[0][0, 0].item(), 4)   # 1 - lr * ||p|| / ||u|| * u, u = 1 + 0.01
        0.99
        >>> m[0, :3].tolist(), round(sm[0, 0].item(), 6)   # m = 0.1 * grad: codes 127, scale 0.1
        ([127, 127, 127], 0.1)
    """
    _ops.multi_tensor_lamb_lean_stage2_(
        grads, params, exp_avgs, exp_avg_scales, exp_avg_sqs, exp_avg_sq_scales, param_norms,
        update_norms, model_params, noop, inv_scale, global_grad_norm, max_grad_norm, lr, beta1,
        beta2, eps, weight_decay, step, bias_correction, grad_averaging, adam_w_mode, use_nvlamb,
        block_size, seed)
