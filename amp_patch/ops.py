"""Fused multi-tensor ops behind loss scaling and master weights.

The ops are defined here, once, under the ``amp_patch`` namespace of
``torch.library``. Each has a pure-PyTorch reference body registered as
``CompositeExplicitAutograd``. The compiled library ``amp_patch._C`` registers
C++ kernels for ``CPU`` (and ``CUDA`` when built). Those take precedence over
the reference, so one name, ``torch.ops.amp_patch.<op>``, routes to the
fastest kernel available for the tensors' device.

All ops take lists of tensors that may mix dtypes (fp32, fp16, bf16, fp64) and
sizes. Arithmetic is done in fp32 ("opmath"), or in fp64 for a tensor (or a
pair) with an fp64 side, and rounded once to the output dtype. ``found_inf`` is
a one-element float tensor that an op sets to 1.0 when it sees an inf or NaN in
the checked input. An op never clears it. Scale arguments are one-element
tensors on the device, so no op syncs with the host. A tensor that an op writes
may share memory with no other tensor of the call, except that ``dst[i]`` may be
``src[i]`` itself.

.. note::
    Every tensor in one call must be on the same device as ``found_inf``.
    Callers group tensors by device first (for instance with
    :func:`amp_patch.scaler.group_by_device_and_dtype`).
"""

from __future__ import annotations

import logging
import math
import os
from typing import Sequence

import torch
from torch import Tensor

__all__ = [
    "multi_tensor_unscale_",
    "multi_tensor_unscale_copy_",
    "multi_tensor_axpby_",
    "multi_tensor_l2norm",
    "multi_tensor_copy_",
    "multi_tensor_unscale_l2norm",
    "update_scale_hysteresis",
    "has_native_kernel",
    "native_extension_loaded",
]

logger = logging.getLogger("amp_patch")

NAMESPACE = "amp_patch"
_lib = torch.library.Library(NAMESPACE, "DEF")

_SCHEMAS = {
    "multi_tensor_unscale_": (
        "multi_tensor_unscale_(Tensor(a!)[] tensors, Tensor(b!) found_inf, Tensor inv_scale) -> ()"
    ),
    "multi_tensor_unscale_copy_": (
        "multi_tensor_unscale_copy_(Tensor[] src, Tensor(a!)[] dst, Tensor(b!) found_inf, "
        "Tensor inv_scale) -> ()"
    ),
    "multi_tensor_axpby_": (
        "multi_tensor_axpby_(Tensor[] x, Tensor(a!)[] y, Tensor(b!) found_inf, float a, float b) -> ()"
    ),
    "multi_tensor_l2norm": (
        "multi_tensor_l2norm(Tensor[] x, bool per_tensor) -> (Tensor total, Tensor per_tensor_norms)"
    ),
    "multi_tensor_copy_": "multi_tensor_copy_(Tensor[] src, Tensor(a!)[] dst) -> ()",
    "multi_tensor_unscale_l2norm": (
        "multi_tensor_unscale_l2norm(Tensor[] x, Tensor inv_scale, bool per_tensor) "
        "-> (Tensor total, Tensor per_tensor_norms)"
    ),
    "update_scale_hysteresis": (
        "update_scale_hysteresis(Tensor(a!) current_scale, Tensor(b!) growth_tracker, "
        "Tensor(c!) hysteresis_tracker, Tensor found_inf, float growth_factor, "
        "float backoff_factor, int growth_interval, int hysteresis) -> ()"
    ),
}
for _schema in _SCHEMAS.values():
    _lib.define(_schema)


def _flag_nonfinite(found_inf: Tensor, t: Tensor) -> None:
    # masked_fill_ with a 0-dim mask stays on the device: no host sync.
    if t.numel():
        found_inf.masked_fill_(~torch.isfinite(t).all(), 1.0)


def _check_rows(op: str, **lists: Sequence[Tensor] | None) -> None:
    """Equal lengths, and at each index equal shapes, over the lists that are not None."""
    named = [(k, v) for k, v in lists.items() if v is not None]
    lead_name, lead = named[0]
    for name, tensors in named[1:]:
        if len(tensors) != len(lead):
            raise RuntimeError(f"amp_patch::{op}: list lengths differ ({lead_name} has {len(lead)}, "
                               f"{name} has {len(tensors)})")
        for i, (a, b) in enumerate(zip(lead, tensors)):
            if a.shape != b.shape:
                raise RuntimeError(f"amp_patch::{op}: {name}[{i}] has shape {tuple(b.shape)} but "
                                   f"{lead_name}[{i}] has {tuple(a.shape)}")


def _byte_range(t: Tensor) -> tuple[int, int]:
    """The bytes ``[first, end)`` that ``t``'s elements span (strides are never negative)."""
    extent = 1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride()))
    first = t.data_ptr()
    return first, first + extent * t.element_size()


def _same_view(a: Tensor, b: Tensor) -> bool:
    return (a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride()
            and a.element_size() == b.element_size())


def _check_no_overlap(op: str, out_name: str, out: Sequence[Tensor], in_name: str = "",
                      inputs: Sequence[Tensor] = ()) -> None:
    """Raise if a written tensor shares memory with any other tensor of the call.

    The kernels process tensors in an unspecified order (CUDA: in parallel), so
    such a call has no defined result. Only ``out[i]`` being the very same view
    as ``inputs[i]`` is allowed: each element is then read before it is written,
    by the same thread. Inputs may overlap each other. Only address ranges are
    compared (sorted, then swept): no per-element work, but two interleaved
    strided views of one buffer are rejected too. The C++ kernels apply the same
    rule (csrc/overlap.cpp).
    """
    # (device, first byte, end byte, written, name), empty tensors left out.
    extents = []
    for i, t in enumerate(out):
        if t.numel():
            extents.append((str(t.device), *_byte_range(t), True, f"{out_name}[{i}]"))
    for i, t in enumerate(inputs):
        if t.numel() and not (i < len(out) and _same_view(t, out[i])):
            extents.append((str(t.device), *_byte_range(t), False, f"{in_name}[{i}]"))
    extents.sort(key=lambda e: (e[0], e[1]))
    # The extent reaching furthest so far, among all and among the written ones.
    far_any = far_written = None
    for e in extents:
        device, first, end, written, name = e
        reach = far_any if written else far_written
        if reach is not None and reach[0] == device and first < reach[2]:
            rule = (f"only {out_name}[i] may be the very same tensor as {in_name}[i]" if in_name
                    else "no tensor may appear twice")
            raise RuntimeError(
                f"amp_patch::{op}: {reach[4]} and {name} overlap in memory, so the result would "
                f"depend on the order in which the kernel processes them ({rule}; a written tensor "
                f"shares memory with no other)"
            )
        if far_any is None or far_any[0] != device or end > far_any[2]:
            far_any = e
        if written and (far_written is None or far_written[0] != device or end > far_written[2]):
            far_written = e


