"""Transformer Engine's PyTorch spelling, served by amp_patch for ``amp-patch run``.

A script written for Transformer Engine (TE) imports ``transformer_engine.pytorch``
and ``transformer_engine.common.recipe``; under ``amp-patch run`` the import hook
(:mod:`amp_patch.apex_compat.import_hook`) answers both from this module, on the
CPU and on GPUs without TE. What is served:

- :class:`Linear`: an :class:`torch.nn.Linear` that takes TE's constructor
  arguments. Inside an enabled :func:`fp8_autocast` its three GEMMs run in FP8
  through :func:`amp_patch.ops.fp8_ops.fp8_linear`, with the region's recipe;
  outside it, it is a plain linear (and amp's opt levels cast it like any other);
- :class:`LayerNorm` (an :class:`torch.nn.LayerNorm`) and :class:`LayerNormLinear`
  (a LayerNorm, then a :class:`Linear`, with TE's parameter names
  ``layer_norm_weight``, ``layer_norm_bias``, ``weight`` and ``bias``);
- :func:`fp8_autocast` (and TE 2's name for it, :func:`autocast`): the FP8
  region. A script needs no :func:`amp_patch.initialize` for FP8: the region
  alone turns it on for the TE layers it runs;
- :class:`DelayedScaling`, :class:`Float8CurrentScaling` and :class:`Format`,
  TE's recipe classes, which :func:`to_fp8_recipe` turns into amp_patch's
  ``Fp8Recipe``.

Arguments that change nothing on one process (``tp_group``, ``init_method``,
``is_first_microbatch``, ...) are accepted; those that ask for what amp_patch
does not do (tensor or sequence parallelism, userbuffers, a custom amax
function) raise :class:`TransformerEngineUnsupported` naming the argument and
what to do instead. Any other TE name fails at import (the hook's message
names what to use instead).

How the recipes map (docs/fp8.md):

- ``DelayedScaling``: ``scaling="delayed"``: per-tensor scales from an amax
  history of ``amax_history_len`` iterations, ``"max"`` or ``"most_recent"``,
  with ``margin``; ``Format.HYBRID`` is E4M3 forward and E5M2 backward,
  ``Format.E4M3`` E4M3 everywhere. ``Format.E5M2`` everywhere is refused:
  FP8 GEMMs need one E4M3 operand;
- ``Float8CurrentScaling``: ``scaling="tensorwise"``, each tensor's own amax.

Each :class:`Linear` keeps its delayed-scaling state (scales and amax
histories of x, W and dY, :class:`~amp_patch.ops.fp8_ops.Fp8LinearState`)
itself. At the start of each FP8 forward in training, the state takes the
previous iteration's amaxes into the history and computes the scales this
iteration uses; the first iteration's scales are 1.0.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import logging
from typing import Any, Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from amp_patch.casting import fp8 as _fp8_casting
from amp_patch.frontend import fp8 as _amp_fp8
from amp_patch.ops import fp8_ops
from amp_patch.settings.fp8 import Fp8Recipe

__all__ = ["TransformerEngineUnsupported", "Format", "DelayedScaling", "Float8CurrentScaling",
           "Recipe", "to_fp8_recipe", "fp8_autocast", "autocast", "is_fp8_enabled",
           "Linear", "LayerNorm", "LayerNormLinear"]

logger = logging.getLogger("amp_patch")


class TransformerEngineUnsupported(ValueError):
    """A Transformer Engine argument or value that amp_patch does not serve."""


def _refuse(what: str, instead: str) -> TransformerEngineUnsupported:
    return TransformerEngineUnsupported(
        f"{what} is not supported by amp_patch's Transformer Engine layer (amp-patch run); "
        f"{instead}. See docs/fp8.md.")


# ---------------------------------------------------------------------------------------
# transformer_engine.common.recipe


class Format(enum.Enum):
    """TE's FP8 formats: which format holds which tensor."""

    #: E4M3 everywhere.
    E4M3 = "e4m3"
    #: E5M2 everywhere: refused when a recipe is used (an FP8 GEMM needs one E4M3 operand).
    E5M2 = "e5m2"
    #: E4M3 for activations and weights, E5M2 for gradients.
    HYBRID = "hybrid"


