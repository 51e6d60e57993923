"""The FP8 recipe: how :func:`amp_patch.initialize`'s ``fp8=`` runs eligible ``nn.Linear`` layers.

A frozen, validated dataclass, as :class:`~amp_patch.settings.properties.Properties`
is. The maths it names (formats, amax histories, margins) lives in
:mod:`amp_patch.ops.fp8_ops`; which layers it converts, and how, in
:mod:`amp_patch.casting.fp8`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable

from torch import nn

__all__ = ["Fp8Recipe", "Fp8ModuleFilter", "SCALINGS", "FORMATS", "AMAX_COMPUTE_ALGOS",
           "DEFAULT_MIN_FEATURES", "check_fp8_modules"]

#: The values of :attr:`Fp8Recipe.scaling`.
SCALINGS = ("tensorwise", "delayed", "rowwise")
#: The values of :attr:`Fp8Recipe.format`.
FORMATS = ("hybrid", "e4m3")
#: The values of :attr:`Fp8Recipe.amax_compute_algo`.
AMAX_COMPUTE_ALGOS = ("max", "most_recent")
#: The default filter's size rule: a layer gains from FP8 only when both of its dims are at
#: least this. Until measured on a GPU it follows published anchors: a 1024x2048x1024 GEMM
#: ran at 0.80x bf16 in FP8, Llama-8B's 4096-wide layers at 1.25x.
DEFAULT_MIN_FEATURES = 2048

#: What ``modules`` / ``fp8_modules`` take: None (the default filter), a callable
#: ``(name, linear) -> bool``, or names (exact or fnmatch patterns) of the layers to convert.
Fp8ModuleFilter = Callable[[str, nn.Linear], bool] | tuple[str, ...] | None


def check_fp8_modules(value: Any, field: str = "fp8_modules") -> Fp8ModuleFilter:
    """``value`` as a module filter: None, a callable, or a tuple of names (a str is one name).

    Raises:
        ValueError: for anything else, or an empty name.

    Example::

        >>> check_fp8_modules(["mlp.*", "head"])
        ('mlp.*', 'head')
        >>> check_fp8_modules("encoder.0")
        ('encoder.0',)
    """
    if value is None or callable(value):
        return value
    names = (value,) if isinstance(value, str) else value
    if isinstance(names, (list, tuple)) and names and all(
            isinstance(n, str) and n for n in names):
        return tuple(names)
    raise ValueError(
        f"{field} must be None (the default filter), a callable (name, nn.Linear) -> bool, or "
        f"a non-empty list of module names (exact or fnmatch patterns such as 'blocks.*.mlp.*'); "
        f"got {value!r}")


def _check_int(name: str, value: Any, low: int) -> None:
    if not (isinstance(value, int) and not isinstance(value, bool) and value >= low):
        raise ValueError(f"Fp8Recipe.{name} must be an int >= {low}, got {value!r}")


def _check_choice(name: str, value: Any, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"Fp8Recipe.{name} must be one of {', '.join(map(repr, allowed))}, "
                         f"got {value!r}")


@dataclass(frozen=True)
class Fp8Recipe:
    """How eligible ``nn.Linear`` layers run their three GEMMs in FP8.

    Args:
        scaling (str): ``"tensorwise"`` (default: each tensor scaled by its own
            current amax), ``"delayed"`` (scales from an amax history of past
            iterations, updated once per optimizer step, as Transformer
            Engine's default) or ``"rowwise"`` (a scale per row; needs
            ``format="e4m3"``).
        format (str): ``"hybrid"`` (default: E4M3 activations and weights, E5M2
            gradients) or ``"e4m3"`` everywhere.
        amax_history_len (int): rows of the delayed recipe's history. Default: 16.
        amax_compute_algo (str): ``"max"`` (default: the largest amax of the
            history) or ``"most_recent"``.
        margin (int): powers of two of headroom below the format's max. Default: 0.
        modules (None, callable or tuple of str): which layers to convert; None
            (default) is the default filter: layers whose in and out features
            are multiples of 16 and at least ``min_features``. A callable
            ``(name, linear) -> bool``, or names (exact or fnmatch patterns),
            chooses them instead. ``initialize``'s ``fp8_modules`` overrides it.
        skip_first_last (bool): with the default filter, also leave out the
            first and the last ``nn.Linear`` in module order. Default: False.
        min_features (int): the default filter's size rule: both dims at least
            this. Default: 2048 (smaller GEMMs were measured slower in FP8 than
            in bf16).
        emulate (bool): run the GEMMs as the fp32 reference (quantize,
            dequantize, matmul in fp32) instead of ``torch._scaled_mm``: the
            same numerics where no FP8 GEMM exists (a GPU before sm_89), and no
            faster. Only when asked; logged. Default: False.

    Raises:
        ValueError: a field out of range, naming it and the allowed values.

    Example::

        >>> Fp8Recipe(scaling="delayed", amax_history_len=32).amax_compute_algo
        'max'
        >>> Fp8Recipe(scaling="rowwise")
        Traceback (most recent call last):
        ...
        ValueError: Fp8Recipe(scaling='rowwise') needs format='e4m3': ...
    """

    scaling: str = "tensorwise"
    format: str = "hybrid"
    amax_history_len: int = 16
    amax_compute_algo: str = "max"
    margin: int = 0
    modules: Fp8ModuleFilter = None
    skip_first_last: bool = False
    min_features: int = DEFAULT_MIN_FEATURES
    emulate: bool = False

    def __post_init__(self) -> None:
        _check_choice("scaling", self.scaling, SCALINGS)
        _check_choice("format", self.format, FORMATS)
        _check_choice("amax_compute_algo", self.amax_compute_algo, AMAX_COMPUTE_ALGOS)
        _check_int("amax_history_len", self.amax_history_len, 1)
        _check_int("margin", self.margin, 0)
        _check_int("min_features", self.min_features, 1)
        for name in ("skip_first_last", "emulate"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"Fp8Recipe.{name} must be True or False, "
                                 f"got {getattr(self, name)!r}")
        object.__setattr__(self, "modules", check_fp8_modules(self.modules, "Fp8Recipe.modules"))
        if self.scaling == "rowwise" and self.format != "e4m3":
            raise ValueError(
                f"Fp8Recipe(scaling='rowwise') needs format='e4m3': the rowwise FP8 GEMMs take "
                f"E4M3 operands only, so gradients cannot be E5M2 (format={self.format!r})")

    @classmethod
    def from_arg(cls, value: Any) -> Fp8Recipe | None:
        """``initialize``'s ``fp8=`` as a recipe: None stays None, a scaling name makes its default.

        Args:
            value (None, str or Fp8Recipe): ``"tensorwise"``, ``"delayed"``,
                ``"rowwise"`` (with ``format="e4m3"``) or a recipe.

        Raises:
            ValueError: any other value.

        Example::

            >>> Fp8Recipe.from_arg("delayed").scaling
            'delayed'
            >>> Fp8Recipe.from_arg("rowwise").format
            'e4m3'
            >>> Fp8Recipe.from_arg(None) is None
            True
        """
        if value is None or isinstance(value, Fp8Recipe):
            return value
        if isinstance(value, str) and value in SCALINGS:
            return cls(scaling=value, format="e4m3" if value == "rowwise" else "hybrid")
        raise ValueError(
            f"fp8 must be None, one of {', '.join(map(repr, SCALINGS))} or an "
            f"amp_patch.Fp8Recipe, got {value!r}")

    def with_modules(self, modules: Fp8ModuleFilter) -> Fp8Recipe:
        """This recipe with another module filter (``initialize``'s ``fp8_modules``)."""
        return dataclasses.replace(self, modules=modules)

    def describe(self) -> str:
        """One line for the log.

        Example::

            >>> Fp8Recipe().describe()
            'tensorwise, format hybrid, margin 0, min_features 2048'
        """
        parts = [self.scaling, f"format {self.format}"]
        if self.scaling == "delayed":
            parts.append(f"history {self.amax_history_len} ({self.amax_compute_algo})")
        parts.append(f"margin {self.margin}")
        if self.modules is not None:
            parts.append("modules " + ("<callable>" if callable(self.modules)
                                       else ", ".join(self.modules)))
        else:
            parts.append(f"min_features {self.min_features}")
            if self.skip_first_last:
                parts.append("skip_first_last")
        if self.emulate:
            parts.append("emulated (fp32 reference GEMMs)")
        return ", ".join(parts)
