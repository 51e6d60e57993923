"""One ``torch.distributed.checkpoint`` (DCP) checkpoint of a whole amp training state.

:func:`save_checkpoint` writes, with one ``dcp.save``:

- ``model``: the model's state dict (fp32 under O2/O3, see
  :mod:`amp_patch.casting.model`; DTensor shards under FSDP2);
- ``optimizer``: the optimizer's state keyed by parameter name rather than by
  position, with its fp32 masters (O2 without FSDP) under
  ``amp_master_params``, so that it loads into another world size;
- ``amp``: the loss scalers (:func:`amp_patch.state_dict`), and the FP8 layers'
  delayed state under ``fp8="delayed"``;
- ``rng``: each rank's torch RNG states (CPU, and CUDA's current device);
- the caller's ``extra`` entries.

DCP saves every rank's shards and writes replicated tensors once; on load it
reads whatever part each rank's tensors need, so a checkpoint of FSDP2 shards
written by 2 ranks loads into 4 and back. :func:`load_checkpoint` loads into
the live objects in place and then hands each its state, which continues
training bit-exactly at the same world size.

An optimizer that has not stepped yet has no state to load into, so both
functions first let it make its state with one step of zero gradients and a
zero learning rate (torch's ``_init_optim_state``, as
``torch.distributed.checkpoint.state_dict`` does), which changes no value.
"""

from __future__ import annotations

import contextlib
import logging
import os
import warnings
from typing import Any, Mapping

import torch
from torch import nn

from amp_patch import session as _session
from amp_patch.casting.model import named_parameters
from amp_patch.frontend.lifecycle import check_scaler_states, load_state_dict, state_dict
from amp_patch.optim.amp import underlying_optimizer
from amp_patch.optim.amp.state_dict_hooks import MASTERS_KEY
from amp_patch.optim.fused.state_format import SCALE_SUFFIX, SCALED_CODES

__all__ = ["save_checkpoint", "load_checkpoint"]

logger = logging.getLogger("amp_patch")

_RESERVED = ("model", "optimizer", "amp", "rng")


def save_checkpoint(checkpoint_id: str | os.PathLike, model, optimizer=None, *,
                    extra: Mapping[str, Any] | None = None, storage_writer=None,
                    process_group=None) -> None:
    """Save the model, optimizer (with masters), loss scalers and RNG as one DCP checkpoint.

    Every rank calls it, as every rank calls ``torch.distributed.checkpoint.save``.
    It also works in a single process without torch.distributed.

    Args:
        checkpoint_id (str or os.PathLike): the checkpoint's directory (or
            the ``checkpoint_id`` a ``storage_writer`` takes).
        model (torch.nn.Module or list of torch.nn.Module): the model(s), bare,
            sharded with ``fully_shard``, or wrapped in DistributedDataParallel.
        optimizer (torch.optim.Optimizer or list, optional): their optimizer(s).
            Default: None.
        extra (dict, optional): more entries saved with the rest (a dataloader's
            state, the epoch, any ``Stateful``); the names ``model``,
            ``optimizer``, ``amp`` and ``rng`` are taken. Default: None.
        storage_writer (torch.distributed.checkpoint.StorageWriter, optional):
            passed to ``dcp.save``. Default: files under ``checkpoint_id``.
        process_group (ProcessGroup, optional): passed to ``dcp.save``.
            Default: the world.

    Raises:
        ValueError: an ``extra`` name is taken, or an optimizer steps a
            tensor that belongs to none of the models.

    Example::

        >>> amp.save_checkpoint(f"ckpt/step{step}", model, optimizer, extra={"step": step})
    """
    import torch.distributed.checkpoint as dcp

    state = _training_state(model, optimizer, extra, rng_rank=_rank(process_group))
    with _single_process_quiet():
        dcp.save(state, checkpoint_id=checkpoint_id, storage_writer=storage_writer,
                 process_group=process_group)


