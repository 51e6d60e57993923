"""FP8 ``nn.Linear`` layers: which ones, their FP8 forward, weight-cast cache and delayed state.

:func:`install` (``initialize(..., fp8=...)``) chooses the eligible ``nn.Linear``
layers of the models (:func:`select`: the default filter, or the caller's) and
gives each a forward of its own that runs :func:`~amp_patch.ops.fp8_ops.fp8_linear`:
all three GEMMs in FP8, fp32 accumulation. The module, its parameters, hooks and
state-dict keys stay as they are; only an instance attribute ``forward`` is
added, and removed again when the session closes (a ``forward`` the instance
already had is put back, the very same object). Everything else in the model
runs at the level's precision, and so does a converted layer inside
``fp8_autocast(enabled=False)``.

The output dtype is what the level gives that layer: O1 casts the input to the
half dtype as its lists cast ``linear``; O2/O3 compute in the model's half
dtype; O0 computes in fp32, in and out.

Per iteration each weight is cast to FP8 once (:class:`Fp8Layer`): the cast is
kept until the optimizer's next step (or the weight's version counter moves),
so gradient accumulation's second forward reuses it. Under ``torch.compile``
there is no cache (it would guard on a version counter): the cast is part of the
graph.

Under the delayed recipe each layer has an :class:`~amp_patch.ops.fp8_ops.Fp8LinearState`
(amax histories and scales of x, W and dY). A step hook of the optimizer
holding the layer's weight updates it once per ``step()``, on the device, and
leaves it bitwise as it was before the step when the step is skipped after an
overflow: the flag the step itself reads (a device tensor under ``sync_free``)
selects the old state with ``torch.where``; a step skipped on the host never
reaches the hook.

Regions: :func:`push_region` / :func:`pop_region` keep the stack that
:func:`amp_patch.fp8_autocast` sets (FP8 on or off, another recipe). It is
module state, not a session's: a region may be entered before ``initialize``.
"""

from __future__ import annotations

import fnmatch
import logging
import types
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ContextManager

import torch
from torch import Tensor, nn

from amp_patch.ops import fp8_ops
from amp_patch.ops.fp8_ops import Fp8Format, Fp8LinearState, Fp8Tensor
from amp_patch.settings.fp8 import Fp8Recipe

if TYPE_CHECKING:
    from amp_patch.settings.properties import Properties

__all__ = ["Fp8Plan", "Fp8Layer", "Fp8Conversion", "select", "install", "push_region",
           "pop_region", "current_region", "step_flag"]

logger = logging.getLogger("amp_patch")

_MULTIPLE = 16
_MISSING = object()


@dataclass(frozen=True)
class Fp8Plan:
    """Which ``nn.Linear`` layers FP8 converted and which it left out, and why.

    Attributes:
        converted (tuple of str): the converted layers' names, in module order
            (``model1.`` etc. in front when several models were passed).
        left_out (dict): name to the reason it runs at the level's precision.
        recipe (Fp8Recipe): the recipe, with ``fp8_modules`` as its filter when given.

    Example::

        >>> plan = select([nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 10))],
        ...               Fp8Recipe(min_features=16))
        >>> plan.converted, plan.left_out
        (('0',), {'1': 'out_features=10 is not a multiple of 16 (the FP8 GEMM needs it)'})
    """

    converted: tuple[str, ...]
    left_out: dict[str, str]
    recipe: Fp8Recipe

    def summary(self) -> str:
        r"""One line: how many layers were converted, and each one left out with its reason
        (``amp-patch compare`` shows it under its table).

        Example::

            >>> plan = select([nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 10))],
            ...               Fp8Recipe(min_features=16))
            >>> print(plan.summary().replace("; ", ";\n"))
            FP8: 1 of 2 nn.Linear layers converted;
            left out: 1 (out_features=10 is not a multiple of 16 (the FP8 GEMM needs it))
        """
        total = len(self.converted) + len(self.left_out)
        text = f"FP8: {len(self.converted)} of {total} nn.Linear layers converted"
        if self.left_out:
            text += "; left out: " + ", ".join(f"{name} ({why})"
                                               for name, why in self.left_out.items())
        return text

    def describe(self) -> str:
        """The log's lines: what was converted, what was left out and why."""
        lines = [f"FP8 ({self.recipe.describe()}): {len(self.converted)} nn.Linear layer(s) "
                 f"converted" + (": " + ", ".join(self.converted) if self.converted else "")]
        for name, why in self.left_out.items():
            lines.append(f"  left out {name}: {why}")
        return "\n".join(lines)