def _as_scalar(inv_scale: Tensor) -> Tensor:
    # 0-dim, so that a product with a 0-dim tensor (a scalar parameter's grad)
    # keeps the tensor's shape instead of broadcasting it to [1].
    return inv_scale.reshape(())


def _opmath(*tensors: Tensor) -> torch.dtype:
    """fp64 when any side is fp64, else fp32: the precision every op computes in."""
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def _unscale_ref(tensors: list[Tensor], found_inf: Tensor, inv_scale: Tensor) -> None:
    _check_no_overlap("multi_tensor_unscale_", "tensors", tensors)
    inv = _as_scalar(inv_scale)
    for t in tensors:
        _flag_nonfinite(found_inf, t)
        t.copy_(t.to(_opmath(t)) * inv)


def _unscale_copy_ref(
    src: list[Tensor], dst: list[Tensor], found_inf: Tensor, inv_scale: Tensor
) -> None:
    _check_rows("multi_tensor_unscale_copy_", src=src, dst=dst)
    _check_no_overlap("multi_tensor_unscale_copy_", "dst", dst, "src", src)
    inv = _as_scalar(inv_scale)
    for s, d in zip(src, dst):
        _flag_nonfinite(found_inf, s)
        d.copy_(s.to(_opmath(s, d)) * inv)


def _axpby_ref(
    x: list[Tensor], y: list[Tensor], found_inf: Tensor, a: float, b: float
) -> None:
    _check_rows("multi_tensor_axpby_", x=x, y=y)
    _check_no_overlap("multi_tensor_axpby_", "y", y, "x", x)
    for xi, yi in zip(x, y):
        _flag_nonfinite(found_inf, xi)
        m = _opmath(xi, yi)
        yi.copy_(a * xi.to(m) + b * yi.to(m))


def _norms_ref(x: list[Tensor], per_tensor: bool, inv_scale: Tensor | None,
               device: torch.device) -> tuple[Tensor, Tensor]:
    # Each tensor's norm in its opmath, of the values times inv_scale (each
    # product rounded), then all of them combined in fp64.
    inv = None if inv_scale is None else _as_scalar(inv_scale)
    norms = []
    for t in x:
        v = t.to(_opmath(t))
        if inv is not None:
            v = v * inv
        norms.append(torch.linalg.vector_norm(v).double() if t.numel()
                     else torch.zeros((), dtype=torch.float64, device=device))
    stacked = torch.stack(norms) if norms else torch.zeros(0, dtype=torch.float64, device=device)
    total = torch.linalg.vector_norm(stacked).float()
    return total, stacked.float() if per_tensor else stacked.new_empty(0, dtype=torch.float32)


def _l2norm_ref(x: list[Tensor], per_tensor: bool) -> tuple[Tensor, Tensor]:
    return _norms_ref(x, per_tensor, None, x[0].device if x else torch.device("cpu"))


def _unscale_l2norm_ref(x: list[Tensor], inv_scale: Tensor, per_tensor: bool) -> tuple[Tensor, Tensor]:
    return _norms_ref(x, per_tensor, inv_scale, inv_scale.device)


def _update_scale_hysteresis_ref(current_scale: Tensor, growth_tracker: Tensor,
                                 hysteresis_tracker: Tensor, found_inf: Tensor,
                                 growth_factor: float, backoff_factor: float,
                                 growth_interval: int, hysteresis: int) -> None:
    # The branches of csrc/scale_update.h as masks, so nothing is read back to
    # the host. found_inf is compared as there (> 0, != 0, <= 0): a NaN flag
    # backs off without using up hysteresis, like Apex's kernel.
    found = found_inf.reshape(())
    scale = current_scale.reshape(())
    growth = growth_tracker.reshape(())
    hyst = hysteresis_tracker.reshape(())
    inf_seen = found > 0
    hyst_left = torch.where(inf_seen, hyst - 1, hyst)
    held = inf_seen & (hyst_left > 0)
    backoff = (found != 0) & ~held
    successful = growth + 1
    grow = (found == 0) & (successful == growth_interval)
    grown = (scale.double() * growth_factor).float()
    backed_off = (scale.double() * backoff_factor).float()
    new_scale = torch.where(backoff, backed_off, torch.where(grow & torch.isfinite(grown), grown, scale))
    new_growth = torch.where(held | backoff | grow, 0, successful)
    new_hyst = torch.where(~held & (found <= 0), hysteresis, hyst_left)
    current_scale.copy_(new_scale)
    growth_tracker.copy_(new_growth)
    hysteresis_tracker.copy_(new_hyst)


def _copy_ref(src: list[Tensor], dst: list[Tensor]) -> None:
    _check_rows("multi_tensor_copy_", src=src, dst=dst)
    _check_no_overlap("multi_tensor_copy_", "dst", dst, "src", src)
    for s, d in zip(src, dst):
        d.copy_(s)


def _norms_fake(x: list[Tensor], per_tensor: bool, device: torch.device) -> tuple[Tensor, Tensor]:
    total = torch.empty((), dtype=torch.float32, device=device)
    norms = torch.empty(len(x) if per_tensor else 0, dtype=torch.float32, device=device)
    return total, norms


def _l2norm_fake(x: list[Tensor], per_tensor: bool) -> tuple[Tensor, Tensor]:
    return _norms_fake(x, per_tensor, x[0].device if x else torch.device("cpu"))


def _unscale_l2norm_fake(x: list[Tensor], inv_scale: Tensor, per_tensor: bool) -> tuple[Tensor, Tensor]:
    return _norms_fake(x, per_tensor, inv_scale.device)


def _no_output_fake(*args, **kwargs) -> None:
    return None


# name: (reference body, fake kernel)
_REFERENCE = {
    "multi_tensor_unscale_": (_unscale_ref, _no_output_fake),
    "multi_tensor_unscale_copy_": (_unscale_copy_ref, _no_output_fake),
    "multi_tensor_axpby_": (_axpby_ref, _no_output_fake),
    "multi_tensor_l2norm": (_l2norm_ref, _l2norm_fake),
    "multi_tensor_copy_": (_copy_ref, _no_output_fake),
    "multi_tensor_unscale_l2norm": (_unscale_l2norm_ref, _unscale_l2norm_fake),
    "update_scale_hysteresis": (_update_scale_hysteresis_ref, _no_output_fake),
}
for _name, (_fn, _fake) in _REFERENCE.items():
    _lib.impl(_name, _fn, "CompositeExplicitAutograd")
    torch.library.register_fake(f"{NAMESPACE}::{_name}", _fake, lib=_lib)


