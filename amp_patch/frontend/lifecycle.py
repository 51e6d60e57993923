"""``initialize``, ``deinitialize`` and the amp checkpoint state."""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any, Sequence, TypeVar

import torch
from torch import nn

from amp_patch import ops as _ops, session as _session
from amp_patch.casting import fp8 as _fp8, fsdp as _fsdp, model as _model
from amp_patch.frontend import debug as _debug
from amp_patch.helpers import agree as _agree, logs as _logging
from amp_patch.optim import amp as _optim
from amp_patch.optim.amp import OPTIMIZER_TYPES, stash as _stash, underlying_optimizer
from amp_patch.patching import (
    cpu_half as _cpu_half,
    install as _install_patches,
    regather as _regather,
)
from amp_patch.patching.state import disable_casts, optimizer_step
from amp_patch.scaler import AmpScaler
from amp_patch.settings import levels as _levels
from amp_patch.settings.dtypes import HALF_DTYPES
from amp_patch.settings.fp8 import Fp8ModuleFilter, Fp8Recipe
from amp_patch.settings.properties import Properties

__all__ = ["initialize", "deinitialize", "state_dict", "load_state_dict"]

T = TypeVar("T")

_WRAPPERS = (nn.DataParallel, nn.parallel.DistributedDataParallel)