def _linears(models: list[nn.Module]) -> list[tuple[str, nn.Linear]]:
    out: list[tuple[str, nn.Linear]] = []
    seen: set[int] = set()
    for i, model in enumerate(models):
        prefix = f"model{i}." if len(models) > 1 else ""
        for name, module in model.named_modules():
            if isinstance(module, nn.Linear) and id(module) not in seen:
                seen.add(id(module))
                out.append((prefix + name, module))
    return out


def _unfit(module: nn.Linear) -> str | None:
    """Why ``module`` cannot run the FP8 forward at all, or None."""
    if isinstance(module, nn.modules.linear.NonDynamicallyQuantizableLinear):
        return ("the out_proj of an nn.MultiheadAttention, whose weight its parent uses "
                "directly, not through this forward")
    if type(module).forward is not nn.Linear.forward:
        return f"{type(module).__qualname__} overrides nn.Linear.forward"
    for what, n in (("in_features", module.in_features), ("out_features", module.out_features)):
        if n % _MULTIPLE:
            return f"{what}={n} is not a multiple of {_MULTIPLE} (the FP8 GEMM needs it)"
    return None


def select(models: list[nn.Module], recipe: Fp8Recipe) -> Fp8Plan:
    """Choose the layers to convert: the default filter, or ``recipe.modules``.

    The default filter leaves out layers whose in or out features are not
    multiples of 16, layers with a dim below ``recipe.min_features``, and, with
    ``skip_first_last``, the first and last ``nn.Linear`` in module order. A
    callable or names in ``recipe.modules`` choose instead (a chosen layer that
    cannot run in FP8, a dim not a multiple of 16, is still left out, with its
    reason).

    Raises:
        ValueError: a name in ``recipe.modules`` that matches no ``nn.Linear``
            (the message lists them).

    Example::

        >>> m = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64))
        >>> select([m], Fp8Recipe(modules=("2",))).converted
        ('2',)
        >>> select([m], Fp8Recipe()).left_out["0"]
        'in_features=64 and out_features=64: below min_features=2048, too small to gain from FP8'
    """
    linears = _linears(models)
    chosen = recipe.modules
    if isinstance(chosen, tuple):
        names = [n for n, _ in linears]
        unmatched = [p for p in chosen if not any(fnmatch.fnmatchcase(n, p) for n in names)]
        if unmatched:
            raise ValueError(
                f"fp8_modules: {', '.join(map(repr, unmatched))} match(es) no nn.Linear of the "
                f"models; their nn.Linear layers are: {', '.join(names) or '(none)'}")
    converted: list[str] = []
    left_out: dict[str, str] = {}
    last = len(linears) - 1
    for index, (name, module) in enumerate(linears):
        if chosen is None:
            why = _unfit(module)
            small = min(module.in_features, module.out_features) < recipe.min_features
            if why is None and small:
                why = (f"in_features={module.in_features} and out_features="
                       f"{module.out_features}: below min_features={recipe.min_features}, "
                       "too small to gain from FP8")
            if why is None and recipe.skip_first_last and index in (0, last):
                why = f"the {'first' if index == 0 else 'last'} nn.Linear (skip_first_last)"
        else:
            wanted = (any(fnmatch.fnmatchcase(name, p) for p in chosen)
                      if isinstance(chosen, tuple) else bool(chosen(name, module)))
            why = "not chosen by fp8_modules" if not wanted else _unfit(module)
        if why is None:
            converted.append(name)
        else:
            left_out[name] = why
    return Fp8Plan(tuple(converted), left_out, recipe)


# ---------------------------------------------------------------------------------------
# Regions (amp_patch.fp8_autocast)


@dataclass(frozen=True)
class _Region:
    enabled: bool
    recipe: Fp8Recipe | None


_regions: list[_Region] = []


def push_region(enabled: bool, recipe: Fp8Recipe | None) -> int:
    """Enter an FP8 region; returns the depth to hand :func:`pop_region`."""
    _regions.append(_Region(bool(enabled), recipe))
    return len(_regions)


def pop_region(depth: int) -> None:
    """Leave the region :func:`push_region` entered (and any left open inside it)."""
    del _regions[depth - 1:]


def current_region() -> tuple[bool, Fp8Recipe | None] | None:
    """The innermost region's ``(enabled, recipe)``, or None outside every region."""
    if not _regions:
        return None
    r = _regions[-1]
    return r.enabled, r.recipe


# ---------------------------------------------------------------------------------------
# One converted layer