def load_checkpoint(checkpoint_id: str | os.PathLike, model, optimizer=None, *,
                    extra: dict[str, Any] | None = None, storage_reader=None,
                    process_group=None) -> None:
    """Load what :func:`save_checkpoint` saved into the live model, optimizer, amp and RNG.

    Call it after :func:`amp_patch.initialize`, with the objects built as for
    saving (the same model, sharded or wrapped alike or not, the same opt
    level). The world size may differ: sharded tensors are re-split. A rank
    whose number the saving run did not have takes the RNG state of rank
    ``rank % saved_world_size``. Every rank calls it.

    Args:
        checkpoint_id (str or os.PathLike): the checkpoint's directory (or
            the ``checkpoint_id`` a ``storage_reader`` takes).
        model (torch.nn.Module or list of torch.nn.Module): the model(s).
        optimizer (torch.optim.Optimizer or list, optional): their optimizer(s).
            Default: None.
        extra (dict, optional): the entries saved as ``extra``; tensors and
            dicts are loaded in place, ``Stateful`` objects through their
            ``load_state_dict``, and other values replaced in this dict.
            Default: None.
        storage_reader (torch.distributed.checkpoint.StorageReader, optional):
            passed to ``dcp.load``. Default: files under ``checkpoint_id``.
        process_group (ProcessGroup, optional): passed to ``dcp.load``.
            Default: the world.

    Raises:
        ValueError: the checkpoint's optimizer names other parameters than
            this optimizer steps, or an ``extra`` name is taken.
        RuntimeError: the checkpoint's loss scalers are not those of this
            session's ``num_losses``.
        torch.distributed.checkpoint.api.CheckpointException: ``dcp.load``
            found an entry missing from the checkpoint, or of another shape
            (a ``BaseException``, as DCP raises it).

    These checks run before ``dcp.load`` writes the live tensors in place: a
    checkpoint that fails them changes nothing.

    Example::

        >>> model, optimizer = amp.initialize(model, optimizer, opt_level="O2")
        >>> amp.load_checkpoint("ckpt/step100", model, optimizer)
    """
    import torch.distributed.checkpoint as dcp

    reader = storage_reader if storage_reader is not None else dcp.FileSystemReader(checkpoint_id)
    metadata = reader.read_metadata().state_dict_metadata
    keys = set(metadata)
    saved_ranks = sorted({int(k.split(".")[1][len("rank"):]) for k in keys
                          if k.startswith("rng.rank")})
    source = saved_ranks[_rank(process_group) % len(saved_ranks)] if saved_ranks else None
    state = _training_state(model, optimizer, extra, rng_rank=source)
    models, optimizers = _as_list(model), _as_list(optimizer)
    optimizer_keys = [_key("optimizer", i, len(optimizers)) for i in range(len(optimizers))]
    _drop_what_was_not_saved(state, keys, optimizer_keys)
    session = _session.current()
    names = _names(models)

    # dcp.load writes the live tensors in place, so whatever can be checked is checked first,
    # on the checkpoint's plain entries (param groups, loss scalers), read on their own.
    plain = _read_plain_entries(state, keys, optimizer_keys, reader, checkpoint_id, process_group)
    groups = [_checked_groups(opt, plain[f"{key}.param_groups"], names, session)
              for opt, key in zip(optimizers, optimizer_keys)]
    amp_state = None
    if "amp" in state:
        amp_state = _nested(plain, "amp")
        check_scaler_states(session, amp_state)
        fp8_copies = state["amp"].get("fp8")
        if fp8_copies and any(k.startswith("amp.fp8.") for k in keys):
            # The FP8 layers' delayed state loads into copies of its tensors, then through
            # load_state_dict with the scalers; a checkpoint without it keeps the live one.
            state["amp"] = {"fp8": fp8_copies}
        else:
            del state["amp"]
    for opt, key in zip(optimizers, optimizer_keys):
        if _take_saved_codes(opt, key, metadata, names, session):
            state[key]["state"] = _optimizer_state(opt, names, session)["state"]
        del state[key]["param_groups"]
    with _single_process_quiet():
        dcp.load(state, checkpoint_id=checkpoint_id, storage_reader=reader,
                 process_group=process_group)

    for i, opt in enumerate(optimizers):
        _load_optimizer(opt, state[optimizer_keys[i]], groups[i], names, session)
    for i, m in enumerate(models):
        _unwrap(m).load_state_dict(state[_key("model", i, len(models))])
    if amp_state is not None:
        if "amp" in state:
            amp_state["fp8"] = state["amp"]["fp8"]
        load_state_dict(amp_state)
    for kind, value in next(iter(state["rng"].values()), {}).items():
        _set_rng(kind, value)
    if extra is not None:
        for name in extra:
            extra[name] = state[name]


