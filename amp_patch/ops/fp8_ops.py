"""FP8 GEMMs: the formats, the scaling maths, a reference body, ``torch._scaled_mm`` and an FP8 linear.

Two FP8 formats serve training. E4M3 (``torch.float8_e4m3fn``: 3 mantissa bits,
largest finite 448, no inf) holds activations and weights; E5M2
(``torch.float8_e5m2``: 2 mantissa bits, largest finite 57344) holds gradients,
whose range is wider. :class:`Fp8Format` names the two pairings: ``HYBRID``
(E4M3 forward, E5M2 backward) and ``E4M3`` everywhere.

A tensor is cast as ``codes = saturate(x * scale)`` and read back as
``codes * scale_inv``. The scale comes from an amax (the largest magnitude):
``scale = fp8_max / amax / 2**margin``, kept at its previous value when the amax
is 0 or not finite (:func:`scale_from_amax`). Three ways of choosing the amax:

- **current (tensorwise)**: the tensor's own amax, one scale per tensor
  (:func:`quantize_tensorwise`);
- **delayed**: the largest (``"max"``) or the newest (``"most_recent"``) amax of
  a history of past iterations, which :func:`update_amax_history_` rolls once
  per step;
- **rowwise**: one scale per row of the first GEMM operand, shape ``(M, 1)``,
  and one per column of the second, ``(1, N)`` (:func:`quantize_rowwise`).

The GEMM runs through ``torch._scaled_mm`` (:func:`fp8_gemm`): fp32 scales,
fp32 accumulation, bf16/fp16/fp32 output. The reference body
(:func:`fp8_gemm_reference`: dequantize to fp32, matmul in fp32, round once) is
the emulation path and what the fast path is tested against; on torch 2.13's CPU
the two agree bitwise, on CUDA to about ``2**-13 (|A| @ |B|)``. CUDA's rules for ``_scaled_mm`` are checked here on every device
(:func:`check_scaled_mm_args`), because the CPU kernel accepts any layout and
would let a breach through to the first GPU run.

.. note::
    The cast saturates: a finite value beyond the format's max becomes the max,
    and so does an inf (E4M3 has none; E5M2's inf is clamped here too, so both
    formats saturate alike). An overflow that the loss scaler must see would
    vanish in the cast. So the amax, taken before it, travels with the codes: a
    non-finite amax makes the dequantization scale (``scale_inv``) NaN, and the
    GEMM's output (forward) or gradient (backward) with it. A NaN input stays NaN
    in both formats.

.. note::
    Nothing here reads a device value on the host: scales, amaxes and the
    history are device tensors updated in place, and :func:`fp8_linear` runs
    under ``torch.compile(fullgraph=True)``.
"""

from __future__ import annotations

import enum
import logging
from typing import Any, Literal, NamedTuple

import torch
from torch import Tensor

__all__ = [
    "E4M3",
    "E5M2",
    "FP8_MAX",
    "Fp8Format",
    "Fp8Tensor",
    "Fp8LinearState",
    "SCALED_MM_SIGNATURE",
    "fp8_max",
    "amax",
    "scale_from_amax",
    "update_amax_history_",
    "quantize",
    "quantize_tensorwise",
    "quantize_rowwise",
    "dequantize",
    "check_scaled_mm_args",
    "fp8_gemm_available",
    "require_fp8_gemm",
    "fp8_gemm",
    "fp8_gemm_reference",
    "quantize_weight",
    "fp8_linear",
]

logger = logging.getLogger("amp_patch")

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2

#: The largest finite value of each FP8 format.
FP8_MAX: dict[torch.dtype, float] = {E4M3: 448.0, E5M2: 57344.0}

#: The GEMM dims that CUDA's ``_scaled_mm`` wants to be multiples of.
_DIM_MULTIPLE = 16
_OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_HISTORY_ALGOS = ("max", "most_recent")


class Fp8Format(enum.Enum):
    """Which FP8 format holds which tensor.

    Example::

        >>> Fp8Format.HYBRID.forward_dtype, Fp8Format.HYBRID.backward_dtype
        (torch.float8_e4m3fn, torch.float8_e5m2)
        >>> Fp8Format("e4m3").backward_dtype
        torch.float8_e4m3fn
    """

    #: E4M3 for activations and weights, E5M2 for gradients.
    HYBRID = "hybrid"
    #: E4M3 for all three.
    E4M3 = "e4m3"

    @property
    def forward_dtype(self) -> torch.dtype:
        """The dtype of activations and weights."""
        return E4M3

    @property
    def backward_dtype(self) -> torch.dtype:
        """The dtype of the output gradient."""
        return E5M2 if self is Fp8Format.HYBRID else E4M3


class Fp8Tensor(NamedTuple):
    """FP8 codes and the fp32 factor that reads them back: ``value = data * scale_inv``.

    ``scale_inv`` has one element (tensorwise), or shape ``(M, 1)`` / ``(1, N)``
    (rowwise) for a 2-D ``data`` of shape ``(M, N)``. It is NaN where the
    quantized values had an inf or NaN (see the module's note).
    """

    data: Tensor
    scale_inv: Tensor

    def t(self) -> Fp8Tensor:
        """The transpose, as a view (rowwise scales transposed with it)."""
        s = self.scale_inv
        if s.dim() == 2:
            # (M, 1) <-> (1, M) with unit strides: a plain .t() would give the new
            # size-1 dim a stride of M, which _scaled_mm refuses.
            s = s.reshape(-1).reshape(s.shape[1], s.shape[0])
        return Fp8Tensor(self.data.t(), s)


