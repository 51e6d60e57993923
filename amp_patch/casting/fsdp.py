"""amp on FSDP2 models (``fully_shard``): precision policies, sharded casts, the order guard.

The supported order is ``fully_shard`` first, then the optimizer over the
sharded parameters, then :func:`amp_patch.initialize`. :func:`prepare` then
makes each FSDP state's :class:`~torch.distributed.fsdp.MixedPrecisionPolicy`
say what the opt level means:

- O2 (half model, fp32 masters): the sharded fp32 parameters *are* the
  masters. They are left fp32, and FSDP all-gathers them in ``half_dtype``
  (``param_dtype``) and reduce-scatters the half grads in fp32
  (``reduce_dtype``; a ``reduce_dtype`` set in the policy given to
  ``fully_shard`` is kept), so the grads land fp32 in the shards and the
  optimizer steps the shards directly: no second copy of the weights exists.
  With ``master_weights="bf16"`` and a bf16 model the shards are cast to
  bf16, as at O3, and are their own masters (stepped with stochastic
  rounding); an fp16 model's shards stay fp32 masters there.
  With ``keep_batchnorm_fp32``, an FSDP state holding only affine batch norms
  all-gathers them in fp32.
- O3 (pure half) and O0: the sharded parameters themselves are cast by
  :mod:`amp_patch.casting.model` (which swaps a DTensor's contents, keeping the
  Parameter object); :meth:`ShardingPlan.refresh` then lets FSDP take the new
  local shards.
- O1: nothing changes; the model stays fp32 and the patched functions run
  inside FSDP's forward and backward as anywhere else.

A policy that already asks for another compute dtype than the level's is an
error, as is a state mixing batch norms kept fp32 with other parameters (FSDP
all-gathers one state's parameters in one dtype).

The other order (``initialize`` then ``fully_shard``) leaves amp's optimizer
records holding the unsharded parameters. Under torch.distributed a guard on
each model's first forward finds an optimizer parameter the model no longer
has and raises, naming the supported order.

.. note::
    This relies on FSDP2 internals of torch 2.13, read at
    ``torch/distributed/fsdp/_fully_shard/``: ``FSDPModule._get_fsdp_state()``,
    ``FSDPState._mp_policy`` and ``_fsdp_param_groups`` (``_fsdp_param_group``, a
    single optional group, before it), and per param group
    ``mp_policy``, ``fsdp_params`` and ``_init_mp_dtypes()`` (what the group's
    lazy init, at the first forward, calls to read the policy), and per
    parameter ``mp_policy``, ``_module_info``, ``reset_sharded_param()`` (what
    ``FSDPModule._apply`` calls after a cast), ``all_gather_outputs`` and
    ``_unsharded_param`` (the all-gather buffers, made once in the dtype of
    the first all-gather).
"""

from __future__ import annotations

import dataclasses
import logging
import sys
from typing import TYPE_CHECKING, Callable, Iterable

import torch
from torch import Tensor, nn

from amp_patch.casting.model import kept_fp32
from amp_patch.settings.dtypes import HALF_DTYPES

if TYPE_CHECKING:
    from amp_patch.optim.amp import OptimizerRecord
    from amp_patch.settings.properties import Properties

__all__ = ["ShardingPlan", "prepare", "param_groups", "is_sharded",
           "fsdp_states", "install_order_guard", "SUPPORTED_ORDER"]

logger = logging.getLogger("amp_patch")

#: The order of calls amp supports with FSDP2, for error messages.
SUPPORTED_ORDER = ("fully_shard(model) first, then the optimizer over model.parameters(), then "
                   "amp_patch.initialize(model, optimizer, ...)")

def is_sharded(model: nn.Module) -> bool:
    """True when ``fully_shard`` was applied to ``model`` or one of its submodules."""
    return bool(fsdp_states([model]))


def fsdp_states(models: Iterable[nn.Module]) -> list:
    """The FSDP2 states of the models' modules, each once, outermost first."""
    if "torch.distributed.fsdp" not in sys.modules:
        return []  # fully_shard was never imported, so nothing is sharded
    from torch.distributed.fsdp import FSDPModule

    states, seen = [], set()
    for model in models:
        for module in model.modules():
            if isinstance(module, FSDPModule):
                state = module._get_fsdp_state()
                if id(state) not in seen:
                    seen.add(id(state))
                    states.append(state)
    return states