def _read_plain_entries(state: dict[str, Any], keys: set[str], optimizer_keys: list[str],
                        reader, checkpoint_id, process_group) -> dict[str, Any]:
    """The optimizers' param groups and, when amp's state is to be loaded, every loss scaler's
    entry the checkpoint holds: flat DCP keys to their values."""
    import torch.distributed.checkpoint as dcp

    # A dotted top-level key is the flat key DCP would make of the nested one.
    plain: dict[str, Any] = {f"{key}.param_groups": None for key in optimizer_keys}
    if "amp" in state:
        plain.update((k, None) for k in keys
                     if k.startswith("amp.") and not k.startswith("amp.fp8."))
    with _single_process_quiet():
        dcp.load(plain, checkpoint_id=checkpoint_id, storage_reader=reader,
                 process_group=process_group)
    return plain


def _nested(flat: dict[str, Any], prefix: str) -> dict[str, dict[str, Any]]:
    """``{"amp.loss_scaler0.loss_scale": v, ...}`` as ``{"loss_scaler0": {"loss_scale": v}}``."""
    out: dict[str, dict[str, Any]] = {}
    for key, value in flat.items():
        if key.startswith(prefix + "."):
            entry, field = key[len(prefix) + 1:].split(".", 1)
            out.setdefault(entry, {})[field] = value
    return out


def _drop_what_was_not_saved(state: dict[str, Any], keys: set[str],
                             optimizer_keys: list[str]) -> None:
    """Take out of the load template the optional parts the checkpoint lacks (``dcp.load``
    raises on a missing entry): amp's state, masters, and RNG states of other kinds."""

    def saved(prefix: str) -> bool:
        return any(k.startswith(prefix + ".") for k in keys)

    if "amp" in state and not saved("amp"):
        del state["amp"]  # saved without amp (an fp32 run): the scalers keep their state
        logger.info("amp_patch.load_checkpoint: the checkpoint holds no loss-scaler state")
    elif "amp" not in state and saved("amp"):
        logger.warning("amp_patch.load_checkpoint: the checkpoint's loss-scaler state is not "
                       "loaded: no amp session is live (call amp_patch.initialize() first)")
    for rank, entry in state["rng"].items():
        for kind in [k for k in entry if f"rng.{rank}.{k}" not in keys]:
            del entry[kind]  # a CUDA state saved on a CPU host, or the other way round
    for key in optimizer_keys:
        if MASTERS_KEY in state[key] and not saved(f"{key}.{MASTERS_KEY}"):
            del state[key][MASTERS_KEY]  # saved without masters: see _load_optimizer


# --------------------------------------------------------------------------- building the state