@dataclass(eq=False)
class Fp8Layer:
    """One converted ``nn.Linear``: its forward's settings, weight-cast cache and delayed state.

    Attributes:
        name (str): as in :attr:`Fp8Plan.converted`.
        module (nn.Linear): the layer.
        recipe (Fp8Recipe): the session's recipe.
        state (Fp8LinearState or None): the delayed recipe's histories and scales.
        half_dtype (torch.dtype or None): O1's half dtype, which the input is cast
            to; None computes in the weight's dtype (O0, O2, O3).
        casts (int): weight casts made (for tests and diagnostics).
    """

    name: str
    module: nn.Linear
    recipe: Fp8Recipe
    state: Fp8LinearState | None
    half_dtype: torch.dtype | None
    no_casts: Callable[[], ContextManager[Any]]
    casts: int = 0
    _saved_forward: Any = _MISSING
    _cache_key: tuple | None = None
    _cache: Fp8Tensor | None = None
    _fmt: dict[str, Fp8Format] = field(default_factory=dict)

    def clear_cache(self) -> None:
        """Drop the weight's FP8 cast (the optimizer stepped, or the scales changed)."""
        self._cache_key = None
        self._cache = None

    def _weight_fp8(self, weight: Tensor, fmt: Fp8Format, recipe: Fp8Recipe,
                    delayed: bool) -> Fp8Tensor:
        rowwise = recipe.scaling == "rowwise"
        st = self.state if delayed else None

        def cast() -> Fp8Tensor:
            self.casts += 1
            return fp8_ops.quantize_weight(
                weight, fmt, None if st is None else st.scale[1],
                None if st is None else st.slots()["amax_w"], rowwise=rowwise,
                margin=recipe.margin)

        if torch.compiler.is_compiling():
            return cast()
        key = (weight._version, weight.data_ptr(), weight.dtype, recipe.scaling, fmt,
               recipe.margin, delayed)
        if self._cache is None or self._cache_key != key:
            self._cache = cast()
            self._cache_key = key
        return self._cache

    def forward(self, x: Tensor) -> Tensor:
        """The layer's forward: FP8 unless a region turns it off."""
        region = _regions[-1] if _regions else None
        module = self.module
        if region is not None and not region.enabled:
            return self.plain_forward(x)
        recipe = self.recipe if region is None or region.recipe is None else region.recipe
        weight, bias = module.weight, module.bias
        dtype: torch.dtype = self.half_dtype if self.half_dtype is not None else weight.dtype
        if x.dtype != dtype and x.dtype in (torch.float32, torch.float16, torch.bfloat16):
            x = x.to(dtype)
        fmt = Fp8Format(recipe.format)
        delayed = recipe.scaling == "delayed" and self.state is not None
        emulate = recipe.emulate or self.recipe.emulate
        wq = self._weight_fp8(weight, fmt, recipe, delayed)
        kwargs: dict[str, Any] = {}
        if delayed:
            st = self.state
            assert st is not None
            slots = st.slots()
            kwargs = dict(x_scale=st.scale[0], grad_scale=st.scale[2], amax_x=slots["amax_x"],
                          amax_grad=slots["amax_grad"])
        scaling = "delayed" if delayed else (
            "rowwise" if recipe.scaling == "rowwise" else "tensorwise")
        if torch.compiler.is_compiling():
            # O1's wrappers lower to plain casts under torch.compile, with the same decisions:
            # none of them touches the FP8 path's tensors (FP8 codes, fp32 amaxes and scales),
            # and switching them off would break the graph.
            return fp8_ops.fp8_linear(x, weight, bias, fmt=fmt, scaling=scaling, weight_fp8=wq,
                                      emulate=emulate, margin=recipe.margin, **kwargs)
        with self.no_casts():
            return fp8_ops.fp8_linear(x, weight, bias, fmt=fmt, scaling=scaling, weight_fp8=wq,
                                      emulate=emulate, margin=recipe.margin, **kwargs)

    def plain_forward(self, x: Tensor) -> Tensor:
        """The forward the layer had: at the level's precision."""
        saved = self._saved_forward
        if saved is not _MISSING:
            return saved(x)
        return type(self.module).forward(self.module, x)

    def install(self) -> None:
        """Give the module its FP8 forward, as an instance attribute."""
        module = self.module
        self._saved_forward = module.__dict__.get("forward", _MISSING)
        layer = self

        def forward(self: nn.Module, x: Tensor) -> Tensor:
            return layer.forward(x)

        module.__dict__["forward"] = types.MethodType(forward, module)

    def uninstall(self) -> None:
        """Put back the forward the instance had (or none of its own): the very same object."""
        module = self.module
        if self._saved_forward is _MISSING:
            module.__dict__.pop("forward", None)
        else:
            module.__dict__["forward"] = self._saved_forward
        self.clear_cache()