def initialize(
    models,
    optimizers=None,
    enabled: bool = True,
    opt_level: str = "O1",
    cast_model_type=None,
    patch_torch_functions: bool | None = None,
    keep_batchnorm_fp32=None,
    master_weights: bool | str | None = None,
    loss_scale=None,
    cast_model_outputs: torch.dtype | None = None,
    num_losses: int = 1,
    verbosity: int = 1,
    min_loss_scale: float | None = None,
    max_loss_scale: float = 2.0**24,
    *,
    half_dtype: torch.dtype | None = None,
    max_consecutive_skips: int | None = None,
    cpu_half_compute: str | None = None,
    optimizer_state: str | None = None,
    sync_free: bool | None = None,
    host_read_interval: int | None = None,
    fp8: str | Fp8Recipe | None = None,
    fp8_modules: Fp8ModuleFilter | list[str] | str = None,
):
    """Set up mixed precision for models and optimizers at an opt level.

    The models and optimizers are changed in place and returned in the shape
    they were passed: ``m, o``, ``m, [o]``, ``[m], o`` or ``[m], [o]``, or the
    models alone when ``optimizers`` is None. A returned model *is* the model
    passed in, and every parameter keeps its :class:`~torch.nn.Parameter`
    object.

    Args:
        models (torch.nn.Module or list of torch.nn.Module): the models. Wrap
            them in DataParallel or DistributedDataParallel *after* this call;
            shard them with FSDP2's ``fully_shard`` *before* it, and build the
            optimizer over the sharded parameters in between (see
            :mod:`amp_patch.casting.fsdp`).
        optimizers (torch.optim.Optimizer or list, optional): the optimizers,
            built over the models' parameters; Apex's LARC around one is
            accepted too. Default: None.
        enabled (bool, optional): False makes this call and :func:`scale_loss`
            no-ops. Default: True.
        opt_level (str, optional): ``"O0"`` fp32, ``"O1"`` patched torch
            functions, ``"O2"`` half model with fp32 master weights, ``"O3"``
            pure half. Default: ``"O1"``.
        cast_model_type (torch.dtype or False, optional): override of the
            level's model dtype; False disables model and input casting.
        patch_torch_functions (bool, optional): override (O1 only).
        keep_batchnorm_fp32 (bool or str, optional): keep affine batch norms fp32.
        master_weights (bool or str, optional): keep fp32 master weights (True),
            or bf16 ones (``"bf16"``): a bf16 param is then its own master and
            the optimizer writes it with stochastic rounding; fp16 params get a
            bf16 master. Not at O1, whose model stays fp32.
        loss_scale (float or str, optional): a static scale or ``"dynamic"``.
        cast_model_outputs (torch.dtype, optional): dtype of model outputs.
        num_losses (int, optional): how many losses get their own scaler. Default: 1.
        verbosity (int, optional): 0 silent, 1 show the chosen properties
            (rank 0 only), 2 debug. Default: 1.
        min_loss_scale (float, optional): floor of the dynamic scale.
        max_loss_scale (float, optional): ceiling of the dynamic scale. Default: 2**24.
        half_dtype (torch.dtype, optional): ``torch.float16`` or
            ``torch.bfloat16``. Default: fp16 for models on CUDA, else bf16.
        max_consecutive_skips (int, optional): with a static loss scale, the
            consecutive skipped steps of one loss allowed before the next
            overflow raises :class:`~amp_patch.scaler.LossScaleCollapseError`.
            Default: 50.
        cpu_half_compute (str, optional): ``"auto"``, ``"native"`` or
            ``"emulate"``: whether half matmuls and convolutions on the CPU are
            emulated (fp32 compute, outputs rounded to half). ``"auto"``
            emulates where :func:`amp_patch.cpu_half_support` reports the host
            not native. Default: ``"auto"``.
        optimizer_state (str, optional): how the optimizers keep their state:
            ``"fp32"``, ``"bf16"``, ``"int8"`` (block-scaled 8-bit moments) or
            ``"fp8"`` (e4m3 first moment, bf16 second); see
            :mod:`amp_patch.optim.fused.state_format`. Anything but ``"fp32"``
            (and ``master_weights="bf16"``) needs amp_patch's FusedAdam or
            FusedSGD. Default: ``"fp32"``.
        sync_free (bool, optional): ``scale_loss`` reads nothing on the host:
            the loss scale is updated on the device, and an overflowed step is
            skipped there by torch's ``fused=True`` Adam, AdamW and SGD and by
            amp_patch's ``FusedAdam`` and ``FusedSGD`` with fp32 state, which take
            the flag as a tensor; any other optimizer (amp_patch's other fused
            ones: their step counters live on the host) reads it in ``step()``,
            once. The loss scale, the overflow message and a collapse are read
            lazily (docs/design.md, "Host syncs"). False reads the overflow at
            every ``scale_loss`` exit, as Apex did. Default: True.
        host_read_interval (int, optional): with ``sync_free``, the updates
            between two host reads of a loss scaler's state, where its overflow
            messages are logged and a collapse raises. Default: 100.
        fp8 (str or Fp8Recipe, optional): run the eligible ``nn.Linear`` layers'
            three GEMMs (forward, grad-input, grad-weight) in FP8 through
            ``torch._scaled_mm``, at any level: ``"tensorwise"`` (current
            per-tensor scaling), ``"delayed"`` (amax histories, updated once per
            optimizer step), ``"rowwise"`` (per-row scales, E4M3), or an
            :class:`~amp_patch.Fp8Recipe`. The rest of the model runs at the
            level's precision. :func:`amp_patch.fp8_plan` tells which layers were
            converted (see :mod:`amp_patch.casting.fp8`). Default: None.
        fp8_modules (callable or list of str, optional): which layers FP8
            converts instead of the default filter: ``(name, linear) -> bool``,
            or names (exact or fnmatch patterns). Default: the recipe's.

    Returns:
        The models and optimizers, as passed.

    Raises:
        ValueError: an unknown opt level, a disallowed override, the same
            optimizer twice, parameters on more than one device type, or (at
            O2/O3, or with models sharded by ``fully_shard``) optimizer
            parameters that belong to none of the models (at O0/O1 those are
            a warning otherwise) or float64 parameters; for FSDP2 models, a
            ``MixedPrecisionPolicy`` that contradicts the level, or
            ``keep_batchnorm_fp32`` with a batch norm in a mixed FSDP group.
        TypeError: a model or optimizer of the wrong type (a tuple where a
            list is expected, a wrapped model).
        RuntimeError: an optimizer already went through initialize (it carries
            Apex's marker ``_amp_stash``; Apex's message), or a session is already
            live; call :func:`deinitialize` first.

    Example::

        >>> model, optimizer = amp.initialize(model, optimizer, opt_level="O2")
        >>> loss = loss_fn(model(x), y)
        >>> with amp.scale_loss(loss, optimizer) as scaled_loss:
        ...     scaled_loss.backward()
        >>> optimizer.step()
    """
    model_list, models_listed = _as_list(models, (nn.Module,), "models")
    if optimizers is None:
        opt_list: list[Any] = []
        opts_listed = False
    else:
        opt_list, opts_listed = _as_list(optimizers, OPTIMIZER_TYPES, "optimizers")
    _check_models(model_list)
    _check_optimizers(opt_list)
    # A second initialize is named before anything it would trip over: at O2 the optimizer
    # would step masters that belong to none of the models, and say only that.
    live = _session.current()
    _stash.check_not_stashed(opt_list, underlying_optimizer,
                             live.optimizers if live is not None else [])
    _session.check_none_live()

    props = Properties.from_opt_level(
        opt_level,
        half_dtype if half_dtype is not None else _default_half_dtype(model_list, cast_model_type),
        enabled=enabled,
        cast_model_type=cast_model_type,
        patch_torch_functions=patch_torch_functions,
        keep_batchnorm_fp32=keep_batchnorm_fp32,
        master_weights=master_weights,
        loss_scale=loss_scale,
        cast_model_outputs=cast_model_outputs,
        num_losses=num_losses,
        verbosity=verbosity,
        min_loss_scale=min_loss_scale,
        max_loss_scale=max_loss_scale,
        max_consecutive_skips=max_consecutive_skips,
        cpu_half_compute=cpu_half_compute,
        optimizer_state=optimizer_state,
        sync_free=sync_free,
        host_read_interval=host_read_interval,
        fp8=fp8,
        fp8_modules=fp8_modules,
    )
    restore_logging = _logging.configure(props.verbosity)
    try:
        if props.enabled:
            _check_params_belong(model_list, opt_list, props)
            _check_no_float64_params(model_list, props)
        session = _session.AmpSession(props, model_list, opt_list)
        _session.activate(session)
    except BaseException:
        restore_logging()
        raise
    # Registered first, so undone last: the other undos still log at this session's level.
    session.on_close("the amp_patch logger's level and handler", restore_logging)
    if props.enabled:
        try:
            _build(session)
        except BaseException:
            _session.reset(abort=True)  # nothing stays half-applied, model dtypes included
            raise
        session.commit()
        _logging.logger.info("%s", props.describe())
    else:
        # Apex's marker all the same: a trainer that initializes while the optimizer has none
        # must not call initialize again at every iteration.
        for optimizer in opt_list:
            _stash.install(optimizer, None, session.on_close)
        _logging.logger.info(
            "amp_patch is disabled (enabled=False): models and optimizers unchanged")

    out_models = model_list if models_listed else model_list[0]
    if optimizers is None:
        return out_models
    return out_models, (opt_list if opts_listed else opt_list[0])


