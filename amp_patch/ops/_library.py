"""The ``amp_patch`` op library: one namespace, the checks the reference bodies share, the kernels.

Every op of :mod:`amp_patch.ops` is defined through :func:`register`, which
gives it its schema, its pure-PyTorch reference body (registered as
``CompositeExplicitAutograd``) and its fake kernel, in one call per table.
The compiled library ``amp_patch._C`` then registers C++ kernels for ``CPU``
(and ``CUDA``) under the same names; :func:`load_native` loads it once all
ops are defined.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Mapping, Sequence

import torch
from torch import Tensor

__all__ = ["NAMESPACE", "register", "load_native", "native_extension_loaded", "has_native_kernel"]

logger = logging.getLogger("amp_patch")

NAMESPACE = "amp_patch"
_lib = torch.library.Library(NAMESPACE, "DEF")
_ops = getattr(torch.ops, NAMESPACE)


def _no_output_fake(*args, **kwargs) -> None:
    return None


def register(schemas: Mapping[str, str], bodies: Mapping[str, Callable[..., Any]],
             fakes: Mapping[str, Callable[..., Any]] | None = None) -> None:
    """Define each op of ``schemas`` with its reference body and its fake kernel.

    Args:
        schemas (dict): op name -> schema string, without the namespace.
        bodies (dict): op name -> reference body (pure PyTorch), for every op of ``schemas``.
        fakes (dict, optional): op name -> fake kernel for ops that return tensors;
            the others get one that returns None.
    """
    fakes = fakes or {}
    for name, schema in schemas.items():
        _lib.define(schema)
        _lib.impl(name, bodies[name], "CompositeExplicitAutograd")
        torch.library.register_fake(f"{NAMESPACE}::{name}", fakes.get(name, _no_output_fake),
                                    lib=_lib)


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
    far_any: tuple | None = None
    far_written: tuple | None = None
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


def _load_native() -> bool:
    # Prebuilt amp_patch._C when it matches this torch, else compiled just in time
    # (amp_patch/_native.py); False: the reference bodies serve.
    from amp_patch import _native

    return _native.load().loaded


_NATIVE_LOADED = False


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


def load_native() -> bool:
    """Load ``amp_patch._C`` (its kernels take precedence over the reference bodies); once.

    Returns:
        bool: whether the compiled kernels serve the ops.
    """
    global _NATIVE_LOADED
    _NATIVE_LOADED = _load_native()
    return _NATIVE_LOADED