def fp8_max(dtype: torch.dtype) -> float:
    """The largest finite value of an FP8 dtype.

    Example::

        >>> fp8_max(torch.float8_e4m3fn), fp8_max(torch.float8_e5m2)
        (448.0, 57344.0)
    """
    try:
        return FP8_MAX[dtype]
    except KeyError:
        raise TypeError(f"{dtype} is not an FP8 format amp_patch uses "
                        f"(torch.float8_e4m3fn or torch.float8_e5m2)") from None


def amax(x: Tensor, dim: int | None = None) -> Tensor:
    """The largest magnitude of ``x`` in fp32, NaN if ``x`` holds a NaN, inf if it holds an inf.

    Args:
        x (Tensor): any floating tensor.
        dim (int, optional): reduce over this dim only, keeping it (size 1);
            default: over all elements, to a 0-dim tensor.

    Returns:
        Tensor: fp32; zeros where the reduced extent is empty.

    Example::

        >>> amax(torch.tensor([1.0, -3.0, 2.0]))
        tensor(3.)
        >>> amax(torch.tensor([[1.0, float("inf")], [2.0, 0.5]]), dim=1).flatten()
        tensor([inf, 2.])
    """
    if x.numel() == 0:
        shape: list[int] = [] if dim is None else list(x.shape)
        if dim is not None:
            shape[dim] = 1
        return torch.zeros(shape, dtype=torch.float32, device=x.device)
    a = x.abs()
    a = a.amax() if dim is None else a.amax(dim=dim, keepdim=True)
    return a.float()


def scale_from_amax(amax: Tensor, dtype: torch.dtype, margin: int = 0,
                    previous: Tensor | None = None) -> Tensor:
    """``fp8_max / amax / 2**margin``, or ``previous`` where that is no usable scale.

    The amax is no guide where it is 0 (an all-zero tensor: any scale casts it
    exactly) or not finite (an overflow: the scale must not collapse to 0 or
    turn NaN), nor where the quotient overflows fp32 (an amax in fp32's
    subnormals). There the previous scale stays; without one, 1.0.

    Args:
        amax (Tensor): fp32, any shape.
        dtype (torch.dtype): the FP8 format.
        margin (int, optional): powers of two of headroom below the format's max.
        previous (Tensor, optional): the scale to keep, broadcastable to ``amax``.

    Returns:
        Tensor: fp32, ``amax``'s shape.

    Example::

        >>> scale_from_amax(torch.tensor([2.0, 0.0, float("inf")]), torch.float8_e4m3fn, margin=1,
        ...                 previous=torch.tensor(5.0))
        tensor([112.,   5.,   5.])
    """
    amax = amax.float()
    sf = (fp8_max(dtype) / amax) / float(2 ** margin)
    keep = torch.ones((), dtype=torch.float32, device=amax.device) if previous is None \
        else previous.float()
    usable = (amax > 0) & torch.isfinite(amax) & torch.isfinite(sf)
    return torch.where(usable, sf, keep)


def update_amax_history_(history: Tensor, scale: Tensor, dtype: torch.dtype, margin: int = 0,
                         algo: Literal["max", "most_recent"] = "max") -> Tensor:
    """The delayed recipe's step: a new ``scale`` from the history, then the history rolled.

    ``history`` has shape ``(length, *scale.shape)``. Row 0 is the slot the
    current iteration records its amax into; the rows after it hold the past
    iterations, the newest last. The step:

    1. takes the amax: the largest over all rows (``"max"``), or row 0's
       (``"most_recent"``);
    2. writes :func:`scale_from_amax` of it into ``scale`` (the previous scale
       stays where the amax is 0 or not finite);
    3. rolls the history by one row toward the front, so that row 0's amax
       becomes the newest past entry (the last row), and clears row 0 for the
       next iteration. The oldest entry, row 1, drops out.

    All in place on the device, with no host read.

    Args:
        history (Tensor): fp32 amax history, ``(length, *scale.shape)``, ``length >= 1``.
        scale (Tensor): fp32 scale(s), updated in place.
        dtype (torch.dtype): the FP8 format the scale is for.
        margin (int, optional): see :func:`scale_from_amax`.
        algo (str, optional): ``"max"`` (default) or ``"most_recent"``.

    Returns:
        Tensor: the amax the new scale came from.

    Example::

        >>> history, scale = torch.zeros(3), torch.ones(())
        >>> for a in (2.0, 4.0, 1.0, 0.5):
        ...     history[0] = a   # what the forward records
        ...     _ = update_amax_history_(history, scale, torch.float8_e4m3fn)
        ...     print(scale.item(), history.tolist())
        224.0 [0.0, 0.0, 2.0]
        112.0 [0.0, 2.0, 4.0]
        112.0 [0.0, 4.0, 1.0]
        112.0 [0.0, 1.0, 0.5]
    """
    if algo not in _HISTORY_ALGOS:
        raise ValueError(f"amax history algo must be one of {_HISTORY_ALGOS}, got {algo!r}")
    if history.dim() != scale.dim() + 1 or history.shape[1:] != scale.shape or history.shape[0] < 1:
        raise ValueError(f"amax history of shape {tuple(history.shape)} does not fit a scale of "
                         f"shape {tuple(scale.shape)}: it must be (length >= 1, *scale.shape)")
    current = history.amax(dim=0) if algo == "max" else history[0].clone()
    scale.copy_(scale_from_amax(current, dtype, margin, previous=scale))
    history.copy_(torch.roll(history, -1, 0))
    history[0].zero_()
    return current