def _build(session: _session.AmpSession) -> None:
    props = session.props
    # Each stage gets what it needs of the session (the settings, the models, on_close, the
    # masters) and returns what the session keeps; none of them looks the session up.
    # Before the cast: the sharding plan says what FSDP casts itself.
    session.sharding = _fsdp.prepare(props, session.models, session.on_close)
    _model.prepare(props, session.models, session.on_close, sharding=session.sharding,
                   master_for=session.master_for, load_master=session.load_master)
    # After the cast (it reads the weights' dtypes), before the optimizers get their masters
    # (it maps each weight to the optimizer that steps it).
    session.fp8 = _fp8.install(props, session.models,
                               [underlying_optimizer(o) for o in session.optimizers],
                               session.on_close, no_casts=disable_casts)
    if session.fp8 is not None:
        session.on_close("the session's FP8 layers", lambda: setattr(session, "fp8", None))
    # Before O1's patches, so that O1's wrappers call the emulating ones they find.
    session.cpu_half = _cpu_half.install(props, session.models, session.on_close)
    if props.patch_torch_functions:
        install_casts(session)
        if session.sharding is not None:
            _regather.install(session.casts, session.sharding.states, session.on_close)
    for optimizer in session.optimizers:
        record = _optim.process(optimizer, props.master_dtype, session.on_close, optimizer_step,
                                optimizer_state=props.optimizer_state)
        session.optimizer_records[id(optimizer)] = record
        _stash.install(optimizer, record, session.on_close)
    session.scalers = [AmpScaler.from_properties(props, loss_id=i)
                       for i in range(props.num_losses)]
    _debug.install(session)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        _fsdp.install_order_guard(session.models, session.optimizer_records.values(),
                                  session.on_close)
        _agree.check_kernels(_ops.native_extension_loaded())


