"""What the fused optimizers share: grad and master lookup, step flags, state, checkpoints.

Each optimizer's ``step()`` groups the params of a param group that have a
grad into :class:`_Batch` es (one per device, and apart for params whose
updated value is also written into a half model copy), then makes one fused
op call per batch. The op reads every grad, param and state tensor once and
writes each once.

Where a step reads its grads and what it writes besides the params can be
redirected with :class:`FusedStepInputs`. That is the one seam between these
optimizers and amp's O2 (:mod:`amp_patch.optim.amp` hands the inputs to any
optimizer that has ``fused_step_inputs``): every step writes the half model
params in the same pass as the fp32 masters, and the one-pass step also
reads the half model grads, still scaled, times the inverse loss scale.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from typing import Any, Callable, Iterator, Mapping

import torch
from torch import Tensor

from amp_patch import ops
from amp_patch.helpers.tensors import local_tensors, shard_groups, sum_over_shards
from amp_patch.optim.fused import state_format as _formats
from amp_patch.optim.fused.state_format import SCALE_SUFFIX, StateFormat
from amp_patch.settings.dtypes import HALF_DTYPES

logger = logging.getLogger("amp_patch")



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
            the same pass.
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


@dataclasses.dataclass
class _Batch:
    """One op call's lists: the params as keyed in ``state``, the tensors stepped, grads,
    outputs."""

    device: torch.device
    keys: list[Tensor] = dataclasses.field(default_factory=list)
    params: list[Tensor] = dataclasses.field(default_factory=list)
    grads: list[Tensor] = dataclasses.field(default_factory=list)
    model_params: list[Tensor] = dataclasses.field(default_factory=list)
    noop: Tensor | None = None
    inv_scale: Tensor | None = None


class FusedOptimizer(torch.optim.Optimizer):
    """Base of amp_patch's fused optimizers: not used directly.

    Subclasses implement ``step()`` with :meth:`_batches`, :meth:`_state_tensor`
    and the ops of :mod:`amp_patch.ops`.

    Args:
        params (iterable): parameters or parameter groups.
        defaults (dict): the per-group defaults.
        set_grad_none (bool): what :meth:`zero_grad` does when called without
            ``set_to_none``.
        master_weights (bool): keep an fp32 master for each fp16/bf16 param
            (in ``state[param]["master_param"]``) and step that.
        state_format (str or StateFormat): how the state is stored (``"fp32"``,
            ``"bf16"``, ``"int8"``, ``"fp8"``; see
            :mod:`amp_patch.optim.fused.state_format`), for the optimizers that
            take low-precision state (:attr:`LEAN_STATE`). Default: ``"fp32"``.

    Example::

        >>> class FusedPlainSGD(FusedOptimizer):
        ...     def __init__(self, params, lr):
        ...         super().__init__(params, dict(lr=lr), set_grad_none=True)
        ...     def _fused_step(self):
        ...         for group in self.param_groups:
        ...             for b in self._batches(group):
        ...                 ops.multi_tensor_sgd_(b.grads, b.params, [], b.model_params, b.noop,
        ...                                       b.inv_scale, lr=group["lr"])
    """

    #: State keys whose saved dtype :meth:`load_state_dict` keeps (fp32 state of half params).
    _KEEP_SAVED_DTYPE: tuple[str, ...] = ("master_param",)
    #: Whether the optimizer takes low-precision state (:meth:`set_state_format`).
    LEAN_STATE = False
    #: Whether ``step()`` reads its step inputs' ``found_inf`` on the host (one sync): the
    #: step counters, which set the bias corrections, live on the host (:meth:`_step_skipped`).
    READS_FOUND_INF = True

    def __init__(self, params: Any, defaults: dict[str, Any], *, set_grad_none: bool,
                 master_weights: bool = False, state_format: str | StateFormat = "fp32") -> None:
        super().__init__(params, defaults)
        self.set_grad_none = set_grad_none
        self.master_weights = master_weights
        self._inputs: FusedStepInputs | None = None
        #: The seed of the stochastic rounding of bf16 params (see :meth:`set_state_format`).
        self.rounding_seed = 0
        self.stochastic_rounding = False
        self.state_format = _formats.get("fp32")
        self.set_state_format(state_format)

    # ----------------------------------------------------------------- public

    def zero_grad(self, set_to_none: bool | None = None) -> None:
        """Clear the grads: to None when ``set_to_none`` (default: the ``set_grad_none``
        given at construction), else to zero.

        Args:
            set_to_none (bool, optional): overrides ``set_grad_none`` for this call.

        Example::

            >>> from amp_patch.optim.fused import FusedSGD
            >>> opt = FusedSGD(model.parameters(), lr=0.1)   # set_grad_none=False, as in Apex
            >>> opt.zero_grad()                  # grads zeroed
            >>> opt.zero_grad(set_to_none=True)  # grads set to None
        """
        super().zero_grad(self.set_grad_none if set_to_none is None else set_to_none)

    def set_state_format(self, state_format: str | StateFormat,
                         stochastic_rounding: bool | None = None) -> StateFormat:
        """Store the state in ``state_format`` from the next step on; returns the previous format.

        State made under another format is converted (decoded, encoded again)
        when a step next uses it, so nothing is lost beyond the new code's
        rounding. ``stochastic_rounding`` makes every step write bf16 params
        (stepped directly: bf16 masters) with stochastic rounding, as the lean
        ops do (:mod:`amp_patch.ops.lean_state_ops`); the bits are reproducible
        from :attr:`rounding_seed` and the step count.

        Args:
            state_format (str or StateFormat): ``"fp32"``, ``"bf16"``, ``"int8"`` or ``"fp8"``.
            stochastic_rounding (bool, optional): None keeps the current setting.

        Returns:
            StateFormat: the format before the call.

        Raises:
            ValueError: an unknown format, or a low-precision one for an optimizer
                that cannot take it.

        Example::

            >>> from amp_patch.optim.fused import FusedAdam
            >>> opt = FusedAdam(model.parameters(), lr=1e-3)
            >>> opt.set_state_format("int8").name
            'fp32'
        """
        fmt = _formats.get(state_format)
        if (fmt.is_lean or stochastic_rounding) and not self.LEAN_STATE:
            raise ValueError(
                f"{type(self).__name__} cannot keep its state in {fmt.name!r} or round "
                "stochastically; the optimizers that can are FusedAdam, FusedSGD and FusedLAMB")
        previous, self.state_format = self.state_format, fmt
        if stochastic_rounding is not None:
            self.stochastic_rounding = bool(stochastic_rounding)
        return previous

    @contextlib.contextmanager
    def fused_step_inputs(self, inputs: FusedStepInputs) -> Iterator[FusedStepInputs]:
        """Make the ``step()`` calls inside the block read grads and flags from ``inputs``.

        Args:
            inputs (FusedStepInputs): the grads, model copies and flags.

        Example::

            >>> with optimizer.fused_step_inputs(FusedStepInputs(found_inf=flag)):
            ...     optimizer.step()   # changes nothing if flag is set
        """
        previous, self._inputs = self._inputs, inputs
        try:
            yield inputs
        finally:
            self._inputs = previous

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict, keeping fp32 state of half params in fp32.

        ``torch.optim.Optimizer.load_state_dict`` casts floating state to each
        param's dtype, which would round fp32 moments and masters of half
        params to half; the keys in ``_KEEP_SAVED_DTYPE`` are restored as saved.

        Args:
            state_dict (dict): from :meth:`state_dict`.

        Example::

            >>> opt.load_state_dict(torch.load("ckpt.pt")["optimizer"])
            >>> opt.state[half_param]["exp_avg"].dtype
            torch.float32
        """
        saved = state_dict["state"]
        flat = [p for group in self.param_groups for p in group["params"]]
        super().load_state_dict(state_dict)
        saved_ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        for param_id, p in zip(saved_ids, flat):
            entry = saved.get(param_id, {})
            for key, value in entry.items():
                # Codes with scales, and the scales, are not values: they keep their dtype.
                keep = (key in self._KEEP_SAVED_DTYPE or key.endswith(SCALE_SUFFIX)
                        or f"{key}{SCALE_SUFFIX}" in entry)
                if keep and isinstance(value, Tensor):
                    self.state[p][key] = value.to(device=p.device, copy=True)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One fused step over every param that has a grad (or a grad in the step inputs).

        Does nothing when the step inputs' ``found_inf`` is set, or when
        ``torch.amp.GradScaler`` found an overflow (optimizers that take the
        scaler's flags).

        Args:
            closure (callable, optional): re-evaluates the model and returns the loss.

        Returns:
            The closure's loss, or None.

        Example::

            >>> loss_fn(model(x), y).backward()
            >>> opt.step()
        """
        loss = self._closure_loss(closure)
        with self._grad_scaler_inputs():
            if self._skips_on_device() or not self._step_skipped():
                self._fused_step()
        return loss

    def _fused_step(self) -> None:
        """The op calls of one step; each optimizer defines its own."""
        raise NotImplementedError(f"{type(self).__name__} does not define its fused step")

    # ------------------------------------------------------------- for steps

    def _closure_loss(self, closure: Callable[[], Any] | None) -> Any:
        if closure is None:
            return None
        with torch.enable_grad():
            return closure()

    def _grad_of(self, p: Tensor) -> Tensor | None:
        inputs = self._inputs
        if inputs is not None and inputs.grads is not None and p in inputs.grads:
            return inputs.grads[p]
        return p.grad

    def _master(self, p: Tensor) -> Tensor:
        """The fp32 master of half param ``p``, made from it on first use."""
        state = self.state[p]
        master = state.get("master_param")
        if master is None:
            master = state["master_param"] = p.detach().to(
                torch.float32, memory_format=torch.preserve_format, copy=True)
        return master

    def _uses_master(self, p: Tensor) -> bool:
        return self.master_weights and p.dtype in HALF_DTYPES

    def _flags(self, device: torch.device) -> tuple[Tensor | None, Tensor | None]:
        """(noop, inv_scale) for one device: from the step inputs, else none."""
        inputs = self._inputs
        if inputs is None:
            return None, None
        return _on(inputs.found_inf, device), _on(inputs.inv_scale, device)

    def _batches(self, group: dict[str, Any], split: Callable[[Tensor], Any] | None = None,
                 ) -> list[_Batch]:
        """The params of ``group`` that have a grad, as op-call batches.

        A batch holds params of one device, all with or all without a model copy
        to write; ``split(param)`` may separate them further (SGD's new momentum
        buffers). Order within a batch is the group's order.
        """
        inputs = self._inputs
        batches: dict[tuple, _Batch] = {}
        for p in group["params"]:
            grad = self._grad_of(p)
            if grad is None:
                continue
            if grad.is_sparse:
                raise RuntimeError(f"{type(self).__name__} does not support sparse gradients")
            stepped, out = p, None
            if inputs is not None and inputs.model_params is not None and p in inputs.model_params:
                out = inputs.model_params[p]
            elif self._uses_master(p):
                stepped, out = self._master(p), p
            key = (p.device, out is not None, split(p) if split is not None else None)
            batch = batches.get(key)
            if batch is None:
                batch = batches[key] = _Batch(p.device)
                batch.noop, batch.inv_scale = self._flags(p.device)
            batch.keys.append(p)
            batch.params.append(stepped)
            batch.grads.append(grad)
            if out is not None:
                batch.model_params.append(out)
        return list(batches.values())

    def _grad_norms(self, groups: list[dict[str, Any]] | None = None) -> dict[torch.device, Tensor]:
        """The L2 norm of every grad of this step's ``groups`` (default: all), per device of the
        params (global across devices when there are several).

        For all groups it comes from the step inputs' ``grad_norms`` when they have it, else
        from one :func:`amp_patch.ops.multi_tensor_l2norm` per device over the grads in
        ``param_groups`` order. The grads are as stored: ``inv_scale`` is applied by the
        kernel that uses the norm. Sharded grads (FSDP2's DTensors) give the norm of the
        whole grads: each rank's squared norm of its shards, summed over their process groups
        (:func:`~amp_patch.helpers.tensors.sum_over_shards`), on every rank alike.
        """
        # device -> shard groups (() for whole grads) -> grads, in param_groups order.
        per_device: dict[torch.device, dict[tuple[Any, ...], list[Tensor]]] = {}
        for group in self.param_groups if groups is None else groups:
            for p in group["params"]:
                grad = self._grad_of(p)
                if grad is not None:
                    by_groups = per_device.setdefault(p.device, {})
                    by_groups.setdefault(shard_groups(grad), []).append(grad)
        sharded = any(key for by_groups in per_device.values() for key in by_groups)
        given = self._inputs.grad_norms if self._inputs is not None and groups is None else None
        if given is not None and not sharded:  # the check's norms are each rank's own
            norms = dict(given)
        else:
            norms = {dev: _grad_norm(by_groups) for dev, by_groups in per_device.items()}
        if len(norms) > 1:
            first = next(iter(norms))
            total = torch.linalg.vector_norm(torch.stack([n.to(first) for n in norms.values()]))
            norms = {dev: total.to(dev) for dev in norms}
        return norms

    def _state_tensor(self, p: Tensor, key: str, dtype: torch.dtype | None = None) -> Tensor:
        """``state[p][key]``, made as zeros like the stepped tensor (in ``dtype``) on first use."""
        state = self.state[p]
        t = state.get(key)
        if t is None:
            like = self._master(p) if self._uses_master(p) else p
            t = state[key] = torch.zeros_like(like, dtype=dtype or like.dtype,
                                              memory_format=torch.preserve_format)
        return t

    def _lean_state(self, p: Tensor, key: str, dtype: torch.dtype) -> tuple[Tensor, Tensor | None]:
        """``state[p][key]`` in code ``dtype`` and its scales (None for unscaled codes).

        Made as zeros on first use, converted when stored in another code
        (:meth:`StateFormat.convert`). The scales live beside the codes, under
        ``key + "_scale"``.
        """
        state = self.state[p]
        scale_key = key + SCALE_SUFFIX
        codes, scales = state.get(key), state.get(scale_key)
        fmt = self.state_format
        if codes is None:
            like = self._master(p) if self._uses_master(p) else p
            codes, scales = fmt.zeros(like, dtype)
        elif codes.dtype != dtype or (scales is None) != (dtype not in _formats.SCALED_CODES):
            codes, scales = fmt.convert(codes, scales, dtype)
        else:
            return codes, scales
        state[key] = codes
        if scales is None:
            state.pop(scale_key, None)
        else:
            state[scale_key] = scales
        return codes, scales

    def _lean_step(self, b: "_Batch") -> bool:
        """Whether batch ``b`` steps through the lean ops: a low-precision format, or bf16
        params to round stochastically."""
        return self.state_format.is_lean or (
            self.stochastic_rounding and any(p.dtype == torch.bfloat16 for p in b.params))

    def _skips_on_device(self) -> bool:
        """Whether this step takes its inputs' ``found_inf`` on the device unread: the kernels
        skip on it, and the step counters (:meth:`_device_step`) stay on the device."""
        inputs = self._inputs
        return inputs is not None and inputs.found_inf is not None and not self.READS_FOUND_INF

    def _device_step(self, group: dict[str, Any]) -> Tensor:
        """Advance the group's step counter on the device, unless ``found_inf`` is set (no read).

        The counter becomes Apex's capturable layout, an int32 tensor of one
        element on the group's device, the first time; it advances by
        ``found_inf == 0``, so a skipped step leaves it as it was.

        Returns:
            Tensor: the counter after this step.
        """
        step = group.get("step")
        device = group["params"][0].device
        if not isinstance(step, Tensor):
            step = group["step"] = torch.tensor([step or 0], dtype=torch.int32).to(
                device, non_blocking=True)
        assert self._inputs is not None and self._inputs.found_inf is not None
        found = self._inputs.found_inf.to(step.device, non_blocking=True)
        step.add_(found.reshape(step.shape) == 0)
        return step

    def _step_skipped(self) -> bool:
        """Whether the step inputs' ``found_inf`` is set: then ``step()`` changes nothing.

        The flag is read on the host (free on the CPU, a sync on CUDA) because the
        step counters, which set the bias corrections, live on the host. It is
        handed to the kernels as their ``noop`` flag all the same.
        """
        found = self._inputs.found_inf if self._inputs is not None else None
        if found is not None and bool(found.reshape(()) != 0):
            logger.debug("%s.step() skipped: found_inf is set", type(self).__name__)
            return True
        return False

    @contextlib.contextmanager
    def _grad_scaler_inputs(self) -> Iterator[None]:
        """Take up what ``torch.amp.GradScaler.step`` hands an optimizer that sets
        ``_step_supports_amp_scaling``: ``self.grad_scale`` (None when the grads
        were already unscaled) and ``self.found_inf``. The grads are then read
        times ``1 / grad_scale`` inside the kernels and stay scaled in ``.grad``.
        """
        grad_scale = getattr(self, "grad_scale", None)
        found_inf = getattr(self, "found_inf", None)
        if not getattr(self, "_step_supports_amp_scaling", False) or (
                grad_scale is None and found_inf is None):
            yield
            return
        inv_scale = None if grad_scale is None else grad_scale.double().reciprocal().float()
        with self.fused_step_inputs(dataclasses.replace(
                self._inputs or FusedStepInputs(), found_inf=found_inf, inv_scale=inv_scale)):
            yield

    @staticmethod
    def _next_step(group: dict[str, Any]) -> int:
        """Advance the group's step counter (Apex keeps one per group, not one per param).

        The counter is an int, or a tensor where Apex kept one on the device
        (``capturable``); it is returned as an int for the bias corrections.
        """
        step = group.get("step")
        if isinstance(step, Tensor):
            step.add_(1)
            return int(step)
        group["step"] = (step or 0) + 1
        return group["step"]

    @staticmethod
    def _scalar(value: float | Tensor) -> float:
        """A hyper-parameter that may be held as a tensor (Apex's capturable ``lr``)."""
        return float(value)


def lean_scales(state: list[tuple[Tensor, Tensor | None]]) -> list[Tensor]:
    """The scales list of a lean op call from ``(codes, scales)`` pairs: one per tensor when
    the codes are block-scaled, else empty (a batch's tensors share their codes)."""
    return [s for _, s in state if s is not None]


def _on(t: Tensor | None, device: torch.device) -> Tensor | None:
    if t is None or t.device == device:
        return t
    return t.to(device, non_blocking=True)


def _grad_norm(by_groups: dict[tuple[Any, ...], list[Tensor]]) -> Tensor:
    """The L2 norm of one device's grads, keyed by their shard groups: of the whole grads.

    Whole grads alone take one multi_tensor_l2norm; sharded ones add their squared norm
    summed over their shards' groups (:func:`~amp_patch.helpers.tensors.sum_over_shards`).
    """
    if list(by_groups) == [()]:
        return ops.multi_tensor_l2norm(by_groups[()])[0]
    total = None
    for groups, members in by_groups.items():
        part = ops.multi_tensor_l2norm(local_tensors(members))[0].float().square()
        sum_over_shards(part, groups)
        total = part if total is None else total + part
    return total.sqrt()  # type: ignore[union-attr]


def whole_tensor_norms(tensors: list[Tensor], *norms: Tensor, op: str = "l2",
                       ) -> tuple[Tensor, ...]:
    """Per-tensor norms of whole tensors from those of this rank's shards.

    ``n[i]`` of each of ``norms`` is the norm of ``tensors[i]``'s local shard (FSDP2's
    DTensors; a whole tensor is its own shard). For each sharded tensor the squares of its
    shards' L2 norms are summed over its process groups (``op="max"``: the maxima taken),
    all of ``norms`` in one all-reduce per set of groups. Whole tensors keep their norms,
    and with no sharded tensor ``norms`` come back as they are.

    Args:
        tensors (list of Tensor): the tensors.
        *norms (Tensor): fp32, one norm per tensor each.
        op (str, optional): ``"l2"`` or ``"max"``. Default: ``"l2"``.

    Returns:
        tuple of Tensor: the whole tensors' norms, one per tensor of ``norms``.

    Example::

        >>> whole_tensor_norms([torch.ones(2), torch.ones(3)], torch.tensor([3.0, 4.0]))
        (tensor([3., 4.]),)
    """
    by_groups: dict[tuple[Any, ...], list[int]] = {}
    for i, t in enumerate(tensors):
        groups = shard_groups(t)
        if groups:
            by_groups.setdefault(groups, []).append(i)
    if not by_groups:
        return norms
    out = torch.stack(norms)
    for groups, members in by_groups.items():
        index = torch.tensor(members, device=out.device)
        part = out.index_select(-1, index)
        if op == "max":
            out.index_copy_(-1, index, sum_over_shards(part, groups, "max"))
        else:
            out.index_copy_(-1, index, sum_over_shards(part.square(), groups).sqrt())
    return tuple(out.unbind(0))
