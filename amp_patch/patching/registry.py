"""User functions under O1: decorators and registrations for the next O1 ``initialize``."""

from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple

from amp_patch.patching import state as _state
from amp_patch.patching.wrappers import Policy, apply_policy

__all__ = [
    "half_function", "float_function", "promote_function",
    "register_half_function", "register_float_function", "register_promote_function",
    "Registration", "REGISTRY",
]


class Registration(NamedTuple):
    """An attribute to patch with a policy at the next install."""

    target: Any
    name: str
    policy: Policy


class Registry:
    """The registered user functions, waiting for the next O1 ``initialize``.

    As with Apex's ``amp.init()``, the O1 :func:`amp_patch.initialize` (or
    legacy :func:`amp_patch.init`) that patches the registrations also
    forgets them (:meth:`consume`): a later session patches them only if they
    are registered again. An ``initialize`` at another level leaves them
    waiting. On an attribute that an O1 list also names (``torch.mm``), the
    registration's policy is the only one applied; the other spellings of
    that op (``torch.Tensor.mm``) keep the list's.
    """

    def __init__(self) -> None:
        self.entries: list[Registration] = []

    def add(self, target: Any, name: str, policy: Policy) -> None:
        """Register ``target.<name>`` for ``policy``.

        Raises:
            ValueError: if ``target`` has no attribute ``name``.
        """
        if not isinstance(name, str) or not hasattr(target, name):
            owner = getattr(target, "__name__", type(target).__name__)
            raise ValueError(f"{owner} has no attribute {name!r} to register for O1 casting")
        self.entries.append(Registration(target, name, policy))

    def consume(self) -> list[Registration]:
        """Return the registrations and forget them (what an O1 install does)."""
        entries, self.entries = self.entries, []
        return entries

    def clear(self) -> None:
        """Forget every registration (the running session keeps its patches)."""
        self.entries.clear()


#: The process-wide registrations read by :func:`amp_patch.patching.install`.
REGISTRY = Registry()


def _decorator(policy: Policy) -> Callable[[Callable], Callable]:
    def decorate(fn: Callable) -> Callable:
        name = getattr(fn, "__qualname__", repr(fn))

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            casts = _state.active()
            if casts is None or not casts.enabled:
                return fn(*args, **kwargs)
            return apply_policy(policy, fn, casts, name, args, kwargs)
        return wrapper
    return decorate


half_function = _decorator(Policy.HALF)
half_function.__doc__ = """Decorate a function so that, under O1, its floating tensor args are cast
to ``half_dtype``.

Tensors nested in lists, tuples and dicts are cast too; fp32 leaves that
require grad go through the weight cache. Outside an O1 session (and inside
:func:`~amp_patch.disable_casts`) the function runs untouched.

Args:
    fn (callable): the function, e.g. a custom op or an extension's entry point.

Returns:
    callable: the decorated function.

Example::

    >>> @amp.half_function
    ... def fused_gemm(a, b):
    ...     return my_ext.gemm(a, b)
"""

float_function = _decorator(Policy.FP32)
float_function.__doc__ = """Decorate a function so that, under O1, its floating tensor args are cast
to fp32.

Tensors nested in lists, tuples and dicts are cast too. Outside an O1
session the function runs untouched.

Args:
    fn (callable): the function.

Returns:
    callable: the decorated function.

Example::

    >>> @amp.float_function
    ... def my_softmax(x):
    ...     return my_ext.softmax(x)
"""

promote_function = _decorator(Policy.PROMOTE)
promote_function.__doc__ = """Decorate a function so that, under O1, mixed floating args are cast to
the widest.

fp32 is wider than fp16 and bf16; fp16 with bf16 gives fp32. Args of a
single floating dtype are left alone. Outside an O1 session the function
runs untouched.

Args:
    fn (callable): the function.

Returns:
    callable: the decorated function.

Example::

    >>> @amp.promote_function
    ... def my_add(a, b):
    ...     return my_ext.add(a, b)
"""


def register_half_function(module: Any, name: str) -> None:
    """Register ``module.<name>`` to be patched with the half policy by the next
    :func:`~amp_patch.initialize`.

    The next O1 :func:`~amp_patch.initialize` patches it and forgets the
    registration; on a name an O1 list also patches, it replaces the list's
    policy for that attribute (see :class:`Registry`).

    Args:
        module (module or class): where the function lives.
        name (str): its attribute name.

    Raises:
        ValueError: if ``module`` has no attribute ``name``.

    Example::

        >>> import types
        >>> my_ext = types.SimpleNamespace(gemm=torch.mm)   # a user's extension module
        >>> amp.register_half_function(my_ext, "gemm")
        >>> model, opt = amp.initialize(model, opt, opt_level="O1")
    """
    REGISTRY.add(module, name, Policy.HALF)


def register_float_function(module: Any, name: str) -> None:
    """Register ``module.<name>`` to be patched with the fp32 policy by the next
    :func:`~amp_patch.initialize`.

    The next O1 :func:`~amp_patch.initialize` patches it and forgets the
    registration; on a name an O1 list also patches, it replaces the list's
    policy for that attribute (see :class:`Registry`).

    Args:
        module (module or class): where the function lives.
        name (str): its attribute name.

    Raises:
        ValueError: if ``module`` has no attribute ``name``.

    Example::

        >>> amp.register_float_function(torch, "sigmoid")
    """
    REGISTRY.add(module, name, Policy.FP32)


def register_promote_function(module: Any, name: str) -> None:
    """Register ``module.<name>`` to be patched with the promote policy by the next
    :func:`~amp_patch.initialize`.

    The next O1 :func:`~amp_patch.initialize` patches it and forgets the
    registration; on a name an O1 list also patches, it replaces the list's
    policy for that attribute (see :class:`Registry`).

    Args:
        module (module or class): where the function lives.
        name (str): its attribute name.

    Raises:
        ValueError: if ``module`` has no attribute ``name``.

    Example::

        >>> amp.register_promote_function(torch, "maximum")
    """
    REGISTRY.add(module, name, Policy.PROMOTE)