def install_casts(session: _session.AmpSession, *, allow_banned: bool = False,
                  enable_caching: bool = True) -> None:
    """Install O1's patches for ``session`` and keep their state in ``session.casts``.

    ``session.casts`` goes back to None when the session closes, after the
    patches are undone.

    Args:
        session (AmpSession): the session being built.
        allow_banned (bool, optional): see :func:`amp_patch.patching.install`. Default: False.
        enable_caching (bool, optional): see :func:`amp_patch.patching.install`. Default: True.
    """
    session.on_close("the session's O1 state", lambda: setattr(session, "casts", None))
    session.casts = _install_patches(session.props.half_dtype, session.models, session.on_close,
                                     allow_banned=allow_banned, enable_caching=enable_caching)


def deinitialize() -> None:
    """Undo everything :func:`initialize` did.

    Restores every patched torch function and Tensor method (the very same
    objects), removes the model hooks, and restores the optimizers' methods.
    Models and optimizers keep their current dtypes and values. Afterwards
    :func:`initialize` may be called again. Calling it with no live session
    does nothing.

    Example::

        >>> original_mm = torch.mm
        >>> model, opt = amp.initialize(model, opt, opt_level="O1")
        >>> torch.mm is original_mm
        False
        >>> amp.deinitialize()
        >>> torch.mm is original_mm
        True
    """
    _session.reset()


def state_dict(destination: dict | None = None) -> dict[str, dict[str, Any]]:
    """The loss scalers' state, and the FP8 layers' delayed state, for a checkpoint.

    Args:
        destination (dict, optional): a dict to fill instead of a new one.

    Returns:
        dict: ``{"loss_scaler0": {"loss_scale": float, "unskipped": int, ...}, ...}``;
        under ``fp8="delayed"`` also ``"fp8": {"<layer>.history": Tensor,
        "<layer>.scale": Tensor, ...}`` (copies).

    Raises:
        RuntimeError: if :func:`initialize` was not called.
    """
    session = _session.require("amp_patch.state_dict()")
    out = {} if destination is None else destination
    for i, scaler in enumerate(session.scalers):
        out[f"loss_scaler{i}"] = scaler.state_dict()
    fp8_state = session.fp8.state_dict() if session.fp8 is not None else {}
    if fp8_state:
        out["fp8"] = fp8_state
    return out