def _load_native() -> bool:
    # Prebuilt amp_patch._C when it matches this torch, else compiled just in time
    # (amp_patch/_native.py); False: the reference bodies above serve.
    from amp_patch import _native

    return _native.load().loaded


_NATIVE_LOADED = _load_native()


def native_extension_loaded() -> bool:
    """Whether the compiled library ``amp_patch._C`` was loaded.

    Returns:
        bool: True when the C++ kernels were built (at install time, or just in
        time for the running torch: :func:`amp_patch._native.status` says which)
        and imported.

    Example::

        >>> amp_patch.ops.native_extension_loaded()   # False under AMP_PATCH_NO_EXT=1
        True
    """
    return _NATIVE_LOADED


def has_native_kernel(device_type: str | torch.device, op: str = "multi_tensor_unscale_") -> bool:
    """Whether a compiled kernel (not the reference) serves ``op`` on a device type.

    Args:
        device_type (str or torch.device): ``"cpu"``, ``"cuda"``, or a device.
        op (str, optional): the op's name without namespace.
            Default: ``"multi_tensor_unscale_"``.

    Returns:
        bool: True when the dispatcher holds a kernel registered for that
        device's dispatch key, False when calls fall back to the reference.

    Example::

        >>> amp_patch.ops.has_native_kernel("cpu")
        True
    """
    key = torch.device(device_type).type.upper()
    return torch._C._dispatch_has_kernel_for_dispatch_key(f"{NAMESPACE}::{op}", key)


_ops = getattr(torch.ops, NAMESPACE)


def multi_tensor_unscale_(tensors: list[Tensor], found_inf: Tensor, inv_scale: Tensor) -> None:
    """Multiply every tensor by ``inv_scale`` in place, and flag non-finite inputs.

    Args:
        tensors (list of Tensor): tensors to unscale in place (any floating dtype).
        found_inf (Tensor): one-element float tensor, set to 1.0 if any input
            element is inf or NaN. Never cleared.
        inv_scale (Tensor): one-element float tensor holding ``1 / scale``.

    Example::

        >>> found_inf = torch.zeros(1)
        >>> multi_tensor_unscale_(grads, found_inf, torch.full((1,), 1 / 65536.0))
    """
    _ops.multi_tensor_unscale_(tensors, found_inf, inv_scale)


def multi_tensor_unscale_copy_(
    src: list[Tensor], dst: list[Tensor], found_inf: Tensor, inv_scale: Tensor
) -> None:
    """Write ``dst[i] = float(src[i]) * inv_scale`` in one pass, flagging non-finite ``src``.

    This is the O2 path from half model grads into fp32 master grads.

    Args:
        src (list of Tensor): inputs, read once.
        dst (list of Tensor): outputs of the same shapes (usually fp32).
        found_inf (Tensor): one-element float flag, set on inf/NaN in ``src``.
        inv_scale (Tensor): one-element float tensor holding ``1 / scale``.

    Example::

        >>> half_grads = [p.grad for p in model.parameters()]
        >>> master_grads = [torch.empty_like(g, dtype=torch.float32) for g in half_grads]
        >>> found_inf = torch.zeros(1)
        >>> multi_tensor_unscale_copy_(half_grads, master_grads, found_inf,
        ...                            torch.full((1,), 1 / 65536.0))
        >>> bool(found_inf)          # True when a half grad held an inf or NaN
        False
    """
    _ops.multi_tensor_unscale_copy_(src, dst, found_inf, inv_scale)


def multi_tensor_axpby_(
    x: list[Tensor], y: list[Tensor], found_inf: Tensor, a: float, b: float
) -> None:
    """Compute ``y[i] = a * x[i] + b * y[i]`` in place, flagging non-finite ``x``.

    Args:
        x (list of Tensor): inputs.
        y (list of Tensor): accumulators, updated in place.
        found_inf (Tensor): one-element float flag, set on inf/NaN in ``x``.
        a (float): coefficient of ``x``.
        b (float): coefficient of ``y``.

    Example::

        >>> x, y = [torch.ones(3)], [torch.full((3,), 2.0)]
        >>> multi_tensor_axpby_(x, y, torch.zeros(1), 0.5, 2.0)
        >>> y[0]
        tensor([4.5000, 4.5000, 4.5000])
    """
    _ops.multi_tensor_axpby_(x, y, found_inf, a, b)


def multi_tensor_l2norm(x: list[Tensor], per_tensor: bool = False) -> tuple[Tensor, Tensor]:
    """L2 norm over all tensors (and optionally of each), accumulated in fp32.

    Args:
        x (list of Tensor): inputs on one device.
        per_tensor (bool, optional): also return each tensor's norm. Default: False.

    Returns:
        tuple of Tensor: ``(total, per_tensor_norms)``. ``total`` is a 0-dim fp32
        tensor; ``per_tensor_norms`` has ``len(x)`` elements, or none when
        ``per_tensor`` is False.

    Example::

        >>> total, each = multi_tensor_l2norm([torch.full((4,), 3.0), torch.full((9,), 4.0)], True)
        >>> total, each
        (tensor(13.4164), tensor([ 6., 12.]))
    """
    return _ops.multi_tensor_l2norm(x, per_tensor)


def multi_tensor_copy_(src: list[Tensor], dst: list[Tensor]) -> None:
    """Casting copy ``dst[i].copy_(src[i])`` for many tensors in one call (masters to model).

    Args:
        src (list of Tensor): sources.
        dst (list of Tensor): destinations of the same shapes, any floating dtype.

    Example::

        >>> masters = [torch.randn(4, 4), torch.randn(4)]
        >>> model = [torch.empty(4, 4, dtype=torch.bfloat16), torch.empty(4, dtype=torch.bfloat16)]
        >>> multi_tensor_copy_(masters, model)   # each master rounded to bf16
    """
    _ops.multi_tensor_copy_(src, dst)


def multi_tensor_unscale_l2norm(x: list[Tensor], inv_scale: Tensor,
                                per_tensor: bool = False) -> tuple[Tensor, Tensor]:
    """L2 norm of the tensors times ``inv_scale``, without changing them (Apex's ``unscale_l2norm``).

    Each element is multiplied by ``inv_scale`` (rounded to fp32, or fp64 for
    fp64 tensors) before it is squared, so scaled fp32 grads whose squares
    would overflow still give a finite norm. The tensors are only read.

    Args:
        x (list of Tensor): inputs on the device of ``inv_scale``.
        inv_scale (Tensor): one-element float32 tensor holding ``1 / scale``.
        per_tensor (bool, optional): also return each tensor's norm. Default: False.

    Returns:
        tuple of Tensor: ``(total, per_tensor_norms)`` as for :func:`multi_tensor_l2norm`.

    Example::

        >>> total, _ = multi_tensor_unscale_l2norm(grads, torch.full((1,), 1 / 65536.0))
        >>> torch.nn.utils.clip_grads_with_norm_(params, 1.0, total)  # doctest: +SKIP
    """
    return _ops.multi_tensor_unscale_l2norm(x, inv_scale, per_tensor)


