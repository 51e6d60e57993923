"""Casting policies and the wrapper factory.

A wrapper takes a policy and the :class:`~amp_patch.patching.state.CastState`
it reads; it knows nothing about the particular op. Method forms are wrapped
exactly like function forms: the wrapper is installed on the class, so
``self`` arrives as ``args[0]`` (uncast) and the saved unbound original is
called with the cast ``self``.

Every wrapper runs a tight pre-check over its arguments first and calls the
original untouched, allocating nothing, when no floating tensor needs a
cast. Only then does :func:`apply_policy` do the full work.

Two implementations make the same decisions:

- the Python wrapper built here, which is the whole policy;
- when the compiled extension is loaded, ``amp_patch._C.CastWrapper``
  (csrc/o1_wrappers.cpp) around it: it scans, casts and looks weights up in
  the weight cache in C, and hands the Python wrapper whatever it does not
  handle itself (nested containers that need casts, tensor subclasses, an
  active TorchFunctionMode, refusals). ``AMP_PATCH_NO_EXT=1`` or a missing
  extension leaves the Python wrapper alone.

Under ``torch.compile`` (:func:`torch.compiler.is_compiling`) a wrapper
lowers to plain casts with the same decisions and no weight cache: the
cache's validity checks read version counters and storage addresses, which
would make the graph depend on data. The compiled graph holds the casts
themselves, so each weight is cast once per graph run, as autocast does.
Dynamo traces the Python wrapper in place of the C one.
"""

from __future__ import annotations

import enum
import functools
from typing import Any, Callable

import torch

from amp_patch import ops as _ops
from amp_patch.settings.dtypes import CASTABLE_DTYPES, HALF_DTYPES

__all__ = ["Policy", "make_wrapper", "apply_policy", "native_available", "promotes_natively"]

_Tensor = torch.Tensor
_FP32 = torch.float32
_SEQUENCES = (list, tuple)
#: For each castable dtype, the other castable dtypes: what an in-place op would cast.
_OTHERS = {d: CASTABLE_DTYPES - {d} for d in CASTABLE_DTYPES}
#: Returned by :func:`_promote_scan` once two floating dtypes were seen.
_MIXED = object()


class Policy(enum.Enum):
    """How a wrapper casts the floating tensors among an op's arguments."""

    HALF = "half"
    FP32 = "fp32"
    PROMOTE = "promote"
    SEQUENCE_PROMOTE = "sequence_promote"
    BANNED = "banned"
    IN_PLACE_FP32 = "in_place_fp32"
    IN_PLACE = "in_place"


#: The policy codes of ``amp_patch._C.CastWrapper`` (the order of its ``Policy`` enum).
_NATIVE_POLICY = {p: i for i, p in enumerate(Policy)}
#: The C wrapper's code for ``PROMOTE`` with native promotion (:func:`promotes_natively`).
_NATIVE_PROMOTE = len(_NATIVE_POLICY)
_compiling = torch.compiler.is_compiling


def _native_type():
    if not _ops.native_extension_loaded():
        return None
    from amp_patch import _C  # not at the top: the compiled extension is optional
    return getattr(_C, "CastWrapper", None)


#: ``amp_patch._C.CastWrapper``, or None without the extension (AMP_PATCH_NO_EXT=1).
_CastWrapper = _native_type()
#: Whether new wrappers use the C fast path; tests switch it to compare both paths.
_use_native = _CastWrapper is not None


def native_available() -> bool:
    """Whether the O1 wrappers have their C fast path (the compiled extension is loaded).

    Returns:
        bool: False under ``AMP_PATCH_NO_EXT=1`` or without a built extension;
        the Python wrappers then make the same decisions.

    Example::

        >>> amp_patch.patching.wrappers.native_available()
        True
    """
    return _CastWrapper is not None


def _collect(obj: Any, found: set) -> None:
    """Add the castable floating dtypes in ``obj`` (tensors, nested lists/tuples/dicts) to
    ``found``."""
    if isinstance(obj, _Tensor):
        if obj.dtype in CASTABLE_DTYPES:
            found.add(obj.dtype)
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            _collect(item, found)
    elif isinstance(obj, dict):
        for item in obj.values():
            _collect(item, found)


