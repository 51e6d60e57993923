"""The loss scaler: scale, counters and overflow flag as device tensors, the update rule run on
the device, its checkpoint state.

One :class:`AmpScaler` exists per ``loss_id``. Its whole state (the scale, the
count of clean iterations, the skip counts, the last overflow) lives in one
float64 tensor on the grads' device, and :meth:`AmpScaler.update_on_device`
applies the update rule there with tensor ops: nothing is read on the host, so
an iteration makes no host sync and can be captured. Per device, the fused
kernels read a one-element ``inv_scale`` tensor, the loss is multiplied by a
0-dim ``scale`` tensor, and the overflow flag ``found_inf`` is raised by the
unscale kernels and by the checks of the loss (:meth:`AmpScaler.check_loss`)
and of the grads' norm (:meth:`AmpScaler.check`).

The host keeps a *mirror* of that state, read lazily (:meth:`AmpScaler.sync`):
when the scale or the overflow is asked for (``loss_scale``, ``last_overflow``,
``state_dict``), and every ``host_read_interval`` updates, where the Apex
message of each overflow seen since the last read is logged and a collapse
raises. :meth:`AmpScaler.update` is the synchronous form, reading at once (the
``sync_free=False`` setting); docs/design.md, "Host syncs", says what each read
costs.

Every tensor of one fused op call must be on one device. Here,
:func:`~amp_patch.helpers.tensors.group_by_device_and_dtype` splits the lists of the unscale
passes; the copy of the masters into the model and :func:`amp_patch.clip_grad_norm_`
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
from amp_patch.helpers.tensors import (
    device_of,
    group_by_device_and_dtype,
    local_tensors,
)
from amp_patch.settings.properties import (
    DEFAULT_HOST_READ_INTERVAL,
    DEFAULT_MAX_CONSECUTIVE_SKIPS,
    DYNAMIC,
    Properties,
)

__all__ = ["AmpScaler", "LossScaleCollapseError", "unscale_grads"]

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
    """The scaler's tensors on one device: ``found_inf`` (0.0 or 1.0), ``inv_scale`` (one
    element, read by the fused kernels), ``scale`` (0-dim, multiplying the loss), ``one``
    (one element, 1.0: the factor of :meth:`flag_nonfinite`) and ``unread_flag`` (one
    element: what passes over grads whose overflow was already decided may raise, and
    nothing reads; see :meth:`AmpScaler.snapshot`), all fp32."""

    __slots__ = ("found_inf", "inv_scale", "scale", "one", "unread_flag")

    def __init__(self, device: torch.device, scale: float) -> None:
        self.found_inf = torch.zeros(1, dtype=torch.float32, device=device)
        self.inv_scale = torch.full((1,), 1.0 / scale, dtype=torch.float32, device=device)
        self.scale = torch.full((), scale, dtype=torch.float32, device=device)
        self.one = torch.ones(1, dtype=torch.float32, device=device)
        self.unread_flag = torch.zeros(1, dtype=torch.float32, device=device)

    def flag_nonfinite(self, tensors: list[Tensor]) -> None:
        """Raise ``found_inf`` if one of ``tensors`` holds an inf or NaN: one op, no sync.

        ``torch._amp_foreach_non_finite_check_and_unscale_`` by 1.0, which leaves
        every value as it was (an in-place write all the same: ``tensors`` must be
        the caller's own, such as a norm it just computed). The ``isfinite`` test
        it replaces took about eight small ops.
        """
        torch._amp_foreach_non_finite_check_and_unscale_(tensors, self.found_inf, self.one)


# The fields of the device state, one float64 each (exact for counts below 2**53).
_SCALE, _UNSKIPPED, _SKIPPED, _CONSECUTIVE, _OVERFLOW, _UNREAD, _COLLAPSED = range(7)
_FIELDS = 7


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
    in a row are an error. Iterations are counted per update, i.e. per exit of
    :func:`amp_patch.scale_loss` for this ``loss_id``.

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
        host_read_interval (int, optional): :meth:`update_on_device` reads the
            state on the host (one sync) every this many updates, to log the
            overflows since the last read and to raise a collapse. Updates
            inside a region compiled by ``torch.compile`` are not counted (a
            host read there would break the graph): there the state is read
            when asked. Default: 100.

    .. note::
        The scale, the counters and the overflow flag are tensors on the
        gradients' device, created the first time a device is seen.
        :meth:`update_on_device` reads nothing on the host (but every
        ``host_read_interval``-th call); :meth:`update` reads once;
        :attr:`loss_scale` of a dynamic scaler, :attr:`last_overflow`,
        :attr:`skipped_steps` and :meth:`state_dict` read when the host's copy
        is behind the device's (:meth:`sync`).

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
        host_read_interval: int = DEFAULT_HOST_READ_INTERVAL,
    ) -> None:
        self.dynamic = loss_scale == DYNAMIC
        self.loss_id = loss_id
        self.max_loss_scale = float(max_loss_scale)
        self.min_loss_scale = None if min_loss_scale is None else float(min_loss_scale)
        self.scale_window = scale_window
        self.max_consecutive_skips = max_consecutive_skips
        self.host_read_interval = host_read_interval
        # The host mirror: exact while no device update is unread (``not _unread``).
        self._scale = (min(INITIAL_DYNAMIC_SCALE, self.max_loss_scale) if self.dynamic
                       else float(loss_scale))
        self._unskipped = 0
        self._skipped = 0
        self._consecutive = 0
        self._last_overflow = False
        self._devices: dict[torch.device, _DeviceTensors] = {}
        # The device state (made at the first update, on the device where the flags meet),
        # and how many updates it holds that the mirror has not read.
        self._state: Tensor | None = None
        self._unread = False
        # Updates since the last read, counted in eager code only: a Python int that changed
        # at every update would make torch.compile recompile the region at every step.
        self._since_read = 0
        self._nonfinite_names: Callable[[], list[str]] | None = None

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
                   max_consecutive_skips=props.max_consecutive_skips,
                   host_read_interval=props.host_read_interval)

    @property
    def loss_scale(self) -> float:
        """The current scale.

        A static scale never changes on the device, so reading it is free; a
        dynamic one is read from the device when the host's copy is behind
        (one sync, see :meth:`sync`).
        """
        if self.dynamic:
            self.sync()
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
        self.sync()
        self._set_scale(scale)

    @property
    def last_overflow(self) -> bool:
        """Whether the last update found an overflow (and so asked for a skipped step).

        Reads the device state when the host's copy is behind (:meth:`sync`).
        """
        self.sync()
        return self._last_overflow

    @property
    def skipped_steps(self) -> int:
        """How many updates found an overflow since the scaler was made (or loaded).

        Reads the device state when the host's copy is behind (:meth:`sync`).
        """
        self.sync()
        return self._skipped

    def device_tensors(self, device: torch.device) -> _DeviceTensors:
        """The ``found_inf``, ``inv_scale`` and ``scale`` tensors on ``device``, made on first use.

        A device first seen while the host's copy is behind copies the scale
        from the device state, without a sync.
        """
        state = self._devices.get(device)
        if state is None:
            state = self._devices[device] = _DeviceTensors(device, self._scale)
            if self._unread:
                self._write_scale_tensors(self._home()[_SCALE], [state])
        return state

    def scale_loss(self, loss: Tensor) -> Tensor:
        """``loss.float()`` times the current scale, on the loss's device (no host sync); for a
        static scale of 1.0, ``loss.float()`` itself (the same bits, one op fewer).

        Args:
            loss (Tensor): the loss.

        Returns:
            Tensor: the scaled loss, fp32, of the loss's shape.

        Example::

            >>> AmpScaler(128.0).scale_loss(torch.tensor(0.5)).item()
            64.0
        """
        if not self.dynamic and self._scale == 1.0:
            return loss.float()  # times 1.0 changes no bit: one op fewer (bf16's static scale)
        return loss.float() * self.device_tensors(loss.device).scale

    def check_loss(self, loss: Tensor) -> None:
        """Flag an overflow if ``loss`` holds an inf or NaN (no host sync).

        This also makes sure the loss's device has a flag, so that every
        process takes part in the update's all-reduce even with no grads.
        """
        state = self.device_tensors(loss.device)
        state.flag_nonfinite([_loss_copy(loss)])

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
            accumulate (pair of lists): ``(x, y)``: ``y = float(x) * inv_scale + y``
                (new scaled grads into grads that already hold unscaled ones):
                one ``multi_tensor_axpby_`` with ``1 / scale`` from the host's
                copy when that is current (a static scale, or no update unread);
                else ``multi_tensor_unscale_copy_`` into fp32 temporaries and
                one ``_foreach_add_``, reading the device's ``inv_scale`` on the
                device, to the same bits.

        .. note::
            Nothing here syncs; the flags are read by the update.
        """
        unscale_grads(in_place, copy, self.device_tensors)
        host_current = not (self.dynamic and self._unread)
        for (device, _), (x, y) in group_by_device_and_dtype(*accumulate).items():
            state = self.device_tensors(device)
            if host_current:
                ops.multi_tensor_axpby_(x, y, state.found_inf, 1.0 / self._scale, 1.0)
                continue
            fresh = [torch.empty_like(t, dtype=torch.float32) for t in y]
            ops.multi_tensor_unscale_copy_(x, fresh, state.found_inf, state.inv_scale)
            _add_into(y, fresh)

    def check(self, grads: Sequence[Tensor],
              losses: list[Tensor] | None = None) -> dict[torch.device, Tensor]:
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
            losses (list of Tensor, optional): losses still to check
                (:meth:`check_loss`); those on a device of ``grads`` are
                checked in the same op as the norm there, and taken out of the
                list.

        Sharded grads (FSDP2's DTensors) are read as this rank's shards: the
        flag is agreed over the ranks when the update reads it, but the
        norms are then this rank's part only.

        Returns:
            dict: device to the L2 norm (0-dim fp32) of that device's grads, as
            stored (times the loss scale); LAMB reuses it for its clipping.

        Example::

            >>> from amp_patch.settings.properties import Properties
            >>> scaler = AmpScaler.from_properties(Properties.from_opt_level("O2", torch.float16))
            >>> loss_fn(model(x), y).backward()
            >>> norms = scaler.check([p.grad for p in model.parameters()])
            >>> scaler.update()   # reads the flag on the host: True on overflow
            False
        """
        local = local_tensors(list(grads))
        devices = set(map(device_of, local))  # read in C: one device is the usual case
        if len(devices) == 1:
            by_device = {devices.pop(): local}
        else:
            by_device = {}
            for g in local:
                by_device.setdefault(g.device, []).append(g)
        norms = {}
        for device, device_grads in by_device.items():
            norm = ops.multi_tensor_l2norm(device_grads)[0]
            checked = [norm]
            if losses and any(t.device == device for t in losses):
                checked += [_loss_copy(t) for t in losses if t.device == device]
                losses[:] = [t for t in losses if t.device != device]
            self.device_tensors(device).flag_nonfinite(checked)
            norms[device] = norm
        return norms

    def snapshot(self, device: torch.device) -> _DeviceTensors:
        """This scale's inverse on ``device`` as a tensor of its own, with a flag nothing reads.

        For grads read after the update (a deferred unscale, or the one-pass
        step), whose overflow the update has already decided: the update (or a
        scale set before the step) may change the scale's own tensors, and a
        later pass must not raise the next iteration's overflow flag. One copy
        is made, on the device (no sync): ``inv_scale``. The passes raise the
        device's ``unread_flag`` and do not read ``scale``, which is shared.

        Args:
            device (torch.device): where the tensors live.

        Returns:
            _DeviceTensors: ``inv_scale`` (a copy of the current one), ``found_inf`` (the
            device's ``unread_flag``), ``scale`` and ``one`` (the device's own).

        Example::

            >>> kept = scaler.snapshot(grad.device)
            >>> scaler.update()             # may double the scale
            >>> unscale_grads([grad], ([], []), {grad.device: kept}.__getitem__)
        """
        now = self.device_tensors(device)
        kept = _DeviceTensors.__new__(_DeviceTensors)
        kept.found_inf = kept.unread_flag = now.unread_flag
        kept.inv_scale = now.inv_scale.clone()
        kept.scale, kept.one = now.scale, now.one
        return kept

    # --------------------------------------------------------------- updating

    def update_on_device(self, nonfinite_names: Callable[[], list[str]] | None = None
                         ) -> Tensor | None:
        """Apply the update rule on the device, reading nothing on the host.

        The overflow flags of every device meet on one (an accelerator if there
        is one), are all-reduced (MAX) under torch.distributed, and decide the
        next scale, the counters and the skip, with tensor ops. The flags are
        then cleared. Every ``host_read_interval``-th call made outside
        ``torch.compile`` reads the state (:meth:`sync`): the Apex message of each
        overflow since the last read is logged then, and a collapse raises then,
        at most that many updates late.

        Args:
            nonfinite_names (callable, optional): returns the names of the
                parameters whose gradients are non-finite; called only to word
                the collapse error.

        Returns:
            Tensor or None: the overflow flag of this update (one-element fp32,
            1.0 on overflow: the step must be skipped), a tensor of its own on the
            device where the flags met; None when no device was ever flagged
            (nothing was checked), which is no overflow.

        Raises:
            LossScaleCollapseError: at a host read, when an update since the last
                read would have taken a dynamic scale below its floor, or a
                static one past ``max_consecutive_skips`` overflows in a row.
        """
        if not self._devices:
            self._clean_update_on_host()
            return None
        flags = [state.found_inf for state in self._devices.values()]
        if len(flags) == 1 and not _in_process_group():  # the usual case: nothing to meet
            ((device, home),) = self._devices.items()
            flag = flags[0]
        else:
            # Prefer an accelerator flag as the meeting point: a device-to-host copy
            # of the others would be a sync each.
            flags.sort(key=lambda f: f.device.type == "cpu")
            flag = flags[0] if len(flags) == 1 else torch.stack(
                [f.to(flags[0].device, non_blocking=True) for f in flags]).amax(0)
            flag = _all_reduce_max(flag)
            device = flag.device
            # The flags may meet on a device with no tensors of its own (nccl's).
            home = self._devices.get(device) or _DeviceTensors(device, 1.0)
        state = self._home(device)
        overflow = torch.empty(1, dtype=torch.float32, device=device)
        self._step_state(state, home, flag, overflow)
        others = [d for d in self._devices.values() if d is not home]
        if others:
            self._write_scale_tensors(state[_SCALE], others)
        for f in flags:
            if f is not flag:
                f.zero_()
        self._unread = True
        self._nonfinite_names = nonfinite_names
        if not torch.compiler.is_compiling():
            self._since_read += 1
            if self._since_read >= self.host_read_interval:
                self.sync()
        return overflow

    def update(self, nonfinite_names: Callable[[], list[str]] | None = None) -> bool:
        """Update (:meth:`update_on_device`) and read the result on the host at once (one sync).

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
        self.update_on_device(nonfinite_names)
        self.sync()
        return self._last_overflow

    def sync(self) -> None:
        """Bring the host's copy of the state up to date (one sync when it is behind).

        Logs the Apex message for the overflows of the updates not read yet,
        and raises a collapse that one of them found. Free when nothing is
        unread.

        Raises:
            LossScaleCollapseError: as :meth:`update`.

        Example::

            >>> scaler = AmpScaler("dynamic")
            >>> scaler.sync()   # nothing unread: no device read
        """
        if not self._unread or self._state is None:
            return
        state = self._state
        values = state.tolist()  # the host read
        self._unread, self._since_read = False, 0
        state[_UNREAD].zero_()
        self._scale = values[_SCALE]
        self._unskipped, self._skipped, self._consecutive = (
            int(values[_UNSKIPPED]), int(values[_SKIPPED]), int(values[_CONSECUTIVE]))
        self._last_overflow = values[_OVERFLOW] != 0.0
        if values[_COLLAPSED]:
            state[_COLLAPSED].zero_()
            raise self._collapse_error()
        unread = int(values[_UNREAD])
        if unread:
            self._log_overflows(unread)

    def _step_state(self, state: Tensor, home: _DeviceTensors, flag: Tensor,
                    overflow: Tensor) -> None:
        """One fused update of the device state (:func:`amp_patch.ops.loss_scale_update_`):
        ``home``'s ``inv_scale`` and ``scale`` written, ``flag`` read and cleared, the
        overflow written into ``overflow``. The host's :meth:`_clean_update_on_host` is its
        no-overflow case."""
        floor = DEFAULT_MIN_LOSS_SCALE if self.min_loss_scale is None else self.min_loss_scale
        ops.loss_scale_update_(state, home.inv_scale, home.scale, flag, overflow,
                               scale_window=float(self.scale_window), floor=floor,
                               floor_is_min=self.min_loss_scale is not None,
                               max_scale=self.max_loss_scale, dynamic=self.dynamic,
                               max_consecutive=float(self.max_consecutive_skips))

    def _clean_update_on_host(self) -> None:
        """An update with no flag anywhere (nothing was checked): a clean iteration, counted on
        the host (the device state, if any, is read first so that the two stay one)."""
        self.sync()
        self._last_overflow = False
        self._unskipped += 1
        self._consecutive = 0
        if self.dynamic and self._unskipped >= self.scale_window:
            self._unskipped = 0
            self._set_scale(min(self.max_loss_scale, self._scale * 2.0))
        elif self._state is not None:
            self._write_state()

    def _log_overflows(self, unread: int) -> None:
        late = (f" ({unread} overflows since the last read of the scale)" if unread > 1 else "")
        if self.dynamic:
            # Apex's words, two spaces included: scripts and log scrapers look for them.
            logger.info("Gradient overflow.  Skipping step, loss scaler %d reducing loss scale "
                        "to %s%s", self.loss_id, self._scale, late)
        else:
            logger.info("Gradient overflow.  Skipping step, loss scaler %d keeps its static loss "
                        "scale %s (%d consecutive skips; more than %d raise an error)%s",
                        self.loss_id, self._scale, self._consecutive, self.max_consecutive_skips,
                        late)

    def _collapse_error(self) -> LossScaleCollapseError:
        if self.dynamic:
            floor = DEFAULT_MIN_LOSS_SCALE if self.min_loss_scale is None else self.min_loss_scale
            what = (f"even at loss scale {self._scale}; it would fall below the floor {floor}")
        else:
            what = (f"at {self._consecutive} consecutive steps with the static loss scale "
                    f"{self._scale}, which cannot shrink (max_consecutive_skips="
                    f"{self.max_consecutive_skips})")
        names = self._nonfinite_names() if self._nonfinite_names is not None else []
        return LossScaleCollapseError(
            f"loss scaler {self.loss_id}: gradients are non-finite {what}. Non-finite gradients "
            f"in: {', '.join(names) if names else 'the loss itself (no gradient was non-finite)'}"
        )

    def _home(self, device: torch.device | None = None) -> Tensor:
        """The device state, made from the host mirror on ``device`` the first time."""
        if self._state is None:
            if device is None:
                raise RuntimeError("the scaler has no device state yet")
            self._state = torch.empty(_FIELDS, dtype=torch.float64, device=device)
            self._write_state()
        return self._state

    def _write_state(self) -> None:
        """Copy the host mirror into the device state (a host-to-device write: no sync)."""
        assert self._state is not None
        values = [0.0] * _FIELDS
        values[_SCALE], values[_UNSKIPPED] = self._scale, float(self._unskipped)
        values[_SKIPPED], values[_CONSECUTIVE] = float(self._skipped), float(self._consecutive)
        values[_OVERFLOW] = float(self._last_overflow)
        self._state.copy_(torch.tensor(values, dtype=torch.float64), non_blocking=True)

    @staticmethod
    def _write_scale_tensors(scale: Tensor, devices: Iterable[_DeviceTensors]) -> None:
        """Each device's ``scale`` and ``inv_scale`` from the device state's float64 scale.

        ``1 / scale`` is divided in float64 and rounded to fp32 once, as the host's
        ``torch.full(1.0 / scale)`` rounds it, so both give the same bits.
        """
        inv = (1.0 / scale).to(torch.float32)
        as32 = scale.to(torch.float32)
        for state in devices:
            state.inv_scale.copy_(inv, non_blocking=True)
            state.scale.copy_(as32, non_blocking=True)

    def _set_scale(self, scale: float) -> None:
        self._scale = scale
        for state in self._devices.values():
            state.inv_scale.fill_(1.0 / scale)  # a host-to-device write: no sync
            state.scale.fill_(scale)
        if self._state is not None:
            self._write_state()

    # ------------------------------------------------------------- checkpoint

    def state_dict(self) -> dict:
        """The checkpoint state (reads the device state first when the host's copy is behind).

        Returns:
            dict: ``{"loss_scale": float, "unskipped": int, "skipped": int, "dynamic": bool,
            "consecutive_skips": int}``.
        """
        self.sync()
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
        self._unread, self._since_read = False, 0  # updates not read yet are replaced, not read
        self._set_scale(scale)
        for dev in self._devices.values():
            dev.found_inf.zero_()

    def __repr__(self) -> str:
        kind = "dynamic" if self.dynamic else "static"
        late = ", updates unread" if self._unread else ""
        return (f"AmpScaler(id={self.loss_id}, {kind}, scale={self._scale}, "
                f"unskipped={self._unskipped}{late})")


def _add_into(y: list[Tensor], x: list[Tensor]) -> None:
    """``y[i] += x[i]``, for ``y`` of one dtype (fp32 master or stashed grads) and fp32 ``x``."""
    if y[0].dtype == torch.float32:
        torch._foreach_add_(y, x)
    else:
        for dst, src in zip(y, x):
            dst.copy_(dst.float() + src)


def _count(value: Any) -> int:
    if isinstance(value, bool) or int(value) != value or value < 0:
        raise ValueError(f"not a count: {value!r}")
    return int(value)


def _loss_copy(loss: Tensor) -> Tensor:
    """An fp32 copy of ``loss`` that :meth:`_DeviceTensors.flag_nonfinite` may write."""
    return loss.detach().to(torch.float32, copy=True)


def _in_process_group() -> bool:
    """Whether this process is one of a torch.distributed group (whose ranks must agree)."""
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def _all_reduce_max(flag: Tensor) -> Tensor:
    """Make every process agree on the overflow decision (a no-op outside torch.distributed)."""
    import torch.distributed as dist

    if not _in_process_group():
        return flag
    backend = dist.get_backend()
    if backend == "nccl" and flag.device.type != "cuda":
        flag = flag.to(torch.device("cuda", torch.cuda.current_device()))
    else:
        flag = flag.clone()
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return flag