def _poison(scale_inv: Tensor, amax: Tensor) -> Tensor:
    # amax - amax is +0 where the amax is finite and NaN where it is inf or NaN:
    # adding it leaves a finite scale_inv bitwise as it was and turns the rest NaN.
    return scale_inv + (amax - amax)


def quantize(x: Tensor, scale: Tensor, dtype: torch.dtype, amax: Tensor | None = None) -> Fp8Tensor:
    """Cast ``x * scale`` to an FP8 format, saturating at its max.

    Args:
        x (Tensor): the values (any floating dtype).
        scale (Tensor): fp32, broadcastable to ``x`` (one element, or per row/column).
        dtype (torch.dtype): ``torch.float8_e4m3fn`` or ``torch.float8_e5m2``.
        amax (Tensor, optional): ``x``'s amax, shaped as ``scale``. Where it is not
            finite, the returned ``scale_inv`` is NaN, so that an overflow the
            saturation hides still reaches the GEMM's output.

    Returns:
        Fp8Tensor: the codes and ``1 / scale``.

    Example::

        >>> q = quantize(torch.tensor([1.0, 500.0, -float("inf")]), torch.tensor(1.0),
        ...              torch.float8_e4m3fn)
        >>> q.data.float()
        tensor([   1.,  448., -448.])
        >>> quantize(torch.tensor([1.0, float("inf")]), torch.tensor(1.0), torch.float8_e5m2,
        ...          amax=torch.tensor(float("inf"))).scale_inv
        tensor(nan)
    """
    limit = fp8_max(dtype)
    scale = scale.float()
    data = (x.float() * scale).clamp(-limit, limit).to(dtype)
    scale_inv = scale.reciprocal()
    if amax is not None:
        scale_inv = _poison(scale_inv, amax.float())
    return Fp8Tensor(data, scale_inv)


def quantize_tensorwise(x: Tensor, dtype: torch.dtype, margin: int = 0) -> tuple[Fp8Tensor, Tensor]:
    """Current scaling: one scale from ``x``'s own amax.

    Returns:
        tuple: the :class:`Fp8Tensor` (0-dim ``scale_inv``) and the amax (0-dim fp32).

    Example::

        >>> q, a = quantize_tensorwise(torch.tensor([0.5, -2.0]), torch.float8_e4m3fn)
        >>> a, q.scale_inv, q.data.float()
        (tensor(2.), tensor(0.0045), tensor([ 112., -448.]))
    """
    a = amax(x)
    return quantize(x, scale_from_amax(a, dtype, margin), dtype, a), a


def quantize_rowwise(x: Tensor, dtype: torch.dtype, dim: int = 1, margin: int = 0,
                     ) -> tuple[Fp8Tensor, Tensor]:
    """Current scaling with one scale per row (``dim=1``: scales ``(M, 1)``) or per column (``dim=0``: ``(1, N)``).

    ``dim`` is the dim reduced over, the GEMM's contraction dim: the first
    operand of ``A @ B`` takes ``dim=1``, the second ``dim=0``.

    Returns:
        tuple: the :class:`Fp8Tensor` and the per-row (column) amax, shaped as its ``scale_inv``.

    Example::

        >>> q, a = quantize_rowwise(torch.tensor([[1.0, -2.0], [4.0, 0.0]]), torch.float8_e4m3fn)
        >>> a.flatten(), q.scale_inv.shape, q.data.float().tolist()
        (tensor([2., 4.]), torch.Size([2, 1]), [[224.0, -448.0], [448.0, 0.0]])
    """
    if x.dim() != 2:
        raise ValueError(f"rowwise scaling takes a 2-D tensor, got shape {tuple(x.shape)}")
    a = amax(x, dim=dim)
    return quantize(x, scale_from_amax(a, dtype, margin), dtype, a), a


