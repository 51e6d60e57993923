"""Casting policies and the wrapper factory.

A wrapper takes a policy and the :class:`~amp_patch.patching.state.CastState`
it reads; it knows nothing about the particular op. Method forms are wrapped
exactly like function forms: the wrapper is installed on the class, so
``self`` arrives as ``args[0]`` (uncast) and the saved unbound original is
called with the cast ``self``.

Every wrapper runs a tight pre-check over its positional arguments first and
calls the original untouched, allocating nothing, when no floating tensor
needs a cast. Only then does :func:`apply_policy` do the full work.
"""

from __future__ import annotations

import enum
import functools
from typing import Any, Callable

import torch

from amp_patch.patching.cache import cacheable

__all__ = ["Policy", "make_wrapper", "apply_policy", "CASTABLE"]

_Tensor = torch.Tensor
_FP32 = torch.float32
_HALVES = frozenset((torch.float16, torch.bfloat16))
#: The only dtypes that O1 ever casts from or to.
CASTABLE = frozenset((torch.float16, torch.bfloat16, torch.float32))
_CONTAINERS = (list, tuple, dict)


class Policy(enum.Enum):
    """How a wrapper casts the floating tensors among an op's arguments."""

    HALF = "half"
    FP32 = "fp32"
    PROMOTE = "promote"
    SEQUENCE_PROMOTE = "sequence_promote"
    BANNED = "banned"
    IN_PLACE_FP32 = "in_place_fp32"
    IN_PLACE = "in_place"


def _collect(obj: Any, found: set) -> None:
    """Add the castable floating dtypes in ``obj`` (tensors, nested lists/tuples/dicts) to ``found``."""
    if isinstance(obj, _Tensor):
        if obj.dtype in CASTABLE:
            found.add(obj.dtype)
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            _collect(item, found)
    elif isinstance(obj, dict):
        for item in obj.values():
            _collect(item, found)


def _cast(obj: Any, dtype: torch.dtype, cache) -> Any:
    """``obj`` with every castable floating tensor of another dtype cast to ``dtype``.

    Containers are rebuilt with their own type (namedtuples included); fp32
    leaves that require grad go through the weight cache when casting down.
    """
    if isinstance(obj, _Tensor):
        if obj.dtype is dtype or obj.dtype not in CASTABLE:
            return obj
        if cache is not None and cacheable(obj):
            return cache.cast(obj, dtype)
        return obj.to(dtype)
    if isinstance(obj, list):
        return [_cast(item, dtype, cache) for item in obj]
    if isinstance(obj, tuple):
        items = [_cast(item, dtype, cache) for item in obj]
        return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
    if isinstance(obj, dict):
        return type(obj)((k, _cast(v, dtype, cache)) for k, v in obj.items())
    return obj


def _widest(dtypes: set) -> torch.dtype:
    # fp16 and bf16 together have no common half type: torch promotes them to fp32.
    return _FP32 if len(dtypes) > 1 else next(iter(dtypes))


