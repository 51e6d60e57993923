"""The loss scaler: scale and overflow flag as device tensors, the update rule, its checkpoint
state.

One :class:`AmpScaler` exists per ``loss_id``. Its scale lives twice: as a
host float (the *mirror*, used to scale the loss and as the float argument of
``multi_tensor_axpby_``) and, per device, as a one-element ``inv_scale``
tensor that the fused kernels read. The overflow flag ``found_inf`` is a
one-element tensor per device, set by the unscale kernels and by the checks of
the loss (:meth:`AmpScaler.check_loss`) and of the grads' norm
(:meth:`AmpScaler.check`). :meth:`AmpScaler.update` reads the flags with the
one host sync of an iteration and then changes the mirror and the device
tensors together, so the two never disagree.

Every tensor of one fused op call must be on one device. Here,
:func:`~amp_patch.tensors.group_by_device_and_dtype` splits the lists of the unscale passes; the
copy of the masters into the model and :func:`amp_patch.clip_grad_norm_`
(``FP16_Optimizer.clip_master_grads`` among its callers) use it too. The other fused calls split
their lists themselves: :meth:`AmpScaler.check` and the fused optimizers'
grad norms by device, the fused optimizers' steps in their ``_batches`` (by
device, and whether a half model copy is written), and the ``amp_C``
functions by device (``_by_device``).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any, Callable, Iterable, Sequence

import torch
from torch import Tensor

from amp_patch import ops
from amp_patch.properties import DEFAULT_MAX_CONSECUTIVE_SKIPS, DYNAMIC, Properties
from amp_patch.tensors import (
    group_by_device_and_dtype,  # re-exported: it was public here
    local_tensors,
)

__all__ = ["AmpScaler", "LossScaleCollapseError", "group_by_device_and_dtype", "unscale_grads"]

logger = logging.getLogger("amp_patch")

#: Dynamic scale start (Apex's 2**16, capped by ``max_loss_scale``).
INITIAL_DYNAMIC_SCALE = 2.0**16
#: Clean iterations after which a dynamic scale doubles.
SCALE_WINDOW = 2000
#: Floor below which the scale must never go (it would reach denormals, then 0).
DEFAULT_MIN_LOSS_SCALE = 2.0**-24


def unscale_grads(in_place: Iterable[Tensor], copy: tuple[Sequence[Tensor], Sequence[Tensor]],
                  tensors: Callable[[torch.device], "_DeviceTensors"]) -> None:
    """The in-place and the copying unscale passes: one fused call per (kind, device, dtype).

    Args:
        in_place (iterable of Tensor): grads divided by the scale in place
            (``multi_tensor_unscale_``).
        copy (pair of lists): ``(src, dst)``: ``dst = float(src) * inv_scale``
            (``multi_tensor_unscale_copy_``).
        tensors (callable): ``tensors(device)`` gives the ``found_inf`` flag
            that the passes raise and the ``inv_scale`` they multiply by.

    Example::

        >>> unscale_grads([fp32_grad], ([half_grad], [master_grad]), scaler.device_tensors)
    """
    for (device, _), (grads,) in group_by_device_and_dtype(list(in_place)).items():
        state = tensors(device)
        ops.multi_tensor_unscale_(grads, state.found_inf, state.inv_scale)
    for (device, _), (src, dst) in group_by_device_and_dtype(*copy).items():
        state = tensors(device)
        ops.multi_tensor_unscale_copy_(src, dst, state.found_inf, state.inv_scale)


class LossScaleCollapseError(RuntimeError):
    """The gradients are non-finite at any scale: a dynamic scale would fall below its floor,
    or a static scale, which cannot shrink, saw too many overflows in a row."""


class _DeviceTensors:
    """The scaler's tensors on one device: ``found_inf`` (0.0 or 1.0) and ``inv_scale``."""

    __slots__ = ("found_inf", "inv_scale")

    def __init__(self, device: torch.device, scale: float) -> None:
        self.found_inf = torch.zeros(1, dtype=torch.float32, device=device)
        self.inv_scale = torch.full((1,), 1.0 / scale, dtype=torch.float32, device=device)