class ShardingPlan:
    """What amp changed in the FSDP2 states of a session's models, and its undo.

    Made by :func:`prepare`. :attr:`policy_cast` holds the parameters whose
    dtype FSDP's policy takes care of (O2), which :mod:`amp_patch.casting.model` must
    not cast.

    Args:
        states (list): the FSDP states.
        policies (list): the policy amp gives each state, in the same order.

    Attributes:
        policy_cast (frozenset of int): ``id()`` of the sharded parameters left
            to the policy.
    """

    def __init__(self, states: list, policies: list) -> None:
        self.states = states
        self._originals = [state._mp_policy for state in states]
        self._policies = policies
        self.policy_cast = frozenset(
            id(p) for state, policy in zip(states, policies) if policy.param_dtype is not None
            for p in _sharded_params(state))

    def apply(self) -> None:
        """Give each state its policy (read by FSDP at the first forward, or re-read now)."""
        for state, policy in zip(self.states, self._policies):
            _set_policy(state, policy)
        self.refresh()

    def restore(self) -> None:
        """Put the policies given to ``fully_shard`` back, and let FSDP re-read them."""
        for state, policy in zip(self.states, self._originals):
            _set_policy(state, policy)
        self.refresh()

    def refresh(self) -> None:
        """Let FSDP take the current shards and policies.

        After a cast each parameter re-takes its local shard. A state that
        has run forward already read its dtypes: it reads them again, and
        all-gather buffers made in another dtype are dropped, so that the next
        all-gather makes them anew.
        """
        for state in self.states:
            for module in state._modules:
                module.reshard()  # the sharded parameters must be the registered ones
            for group in param_groups(state):
                with torch.no_grad():
                    for fsdp_param in group.fsdp_params:
                        fsdp_param.reset_sharded_param()
                if not hasattr(group, "_orig_dtype"):
                    continue  # not lazily initialized yet: the first forward reads everything
                group._init_mp_dtypes()
                for fsdp_param in group.fsdp_params:
                    wanted = fsdp_param.param_dtype or fsdp_param.orig_dtype
                    outputs = fsdp_param.all_gather_outputs
                    if outputs and outputs[0].dtype != wanted:
                        fsdp_param.all_gather_outputs = []
                        if hasattr(fsdp_param, "_unsharded_param"):
                            del fsdp_param._unsharded_param


def prepare(props: Properties, models: list[nn.Module],
            on_close: Callable[..., None]) -> ShardingPlan | None:
    """Fit the FSDP2 states of the models to the opt level (see the module's text).

    Everything is checked before anything changes. The undo (the policies
    given to ``fully_shard`` back) is registered with ``on_close``
    before the model is cast, so that it runs after a failed initialize has
    put the model's dtypes back, and FSDP then takes those shards again.

    Args:
        props (Properties): the session's settings.
        models (list of torch.nn.Module): the models passed to initialize.
        on_close (callable): ``on_close(what, undo)`` registers an undo with the session.

    Returns:
        ShardingPlan or None: None when no model is sharded.

    Raises:
        ValueError: a policy given to ``fully_shard`` asks for another compute
            dtype than the level's, or ``keep_batchnorm_fp32`` meets an FSDP
            state that holds batch norms and other parameters together.

    Example::

        >>> fully_shard(model)
        >>> opt = torch.optim.AdamW(model.parameters())
        >>> model, opt = amp.initialize(model, opt, opt_level="O2")
        >>> model._get_fsdp_state()._mp_policy.param_dtype
        torch.bfloat16
    """
    states = fsdp_states(models)
    if not states:
        return None
    _check_cpu_support(states)
    half = props.cast_model_type if props.cast_model_type in HALF_DTYPES else None
    keep = bool(props.keep_batchnorm_fp32) and half is not None
    policies = []
    for state in states:
        modules = {id(m): m for m in _param_modules(state)}.values()
        kept = [kept_fp32(m, keep) for m in modules]
        if any(kept) and not all(kept):
            names = sorted(type(m).__name__ for m in modules if kept_fp32(m, keep))
            raise ValueError(
                f"keep_batchnorm_fp32 keeps {', '.join(names)} in fp32, but fully_shard put "
                f"them in one FSDP group with other parameters of {_state_name(state)}, and FSDP "
                "gathers one group in one dtype. Call fully_shard on each batch norm before its "
                "parent, or pass keep_batchnorm_fp32=False.")
        kept_only = any(kept)  # then every one (checked above): this state stays as it is
        # bf16 masters of a bf16 model are the params themselves (master_weights="bf16"): the
        # shards are cast, as at O3, and stepped with stochastic rounding, not kept fp32.
        own_masters = props.master_dtype == half
        want = (half if half is not None and props.master_weights and not kept_only
                and not own_masters else None)
        # The dtype this state computes in once amp is done: gathered in half, cast, or its own.
        cast = props.cast_model_type if props.casts_model and not kept_only else None
        policies.append(_policy(state, want, want or cast or _own_dtype(state), props.opt_level))
    plan = ShardingPlan(states, policies)
    on_close("FSDP mixed-precision policies", plan.restore)
    plan.apply()
    return plan


