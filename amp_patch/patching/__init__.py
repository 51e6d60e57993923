"""O1: casting wrappers on torch functions and Tensor methods.

:func:`install` is what :func:`amp_patch.initialize` calls at O1. It makes
the session's :class:`~amp_patch.patching.state.CastState` (``session.casts``)
and patches every spelling of every listed op (:func:`spellings`: ``torch``,
``torch.nn.functional``, ``torch.Tensor``, ``torch.special``,
``torch.linalg``, the RNN kernels in ``torch._VF``) and the registered user
functions, recording every patch so that :func:`amp_patch.deinitialize`
restores the very same objects. A registration takes the place of the list's
wrapper on the attribute it names, and is consumed (see
:class:`~amp_patch.patching.registry.Registry`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from torch import nn

from amp_patch.patching import lists, rnn
from amp_patch.patching.dynamo import RULES as _DYNAMO_RULES
from amp_patch.patching.op_spellings import Spelling, spellings
from amp_patch.patching.patcher import Patcher
from amp_patch.patching.registry import REGISTRY
from amp_patch.patching.state import CastState, active, disable_casts, set_active
from amp_patch.patching.wrappers import Policy, make_wrapper

__all__ = ["install", "spellings", "Spelling", "CastState", "disable_casts"]

logger = logging.getLogger("amp_patch")


def install(half_dtype: torch.dtype, models: list[nn.Module], on_close: Callable[..., None], *,
            allow_banned: bool = False, enable_caching: bool = True) -> CastState:
    """Patch torch for O1 and register the undo with ``on_close``.

    Makes a new :class:`CastState` for ``half_dtype``, the :func:`active` one
    until the undo runs. The undo ("O1 patches") is registered before the
    first patch, so a failure part-way still leaves torch unpatched after
    :func:`amp_patch.deinitialize`; it also clears the cache and makes no
    state active.

    Args:
        half_dtype (torch.dtype): what the half list casts to.
        models (list of torch.nn.Module): the session's models (each forward
            without grad starts with fresh casts).
        on_close (callable): ``on_close(what, undo)`` registers an undo with the session.
        allow_banned (bool, optional): run banned functions in fp32 instead
            of raising. Default: False.
        enable_caching (bool, optional): use the weight-cast cache. Default: True.

    Returns:
        CastState: the state the wrappers read; its ``patches`` records the installed patches.

    Example::

        >>> undos = []
        >>> state = install(torch.bfloat16, [], lambda what, undo: undos.append(undo))
        >>> torch.mm(torch.ones(2, 2), torch.ones(2, 2)).dtype
        torch.bfloat16
        >>> for undo in reversed(undos):  # what the session's close does
        ...     _ = undo()
        >>> torch.mm(torch.ones(2, 2), torch.ones(2, 2)).dtype
        torch.float32
    """
    state = CastState(half_dtype, allow_banned=allow_banned, enable_caching=enable_caching)
    patcher = Patcher()
    state.patches = patcher
    dynamo_rules = None  # dynamo's maps once the patches are in (see patching/dynamo.py)

    def undo() -> None:
        try:
            patcher.undo_all()
        finally:
            state.close()  # a wrapper that outside code kept passes calls through from now on
            state.cache.clear()
            if active() is state:
                set_active(None)
            _DYNAMO_RULES.drop_if_rebuilt(dynamo_rules)

    set_active(state)
    on_close("O1 patches", undo)

    # scale_loss ends a training iteration and clears the cache; an evaluation
    # loop never calls it, and an edit through ``param.data`` (swapping in EMA
    # weights, say) moves no version counter. So each forward of a model run
    # without grad starts with fresh no_grad casts, as an autocast region would.
    def fresh_eval_casts(module, args) -> None:
        if not torch.is_grad_enabled():
            state.cache.drop_no_grad_entries()

    hooks = [model.register_forward_pre_hook(fresh_eval_casts) for model in models]
    def remove_hooks() -> None:
        for hook in hooks:
            hook.remove()

    on_close("O1 cache hooks", remove_hooks)

    def wrap(policy: Policy, qualname: str, message: str | None, native: bool = False):
        return lambda original: make_wrapper(policy, original, state, qualname, message, native)

    # A user registration decides alone for the attribute it names: a list
    # wrapper around it would cast first (a half round trip under an fp32
    # registration), so that spelling is left to the registration.
    registered = {(id(entry.target), entry.name) for entry in REGISTRY.entries}
    for spelling in spellings():
        if (id(spelling.target), spelling.name) not in registered:
            patcher.patch(spelling.target, spelling.name,
                          wrap(spelling.policy, spelling.qualname, spelling.message,
                               spelling.op in lists.NATIVE_PROMOTION))
    rnn.allow_half_inputs(patcher, state)
    for entry in REGISTRY.consume():
        owner = getattr(entry.target, "__name__", type(entry.target).__name__)
        wrapper = wrap(entry.policy, f"{owner}.{entry.name}", None)
        if not patcher.patch(entry.target, entry.name, wrapper):
            logger.warning("amp_patch: registered %s.%s no longer exists; not patched",
                           owner, entry.name)
    # torch.compile must keep knowing the functions O1 wraps (see patching/dynamo.py).
    dynamo_rules = _DYNAMO_RULES.snapshot(patcher)
    _DYNAMO_RULES.watch_import(lambda: getattr(active(), "patches", None))
    logger.debug("amp_patch O1: %d functions and methods patched (half dtype %s)",
                 len(patcher), state.half_dtype)
    return state
