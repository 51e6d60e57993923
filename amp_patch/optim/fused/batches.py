"""The arguments of the fused ops, built from a param group: what a fused step reads and writes.

A fused optimizer's step groups the params of a param group that have a grad
into :class:`Batch` es (one per device, apart for params whose updated value is
also written into a model copy, and apart by what the optimizer's ``split``
says), and makes one op call per batch. A batch holds the op's arguments ready
to pass: the lists of grads, params and model copies (FSDP2's DTensors as their
local shards), each state tensor's codes and scales, and the step's flags.

Where a step reads its grads and what it writes besides the params can be
redirected with :class:`FusedStepInputs`. That is the one seam between the
fused optimizers and amp's O2 (:mod:`amp_patch.optim.amp` hands the inputs to
any optimizer that has ``fused_step_inputs``): every step writes the half model
params in the same pass as the fp32 masters, and the one-pass step also reads
the half model grads, still scaled, times the inverse loss scale.
"""

from __future__ import annotations

import dataclasses
import itertools
import operator
from typing import Any, Callable, Mapping, NamedTuple, Protocol, overload

import torch
from torch import Tensor

from amp_patch.helpers.tensors import local_tensors
from amp_patch.optim.fused.state_format import (
    SCALE_SUFFIX,
    SCALED_CODES,
    QuantizedState,
    StateFormat,
)

__all__ = ["FusedStepInputs", "Batch", "StateLists", "build_batches", "KeptBatches", "to_device"]


@dataclasses.dataclass
class FusedStepInputs:
    """Where a fused ``step()`` reads its grads and writes half copies, and its device flags.

    Installed for one step with :meth:`FusedOptimizer.fused_step_inputs`. The
    mappings are keyed by the tensors in ``param_groups`` (under amp's O2, the
    fp32 masters).

    Args:
        grads (Mapping, optional): param -> the gradient to read instead of
            ``param.grad`` (a half model grad, still multiplied by the loss
            scale). A param found here is stepped even when its ``.grad`` is None.
        model_params (Mapping, optional): param -> a tensor of the same shape
            (the half model param) that receives the updated value, rounded, in
            the same pass. A param found here is amp's master: it is stepped as
            it is, and the optimizer makes no master of its own for it.
        inv_scale (Tensor, optional): one-element fp32 tensor; grads are read
            multiplied by it.
        found_inf (Tensor, optional): one-element fp32 flag; when non-zero the
            step changes nothing at all (params, state, model copies).
        grad_norms (Mapping, optional): device -> the L2 norm (0-dim fp32) of
            all the grads this step reads on that device, as stored (before
            ``inv_scale``), summed in ``param_groups`` order. An optimizer that
            needs the global grad norm (LAMB's clipping) uses it instead of
            reading the grads once more.

    Example::

        >>> inputs = FusedStepInputs(grads={master: p.grad}, model_params={master: p},
        ...                          inv_scale=scaler_inv_scale, found_inf=scaler_found_inf)
        >>> with optimizer.fused_step_inputs(inputs):
        ...     optimizer.step()
    """

    grads: Mapping[Tensor, Tensor] | None = None
    model_params: Mapping[Tensor, Tensor] | None = None
    inv_scale: Tensor | None = None
    found_inf: Tensor | None = None
    grad_norms: Mapping[torch.device, Tensor] | None = None


class StateLists(NamedTuple):
    """One kind of state (``exp_avg``, say) of a batch, as an op takes it: the codes, one per
    tensor, and the scales of the block-scaled ones (empty when none is)."""

    codes: list[Tensor]
    scales: list[Tensor]


