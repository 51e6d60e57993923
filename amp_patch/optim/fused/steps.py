"""The step counters of the fused optimizers (one per param group, as Apex keeps them) and skips.

A counter is an int on the host, or Apex's capturable layout, an int32 tensor
of one element on the group's device. :func:`next_step` advances it on the
host, for the bias corrections and the rounding bits of the host-side steps;
:func:`device_counter` makes it a tensor on the device, where
:func:`amp_patch.ops.adam_device_step_` advances it by ``found_inf == 0``, so
that a skip decided on the device is never read. :func:`found_inf_read` reads
the skip on the host, and :func:`grad_scaler_inputs` takes up the flags that
``torch.amp.GradScaler`` hands an optimizer.

Example::

    >>> group = {"params": [torch.zeros(2)]}
    >>> next_step(group), next_step(group)
    (1, 2)
    >>> device_counter(group)
    tensor([2], dtype=torch.int32)
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from typing import Any, Iterator

import torch
from torch import Tensor

from amp_patch.optim.fused.batches import FusedStepInputs

logger = logging.getLogger("amp_patch")

__all__ = ["next_step", "device_counter", "as_float", "found_inf_read", "grad_scaler_inputs"]


def next_step(group: dict[str, Any]) -> int:
    """Advance the group's step counter on the host; returns the step, from 1.

    The counter is an int, or a tensor where Apex kept one on the device
    (``capturable``); it is returned as an int for the bias corrections.
    """
    step = group.get("step")
    if isinstance(step, Tensor):
        step.add_(1)
        return int(step)
    group["step"] = (step or 0) + 1
    return group["step"]


def device_counter(group: dict[str, Any]) -> Tensor:
    """The group's step counter as a tensor on its params' device (Apex's capturable layout,
    made from the host int the first time)."""
    step = group.get("step")
    if not isinstance(step, Tensor):
        step = group["step"] = torch.tensor([step or 0], dtype=torch.int32).to(
            group["params"][0].device, non_blocking=True)
    return step


def as_float(value: float | Tensor) -> float:
    """A hyper-parameter that may be held as a tensor (Apex's capturable ``lr``), as a float."""
    return float(value)


def found_inf_read(inputs: FusedStepInputs | None, name: str) -> bool:
    """Whether the step inputs' ``found_inf`` is set: then ``step()`` changes nothing.

    The flag is read on the host (free on the CPU, a sync on CUDA) because the
    step counters, which set the bias corrections, live on the host. It is
    handed to the kernels as their ``noop`` flag all the same.
    """
    found = inputs.found_inf if inputs is not None else None
    if found is not None and bool(found.reshape(()) != 0):
        logger.debug("%s.step() skipped: found_inf is set", name)
        return True
    return False


@contextlib.contextmanager
def grad_scaler_inputs(opt: Any) -> Iterator[None]:
    """Take up what ``torch.amp.GradScaler.step`` hands an optimizer that sets
    ``_step_supports_amp_scaling``: ``opt.grad_scale`` (None when the grads were
    already unscaled) and ``opt.found_inf``, as step inputs of a fused optimizer
    ``opt``. The grads are then read times ``1 / grad_scale`` inside the kernels
    and stay scaled in ``.grad``.
    """
    grad_scale = getattr(opt, "grad_scale", None)
    found_inf = getattr(opt, "found_inf", None)
    if not getattr(opt, "_step_supports_amp_scaling", False) or (
            grad_scale is None and found_inf is None):
        yield
        return
    inv_scale = None if grad_scale is None else grad_scale.double().reciprocal().float()
    with opt.fused_step_inputs(dataclasses.replace(
            opt._inputs or FusedStepInputs(), found_inf=found_inf, inv_scale=inv_scale)):
        yield