def dequantize(q: Fp8Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """``q.data * q.scale_inv`` in fp32, then rounded to ``dtype``.

    Example::

        >>> q = quantize(torch.tensor([3.0, -0.25]), torch.tensor(4.0), torch.float8_e5m2)
        >>> dequantize(q)
        tensor([ 3.0000, -0.2500])
    """
    return (q.data.float() * q.scale_inv).to(dtype)


# ---------------------------------------------------------------------------------------
# torch._scaled_mm: its signature, where it runs, CUDA's rules


def _scaled_mm_signature() -> str | None:
    """``"scale_a/scale_b -> Tensor"`` for the signature this module calls, else None."""
    op = getattr(torch.ops.aten, "_scaled_mm", None)
    if op is None:
        return None
    schema = op.default._schema
    names = {a.name for a in schema.arguments}
    # Before torch 2.5 the op returned (out, amax) and took its scales as optional.
    if {"self", "mat2", "scale_a", "scale_b", "bias", "out_dtype", "use_fast_accum"} <= names \
            and len(schema.returns) == 1:
        return "_scaled_mm(self, mat2, scale_a, scale_b, bias=None, scale_result=None, " \
               "out_dtype=None, use_fast_accum=False) -> Tensor"
    return None


#: The ``torch._scaled_mm`` signature this module calls, or None if the running torch lacks it.
SCALED_MM_SIGNATURE: str | None = _scaled_mm_signature()


def _probe_cpu_rowwise() -> bool:
    # torch 2.11's CPU kernel (oneDNN) asserts on per-row scales; 2.13's takes them.
    # One 16x16 product at import says which this torch is.
    if SCALED_MM_SIGNATURE is None:
        return False
    a = torch.zeros(16, 16, dtype=E4M3)
    try:
        torch._scaled_mm(a, a.t(), scale_a=torch.ones(16, 1), scale_b=torch.ones(1, 16),
                         out_dtype=torch.bfloat16)
    except RuntimeError:
        return False
    return True


#: Whether this torch's CPU ``_scaled_mm`` takes rowwise scales.
_CPU_ROWWISE: bool = _probe_cpu_rowwise()


def fp8_gemm_available(device: str | torch.device, rowwise: bool = False) -> bool:
    """Whether ``torch._scaled_mm`` can serve FP8 GEMMs on a device.

    True when the running torch has the signature this module calls, registers a
    kernel for the device's dispatch key, and, for CUDA, the GPU is sm_89 or later.
    With ``rowwise``, also whether it takes per-row scales (the CPU kernel does
    from torch 2.13 on; torch 2.11's does not).

    Example::

        >>> fp8_gemm_available("cpu")   # torch 2.13's CPU build has the kernel
        True
    """
    device = torch.device(device)
    if SCALED_MM_SIGNATURE is None:
        return False
    if not torch._C._dispatch_has_kernel_for_dispatch_key("aten::_scaled_mm", device.type.upper()):
        return False
    if device.type == "cuda":
        return torch.cuda.get_device_capability(device) >= (8, 9)
    return _CPU_ROWWISE or not rowwise or device.type != "cpu"


def require_fp8_gemm(device: str | torch.device) -> None:
    """Raise a clear error unless :func:`fp8_gemm_available` is true for ``device``.

    Call it once where FP8 is set up, not per GEMM (it may query the GPU).

    Raises:
        RuntimeError: naming what is missing and the way out, emulation
            (``emulate=True``: the fp32 reference, exact but no faster).

    Example::

        >>> require_fp8_gemm("cpu")
    """
    if fp8_gemm_available(device):
        return
    device = torch.device(device)
    if SCALED_MM_SIGNATURE is None:
        why = (f"torch {torch.__version__} has no torch._scaled_mm with the signature amp_patch "
               "calls (scale_a, scale_b, out_dtype; one Tensor returned; torch >= 2.5)")
    elif device.type == "cuda" and torch._C._dispatch_has_kernel_for_dispatch_key(
            "aten::_scaled_mm", "CUDA"):
        cap = torch.cuda.get_device_capability(device)
        why = f"the GPU {device} is sm_{cap[0]}{cap[1]}; FP8 GEMMs need sm_89 or later"
    else:
        why = f"torch {torch.__version__}'s torch._scaled_mm has no kernel for {device.type!r}"
    raise RuntimeError(f"amp_patch FP8: {why}. Choose emulation explicitly (emulate=True: "
                       "quantize, dequantize and matmul in fp32, numerically the same and no "
                       "faster), or upgrade torch / run on a GPU that has FP8 tensor cores.")


def check_scaled_mm_args(a: Tensor, b: Tensor, scale_a: Tensor, scale_b: Tensor,
                         out_dtype: torch.dtype, bias: Tensor | None = None) -> None:
    """Enforce CUDA's rules for ``torch._scaled_mm(a, b, ...)``, whatever the device.

    The CPU kernel accepts any layout and dims; CUDA's does not, so a breach would
    pass every CPU test and fail on the first GPU. The rules:

    - ``a`` and ``b`` are 2-D FP8 tensors with matching inner dims, not both E5M2;
    - ``a`` is row-major (its last dim contiguous), ``b`` column-major (its first);
    - each of M, K, N is a multiple of 16;
    - ``out_dtype`` is bf16, fp16 or fp32;
    - the scales are fp32 and contiguous: one element each (tensorwise), or
      ``(M, 1)`` and ``(1, N)`` (rowwise, which also needs E4M3 inputs and a bf16
      output, as the rowwise kernels do);
    - a bias is 1-D of size N in ``out_dtype``, and ``out_dtype`` is not fp32.

    Raises:
        ValueError: naming the broken rule and how to meet it.

    Example::

        >>> a = torch.zeros(16, 32, dtype=torch.float8_e4m3fn)
        >>> b = torch.zeros(16, 32, dtype=torch.float8_e4m3fn)
        >>> one = torch.ones(())
        >>> check_scaled_mm_args(a, b.t(), one, one, torch.bfloat16)   # column-major b: fine
        >>> check_scaled_mm_args(a, b.t().contiguous(), one, one, torch.bfloat16)
        Traceback (most recent call last):
        ...
        ValueError: torch._scaled_mm: the second operand must be column-major ...
    """
    def fail(msg: str) -> None:
        raise ValueError(f"torch._scaled_mm: {msg} (CUDA's rule, enforced on every device)")

    if a.dim() != 2 or b.dim() != 2:
        fail(f"both operands must be 2-D, got {tuple(a.shape)} and {tuple(b.shape)}")
    for name, t in (("first", a), ("second", b)):
        if t.dtype not in FP8_MAX:
            fail(f"the {name} operand is {t.dtype}, not torch.float8_e4m3fn or torch.float8_e5m2")
    if a.dtype == E5M2 and b.dtype == E5M2:
        fail("E5M2 x E5M2 is refused; one operand at least must be E4M3 (HYBRID casts only "
             "the gradient to E5M2)")
    (m, k), (k2, n) = a.shape, b.shape
    if k != k2:
        fail(f"shapes {tuple(a.shape)} and {tuple(b.shape)} cannot be multiplied")
    if a.stride(1) != 1 and m > 1:
        fail(f"the first operand must be row-major (stride (K, 1)), got strides {a.stride()}; "
             "pass .contiguous()")
    if b.stride(0) != 1 and n > 1:
        raise ValueError(
            f"torch._scaled_mm: the second operand must be column-major (strides (1, K)), got "
            f"strides {b.stride()}; pass w.t() of a contiguous (N, K) tensor "
            "(CUDA's rule, enforced on every device)")
    bad = [f"{d}={v}" for d, v in (("M", m), ("K", k), ("N", n)) if v % _DIM_MULTIPLE]
    if bad:
        fail(f"every dim must be a multiple of {_DIM_MULTIPLE}, got {', '.join(bad)}; pad, or "
             "leave this layer out of FP8")
    if out_dtype not in _OUT_DTYPES:
        fail(f"out_dtype must be one of {_OUT_DTYPES}, got {out_dtype}")
    for name, s in (("scale_a", scale_a), ("scale_b", scale_b)):
        if s.dtype != torch.float32:
            fail(f"{name} must be fp32, got {s.dtype}")
        if not s.is_contiguous() or (s.dim() == 2 and s.stride(1) != 1):
            fail(f"{name} must be contiguous with a unit last stride, got strides {s.stride()}")
    tensorwise = scale_a.numel() == 1 and scale_b.numel() == 1
    rowwise = tuple(scale_a.shape) == (m, 1) and tuple(scale_b.shape) == (1, n)
    if not (tensorwise or rowwise):
        fail(f"scales must have one element each, or shapes ({m}, 1) and (1, {n}); got "
             f"{tuple(scale_a.shape)} and {tuple(scale_b.shape)}")
    if rowwise and not tensorwise:
        if a.dtype != E4M3 or b.dtype != E4M3:
            fail("rowwise scaling takes E4M3 operands only (use Fp8Format.E4M3)")
        if out_dtype != torch.bfloat16:
            fail(f"rowwise scaling writes bf16 only, got out_dtype {out_dtype}")
    if bias is not None:
        if out_dtype == torch.float32:
            fail("a bias needs a bf16 or fp16 output; add it after an fp32 GEMM")
        if bias.dtype != out_dtype or tuple(bias.shape) != (n,):
            fail(f"the bias must be 1-D of size {n} in {out_dtype}, got {tuple(bias.shape)} "
                 f"{bias.dtype}")


def fp8_gemm_reference(a: Fp8Tensor, b: Fp8Tensor, out_dtype: torch.dtype,
                       bias: Tensor | None = None) -> Tensor:
    """The reference body of :func:`fp8_gemm`: dequantize to fp32, matmul in fp32, add the bias, round once.

    It runs on any device and any torch with FP8 dtypes, and it is the emulation
    path. On the CPU (torch 2.13) ``torch._scaled_mm`` computes the same and agrees
    bitwise. On CUDA it applies the scales after accumulating, and the FP8
    tensor cores accumulate with less than fp32's precision within a block:
    measured on an H200, the two differ by up to about ``2**-13 (|A| @ |B|)``.

    Example::

        >>> a, _ = quantize_tensorwise(torch.eye(16), torch.float8_e4m3fn)
        >>> b, _ = quantize_tensorwise(torch.full((16, 16), 0.5), torch.float8_e4m3fn)
        >>> fp8_gemm_reference(a, b, torch.float32)[0, :3]
        tensor([0.5000, 0.5000, 0.5000])
    """
    out = dequantize(a) @ dequantize(b)
    if bias is not None:
        out = out + bias.float()
    return out.to(out_dtype)


def fp8_gemm(a: Fp8Tensor, b: Fp8Tensor, out_dtype: torch.dtype, bias: Tensor | None = None, *,
             emulate: bool = False) -> Tensor:
    """``a @ b`` of two FP8 tensors through ``torch._scaled_mm``: fp32 accumulation, one rounding to ``out_dtype``.

    Args:
        a (Fp8Tensor): ``(M, K)``, row-major.
        b (Fp8Tensor): ``(K, N)``, column-major (the ``.t()`` of a contiguous ``(N, K)``).
        out_dtype (torch.dtype): bf16, fp16 or fp32.
        bias (Tensor, optional): ``(N,)``, added in fp32 before the rounding. A bias
            not in ``out_dtype`` (or with an fp32 output) is added after the GEMM.
        emulate (bool, optional): run :func:`fp8_gemm_reference` instead.

    CUDA's rules are checked first on every device (:func:`check_scaled_mm_args`).

    Example::

        >>> x, _ = quantize_tensorwise(torch.randn(16, 32), torch.float8_e4m3fn)
        >>> w, _ = quantize_tensorwise(torch.randn(48, 32), torch.float8_e4m3fn)
        >>> y = fp8_gemm(x, w.t(), torch.bfloat16)
        >>> y.shape, torch.equal(y, fp8_gemm(x, w.t(), torch.bfloat16, emulate=True))
        (torch.Size([16, 48]), True)
    """
    fused_bias = bias if bias is not None and bias.dtype == out_dtype \
        and out_dtype != torch.float32 else None
    check_scaled_mm_args(a.data, b.data, a.scale_inv, b.scale_inv, out_dtype, fused_bias)
    if emulate:
        return fp8_gemm_reference(a, b, out_dtype, bias)
    if a.data.device.type == "cpu" and not _CPU_ROWWISE and a.scale_inv.numel() > 1:
        raise RuntimeError(f"amp_patch FP8: torch {torch.__version__}'s CPU torch._scaled_mm takes "
                           "tensorwise scales only; choose emulation (emulate=True) for rowwise "
                           "scaling on the CPU, or torch >= 2.13")
    if fused_bias is None and bias is not None:
        out = torch._scaled_mm(a.data, b.data, scale_a=a.scale_inv, scale_b=b.scale_inv,
                               out_dtype=torch.float32)
        return (out + bias.float()).to(out_dtype)
    return torch._scaled_mm(a.data, b.data, scale_a=a.scale_inv, scale_b=b.scale_inv,
                            bias=fused_bias, out_dtype=out_dtype)


# ---------------------------------------------------------------------------------------
# The FP8 linear


def _pad_rows(q: Fp8Tensor, rows: int) -> Fp8Tensor:
    """``q`` with zero rows appended up to ``rows``; a rowwise scale gets ones (zeros read back as 0)."""
    extra = rows - q.data.shape[0]
    if extra == 0:
        return q
    zeros = torch.zeros(extra, q.data.shape[1], dtype=q.data.dtype, device=q.data.device)
    data = torch.cat([q.data, zeros])
    s = q.scale_inv
    if s.dim() == 2 and s.shape[0] > 1:
        s = torch.cat([s, torch.ones(extra, 1, dtype=s.dtype, device=s.device)])
    return Fp8Tensor(data, s)


def _round_up(n: int) -> int:
    return -(-n // _DIM_MULTIPLE) * _DIM_MULTIPLE


def _col_major(q: Fp8Tensor) -> Fp8Tensor:
    """``q`` with the same values, laid out column-major (a copy of the 1-byte codes)."""
    return Fp8Tensor(q.data.t().contiguous().t(), q.scale_inv)


def _quantize_for(x: Tensor, dtype: torch.dtype, scale: Tensor | None, rowwise_dim: int | None,
                  margin: int) -> tuple[Fp8Tensor, Tensor]:
    """Quantize with a given (delayed) scale, or by current tensorwise or rowwise scaling.

    A delayed scale of 0 is one not yet set (:class:`Fp8LinearState` before its
    first update): the current amax gives the scale then, chosen on the device.
    """
    if rowwise_dim is not None:
        return quantize_rowwise(x, dtype, dim=rowwise_dim, margin=margin)
    if scale is None:
        return quantize_tensorwise(x, dtype, margin)
    a = amax(x)
    scale = torch.where(scale > 0, scale, scale_from_amax(a, dtype, margin))
    return quantize(x, scale, dtype, a), a


def _record(slot: Tensor | None, a: Tensor) -> None:
    # The overall amax, copied on the device: no host read.
    if slot is not None:
        slot.copy_(a.amax().reshape(slot.shape))


class _Fp8Linear(torch.autograd.Function):
    """y = x W^T (+ b) with three FP8 GEMMs; see :func:`fp8_linear` for the arguments."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor, bias: Tensor | None, w_data: Tensor | None,
                w_scale_inv: Tensor | None, x_scale: Tensor | None, grad_scale: Tensor | None,
                amax_x: Tensor | None, amax_w: Tensor | None, amax_grad: Tensor | None,
                fmt: Fp8Format, rowwise: bool, emulate: bool, margin: int) -> Tensor:
        lead, k = x.shape[:-1], x.shape[-1]
        x2 = x.reshape(-1, k)
        m = x2.shape[0]
        rows = _round_up(m)
        fdt = fmt.forward_dtype
        qx, ax = _quantize_for(x2, fdt, x_scale, 1 if rowwise else None, margin)
        _record(amax_x, ax)
        if w_data is not None and w_scale_inv is not None:
            qw = Fp8Tensor(w_data, w_scale_inv)
        else:
            qw, aw = _quantize_for(weight, fdt, None, 1 if rowwise else None, margin)
            _record(amax_w, aw)
        out_dtype = torch.bfloat16 if rowwise else x.dtype
        fuse = bias is not None and out_dtype != torch.float32
        b = bias.to(out_dtype) if fuse and bias is not None else None
        y = fp8_gemm(_pad_rows(qx, rows), qw.t(), out_dtype, b, emulate=emulate)[:m]
        if bias is not None and not fuse:
            y = y + bias.to(y.dtype)
        if rowwise:
            # The backward quantizes x and W along the other dim: keep them as they are.
            ctx.save_for_backward(x2, weight, None, None, None, None, grad_scale, amax_grad)
        else:
            ctx.save_for_backward(None, None, qx.data, qx.scale_inv, qw.data, qw.scale_inv,
                                  grad_scale, amax_grad)
        ctx.meta = (lead, m, rows, x.dtype, weight.dtype,
                    None if bias is None else bias.dtype, fmt, rowwise, emulate, margin)
        return y.to(x.dtype).reshape(*lead, y.shape[-1])

    @staticmethod
    def backward(ctx: Any, *grads: Tensor) -> tuple[Tensor | None, ...]:
        (grad_out,) = grads
        x2, weight, x_data, x_scale_inv, w_data, w_scale_inv, grad_scale, amax_grad = \
            ctx.saved_tensors
        lead, m, rows, x_dtype, w_dtype, b_dtype, fmt, rowwise, emulate, margin = ctx.meta
        n = grad_out.shape[-1]
        dy = grad_out.reshape(-1, n)
        bdt = fmt.backward_dtype
        if rowwise:
            # grad-input contracts over N: dY per row, W per column; grad-weight
            # contracts over M: dY^T per row (dY per column), x per column.
            qdy, ady = quantize_rowwise(dy, bdt, dim=1, margin=margin)
            qw_col, _ = quantize_rowwise(weight, fmt.forward_dtype, dim=0, margin=margin)
            qdy_t, _ = quantize_rowwise(dy, bdt, dim=0, margin=margin)
            qx_col, _ = quantize_rowwise(x2, fmt.forward_dtype, dim=0, margin=margin)
            gi_dtype = gw_dtype = torch.bfloat16
        else:
            qdy, ady = _quantize_for(dy, bdt, grad_scale, None, margin)
            qw_col = Fp8Tensor(w_data, w_scale_inv)
            qdy_t = qdy
            qx_col = Fp8Tensor(x_data, x_scale_inv)
            gi_dtype, gw_dtype = x_dtype, w_dtype
        _record(amax_grad, ady)
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            gx = fp8_gemm(_pad_rows(qdy, rows), _col_major(qw_col), gi_dtype, emulate=emulate)
            grad_x = gx[:m].to(x_dtype).reshape(*lead, gx.shape[-1])
        if ctx.needs_input_grad[1]:
            # dY^T (N, M) row-major times x (M, K) column-major, M padded with zeros.
            a = _pad_rows(qdy_t, rows).t()
            a = Fp8Tensor(a.data.contiguous(), a.scale_inv)
            bq = _col_major(_pad_rows(qx_col, rows))
            grad_w = fp8_gemm(a, bq, gw_dtype, emulate=emulate).to(w_dtype)
        if b_dtype is not None and ctx.needs_input_grad[2]:
            grad_b = dy.float().sum(0).to(b_dtype)
        return (grad_x, grad_w, grad_b) + (None,) * 11


def quantize_weight(weight: Tensor, fmt: Fp8Format = Fp8Format.HYBRID, scale: Tensor | None = None,
                    amax_out: Tensor | None = None, *, rowwise: bool = False,
                    margin: int = 0) -> Fp8Tensor:
    """A weight's FP8 cast for :func:`fp8_linear`'s ``weight_fp8``: made once per iteration, then reused.

    Args:
        weight (Tensor): ``(N, K)``.
        fmt (Fp8Format, optional): the forward dtype is taken from it.
        scale (Tensor, optional): a delayed scale; default: current (tensorwise) scaling.
        amax_out (Tensor, optional): one-element fp32 tensor the weight's amax is copied into.
        rowwise (bool, optional): one scale per output row, shape ``(N, 1)``.
        margin (int, optional): see :func:`scale_from_amax`.

    Returns:
        Fp8Tensor: codes ``(N, K)`` contiguous and their ``scale_inv``.

    Example::

        >>> w = torch.randn(32, 16)
        >>> qw = quantize_weight(w)
        >>> qw.data.dtype, qw.data.shape
        (torch.float8_e4m3fn, torch.Size([32, 16]))
    """
    with torch.no_grad():
        q, a = _quantize_for(weight.detach(), fmt.forward_dtype, scale, 1 if rowwise else None,
                             margin)
        _record(amax_out, a)
    return q


def fp8_linear(x: Tensor, weight: Tensor, bias: Tensor | None = None, *,
               fmt: Fp8Format = Fp8Format.HYBRID, scaling: str = "tensorwise",
               x_scale: Tensor | None = None, grad_scale: Tensor | None = None,
               weight_fp8: Fp8Tensor | None = None, amax_x: Tensor | None = None,
               amax_w: Tensor | None = None, amax_grad: Tensor | None = None,
               emulate: bool = False, margin: int = 0) -> Tensor:
    """``x @ weight.T + bias`` with its three GEMMs in FP8 (forward, grad-input, grad-weight).

    x and W are cast to E4M3, the output gradient dY to E5M2 (``HYBRID``) or
    E4M3. Each GEMM accumulates in fp32 (:func:`fp8_gemm`); the output and
    grad-input come back in ``x``'s dtype, grad-weight in ``weight``'s. Rows of
    ``x`` (tokens) are zero-padded to a multiple of 16 for the GEMMs, which
    changes no result; K and N must be multiples of 16.

    Args:
        x (Tensor): ``(..., K)``.
        weight (Tensor): ``(N, K)``.
        bias (Tensor, optional): ``(N,)``.
        fmt (Fp8Format, optional): ``HYBRID`` (default) or ``E4M3``.
        scaling (str, optional): ``"tensorwise"`` (default: current scaling for
            every tensor whose scale is not given), ``"delayed"`` (``x_scale`` and
            ``grad_scale`` given, and the weight's through ``weight_fp8``) or
            ``"rowwise"`` (current per-row scales, E4M3 only, bf16 GEMM outputs;
            the backward re-quantizes x and W along the other dim, so they are
            kept in their own precision, not in FP8).
        x_scale, grad_scale (Tensor, optional): one-element fp32 scales of x and dY.
        weight_fp8 (Fp8Tensor, optional): the weight's cast from
            :func:`quantize_weight`, made once per iteration and cached; ``weight``
            is then only read for its dtype and its gradient (rowwise: the backward).
        amax_x, amax_w, amax_grad (Tensor, optional): one-element fp32 tensors the
            amaxes of x, W (when cast here) and dY are copied into, on the device,
            for the delayed recipe's history.
        emulate (bool, optional): the GEMMs run as :func:`fp8_gemm_reference`.
        margin (int, optional): see :func:`scale_from_amax`.

    .. note::
        An inf or NaN in x or W makes the output NaN, one in dY the gradients:
        the saturating cast cannot hide an overflow from the loss scaler.

    Example::

        >>> x = torch.randn(4, 32, requires_grad=True)
        >>> lin = nn.Linear(32, 16)
        >>> y = fp8_linear(x, lin.weight, lin.bias)
        >>> y.sum().backward()
        >>> y.shape, x.grad.shape, lin.weight.grad.dtype
        (torch.Size([4, 16]), torch.Size([4, 32]), torch.float32)
        >>> bool((y - lin(x)).abs().max() < 0.2)
        True
    """
    if scaling not in ("tensorwise", "delayed", "rowwise"):
        raise ValueError(f"scaling must be 'tensorwise', 'delayed' or 'rowwise', got {scaling!r}")
    rowwise = scaling == "rowwise"
    if scaling == "delayed" and (x_scale is None or grad_scale is None or weight_fp8 is None):
        raise ValueError("delayed scaling takes x_scale, grad_scale and weight_fp8 (the weight "
                         "cast with its own scale by quantize_weight)")
    if rowwise and fmt is not Fp8Format.E4M3:
        raise ValueError("rowwise scaling runs E4M3 everywhere (the rowwise GEMMs take no "
                         "E5M2); pass fmt=Fp8Format.E4M3")
    if rowwise and (x_scale is not None or grad_scale is not None):
        raise ValueError("rowwise scaling computes its own per-row scales; pass no x_scale or "
                         "grad_scale")
    w_data, w_scale_inv = (None, None) if weight_fp8 is None else weight_fp8
    out = _Fp8Linear.apply(x, weight, bias, w_data, w_scale_inv, x_scale, grad_scale, amax_x,
                           amax_w, amax_grad, fmt, rowwise, emulate, margin)
    return out


class Fp8LinearState:
    """The delayed recipe's state for one linear: scales and amax histories of x, W and dY.

    The forward records each amax into row 0 of its history (:meth:`slots`);
    :meth:`update_` then computes the next scales and rolls the histories
    (:func:`update_amax_history_`), all on the device. The scales start unset (0):
    until the histories hold an amax, each tensor is scaled by its current amax.

    Args:
        fmt (Fp8Format, optional): gives each tensor's FP8 dtype.
        history_len (int, optional): rows of each history (TE's default is 1024).
        algo (str, optional): ``"max"`` or ``"most_recent"``.
        margin (int, optional): see :func:`scale_from_amax`.
        device (torch.device, optional): where the tensors live.

    Example::

        >>> st = Fp8LinearState(history_len=4)
        >>> lin = nn.Linear(32, 16)
        >>> x = torch.randn(16, 32, requires_grad=True)
        >>> wq = quantize_weight(lin.weight, st.fmt, st.scale[1], st.slots()["amax_w"])
        >>> fp8_linear(x, lin.weight, lin.bias, scaling="delayed", weight_fp8=wq,
        ...            x_scale=st.scale[0], grad_scale=st.scale[2],
        ...            amax_x=st.slots()["amax_x"], amax_grad=st.slots()["amax_grad"]).sum().backward()
        >>> st.update_()
        >>> bool((st.scale > 1).all()), st.history[0].tolist()
        (True, [0.0, 0.0, 0.0])
    """

    def __init__(self, fmt: Fp8Format = Fp8Format.HYBRID, history_len: int = 16,
                 algo: Literal["max", "most_recent"] = "max", margin: int = 0,
                 device: torch.device | str | None = None) -> None:
        if history_len < 1:
            raise ValueError(f"history_len must be >= 1, got {history_len}")
        if algo not in _HISTORY_ALGOS:
            raise ValueError(f"algo must be one of {_HISTORY_ALGOS}, got {algo!r}")
        self.fmt = fmt
        self.algo: Literal["max", "most_recent"] = algo
        self.margin = margin
        #: Columns x, W, dY.
        self.history = torch.zeros(history_len, 3, dtype=torch.float32, device=device)
        # 0: not yet set; the first iteration (and any before a non-empty history) scales each
        # tensor by its current amax instead of by 1.0, which would flush small tensors.
        self.scale = torch.zeros(3, dtype=torch.float32, device=device)

    def slots(self) -> dict[str, Tensor]:
        """Views of row 0 of the histories, the ``amax_*`` arguments of :func:`fp8_linear`."""
        row = self.history[0]
        return {"amax_x": row[0:1], "amax_w": row[1:2], "amax_grad": row[2:3]}

    def update_(self) -> None:
        """Next scales from the histories, then roll them; per FP8 dtype, on the device."""
        fwd, bwd = self.fmt.forward_dtype, self.fmt.backward_dtype
        for col, dtype in ((slice(0, 2), fwd), (slice(2, 3), bwd)):
            update_amax_history_(self.history[:, col], self.scale[col], dtype, self.margin,
                                 self.algo)

    def state_dict(self) -> dict[str, Any]:
        """The scales and histories (copies), for a checkpoint."""
        return {"history": self.history.clone(), "scale": self.scale.clone()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s tensors bitwise."""
        self.history.copy_(state["history"])
        self.scale.copy_(state["scale"])