@dataclasses.dataclass
class Batch:
    """The arguments of one fused op call, in the group's order.

    ``grads``, ``params`` and ``model_params`` are the lists the op takes (local
    shards of DTensors); ``stepped`` and ``stepped_grads`` are the same tensors as
    they are, for the norms of whole sharded tensors
    (:func:`~amp_patch.optim.fused.norms.whole_tensor_norms`). ``keys`` are the
    params as keyed in the optimizer's ``state``; ``state`` has one
    :class:`StateLists` per state key asked for. ``low_precision`` says whether
    the call takes the low-precision state ops (a low-precision format, or bf16
    params to round stochastically); ``split`` is the value that the
    optimizer's split gave the batch's params.
    """

    device: torch.device
    keys: list[Tensor]
    stepped: list[Tensor]
    stepped_grads: list[Tensor]
    grads: list[Tensor]
    params: list[Tensor]
    model_params: list[Tensor]
    noop: Tensor | None
    inv_scale: Tensor | None
    state: tuple[StateLists, ...]
    low_precision: bool
    split: Any
    block_size: int


class _Source(Protocol):
    """What :func:`build_batches` asks of the optimizer (:class:`FusedOptimizer`)."""

    state_format: StateFormat
    stochastic_rounding: bool
    _inputs: FusedStepInputs | None

    @property
    def state(self) -> Mapping[Tensor, Any]: ...
    def _grad_of(self, p: Tensor) -> Tensor | None: ...
    def _target(self, p: Tensor) -> tuple[Tensor, Tensor | None]: ...
    def _state_codes(self, key: Tensor, stepped: Tensor,
                     low_precision: bool) -> tuple[torch.dtype | None, ...]: ...
    def state_in_code(self, p: Tensor, key: str, dtype: torch.dtype | None,
                      like: Tensor | None = None) -> QuantizedState: ...


def build_batches(opt: _Source, group: dict[str, Any], split: Callable[[Tensor], Any] | None,
                  state: tuple[str, ...]) -> list[Batch]:
    """The params of ``group`` that have a grad, as op calls (see the module's text).

    ``split(param)`` separates batches further (SGD's new momentum buffers, the
    codes of a low-precision format). The state under each key of ``state`` is
    made (zeros) or converted to the code the optimizer asks
    (``_state_codes``) as it is gathered.
    """
    # Every step of every group passes here: the loops keep to locals.
    rows: dict[tuple[Any, ...], list[tuple[Tensor, Tensor, Tensor, Tensor | None]]] = {}
    grad_of, target_of = opt._grad_of, opt._target
    for p in group["params"]:
        grad = grad_of(p)
        if grad is None:
            continue
        if grad.is_sparse:
            raise RuntimeError(f"{type(opt).__name__} does not support sparse gradients")
        target, out = target_of(p)
        key = (p.device, out is not None, split(p) if split is not None else None)
        rows.setdefault(key, []).append((p, target, grad, out))
    inputs = opt._inputs
    fmt = opt.state_format
    states = opt.state
    names = [(name, name + SCALE_SUFFIX) for name in state]
    batches = []
    for (device, _, split_value), members in rows.items():
        keys, stepped, grads, outs = (list(column) for column in zip(*members))
        if outs[0] is None:  # the key keeps params with and without a model copy apart
            outs = []
        low = fmt.low_precision or (
            opt.stochastic_rounding and any(s.dtype == torch.bfloat16 for s in stepped))
        # The codes follow the dtype of the tensor stepped and the format's codes, which
        # the split keeps alike within a batch: asked once per stepped dtype, with whether
        # each code keeps scales beside it.
        by_dtype: dict[torch.dtype, tuple[tuple[torch.dtype | None, bool], ...]] = {}
        kept_codes: list[list[Tensor]] = [[] for _ in state]
        kept_scales: list[list[Tensor]] = [[] for _ in state]
        for p, s in zip(keys, stepped):
            wants = by_dtype.get(s.dtype)
            if wants is None:
                wants = by_dtype[s.dtype] = tuple(
                    (want, want is not None and want in SCALED_CODES)
                    for want in opt._state_codes(p, s, low))
            entry = states[p]
            # The codes and scales as stored, when stored as asked (every step but the
            # first, :meth:`QuantizedState.stored_in`): read from the entry directly, with
            # no QuantizedState made per tensor and key.
            for (name, scale_name), (want, scaled), codes_of, scales_of in zip(
                    names, wants, kept_codes, kept_scales):
                data = entry.get(name)
                scales = entry.get(scale_name) if data is not None else None
                if data is None or not (want is None or (
                        data.dtype == want and (scales is not None) == scaled)):
                    made = opt.state_in_code(p, name, want, like=s)
                    data, scales = made.codes, made.scales
                codes_of.append(data)
                if scales is not None:
                    scales_of.append(scales)
        lists = [StateLists(local_tensors(kept_codes[i]), local_tensors(kept_scales[i]))
                 for i in range(len(state))]
        batches.append(Batch(
            device=device, keys=keys, stepped=stepped, stepped_grads=grads,
            # The ops take plain tensors: FSDP2's DTensors hand in their local shards.
            grads=local_tensors(grads), params=local_tensors(stepped),
            model_params=local_tensors(outs),
            noop=to_device(inputs.found_inf if inputs is not None else None, device),
            inv_scale=to_device(inputs.inv_scale if inputs is not None else None, device),
            state=tuple(lists), low_precision=low, split=split_value,
            block_size=fmt.block_size))
    return batches


