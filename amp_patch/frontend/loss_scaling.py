"""``scale_loss``: the context manager around ``backward()`` that scales, unscales and checks."""

from __future__ import annotations

import contextlib
import functools
from typing import TYPE_CHECKING, Any, Iterator, Sequence

import torch
from torch import Tensor

from amp_patch import session as _session
from amp_patch.casting.model import named_parameters
from amp_patch.optim.amp import OPTIMIZER_TYPES
from amp_patch.scaler import LossScaleCollapseError

if TYPE_CHECKING:
    from amp_patch.optim.amp import OptimizerRecord

__all__ = ["scale_loss", "master_params"]


@contextlib.contextmanager
def scale_loss(
    loss: Tensor,
    optimizers: torch.optim.Optimizer | Sequence[torch.optim.Optimizer],
    loss_id: int = 0,
    model: torch.nn.Module | None = None,
    delay_unscale: bool = False,
    delay_overflow_check: bool = False,
) -> Iterator[Tensor]:
    """Scale a loss for ``backward()``, then unscale and check the gradients on exit.

    Yields ``loss.float() * scale``, where ``scale`` is the current scale of
    loss scaler ``loss_id``. On a normal exit, the gradients of every param
    the given optimizers hold are unscaled by fused multi-tensor ops, one
    call per (kind, device, dtype): in place for params stepped directly, and
    from half model grads into fp32 master grads under O2 (or accumulated
    into grads already there: ``y = x / scale + y``). Every pass, and the
    loss itself, feed one overflow flag. Under O2 with an amp_patch fused
    optimizer (one that takes step inputs) the grads are instead only read,
    by one L2 norm per device that feeds the flag, and ``step()`` reads them
    still scaled (the one-pass step, see docs/optimizers.md). The scaler then
    updates on the device; on overflow the next ``step()`` of each of these
    optimizers is skipped and the scale halves (dynamic scaling). Nothing is
    read on the host (``sync_free``, the default): the skip is decided on the
    device where the optimizer can take the flag, and read by ``step()``
    otherwise (docs/design.md, "Host syncs"). The O1 weight-cast cache is
    cleared on entry (the backward then frees each cast once its last user is
    done) and again on exit.

    With a static scale of 1.0 and no master weights (O0, O3, and O1 with
    bf16 by default) this is a fast path: it yields ``loss.float()`` and
    neither unscales nor checks.

    Args:
        loss (Tensor): the loss; NaN or inf in it counts as an overflow.
        optimizers (torch.optim.Optimizer or list): optimizers, all passed to
            :func:`amp_patch.initialize`, whose params this backward reaches.
        loss_id (int, optional): which loss scaler to use, below ``num_losses``. Default: 0.
        model (torch.nn.Module, optional): accepted for Apex compatibility; unused.
        delay_unscale (bool, optional): leave the grads scaled and do nothing
            else on exit (gradient accumulation; the last call of the window
            unscales everything accumulated). Default: False.
        delay_overflow_check (bool, optional): unscale, but neither update
            the scale nor skip; the overflow flag stays raised until the
            next exit that checks. Default: False.

    Yields:
        Tensor: the scaled loss, fp32.

    Raises:
        TypeError: ``loss`` is not a tensor, or ``optimizers`` not optimizers.
        RuntimeError: :func:`amp_patch.initialize` was not called, ``loss_id``
            is out of range, an optimizer was not passed to initialize, or this
            block is nested in another ``scale_loss`` block.
        amp_patch.scaler.LossScaleCollapseError: the dynamic scale would fall
            below its floor; names the params with non-finite grads.

    .. note::
        Call ``optimizer.step()`` after the block, and clip gradients (on
        :func:`amp_patch.master_params`) between the block and the step.

    Example::

        >>> model, optimizer = amp.initialize(model, optimizer, opt_level="O2")
        >>> loss = loss_fn(model(x), y)
        >>> with amp.scale_loss(loss, optimizer) as scaled_loss:
        ...     scaled_loss.backward()
        >>> optimizer.step()
    """
    session = _session.require("amp_patch.scale_loss()")
    props = session.props
    if not props.enabled:
        yield loss
        return
    if not isinstance(loss, Tensor):
        raise TypeError(
            "scale_loss: the loss must be a torch.Tensor (the one to call backward() on, "
            f"as in `with amp.scale_loss(loss, optimizer) as scaled: scaled.backward()`); "
            f"got {type(loss).__name__}"
        )
    opt_list = _as_optimizer_list(optimizers)
    if (not isinstance(loss_id, int) or isinstance(loss_id, bool)
            or not 0 <= loss_id < props.num_losses):
        raise RuntimeError(
            f"loss_id={loss_id!r} is out of range: initialize() was called with "
            f"num_losses={props.num_losses}, so loss_id must be in 0..{props.num_losses - 1}"
        )
    records = [session.record_for(opt) for opt in opt_list]
    if session.scale_loss_open:
        # The inner block's begin_backward would stash the outer's still scaled grads
        # as if unscaled, and the sum would come out with the inner loss counted twice.
        raise RuntimeError(
            "amp_patch.scale_loss() blocks cannot be nested: the scale_loss block of an "
            "earlier loss is still open. Close it (call its backward() inside it) before "
            "entering the next one; losses may share one block (scale_loss(loss1 + loss2, ...)) "
            "or follow each other with their own loss_id."
        )
    session.scale_loss_open = True
    try:
        yield from _scaled_backward(session, loss, records, loss_id, delay_unscale,
                                    delay_overflow_check)
    finally:
        session.scale_loss_open = False


