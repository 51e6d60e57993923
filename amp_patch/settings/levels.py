"""The opt levels: one registry row per level, saying what each stage of ``initialize`` does.

Everything that knows the levels reads them from here:
:meth:`amp_patch.settings.properties.Properties.from_opt_level` (the presets and the
error for an unknown level), the front end, the CLI's trainers and
``amp-patch compare``, the tests' parametrizations, and the table in
docs/opt_levels.md (:func:`markdown_table`; a test checks the page holds it).

A row's fields are the stages' switches. The stages themselves read the
resolved :class:`~amp_patch.settings.properties.Properties`, in which a caller's
overrides have replaced the row's values:

- ``cast_model_type``: model casting (:mod:`amp_patch.casting.model`) casts the
  model and its floating inputs to this dtype; :data:`HALF` means the
  session's ``half_dtype``; None leaves the model alone;
- ``patch_torch_functions``: O1 patching (:mod:`amp_patch.patching`)
  wraps torch's functions and Tensor methods;
- ``keep_batchnorm_fp32``: model casting leaves affine batch norms in fp32;
- ``master_weights``: the optimizer records (:mod:`amp_patch.optim.amp`) step
  fp32 masters of the half parameters;
- ``loss_scale``: the loss scalers' start (:mod:`amp_patch.scaler`), with
  float16; with bfloat16 every level's default is a static 1.0.

To add a level, add a row to :data:`OPT_LEVELS`, then the stage it needs if
no existing switch describes it (docs/design.md names the layers).

Example::

    >>> from amp_patch.settings.levels import OPT_LEVELS
    >>> OPT_LEVELS["O2"].master_weights
    True
    >>> list(OPT_LEVELS)
    ['O0', 'O1', 'O2', 'O3']
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import torch

__all__ = ["OptLevel", "OPT_LEVELS", "NAMES", "HALF", "DYNAMIC", "get", "markdown_table"]

#: The loss scale that starts high and adapts (halves on overflow, grows when clean).
DYNAMIC = "dynamic"

#: In a row's ``cast_model_type``: the session's half dtype.
HALF = "half"


@dataclass(frozen=True)
class OptLevel:
    """One opt level: its name, a one-line summary, and its preset (see the module's text).

    Args:
        name (str): ``"O0"`` ... (the letter O).
        summary (str): what the level is, in a few words (docs and messages).
        cast_model_type (torch.dtype, str or None): the model's dtype; :data:`HALF`
            for the session's half dtype; None leaves the model as it is.
        patch_torch_functions (bool): install O1's casting wrappers.
        keep_batchnorm_fp32 (bool or None): keep affine batch norms in fp32.
        master_weights (bool or None): keep fp32 masters of the half params.
        loss_scale (float or str): the loss scale with float16 (:data:`DYNAMIC` or a number).
    """

    name: str
    summary: str
    cast_model_type: torch.dtype | str | None
    patch_torch_functions: bool
    keep_batchnorm_fp32: bool | None
    master_weights: bool | None
    loss_scale: float | str

    @property
    def casts_model_to_half(self) -> bool:
        """True when the preset casts the model to the half dtype (O2, O3)."""
        return self.cast_model_type == HALF

    @property
    def computes_in_half(self) -> bool:
        """True when the preset computes in half, by a model cast or by O1's patches (O1-O3)."""
        return self.casts_model_to_half or self.patch_torch_functions

    def preset(self, half_dtype: torch.dtype) -> dict[str, Any]:
        """The :class:`~amp_patch.Properties` fields this level sets, for ``half_dtype``.

        Example::

            >>> OPT_LEVELS["O3"].preset(torch.bfloat16)["cast_model_type"]
            torch.bfloat16
            >>> OPT_LEVELS["O1"].preset(torch.float16)["loss_scale"]
            'dynamic'
        """
        cast = half_dtype if self.cast_model_type == HALF else self.cast_model_type
        return dict(
            cast_model_type=cast,
            patch_torch_functions=self.patch_torch_functions,
            keep_batchnorm_fp32=self.keep_batchnorm_fp32,
            master_weights=self.master_weights,
            # bf16 has fp32's exponent range: its gradients need no scaling.
            loss_scale=1.0 if half_dtype == torch.bfloat16 else self.loss_scale,
        )


_ROWS = (
    OptLevel("O0", "fp32", torch.float32, patch_torch_functions=False,
             keep_batchnorm_fp32=None, master_weights=False, loss_scale=1.0),
    OptLevel("O1", "patched torch functions", None, patch_torch_functions=True,
             keep_batchnorm_fp32=None, master_weights=None, loss_scale=DYNAMIC),
    OptLevel("O2", "half model, fp32 master weights", HALF, patch_torch_functions=False,
             keep_batchnorm_fp32=True, master_weights=True, loss_scale=DYNAMIC),
    OptLevel("O3", "pure half", HALF, patch_torch_functions=False,
             keep_batchnorm_fp32=False, master_weights=False, loss_scale=1.0),
)

#: Every level by name, in the order tools run and report them.
OPT_LEVELS: Mapping[str, OptLevel] = MappingProxyType({row.name: row for row in _ROWS})

#: The level names, in order.
NAMES: tuple[str, ...] = tuple(OPT_LEVELS)


def get(name: Any) -> OptLevel:
    """The level called ``name``.

    Raises:
        ValueError: for any other value, listing the levels.

    Example::

        >>> get("O1").patch_torch_functions
        True
        >>> get("01")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ValueError: Unexpected optimization level '01'. Options are 'O0', 'O1', 'O2', 'O3'. ...
    """
    level = OPT_LEVELS.get(name) if isinstance(name, str) else None
    if level is None:
        raise ValueError(
            f"Unexpected optimization level {name!r}. Options are "
            f"{', '.join(repr(n) for n in NAMES)}. Note that in 'O0', 'O1', etc., the prefix O "
            "is the letter O, not the number zero."
        )
    return level


def _cell(value: Any) -> str:
    if isinstance(value, torch.dtype):
        return str(value).removeprefix("torch.")
    if isinstance(value, str) and value != HALF:
        return f'"{value}"'
    return str(value)


def markdown_table() -> str:
    """The presets as the Markdown table of docs/opt_levels.md (no trailing newline).

    Example::

        >>> print(markdown_table().splitlines()[2])
        | **O0** | float32 | False | None | False | 1.0 |
    """
    columns = ("cast_model_type", "patch_torch_functions", "keep_batchnorm_fp32",
               "master_weights", "loss_scale")
    lines = ["| | " + " | ".join(columns[:-1]) + " | loss_scale (fp16) |",
             "|" + "---|" * (len(columns) + 1)]
    for row in OPT_LEVELS.values():
        lines.append(f"| **{row.name}** | "
                     + " | ".join(_cell(getattr(row, c)) for c in columns) + " |")
    return "\n".join(lines)


if __name__ == "__main__":  # python -m amp_patch.settings.levels: the table, for docs/opt_levels.md
    print(markdown_table())
