"""``initialize``, ``deinitialize`` and the amp checkpoint state."""

from __future__ import annotations

from typing import Any, Sequence, TypeVar

import torch
from torch import nn

from amp_patch import _logging, session as _session
from amp_patch.properties import Properties

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
    master_weights: bool | None = None,
    loss_scale=None,
    cast_model_outputs: torch.dtype | None = None,
    num_losses: int = 1,
    verbosity: int = 1,
    min_loss_scale: float | None = None,
    max_loss_scale: float = 2.0**24,
    *,
    half_dtype: torch.dtype | None = None,
    cpu_half_compute: str | None = None,
):
    """Set up mixed precision for models and optimizers at an opt level.

    The models and optimizers are changed in place and returned in the shape
    they were passed: ``m, o``, ``m, [o]``, ``[m], o`` or ``[m], [o]``, or the
    models alone when ``optimizers`` is None. A returned model *is* the model
    passed in, and every parameter keeps its :class:`~torch.nn.Parameter`
    object.

    Args:
        models (torch.nn.Module or list of torch.nn.Module): the models. Wrap
            them in DataParallel or DistributedDataParallel *after* this call.
        optimizers (torch.optim.Optimizer or list, optional): the optimizers,
            built over the models' parameters. Default: None.
        enabled (bool, optional): False makes this call and :func:`scale_loss`
            no-ops. Default: True.
        opt_level (str, optional): ``"O0"`` fp32, ``"O1"`` patched torch
            functions, ``"O2"`` half model with fp32 master weights, ``"O3"``
            pure half. Default: ``"O1"``.
        cast_model_type (torch.dtype or False, optional): override of the
            level's model dtype; False disables model and input casting.
        patch_torch_functions (bool, optional): override (O1 only).
        keep_batchnorm_fp32 (bool or str, optional): keep affine batch norms fp32.
        master_weights (bool, optional): keep fp32 master weights.
        loss_scale (float or str, optional): a static scale or ``"dynamic"``.
        cast_model_outputs (torch.dtype, optional): dtype of model outputs.
        num_losses (int, optional): how many losses get their own scaler. Default: 1.
        verbosity (int, optional): 0 silent, 1 show the chosen properties
            (rank 0 only), 2 debug. Default: 1.
        min_loss_scale (float, optional): floor of the dynamic scale.
        max_loss_scale (float, optional): ceiling of the dynamic scale. Default: 2**24.
        half_dtype (torch.dtype, optional): ``torch.float16`` or
            ``torch.bfloat16``. Default: fp16 for models on CUDA, else bf16.
        cpu_half_compute (str, optional): ``"auto"``, ``"native"`` or
            ``"emulate"``: whether half matmuls and convolutions on the CPU are
            emulated (fp32 compute, outputs rounded to half). ``"auto"``
            emulates where :func:`amp_patch.cpu_half_support` reports the host
            not native. Default: ``"auto"``.

    Returns:
        The models and optimizers, as passed.

    Raises:
        ValueError: an unknown opt level, a disallowed override, the same
            optimizer twice, or parameters on more than one device type.
        TypeError: a model or optimizer of the wrong type (a tuple where a
            list is expected, a wrapped model).
        RuntimeError: a session is already live; call :func:`deinitialize` first.

    Example::

        >>> model, optimizer = amp.initialize(model, optimizer, opt_level="O2")
        >>> with amp.scale_loss(loss, optimizer) as scaled_loss:
        ...     scaled_loss.backward()
        >>> optimizer.step()
    """
    model_list, models_listed = _as_list(models, nn.Module, "models")
    if optimizers is None:
        opt_list, opts_listed = [], False
    else:
        opt_list, opts_listed = _as_list(optimizers, torch.optim.Optimizer, "optimizers")
    _check_models(model_list)
    _check_optimizers(opt_list)

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
        cpu_half_compute=cpu_half_compute,
    )
    _logging.configure(props.verbosity)

    session = _session.AmpSession(props, model_list, opt_list)
    _session.activate(session)
    if props.enabled:
        try:
            _build(session)
        except BaseException:
            _session.reset()
            raise
        _logging.logger.info("%s", props.describe())
    else:
        _logging.logger.info("amp_patch is disabled (enabled=False): models and optimizers unchanged")

    out_models = model_list if models_listed else model_list[0]
    if optimizers is None:
        return out_models
    return out_models, (opt_list if opts_listed else opt_list[0])