def _scaled_backward(session: _session.AmpSession, loss: Tensor, records: list[OptimizerRecord],
                     loss_id: int, delay_unscale: bool,
                     delay_overflow_check: bool) -> Iterator[Tensor]:
    """The body of :func:`scale_loss` once its arguments are checked: yields the scaled loss."""
    # The forward is over: the O1 casts go from the cache now, so that the backward frees
    # each with the last node that saved it (as autocast's cache, cleared when its region
    # ends) instead of holding every one until the exit.
    if session.casts is not None:
        session.casts.cache.clear()
    # A scale set after initialize (Apex's ``_amp_state.loss_scalers[i]._loss_scale``) is used.
    check = session.rank_check  # AMP_PATCH_DEBUG_RANKS=1 (amp_patch/frontend/debug.py)
    if session.props.skips_unscale and session.scalers[loss_id].loss_scale == 1.0:
        if check is not None:
            check.at_entry(session, loss_id, delay_unscale, delay_overflow_check, fast=True)
        try:
            yield loss.float()
        finally:
            _end_iteration(session)
        return

    scaler = session.scalers[loss_id]
    if check is not None:  # before anything is changed, so that a mismatch leaves all as it was
        check.at_entry(session, loss_id, delay_unscale, delay_overflow_check, fast=False)
    for record in records:
        # Grads an earlier exit left scaled for a one-pass step are unscaled first, as that
        # exit would have done; unscaled grads go aside (not under delay_unscale).
        record.begin_backward(delay_unscale)
    try:
        yield scaler.scale_loss(loss)
    except BaseException:
        scaler.check_loss(loss)
        for record in records:
            record.abandon_backward(delay_unscale)
        _end_iteration(session)
        raise

    try:
        # The loss's own check raises the flag in the first grads' check that can take it
        # (one op fewer), else here, before anything reads the flag.
        loss_unchecked = [loss]
        if delay_unscale:
            scaler.check_loss(loss)
            for record in records:
                record.end_backward_scaled()
            return
        in_place: list[Tensor] = []
        copy: tuple[list[Tensor], list[Tensor]] = ([], [])
        accumulate: tuple[list[Tensor], list[Tensor]] = ([], [])
        deferred = 0
        for record in records:
            # The one-pass O2 step reads the grads itself; without the overflow check that
            # follows, a step on non-finite grads must see them unscaled, as it always did.
            if delay_overflow_check or not record.defer_unscale(scaler, loss_unchecked):
                record.collect_unscale(in_place, copy, accumulate)
            else:
                deferred += 1
        if loss_unchecked:
            scaler.check_loss(loss)
        if in_place or copy[0] or accumulate[0]:  # nothing left when every record deferred
            scaler.unscale(in_place, copy, accumulate)
        if delay_overflow_check:
            return
        names = functools.partial(_nonfinite_names, session, records)
        try:
            if session.props.sync_free:
                # The skip is decided on the device: each record hands the flag to its step.
                flag = scaler.update_on_device(names)
                if flag is not None:
                    for record in records:
                        record.schedule_skip(flag)
            elif scaler.update(names):
                for record in records:
                    record.schedule_skip(True)
        except LossScaleCollapseError:
            # Whoever catches the collapse must still not step on these grads.
            for record in records:
                record.schedule_skip(True)
            raise
        if check is not None:  # the rank check reads the overflow on the host (a debug mode)
            check.at_exit(session, scaler, len(in_place) + len(copy[0]) + len(accumulate[0]),
                          deferred, scaler.last_overflow)
    finally:
        _end_iteration(session)


def master_params(optimizer: torch.optim.Optimizer) -> Iterator[Tensor]:
    """Iterate over the tensors ``optimizer`` steps: the fp32 masters under O2, else its params.

    Clip gradients on these after :func:`scale_loss` exits: they hold the
    unscaled gradients. Under O2 with an amp_patch fused optimizer the exit
    leaves the grads scaled for the one-pass step; the first element asked for
    makes the masters' fp32 grads then (the unscale pass the exit left out),
    and that ``step()`` reads them instead.

    Args:
        optimizer (torch.optim.Optimizer): an optimizer passed to :func:`amp_patch.initialize`
            (any optimizer works; without amp it yields its params).

    Yields:
        Tensor: each param of each param group, in order.

    Example::

        >>> model, optimizer = amp.initialize(model, optimizer, opt_level="O2")
        >>> loss = loss_fn(model(x), y)
        >>> with amp.scale_loss(loss, optimizer) as scaled_loss:
        ...     scaled_loss.backward()
        >>> total_norm = torch.nn.utils.clip_grad_norm_(amp.master_params(optimizer), max_norm=1.0)
        >>> optimizer.step()
    """
    session = _session.current()
    record = session.optimizer_records.get(id(optimizer)) if session is not None else None
    if record is not None and record.optimizer_or_none() is optimizer:
        record.materialize_grads()
    for group in optimizer.param_groups:
        yield from group["params"]


def _end_iteration(session: _session.AmpSession) -> None:
    if session.casts is not None:
        session.casts.cache.clear()
    if session.rank_check is not None:
        session.rank_check.iteration_ended(session)


def _as_optimizer_list(optimizers) -> list[Any]:
    if isinstance(optimizers, OPTIMIZER_TYPES):
        return [optimizers]
    if isinstance(optimizers, (list, tuple)) and all(
            isinstance(o, OPTIMIZER_TYPES) for o in optimizers):
        return list(optimizers)
    raise TypeError(
        "scale_loss: optimizers must be an Optimizer (or a LARC) passed to initialize, or a "
        f"list of them; got {type(optimizers).__name__}"
    )


def _nonfinite_names(session: _session.AmpSession, records: list[OptimizerRecord]) -> list[str]:
    names = {id(param): name for name, param in named_parameters(session.models)}
    found: list[str] = []
    for record in records:
        found += [n for n in record.nonfinite_grad_names(names) if n not in found]
    return found