def _training_state(model, optimizer, extra, rng_rank: int | None) -> dict[str, Any]:
    """The dict ``dcp.save`` writes and ``dcp.load`` fills: see the module's text."""
    models = _as_list(model)
    optimizers = _as_list(optimizer)
    session = _session.current()
    names = _names(models)
    state: dict[str, Any] = {}
    for i, m in enumerate(models):
        state[_key("model", i, len(models))] = _unwrap(m).state_dict()
    for i, opt in enumerate(optimizers):
        state[_key("optimizer", i, len(optimizers))] = _optimizer_state(opt, names, session)
    if session is not None and session.props.enabled:
        state["amp"] = state_dict()
    state["rng"] = {} if rng_rank is None else {f"rank{rng_rank}": _rng_state()}
    for name, value in (extra or {}).items():
        if name in _RESERVED:
            raise ValueError(f"extra={{{name!r}: ...}}: the names {', '.join(_RESERVED)} are "
                             "taken by the checkpoint itself; choose another")
        state[name] = value
    return state


def _optimizer_state(optimizer, names: dict[int, str], session) -> dict[str, Any]:
    """The optimizer's state dict keyed by parameter name (the model parameter behind a master)."""
    opt = underlying_optimizer(optimizer)
    _materialize_state(opt, session)
    sd = opt.state_dict()
    flat = _stepped_names(opt, names, session)
    out: dict[str, Any] = {
        "state": {flat[i]: value for i, value in sd["state"].items()},
        # A tuple is stored whole: its hyper-parameters need no key of their own in the checkpoint.
        "param_groups": tuple(dict(g, params=[flat[i] for i in g["params"]])
                              for g in sd["param_groups"]),
    }
    if MASTERS_KEY in sd:
        out[MASTERS_KEY] = {flat[int(i)]: master for i, master in sd[MASTERS_KEY].items()}
    return out


def _checked_groups(optimizer, saved_groups, names: dict[int, str], session) -> list[dict]:
    """The checkpoint's param groups with this optimizer's flat indices for parameter names.

    Raises:
        ValueError: the groups are not as many as this optimizer's, or one
            steps other parameters.
    """
    opt = underlying_optimizer(optimizer)
    flat = _stepped_names(opt, names, session)
    groups = list(saved_groups)
    if len(groups) != len(opt.param_groups):
        raise ValueError(f"the checkpoint's optimizer has {len(groups)} param groups, this "
                         f"{type(opt).__name__} has {len(opt.param_groups)}")
    start, new_groups = 0, []
    for gi, (group, current) in enumerate(zip(groups, opt.param_groups)):
        mine = flat[start:start + len(current["params"])]
        if set(group["params"]) != set(mine):
            missing = sorted(set(mine) - set(group["params"]))
            extra = sorted(set(group["params"]) - set(mine))
            raise ValueError(f"param group {gi} of the checkpoint's optimizer does not step the "
                             f"same parameters as this one: not in the checkpoint {missing[:5]}, "
                             f"only in the checkpoint {extra[:5]}")
        new_groups.append(dict(group, params=list(range(start, start + len(mine)))))
        start += len(mine)
    return new_groups


def _load_optimizer(optimizer, saved: dict[str, Any], groups: list[dict],
                    names: dict[int, str], session) -> None:
    opt = underlying_optimizer(optimizer)
    index = {name: i for i, name in enumerate(_stepped_names(opt, names, session))}
    sd: dict[str, Any] = {"state": {index[n]: v for n, v in saved["state"].items()},
                          "param_groups": groups}
    if MASTERS_KEY in saved:
        sd[MASTERS_KEY] = {index[n]: v for n, v in saved[MASTERS_KEY].items()}
    else:
        # Saved without masters (an fp32 or O1 run): the model's entries, which are the masters'
        # own storage under O2, were loaded into them already. Without this the optimizer would
        # restart them from the half model.
        record = session.optimizer_records.get(id(opt)) if session is not None else None
        if record is not None and len(record.masters):
            sd[MASTERS_KEY] = {i: p for i, p in enumerate(_flat(opt))
                               if record.masters.is_master(p)}
    opt.load_state_dict(sd)


