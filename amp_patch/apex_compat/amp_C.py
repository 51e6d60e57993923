"""An ``amp_C``-compatible module: Apex's fused multi-tensor kernels, over amp_patch's ops.

The functions keep Apex's signatures (``chunk_size`` first, then ``noop_flag``,
an int tensor that is set to 1 when a checked input holds an inf or NaN and is
never cleared), so scripts that call them through
:data:`amp_patch.multi_tensor_applier` keep working unchanged. They run on any
device amp_patch's ops do, group tensors by device, and never sync with the
host.

Unlike Apex's kernels, these accept lists that mix fp32, fp16, bf16 and fp64.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
from torch import Tensor

from amp_patch import ops

__all__ = [
    "multi_tensor_scale",
    "multi_tensor_axpby",
    "multi_tensor_l2norm",
    "multi_tensor_unscale_l2norm",
    "update_scale_hysteresis",
]


def _by_device(n: int, lists: Sequence[Sequence[Tensor]]) -> dict[torch.device, list[int]]:
    groups: dict[torch.device, list[int]] = {}
    for i in range(n):
        groups.setdefault(lists[0][i].device, []).append(i)
    return groups


def _check_lengths(name: str, lists: Sequence[Sequence[Tensor]], expected: int) -> None:
    if len(lists) != expected:
        raise RuntimeError(f"amp_C.{name}: expected {expected} tensor lists, got {len(lists)}")
    lengths = {len(lst) for lst in lists}
    if len(lengths) > 1:
        raise RuntimeError(f"amp_C.{name}: tensor lists differ in length ({sorted(lengths)})")


def _flagged(noop_flag: Tensor, per_device: Callable[[torch.device, list[int], Tensor], None],
             groups: dict[torch.device, list[int]]) -> None:
    """Run ``per_device(device, indices, found_inf)`` per group and fold found_inf into noop_flag."""
    for device, idx in groups.items():
        found_inf = torch.zeros(1, dtype=torch.float32, device=device)
        per_device(device, idx, found_inf)
        # masked_fill_ with a device mask queues work; it does not read the flag on the host.
        noop_flag.masked_fill_((found_inf > 0).to(noop_flag.device), 1)


def _scalar(value: float, device: torch.device) -> Tensor:
    return torch.full((1,), value, dtype=torch.float32, device=device)


def multi_tensor_scale(chunk_size: int, noop_flag: Tensor, tensor_lists: Sequence[Sequence[Tensor]],
                       scale: float) -> None:
    """``dst[i] = src[i] * scale`` in fp32, rounded once to ``dst``'s dtype.

    Args:
        chunk_size (int): ignored (amp_patch's kernels chunk by themselves).
        noop_flag (Tensor): one-element int tensor, set to 1 on inf/NaN in ``src``.
        tensor_lists (list): ``[src, dst]``, two lists of same-shaped tensors.
        scale (float): the multiplier.

    Example::

        >>> multi_tensor_applier(amp_C.multi_tensor_scale, noop, [model_grads, master_grads], 1 / 1024)
    """
    _check_lengths("multi_tensor_scale", tensor_lists, 2)
    src, dst = tensor_lists

    def run(device: torch.device, idx: list[int], found_inf: Tensor) -> None:
        ops.multi_tensor_unscale_copy_([src[i] for i in idx], [dst[i] for i in idx], found_inf,
                                       _scalar(scale, device))

    _flagged(noop_flag, run, _by_device(len(src), tensor_lists))


def multi_tensor_axpby(chunk_size: int, noop_flag: Tensor, tensor_lists: Sequence[Sequence[Tensor]],
                       a: float, b: float, arg_to_check: int) -> None:
    """``out[i] = a * x[i] + b * y[i]`` in fp32, rounded once to ``out``'s dtype.

    Args:
        chunk_size (int): ignored (amp_patch's kernels chunk by themselves).
        noop_flag (Tensor): one-element int tensor, set to 1 on inf/NaN in the checked input.
        tensor_lists (list): ``[x, y, out]``; ``out`` may be ``y`` (or ``x``) itself.
        a (float): coefficient of ``x``.
        b (float): coefficient of ``y``.
        arg_to_check (int): which input to check: 0 for ``x``, 1 for ``y``, -1 for both.

    Example::

        >>> multi_tensor_applier(amp_C.multi_tensor_axpby, noop, [grads, acc, acc], 1 / 1024, 1.0, 0)
    """
    _check_lengths("multi_tensor_axpby", tensor_lists, 3)
    if arg_to_check not in (-1, 0, 1):
        raise RuntimeError(f"amp_C.multi_tensor_axpby: arg_to_check must be -1, 0 or 1, got {arg_to_check}")
    x, y, out = tensor_lists
    # The op computes acc = c1 * checked + c2 * acc in place and checks `checked`,
    # so acc starts as an exact fp32 copy of the other input (fp16/bf16 widen exactly).
    checked, other, c_checked, c_other = (y, x, b, a) if arg_to_check == 1 else (x, y, a, b)

    def run(device: torch.device, idx: list[int], found_inf: Tensor) -> None:
        acc = [out[i] if out[i].dtype == torch.float32 and out[i] is not checked[i]
               else torch.empty_like(out[i], dtype=torch.float32) for i in idx]
        if arg_to_check == -1:
            # Widening through unscale_copy_ with a scale of 1 is exact and also checks y.
            ops.multi_tensor_unscale_copy_([other[i] for i in idx], acc, found_inf, _scalar(1.0, device))
        else:
            pairs = [(other[i], a_) for i, a_ in zip(idx, acc) if other[i] is not a_]
            ops.multi_tensor_copy_([p[0] for p in pairs], [p[1] for p in pairs])
        ops.multi_tensor_axpby_([checked[i] for i in idx], acc, found_inf, c_checked, c_other)
        back = [(a_, out[i]) for i, a_ in zip(idx, acc) if a_ is not out[i]]
        ops.multi_tensor_copy_([p[0] for p in back], [p[1] for p in back])

    _flagged(noop_flag, run, _by_device(len(x), tensor_lists))


def _one_device(name: str, x: Sequence[Tensor]) -> None:
    devices = {t.device for t in x}
    if len(devices) > 1:
        raise RuntimeError(f"amp_C.{name}: tensors are on several devices ({sorted(map(str, devices))})")


def _flag_nonfinite_norm(noop_flag: Tensor, total: Tensor) -> None:
    # Apex's norm kernels set the flag when a chunk's sum of squares is not
    # finite; the total is then not finite either. A device mask: no host sync.
    noop_flag.masked_fill_(~torch.isfinite(total).to(noop_flag.device), 1)


def multi_tensor_l2norm(chunk_size: int, noop_flag: Tensor, tensor_lists: Sequence[Sequence[Tensor]],
                        per_tensor: bool | None = None) -> tuple[Tensor, Tensor]:
    """The L2 norm of all tensors together (and of each), accumulated in fp32.

    Args:
        chunk_size (int): ignored (amp_patch's kernels chunk by themselves).
        noop_flag (Tensor): one-element int tensor, set to 1 when the norm is
            not finite (an inf or NaN in the input, or a sum of squares past
            fp32's range), as Apex's kernel did. Never cleared.
        tensor_lists (list): ``[x]``, one list of tensors on one device.
        per_tensor (bool, optional): also return each tensor's norm; ``None``
            means False, as in Apex. Default: None.

    Returns:
        tuple of Tensor: ``(total_norm, per_tensor_norms)`` as in Apex: ``total_norm``
        has shape ``[1]``; ``per_tensor_norms`` has ``len(x)`` elements, or none
        when ``per_tensor`` is False.

    Example::

        >>> norm, _ = multi_tensor_applier(amp_C.multi_tensor_l2norm, noop, [grads], False)
    """
    _check_lengths("multi_tensor_l2norm", tensor_lists, 1)
    (x,) = tensor_lists
    _one_device("multi_tensor_l2norm", x)
    total, norms = ops.multi_tensor_l2norm(list(x), bool(per_tensor))
    _flag_nonfinite_norm(noop_flag, total)
    return total.reshape(1), norms


def multi_tensor_unscale_l2norm(chunk_size: int, noop_flag: Tensor, tensor_lists: Sequence[Sequence[Tensor]],
                                inv_scale: Tensor, per_tensor: bool | None = None) -> tuple[Tensor, Tensor]:
    """The L2 norm of ``x * inv_scale`` (and of each tensor), without changing ``x``.

    Each element is unscaled before it is squared, so the norm of scaled
    grads is that of the true grads even where the scaled squares would
    overflow.

    Args:
        chunk_size (int): ignored (amp_patch's kernels chunk by themselves).
        noop_flag (Tensor): one-element int tensor, set to 1 when the norm is
            not finite, as Apex's kernel did. Never cleared.
        tensor_lists (list): ``[x]``, one list of tensors on the device of ``inv_scale``.
        inv_scale (Tensor): one-element float32 tensor holding ``1 / scale``.
        per_tensor (bool, optional): also return each tensor's norm; ``None``
            means False, as in Apex. Default: None.

    Returns:
        tuple of Tensor: ``(total_norm [1], per_tensor_norms)``, as :func:`multi_tensor_l2norm`.

    Example::

        >>> inv = torch.full((1,), 1 / 65536.0, device="cuda")
        >>> norm, _ = multi_tensor_applier(amp_C.multi_tensor_unscale_l2norm, noop, [grads], inv, False)
    """
    _check_lengths("multi_tensor_unscale_l2norm", tensor_lists, 1)
    (x,) = tensor_lists
    _one_device("multi_tensor_unscale_l2norm", x)
    total, norms = ops.multi_tensor_unscale_l2norm(list(x), inv_scale, bool(per_tensor))
    _flag_nonfinite_norm(noop_flag, total)
    return total.reshape(1), norms


def update_scale_hysteresis(current_scale: Tensor, growth_tracker: Tensor, hysteresis_tracker: Tensor,
                            found_inf: Tensor, growth_factor: float, backoff_factor: float,
                            growth_interval: int, hysteresis: int) -> Tensor:
    """Apex's dynamic loss-scale step with hysteresis, on the device; returns ``current_scale``.

    See :func:`amp_patch.ops.update_scale_hysteresis` for the rules. As in
    Apex, whose kernels were built with ``--use_fast_math`` (denormals flushed
    to zero), a scale that would fall below fp32's smallest normal number
    (``torch.finfo(torch.float32).tiny``) becomes 0 at once: Apex's
    ``test_update_scale_hysteresis`` expects that, and this op's name promises
    Apex's behaviour. (:func:`amp_patch.ops.update_scale_hysteresis` itself
    keeps IEEE arithmetic, and goes through the denormals to zero.) The flush
    applies to the scale this op leaves, so a denormal scale passed in also
    comes out as 0.

    Args:
        current_scale (Tensor): one-element float32 scale, updated in place.
        growth_tracker (Tensor): one-element int32 count of clean steps, updated in place.
        hysteresis_tracker (Tensor): one-element int32 hysteresis left, updated in place.
        found_inf (Tensor): one-element float32 flag of this step.
        growth_factor (float): multiplier after ``growth_interval`` clean steps.
        backoff_factor (float): multiplier on an inf once the hysteresis is used up.
        growth_interval (int): clean steps between growths.
        hysteresis (int): inf steps tolerated before the scale backs off.

    Returns:
        Tensor: ``current_scale``, as Apex's returned it.

    Example::

        >>> scale = amp_C.update_scale_hysteresis(scale, growth, hyst, found_inf, 2.0, 0.5, 2000, 2)
    """
    ops.update_scale_hysteresis(current_scale, growth_tracker, hysteresis_tracker, found_inf,
                                growth_factor, backoff_factor, growth_interval, hysteresis)
    # Flush to zero on the device, with no host sync.
    denormal = current_scale.abs() < torch.finfo(torch.float32).tiny
    current_scale.masked_fill_(denormal, 0.0)
    return current_scale