def update_scale_hysteresis(current_scale: Tensor, growth_tracker: Tensor, hysteresis_tracker: Tensor,
                            found_inf: Tensor, growth_factor: float, backoff_factor: float,
                            growth_interval: int, hysteresis: int) -> None:
    """One step of a dynamic loss scale with hysteresis, on the device (Apex's ``update_scale_hysteresis``).

    When ``found_inf`` is set, the step first uses up one unit of hysteresis:
    while some is left the scale holds (and the growth count restarts); after
    that, every such step multiplies the scale by ``backoff_factor``. After
    ``growth_interval`` clean steps in a row the scale is multiplied by
    ``growth_factor``, unless that would overflow fp32. Every clean step restores
    the hysteresis to ``hysteresis``. Products are taken in fp64 and rounded
    once to fp32. Nothing is read back to the host.

    Args:
        current_scale (Tensor): one-element float32 scale, updated in place.
        growth_tracker (Tensor): one-element int32 count of clean steps, updated in place.
        hysteresis_tracker (Tensor): one-element int32 hysteresis left, updated in place;
            start it at ``hysteresis``.
        found_inf (Tensor): one-element float32 flag of this step.
        growth_factor (float): multiplier after ``growth_interval`` clean steps.
        backoff_factor (float): multiplier on an inf once the hysteresis is used up.
        growth_interval (int): clean steps between growths.
        hysteresis (int): inf steps tolerated before the scale backs off.

    Example::

        >>> scale = torch.full((1,), 65536.0)
        >>> growth, hyst = torch.zeros(1, dtype=torch.int32), torch.full((1,), 2, dtype=torch.int32)
        >>> update_scale_hysteresis(scale, growth, hyst, torch.ones(1), 2.0, 0.5, 2000, 2)
        >>> scale.item(), hyst.item()
        (65536.0, 1)
    """
    _ops.update_scale_hysteresis(current_scale, growth_tracker, hysteresis_tracker, found_inf,
                                 growth_factor, backoff_factor, growth_interval, hysteresis)


# ---------------------------------------------------------------------------
# Fused optimizer ops (amp_patch.optimizers). Each takes the lists of one
# optimizer step, updates params and state in place, and never syncs:
#
# - `noop` (optional, one-element float32 or int32: amp_patch's found_inf or
#   Apex's noop buffer): when non-zero the op writes nothing at all, so a step
#   whose overflow was found earlier is skipped whole, never half-applied.
# - `inv_scale` (optional, one-element float32): grads are read as
#   ``float(grad) * inv_scale``, so half grads of a scaled loss need no
#   separate unscale pass and are left untouched.
# - `model_params` (may be empty): after the update each params[i] (an fp32
#   master) is also written, rounded, into model_params[i] (the half model
#   param), in the same pass.
#
# Arithmetic is fp32 in the order of csrc/cpu/optim_math.h, one rounding per
# operation; hyper-parameters are rounded to fp32 once and bias corrections are
# 1 - beta**step in float64 rounded once, as Apex's host code does.
# ---------------------------------------------------------------------------

_OPTIM_SCHEMAS = {
    "multi_tensor_adam_": (
        "multi_tensor_adam_(Tensor[] grads, Tensor(a!)[] params, Tensor(b!)[] exp_avgs, "
        "Tensor(c!)[] exp_avg_sqs, Tensor(d!)[] model_params, Tensor? noop, Tensor? inv_scale, "
        "float lr, float beta1, float beta2, float eps, float weight_decay, int step, "
        "bool adam_w_mode, bool bias_correction) -> ()"
    ),
    "multi_tensor_sgd_": (
        "multi_tensor_sgd_(Tensor[] grads, Tensor(a!)[] params, Tensor(b!)[] momentum_buffers, "
        "Tensor(c!)[] model_params, Tensor? noop, Tensor? inv_scale, float lr, float weight_decay, "
        "float momentum, float dampening, bool nesterov, bool first_run, bool wd_after_momentum) -> ()"
    ),
    "multi_tensor_adagrad_": (
        "multi_tensor_adagrad_(Tensor[] grads, Tensor(a!)[] params, Tensor(b!)[] state_sums, "
        "Tensor(c!)[] model_params, Tensor? noop, Tensor? inv_scale, float lr, float eps, "
        "float weight_decay, bool adagrad_w_mode) -> ()"
    ),
    "multi_tensor_novograd_": (
        "multi_tensor_novograd_(Tensor[] grads, Tensor(a!)[] params, Tensor(b!)[] exp_avgs, "
        "Tensor grad_norms, Tensor(c!)[] model_params, Tensor? noop, Tensor? inv_scale, float lr, "
        "float beta1, float beta2, float eps, float weight_decay, int step, bool bias_correction, "
        "bool grad_averaging, bool reg_inside_moment) -> ()"
    ),
    "multi_tensor_lamb_stage1_": (
        "multi_tensor_lamb_stage1_(Tensor[] grads, Tensor[] params, Tensor(a!)[] exp_avgs, "
        "Tensor(b!)[] exp_avg_sqs, Tensor? noop, Tensor? inv_scale, Tensor global_grad_norm, "
        "float max_grad_norm, float beta1, float beta2, float eps, float weight_decay, int step, "
        "bool bias_correction, bool grad_averaging, bool adam_w_mode, bool use_nvlamb) "
        "-> (Tensor param_norms, Tensor update_norms)"
    ),
    "multi_tensor_lamb_stage2_": (
        "multi_tensor_lamb_stage2_(Tensor(a!)[] params, Tensor[] exp_avgs, Tensor[] exp_avg_sqs, "
        "Tensor param_norms, Tensor update_norms, Tensor(b!)[] model_params, Tensor? noop, float lr, "
        "float beta1, float beta2, float eps, float weight_decay, int step, bool bias_correction, "
        "bool adam_w_mode, bool use_nvlamb) -> ()"
    ),
}
for _schema in _OPTIM_SCHEMAS.values():
    _lib.define(_schema)

__all__ += [
    "multi_tensor_adam_",
    "multi_tensor_sgd_",
    "multi_tensor_adagrad_",
    "multi_tensor_novograd_",
    "multi_tensor_lamb_stage1_",
    "multi_tensor_lamb_stage2_",
]


def _f32(x: float) -> float:
    """``x`` rounded to the nearest float32, as the kernels take their scalars."""
    return torch.tensor(x, dtype=torch.float32).item()


def _one_minus(x: float) -> float:
    """``1 - x`` computed in float32 (x already a float32 value)."""
    return (torch.ones((), dtype=torch.float32) - x).item()


