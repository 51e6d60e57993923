"""FusedOptimizer, the base of the fused optimizers: the step, masters, state, checkpoints.

Each optimizer's ``step()`` makes one fused op call per
:class:`~amp_patch.optim.fused.batches.Batch` of a param group (:meth:`FusedOptimizer._batches`:
the lists and flags ready to pass, the state in its codes).

The masters of half params are amp's when amp steps the optimizer: a param that
the step inputs map to a model copy (``FusedStepInputs.model_params``) is
:class:`~amp_patch.optim.amp.MasterWeights`' master, stepped as it is. Only
without amp does an optimizer built with ``master_weights=True`` (or
:class:`~amp_patch.optim.fused.FusedMixedPrecisionLamb`) keep masters of its own,
in ``state[p]["master_param"]`` as Apex did (:meth:`FusedOptimizer._target`).
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch
from torch import Tensor

from amp_patch.optim.fused import state_format as _formats
from amp_patch.optim.fused.batches import Batch, FusedStepInputs, KeptBatches, build_batches
from amp_patch.optim.fused.norms import grad_norms
from amp_patch.optim.fused.state_format import SCALE_SUFFIX, QuantizedState, StateFormat
from amp_patch.optim.fused.step_entry import grads_to_none, hooked_step, labelled
from amp_patch.optim.fused.steps import found_inf_read, grad_scaler_inputs
from amp_patch.settings.dtypes import HALF_DTYPES

__all__ = ["FusedOptimizer", "FusedStepInputs"]


class FusedOptimizer(torch.optim.Optimizer):
    """Base of amp_patch's fused optimizers: not used directly.

    Subclasses implement ``_fused_step()`` with :meth:`_batches` and the ops of
    :mod:`amp_patch.ops`.

    Args:
        params (iterable): parameters or parameter groups.
        defaults (dict): the per-group defaults.
        set_grad_none (bool): what :meth:`zero_grad` does when called without
            ``set_to_none``.
        master_weights (bool): without amp, keep an fp32 master for each fp16/bf16
            param (in ``state[param]["master_param"]``) and step that.
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
    #: Whether the optimizer takes low-precision state (``optimizer_state``).
    LEAN_STATE = False
    #: Whether ``step()`` reads its step inputs' ``found_inf`` on the host (one sync): the
    #: step counters, which set the bias corrections, live on the host.
    READS_FOUND_INF = True

    def __init__(self, params: Any, defaults: dict[str, Any], *, set_grad_none: bool,
                 master_weights: bool = False, state_format: str | StateFormat = "fp32") -> None:
        super().__init__(params, defaults)
        self.set_grad_none = set_grad_none
        self.master_weights = master_weights
        self._inputs: FusedStepInputs | None = None
        #: id(group) -> the batches its last step built, kept (:meth:`_batches`).
        self._kept_batches: dict[int, KeptBatches] = {}
        #: The seed of the stochastic rounding of bf16 params (see :meth:`set_state_format`).
        self.rounding_seed = 0
        self.stochastic_rounding = False
        self.state_format = _formats.get("fp32")
        self.set_state_format(state_format)

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

        Setting to None is torch's loop without its ``record_function``
        unless a profiler runs (:func:`~amp_patch.optim.fused.step_entry.labelled`);
        zeroing is torch's ``zero_grad``.
        """
        if set_to_none is None:
            set_to_none = self.set_grad_none
        if not set_to_none or labelled():
            super().zero_grad(set_to_none)
            return
        grads_to_none(self)

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
        if (fmt.low_precision or stochastic_rounding) and not self.LEAN_STATE:
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
        The load state-dict hooks work as torch's: the restoring reads the dict
        the pre-hooks made, and runs before the post-hooks, which see the state
        as loaded and keep what they change.

        Args:
            state_dict (dict): from :meth:`state_dict`.

        Example::

            >>> opt.load_state_dict(torch.load("ckpt.pt")["optimizer"])
            >>> opt.state[half_param]["exp_avg"].dtype
            torch.float32
        """
        self.forget_kept_batches()
        flat = [p for group in self.param_groups for p in group["params"]]
        loaded: list[dict[str, Any]] = []
        # Registered for this call only: the last pre-hook and the first post-hook.
        last_pre = self.register_load_state_dict_pre_hook(lambda _, sd: loaded.append(sd))
        first_post = self.register_load_state_dict_post_hook(
            lambda _: self._restore_saved_dtypes(loaded[-1], flat), prepend=True)
        try:
            super().load_state_dict(state_dict)
        finally:
            last_pre.remove()
            first_post.remove()

    def _restore_saved_dtypes(self, state_dict: dict[str, Any], flat: list[Tensor]) -> None:
        """Set the state that keeps its saved dtype (see :meth:`load_state_dict`) from
        ``state_dict``, whose params are ``flat`` in order."""
        saved = state_dict["state"]
        saved_ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        for param_id, p in zip(saved_ids, flat):
            entry = saved.get(param_id, {})
            for key, value in entry.items():
                # Codes with scales, and the scales, are not values: they keep their dtype.
                keep = (key in self._KEEP_SAVED_DTYPE or key.endswith(SCALE_SUFFIX)
                        or f"{key}{SCALE_SUFFIX}" in entry)
                if keep and isinstance(value, Tensor):
                    self.state[p][key] = value.to(device=p.device, copy=True)

    #: What an optimizer keeps of one process's steps: made anew by a copy or an unpickling
    #: (:meth:`__setstate__`), never carried. Subclasses add their own.
    _MADE_ANEW: dict[str, Callable[[], Any]] = {"_inputs": lambda: None, "_kept_batches": dict}

    def __getstate__(self) -> dict[str, Any]:
        """torch's state (``defaults``, ``state``, ``param_groups``) and this optimizer's own
        settings (``state_format``, ``adam_w_mode``...: its public attributes), so that
        ``copy.deepcopy`` and pickle keep them (torch's alone would drop them). What torch
        leaves out stays out: hooks, methods wrapped on the instance (by amp or an LR
        scheduler), :attr:`_MADE_ANEW`, and every other private attribute, such as the marker
        ``amp_patch.initialize`` puts on an optimizer it took and a scheduler's flag."""
        state = super().__getstate__()
        for key, value in self.__dict__.items():
            if not (key.startswith("_") or key in state or callable(value)):
                state[key] = value
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        for key, make in self._MADE_ANEW.items():
            self.__dict__.setdefault(key, make())

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        step = cls.__dict__.get("step")
        if step is not None and not getattr(step, "hooked", False):
            cls.step = hooked_step(step)  # type: ignore[method-assign]

    @hooked_step
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One fused step over every param that has a grad (or a grad in the step inputs).

        Does nothing when the step inputs' ``found_inf`` is set, or when
        ``torch.amp.GradScaler`` found an overflow (optimizers that take the
        scaler's flags). Runs with grad mode off, and with torch's step hooks
        and profiler label (:mod:`~amp_patch.optim.fused.step_entry`; a
        subclass's own ``step`` gets the same entry).

        Args:
            closure (callable, optional): re-evaluates the model and returns the loss.

        Returns:
            The closure's loss, or None.

        Example::

            >>> loss_fn(model(x), y).backward()
            >>> opt.step()
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        with grad_scaler_inputs(self):
            if self._skips_on_device() or not found_inf_read(self._inputs, type(self).__name__):
                self._fused_step()
        return loss

    def _fused_step(self) -> None:
        """The op calls of one step; each optimizer defines its own."""
        raise NotImplementedError(f"{type(self).__name__} does not define its fused step")

    def state_in_code(self, p: Tensor, key: str, dtype: torch.dtype | None,
                      like: Tensor | None = None) -> QuantizedState:
        """``state[p][key]`` in code ``dtype`` (None: as stored), stored back when it changed.

        Made as zeros like ``like`` (default: ``p``) on first use; converted when
        stored in another code (:meth:`QuantizedState.in_code`).

        Example::

            >>> from amp_patch.optim.fused import FusedAdam
            >>> p = torch.nn.Parameter(torch.zeros(64, 64))
            >>> opt = FusedAdam([p])
            >>> opt.state_in_code(p, "exp_avg", torch.int8).codes.dtype, sorted(opt.state[p])
            (torch.int8, ['exp_avg', 'exp_avg_scale'])
        """
        entry, block_size = self.state[p], self.state_format.block_size
        kept = QuantizedState.load(entry, key, block_size)
        if kept is None:
            like = p if like is None else like
            kept = QuantizedState.zeros(like, dtype or like.dtype, block_size)
        elif dtype is None or kept.is_in(dtype):
            return kept
        else:
            kept = kept.in_code(dtype)
        kept.store(entry, key)
        return kept

    def _batches(self, group: dict[str, Any], split: Callable[[Tensor], Any] | None = None,
                 state: tuple[str, ...] = ()) -> list[Batch]:
        """The op calls of ``group``'s step (:func:`~amp_patch.optim.fused.batches.build_batches`),
        with the state under the keys ``state`` in the codes of :meth:`_state_codes`.

        The batches of the group's last step are kept and made again with this
        step's grads when nothing else changed
        (:class:`~amp_patch.optim.fused.batches.KeptBatches`). Not under
        ``torch.compile``, whose graph holds the lists itself, and not for an
        optimizer that keeps masters of its own.
        """
        if self.master_weights or torch.compiler.is_compiling():
            return build_batches(self, group, split, state)
        kept = self._kept_batches.get(id(group))
        if kept is not None:
            batches = kept.rebuild(self, group, split, state)
            if batches is not None:
                return batches
        batches = build_batches(self, group, split, state)
        # A split made anew at every step (SGD's, of this step's new buffers) is never kept.
        if kept is None or kept.split == split:
            self._kept_batches[id(group)] = KeptBatches(self, group, split, state, batches)
        return batches

    def forget_kept_batches(self) -> None:
        """Drop the batches kept from the last step (:meth:`_batches`), and with them their
        references to the params and state: for whoever takes those from the optimizer.

        Example::

            >>> from amp_patch.optim.fused import FusedAdam
            >>> opt = FusedAdam(model.parameters(), lr=1e-3)
            >>> loss_fn(model(x), y).backward()
            >>> opt.step()                 # keeps its batches for the next step
            >>> opt.forget_kept_batches()
        """
        self._kept_batches.clear()

    def _state_codes(self, key: Tensor, stepped: Tensor,
                     low_precision: bool) -> tuple[torch.dtype | None, ...]:
        """The codes of a param's state tensors: the format's for the low-precision ops, else
        the dtype of the tensor stepped (state of another dtype is converted)."""
        if low_precision:
            return self.state_format.codes(key)
        return stepped.dtype, stepped.dtype

    def _grad_of(self, p: Tensor) -> Tensor | None:
        inputs = self._inputs
        if inputs is not None and inputs.grads is not None:
            grad = inputs.grads.get(p)  # one hash of p: a tensor's is Python code
            if grad is not None:
                return grad
        return p.grad

    def _target(self, p: Tensor) -> tuple[Tensor, Tensor | None]:
        """``(tensor stepped, model copy written)`` for param ``p``: amp's masters first (a ``p``
        that the step inputs map to a model param is one), else, for a half ``p`` of an
        optimizer that keeps masters, its own fp32 master (made on first use) and ``p``."""
        inputs = self._inputs
        if inputs is not None and inputs.model_params is not None:
            model_p = inputs.model_params.get(p)
            if model_p is not None:
                return p, model_p
        if not self._uses_master(p):
            return p, None
        state = self.state[p]
        master = state.get("master_param")
        if master is None:
            master = state["master_param"] = p.detach().to(
                torch.float32, memory_format=torch.preserve_format, copy=True)
        return master, p

    def _uses_master(self, p: Tensor) -> bool:
        return self.master_weights and p.dtype in HALF_DTYPES

    def _grad_norms(self, groups: list[dict[str, Any]] | None = None) -> dict[torch.device, Tensor]:
        """The L2 norm of this step's grads of ``groups`` (default: all), per device
        (:func:`~amp_patch.optim.fused.norms.grad_norms`); for all groups, the step inputs'
        ``grad_norms`` when they have them."""
        grads = [(p.device, g) for group in (self.param_groups if groups is None else groups)
                 for p in group["params"] if (g := self._grad_of(p)) is not None]
        given = self._inputs.grad_norms if self._inputs is not None and groups is None else None
        return grad_norms(grads, given)

    def _skips_on_device(self) -> bool:
        """Whether this step takes its inputs' ``found_inf`` on the device unread: the kernels
        skip on it, and the step counters (:func:`~amp_patch.optim.fused.steps.device_counter`)
        stay on the device."""
        inputs = self._inputs
        return inputs is not None and inputs.found_inf is not None and not self.READS_FOUND_INF
