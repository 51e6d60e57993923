"""O0/O2/O3 model casting: params and buffers through ``.data``, and input/output cast hooks.

The cast keeps every :class:`~torch.nn.Parameter` object (only its ``.data``
changes), so optimizers built before :func:`amp_patch.initialize` still hold
the model's parameters. Inputs and outputs are cast by forward hooks, not by
an overwritten ``forward``: DataParallel replicas copy hooks with the module.

Under a half model type, ``model.state_dict()`` (of the model or any of its
submodules) returns fp32 tensors, as Apex's state-dict hook did: a half
parameter's entry is its fp32 master when an optimizer keeps one (the exact
weights O2 trains), else the half tensor cast to fp32. ``load_state_dict``
takes fp32 or half entries, and a master takes the loaded value exactly.

Which tensors are cast: floating tensors of fp16, bf16 and fp32, the same rule
as O1's wrappers (docs/design.md, "O1 casting"). float64 passes through, so a caller who
deliberately feeds doubles (a double-precision target, say) keeps them;
integer, bool and complex tensors, strings, ndarrays and other objects pass
through untouched.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Container, Mapping
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from amp_patch.settings.dtypes import CASTABLE_DTYPES, HALF_DTYPES

if TYPE_CHECKING:
    from amp_patch.settings.properties import Properties

__all__ = ["prepare", "cast_module", "cast_own_tensors", "cast_floating", "named_parameters",
           "kept_fp32"]


class Sharding(Protocol):
    """What :func:`prepare` needs of the FSDP2 states of the models
    (:class:`amp_patch.casting.fsdp.ShardingPlan` is the one implementation)."""

    #: ``id()`` of the sharded parameters whose dtype FSDP's policy gives them.
    policy_cast: frozenset[int]

    def refresh(self) -> None:
        """Make FSDP take the cast shards as its own."""


def _no_master(param: torch.Tensor) -> torch.Tensor | None:
    return None


def _no_load(param: torch.Tensor, value: torch.Tensor) -> None:
    return None


def prepare(props: Properties, models: list[nn.Module], on_close: Callable[..., None], *,
            sharding: Sharding | None = None,
            master_for: Callable[[torch.Tensor], torch.Tensor | None] = _no_master,
            load_master: Callable[[torch.Tensor, torch.Tensor], None] = _no_load) -> None:
    """Cast the models and register the input/output cast hooks.

    Does nothing when ``props.cast_model_type`` is not a dtype (O1, or
    ``cast_model_type=False``). Otherwise every floating parameter and buffer
    becomes ``cast_model_type`` (through ``.data``), except those of affine
    batch norms when ``keep_batchnorm_fp32`` is set and the model type is a
    half dtype. A forward pre-hook casts floating inputs to the model type; a
    forward hook casts floating outputs to ``cast_model_outputs`` (fp32 when
    None). Under a half model type, state-dict hooks make ``model.state_dict()``
    fp32 and let ``load_state_dict`` set the masters. Removing the hooks is
    registered with ``on_close``, and so is undoing the casts, for an
    :func:`amp_patch.initialize` that fails later on (a successful session
    keeps the model's dtypes at deinitialize).

    Args:
        props (Properties): the session's settings.
        models (list of torch.nn.Module): changed in place.
        on_close (callable): ``on_close(what, undo, abort=...)`` registers an undo with
            the session (:meth:`amp_patch.session.AmpSession.on_close`).
        sharding (Sharding, optional): what FSDP preparation did to the models'
            FSDP2 states; None when none is sharded.
        master_for (callable, optional): ``master_for(param)``: the fp32 master
            an optimizer keeps for ``param``, or None; read when
            ``state_dict()`` runs (the optimizers are processed after the cast).
            Default: no masters.
        load_master (callable, optional): ``load_master(param, value)``: set
            ``param``'s master, if any, to ``value`` (``load_state_dict``).

    Example::

        >>> from amp_patch.settings.properties import Properties
        >>> model = nn.Linear(2, 2)
        >>> undos = []
        >>> props = Properties.from_opt_level("O2", torch.bfloat16)
        >>> prepare(props, [model], lambda what, undo, abort=None: undos.append(undo))
        >>> model.weight.dtype
        torch.bfloat16
        >>> for undo in reversed(undos):  # what the session's close does
        ...     if undo is not None:
        ...         undo()
    """
    # As in Apex, cast_model_outputs applies even when the model itself is not cast (O1).
    output_dtype = props.cast_model_outputs or (torch.float32 if props.casts_model else None)
    if not props.casts_model and output_dtype is None:
        return
    handles: list = []
    originals: list[_Original] = []

    def remove_hooks() -> None:
        for handle in handles:
            handle.remove()

    def uncast() -> None:
        # The very tensors from before the cast: a cast back would round fp32 values to half.
        for original in reversed(originals):
            original.put_back()

    # Registered before anything changes, so that a failure half-way is undone too.
    on_close("model casts", None, abort=uncast)
    on_close("model hooks", remove_hooks)
    # Sharded params whose dtype FSDP's policy gives them (O2) keep theirs: they are the masters.
    leave = sharding.policy_cast if sharding is not None else frozenset()
    for model in models:
        if props.casts_model:
            model_dtype: torch.dtype = props.cast_model_type  # type: ignore[assignment]
            keep_bn = bool(props.keep_batchnorm_fp32) and model_dtype != torch.float32
            cast_module(model, model_dtype, keep_bn, originals=originals, leave=leave)
            if model_dtype in HALF_DTYPES:
                handles += _register_fp32_state_dict(model, master_for, load_master)

            def cast_inputs(module, args, kwargs, _dtype=model_dtype):
                return cast_floating(args, _dtype), cast_floating(kwargs, _dtype)

            handles.append(model.register_forward_pre_hook(cast_inputs, with_kwargs=True))

        def cast_outputs(module, args, output, _dtype=output_dtype):
            return cast_floating(output, _dtype)

        handles.append(model.register_forward_hook(cast_outputs))
    if sharding is not None and originals:
        sharding.refresh()  # FSDP takes the cast shards as its own


def named_parameters(models: list[nn.Module]):
    """``(name, param)`` over several models, for messages: ``model1.0.weight`` when there are
    several, ``0.weight`` for one. A param shared by two models comes once.

    Args:
        models (list of torch.nn.Module): the models, as passed to initialize.

    Yields:
        tuple: the qualified name and the parameter.

    Example::

        >>> mlp_a = nn.Sequential(nn.Linear(4, 16), nn.ReLU())
        >>> mlp_b = nn.Sequential(nn.Linear(4, 16), nn.ReLU())
        >>> dict(named_parameters([mlp_a, mlp_b]))["model1.0.bias"].shape
        torch.Size([16])
    """
    seen: set[int] = set()
    for i, model in enumerate(models):
        prefix = f"model{i}." if len(models) > 1 else ""
        for name, param in model.named_parameters():
            if id(param) not in seen:
                seen.add(id(param))
                yield prefix + name, param


def kept_fp32(module: nn.Module, keep_batchnorm_fp32: bool) -> bool:
    """Whether ``keep_batchnorm_fp32`` keeps ``module``'s own params and buffers as they are.

    Args:
        module (torch.nn.Module): one module (its own tensors, not its children's).
        keep_batchnorm_fp32 (bool): the session's setting, for a half model type.

    Example::

        >>> kept_fp32(nn.BatchNorm2d(4), True), kept_fp32(nn.BatchNorm2d(4, affine=False), True)
        (True, False)
    """
    # SyncBatchNorm is a _BatchNorm too.
    return keep_batchnorm_fp32 and isinstance(module, _BatchNorm) and module.affine


def cast_module(model: nn.Module, dtype: torch.dtype, keep_batchnorm_fp32: bool, *,
                castable: Container[torch.dtype] | None = CASTABLE_DTYPES,
                originals: list | None = None, leave: frozenset[int] = frozenset()) -> None:
    """Cast the params and buffers of ``model`` and its submodules to ``dtype``, in place.

    Each module's own tensors go through :func:`cast_own_tensors`, except
    those of the modules :func:`kept_fp32` keeps.

    Args:
        model (torch.nn.Module): the model.
        dtype (torch.dtype): the target dtype.
        keep_batchnorm_fp32 (bool): leave affine batch norms as they are.
        castable, originals, leave (optional): passed to :func:`cast_own_tensors`.

    Example::

        >>> net = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
        >>> cast_module(net, torch.bfloat16, keep_batchnorm_fp32=True)
        >>> net[0].weight.dtype, net[1].weight.dtype
        (torch.bfloat16, torch.float32)
    """
    for module in model.modules():
        if not kept_fp32(module, keep_batchnorm_fp32):
            cast_own_tensors(module, dtype, castable=castable, originals=originals, leave=leave)


def cast_own_tensors(module: nn.Module, dtype: torch.dtype, *,
                     castable: Container[torch.dtype] | None = CASTABLE_DTYPES,
                     originals: list | None = None, leave: frozenset[int] = frozenset()) -> None:
    """Cast the params and buffers of ``module`` itself (not its children) to ``dtype``.

    Every tensor stays the same object: a plain tensor gets new ``.data``, a
    wrapper subclass (FSDP2's DTensor) swaps contents with a cast copy. A
    param's grad is replaced by a cast copy.

    Args:
        module (torch.nn.Module): the module.
        dtype (torch.dtype): the target dtype.
        castable (container of torch.dtype, optional): the dtypes that are
            cast; None for every floating dtype. Default:
            :data:`amp_patch.settings.dtypes.CASTABLE_DTYPES`.
        originals (list, optional): receives what each cast tensor held
            before, to put it back exactly. Default: None (not kept).
        leave (frozenset, optional): ``id()`` of params that keep their dtype.

    Example::

        >>> seq = nn.Sequential(nn.Linear(4, 4))
        >>> cast_own_tensors(seq, torch.bfloat16)   # a container: it holds no tensor itself
        >>> seq[0].weight.dtype
        torch.float32
    """
    tensors: list[torch.Tensor] = [p for p in module.parameters(recurse=False)
                                   if id(p) not in leave]
    tensors += [b for b in module.buffers(recurse=False) if b is not None]
    for t in tensors:
        if t.dtype != dtype and (t.dtype in castable if castable is not None
                                 else t.is_floating_point()):
            original = _Original.cast(t, dtype)
            if originals is not None:
                originals.append(original)


class _Original:
    """A tensor cast in place, and what it held before, to put back exactly.

    A plain tensor is cast through ``.data``. A tensor subclass that wraps
    another (FSDP2's DTensor parameters) keeps its inner tensor in a Python
    attribute that ``.data`` does not reach, so it swaps contents with a cast
    copy (:func:`torch.utils.swap_tensors`, as ``nn.Module._apply`` does for
    them); either way the object stays the same.
    """

    __slots__ = ("tensor", "data", "grad", "swapped")

    def __init__(self, tensor: torch.Tensor, data: torch.Tensor, grad: torch.Tensor | None,
                 swapped: bool) -> None:
        self.tensor, self.data, self.grad, self.swapped = tensor, data, grad, swapped

    @classmethod
    def cast(cls, t: torch.Tensor, dtype: torch.dtype) -> "_Original":
        grad = t.grad if isinstance(t, nn.Parameter) else None
        if not is_traceable_wrapper_subclass(t):
            original = cls(t, t.data, grad, False)
            t.data = t.data.to(dtype)
        else:
            holder = t.detach().to(dtype)
            if isinstance(t, nn.Parameter):
                holder = nn.Parameter(holder, requires_grad=t.requires_grad)
            torch.utils.swap_tensors(t, holder)  # holder now holds the uncast contents
            original = cls(t, holder, grad, True)
        if grad is not None:
            t.grad = grad.to(dtype)
        return original

    def put_back(self) -> None:
        t = self.tensor
        if self.swapped:
            torch.utils.swap_tensors(t, self.data)
        else:
            t.data = self.data
        if isinstance(t, nn.Parameter):
            t.grad = self.grad


def _register_fp32_state_dict(model: nn.Module,
                              master_for: Callable[[torch.Tensor], torch.Tensor | None],
                              load_master: Callable[[torch.Tensor, torch.Tensor], None]) -> list:
    """One state-dict hook pair per module, each for its own params and buffers, so that a
    submodule's ``state_dict()`` is fp32 too. Masters are looked up at call time: the
    optimizers are processed after the model is cast."""

    def own_tensors(module: nn.Module):
        yield from module.named_parameters(recurse=False)
        yield from module.named_buffers(recurse=False)

    def to_fp32(module, state_dict, prefix, local_metadata) -> None:
        for name, t in own_tensors(module):
            key = prefix + name
            value = state_dict.get(key)
            if not isinstance(value, torch.Tensor) or value.dtype not in HALF_DTYPES:
                continue
            master = master_for(t)
            if master is None:
                state_dict[key] = value.detach().float()
            else:  # as state_dict(keep_vars=...) gave the param: the master itself, or detached
                state_dict[key] = master if value is t else master.detach()

    def load_masters(module, state_dict, prefix, *_) -> None:
        for name, p in module.named_parameters(recurse=False):
            value = state_dict.get(prefix + name)
            if isinstance(value, torch.Tensor) and value.is_floating_point():
                load_master(p, value)

    handles = []
    for module in model.modules():
        handles.append(module.register_state_dict_post_hook(to_fp32))
        handles.append(module.register_load_state_dict_pre_hook(load_masters))
    return handles


def cast_floating(value: Any, dtype: torch.dtype) -> Any:
    """Cast the fp16/bf16/fp32 tensors in ``value`` to ``dtype``, through nested containers.

    Lists, tuples, namedtuples and mappings are rebuilt with their own types;
    other objects (strings, ndarrays, float64 and integer tensors) are
    returned as they are. A tensor already of ``dtype`` is returned itself.

    Args:
        value: a tensor, a container of them, or anything else.
        dtype (torch.dtype): the target floating dtype.

    Returns:
        ``value`` with its castable tensors converted.

    Example::

        >>> out = cast_floating({"x": torch.ones(2), "ids": torch.arange(2)}, torch.bfloat16)
        >>> out["x"].dtype, out["ids"].dtype
        (torch.bfloat16, torch.int64)
    """
    if isinstance(value, torch.Tensor):
        if value.dtype in CASTABLE_DTYPES and value.dtype != dtype:
            return value.to(dtype)
        return value
    if isinstance(value, (str, bytes)):
        return value
    if isinstance(value, tuple):
        items = [cast_floating(v, dtype) for v in value]
        if hasattr(value, "_fields"):  # namedtuple (PackedSequence included)
            return type(value)(*items)
        return tuple(items) if type(value) is tuple else type(value)(items)
    if isinstance(value, list):
        items = [cast_floating(v, dtype) for v in value]
        return items if type(value) is list else type(value)(items)
    if isinstance(value, Mapping):
        if type(value) is dict:
            return {k: cast_floating(v, dtype) for k, v in value.items()}
        out: Any = copy.copy(value)  # keeps OrderedDict, defaultdict's factory, and the like
        for k, v in value.items():
            out[k] = cast_floating(v, dtype)
        return out
    return value