def _bias_correction(beta: float, step: int, enabled: bool) -> float:
    return _f32(1.0 - beta ** step) if enabled else 1.0


def _div(x: Tensor, c: float) -> Tensor:
    # A tensor divisor: CUDA turns division by a Python scalar into a multiply by
    # its reciprocal, which the kernels (true division) would not match.
    return x / torch.full((), c, dtype=torch.float32, device=x.device)


def _sqrt_rn(x: Tensor) -> Tensor:
    # torch.sqrt on CPU is not correctly rounded for float32; a float64 sqrt
    # (error < 1 ulp) rounded to float32 is, for every float32 input.
    return x.double().sqrt().float()


def _keep(noop: Tensor | None) -> Tensor | None:
    """A 0-dim bool that is True when the step must leave everything as it is."""
    return None if noop is None else noop.reshape(()) != 0


def _commit(keep: Tensor | None, *pairs: tuple[Tensor, Tensor]) -> None:
    """Write each new value into its tensor; under ``keep``, write the old bits back."""
    for dst, value in pairs:
        value = value.to(dst.dtype)
        dst.copy_(value if keep is None else torch.where(keep, dst, value))


def _grad32(g: Tensor, inv_scale: Tensor | None) -> Tensor:
    g = g.float()
    return g if inv_scale is None else g * inv_scale.reshape(()).to(g.device)


def _out(model_params: Sequence[Tensor], i: int, p: Tensor) -> list[tuple[Tensor, Tensor]]:
    return [(model_params[i], p)] if model_params else []


def _adam_direction(m: Tensor, v: Tensor, p: Tensor | None, bc1: float, bc2: float, eps: float,
                    wd: float, adam_w_mode: bool) -> Tensor:
    """Adam's update direction from the moments, with AdamW's decay term (LAMB's too)."""
    u = _div(m, bc1) / (_sqrt_rn(_div(v, bc2)) + eps)
    if adam_w_mode and wd != 0.0:
        u = u + wd * p
    return u


def _adam_moments(g: Tensor, p: Tensor | None, m: Tensor, v: Tensor, b1: float, b2: float,
                  c1: float, c2: float, bc1: float, bc2: float, eps: float, wd: float,
                  adam_w_mode: bool) -> tuple[Tensor, Tensor, Tensor]:
    """New moments from an unscaled grad, and the direction (LAMB: c1 is beta3)."""
    if not adam_w_mode and wd != 0.0:
        g = g + wd * p
    m = b1 * m.float() + c1 * g
    v = b2 * v.float() + c2 * g * g
    return m, v, _adam_direction(m, v, p, bc1, bc2, eps, wd, adam_w_mode)


def _adam_ref(grads, params, exp_avgs, exp_avg_sqs, model_params, noop, inv_scale, lr, beta1,
              beta2, eps, weight_decay, step, adam_w_mode, bias_correction) -> None:
    _check_rows("multi_tensor_adam_", grads=grads, params=params, exp_avgs=exp_avgs,
                exp_avg_sqs=exp_avg_sqs, model_params=model_params or None)
    keep = _keep(noop)
    b1, b2, lr, eps, wd = _f32(beta1), _f32(beta2), _f32(lr), _f32(eps), _f32(weight_decay)
    c1, c2 = _one_minus(b1), _one_minus(b2)
    bc1, bc2 = _bias_correction(b1, step, bias_correction), _bias_correction(b2, step, bias_correction)
    for i, grad in enumerate(grads):
        if grad.numel() == 0:
            continue
        p = params[i].float()
        m, v, u = _adam_moments(_grad32(grad, inv_scale), p, exp_avgs[i], exp_avg_sqs[i], b1, b2,
                                c1, c2, bc1, bc2, eps, wd, adam_w_mode)
        p = p - lr * u
        _commit(keep, (params[i], p), (exp_avgs[i], m), (exp_avg_sqs[i], v),
                *_out(model_params, i, p))


def _sgd_ref(grads, params, momentum_buffers, model_params, noop, inv_scale, lr, weight_decay,
             momentum, dampening, nesterov, first_run, wd_after_momentum) -> None:
    op = "multi_tensor_sgd_"
    if momentum != 0.0 and len(momentum_buffers) != len(grads):
        raise RuntimeError(f"amp_patch::{op}: momentum is {momentum} but momentum_buffers has "
                           f"{len(momentum_buffers)} tensors for {len(grads)} grads")
    _check_rows(op, grads=grads, params=params,
                momentum_buffers=momentum_buffers if momentum != 0.0 else None,
                model_params=model_params or None)
    keep = _keep(noop)
    lr, wd, mu = _f32(lr), _f32(weight_decay), _f32(momentum)
    c_damp = _one_minus(_f32(dampening))
    for i, grad in enumerate(grads):
        if grad.numel() == 0:
            continue
        g, p = _grad32(grad, inv_scale), params[i].float()
        if wd != 0.0 and not wd_after_momentum:
            g = g + wd * p
        state = []
        if mu != 0.0:
            buf = g if first_run else mu * momentum_buffers[i].float() + c_damp * g
            g = g + mu * buf if nesterov else buf
            state = [(momentum_buffers[i], buf)]
        if wd != 0.0 and wd_after_momentum:
            g = g + wd * p
        p = p - lr * g
        _commit(keep, (params[i], p), *state, *_out(model_params, i, p))


def _adagrad_ref(grads, params, state_sums, model_params, noop, inv_scale, lr, eps, weight_decay,
                 adagrad_w_mode) -> None:
    _check_rows("multi_tensor_adagrad_", grads=grads, params=params, state_sums=state_sums,
                model_params=model_params or None)
    keep = _keep(noop)
    lr, eps, wd = _f32(lr), _f32(eps), _f32(weight_decay)
    for i, grad in enumerate(grads):
        if grad.numel() == 0:
            continue
        g, p = _grad32(grad, inv_scale), params[i].float()
        if not adagrad_w_mode and wd != 0.0:
            g = g + wd * p
        h = state_sums[i].float() + g * g
        update = g / (_sqrt_rn(h) + eps)
        if adagrad_w_mode and wd != 0.0:
            update = update + wd * p
        p = p - lr * update
        _commit(keep, (params[i], p), (state_sums[i], h), *_out(model_params, i, p))