def step_flag(optimizer: torch.optim.Optimizer) -> Tensor | None:
    """The overflow flag (a device tensor) that the running ``step()`` of ``optimizer`` reads.

    torch's fused optimizers read ``optimizer.found_inf`` (``torch.amp.GradScaler``'s
    protocol), amp_patch's fused optimizers their step inputs' ``found_inf``.
    Any other optimizer is not called at all on a skipped step.
    """
    flag = getattr(optimizer, "found_inf", None)
    if isinstance(flag, Tensor):
        return flag
    inputs = getattr(optimizer, "_inputs", None)
    flag = getattr(inputs, "found_inf", None)
    return flag if isinstance(flag, Tensor) else None


def _update_states(states: list[Fp8LinearState], flag: Tensor | None) -> None:
    if flag is None:
        for st in states:
            st.update_()
        return
    for st in states:
        skip = flag.reshape(()).to(st.scale.device) != 0
        history, scale = st.history.clone(), st.scale.clone()
        st.update_()
        st.history.copy_(torch.where(skip, history, st.history))
        st.scale.copy_(torch.where(skip, scale, st.scale))


class Fp8Conversion:
    """What :func:`install` did: the plan, the layers, and their delayed states' checkpoint.

    Args:
        plan (Fp8Plan): which layers.
        layers (list of Fp8Layer): the converted layers, in the plan's order.
    """

    def __init__(self, plan: Fp8Plan, layers: list[Fp8Layer]) -> None:
        self.plan = plan
        self.layers = layers

    @property
    def casts(self) -> int:
        """Weight casts made so far, over all layers."""
        return sum(layer.casts for layer in self.layers)

    def state_dict(self) -> dict[str, Tensor]:
        """The delayed states (copies), flat: ``{"<layer>.history": ..., "<layer>.scale": ...}``."""
        out: dict[str, Tensor] = {}
        for layer in self.layers:
            if layer.state is not None:
                for key, value in layer.state.state_dict().items():
                    out[f"{layer.name}.{key}"] = value
        return out

    def check_state_dict(self, state: Any) -> None:
        """Raise unless :meth:`load_state_dict` would take ``state`` whole.

        Raises:
            TypeError: ``state`` is not a dict.
            ValueError: its layers or shapes differ from this session's.
        """
        if not isinstance(state, dict):
            raise TypeError(f"the amp state's 'fp8' entry must be a dict, got "
                            f"{type(state).__name__}")
        mine = self.state_dict()
        if set(state) != set(mine):
            missing, extra = sorted(set(mine) - set(state)), sorted(set(state) - set(mine))
            raise ValueError(
                "the checkpoint's FP8 state does not fit this session's converted layers: "
                f"missing {missing or 'nothing'}, unexpected {extra or 'nothing'} (were the same "
                "fp8 recipe and fp8_modules passed to initialize?)")
        for key, value in state.items():
            if not isinstance(value, Tensor) or value.shape != mine[key].shape:
                got = tuple(value.shape) if isinstance(value, Tensor) else type(value).__name__
                raise ValueError(f"FP8 state {key!r}: expected a tensor of shape "
                                 f"{tuple(mine[key].shape)}, got {got} (amax_history_len differs?)")

    def load_state_dict(self, state: dict[str, Tensor]) -> None:
        """Load :meth:`state_dict`'s tensors bitwise (checked first: a bad one changes nothing)."""
        self.check_state_dict(state)
        for layer in self.layers:
            if layer.state is not None:
                layer.state.load_state_dict({"history": state[f"{layer.name}.history"],
                                             "scale": state[f"{layer.name}.scale"]})
            layer.clear_cache()

    def live_tensors(self) -> dict[str, Tensor]:
        """The delayed states' own tensors under :meth:`state_dict`'s keys, for a load in place."""
        out: dict[str, Tensor] = {}
        for layer in self.layers:
            if layer.state is not None:
                out[f"{layer.name}.history"] = layer.state.history
                out[f"{layer.name}.scale"] = layer.state.scale
        return out


def _check_devices(recipe: Fp8Recipe, devices: Iterable[torch.device]) -> None:
    if recipe.emulate:
        logger.info("amp_patch FP8: emulate=True was chosen: the FP8 GEMMs run as the fp32 "
                    "reference (quantize, dequantize, matmul in fp32), no faster than fp32")
        return
    for device in devices:
        fp8_ops.require_fp8_gemm(device)
        if recipe.scaling == "rowwise" and not fp8_ops.fp8_gemm_available(device, rowwise=True):
            raise RuntimeError(
                f"amp_patch FP8: torch {torch.__version__}'s torch._scaled_mm on {device} takes no "
                "rowwise scales (the CPU kernel does from torch 2.13 on); choose "
                "Fp8Recipe(scaling='rowwise', format='e4m3', emulate=True), or 'tensorwise'")


