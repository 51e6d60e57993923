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
    Callers group tensors by device first (see :func:`amp_patch.scaler`).
"""

from __future__ import annotations

import logging
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


def _check_pairs(src: Sequence[Tensor], dst: Sequence[Tensor], op: str) -> None:
    if len(src) != len(dst):
        raise RuntimeError(f"amp_patch::{op}: list lengths differ ({len(src)} vs {len(dst)})")
    for i, (s, d) in enumerate(zip(src, dst)):
        if s.shape != d.shape:
            raise RuntimeError(
                f"amp_patch::{op}: tensor {i} has shape {tuple(s.shape)} in the first list "
                f"but {tuple(d.shape)} in the second"
            )


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
    _check_pairs(src, dst, "multi_tensor_unscale_copy_")
    _check_no_overlap("multi_tensor_unscale_copy_", "dst", dst, "src", src)
    inv = _as_scalar(inv_scale)
    for s, d in zip(src, dst):
        _flag_nonfinite(found_inf, s)
        d.copy_(s.to(_opmath(s, d)) * inv)


def _axpby_ref(
    x: list[Tensor], y: list[Tensor], found_inf: Tensor, a: float, b: float
) -> None:
    _check_pairs(x, y, "multi_tensor_axpby_")
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
    _check_pairs(src, dst, "multi_tensor_copy_")
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
    if os.environ.get("AMP_PATCH_NO_EXT", "0") == "1":
        logger.debug("AMP_PATCH_NO_EXT=1: using the reference multi-tensor ops")
        return False
    try:
        from amp_patch import _C  # noqa: F401  (loading it registers the kernels)
    except ImportError as exc:
        logger.debug("amp_patch._C is not available (%s); using the reference multi-tensor ops", exc)
        return False
    return True


_NATIVE_LOADED = _load_native()


def native_extension_loaded() -> bool:
    """Whether the compiled library ``amp_patch._C`` was loaded.

    Returns:
        bool: True when the C++ kernels were built and imported.
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
    """
    return _ops.multi_tensor_l2norm(x, per_tensor)


def multi_tensor_copy_(src: list[Tensor], dst: list[Tensor]) -> None:
    """Casting copy ``dst[i].copy_(src[i])`` for many tensors in one call (masters to model).

    Args:
        src (list of Tensor): sources.
        dst (list of Tensor): destinations of the same shapes, any floating dtype.
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