def _needs_cast(items, needs: frozenset) -> bool:
    """Whether any tensor in ``items`` (nested lists/tuples/dicts too) has a dtype in ``needs``.

    The wrappers' pre-check: it allocates nothing and returns at the first hit.
    """
    for a in items:
        if isinstance(a, _Tensor):
            if a.dtype in needs:
                return True
        elif isinstance(a, _SEQUENCES):
            if _needs_cast(a, needs):
                return True
        elif isinstance(a, dict):
            if _needs_cast(a.values(), needs):
                return True
    return False


def _promote_scan(items, first):
    """The one castable dtype among ``items`` (or ``first``, None if none), or ``_MIXED``."""
    for a in items:
        if isinstance(a, _Tensor):
            d = a.dtype
            if d in CASTABLE_DTYPES:
                if first is None:
                    first = d
                elif d is not first:
                    return _MIXED
        elif isinstance(a, _SEQUENCES):
            first = _promote_scan(a, first)
            if first is _MIXED:
                return _MIXED
        elif isinstance(a, dict):
            first = _promote_scan(a.values(), first)
            if first is _MIXED:
                return _MIXED
    return first


#: The C conversion methods: cheaper to call than ``Tensor.to(dtype)`` (no argument
#: parsing) and, being TensorBase's own, never the patched versions.
_CONVERT = {
    torch.float32: torch._C.TensorBase.float,
    torch.float16: torch._C.TensorBase.half,
    torch.bfloat16: torch._C.TensorBase.bfloat16,
}


def _cast_items(items, dtype: torch.dtype, cache) -> list | None:
    """``items`` as a new list with each castable floating tensor of another dtype cast
    to ``dtype``, or None when none needed a cast (nothing is allocated then).

    fp32 leaves that require grad go through the weight cache when ``cache`` is
    given; nested containers are rebuilt by :func:`_cast`. Scanning and casting
    in one pass keeps the wrappers' cast path to a single loop.
    """
    needs = _OTHERS[dtype]
    out = None
    i = 0
    for a in items:
        if isinstance(a, _Tensor):
            d = a.dtype
            if d in needs:
                if out is None:
                    out = list(items)
                if cache is not None and d is _FP32 and a.requires_grad and a.is_leaf:
                    out[i] = cache.lookup(a, dtype)
                else:
                    out[i] = _CONVERT[dtype](a)
        elif isinstance(a, (list, tuple, dict)):
            cast = _cast(a, dtype, cache)
            if cast is not a:
                if out is None:
                    out = list(items)
                out[i] = cast
        i += 1
    return out


def _cast(obj: Any, dtype: torch.dtype, cache) -> Any:
    """``obj`` with every castable floating tensor of another dtype cast to ``dtype``.

    Containers are rebuilt with their own type (namedtuples included) when
    something inside was cast; otherwise ``obj`` itself comes back.
    """
    if isinstance(obj, _Tensor):
        items = _cast_items((obj,), dtype, cache)
        return obj if items is None else items[0]
    if isinstance(obj, dict):
        items = _cast_items(obj.values(), dtype, cache)
        return obj if items is None else type(obj)(zip(obj.keys(), items))
    if isinstance(obj, (list, tuple)):
        items = _cast_items(obj, dtype, cache)
        if items is None:
            return obj
        if isinstance(obj, list):
            return items
        return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
    return obj


def _inputs(kwargs: dict) -> list:
    """The keyword arguments that are inputs: an ``out=`` tensor receives the result,
    so it is never cast (a cast copy would get the result instead of the caller's
    tensor) and its dtype takes no part in the casting decision."""
    return [v for k, v in kwargs.items() if k != "out"]


def _cast_args(args: tuple, kwargs: dict, dtype: torch.dtype, cache) -> tuple[tuple, dict]:
    """``args`` and ``kwargs`` (but ``out``) with their castable floating tensors cast to
    ``dtype``."""
    items = _cast_items(args, dtype, cache)
    if items is not None:
        args = tuple(items)
    if kwargs:
        keys = [k for k in kwargs if k != "out"]
        items = _cast_items([kwargs[k] for k in keys], dtype, cache)
        if items is not None:
            kwargs = {**kwargs, **dict(zip(keys, items))}
    return args, kwargs