def _format(fmt: Any) -> str:
    if isinstance(fmt, str) and fmt.lower() in ("hybrid", "e4m3"):
        return fmt.lower()
    if fmt is Format.HYBRID or fmt is Format.E4M3:
        return fmt.value
    if fmt is Format.E5M2 or fmt == "e5m2":
        raise _refuse("fp8_format=Format.E5M2 (E5M2 for every tensor)",
                      "use Format.HYBRID (E5M2 for gradients only) or Format.E4M3: an FP8 "
                      "GEMM takes at most one E5M2 operand")
    raise TypeError(f"fp8_format must be a Format (HYBRID, E4M3), got {fmt!r}")


class Recipe:
    """TE's base class of its recipes."""


@dataclasses.dataclass
class DelayedScaling(Recipe):
    """TE's delayed-scaling recipe: per-tensor scales from a history of past amaxes.

    Args:
        margin (int, optional): powers of two of headroom below the format's max.
        fp8_format (Format, optional): ``Format.HYBRID`` (default) or ``Format.E4M3``.
        amax_history_len (int, optional): iterations of the history (TE's default 1024).
        amax_compute_algo (str, optional): ``"max"`` (default) or ``"most_recent"``.
        scaling_factor_compute_algo: must be None (a custom function is refused).
        reduce_amax (bool, optional): accepted; on one process there is nothing to reduce.
        fp8_dpa, fp8_mha (bool, optional): must be False (FP8 attention is not served).

    Example::

        >>> r = DelayedScaling(fp8_format=Format.HYBRID, amax_history_len=16,
        ...                    amax_compute_algo="max")
        >>> to_fp8_recipe(r).scaling
        'delayed'
    """

    margin: int = 0
    fp8_format: Format = Format.HYBRID
    amax_history_len: int = 1024
    amax_compute_algo: Any = "max"
    scaling_factor_compute_algo: Callable[..., Any] | None = None
    reduce_amax: bool = True
    fp8_dpa: bool = False
    fp8_mha: bool = False
    interval: int | None = None

    def __post_init__(self) -> None:
        _format(self.fp8_format)
        if callable(self.amax_compute_algo) or self.amax_compute_algo not in ("max",
                                                                             "most_recent"):
            raise _refuse(f"amax_compute_algo={self.amax_compute_algo!r}",
                          "use 'max' or 'most_recent'")
        if self.scaling_factor_compute_algo is not None:
            raise _refuse("a custom scaling_factor_compute_algo",
                          "leave it None: the scale is fp8_max / amax / 2**margin")
        if self.fp8_dpa or self.fp8_mha:
            raise _refuse("fp8_dpa / fp8_mha (FP8 attention)",
                          "leave them False; attention runs at the opt level's precision")
        if self.amax_history_len < 1:
            raise ValueError(f"amax_history_len must be >= 1, got {self.amax_history_len}")


@dataclasses.dataclass
class Float8CurrentScaling(Recipe):
    """TE's current-scaling recipe: each tensor scaled by its own amax (amp_patch's tensorwise).

    Args:
        fp8_format (Format, optional): ``Format.HYBRID`` (default) or ``Format.E4M3``.
    """

    fp8_format: Format = Format.HYBRID

    def __post_init__(self) -> None:
        _format(self.fp8_format)


def to_fp8_recipe(recipe: Any = None) -> Any:
    """amp_patch's ``Fp8Recipe`` for a TE recipe (None: TE's default, ``DelayedScaling()``).

    An amp_patch recipe, or its names (``"tensorwise"``, ``"delayed"``,
    ``"rowwise"``), pass through.

    Raises:
        TypeError: not a recipe.
    """
    cls = Fp8Recipe
    if recipe is None:
        recipe = DelayedScaling()
    if isinstance(recipe, DelayedScaling):
        return cls(scaling="delayed", format=_format(recipe.fp8_format),
                   amax_history_len=recipe.amax_history_len,
                   amax_compute_algo=recipe.amax_compute_algo, margin=recipe.margin)
    if isinstance(recipe, Float8CurrentScaling):
        return cls(scaling="tensorwise", format=_format(recipe.fp8_format))
    if isinstance(recipe, (str, Fp8Recipe)):
        return Fp8Recipe.from_arg(recipe)
    raise TypeError(f"fp8_recipe must be a DelayedScaling, a Float8CurrentScaling or an "
                    f"amp_patch Fp8Recipe, got {type(recipe).__name__}")