def _novograd_ref(grads, params, exp_avgs, grad_norms, model_params, noop, inv_scale, lr, beta1,
                  beta2, eps, weight_decay, step, bias_correction, grad_averaging,
                  reg_inside_moment) -> None:
    op = "multi_tensor_novograd_"
    _check_rows(op, grads=grads, params=params, exp_avgs=exp_avgs, model_params=model_params or None)
    if grad_norms.shape != (len(grads),):
        raise RuntimeError(f"amp_patch::{op}: grad_norms must have one element per tensor "
                           f"({len(grads)}), got shape {tuple(grad_norms.shape)}")
    keep = _keep(noop)
    b1, lr, eps, wd = _f32(beta1), _f32(lr), _f32(eps), _f32(weight_decay)
    b3 = _one_minus(b1) if grad_averaging else 1.0
    bc1 = _bias_correction(b1, step, bias_correction)
    # The second moment is a norm, so its correction is a square root.
    bc2 = _f32(math.sqrt(1.0 - _f32(beta2) ** step)) if bias_correction else 1.0
    for i, grad in enumerate(grads):
        if grad.numel() == 0:
            continue
        denom = _div(grad_norms[i].float(), bc2) + eps
        g, p = _grad32(grad, inv_scale), params[i].float()
        if reg_inside_moment:
            g = g / denom
            if wd != 0.0:
                g = g + wd * p
            m = b1 * exp_avgs[i].float() + b3 * g
            p = p - lr * _div(m, bc1)
        else:
            m = b1 * exp_avgs[i].float() + b3 * g
            update = _div(m, bc1) / denom
            if wd != 0.0:
                update = update + wd * p
            p = p - lr * update
        _commit(keep, (params[i], p), (exp_avgs[i], m), *_out(model_params, i, p))


def _lamb_stage1_ref(grads, params, exp_avgs, exp_avg_sqs, noop, inv_scale, global_grad_norm,
                     max_grad_norm, beta1, beta2, eps, weight_decay, step, bias_correction,
                     grad_averaging, adam_w_mode, use_nvlamb) -> tuple[Tensor, Tensor]:
    _check_rows("multi_tensor_lamb_stage1_", grads=grads, params=params, exp_avgs=exp_avgs,
                exp_avg_sqs=exp_avg_sqs)
    keep = _keep(noop)
    b1, b2, eps, wd = _f32(beta1), _f32(beta2), _f32(eps), _f32(weight_decay)
    b3 = _one_minus(b1) if grad_averaging else 1.0
    c2 = _one_minus(b2)
    bc1, bc2 = _bias_correction(b1, step, bias_correction), _bias_correction(b2, step, bias_correction)
    norms_wanted = use_nvlamb or wd != 0.0
    device = grads[0].device if grads else torch.device("cpu")
    norm = _grad32(global_grad_norm.reshape(()), inv_scale)
    max_norm = _f32(max_grad_norm)
    clip = torch.ones((), device=norm.device)
    if max_norm > 0.0:
        clip = torch.where(norm > max_norm, _div(norm, max_norm), clip)
    sums = torch.zeros(2, len(grads), dtype=torch.float64, device=device)
    for i, grad in enumerate(grads):
        if grad.numel() == 0:
            continue
        p = params[i].float() if norms_wanted else None
        m, v, u = _adam_moments(_grad32(grad, inv_scale) / clip, p, exp_avgs[i], exp_avg_sqs[i],
                                b1, b2, b3, c2, bc1, bc2, eps, wd, adam_w_mode)
        if norms_wanted:
            sums[0, i] = p.double().square().sum()
        sums[1, i] = u.double().square().sum()
        _commit(keep, (exp_avgs[i], m), (exp_avg_sqs[i], v))
    norms = sums.sqrt().float()
    if keep is not None:
        norms = torch.where(keep, torch.zeros_like(norms), norms)
    return norms[0].clone(), norms[1].clone()


def _lamb_stage2_ref(params, exp_avgs, exp_avg_sqs, param_norms, update_norms, model_params, noop,
                     lr, beta1, beta2, eps, weight_decay, step, bias_correction, adam_w_mode,
                     use_nvlamb) -> None:
    op = "multi_tensor_lamb_stage2_"
    _check_rows(op, params=params, exp_avgs=exp_avgs, exp_avg_sqs=exp_avg_sqs,
                model_params=model_params or None)
    for name, t in (("param_norms", param_norms), ("update_norms", update_norms)):
        if t.shape != (len(params),):
            raise RuntimeError(f"amp_patch::{op}: {name} must have one element per tensor "
                               f"({len(params)}), got shape {tuple(t.shape)}")
    keep = _keep(noop)
    b1, b2, lr, eps, wd = _f32(beta1), _f32(beta2), _f32(lr), _f32(eps), _f32(weight_decay)
    bc1, bc2 = _bias_correction(b1, step, bias_correction), _bias_correction(b2, step, bias_correction)
    for i, param in enumerate(params):
        if param.numel() == 0:
            continue
        ratio = torch.full((), lr, dtype=torch.float32, device=param.device)
        if use_nvlamb or wd != 0.0:
            pn, un = param_norms[i], update_norms[i]
            ratio = torch.where((pn != 0) & (un != 0), lr * (pn / un), ratio)
        p = param.float()
        u = _adam_direction(exp_avgs[i].float(), exp_avg_sqs[i].float(), p, bc1, bc2, eps, wd,
                            adam_w_mode)
        p = p - ratio * u
        _commit(keep, (params[i], p), *_out(model_params, i, p))


def _lamb_stage1_fake(grads, *args) -> tuple[Tensor, Tensor]:
    device = grads[0].device if grads else torch.device("cpu")
    return (torch.empty(len(grads), dtype=torch.float32, device=device),
            torch.empty(len(grads), dtype=torch.float32, device=device))


_OPTIM_REFERENCE = {
    "multi_tensor_adam_": _adam_ref,
    "multi_tensor_sgd_": _sgd_ref,
    "multi_tensor_adagrad_": _adagrad_ref,
    "multi_tensor_novograd_": _novograd_ref,
    "multi_tensor_lamb_stage1_": _lamb_stage1_ref,
    "multi_tensor_lamb_stage2_": _lamb_stage2_ref,
}
_OPTIM_FAKES = {"multi_tensor_lamb_stage1_": _lamb_stage1_fake}
for _name in _OPTIM_SCHEMAS:
    _lib.impl(_name, _OPTIM_REFERENCE[_name], "CompositeExplicitAutograd")
    torch.library.register_fake(f"{NAMESPACE}::{_name}", _OPTIM_FAKES.get(_name, _no_output_fake),
                                lib=_lib)


