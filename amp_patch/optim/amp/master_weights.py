"""fp32 master weights: their creation, the copies between masters and model, and their grads.

A master is an fp32 :class:`~torch.nn.Parameter` that takes its half
parameter's place in the optimizer's ``param_groups``, so the optimizer steps
(and keeps its state for) the master. :class:`MasterWeights` is the only link
between the two: it maps each master to its model parameter and back, writes
the masters into the model after a step, refreshes a master whose model
parameter was written from outside, and owns the fp32 storage that each
master's grad is unscaled into.
"""

from __future__ import annotations

from typing import Any, Iterable, Sequence, TypeGuard

import torch
from torch import Tensor, nn

from amp_patch import ops
from amp_patch.helpers.tensors import group_by_device_and_dtype, none_has_grad, version_of
from amp_patch.optim.fused.state_format import SCALE_SUFFIX, SCALED_CODES
from amp_patch.settings.dtypes import HALF_DTYPES

#: The key, in each param group of an O2 optimizer's state dict, of its fp32 masters by position
#: (None for a param without one); see :mod:`amp_patch.optim.amp.state_dict_hooks`.
GROUP_MASTERS_KEY = "amp_group_masters"

__all__ = ["MasterWeights", "clear_grads", "match_state_to_params"]


class MasterWeights:
    """The fp32 masters of one optimizer's half parameters.

    Every lookup is keyed by ``id()`` of an object that the other mapping holds
    strongly (a master holds on to its model parameter and back), so an id can
    never be reused by another object while it is a key here.

    Example::

        >>> optimizer = torch.optim.SGD(model.bfloat16().parameters(), lr=0.1)
        >>> masters = MasterWeights()
        >>> masters.attach(optimizer.param_groups[0], optimizer.state)
        >>> [(p.dtype, m.dtype) for p, m in masters.pairs(optimizer.param_groups[0]["params"])][0]
        (torch.bfloat16, torch.float32)
    """

    def __init__(self, dtype: torch.dtype = torch.float32) -> None:
        #: The masters' dtype: fp32, or bf16 (a bf16 param is then its own master).
        self.dtype = dtype
        # id(master) -> model param, and the reverse.
        self._model_of: dict[int, Tensor] = {}
        self._master_of: dict[int, Tensor] = {}
        # id(master) -> the storage its fp32 grad is unscaled into, reused every iteration.
        self._grad_buffers: dict[int, Tensor] = {}
        # id(model param) -> its version counter right after amp last wrote it; the last
        # mark_written's list and versions stay apart (_written_last) until something reads
        # the dict, so that a step's check of the same list compares two lists in C.
        self._written_version: dict[int, int] = {}
        self._written_last: tuple[Sequence[Tensor], list[int]] | None = None
        #: Moves whenever a master is made or forgotten (the pairs of a record are kept until then).
        self.version = 0

    def __len__(self) -> int:
        return len(self._model_of)

    def attach(self, group: dict, state: dict) -> None:
        """Put an fp32 master in place of every half parameter of ``group`` that has none yet.

        Args:
            group (dict): a param group; its ``"params"`` list is changed in place.
            state (dict): the optimizer's ``state``; a half parameter's existing
                state (the optimizer stepped before initialize) moves to its
                master, in fp32.
        """
        params = group["params"]
        # Masters of a checkpoint that a plain optimizer loaded before initialize.
        saved = group.pop(GROUP_MASTERS_KEY, None) or []
        for i, p in enumerate(params):
            if p.dtype not in HALF_DTYPES or p.dtype == self.dtype or id(p) in self._master_of:
                continue
            # .to() keeps the param's layout (channels-last stays channels-last).
            master = nn.Parameter(p.detach().to(self.dtype), requires_grad=p.requires_grad)
            value = saved[i] if i < len(saved) else None
            if _saved_master_of(value, p, self.dtype):
                # The model was loaded from the same checkpoint (its half value is this
                # master rounded): take the exact fp32 value, not the rounded one.
                with torch.no_grad():
                    master.copy_(value)
            if p.grad is not None:
                master.grad = p.grad.detach().to(self.dtype)
            self._model_of[id(master)] = p
            self._master_of[id(p)] = master
            self.version += 1
            self._written()[id(p)] = p._version
            params[i] = master
            if p in state:
                state[master] = {k: _state_to(v, torch.float32, master.device, k)
                                 for k, v in state.pop(p).items()}

    def model_param(self, stepped: Tensor) -> Tensor:
        """The model parameter behind a stepped tensor (the tensor itself when it is no master)."""
        return self._model_of.get(id(stepped), stepped)

    def master_for(self, param: Tensor) -> Tensor | None:
        """The master of a model parameter, or None when it has none."""
        return self._master_of.get(id(param))

    def is_master(self, t: Tensor) -> bool:
        """True when ``t`` is one of these masters."""
        return id(t) in self._model_of

    def pairs(self, stepped: Iterable[Tensor]) -> list[tuple[Tensor, Tensor]]:
        """``(model param, master)`` for each master among ``stepped``, in that order."""
        out = []
        for s in stepped:
            model_p = self._model_of.get(id(s))
            if model_p is not None:
                out.append((model_p, s))
        return out

    # ------------------------------------------------------------------ grads

    def grad_storage(self, master: Tensor) -> Tensor:
        """The fp32 tensor a master's grad is written into, kept from one iteration to the next.

        A fresh ``empty_like`` per master per iteration (tens of MB for a
        model of 20 M params) lands on newly mapped pages, and faulting them in
        costs several times the unscale pass itself. So each master keeps one
        buffer, as ``zero_grad(set_to_none=False)`` would keep its grad;
        ``.grad`` itself is still released (see :meth:`release_grads`), and the
        next ``scale_loss`` refills the same storage. A grad tensor kept by the
        caller across iterations therefore sees the next iteration's values.
        """
        buf = self._grad_buffers.get(id(master))
        if buf is None or buf.shape != master.shape or buf.stride() != master.stride() \
                or buf.device != master.device:
            # The master's layout is its param's, so the unscale pass reads the half grad
            # and writes this buffer as two dense runs of the same strides.
            buf = torch.empty_like(master)
            self._grad_buffers[id(master)] = buf
        return buf

    def release_grads(self) -> None:
        """Set every master's ``.grad`` to None, as Apex did after each step and skipped step.

        ``model.zero_grad()`` (or clearing the model's grads by hand) cannot
        reach the masters, so without this the next iteration would add onto
        this one's master grads. The storage stays for the next iteration
        (:meth:`grad_storage`).
        """
        masters = self._master_of.values()
        if none_has_grad(masters):  # the one-pass step made none
            return
        for master in masters:
            if master.grad is not None:  # reading .grad costs less than setting it
                master.grad = None

    # --------------------------------------------------------- master <-> model

    @torch.no_grad()
    def copy_to_model(self, stepped: Iterable[Tensor]) -> None:
        """Write the masters among ``stepped`` into their half params: one fused copy per group."""
        pairs = self.pairs(stepped)
        if not pairs:
            return
        models = [m for m, _ in pairs]
        masters = [s for _, s in pairs]
        for (dst, src) in group_by_device_and_dtype(models, masters).values():
            ops.multi_tensor_copy_(src, dst)
        self.mark_written(models)

    def mark_written(self, params: Iterable[Tensor]) -> None:
        """Note that amp itself just wrote ``params``: :meth:`sync_from_model` leaves them.

        ``params`` (a list kept by the caller, such as a record's
        :meth:`~amp_patch.optim.amp.OptimizerRecord.master_models`) is held with its
        versions as they are now; the next :meth:`sync_pairs` over the same list
        compares the versions alone.
        """
        params = params if isinstance(params, (list, tuple)) else list(params)
        # Another list than the one kept: fold that one in first. The same list's new
        # versions simply replace its old ones.
        if self._written_last is not None and self._written_last[0] is not params:
            self._written()
        self._written_last = (params, list(map(version_of, params)))

    def _written(self) -> dict[int, int]:
        """``_written_version``, with the last :meth:`mark_written` folded in."""
        last, self._written_last = self._written_last, None
        if last is not None:
            params, versions = last
            self._written_version.update(zip(map(id, params), versions))
        return self._written_version

    @torch.no_grad()
    def sync_from_model(self, stepped: Iterable[Tensor]) -> None:
        """Refresh masters whose model param was changed from outside since amp last wrote it.

        ``p.data.copy_(...)`` or an optimizer-less load after
        :func:`amp_patch.initialize` writes the half params only; stepping the
        stale masters would copy the old weights back. A master is refreshed
        only when its param no longer equals the master rounded to the param's
        dtype, so writing consistent values keeps the exact fp32 masters. An
        unchanged version counter costs no comparison (on CUDA, ``torch.equal``
        is a host sync).
        """
        self.sync_pairs(self.pairs(stepped))

    def sync_pairs(self, pairs: Iterable[tuple[Tensor, Tensor]],
                   models: Sequence[Tensor] | None = None) -> None:
        """:meth:`sync_from_model` over ``(model param, master)`` pairs already found.

        Args:
            pairs (iterable): ``(model param, master)`` pairs.
            models (sequence of Tensor, optional): the pairs' model params, in order (a list
                the caller keeps: the very list last passed to :meth:`mark_written` costs
                no lookup).
        """
        pairs = pairs if isinstance(pairs, (list, tuple)) else list(pairs)
        if models is None:
            models = [model_p for model_p, _ in pairs]
        # Every version as amp wrote it (each step but after an outside write): read in C.
        last = self._written_last
        if last is not None and last[0] is models and last[1] == list(map(version_of, models)):
            return
        written = self._written()
        if list(map(written.get, map(id, models))) == list(map(version_of, models)):
            return
        for model_p, master in pairs:
            self._refresh(model_p, master)

    def current_master(self, param: Tensor) -> Tensor | None:
        """The master of ``param``, refreshed first if the param was written from outside."""
        master = self._master_of.get(id(param))
        if master is not None:
            self._refresh(param, master)
        return master

    @torch.no_grad()
    def load_master(self, param: Tensor, value: Tensor) -> None:
        """Set the master of ``param`` to ``value`` exactly (fp32 or half), before the param itself
        is loaded with it: the later refresh then finds the two consistent and keeps the master."""
        master = self._master_of.get(id(param))
        if master is not None and value.shape == master.shape:
            master.copy_(value)

    def _refresh(self, model_p: Tensor, master: Tensor) -> None:
        written = self._written()
        if written.get(id(model_p)) == model_p._version:
            return
        with torch.no_grad():
            if not torch.equal(model_p, master.to(model_p.dtype)):
                master.copy_(model_p)
        written[id(model_p)] = model_p._version

    def detach(self, optimizer: torch.optim.Optimizer) -> None:
        """Put the model params back in ``optimizer.param_groups`` and forget the masters.

        The optimizer state of each master moves to its model parameter, cast
        to that parameter's dtype as ``Optimizer.load_state_dict`` would (step
        counters unchanged). Values are not changed: after every step the
        model already equals its masters. An optimizer that converts its state
        to its format at its next step (``LEAN_STATE``: amp_patch's FusedAdam
        and FusedSGD, which keep fp32 or block-scaled state for half params)
        keeps the state as it is, so that nothing is rounded away.
        """
        keep = getattr(optimizer, "LEAN_STATE", False)
        forget = getattr(optimizer, "forget_kept_batches", None)
        if forget is not None:  # a fused optimizer's batches hold the masters and their state
            forget()
        for group in optimizer.param_groups:
            params = group["params"]
            for i, p in enumerate(params):
                model_p = self._model_of.get(id(p))
                if model_p is None:
                    continue
                params[i] = model_p
                if p in optimizer.state:
                    optimizer.state[model_p] = {
                        k: _state_to(v, model_p.dtype, model_p.device, k, keep_dtype=keep)
                        for k, v in optimizer.state.pop(p).items()}
        self._model_of.clear()
        self._master_of.clear()
        self._grad_buffers.clear()
        self._written_version.clear()
        self._written_last = None
        self.version += 1