# ---------------------------------------------------------------------------------------
# The FP8 region

def is_fp8_enabled() -> bool:
    """Whether the innermost FP8 region (TE's or amp's ``fp8_autocast``) is enabled."""
    region = _fp8_casting.current_region()
    return bool(region and region[0])


def _region_recipe() -> Fp8Recipe | None:
    """The recipe TE's layers run with here: the innermost region's, else the live session's
    (``amp.fp8_autocast()`` with no recipe inside ``initialize(fp8=...)``), else TE's default;
    None outside every region or in a disabled one."""
    region = _fp8_casting.current_region()
    if region is None or not region[0]:
        return None
    if region[1] is not None:
        return region[1]
    plan = _amp_fp8.fp8_plan()
    return plan.recipe if plan is not None else to_fp8_recipe(None)


@contextlib.contextmanager
def fp8_autocast(enabled: bool = True, calibrating: bool = False, fp8_recipe: Any = None,
                 fp8_group: Any = None, _graph: bool = False) -> Iterator[None]:
    """TE's FP8 region: :class:`Linear` layers run their GEMMs in FP8 inside it when enabled.

    It is :func:`amp_patch.fp8_autocast` with the recipe converted
    (:func:`to_fp8_recipe`): without :func:`amp_patch.initialize` the region
    alone turns FP8 on for the TE layers; inside an amp session initialized with
    ``fp8=``, the layers amp converted follow it too. Regions nest, TE's and
    amp's alike: the innermost wins (``enabled=False`` inside turns FP8 off).

    Args:
        enabled (bool, optional): FP8 on (default) or off in the region.
        calibrating (bool, optional): must be False (calibration is not served).
        fp8_recipe (optional): :class:`DelayedScaling` (default: ``DelayedScaling()``),
            :class:`Float8CurrentScaling`, or an amp_patch ``Fp8Recipe``.
        fp8_group (optional): accepted; amaxes are not reduced across ranks, each
            rank keeps its own scales (logged once).

    Example::

        >>> layer = Linear(32, 16, device="cpu")
        >>> with fp8_autocast(enabled=True, fp8_recipe=DelayedScaling(amax_history_len=4)):
        ...     y = layer(torch.randn(8, 32))
    """
    if calibrating:
        raise _refuse("fp8_autocast(calibrating=True)",
                      "train in FP8 from the start, or run the calibration steps without FP8")
    if fp8_group is not None:
        _warn_once("fp8_group", "fp8_autocast(fp8_group=...): amp_patch does not reduce FP8 "
                   "amaxes across ranks; each rank keeps its own scales")
    recipe = to_fp8_recipe(fp8_recipe) if enabled else None
    with _amp_fp8.fp8_autocast(enabled=bool(enabled), recipe=recipe):
        yield


@contextlib.contextmanager
def autocast(enabled: bool = True, calibrating: bool = False, recipe: Any = None,
             amax_reduction_group: Any = None, _graph: bool = False) -> Iterator[None]:
    """TE 2's name for :func:`fp8_autocast` (``recipe=`` for ``fp8_recipe=``)."""
    with fp8_autocast(enabled=enabled, calibrating=calibrating, fp8_recipe=recipe,
                      fp8_group=amax_reduction_group):
        yield


_WARNED: set[str] = set()


def _warn_once(key: str, message: str) -> None:
    if key not in _WARNED:
        _WARNED.add(key)
        logger.warning(message)


# ---------------------------------------------------------------------------------------
# transformer_engine.pytorch modules

