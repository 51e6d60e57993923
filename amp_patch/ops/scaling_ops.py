"""The loss-scaling ops: unscale, unscale-and-copy, axpby, L2 norms, copy, the scale update.

Their schemas, reference bodies and public wrappers; :mod:`amp_patch.ops` says
what every op of the package promises (dtypes, ``found_inf``, no host sync).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import Tensor

from amp_patch.ops._library import (
    _as_scalar,
    _check_no_overlap,
    _check_rows,
    _flag_nonfinite,
    _no_output_fake,
    _opmath,
    _ops,
    register,
)

__all__ = [
    "multi_tensor_unscale_",
    "multi_tensor_unscale_copy_",
    "multi_tensor_axpby_",
    "multi_tensor_l2norm",
    "multi_tensor_copy_",
    "multi_tensor_unscale_l2norm",
    "update_scale_hysteresis",
    "loss_scale_update_",
    "LOSS_SCALE_FIELDS",
]

#: The float64 fields of :func:`loss_scale_update_`'s state, in order.
LOSS_SCALE_FIELDS = ("scale", "clean", "skipped", "consecutive", "overflow", "unread", "collapsed")

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
    "loss_scale_update_": (
        "loss_scale_update_(Tensor(a!) state, Tensor(b!) inv_scale, Tensor(c!) scale, "
        "Tensor(d!) found_inf, Tensor(e!) overflow, float scale_window, float floor, "
        "bool floor_is_min, float max_scale, bool dynamic, float max_consecutive) -> ()"
    ),
}


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


def _loss_scale_update_ref(state: Tensor, inv_scale: Tensor, scale: Tensor, found_inf: Tensor,
                           overflow: Tensor, scale_window: float, floor: float,
                           floor_is_min: bool, max_scale: float, dynamic: bool,
                           max_consecutive: float) -> None:
    # The branches of csrc/scale_update.h as masks, so nothing is read back to the host.
    s, clean, skipped, consecutive, _, unread, collapsed = state.unbind()
    hit = found_inf.reshape(()) != 0
    h = hit.to(state.dtype)
    clean = (clean + 1.0) * (1.0 - h)
    consecutive = (consecutive + 1.0) * h
    if dynamic:
        halved = s * 0.5
        collapse = hit & (halved < floor)
        if floor_is_min:
            collapse = collapse & (s <= floor)
        grow = clean >= scale_window
        s = torch.where(hit, torch.where(collapse, s, halved.clamp(min=floor)),
                        torch.where(grow, (s * 2.0).clamp(max=max_scale), s))
        clean = torch.where(grow, torch.zeros_like(clean), clean)
    else:
        collapse = hit & (consecutive > max_consecutive)
    state.copy_(torch.stack([s, clean, skipped + h, consecutive, h, unread + h,
                             torch.maximum(collapsed, collapse.to(state.dtype))]))
    inv_scale.copy_((1.0 / s).to(torch.float32))
    scale.copy_(s.to(torch.float32))
    overflow.copy_(h.to(torch.float32))
    found_inf.zero_()


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


_REFERENCE: dict[str, tuple[Callable[..., Any], Callable[..., Any]]] = {
    "multi_tensor_unscale_": (_unscale_ref, _no_output_fake),
    "multi_tensor_unscale_copy_": (_unscale_copy_ref, _no_output_fake),
    "multi_tensor_axpby_": (_axpby_ref, _no_output_fake),
    "multi_tensor_l2norm": (_l2norm_ref, _l2norm_fake),
    "multi_tensor_copy_": (_copy_ref, _no_output_fake),
    "multi_tensor_unscale_l2norm": (_unscale_l2norm_ref, _unscale_l2norm_fake),
    "update_scale_hysteresis": (_update_scale_hysteresis_ref, _no_output_fake),
    "loss_scale_update_": (_loss_scale_update_ref, _no_output_fake),
}
register(_SCHEMAS, {name: body for name, (body, _) in _REFERENCE.items()},
         {name: fake for name, (_, fake) in _REFERENCE.items()})


def multi_tensor_unscale_(tensors: list[Tensor], found_inf: Tensor, inv_scale: Tensor) -> None:
    """Multiply every tensor by ``inv_scale`` in place, and flag non-finite inputs.

    Args:
        tensors (list of Tensor): tensors to unscale in place (any floating dtype).
        found_inf (Tensor): one-element float tensor, set to 1.0 if any input
            element is inf or NaN. Never cleared.
        inv_scale (Tensor): one-element float tensor holding ``1 / scale``.

    Example::

        >>> grads = [torch.full((2,), 65536.0), torch.full((3,), 65536.0, dtype=torch.bfloat16)]
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

        >>> model.bfloat16()(x.bfloat16()).float().pow(2).mean().backward()
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

        >>> grads = [torch.full((4,), 65536.0), torch.full((12,), 65536.0)]
        >>> total, _ = multi_tensor_unscale_l2norm(grads, torch.full((1,), 1 / 65536.0))
        >>> total
        tensor(4.)
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


def loss_scale_update_(state: Tensor, inv_scale: Tensor, scale: Tensor, found_inf: Tensor,
                       overflow: Tensor, *, scale_window: float, floor: float,
                       floor_is_min: bool, max_scale: float, dynamic: bool,
                       max_consecutive: float) -> None:
    """One update of amp's loss scale, on the device (:meth:`amp_patch.scaler.AmpScaler.update_on_device`).

    ``state`` holds :data:`LOSS_SCALE_FIELDS` in float64. An overflow
    (``found_inf`` non-zero, NaN included) halves a dynamic scale, not below
    ``floor``; an overflow that would take it below (or, with ``floor_is_min``,
    one at the floor) is a collapse, and the scale holds. ``scale_window`` clean
    updates double it, up to ``max_scale``. A static scale holds, and more than
    ``max_consecutive`` overflows in a row are a collapse. The counts follow,
    ``inv_scale`` (``1 / scale`` in float64, rounded once) and ``scale`` (fp32)
    are written, ``overflow`` receives this update's flag and ``found_inf`` is
    cleared. Nothing is read back to the host.

    Args:
        state (Tensor): float64, 7 elements, updated in place.
        inv_scale (Tensor): one-element float32, written.
        scale (Tensor): one-element (or 0-dim) float32, written.
        found_inf (Tensor): one-element float32 flag, read, then cleared.
        overflow (Tensor): one-element float32, written with 1.0 on overflow, else 0.0.
        scale_window (float): clean updates before a dynamic scale doubles.
        floor (float): the floor of a dynamic scale.
        floor_is_min (bool): the floor is the user's ``min_loss_scale`` (reachable).
        max_scale (float): the ceiling of a dynamic scale.
        dynamic (bool): dynamic or static scaling.
        max_consecutive (float): a static scale's overflows in a row allowed.

    Example::

        >>> state = torch.tensor([65536.0, 0, 0, 0, 0, 0, 0], dtype=torch.float64)
        >>> inv, scale, flag, out = torch.ones(1), torch.ones(()), torch.ones(1), torch.zeros(1)
        >>> loss_scale_update_(state, inv, scale, flag, out, scale_window=2000, floor=2.0**-24,
        ...                    floor_is_min=False, max_scale=2.0**24, dynamic=True,
        ...                    max_consecutive=50)
        >>> scale.item(), out.item(), flag.item()
        (32768.0, 1.0, 0.0)
    """
    _ops.loss_scale_update_(state, inv_scale, scale, found_inf, overflow, scale_window, floor,
                            floor_is_min, max_scale, dynamic, max_consecutive)
