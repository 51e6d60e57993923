"""``fp8_autocast`` (FP8 off or on for a region) and ``fp8_plan`` (what ``fp8=`` converted)."""

from __future__ import annotations

import contextlib
from typing import Any

from amp_patch import session as _session
from amp_patch.casting import fp8 as _fp8
from amp_patch.casting.fp8 import Fp8Plan
from amp_patch.settings.fp8 import Fp8Recipe

__all__ = ["fp8_autocast", "fp8_plan"]


class fp8_autocast(contextlib.ContextDecorator):
    """Turn FP8 off, or on with another recipe, for a region; a context manager and a decorator.

    The layers ``initialize(..., fp8=...)`` converted run in FP8 outside any
    region. Inside ``fp8_autocast(enabled=False)`` they run at the level's
    precision (an evaluation, a sensitive block); ``fp8_autocast(recipe=...)``
    runs them with that recipe's scaling, format and margin (its module filter
    is not used: the layers were chosen at ``initialize``). Regions nest, the
    innermost wins, and an exception leaves them as they were. Outside a
    session a region has nothing to act on and does nothing.

    Args:
        enabled (bool, optional): FP8 on (True, default) or off.
        recipe (Fp8Recipe or str, optional): the recipe inside, or a scaling
            name (``"tensorwise"``, ``"delayed"``, ``"rowwise"``). Default: the
            session's.

    Raises:
        ValueError: a ``"delayed"`` recipe inside a session whose recipe was not
            delayed (its layers keep no amax histories), or a bad recipe.

    .. note::
        The switch is read when a converted layer's forward runs; the backward
        of that forward runs as it was recorded, whatever region it is in.

    Example::

        >>> with amp.fp8_autocast(enabled=False):
        ...     out = model(x)
        >>> @amp.fp8_autocast(enabled=False)
        ... def evaluate(batch):
        ...     return model(batch)
    """

    def __init__(self, enabled: bool = True, recipe: Fp8Recipe | str | None = None) -> None:
        if not isinstance(enabled, bool):
            raise ValueError(f"fp8_autocast: enabled must be True or False, got {enabled!r}")
        self.enabled = enabled
        self.recipe = Fp8Recipe.from_arg(recipe)
        self._depths: list[int] = []

    def __enter__(self) -> fp8_autocast:
        session = _session.current()
        conversion = session.fp8 if session is not None else None
        if (self.enabled and self.recipe is not None and self.recipe.scaling == "delayed"
                and conversion is not None and conversion.plan.recipe.scaling != "delayed"):
            raise ValueError(
                "fp8_autocast(recipe=...delayed...): the session was initialized with "
                f"fp8={conversion.plan.recipe.scaling!r}, so its layers keep no amax histories; "
                "initialize with fp8='delayed' (or an Fp8Recipe(scaling='delayed'))")
        self._depths.append(_fp8.push_region(self.enabled, self.recipe))
        return self

    def __exit__(self, *exc: Any) -> None:
        _fp8.pop_region(self._depths.pop())


def fp8_plan() -> Fp8Plan | None:
    """Which layers the live session's ``fp8=`` converted, which it left out, and why.

    Returns:
        Fp8Plan or None: ``.converted`` (names), ``.left_out`` (name to reason)
        and ``.recipe``; None without a live session or without ``fp8``.

    Example::

        >>> net = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 8))
        >>> _ = amp.initialize(net, opt_level="O0", fp8=amp.Fp8Recipe(min_features=16),
        ...                    verbosity=0)
        >>> plan = amp.fp8_plan()
        >>> plan.converted, plan.left_out
        (('0',), {'2': 'out_features=8 is not a multiple of 16 (the FP8 GEMM needs it)'})
        >>> amp.deinitialize()
        >>> amp.fp8_plan() is None
        True
    """
    session = _session.current()
    if session is None or session.fp8 is None:
        return None
    return session.fp8.plan