def apply_policy(policy: Policy, fn: Callable, state, name: str, args: tuple,
                 kwargs: dict, message: str | None = None) -> Any:
    """Call ``fn(*args, **kwargs)`` with the casts that ``policy`` asks for.

    This is the complete path: it scans nested containers and kwargs too.
    The patched wrappers reach it only when their pre-check saw something to
    cast; the decorators of :mod:`amp_patch.patching.registry` always use it.

    Args:
        policy (Policy): the casting rule.
        fn (callable): the original function (an unbound method for Tensor methods).
        state (CastState): the session's casting state.
        name (str): the op's name, for error messages.
        args (tuple): positional arguments (``self`` first for methods).
        kwargs (dict): keyword arguments.
        message (str, optional): for a banned op, the error text; ``{dtype}``
            is replaced by the offending dtype.

    Raises:
        RuntimeError: a banned op got a half argument (without ``allow_banned``),
            or an fp32 op was called in place on a half tensor.
    """
    cache = state.cache
    if policy is Policy.HALF:
        target = state.half_dtype
    elif policy is Policy.FP32 or policy is Policy.BANNED:
        if policy is Policy.BANNED and not state.allow_banned:
            found: set = set()
            _collect(args, found)
            _collect(kwargs, found)
            half = found & _HALVES
            if half:
                text = message or (f"{name} is banned under O1 for half inputs ({{dtype}}); "
                                   "pass allow_banned=True to run it in fp32")
                raise RuntimeError("amp_patch O1: " + text.format(dtype=min(map(str, half))))
        target = _FP32
    elif policy is Policy.PROMOTE or policy is Policy.SEQUENCE_PROMOTE:
        found = set()
        if policy is Policy.SEQUENCE_PROMOTE:
            _collect(args[0] if args else kwargs.get("tensors", ()), found)
        else:
            _collect(args, found)
            _collect(kwargs, found)
        if len(found) < 2:
            return fn(*args, **kwargs)
        target = _widest(found)
        if policy is Policy.SEQUENCE_PROMOTE:
            if args:
                return fn(_cast(args[0], target, None), *args[1:], **kwargs)
            return fn(*args, **dict(kwargs, tensors=_cast(kwargs["tensors"], target, None)))
        cache = None
    else:
        this = args[0] if args else None
        if not isinstance(this, _Tensor) or this.dtype not in CASTABLE:
            return fn(*args, **kwargs)
        if policy is Policy.IN_PLACE_FP32 and this.dtype in _HALVES:
            raise RuntimeError(
                f"amp_patch O1: {name} runs in fp32, so its in-place form cannot store the "
                f"result in a {this.dtype} tensor; use the out-of-place form "
                f"({name.rstrip('_').replace('__i', '__')}) instead"
            )
        target = this.dtype
        return fn(this, *_cast(args[1:], target, None), **_cast(kwargs, target, None))
    return fn(*_cast(args, target, cache), **_cast(kwargs, target, cache))


def make_wrapper(policy: Policy, original: Callable, state, name: str,
                 message: str | None = None) -> Callable:
    """A function that applies ``policy`` around ``original``, reading ``state`` on every call.

    Args:
        policy (Policy): the casting rule.
        original (callable): the function or unbound method being replaced.
        state (CastState): read on every call (``enabled``, ``half_dtype``, ``cache``).
        name (str): the op's qualified name, for error messages.
        message (str, optional): the error text of a banned op.

    Returns:
        callable: the wrapper, carrying ``original`` as ``__wrapped__``.
    """
    if policy is Policy.HALF:
        needs = CASTABLE - {state.half_dtype}
    elif policy is Policy.FP32 or policy is Policy.BANNED:
        needs = _HALVES
    else:
        needs = None

    if needs is not None:
        def wrapper(*args, **kwargs):
            if state.enabled:
                for a in args:
                    if isinstance(a, _Tensor):
                        if a.dtype in needs:
                            break
                    elif isinstance(a, _CONTAINERS):
                        break
                else:
                    if not kwargs:
                        return original(*args)
                return apply_policy(policy, original, state, name, args, kwargs, message)
            return original(*args, **kwargs)
    elif policy is Policy.PROMOTE:
        def wrapper(*args, **kwargs):
            if state.enabled:
                first = None
                for a in args:
                    if isinstance(a, _Tensor):
                        d = a.dtype
                        if d in CASTABLE:
                            if first is None:
                                first = d
                            elif d is not first:
                                break
                    elif isinstance(a, _CONTAINERS):
                        break
                else:
                    if not kwargs:
                        return original(*args)
                return apply_policy(policy, original, state, name, args, kwargs, message)
            return original(*args, **kwargs)
    elif policy is Policy.SEQUENCE_PROMOTE:
        def wrapper(*args, **kwargs):
            if state.enabled:
                return apply_policy(policy, original, state, name, args, kwargs, message)
            return original(*args, **kwargs)
    else:
        def wrapper(*args, **kwargs):
            if state.enabled and args:
                this = args[0]
                if isinstance(this, _Tensor):
                    d = this.dtype
                    if d in CASTABLE:
                        if policy is Policy.IN_PLACE_FP32 and d is not _FP32:
                            return apply_policy(policy, original, state, name, args, kwargs, message)
                        for a in args[1:]:
                            if isinstance(a, _Tensor):
                                if a.dtype is not d and a.dtype in CASTABLE:
                                    break
                            elif isinstance(a, _CONTAINERS):
                                break
                        else:
                            if not kwargs:
                                return original(*args)
                        return apply_policy(policy, original, state, name, args, kwargs, message)
            return original(*args, **kwargs)

    try:
        functools.update_wrapper(wrapper, original)
    except (AttributeError, TypeError):
        wrapper.__wrapped__ = original
    wrapper._amp_patch_policy = policy
    return wrapper