def load_state_dict(state: dict[str, dict[str, Any]]) -> None:
    """Restore the loss scalers' state saved by :func:`state_dict`. Call after :func:`initialize`.

    Args:
        state (dict): as returned by :func:`state_dict`: ``{"loss_scaler0":
            {"loss_scale": float, "unskipped": int, ...}, ...}``, one entry per
            loss, and ``"fp8"`` (the delayed FP8 state; a checkpoint without it
            loads, and the FP8 layers keep their scales); other keys are ignored.

    Raises:
        RuntimeError: if :func:`initialize` was not called, or the checkpoint's
            scalers are not ``loss_scaler0`` to ``loss_scaler{num_losses - 1}``.
        TypeError: ``state``, or one scaler's entry, is not a dict.
        ValueError: a key ``loss_scaler...`` without a number, or an entry
            without ``loss_scale`` and ``unskipped`` or with bad values.

    Every entry is checked before any is loaded: a bad checkpoint changes nothing.
    """
    session = _session.require("amp_patch.load_state_dict()")
    if not session.props.enabled:
        return
    expected = check_scaler_states(session, state)
    fp8_state = state.get("fp8")
    if fp8_state is not None and session.fp8 is not None:
        session.fp8.check_state_dict(fp8_state)
    for key, scaler in zip(expected, session.scalers):
        scaler.load_state_dict(state[key])
    if session.fp8 is not None and fp8_state is not None:
        session.fp8.load_state_dict(fp8_state)
    elif session.fp8 is not None and session.fp8.state_dict():
        _logging.logger.info("amp_patch: the amp state holds no FP8 state (saved without "
                             "fp8='delayed'?): the FP8 layers keep their current scales")


def check_scaler_states(session: _session.AmpSession, state: Any) -> list[str]:
    """Check the amp state for :func:`load_state_dict` without loading it.

    Args:
        session (AmpSession): the live session, whose loss scalers would load ``state``.
        state (dict): as :func:`state_dict` returned it.

    Returns:
        list: the keys of ``state`` that its scalers load, in their order.

    Raises:
        TypeError, ValueError, RuntimeError: as :func:`load_state_dict`.

    Example::

        >>> from amp_patch import session
        >>> model, opt = amp.initialize(model, opt, opt_level="O1", half_dtype=torch.float16)
        >>> check_scaler_states(session.current(),
        ...                     {"loss_scaler0": {"loss_scale": 2.0, "unskipped": 0}})
        ['loss_scaler0']
    """
    n = len(session.scalers)
    expected = [f"loss_scaler{i}" for i in range(n)]
    form = ("the dict that amp_patch.state_dict() returns, {'loss_scaler0': {'loss_scale': "
            "float, 'unskipped': int}, ...}")
    if not isinstance(state, Mapping):
        raise TypeError(f"amp_patch.load_state_dict() takes {form}; got {type(state).__name__}")
    keys = [k for k in state if isinstance(k, str) and k.startswith("loss_scaler")]
    bad = [k for k in keys if not k[len("loss_scaler"):].isdigit()]
    if bad:
        raise ValueError(f"unexpected key {bad[0]!r} in the amp state: loss scalers are saved as "
                         f"{', '.join(expected)} (loss_scaler followed by the loss_id)")
    if sorted(keys) != sorted(expected):
        raise RuntimeError(
            f"the checkpoint holds the loss scalers {sorted(keys)} but initialize() was called "
            f"with num_losses={n}, which needs {expected}"
        )
    for key, scaler in zip(expected, session.scalers):
        scaler.check_state_dict(state[key])
    return expected


def _as_list(value: Any, kinds: tuple[type, ...], name: str) -> tuple[list, bool]:
    if isinstance(value, kinds):
        return [value], False
    described = " or ".join(f"{k.__module__}.{k.__qualname__}" for k in kinds)
    if isinstance(value, list):
        if not value:
            raise ValueError(f"{name} is an empty list")
        bad = [type(v).__name__ for v in value if not isinstance(v, kinds)]
        if bad:
            raise TypeError(f"{name} must be {described} objects; got {', '.join(bad)}")
        return list(value), True
    hint = " (pass a list, not a tuple)" if isinstance(value, tuple) else ""
    raise TypeError(
        f"{name} must be a {described} or a list of them, got {type(value).__name__}{hint}"
    )


