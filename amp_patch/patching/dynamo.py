"""Keeps ``torch.compile``'s view of torch's functions true while O1's patches come and go.

Dynamo decides how to trace a callable by looking it up in maps keyed by
torch's function objects (``torch.layer_norm`` -> an op to put in the graph),
which it builds once, from whatever the attributes of ``torch`` hold at that
moment, and caches for the process. Built while O1's wrappers are installed,
the maps hold the wrappers in place of the functions they wrap: the traced
wrappers then call functions that dynamo no longer recognises, and every
such call breaks the graph; and a map built in one session keeps that
session's wrappers for the next.

So the maps are built from torch's own functions: if dynamo is loaded and
has not built them when O1 installs, and again if dynamo is first imported
while the patches are installed, each time with the patched attributes
showing what they wrap, below every amp_patch wrapper
(:meth:`~amp_patch.patching.patcher.Patcher.showing_originals`); and after
the patches are undone, maps that dynamo rebuilt meanwhile are dropped.
During a session dynamo then meets amp_patch's wrappers as functions it does
not know and traces them (the C wrappers through their Python equivalent,
the CPU half emulation's as they are), down to torch's functions, which it
knows.
"""

from __future__ import annotations

import logging
import sys
from typing import Any, Callable

import wrapt

from amp_patch.patching.patcher import Patcher

__all__ = ["DynamoRules", "RULES"]

logger = logging.getLogger("amp_patch")

_TRACE_RULES = "torch._dynamo.trace_rules"
#: Dynamo's caches keyed by torch's objects (torch 2.13's trace_rules), each a functools.cache.
_BUILDERS = ("get_torch_obj_rule_map", "get_tensor_method")


class DynamoRules:
    """Dynamo's object-keyed trace-rule caches, as O1 keeps them.

    There is one instance, :data:`RULES`, because dynamo's caches are per
    process; it only remembers whether its import hook is registered.
    """

    def __init__(self) -> None:
        self._watching = False

    @staticmethod
    def _builders() -> list[Any]:  # functools.lru_cache-wrapped functions of dynamo
        rules = sys.modules.get(_TRACE_RULES)
        if rules is None:
            return []
        return [getattr(rules, n) for n in _BUILDERS
                if hasattr(getattr(rules, n, None), "cache_clear")]

    def snapshot(self, patcher: Patcher) -> tuple | None:
        """Dynamo's maps, built now from torch's own functions if they are not built.

        Call it once O1's patches are installed: a missing map is built with
        the patches (and any amp_patch patch set under them) shown as what
        they wrap.

        Args:
            patcher (Patcher): the installed O1 patches.

        Returns:
            tuple or None: the maps, for :meth:`drop_if_rebuilt`; None without dynamo.
        """
        builders = self._builders()
        if not builders:
            return None
        if not all(b.cache_info().currsize for b in builders):
            self._rebuild(builders, patcher)
        return tuple(build() for build in builders)

    @staticmethod
    def _rebuild(builders: list, patcher: Patcher) -> None:
        for build in builders:
            build.cache_clear()
        with patcher.showing_originals():
            for build in builders:
                build()

    def drop_if_rebuilt(self, snapshot: tuple | None) -> None:
        """After O1's patches are undone: drop the maps that dynamo built since ``snapshot``.

        Dynamo builds them again, from torch as it then is, when it next needs them.

        Args:
            snapshot (tuple or None): what :meth:`snapshot` returned before the patches.
        """
        builders = self._builders()
        cached = [b for b in builders if b.cache_info().currsize]
        if not cached:
            return
        if snapshot is not None and len(snapshot) == len(builders) and all(
                b() is s for b, s in zip(builders, snapshot)):
            return
        for build in builders:
            build.cache_clear()

    def watch_import(self, current_patcher: Callable[[], Patcher | None]) -> None:
        """Rebuild the maps from the wrapped functions if dynamo is first imported during a session.

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