#: Keyword arguments of TE's modules accepted at these values (or any value, for ``None``),
#: with what happens to the others.
_PARALLEL = "tensor and sequence parallelism are not served: use torch.distributed.tensor.parallel"
_ACCEPTED: dict[str, tuple[Any, str]] = {
    "init_method": (None, ""),  # honoured: called on the weight
    "get_rng_state_tracker": (None, ""),
    "rng_tracker_name": (None, ""),
    "tp_group": (None, ""),  # one rank of tensor parallelism: nothing to do
    "name": (None, ""),
    "is_first_microbatch": (None, ""),
    "tp_size": (1, _PARALLEL),
    "sequence_parallel": (False, _PARALLEL),
    "parallel_mode": (None, _PARALLEL),
    "fuse_wgrad_accumulation": (False, "autograd accumulates weight gradients in .grad"),
    "parameters_split": (None, "split the output of one Linear with torch.split"),
    "ub_overlap_ag": (False, "communication overlap (userbuffers) is not served"),
    "ub_overlap_rs": (False, "communication overlap (userbuffers) is not served"),
    "ub_overlap_rs_dgrad": (False, "communication overlap (userbuffers) is not served"),
    "ub_bulk_dgrad": (False, "communication overlap (userbuffers) is not served"),
    "ub_bulk_wgrad": (False, "communication overlap (userbuffers) is not served"),
    "ub_overlap_ag_fprop": (False, "communication overlap (userbuffers) is not served"),
    "ub_name": (None, "communication overlap (userbuffers) is not served"),
    "delay_wgrad_compute": (False, "autograd computes the weight gradient in the backward"),
    "save_original_input": (False, ""),
}
_ANY = {"init_method", "get_rng_state_tracker", "rng_tracker_name", "tp_group", "name",
        "is_first_microbatch", "save_original_input"}


def _check_kwargs(owner: str, kwargs: dict[str, Any]) -> Callable[..., Any] | None:
    """Accept TE's arguments that change nothing here; refuse the others. Returns init_method."""
    for key, value in kwargs.items():
        if key not in _ACCEPTED:
            raise TypeError(f"{owner}() got an unexpected keyword argument {key!r} (amp_patch "
                            f"serves TE's arguments: in_features, out_features, bias, "
                            f"params_dtype, device, and {', '.join(sorted(_ACCEPTED))})")
        default, instead = _ACCEPTED[key]
        if key not in _ANY and value != default:
            raise _refuse(f"{owner}({key}={value!r})", instead)
    return kwargs.get("init_method")


def _device(device: Any) -> torch.device:
    # TE's default is the current CUDA device; amp_patch's default is CUDA where there is one.
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(device)


class _Fp8Linear:
    """The FP8 path of a TE linear: its delayed state, the device check, the call to the op."""

    def __init__(self) -> None:
        self.state: fp8_ops.Fp8LinearState | None = None
        self.key: tuple[Any, ...] | None = None
        self.checked: set[torch.device] = set()

    def __call__(self, owner: nn.Module, x: torch.Tensor, weight: torch.Tensor,
                 bias: torch.Tensor | None, recipe: Any) -> torch.Tensor:
        n, k = weight.shape
        if n % 16 or k % 16:
            raise ValueError(f"{type(owner).__name__}(in_features={k}, out_features={n}) inside "
                             "fp8_autocast: FP8 GEMMs need both dims to be multiples of 16, as "
                             "Transformer Engine's do; run this layer outside the region, or pad it")
        emulate = bool(getattr(recipe, "emulate", False))
        if not emulate and x.device not in self.checked:
            fp8_ops.require_fp8_gemm(x.device)
            self.checked.add(x.device)
        if x.device.type in ("cpu", "cuda") and torch.is_autocast_enabled(x.device.type):
            x = x.to(torch.get_autocast_dtype(x.device.type))
        fmt = fp8_ops.Fp8Format(recipe.format)
        scaling = recipe.scaling
        if scaling == "rowwise":
            return fp8_ops.fp8_linear(x, weight, bias, fmt=fp8_ops.Fp8Format.E4M3,
                                      scaling="rowwise", emulate=emulate, margin=recipe.margin)
        if scaling == "tensorwise":
            return fp8_ops.fp8_linear(x, weight, bias, fmt=fmt, emulate=emulate,
                                      margin=recipe.margin)
        key = (fmt, recipe.amax_history_len, recipe.amax_compute_algo, recipe.margin, x.device)
        if self.state is None or self.key != key:
            self.state = fp8_ops.Fp8LinearState(fmt, recipe.amax_history_len,
                                                recipe.amax_compute_algo, recipe.margin,
                                                device=x.device)
            self.key = key
        elif torch.is_grad_enabled():
            # The previous iteration's amaxes (x and W here, dY in its backward) join the history.
            self.state.update_()
        st = self.state
        slots = st.slots()
        wq = fp8_ops.quantize_weight(weight, fmt, st.scale[1], slots["amax_w"],
                                     margin=recipe.margin)
        return fp8_ops.fp8_linear(x, weight, bias, fmt=fmt, scaling="delayed",
                                  x_scale=st.scale[0], grad_scale=st.scale[2], weight_fp8=wq,
                                  amax_x=slots["amax_x"], amax_grad=slots["amax_grad"],
                                  emulate=emulate, margin=recipe.margin)