def promotes_natively(args: tuple, kwargs: dict) -> bool:
    """Whether torch's own type promotion gives an op of
    :data:`~amp_patch.patching.lists.NATIVE_PROMOTION` what casting to the widest dtype would.

    True for exactly two tensors, both fp32, fp16 or bf16 and both 0-dim or
    neither (a 0-dim tensor does not promote a dimensioned one), with nothing
    nested: the op then widens each element exactly and computes in the wider
    dtype, and autograd narrows each grad to its input's dtype, as the cast's
    backward would. The C wrapper applies the same rule (``csrc/o1_wrappers.cpp``).

    Args:
        args (tuple): the op's positional arguments.
        kwargs (dict): its keyword arguments (``out=`` is not an input).

    Example::

        >>> a, b = torch.ones(2), torch.ones(2, dtype=torch.bfloat16)
        >>> promotes_natively((a, b), {}), promotes_natively((a, b[0]), {})
        (True, False)
    """
    tensors = []
    for a in (*args, *_inputs(kwargs)) if kwargs else args:
        if isinstance(a, _Tensor):
            if a.dtype not in CASTABLE_DTYPES:
                return False
            tensors.append(a)
        elif isinstance(a, (*_SEQUENCES, dict)):
            return False
    return len(tensors) == 2 and (tensors[0].dim() == 0) == (tensors[1].dim() == 0)


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
        NotImplementedError: a banned op got a half argument (without
            ``allow_banned``), or an fp32 op was called in place on a half
            tensor. Apex raised this type; it is a RuntimeError too.
    """
    # Under torch.compile the graph holds the casts: no weight cache (see the module docstring).
    cache = None if _compiling() else state.cache
    if policy is Policy.HALF:
        target = state.half_dtype
    elif policy is Policy.FP32 or policy is Policy.BANNED:
        if policy is Policy.BANNED and not state.allow_banned:
            found: set = set()
            _collect(args, found)
            _collect(_inputs(kwargs), found)
            half = found & HALF_DTYPES
            if half:
                text = message or (f"{name} is banned under O1 for half inputs ({{dtype}}); "
                                   "pass allow_banned=True to run it in fp32")
                raise NotImplementedError("amp_patch O1: " + text.format(dtype=min(map(str, half))))
        target = _FP32
    elif policy is Policy.PROMOTE or policy is Policy.SEQUENCE_PROMOTE:
        found = set()
        if policy is Policy.SEQUENCE_PROMOTE:
            _collect(args[0] if args else kwargs.get("tensors", ()), found)
        else:
            _collect(args, found)
            _collect(_inputs(kwargs), found)
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
        if not isinstance(this, _Tensor) or this.dtype not in CASTABLE_DTYPES:
            return fn(*args, **kwargs)
        if policy is Policy.IN_PLACE_FP32 and this.dtype in HALF_DTYPES:
            raise NotImplementedError(
                f"amp_patch O1: {name} runs in fp32, so its in-place form cannot store the "
                f"result in a {this.dtype} tensor; use the out-of-place form "
                f"({name.rstrip('_').replace('__i', '__')}) instead"
            )
        rest, kwargs = _cast_args(args[1:], kwargs, this.dtype, None)
        return fn(this, *rest, **kwargs)
    args, kwargs = _cast_args(args, kwargs, target, cache)
    return fn(*args, **kwargs)


def _python_wrapper(policy: Policy, original: Callable, state, name: str,
                    message: str | None, native_promotion: bool = False) -> Callable:
    """The whole policy in Python: the fallback of the C wrapper, and the wrapper without it."""
    if policy is Policy.HALF or policy is Policy.FP32:
        target = state.half_dtype if policy is Policy.HALF else _FP32
        needs = _OTHERS[target] if policy is Policy.HALF else HALF_DTYPES
        cache = state.cache

        # The commonest wrappers scan and cast in one pass, skipping apply_policy.
        def wrapper(*args, **kwargs):
            if state.enabled:
                if _compiling():
                    return apply_policy(policy, original, state, name, args, kwargs, message)
                cast = _cast_items(args, target, cache)
                if kwargs and _needs_cast(_inputs(kwargs), needs):
                    args, kwargs = _cast_args(args, kwargs, target, cache)
                    return original(*args, **kwargs)
                if cast is not None:
                    return original(*cast, **kwargs)
            return original(*args, **kwargs)
    elif policy is Policy.BANNED:
        needs = HALF_DTYPES

        def wrapper(*args, **kwargs):
            if state.enabled and (_needs_cast(args, needs)
                                  or (kwargs and _needs_cast(_inputs(kwargs), needs))):
                return apply_policy(policy, original, state, name, args, kwargs, message)
            return original(*args, **kwargs)
    elif policy is Policy.PROMOTE:
        def wrapper(*args, **kwargs):
            if state.enabled:
                first = _promote_scan(args, None)
                if kwargs and first is not _MIXED:
                    first = _promote_scan(_inputs(kwargs), first)
                if first is _MIXED and not (native_promotion
                                            and promotes_natively(args, kwargs)):
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
                if isinstance(this, _Tensor) and this.dtype in CASTABLE_DTYPES:
                    needs = _OTHERS[this.dtype]
                    if ((policy is Policy.IN_PLACE_FP32 and this.dtype is not _FP32)
                            or _needs_cast(args[1:], needs)
                            or (kwargs and _needs_cast(_inputs(kwargs), needs))):
                        return apply_policy(policy, original, state, name, args, kwargs, message)
            return original(*args, **kwargs)
    _describe(wrapper, original, policy)
    return wrapper


def _describe(wrapper: Any, original: Callable, policy: Policy) -> None:
    try:
        functools.update_wrapper(wrapper, original)
    except (AttributeError, TypeError):
        wrapper.__wrapped__ = original
    wrapper._amp_patch_policy = policy


def make_wrapper(policy: Policy, original: Callable, state, name: str,
                 message: str | None = None, native_promotion: bool = False) -> Callable:
    """A function that applies ``policy`` around ``original``, reading ``state`` on every call.

    With the compiled extension this is an ``amp_patch._C.CastWrapper``
    (see the module docstring), else the Python wrapper; both bind like
    functions when installed on a class.

    Args:
        policy (Policy): the casting rule.
        original (callable): the function or unbound method being replaced.
        state (CastState): read on every call (``enabled``, ``half_dtype``, ``cache``).
        name (str): the op's qualified name, for error messages.
        message (str, optional): the error text of a banned op.
        native_promotion (bool, optional): a ``PROMOTE`` op of
            :data:`~amp_patch.patching.lists.NATIVE_PROMOTION`: called uncast
            where :func:`promotes_natively`. Default: False.

    Returns:
        callable: the wrapper, carrying ``original`` as ``__wrapped__``.

    Example::

        >>> from amp_patch.patching.state import CastState
        >>> state = CastState(torch.bfloat16)
        >>> wrapper = make_wrapper(Policy.FP32, torch.exp, state, "torch.exp")
        >>> wrapper(torch.ones(2, dtype=torch.bfloat16)).dtype
        torch.float32
    """
    native_promotion = native_promotion and policy is Policy.PROMOTE
    fallback = _python_wrapper(policy, original, state, name, message, native_promotion)
    if not _use_native or _CastWrapper is None:
        return fallback
    target = (state.half_dtype if policy is Policy.HALF
              else _FP32 if policy is Policy.FP32 else None)
    code = _NATIVE_PROMOTE if native_promotion else _NATIVE_POLICY[policy]
    wrapper = _CastWrapper(original, fallback, state, state.cache, code, target)
    _describe(wrapper, original, policy)
    # Dynamo cannot trace into C: this (the protocol of torch.jit.script_if_tracing)
    # makes it trace the Python wrapper, which lowers to plain casts under compile.
    setattr(wrapper, "__script_if_tracing_wrapper", True)
    setattr(wrapper, "__original_fn", fallback)
    return wrapper