def _saved_master_of(value: Any, param: Tensor, dtype: torch.dtype) -> TypeGuard[Tensor]:
    """Whether ``value`` (a checkpoint's master) is the master of ``param`` as loaded: a tensor
    of the masters' dtype and its shape that rounds to exactly its half value."""
    return (isinstance(value, Tensor) and value.dtype == dtype
            and value.shape == param.shape and value.device == param.device
            and torch.equal(value.to(param.dtype), param.detach()))


def clear_grads(params: Iterable[Tensor], set_to_none: bool) -> None:
    """Clear the grads of ``params`` as ``Optimizer.zero_grad`` does, for params it does not hold.

    The model params behind the masters (amp's O2, ``FP16_Optimizer``) are
    not in any param group, so the optimizer's own ``zero_grad`` never
    reaches them.

    Args:
        params (iterable of Tensor): the params whose grads to clear.
        set_to_none (bool): set the grads to None rather than zeroing them
            (one fused ``_foreach_zero_``).

    Example::

        >>> clear_grads([model_p for model_p, _ in masters.pairs(stepped)], set_to_none=True)
    """
    grads = []
    for p in params:
        if p.grad is None:
            continue
        if set_to_none:
            p.grad = None
            continue
        # torch's rule: a grad that is itself part of a graph leaves it before being zeroed.
        if p.grad.grad_fn is not None:
            p.grad.detach_()
        else:
            p.grad.requires_grad_(False)
        grads.append(p.grad)
    if grads:
        torch._foreach_zero_(grads)


