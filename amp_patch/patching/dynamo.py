"""Keeps ``torch.compile``'s view of torch's functions true while O1's patches come and go.

Dynamo decides how to trace a callable by looking it up in maps keyed by
torch's function objects (``torch.layer_norm`` -> an op to put in the graph),
which it builds once, from whatever the attributes of ``torch`` hold at that
moment, and caches for the process. Built while O1's wrappers are installed,
the maps hold the wrappers in place of torch's own functions: the traced
wrappers then call functions that dynamo no longer recognises, and every
such call breaks the graph; and a map built in one session keeps that
session's wrappers for the next.

So the maps are kept built from torch's own functions: checked (and rebuilt
if dynamo built them anew) before O1 patches and after the patches are
undone, and rebuilt when dynamo is first imported while the patches are
installed, with the originals shown for the moment of the rebuild
(:meth:`Patcher.showing_originals`). During a session dynamo then meets the
wrappers as functions it does not know and traces them (the C wrappers
through their Python equivalent), and what they call is torch's own
functions, which it does know.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from typing import Any, Callable

import wrapt

from amp_patch.patching.patcher import Patcher

__all__ = ["DynamoRules", "RULES"]

logger = logging.getLogger("amp_patch")

_TRACE_RULES = "torch._dynamo.trace_rules"
#: Dynamo's caches keyed by torch's objects (torch 2.13's trace_rules).
_BUILDERS = ("get_torch_obj_rule_map", "get_tensor_method")


class DynamoRules:
    """Dynamo's object-keyed trace-rule caches, as O1 keeps them (process-wide, as they are).

    Attributes:
        clean (tuple or None): the cached maps last built from torch's own
            functions (held, so that a rebuilt map can never be mistaken for them).
    """

    def __init__(self) -> None:
        self.clean: tuple | None = None
        self._watching = False

    @staticmethod
    def _builders() -> list[Callable[[], Any]]:
        rules = sys.modules.get(_TRACE_RULES)
        if rules is None:
            return []
        return [getattr(rules, n) for n in _BUILDERS
                if hasattr(getattr(rules, n, None), "cache_clear")]

    def _rebuild(self, builders: list, patcher: Patcher | None) -> None:
        for build in builders:
            build.cache_clear()
        with patcher.showing_originals() if patcher is not None else contextlib.nullcontext():
            self.clean = tuple(build() for build in builders)

    def ensure_clean(self) -> None:
        """With torch unpatched: rebuild the maps if dynamo built them since they were last clean.

        A no-op without dynamo loaded, and when the maps are the clean ones.
        """
        builders = self._builders()
        if builders and (self.clean is None or len(self.clean) != len(builders)
                         or not all(b() is c for b, c in zip(builders, self.clean))):
            self._rebuild(builders, None)

    def watch_import(self, current_patcher: Callable[[], Patcher | None]) -> None:
        """Rebuild the maps from the originals if dynamo is first imported while O1 is installed.

        Registers (once per process) a hook on the import of ``torch._dynamo``.

        Args:
            current_patcher (callable): returns the installed O1 patches, or None.
        """
        if self._watching or _TRACE_RULES in sys.modules:
            return
        self._watching = True

        def on_import(_module) -> None:
            patcher = current_patcher()
            if patcher is None:
                return
            try:
                self._rebuild(self._builders(), patcher)
            except Exception:  # never fail the user's import of torch._dynamo
                logger.warning("amp_patch: could not rebuild torch._dynamo's trace rules; "
                               "torch.compile may break graphs at O1's wrappers", exc_info=True)

        wrapt.register_post_import_hook(on_import, "torch._dynamo")


#: The one instance: dynamo's caches are per process.
RULES = DynamoRules()