def _check_models(models: Sequence[nn.Module]) -> None:
    for m in models:
        if isinstance(m, _WRAPPERS):
            raise TypeError(
                f"the model is already wrapped in {type(m).__name__}; call amp_patch.initialize() "
                f"on the bare model first and wrap it in {type(m).__name__} afterwards"
            )
    device_types = {t.device.type for m in models for t in _floating_tensors(m)}
    if len(device_types) > 1:
        raise ValueError(
            f"the models have parameters on more than one device type ({sorted(device_types)}); "
            "move every model to one device before amp_patch.initialize()"
        )


def _check_optimizers(optimizers: Sequence[Any]) -> None:
    seen: set[int] = set()
    for opt in optimizers:
        inner = underlying_optimizer(opt)  # a LARC and the optimizer it wraps are one
        if id(inner) in seen:
            raise ValueError(
                f"the same optimizer ({type(inner).__name__}) was passed to initialize twice"
            )
        seen.add(id(inner))


def _check_params_belong(models: Sequence[nn.Module], optimizers: Sequence[Any],
                         props: Properties) -> None:
    """Optimizer params outside every model: an error where the models are cast (O2/O3: the
    optimizer would step tensors the cast models no longer use), else a warning."""
    owned = {id(p) for m in models for p in m.parameters()}
    foreign = [f"{type(opt).__name__} param_groups[{gi}]['params'][{pi}] "
               f"(shape {tuple(p.shape)}, {p.dtype})"
               for opt in map(underlying_optimizer, optimizers)
               for gi, group in enumerate(opt.param_groups)
               for pi, p in enumerate(group["params"]) if id(p) not in owned]
    if not foreign:
        return
    if _fsdp.fsdp_states(models):
        raise ValueError(
            f"{len(foreign)} parameters of the optimizers belong to none of the models passed to "
            f"amp_patch.initialize(), which are sharded with fully_shard: an optimizer built "
            f"before fully_shard holds the unsharded parameters. Call {_fsdp.SUPPORTED_ORDER}.")
    n = len(foreign)
    shown = ", ".join(foreign[:5]) + (f", and {n - 5} more" if n > 5 else "")
    what = (f"{n} parameter{'s' if n > 1 else ''} of the optimizers belong{'s' if n == 1 else ''} "
            f"to none of the models passed to amp_patch.initialize(): {shown}")
    if _levels.get(props.opt_level).casts_model_to_half:  # O2, O3
        raise ValueError(f"{what}. {props.opt_level} casts the models passed, so the optimizer "
                         "must be built over their parameters: pass every model it steps.")
    warnings.warn(f"{what}. amp will step them but casts nothing for them; pass every model "
                  "the optimizer steps.", stacklevel=3)


def _check_no_float64_params(models: Sequence[nn.Module], props: Properties) -> None:
    """amp casts fp16/bf16/fp32 only; a float64 param left in a half model fails at the first
    forward with a dtype mismatch, so say it here, by name."""
    if props.cast_model_type not in HALF_DTYPES:
        return
    doubles = [name for name, p in _model.named_parameters(list(models))
               if p.dtype == torch.float64]
    if doubles:
        raise ValueError(
            f"{props.opt_level} casts the model to {props.cast_model_type}, but amp leaves float64 "
            f"parameters as they are, and these would then meet half inputs: {', '.join(doubles)}. "
            "Convert the model to float32 (model.float()) before amp_patch.initialize()."
        )


def _floating_tensors(model: nn.Module):
    for t in list(model.parameters()) + list(model.buffers()):
        if t.is_floating_point():
            yield t


def _default_half_dtype(models: Sequence[nn.Module], cast_model_type: Any) -> torch.dtype:
    # An explicit half cast_model_type says what "half" means (and so the default loss scale).
    if isinstance(cast_model_type, torch.dtype) and cast_model_type in HALF_DTYPES:
        return cast_model_type
    on_cuda = any(t.is_cuda for m in models for t in _floating_tensors(m))
    return torch.float16 if on_cuda else torch.bfloat16