def multi_tensor_adam_(
    grads: list[Tensor], params: list[Tensor], exp_avgs: list[Tensor], exp_avg_sqs: list[Tensor],
    model_params: list[Tensor], noop: Tensor | None, inv_scale: Tensor | None, *, lr: float,
    beta1: float, beta2: float, eps: float, weight_decay: float, step: int, adam_w_mode: bool = True,
    bias_correction: bool = True,
) -> None:
    """One Adam / AdamW step over lists of tensors, in one pass (Apex's ``multi_tensor_adam``).

    Per element, in fp32: ``g = grad * inv_scale`` (plus ``weight_decay * p`` in
    L2 mode), ``m = beta1*m + (1-beta1)*g``, ``v = beta2*v + (1-beta2)*g*g``,
    ``update = (m/bc1) / (sqrt(v/bc2) + eps)`` (plus ``weight_decay * p`` in
    AdamW mode), ``p = p - lr*update``, with ``bc = 1 - beta**step``.

    Args:
        grads (list of Tensor): gradients (fp32, fp16 or bf16), read only.
        params (list of Tensor): parameters or fp32 masters, updated in place.
        exp_avgs (list of Tensor): first moments, updated in place.
        exp_avg_sqs (list of Tensor): second moments, updated in place.
        model_params (list of Tensor): empty, or one tensor per param that receives
            the updated param rounded to its dtype (the half model copy).
        noop (Tensor, optional): one-element flag; non-zero skips the whole step.
        inv_scale (Tensor, optional): one-element fp32 multiplier of the grads.
        lr (float): learning rate.
        beta1 (float): first-moment decay.
        beta2 (float): second-moment decay.
        eps (float): added to the denominator.
        weight_decay (float): weight decay.
        step (int): the step number, from 1, for the bias corrections.
        adam_w_mode (bool, optional): decoupled weight decay (AdamW) rather than L2.
            Default: True.
        bias_correction (bool, optional): Default: True.

    Example::

        >>> ops.multi_tensor_adam_(half_grads, masters, m, v, half_params, found_inf, inv_scale,
        ...                        lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, step=1)
    """
    _ops.multi_tensor_adam_(grads, params, exp_avgs, exp_avg_sqs, model_params, noop, inv_scale,
                            lr, beta1, beta2, eps, weight_decay, step, adam_w_mode, bias_correction)


def multi_tensor_sgd_(
    grads: list[Tensor], params: list[Tensor], momentum_buffers: list[Tensor],
    model_params: list[Tensor], noop: Tensor | None, inv_scale: Tensor | None, *, lr: float,
    weight_decay: float = 0.0, momentum: float = 0.0, dampening: float = 0.0,
    nesterov: bool = False, first_run: bool = False, wd_after_momentum: bool = False,
) -> None:
    """One SGD step over lists of tensors, with Apex's momentum rule (``multi_tensor_sgd``).

    ``g = grad * inv_scale`` (+ ``weight_decay * p`` before or after momentum);
    with momentum, ``buf = g`` on the first run, else ``momentum*buf + (1-dampening)*g``,
    then ``g = buf`` (Nesterov: ``g + momentum*buf``); ``p = p - lr*g``.

    Args:
        grads (list of Tensor): gradients, read only.
        params (list of Tensor): parameters or fp32 masters, updated in place.
        momentum_buffers (list of Tensor): one per param when ``momentum != 0``
            (ignored otherwise; may be empty).
        model_params (list of Tensor): empty, or the half copies to write.
        noop (Tensor, optional): non-zero skips the whole step.
        inv_scale (Tensor, optional): one-element fp32 multiplier of the grads.
        lr (float): learning rate.
        weight_decay (float, optional): Default: 0.
        momentum (float, optional): Default: 0.
        dampening (float, optional): Default: 0.
        nesterov (bool, optional): Default: False.
        first_run (bool, optional): the buffers are new: set them to the grad.
            Default: False.
        wd_after_momentum (bool, optional): add weight decay after the momentum.
            Default: False.

    Example::

        >>> ops.multi_tensor_sgd_(grads, params, bufs, [], None, None, lr=0.1, momentum=0.9)
    """
    _ops.multi_tensor_sgd_(grads, params, momentum_buffers, model_params, noop, inv_scale, lr,
                           weight_decay, momentum, dampening, nesterov, first_run, wd_after_momentum)


def multi_tensor_adagrad_(
    grads: list[Tensor], params: list[Tensor], state_sums: list[Tensor], model_params: list[Tensor],
    noop: Tensor | None, inv_scale: Tensor | None, *, lr: float, eps: float,
    weight_decay: float = 0.0, adagrad_w_mode: bool = False,
) -> None:
    """One Adagrad step over lists of tensors (Apex's ``multi_tensor_adagrad``).

    ``g = grad * inv_scale`` (+ ``weight_decay * p`` in L2 mode), ``sum += g*g``,
    ``p = p - lr * (g / (sqrt(sum) + eps) [+ weight_decay * p in w mode])``.

    Args:
        grads (list of Tensor): gradients, read only.
        params (list of Tensor): parameters or fp32 masters, updated in place.
        state_sums (list of Tensor): the sums of squared grads, updated in place.
        model_params (list of Tensor): empty, or the half copies to write.
        noop (Tensor, optional): non-zero skips the whole step.
        inv_scale (Tensor, optional): one-element fp32 multiplier of the grads.
        lr (float): learning rate.
        eps (float): added to the denominator.
        weight_decay (float, optional): Default: 0.
        adagrad_w_mode (bool, optional): decoupled weight decay. Default: False.

    Example::

        >>> ops.multi_tensor_adagrad_(grads, params, sums, [], None, None, lr=1e-2, eps=1e-10)
    """
    _ops.multi_tensor_adagrad_(grads, params, state_sums, model_params, noop, inv_scale, lr, eps,
                               weight_decay, adagrad_w_mode)


def multi_tensor_novograd_(
    grads: list[Tensor], params: list[Tensor], exp_avgs: list[Tensor], grad_norms: Tensor,
    model_params: list[Tensor], noop: Tensor | None, inv_scale: Tensor | None, *, lr: float,
    beta1: float, beta2: float, eps: float, weight_decay: float, step: int,
    bias_correction: bool = True, grad_averaging: bool = True, reg_inside_moment: bool = False,
) -> None:
    """NovoGrad's element step over lists of tensors (Apex's ``multi_tensor_novograd``).

    ``grad_norms[i]`` is tensor i's second moment: its blended grad norm, which
    the caller updates first (:class:`amp_patch.optimizers.FusedNovoGrad` does).
    With ``denom = grad_norms[i] / sqrt(1 - beta2**step) + eps``: by default
    ``m = beta1*m + beta3*g``, ``p = p - lr * ((m/bc1)/denom + weight_decay*p)``;
    with ``reg_inside_moment`` the grad is normalised (and decayed) before the
    moment: ``m = beta1*m + beta3*(g/denom + weight_decay*p)``, ``p = p - lr*m/bc1``.
    ``beta3`` is ``1 - beta1`` with ``grad_averaging``, else 1.

    Args:
        grads (list of Tensor): gradients, read only.
        params (list of Tensor): parameters or fp32 masters, updated in place.
        exp_avgs (list of Tensor): first moments, updated in place.
        grad_norms (Tensor): 1-D fp32, one blended norm per tensor.
        model_params (list of Tensor): empty, or the half copies to write.
        noop (Tensor, optional): non-zero skips the whole step.
        inv_scale (Tensor, optional): one-element fp32 multiplier of the grads.
        lr (float): learning rate.
        beta1 (float): first-moment decay.
        beta2 (float): norm decay (for the bias correction).
        eps (float): added to the denominator.
        weight_decay (float): weight decay.
        step (int): the step number, from 1.
        bias_correction (bool, optional): Default: True.
        grad_averaging (bool, optional): Default: True.
        reg_inside_moment (bool, optional): Default: False.

    Example::

        >>> ops.multi_tensor_novograd_(grads, params, m, norms, [], None, None, lr=1e-3,
        ...                            beta1=0.95, beta2=0.98, eps=1e-8, weight_decay=0.0, step=1)
    """
    _ops.multi_tensor_novograd_(grads, params, exp_avgs, grad_norms, model_params, noop, inv_scale,
                                lr, beta1, beta2, eps, weight_decay, step, bias_correction,
                                grad_averaging, reg_inside_moment)