def install(props: Properties, models: list[nn.Module], optimizers: list[torch.optim.Optimizer],
            on_close: Callable[..., None], *,
            no_casts: Callable[[], ContextManager[Any]]) -> Fp8Conversion | None:
    """Convert the eligible layers of ``models`` for ``props.fp8_recipe``; None without FP8.

    Call it after the models are cast (it reads the weights' dtypes) and before
    the optimizers are processed (it maps each weight to its optimizer).

    Args:
        props (Properties): the session's settings.
        models (list of nn.Module): the models.
        optimizers (list of torch.optim.Optimizer): the torch optimizers themselves
            (a LARC's inner one); each gets a step post-hook that updates the
            delayed states of its layers and drops their weight casts.
        on_close (callable): the session's ``on_close``.
        no_casts (callable): a context manager with O1's casts off, around the
            FP8 forward (its GEMMs must not meet O1's half casts).

    Returns:
        Fp8Conversion or None.

    Raises:
        RuntimeError: no FP8 GEMM on the weights' device (see
            :func:`~amp_patch.ops.fp8_ops.require_fp8_gemm`), unless ``emulate``.
        ValueError: an ``fp8_modules`` name that matches no ``nn.Linear``.

    Example::

        >>> from contextlib import nullcontext
        >>> from amp_patch.settings.properties import Properties
        >>> props = Properties.from_opt_level("O0", torch.bfloat16,
        ...                                   fp8=Fp8Recipe(min_features=16))
        >>> net = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 10))
        >>> undo = []
        >>> conv = install(props, [net], [], lambda what, fn: undo.append(fn), no_casts=nullcontext)
        >>> conv.plan.converted, "forward" in net[0].__dict__
        (('0',), True)
        >>> net(torch.randn(4, 32)).dtype
        torch.float32
        >>> for fn in reversed(undo): fn()
        >>> "forward" in net[0].__dict__
        False
    """
    recipe = props.fp8_recipe
    if recipe is None:
        return None
    plan = select(models, recipe)
    logger.info("%s", plan.describe())
    by_name = dict(_linears(models))
    modules = [by_name[name] for name in plan.converted]
    _check_devices(recipe, {m.weight.device for m in modules})
    half = props.half_dtype if props.patch_torch_functions else None
    layers = []
    for name, module in zip(plan.converted, modules):
        state = None
        if recipe.scaling == "delayed":
            state = Fp8LinearState(Fp8Format(recipe.format), recipe.amax_history_len,
                                   recipe.amax_compute_algo,  # type: ignore[arg-type]
                                   recipe.margin, device=module.weight.device)
        layers.append(Fp8Layer(name, module, recipe, state, half, no_casts))
    conversion = Fp8Conversion(plan, layers)
    for layer in layers:
        layer.install()
        on_close(f"the FP8 forward of {layer.name}", layer.uninstall)
    _hook_optimizers(layers, optimizers, on_close)
    return conversion


def _hook_optimizers(layers: list[Fp8Layer], optimizers: list[torch.optim.Optimizer],
                     on_close: Callable[..., None]) -> None:
    """One step post-hook per optimizer: update its layers' delayed states, drop the casts."""
    if not optimizers:
        if any(layer.state is not None for layer in layers):
            logger.info("amp_patch FP8: no optimizer was passed to initialize, so the delayed "
                        "scales are never updated (they stay at their initial or loaded values)")
        return
    owner: dict[int, int] = {}
    for index, opt in enumerate(optimizers):
        for group in opt.param_groups:
            for p in group["params"]:
                owner.setdefault(id(p), index)
    mine: list[list[Fp8Layer]] = [[] for _ in optimizers]
    for layer in layers:
        # A layer whose weight no optimizer steps is updated with the first one's steps.
        mine[owner.get(id(layer.module.weight), 0)].append(layer)
    for opt, own in zip(optimizers, mine):
        if not own:
            continue
        states = [layer.state for layer in own if layer.state is not None]

        def hook(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any,
                 states: list[Fp8LinearState] = states, own: list[Fp8Layer] = own) -> None:
            if states:
                _update_states(states, step_flag(optimizer))
            for layer in own:
                layer.clear_cache()

        handle = opt.register_step_post_hook(hook)
        on_close(f"the FP8 step hook of {type(opt).__name__}", handle.remove)