class AmpScaler:
    """Static or dynamic loss scaling for one ``loss_id``.

    amp's own scaler; Apex's FP16_Optimizer-era ``LossScaler`` and
    ``DynamicLossScaler`` are other classes, served by
    :mod:`amp_patch.apex_compat.fp16_optimizer` on top of this one.

    A dynamic scale starts at ``min(2**16, max_loss_scale)``. An overflow
    halves it (never below ``min_loss_scale``) and restarts the count of clean
    iterations; after ``scale_window`` (2000) clean iterations it doubles, up
    to ``max_loss_scale``. A static scale never changes, but an overflow still
    makes the step be skipped; more than ``max_consecutive_skips`` overflows
    in a row are an error. Iterations are counted per :meth:`update`, i.e.
    per exit of :func:`amp_patch.scale_loss` for this ``loss_id``.

    Args:
        loss_scale (float or str): a static scale, or ``"dynamic"``.
        loss_id (int, optional): which loss this scaler serves (for messages). Default: 0.
        min_loss_scale (float, optional): floor of the dynamic scale. When it
            is set the scale halves down to it; one more overflow there is a
            collapse. Default: None, meaning a collapse below ``2**-24``.
        max_loss_scale (float, optional): ceiling of the dynamic scale. Default: ``2**24``.
        scale_window (int, optional): clean iterations before doubling. Default: 2000.
        max_consecutive_skips (int, optional): with a static scale, the
            overflows in a row allowed; the next one raises. Default: 50.

    .. note::
        The scale and overflow flag are tensors on the gradients' device,
        created the first time a device is seen. :meth:`update` is the only
        method that syncs with the host, once.

    Example::

        >>> scaler = AmpScaler("dynamic")
        >>> scaler.loss_scale
        65536.0
    """

    def __init__(
        self,
        loss_scale: float | str,
        loss_id: int = 0,
        min_loss_scale: float | None = None,
        max_loss_scale: float = 2.0**24,
        scale_window: int = SCALE_WINDOW,
        max_consecutive_skips: int = DEFAULT_MAX_CONSECUTIVE_SKIPS,
    ) -> None:
        self.dynamic = loss_scale == DYNAMIC
        self.loss_id = loss_id
        self.max_loss_scale = float(max_loss_scale)
        self.min_loss_scale = None if min_loss_scale is None else float(min_loss_scale)
        self.scale_window = scale_window
        self._scale = (min(INITIAL_DYNAMIC_SCALE, self.max_loss_scale) if self.dynamic
                       else float(loss_scale))
        self.max_consecutive_skips = max_consecutive_skips
        self._unskipped = 0
        self._skipped = 0
        self._consecutive = 0
        self._last_overflow = False
        self._devices: dict[torch.device, _DeviceTensors] = {}

    @classmethod
    def from_properties(cls, props: Properties, loss_id: int = 0) -> "AmpScaler":
        """The scaler for ``loss_id`` of a session's properties.

        Args:
            props (Properties): the session's settings.
            loss_id (int, optional): the loss it serves. Default: 0.

        Returns:
            AmpScaler: a new scaler.
        """
        return cls(props.loss_scale, loss_id=loss_id, min_loss_scale=props.min_loss_scale,
                   max_loss_scale=props.max_loss_scale,
                   max_consecutive_skips=props.max_consecutive_skips)

    @property
    def loss_scale(self) -> float:
        """The current scale (the host mirror; reading it does not sync)."""
        return self._scale

    @loss_scale.setter
    def loss_scale(self, value: float) -> None:
        """Set the scale that the next iteration uses (host mirror and device tensors together).

        Raises:
            ValueError: if ``value`` is not a positive finite number.
        """
        scale = float(value)
        if not (0.0 < scale < float("inf")):
            raise ValueError(f"loss scaler {self.loss_id}: the loss scale must be a positive "
                             f"finite number, got {value!r}")
        self._set_scale(scale)

    @property
    def last_overflow(self) -> bool:
        """Whether the last :meth:`update` found an overflow (and so asked for a skipped step)."""
        return self._last_overflow

    @property
    def skipped_steps(self) -> int:
        """How many updates found an overflow since the scaler was made (or loaded)."""
        return self._skipped

    def device_tensors(self, device: torch.device) -> _DeviceTensors:
        """The ``found_inf`` and ``inv_scale`` tensors on ``device``, made on first use."""
        state = self._devices.get(device)
        if state is None:
            state = self._devices[device] = _DeviceTensors(device, self._scale)
        return state

    def check_loss(self, loss: Tensor) -> None:
        """Flag an overflow if ``loss`` holds an inf or NaN (no host sync).

        This also makes sure the loss's device has a flag, so that every
        process takes part in :meth:`update`'s all-reduce even with no grads.
        """
        state = self.device_tensors(loss.device)
        state.found_inf.masked_fill_(~torch.isfinite(loss.detach()).all(), 1.0)

    def unscale(
        self,
        in_place: Iterable[Tensor] = (),
        copy: tuple[Sequence[Tensor], Sequence[Tensor]] = ((), ()),
        accumulate: tuple[Sequence[Tensor], Sequence[Tensor]] = ((), ()),
    ) -> None:
        """Unscale gradients with one fused call per (kind, device, dtype), flagging inf/NaN.

        Args:
            in_place (iterable of Tensor): grads divided by the scale in place
                (``multi_tensor_unscale_``).
            copy (pair of lists): ``(src, dst)``: ``dst = float(src) * inv_scale``
                (``multi_tensor_unscale_copy_``, half model grads into the
                fp32 master grads' storage).
            accumulate (pair of lists): ``(x, y)``: ``y = x * (1 / scale) + y``,
                ``1 / scale`` computed on the host from the mirror
                (``multi_tensor_axpby_``, new scaled grads into grads that
                already hold unscaled ones).

        .. note::
            Nothing here syncs; the flags are read by :meth:`update`.
        """
        unscale_grads(in_place, copy, self.device_tensors)
        for (device, _), (x, y) in group_by_device_and_dtype(*accumulate).items():
            state = self.device_tensors(device)
            ops.multi_tensor_axpby_(x, y, state.found_inf, 1.0 / self._scale, 1.0)

    def check(self, grads: Sequence[Tensor]) -> dict[torch.device, Tensor]:
        """Flag an overflow if any of ``grads`` holds an inf or NaN, only reading them (no sync).

        One :func:`amp_patch.ops.multi_tensor_l2norm` per device: the norm of
        the grads as stored is non-finite when one of them is, so the flag
        rises as the unscale passes would raise it, without writing anything.
        (It also rises for finite grads whose norm overflows fp32, which no
        optimizer could step with anyway.) The one-pass O2 step reads the
        grads, still scaled, in the optimizer's own pass.

        Args:
            grads (sequence of Tensor): the grads, in the order the norms
                should sum them (an optimizer's ``param_groups`` order).

        Sharded grads (FSDP2's DTensors) are read as this rank's shards: the
        flag is agreed over the ranks when :meth:`update` reads it, but the
        norms are then this rank's part only.

        Returns:
            dict: device to the L2 norm (0-dim fp32) of that device's grads, as
            stored (times the loss scale); LAMB reuses it for its clipping.

        Example::

            >>> from amp_patch.properties import Properties
            >>> scaler = AmpScaler.from_properties(Properties.from_opt_level("O2", torch.float16))
            >>> loss_fn(model(x), y).backward()
            >>> norms = scaler.check([p.grad for p in model.parameters()])
            >>> scaler.update()   # the one host sync: True on overflow
            False
        """
        by_device: dict[torch.device, list[Tensor]] = {}
        for g in local_tensors(list(grads)):
            by_device.setdefault(g.device, []).append(g)
        norms = {}
        for device, device_grads in by_device.items():
            norm = ops.multi_tensor_l2norm(device_grads)[0]
            self.device_tensors(device).found_inf.masked_fill_(~torch.isfinite(norm), 1.0)
            norms[device] = norm
        return norms

    def snapshot(self, device: torch.device) -> _DeviceTensors:
        """This scale's ``inv_scale`` on ``device``, as a tensor of its own, with a flag of its own.

        For grads read after :meth:`update` (a deferred unscale, or the
        one-pass step): update may already have changed the scale, and a later
        pass must not raise the next iteration's overflow flag.

        Args:
            device (torch.device): where the tensors live.

        Returns:
            _DeviceTensors: ``found_inf`` (zero) and ``inv_scale`` (``1 / loss_scale`` now).

        Example::

            >>> kept = scaler.snapshot(grad.device)
            >>> scaler.update()             # may double the scale
            >>> unscale_grads([grad], ([], []), {grad.device: kept}.__getitem__)
        """
        return _DeviceTensors(device, self._scale)

    def _read_overflow(self) -> bool:
        flags = [state.found_inf for state in self._devices.values()]
        if not flags:
            return False
        # Prefer an accelerator flag as the meeting point: a device-to-host copy
        # of the others would be a sync each.
        flags.sort(key=lambda f: f.device.type == "cpu")
        flag = flags[0] if len(flags) == 1 else torch.stack(
            [f.to(flags[0].device, non_blocking=True) for f in flags]).amax(0)
        flag = _all_reduce_max(flag)
        overflow = flag.item() != 0.0  # the one host sync of an iteration
        for f in flags:
            f.zero_()
        return overflow

    def update(self, nonfinite_names: Callable[[], list[str]] | None = None) -> bool:
        """Read the overflow flags (one host sync), then adjust the scale and count.

        On overflow the dynamic scale halves and the count of clean iterations
        restarts, and the Apex message is logged at INFO (a static scale logs
        that it stays). After ``scale_window`` clean iterations the dynamic
        scale doubles.

        Args:
            nonfinite_names (callable, optional): returns the names of the
                parameters whose gradients are non-finite; called only to word
                the collapse error.

        Returns:
            bool: True when an overflow was seen (the step must be skipped).

        Raises:
            LossScaleCollapseError: a dynamic scale would fall below its floor,
                or a static one overflowed more than ``max_consecutive_skips``
                times in a row.
        """
        overflow = self._last_overflow = self._read_overflow()
        if not overflow:
            self._unskipped += 1
            self._consecutive = 0
            if self.dynamic and self._unskipped >= self.scale_window:
                self._set_scale(min(self.max_loss_scale, self._scale * 2.0))
                self._unskipped = 0
            return False
        self._skipped += 1
        self._unskipped = 0
        self._consecutive += 1
        if self.dynamic:
            floor = DEFAULT_MIN_LOSS_SCALE if self.min_loss_scale is None else self.min_loss_scale
            halved = self._scale / 2.0
            if halved < floor and (self.min_loss_scale is None or self._scale <= floor):
                raise self._collapse(nonfinite_names, f"even at loss scale {self._scale}; it would "
                                                      f"fall below the floor {floor}")
            self._set_scale(max(halved, floor))
            # Apex's words, two spaces included: scripts and log scrapers look for them.
            logger.info("Gradient overflow.  Skipping step, loss scaler %d reducing loss scale "
                        "to %s", self.loss_id, self._scale)
            return True
        if self._consecutive > self.max_consecutive_skips:
            raise self._collapse(
                nonfinite_names,
                f"at {self._consecutive} consecutive steps with the static loss scale "
                f"{self._scale}, which cannot shrink (max_consecutive_skips="
                f"{self.max_consecutive_skips})")
        logger.info("Gradient overflow.  Skipping step, loss scaler %d keeps its static loss scale "
                    "%s (%d consecutive skips; more than %d raise an error)", self.loss_id,
                    self._scale, self._consecutive, self.max_consecutive_skips)
        return True

    def _collapse(self, nonfinite_names: Callable[[], list[str]] | None,
                  what: str) -> LossScaleCollapseError:
        names = nonfinite_names() if nonfinite_names is not None else []
        return LossScaleCollapseError(
            f"loss scaler {self.loss_id}: gradients are non-finite {what}. Non-finite gradients "
            f"in: {', '.join(names) if names else 'the loss itself (no gradient was non-finite)'}"
        )

    def _set_scale(self, scale: float) -> None:
        self._scale = scale
        for state in self._devices.values():
            state.inv_scale.fill_(1.0 / scale)  # a host-to-device write: no sync

    def state_dict(self) -> dict:
        """The checkpoint state.

        Returns:
            dict: ``{"loss_scale": float, "unskipped": int, "skipped": int, "dynamic": bool,
            "consecutive_skips": int}``.
        """
        return {"loss_scale": self._scale, "unskipped": self._unskipped,
                "skipped": self._skipped, "dynamic": self.dynamic,
                "consecutive_skips": self._consecutive}

    def check_state_dict(self, state: Any) -> tuple[float, int, int, int]:
        """Validate a saved state without loading it.

        Args:
            state (dict): as :meth:`state_dict` returned it.

        Returns:
            tuple: ``(loss_scale, unskipped, skipped, consecutive_skips)``.

        Raises:
            TypeError: ``state`` is not a dict.
            ValueError: a required key is missing, or a value is not a number
                of the right kind (the scale must be positive and finite).
        """
        where = f"loss scaler {self.loss_id} (loss_scaler{self.loss_id})"
        form = ("a dict such as {'loss_scale': 65536.0, 'unskipped': 0}, as "
                "amp_patch.state_dict() saves it")
        if not isinstance(state, Mapping):
            raise TypeError(f"{where}: the saved state must be {form}; got {type(state).__name__}")
        missing = [k for k in ("loss_scale", "unskipped") if k not in state]
        if missing:
            raise ValueError(f"{where}: the saved state lacks {', '.join(map(repr, missing))}; "
                             f"it must be {form}")
        try:
            scale = float(state["loss_scale"])
            counts = tuple(_count(state.get(k, 0)) for k in ("unskipped", "skipped",
                                                             "consecutive_skips"))
        except (TypeError, ValueError):
            raise ValueError(
                f"{where}: 'loss_scale' must be a number and 'unskipped', 'skipped' and "
                f"'consecutive_skips' non-negative ints; got {dict(state)!r}") from None
        if not (0.0 < scale < float("inf")):
            raise ValueError(f"{where}: invalid saved loss_scale {scale!r}; it must be a positive "
                             "finite number")
        unskipped, skipped, consecutive = counts
        return scale, unskipped, skipped, consecutive

    def load_state_dict(self, state: dict) -> None:
        """Restore the state saved by :meth:`state_dict`; pending overflow flags are cleared.

        Args:
            state (dict): needs ``"loss_scale"`` and ``"unskipped"``; other keys are optional.

        Raises:
            TypeError, ValueError: as :meth:`check_state_dict`; nothing is changed then.
        """
        scale, self._unskipped, self._skipped, self._consecutive = self.check_state_dict(state)
        self._last_overflow = False
        self._set_scale(scale)
        for dev in self._devices.values():
            dev.found_inf.zero_()

    def __repr__(self) -> str:
        kind = "dynamic" if self.dynamic else "static"
        return (f"AmpScaler(id={self.loss_id}, {kind}, scale={self._scale}, "
                f"unskipped={self._unskipped})")


def _count(value: Any) -> int:
    if isinstance(value, bool) or int(value) != value or value < 0:
        raise ValueError(f"not a count: {value!r}")
    return int(value)


def _all_reduce_max(flag: Tensor) -> Tensor:
    """Make every process agree on the overflow decision (a no-op outside torch.distributed)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return flag
    backend = dist.get_backend()
    if backend == "nccl" and flag.device.type != "cuda":
        flag = flag.to(torch.device("cuda", torch.cuda.current_device()))
    else:
        flag = flag.clone()
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return flag
