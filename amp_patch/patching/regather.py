"""O1's weight-cast cache on FSDP2 models: a cast lives no longer than the all-gather it cast.

Why this exists (a gloo "collective mismatch" at O1, docs/distributed.md). FSDP2 keeps
one unsharded :class:`~torch.nn.Parameter` per sharded parameter and, at every
forward of its module, all-gathers into that Parameter's storage, which it
freed after the previous forward (``storage.resize_(0)``) and now reallocates
in place (``resize_(n)``). The copy goes through the all-gather buffer, so
the Parameter's version counter never moves: the same object, version 0,
forever. The cache's other check, the storage address, then decides alone,
and it depends on the allocator: whether the freed block comes back at the
same address differs from forward to forward and from rank to rank.

When it does, the cache returns a cast made by an *earlier* forward, say an
evaluation forward run with grad enabled, which no ``scale_loss`` cleared
after. Its values are right, but its autograd node belongs to that earlier
graph and is older than FSDP's post-backward node of the current forward.
The autograd engine runs ready nodes newest first, so in backward FSDP's
post-backward reduce-scatters the module's gradients *before* the gradient
of that weight has arrived through the old node: on this rank the weight has
no gradient yet and is left out of the reduce-scatter; on a rank whose
address changed it is in. The two ranks reduce-scatter buffers of different
sizes, and gloo aborts. (On NCCL the same mismatch hangs or reduces garbage.)

The fix keeps a cast of an FSDP-managed parameter for one gather: a forward
pre-hook and a forward hook on each FSDP module drop the cache entries of the
unsharded parameters of its group, so every forward of the module casts them
afresh, on every rank alike. Within the forward (a weight used by several
ops, RNN time steps) the cache works as before. Activation checkpointing's
recomputation in backward therefore casts anew too, whatever address the
re-gather got.

.. note::
    This reads FSDP2 internals of torch 2.13 (``FSDPState._modules``,
    the param groups (:func:`~amp_patch.casting.fsdp.param_groups`, per torch
    version), ``FSDPParamGroup.fsdp_params`` and
    ``FSDPParam._unsharded_param``), as :mod:`amp_patch.casting.fsdp` does.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Iterator

import torch
from torch import nn

from amp_patch.casting.fsdp import param_groups

if TYPE_CHECKING:
    from amp_patch.patching.state import CastState

__all__ = ["install", "unsharded_params"]

_compiling = torch.compiler.is_compiling


def unsharded_params(state) -> Iterator[nn.Parameter]:
    """The unsharded parameters that FSDP2 has made for a state so far (at its first all-gather).

    Args:
        state: an ``FSDPState`` (``module._get_fsdp_state()``).

    Yields:
        torch.nn.Parameter: the Parameters that FSDP all-gathers into and sets on the
        modules during forward and backward.
    """
    for group in param_groups(state):
        for fsdp_param in group.fsdp_params:
            param = getattr(fsdp_param, "_unsharded_param", None)
            if param is not None:
                yield param


def install(casts: "CastState | None", states: list, on_close: Callable[..., None]) -> int:
    """Make each FSDP module's forward drop the O1 cache's casts of its group's parameters.

    Does nothing without O1's weight-cast cache (``casts`` is None) or
    without FSDP states. The hooks are removed at :func:`amp_patch.deinitialize`.

    Args:
        casts (CastState or None): O1's state (the session's ``casts``), patches installed.
        states (list): the FSDP states of the session's models
            (:func:`amp_patch.casting.fsdp.fsdp_states`).
        on_close (callable): the session's ``on_close(what, undo)``; the hooks are removed there.

    Returns:
        int: the number of hooks registered.

    Example::

        >>> install(session.casts, fsdp_states(session.models), session.on_close)  # O1, FSDP2
        8
    """
    if casts is None or not states:
        return 0
    cache = casts.cache
    handles = []
    for state in states:
        def drop(*_args, _state=state) -> None:
            if not _compiling():  # compiled code casts in the graph, without the cache
                cache.forget(unsharded_params(_state))

        for module in state._modules:
            handles.append(module.register_forward_pre_hook(drop))
            handles.append(module.register_forward_hook(drop, always_call=True))
    on_close("the O1 cache's FSDP2 hooks", lambda: [h.remove() for h in handles])
    return len(handles)