def match_state_to_params(optimizer: torch.optim.Optimizer, params: Iterable[Tensor]) -> None:
    """Cast the optimizer state of ``params`` to their dtypes, as
    ``Optimizer.load_state_dict`` would.

    A model cast by initialize (or one that a previous session left half)
    would otherwise meet state made for its old dtype, which torch's
    optimizers reject. Each changed entry is a new dict; the old one is left
    as it was.

    Args:
        optimizer (torch.optim.Optimizer): the optimizer.
        params (iterable of Tensor): params it steps directly.
    """
    state = optimizer.state
    for p in params:
        entry = state.get(p) if p in state else None
        if entry and any(_state_to(v, p.dtype, p.device, k) is not v
                         and (v.dtype != p.dtype or v.device != p.device)
                         for k, v in entry.items()):
            state[p] = {k: _state_to(v, p.dtype, p.device, k) for k, v in entry.items()}


def _state_to(value: Any, dtype: torch.dtype, device: torch.device, key: str,
              keep_dtype: bool = False) -> Any:
    # Optimizer.load_state_dict's rule: floating state follows the param, step counters do not;
    # nor do block-scaled codes and their scales (amp_patch.optim.fused.state_format), which
    # are not values. keep_dtype moves the state to the device only.
    if (isinstance(value, Tensor) and key != "step" and value.is_floating_point()
            and value.dtype not in SCALED_CODES and not key.endswith(SCALE_SUFFIX)):
        return value.to(dtype=value.dtype if keep_dtype else dtype, device=device)
    return value