def install_order_guard(models: list[nn.Module], records: Iterable[OptimizerRecord],
                        on_close: Callable[..., None]) -> None:
    """On each model's first forward, raise if an optimizer steps parameters the model lost.

    That happens when ``fully_shard`` (or anything else that replaces
    parameters) runs after :func:`amp_patch.initialize`: amp's optimizer
    records, and the optimizer itself, still hold the parameters from before.
    The check runs once per model (its cost is one pass over the
    parameters); the hook removes itself when it passes.

    Args:
        models (list of torch.nn.Module): the models passed to initialize.
        records (iterable of OptimizerRecord): the records of the session's optimizers.
        on_close (callable): ``on_close(what, undo)`` registers an undo with the session.
    """
    held = {id(record.model_param(p)) for record in records for p in record.stepped_params()}
    for index, model in enumerate(models):
        mine = {id(p) for p in model.parameters()} & held
        if mine:
            _guard(on_close, model, index, mine)


def _guard(on_close: Callable[..., None], model: nn.Module, index: int,
           expected: set[int]) -> None:
    handle = None

    def check(module, args):
        if expected - {id(p) for p in model.parameters()}:
            sharded = is_sharded(model)
            raise RuntimeError(
                f"model {index} no longer has the parameters that its optimizer steps: "
                + ("fully_shard was applied after amp_patch.initialize(), so the optimizer and "
                   "amp hold the unsharded parameters. " if sharded else
                   "they were replaced after amp_patch.initialize() (load_state_dict(assign=True), "
                   "fully_shard, or a new submodule). ")
                + f"Call amp_patch.deinitialize(), then {SUPPORTED_ORDER}.")
        handle.remove()

    # First, before FSDP's own pre-forward (also prepended, at fully_shard) registers the
    # unsharded parameters on the modules, when fully_shard came before initialize.
    handle = model.register_forward_pre_hook(check, prepend=True)
    on_close("first-forward order guard", handle.remove)


def _policy(state, want: torch.dtype | None, compute: torch.dtype | None, level: str):
    """The policy amp gives one state: the one given to fully_shard, with the level's dtypes."""
    given = state._mp_policy
    if given.param_dtype not in (None, compute):
        raise ValueError(_conflict(state, given, level))
    if want is None:
        return given
    reduce_dtype = given.reduce_dtype if given.reduce_dtype is not None else torch.float32
    return dataclasses.replace(given, param_dtype=want, reduce_dtype=reduce_dtype)


def _conflict(state, given, level: str) -> str:
    return (f"fully_shard({_state_name(state)}, mp_policy=MixedPrecisionPolicy(param_dtype="
            f"{given.param_dtype})) asks FSDP to compute in {given.param_dtype}, which opt_level "
            f"{level} does not do. Leave param_dtype unset: amp sets it where the level casts "
            "(O2 all-gathers in half_dtype), and a reduce_dtype you set is kept.")


def cpu_fsdp_supported() -> bool:
    """Whether this torch's FSDP2 can run on the CPU.

    ``fully_shard``'s forward records events on the device's streams; torch 2.6's
    ``torch.cpu.Stream`` has no ``record_event``, so FSDP2 there runs on CUDA only
    (2.9, 2.13 and 2.14 have it).

    Returns:
        bool: True when ``torch.cpu.Stream.record_event`` exists.
    """
    return hasattr(torch.cpu.Stream, "record_event")


def _check_cpu_support(states) -> None:
    if cpu_fsdp_supported():
        return
    if any(p.device.type == "cpu" for state in states for p in _sharded_params(state)):
        raise RuntimeError(
            f"FSDP2 on the CPU needs a newer torch than {torch.__version__}: fully_shard's "
            "forward records events on CPU streams, which this release's torch.cpu.Stream "
            "cannot (no record_event). Shard on CUDA, or upgrade torch (docs/install.md lists "
            "the tested releases).")


def param_groups(state) -> list:
    """The FSDP param groups of a state: a list in torch 2.13, one optional group in 2.6 - 2.9."""
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is not None:
        return list(groups)
    group = getattr(state, "_fsdp_param_group", None)
    return [] if group is None else [group]


def _set_policy(state, policy) -> None:
    state._mp_policy = policy  # read at each forward for the input and output casts
    for group in param_groups(state):
        group.mp_policy = policy
        for fsdp_param in group.fsdp_params:
            fsdp_param.mp_policy = policy


def _sharded_params(state) -> Iterable[Tensor]:
    for group in param_groups(state):
        for fsdp_param in group.fsdp_params:
            yield fsdp_param.sharded_param


def _param_modules(state) -> list[nn.Module]:
    return [fsdp_param._module_info.module for group in param_groups(state)
            for fsdp_param in group.fsdp_params]


def _state_name(state) -> str:
    modules = state._modules
    return ", ".join(type(m).__name__ for m in modules) if modules else "a module"


def _own_dtype(state) -> torch.dtype | None:
    return next((p.dtype for p in _sharded_params(state) if p.is_floating_point()), None)