def _build(session: _session.AmpSession) -> None:
    # Imported here: these modules import torch-heavy pieces that need ops registered first.
    from amp_patch import cpu_half as _cpu_half, model as _model, optim as _optim
    from amp_patch.patching import install as _install_patches
    from amp_patch.scaler import LossScaler

    props = session.props
    _model.prepare(session)
    # Before O1's patches, so that O1's wrappers call the emulating ones they find.
    _cpu_half.install(session)
    if props.patch_torch_functions:
        _install_patches(session)
    for optimizer in session.optimizers:
        session.optimizer_records[id(optimizer)] = _optim.process(optimizer, session)
    session.scalers = [LossScaler.from_properties(props, loss_id=i)
                       for i in range(props.num_losses)]


def deinitialize() -> None:
    """Undo everything :func:`initialize` did.

    Restores every patched torch function and Tensor method (the very same
    objects), removes the model hooks, and restores the optimizers' methods.
    Models and optimizers keep their current dtypes and values. Afterwards
    :func:`initialize` may be called again. Calling it with no live session
    does nothing.

    Example::

        >>> amp.deinitialize()
        >>> torch.mm is original_mm
        True
    """
    _session.reset()


def state_dict(destination: dict | None = None) -> dict[str, dict[str, Any]]:
    """The loss scalers' state, for a checkpoint.

    Args:
        destination (dict, optional): a dict to fill instead of a new one.

    Returns:
        dict: ``{"loss_scaler0": {"loss_scale": float, "unskipped": int, ...}, ...}``.

    Raises:
        RuntimeError: if :func:`initialize` was not called.
    """
    session = _session.require("amp_patch.state_dict()")
    out = {} if destination is None else destination
    for i, scaler in enumerate(session.scalers):
        out[f"loss_scaler{i}"] = scaler.state_dict()
    return out


def load_state_dict(state: dict[str, dict[str, Any]]) -> None:
    """Restore the loss scalers' state saved by :func:`state_dict`. Call after :func:`initialize`.

    Args:
        state (dict): as returned by :func:`state_dict`.

    Raises:
        RuntimeError: if :func:`initialize` was not called, or the number of
            scalers differs from ``num_losses``.
    """
    session = _session.require("amp_patch.load_state_dict()")
    if not session.props.enabled:
        return
    keys = sorted((k for k in state if k.startswith("loss_scaler")), key=lambda k: int(k[11:]))
    if len(keys) != len(session.scalers):
        raise RuntimeError(
            f"the checkpoint holds {len(keys)} loss scaler(s) but initialize() was called with "
            f"num_losses={len(session.scalers)}"
        )
    for i, scaler in enumerate(session.scalers):
        scaler.load_state_dict(state[f"loss_scaler{i}"])


def _as_list(value: Any, kind: type, name: str) -> tuple[list, bool]:
    if isinstance(value, kind):
        return [value], False
    if isinstance(value, list):
        if not value:
            raise ValueError(f"{name} is an empty list")
        bad = [type(v).__name__ for v in value if not isinstance(v, kind)]
        if bad:
            raise TypeError(f"{name} must be {kind.__name__} objects; got {', '.join(bad)}")
        return list(value), True
    hint = " (pass a list, not a tuple)" if isinstance(value, tuple) else ""
    raise TypeError(
        f"{name} must be a {kind.__module__}.{kind.__qualname__} or a list of them, "
        f"got {type(value).__name__}{hint}"
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


def _check_optimizers(optimizers: Sequence[torch.optim.Optimizer]) -> None:
    seen: set[int] = set()
    for opt in optimizers:
        if id(opt) in seen:
            raise ValueError(
                f"the same optimizer ({type(opt).__name__}) was passed to initialize twice"
            )
        seen.add(id(opt))


def _floating_tensors(model: nn.Module):
    for t in list(model.parameters()) + list(model.buffers()):
        if t.is_floating_point():
            yield t


def _default_half_dtype(models: Sequence[nn.Module], cast_model_type: Any) -> torch.dtype:
    # An explicit half cast_model_type says what "half" means (and so the default loss scale).
    if cast_model_type in (torch.float16, torch.bfloat16):
        return cast_model_type
    on_cuda = any(t.is_cuda for m in models for t in _floating_tensors(m))
    return torch.float16 if on_cuda else torch.bfloat16