class _Kept(NamedTuple):
    """One batch of a :class:`KeptBatches`: the batch with no grads or flags, its members'
    places in the group's params, their state entries, and each state key's codes and scales
    (None where a tensor has none) as the entries held them."""

    batch: Batch
    places: tuple[int, ...]
    entries: list[Any]
    outs: list[Tensor]
    codes: list[tuple[list[Tensor], list[Tensor | None]]]
    #: Whether every kept tensor is a plain one: the batch's lists then serve as they are
    #: (a DTensor's local shard is taken again at every step).
    plain: bool


_grad = operator.attrgetter("grad")
_is_sparse = operator.attrgetter("is_sparse")


class KeptBatches:
    """What :func:`build_batches` made of a group, kept so that the next step makes its batches
    again from the new grads alone.

    Every step of every group builds its batches: about 120 us of Python per
    step over 53 params, where a host-bound step takes 10 ms. From one step to
    the next only the grads and the flags change, as long as everything else
    the batches were built from stays: the group's params (the same tensors,
    in order), which of them have a grad, the optimizer's state entries and
    the tensors in them, the split and state keys asked for, the state format,
    stochastic rounding, and the model copies the step inputs map to (the same
    mapping). :meth:`rebuild` checks all of that (the tensors by identity,
    read in C where it can be) and returns None when anything changed; the
    optimizer then builds anew and keeps the new batches.

    The kept batches hold no grads and no flags. They hold the group's params
    and state, which the optimizer holds too; :meth:`FusedOptimizer.forget_kept_batches`
    drops them where the optimizer lets go of those (``load_state_dict``, amp's
    ``deinitialize``).

    Args:
        opt: the optimizer (a :class:`~amp_patch.optim.fused.FusedOptimizer`).
        group (dict): the param group.
        split, state: as given to :func:`build_batches`.
        batches (list of Batch): what :func:`build_batches` returned for them, now.
    """

    def __init__(self, opt: _Source, group: dict[str, Any], split: Callable[[Tensor], Any] | None,
                 state: tuple[str, ...], batches: list[Batch]) -> None:
        params = group["params"]
        inputs = opt._inputs
        self.group = group
        self.params = list(params)
        self.split = split
        self.state = state
        self.fmt = opt.state_format
        self.rounding = opt.stochastic_rounding
        self.states = opt.state
        self.model_params = None if inputs is None else inputs.model_params
        self.has_grad = [opt._grad_of(p) is not None for p in params]
        place = {id(p): i for i, p in enumerate(params)}
        self.kept: list[_Kept] = []
        for b in batches:
            entries = [opt.state[k] for k in b.keys]  # build_batches made every one
            codes = [([e.get(name) for e in entries], [e.get(name + SCALE_SUFFIX) for e in entries])
                     for name in state]
            # The model copies as the step inputs map them, before any local shard is taken.
            outs = [out for k in b.keys if (out := opt._target(k)[1]) is not None]
            kept_lists: list[list[Any]] = [
                b.stepped, outs, *(data for data, _ in codes),
                *([t for t in scales if t is not None] for _, scales in codes)]
            plain = all(local_tensors(xs) is xs for xs in kept_lists)
            self.kept.append(_Kept(
                dataclasses.replace(b, stepped_grads=[], grads=[], noop=None, inv_scale=None),
                tuple(place[id(k)] for k in b.keys), entries, outs, codes, plain))

    def rebuild(self, opt: _Source, group: dict[str, Any], split: Callable[[Tensor], Any] | None,
                state: tuple[str, ...]) -> list[Batch] | None:
        """The batches of this step, or None when they cannot be the kept ones with new grads."""
        params = group["params"]
        inputs = opt._inputs
        if (group is not self.group or split != self.split or state != self.state
                or opt.state_format is not self.fmt or opt.stochastic_rounding != self.rounding
                or opt.state is not self.states
                or (None if inputs is None else inputs.model_params) is not self.model_params
                or len(params) != len(self.params)
                or not all(map(operator.is_, params, self.params))):
            return None
        given = None if inputs is None else inputs.grads
        if given is None:
            grads = list(map(_grad, params))
        elif _one_grad_each_in_order(given, params):  # amp's deferred grads: no lookups
            grads = list(given.values())
        else:  # the step inputs' grads first, as _grad_of reads them
            grads = [g if g is not None else p.grad for g, p in zip(map(given.get, params), params)]
        if list(map(operator.is_not, grads, itertools.repeat(None))) != self.has_grad:
            return None
        states = self.states
        for k in self.kept:
            if not all(map(operator.is_, map(states.get, k.batch.keys), k.entries)):
                return None
            for name, (data, scales) in zip(state, k.codes):
                if not (all(map(operator.is_, map(dict.get, k.entries, itertools.repeat(name)),
                                data))
                        and all(map(operator.is_, map(dict.get, k.entries,
                                                      itertools.repeat(name + SCALE_SUFFIX)),
                                    scales))):
                    return None
        found_inf = None if inputs is None else inputs.found_inf
        inv_scale = None if inputs is None else inputs.inv_scale
        out = []
        for k in self.kept:
            b = k.batch
            step_grads = [grads[i] for i in k.places]
            if any(map(_is_sparse, step_grads)):
                return None  # build_batches raises its error
            if k.plain:
                stepped, outs, lists = b.params, b.model_params, b.state
            else:
                stepped, outs = local_tensors(b.stepped), local_tensors(k.outs)
                lists = tuple(StateLists(local_tensors(data),
                                         local_tensors([t for t in scales if t is not None]))
                              for data, scales in k.codes)
            out.append(Batch(
                device=b.device, keys=b.keys, stepped=b.stepped, stepped_grads=step_grads,
                grads=local_tensors(step_grads), params=stepped, model_params=outs,
                noop=to_device(found_inf, b.device), inv_scale=to_device(inv_scale, b.device),
                state=lists, low_precision=b.low_precision, split=b.split,
                block_size=b.block_size))
        return out


def _one_grad_each_in_order(grads: Mapping[Tensor, Tensor], params: list[Tensor]) -> bool:
    """Whether ``grads`` is a dict that maps exactly ``params``, in their order, to grads (no
    None): its values are then the grads in order, read without hashing a tensor (a tensor's
    ``__hash__`` is Python code)."""
    return (type(grads) is dict and len(grads) == len(params)
            and all(map(operator.is_, grads, params))
            and not any(map(operator.is_, grads.values(), itertools.repeat(None))))


@overload
def to_device(t: Tensor, device: torch.device) -> Tensor: ...
@overload
def to_device(t: None, device: torch.device) -> None: ...
@overload
def to_device(t: Tensor | None, device: torch.device) -> Tensor | None: ...


def to_device(t: Tensor | None, device: torch.device) -> Tensor | None:
    """``t`` on ``device`` (no copy when it is there already; None stays None)."""
    if t is None or t.device == device:
        return t
    return t.to(device, non_blocking=True)