def _take_saved_codes(optimizer, prefix: str, metadata: Mapping[str, Any],
                      names: dict[int, str], session) -> bool:
    """Store the state of an optimizer with a state format (amp_patch's FusedAdam and FusedSGD,
    see :mod:`amp_patch.optim.fused.state_format`) in the codes the checkpoint holds.

    ``dcp.load`` fills the live tensors in place and needs every entry the checkpoint has,
    of its dtype: block-scaled codes have scales beside them that fp32 state lacks, and
    int8 codes read into fp32 tensors would be taken for values. The state is converted
    (decoded, encoded) to the saved codes first; its values are then overwritten by the
    load, and the next step converts them to the optimizer's own format. Returns whether
    anything was converted.
    """
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    opt = underlying_optimizer(optimizer)
    if not getattr(opt, "LEAN_STATE", False):
        return False
    changed = False
    for p, name in zip(_flat(opt), _stepped_names(opt, names, session)):
        entry = opt.state.get(p) or {}
        for key, value in list(entry.items()):
            saved = metadata.get(f"{prefix}.state.{name}.{key}")
            if (key == "step" or key.endswith(SCALE_SUFFIX) or not isinstance(value, torch.Tensor)
                    or not isinstance(saved, TensorStorageMetadata)):
                continue
            dtype = saved.properties.dtype
            if value.dtype != dtype or (key + SCALE_SUFFIX in entry) != (dtype in SCALED_CODES):
                opt.state_in_code(p, key, dtype)  # converts in place of the entry
                changed = True
    return changed


def _flat(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for group in opt.param_groups for p in group["params"]]


def _stepped_names(opt: torch.optim.Optimizer, names: dict[int, str], session) -> list[str]:
    record = session.optimizer_records.get(id(opt)) if session is not None else None
    out = []
    for gi, group in enumerate(opt.param_groups):
        for pi, p in enumerate(group["params"]):
            param = record.model_param(p) if record is not None else p
            name = names.get(id(param))
            if name is None:
                raise ValueError(f"{type(opt).__name__} param_groups[{gi}]['params'][{pi}] belongs "
                                 "to none of the models passed: pass every model it steps")
            out.append(name)
    return out


def _materialize_state(opt: torch.optim.Optimizer, session) -> None:
    """Let a fresh optimizer make its state (torch's zero-gradient, zero-lr step) without letting
    that step consume a skip amp has scheduled."""
    from torch.distributed.checkpoint.state_dict import _init_optim_state

    record = session.optimizer_records.get(id(opt)) if session is not None else None
    with record.grads.skip_held_back() if record is not None else contextlib.nullcontext():
        _init_optim_state(opt)


# --------------------------------------------------------------------------- helpers


@contextlib.contextmanager
def _single_process_quiet():
    """DCP warns at every call without a process group; one process is a use amp documents."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is (disabled, )?unavailable "
                                "or uninitialized, assuming the intent")
        yield


def _rng_state() -> dict[str, torch.Tensor]:
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng(kind: str, value: torch.Tensor) -> None:
    if kind == "cpu":
        torch.set_rng_state(value)
    elif kind == "cuda" and torch.cuda.is_available():
        torch.cuda.set_rng_state(value)


def _rank(process_group) -> int:
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()):
        return 0
    return dist.get_rank(process_group)


def _names(models: list[nn.Module]) -> dict[int, str]:
    return {id(p): name for name, p in named_parameters([_unwrap(m) for m in models])}


def _unwrap(model: nn.Module) -> nn.Module:
    """The module whose names the checkpoint uses: DDP's and torch.compile's wrappers removed,
    so that a checkpoint moves between them."""
    while True:
        if isinstance(model, nn.parallel.DistributedDataParallel):
            model = model.module
        elif isinstance(getattr(model, "_orig_mod", None), nn.Module):
            model = model._orig_mod
        else:
            return model


def _as_list(value) -> list:
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple)) else [value]


def _key(kind: str, i: int, n: int) -> str:
    return kind if n == 1 else f"{kind}{i}"