def _linear(owner: nn.Module, fp8: _Fp8Linear, x: torch.Tensor, weight: torch.Tensor,
            bias: torch.Tensor | None) -> torch.Tensor:
    recipe = _region_recipe()
    if recipe is None:
        return F.linear(x, weight, bias)
    return fp8(owner, x, weight, bias, recipe)


class Linear(nn.Linear):
    """TE's ``Linear``: a :class:`torch.nn.Linear` whose GEMMs run in FP8 inside :func:`fp8_autocast`.

    Args:
        in_features (int): size of each input sample.
        out_features (int): size of each output sample.
        bias (bool, optional): learn an additive bias. Default: True.
        params_dtype (torch.dtype, optional): the parameters' dtype (default: torch's default).
        device (optional): where the parameters live (default: CUDA where there is a
            GPU, else the CPU).
        return_bias (bool, optional): return ``(output, bias)`` with the bias not added,
            as TE does.
        init_method (callable, optional): called on the weight, as TE does.

    Others of TE's keyword arguments are accepted at their one-process values and
    refused otherwise (:class:`TransformerEngineUnsupported`).

    Example::

        >>> layer = Linear(64, 32, device="cpu")
        >>> with fp8_autocast(fp8_recipe=DelayedScaling(amax_history_len=8)):
        ...     layer(torch.randn(4, 64)).shape
        torch.Size([4, 32])
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *,
                 params_dtype: torch.dtype | None = None, device: Any = None,
                 return_bias: bool = False, **kwargs: Any) -> None:
        init_method = _check_kwargs("te.Linear", kwargs)
        super().__init__(in_features, out_features, bias, device=_device(device),
                         dtype=params_dtype)
        self.return_bias = return_bias
        self._amp_patch_fp8 = _Fp8Linear()
        if init_method is not None:
            with torch.no_grad():
                init_method(self.weight)

    def forward(self, inp: torch.Tensor, is_first_microbatch: bool | None = None,
                fp8_output: bool = False) -> Any:
        """``inp @ weight.T + bias``, in FP8 inside an enabled :func:`fp8_autocast`."""
        if fp8_output:
            raise _refuse("fp8_output=True", "the output is in the input's precision")
        bias = None if self.return_bias else self.bias
        out = _linear(self, self._amp_patch_fp8, inp, self.weight, bias)
        return (out, self.bias) if self.return_bias else out


class LayerNorm(nn.LayerNorm):
    """TE's ``LayerNorm``: :class:`torch.nn.LayerNorm` with TE's constructor arguments.

    Args:
        hidden_size (int): the normalised (last) dim.
        eps (float, optional): default 1e-5.
        params_dtype (torch.dtype, optional): the parameters' dtype.
        zero_centered_gamma (bool, optional): the weight holds ``gamma - 1`` (starts at 0).
        device (optional): see :class:`Linear`.
        sequence_parallel (bool, optional): must be False.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-5, sequence_parallel: bool | None = None,
                 params_dtype: torch.dtype | None = None, zero_centered_gamma: bool = False,
                 device: Any = None, **kwargs: Any) -> None:
        _check_kwargs("te.LayerNorm", {**kwargs, "sequence_parallel": bool(sequence_parallel)})
        super().__init__(hidden_size, eps=eps, device=_device(device), dtype=params_dtype)
        self.zero_centered_gamma = zero_centered_gamma
        if zero_centered_gamma:
            with torch.no_grad():
                self.weight.zero_()

    def forward(self, inp: torch.Tensor) -> torch.Tensor:
        """The layer norm of ``inp`` over its last dim."""
        weight = self.weight + 1 if self.zero_centered_gamma else self.weight
        return F.layer_norm(inp, self.normalized_shape, weight, self.bias, self.eps)


