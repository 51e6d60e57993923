"""The validated, frozen properties of a session; the opt levels' presets come from
:mod:`amp_patch.settings.levels`."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from amp_patch.settings import levels as _levels
from amp_patch.settings.dtypes import MASTER_WEIGHT_DTYPES, OPTIMIZER_STATE_NAMES, check_half_dtype
from amp_patch.settings.fp8 import Fp8ModuleFilter, Fp8Recipe, check_fp8_modules
from amp_patch.settings.levels import DYNAMIC

__all__ = ["Properties", "DYNAMIC", "DEFAULT_MAX_CONSECUTIVE_SKIPS",
           "DEFAULT_HOST_READ_INTERVAL", "CPU_HALF_MODES", "check_cpu_half_mode"]

#: Consecutive skipped steps a static loss scale allows before it is an error.
DEFAULT_MAX_CONSECUTIVE_SKIPS = 50
#: Updates after which a sync-free loss scaler reads its device state on the host (to log
#: overflows and raise a collapse): see docs/design.md, "Host syncs".
DEFAULT_HOST_READ_INTERVAL = 100
#: The values of the ``cpu_half_compute`` property (:mod:`amp_patch.patching.cpu_half` acts
#: on them).
CPU_HALF_MODES = ("auto", "native", "emulate")

# cast_model_type: a dtype, None (leave the model alone) or False (no model or input casting).
CastType = torch.dtype | bool | None


def check_cpu_half_mode(value: Any) -> str:
    """``value`` when it is one of :data:`CPU_HALF_MODES`.

    Raises:
        ValueError: otherwise, naming the choices.

    Example::

        >>> check_cpu_half_mode("emulate")
        'emulate'
    """
    if not (isinstance(value, str) and value in CPU_HALF_MODES):
        raise ValueError(
            "cpu_half_compute must be 'auto' (emulate half matmuls where the CPU has no native "
            f"half), 'native' or 'emulate', got {value!r}"
        )
    return value


@dataclass(frozen=True)
class Properties:
    """The resolved settings of one :func:`amp_patch.initialize` call.

    Build it with :meth:`from_opt_level`, which applies an opt level's preset
    and then the caller's overrides. Construction validates the combination and
    raises :class:`ValueError` with the reason when it is not allowed.

    Args:
        opt_level (str): ``"O0"``, ``"O1"``, ``"O2"`` or ``"O3"`` (the letter O).
        half_dtype (torch.dtype): ``torch.float16`` or ``torch.bfloat16``.
        cast_model_type (torch.dtype, None or False): dtype the model is cast
            to; None leaves it; False disables model and input casting.
        patch_torch_functions (bool): install the O1 casting wrappers.
        keep_batchnorm_fp32 (bool or None): keep affine batch norms in fp32
            when the model is cast to half.
        master_weights (bool, str or None): keep fp32 master copies of half
            params (True), or bf16 ones (``"bf16"``: a bf16 param is then its
            own master, stepped with stochastic rounding).
        optimizer_state (str): how the optimizer keeps its state: ``"fp32"``,
            ``"bf16"``, ``"int8"`` or ``"fp8"`` (amp_patch's FusedAdam and
            FusedSGD; see :mod:`amp_patch.optim.fused.state_format`).
        loss_scale (float or str): a static scale, or ``"dynamic"``.
        cast_model_outputs (torch.dtype or None): dtype of model outputs; None
            means fp32 when the model is cast.
        num_losses (int): number of loss scalers.
        verbosity (int): 0 silent, 1 the chosen properties, 2 debug.
        min_loss_scale (float or None): floor of the dynamic scale.
        max_loss_scale (float): ceiling of the dynamic scale.
        max_consecutive_skips (int): a static loss scale cannot shrink, so
            non-finite gradients at every step would skip steps forever; after
            this many consecutive skips of one loss scaler, the next overflow
            raises :class:`~amp_patch.scaler.LossScaleCollapseError`. (A dynamic
            scale is bounded by ``min_loss_scale`` instead.) Default: 50.
        sync_free (bool): the loss scalers update on the device and ``scale_loss``
            reads nothing on the host; the skip of an overflowed step is
            decided on the device where the optimizer can take it (see
            docs/design.md, "Host syncs"). False reads the overflow on the host
            at every ``scale_loss`` exit, as Apex did. Default: True.
        host_read_interval (int): with ``sync_free``, a loss scaler reads its
            state on the host every this many updates, logging the overflows
            since the last read and raising a collapse. Default: 100.
        enabled (bool): False makes amp a no-op.
        cpu_half_compute (str): how half matmuls and convolutions run on the
            CPU: ``"auto"`` emulates them (fp32 compute on fp32 copies of the
            half inputs, outputs rounded to half) exactly where
            :func:`amp_patch.cpu_half_support` reports the host not native;
            ``"native"`` never emulates; ``"emulate"`` always does.
        fp8 (Fp8Recipe or None): run eligible ``nn.Linear`` layers' GEMMs in FP8
            (:mod:`amp_patch.casting.fp8`); ``"tensorwise"``, ``"delayed"`` and
            ``"rowwise"`` become the default :class:`~amp_patch.Fp8Recipe` of
            that scaling. Default: None.
        fp8_modules (None, callable or tuple of str): which layers FP8 converts,
            overriding the recipe's ``modules`` (see :attr:`fp8_recipe`); needs
            ``fp8``. Default: None.

    Example::

        >>> props = Properties.from_opt_level("O2", torch.bfloat16, loss_scale=128.0)
        >>> props.cast_model_type, props.master_weights, props.loss_scale
        (torch.bfloat16, True, 128.0)
        >>> dataclasses.replace(props, opt_level="O5")
        Traceback (most recent call last):
        ...
        ValueError: Unexpected optimization level 'O5'. Options are 'O0', 'O1', 'O2', 'O3'. ...
    """

    opt_level: str = "O1"
    half_dtype: torch.dtype = torch.float16
    cast_model_type: CastType = None
    patch_torch_functions: bool = True
    keep_batchnorm_fp32: bool | None = None
    master_weights: bool | str | None = None
    optimizer_state: str = "fp32"
    loss_scale: float | str = DYNAMIC
    cast_model_outputs: torch.dtype | None = None
    num_losses: int = 1
    verbosity: int = 1
    min_loss_scale: float | None = None
    max_loss_scale: float = 2.0**24
    max_consecutive_skips: int = DEFAULT_MAX_CONSECUTIVE_SKIPS
    sync_free: bool = True
    host_read_interval: int = DEFAULT_HOST_READ_INTERVAL
    enabled: bool = True
    cpu_half_compute: str = "auto"
    fp8: Fp8Recipe | None = None
    fp8_modules: Fp8ModuleFilter = None

    def __post_init__(self) -> None:
        set_ = object.__setattr__  # normalisation of a frozen instance, before anyone sees it
        level = _levels.get(self.opt_level)  # raises for an unknown level, listing them
        check_half_dtype(self.half_dtype)
        check_cpu_half_mode(self.cpu_half_compute)
        set_(self, "fp8", Fp8Recipe.from_arg(self.fp8))
        set_(self, "fp8_modules", check_fp8_modules(self.fp8_modules))
        if self.fp8_modules is not None and self.fp8 is None:
            raise ValueError("fp8_modules chooses the layers FP8 converts, but fp8 is None: pass "
                             "fp8='tensorwise', 'delayed', 'rowwise' or an amp_patch.Fp8Recipe")
        set_(self, "keep_batchnorm_fp32", _parse_optional_bool(self.keep_batchnorm_fp32))
        set_(self, "loss_scale", _parse_loss_scale(self.loss_scale))
        if not (self.cast_model_type is None or self.cast_model_type is False
                or isinstance(self.cast_model_type, torch.dtype)):
            raise ValueError(
                "cast_model_type must be a torch.dtype, None or False, "
                f"got {self.cast_model_type!r}"
            )
        if (isinstance(self.cast_model_type, torch.dtype)
                and not self.cast_model_type.is_floating_point):
            raise ValueError(
                f"cast_model_type must be a floating dtype, got {self.cast_model_type}")
        if self.cast_model_outputs is not None and not (
            isinstance(self.cast_model_outputs, torch.dtype)
            and self.cast_model_outputs.is_floating_point
        ):
            raise ValueError(
                f"cast_model_outputs must be a floating torch.dtype or None, "
                f"got {self.cast_model_outputs!r}"
            )
        if level.patch_torch_functions:  # O1: it patches torch instead of casting the model
            if self.cast_model_type not in (None, False, torch.float32):
                raise ValueError(
                    "O1 inserts casts around torch functions rather than casting the model: "
                    f"cast_model_type must be None, False or torch.float32, not "
                    f"{self.cast_model_type}. Use O2 or O3 to cast the model to half."
                )
            if self.keep_batchnorm_fp32 is not None:
                raise ValueError(
                    "O1 does not cast the model, so keep_batchnorm_fp32 must be None "
                    f"(got {self.keep_batchnorm_fp32!r}). Batch norm already runs in fp32 under O1."
                )
            if self.master_weights is not None:
                raise ValueError(
                    "O1 keeps the model in fp32, so there is nothing to keep master weights of: "
                    f"master_weights must be None (got {self.master_weights!r})."
                )
        elif self.patch_torch_functions:
            raise ValueError(
                f"patch_torch_functions=True is only allowed with O1, not {self.opt_level}: "
                "the other levels cast the model instead of patching torch."
            )
        if self.master_weights is not None and not isinstance(self.master_weights, bool) \
                and self.master_weights not in MASTER_WEIGHT_DTYPES:
            raise ValueError(
                f"master_weights must be True, False, None or "
                f"{' or '.join(map(repr, MASTER_WEIGHT_DTYPES))}, got {self.master_weights!r}")
        if self.optimizer_state not in OPTIMIZER_STATE_NAMES:
            raise ValueError(
                f"optimizer_state must be one of {', '.join(map(repr, OPTIMIZER_STATE_NAMES))}, "
                f"got {self.optimizer_state!r}")
        if not isinstance(self.num_losses, int) or self.num_losses < 1:
            raise ValueError(f"num_losses must be a positive int, got {self.num_losses!r}")
        if not (isinstance(self.max_consecutive_skips, int) and not isinstance(
                self.max_consecutive_skips, bool) and self.max_consecutive_skips >= 1):
            raise ValueError(
                f"max_consecutive_skips must be a positive int, got {self.max_consecutive_skips!r}"
            )
        if not isinstance(self.sync_free, bool):
            raise ValueError(f"sync_free must be True or False, got {self.sync_free!r}")
        if not (isinstance(self.host_read_interval, int) and not isinstance(
                self.host_read_interval, bool) and self.host_read_interval >= 1):
            raise ValueError(
                f"host_read_interval must be a positive int, got {self.host_read_interval!r}")
        if not (isinstance(self.max_loss_scale, (int, float)) and self.max_loss_scale > 0):
            raise ValueError(
                f"max_loss_scale must be a positive number, got {self.max_loss_scale!r}")
        set_(self, "max_loss_scale", float(self.max_loss_scale))
        if self.min_loss_scale is not None:
            if not (isinstance(self.min_loss_scale, (int, float)) and self.min_loss_scale > 0):
                raise ValueError(
                    f"min_loss_scale must be a positive number or None, got {self.min_loss_scale!r}"
                )
            if self.min_loss_scale > self.max_loss_scale:
                raise ValueError(
                    f"min_loss_scale ({self.min_loss_scale}) is above max_loss_scale "
                    f"({self.max_loss_scale})"
                )
            set_(self, "min_loss_scale", float(self.min_loss_scale))

    @classmethod
    def from_opt_level(
        cls, opt_level: str, half_dtype: torch.dtype, **overrides: Any
    ) -> "Properties":
        """Apply an opt level's preset, then the overrides that are not None.

        Args:
            opt_level (str): ``"O0"`` to ``"O3"``.
            half_dtype (torch.dtype): what "half" means for this session.
            **overrides: any field of :class:`Properties`; None keeps the preset.

        Returns:
            Properties: the validated settings.

        Example::

            >>> Properties.from_opt_level("O2", torch.bfloat16).loss_scale
            1.0
        """
        preset = _levels.get(opt_level).preset(half_dtype)
        unknown = set(overrides) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise TypeError(f"unknown amp properties: {sorted(unknown)}")
        preset.update({k: v for k, v in overrides.items() if v is not None})
        return cls(opt_level=opt_level, half_dtype=half_dtype, **preset)

    @property
    def dynamic_loss_scale(self) -> bool:
        """True when the loss scale is dynamic."""
        return self.loss_scale == DYNAMIC

    @property
    def casts_model(self) -> bool:
        """True when the model (and its floating inputs) are cast to a dtype."""
        return isinstance(self.cast_model_type, torch.dtype)

    @property
    def master_dtype(self) -> torch.dtype | None:
        """The dtype of the master weights (None without them)."""
        if not self.master_weights:
            return None
        return MASTER_WEIGHT_DTYPES.get(self.master_weights, torch.float32)  # type: ignore[arg-type]

    @property
    def fp8_recipe(self) -> Fp8Recipe | None:
        """The FP8 recipe in effect: :attr:`fp8` with :attr:`fp8_modules` as its filter."""
        if self.fp8 is None or self.fp8_modules is None:
            return self.fp8
        return self.fp8.with_modules(self.fp8_modules)

    @property
    def skips_unscale(self) -> bool:
        """True for the fast path: a static scale of 1.0 and no master weights."""
        return self.loss_scale == 1.0 and not self.master_weights

    def describe(self) -> str:
        """A multi-line, human-readable account of the settings, for logging."""
        lines = [f"Selected optimization level {self.opt_level} (half dtype {self.half_dtype})"]
        for name in ("enabled", "opt_level", "cast_model_type", "patch_torch_functions",
                     "keep_batchnorm_fp32", "master_weights", "optimizer_state", "loss_scale",
                     "cpu_half_compute"):
            lines.append(f"  {name:<22}: {getattr(self, name)}")
        if self.fp8_recipe is not None:
            lines.append(f"  {'fp8':<22}: {self.fp8_recipe.describe()}")
        return "\n".join(lines)


def _parse_optional_bool(value: Any) -> bool | None:
    if value is None or isinstance(value, bool):
        return value
    if value in ("True", "False"):
        return value == "True"
    raise ValueError(
        f"keep_batchnorm_fp32 must be True, False, 'True', 'False' or None, got {value!r}")


def _parse_loss_scale(value: Any) -> float | str:
    if value == DYNAMIC:
        return DYNAMIC
    try:
        scale = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"loss_scale must be 'dynamic' or a number, got {value!r}") from None
    if not scale > 0 or scale == float("inf"):
        raise ValueError(f"loss_scale must be a positive finite number, got {value!r}")
    return scale