def multi_tensor_lamb_stage1_(
    grads: list[Tensor], params: list[Tensor], exp_avgs: list[Tensor], exp_avg_sqs: list[Tensor],
    noop: Tensor | None, inv_scale: Tensor | None, global_grad_norm: Tensor, *,
    max_grad_norm: float, beta1: float, beta2: float, eps: float, weight_decay: float, step: int,
    bias_correction: bool = True, grad_averaging: bool = True, adam_w_mode: bool = True,
    use_nvlamb: bool = False,
) -> tuple[Tensor, Tensor]:
    """LAMB's first stage: the moments, and the norms that the trust ratio needs.

    ``g = grad * inv_scale / clip``, where ``clip = n / max_grad_norm`` when the
    unscaled global norm ``n = global_grad_norm * inv_scale`` exceeds
    ``max_grad_norm > 0``, else 1. Then (L2 mode adds ``weight_decay * p`` to g)
    ``m = m*beta1 + beta3*g``, ``v = v*beta2 + (1-beta2)*g*g``, and the update
    direction ``u = (m/bc1) / (sqrt(v/bc2) + eps)`` (+ ``weight_decay * p`` in
    AdamW mode). ``u`` is not stored: stage 2 recomputes it from ``m`` and ``v``.

    Args:
        grads (list of Tensor): gradients, read only.
        params (list of Tensor): parameters or fp32 masters, read only (read
            only with weight decay or ``use_nvlamb``).
        exp_avgs (list of Tensor): first moments, updated in place.
        exp_avg_sqs (list of Tensor): second moments, updated in place.
        noop (Tensor, optional): non-zero skips the step (both norms are then 0).
        inv_scale (Tensor, optional): one-element fp32 multiplier of the grads.
        global_grad_norm (Tensor): one-element fp32, the L2 norm of all the
            optimizer's grads as stored (scaled), e.g. from :func:`multi_tensor_l2norm`.
        max_grad_norm (float): clipping threshold; 0 or less turns clipping off.
        beta1 (float): first-moment decay.
        beta2 (float): second-moment decay.
        eps (float): added to the denominator.
        weight_decay (float): weight decay.
        step (int): the step number, from 1.
        bias_correction (bool, optional): Default: True.
        grad_averaging (bool, optional): ``beta3 = 1 - beta1`` (else 1). Default: True.
        adam_w_mode (bool, optional): decoupled weight decay. Default: True.
        use_nvlamb (bool, optional): the trust ratio for every tensor, not only
            those with weight decay (then the param norms are computed). Default: False.

    Returns:
        tuple of Tensor: ``(param_norms, update_norms)``, fp32, one per tensor
        (``param_norms`` are 0 when not needed).

    Example::

        >>> total, _ = ops.multi_tensor_l2norm(grads)
        >>> pn, un = ops.multi_tensor_lamb_stage1_(grads, params, m, v, None, None, total,
        ...     max_grad_norm=1.0, beta1=0.9, beta2=0.999, eps=1e-6, weight_decay=0.01, step=1)
        >>> ops.multi_tensor_lamb_stage2_(params, m, v, pn, un, [], None, lr=1e-3, beta1=0.9,
        ...     beta2=0.999, eps=1e-6, weight_decay=0.01, step=1)
    """
    return _ops.multi_tensor_lamb_stage1_(grads, params, exp_avgs, exp_avg_sqs, noop, inv_scale,
                                          global_grad_norm, max_grad_norm, beta1, beta2, eps,
                                          weight_decay, step, bias_correction, grad_averaging,
                                          adam_w_mode, use_nvlamb)


def multi_tensor_lamb_stage2_(
    params: list[Tensor], exp_avgs: list[Tensor], exp_avg_sqs: list[Tensor], param_norms: Tensor,
    update_norms: Tensor, model_params: list[Tensor], noop: Tensor | None, *, lr: float,
    beta1: float, beta2: float, eps: float, weight_decay: float, step: int,
    bias_correction: bool = True, adam_w_mode: bool = True, use_nvlamb: bool = False,
) -> None:
    """LAMB's second stage: ``p = p - ratio * u``, with the per-tensor trust ratio.

    ``u`` is recomputed from the moments stage 1 stored. ``ratio`` is
    ``lr * param_norm / update_norm`` for tensors with weight decay (all of them
    with ``use_nvlamb``) when both norms are non-zero, else ``lr``.

    Args:
        params (list of Tensor): parameters or fp32 masters, updated in place.
        exp_avgs (list of Tensor): first moments from stage 1, read only.
        exp_avg_sqs (list of Tensor): second moments from stage 1, read only.
        param_norms (Tensor): stage 1's first result.
        update_norms (Tensor): stage 1's second result.
        model_params (list of Tensor): empty, or the half copies to write.
        noop (Tensor, optional): non-zero skips the step.
        lr (float): learning rate.
        beta1 (float): as in stage 1.
        beta2 (float): as in stage 1.
        eps (float): as in stage 1.
        weight_decay (float): as in stage 1.
        step (int): as in stage 1.
        bias_correction (bool, optional): Default: True.
        adam_w_mode (bool, optional): Default: True.
        use_nvlamb (bool, optional): Default: False.

    Example::

        >>> ops.multi_tensor_lamb_stage2_(params, m, v, pn, un, half_params, found_inf, lr=1e-3,
        ...     beta1=0.9, beta2=0.999, eps=1e-6, weight_decay=0.01, step=1)
    """
    _ops.multi_tensor_lamb_stage2_(params, exp_avgs, exp_avg_sqs, param_norms, update_norms,
                                   model_params, noop, lr, beta1, beta2, eps, weight_decay, step,
                                   bias_correction, adam_w_mode, use_nvlamb)