class LayerNormLinear(nn.Module):
    """TE's ``LayerNormLinear``: a layer norm of the input, then a :class:`Linear` (FP8 in the region).

    The parameters carry TE's names: ``layer_norm_weight``, ``layer_norm_bias``
    (absent with ``normalization="RMSNorm"``), ``weight`` and ``bias``.

    Args:
        in_features, out_features (int): as :class:`Linear`.
        eps (float, optional): the norm's epsilon. Default: 1e-5.
        bias (bool, optional): the linear's bias. Default: True.
        normalization (str, optional): ``"LayerNorm"`` (default) or ``"RMSNorm"``.
        return_layernorm_output (bool, optional): return ``(output, normed input)``.
        return_bias (bool, optional): return the bias unadded, as :class:`Linear`.
        params_dtype, device, zero_centered_gamma, init_method: as :class:`Linear`
            and :class:`LayerNorm`.

    Example::

        >>> ln_fc = LayerNormLinear(64, 128, device="cpu")
        >>> sorted(n for n, _ in ln_fc.named_parameters())
        ['bias', 'layer_norm_bias', 'layer_norm_weight', 'weight']
    """

    def __init__(self, in_features: int, out_features: int, eps: float = 1e-5,
                 bias: bool = True, normalization: str = "LayerNorm",
                 return_layernorm_output: bool = False, return_bias: bool = False,
                 params_dtype: torch.dtype | None = None, zero_centered_gamma: bool = False,
                 device: Any = None, **kwargs: Any) -> None:
        super().__init__()
        init_method = _check_kwargs("te.LayerNormLinear", kwargs)
        if normalization not in ("LayerNorm", "RMSNorm"):
            raise ValueError(f"normalization must be 'LayerNorm' or 'RMSNorm', got "
                             f"{normalization!r}")
        dev = _device(device)
        factory = {"device": dev, "dtype": params_dtype}
        self.in_features, self.out_features, self.eps = in_features, out_features, eps
        self.normalization = normalization
        self.zero_centered_gamma = zero_centered_gamma
        self.return_layernorm_output = return_layernorm_output
        self.return_bias = return_bias
        start = torch.zeros if zero_centered_gamma else torch.ones
        self.layer_norm_weight = nn.Parameter(start(in_features, **factory))
        self.layer_norm_bias = (nn.Parameter(torch.zeros(in_features, **factory))
                                if normalization == "LayerNorm" else None)
        # The linear's parameters, initialised as nn.Linear initialises its own.
        ref = nn.Linear(in_features, out_features, bias, **factory)
        self.weight = ref.weight
        self.bias = ref.bias
        self._amp_patch_fp8 = _Fp8Linear()
        if init_method is not None:
            with torch.no_grad():
                init_method(self.weight)

    def _norm(self, inp: torch.Tensor) -> torch.Tensor:
        weight = self.layer_norm_weight + 1 if self.zero_centered_gamma else self.layer_norm_weight
        if self.normalization == "RMSNorm":
            return F.rms_norm(inp, (self.in_features,), weight, self.eps)
        return F.layer_norm(inp, (self.in_features,), weight, self.layer_norm_bias, self.eps)

    def forward(self, inp: torch.Tensor, is_first_microbatch: bool | None = None,
                fp8_output: bool = False) -> Any:
        """The norm, then the linear (FP8 inside an enabled :func:`fp8_autocast`)."""
        if fp8_output:
            raise _refuse("fp8_output=True", "the output is in the input's precision")
        normed = self._norm(inp)
        bias = None if self.return_bias else self.bias
        out = _linear(self, self._amp_patch_fp8, normed, self.weight, bias)
        result: tuple[Any, ...] = (out,)
        if self.return_bias:
            result += (self.bias,)
        if self.return_layernorm_output:
            result += (normed,)
        return result[0] if len(result) == 1 else result

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"normalization={self.normalization}, bias={self.bias is not None}")
