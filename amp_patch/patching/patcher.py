"""Recorded, exactly undoable attribute patches."""

from __future__ import annotations

import contextlib
import inspect
import logging
from typing import Any, Callable, Iterator, NamedTuple

import wrapt

__all__ = ["Patcher", "PatchRecord", "unwrapped"]

logger = logging.getLogger("amp_patch")


class PatchRecord(NamedTuple):
    """One installed patch.

    Attributes:
        parent: the module, class or object whose attribute was replaced.
        name (str): the attribute name on ``parent``.
        original: the value found (for classes, from the ``__dict__`` of the
            class in the MRO that defines it: the unbound function).
        owned (bool): whether ``name`` was in ``parent``'s own ``__dict__``;
            undo then restores it with setattr, otherwise deletes the patch
            so the inherited (or ``__getattr__``-provided) value shows again.
    """

    parent: Any
    name: str
    original: Any
    owned: bool


class Patcher:
    """Replaces attributes and remembers how to put every one of them back.

    Example::

        >>> patcher = Patcher()
        >>> original_mm = torch.mm
        >>> patcher.patch(torch, "mm", lambda original: lambda *args: original(*args) * 2)
        True
        >>> torch.mm(torch.ones(1, 1), torch.ones(1, 1))
        tensor([[2.]])
        >>> patcher.undo_all()
        >>> torch.mm is original_mm
        True
    """

    def __init__(self) -> None:
        self.records: list[PatchRecord] = []

    def __len__(self) -> int:
        return len(self.records)

    def patch(self, target: Any, path: str, make: Callable[[Any], Any]) -> bool:
        """Replace ``target.<path>`` by ``make(original)``.

        Args:
            target: a module, class or object.
            path (str): an attribute name, dotted for nested ones
                (``"linalg.multi_dot"``).
            make (callable): takes the original (unbound, for a class attribute)
                and returns the replacement.

        Returns:
            bool: False, with nothing changed, when the attribute does not exist.
        """
        try:
            parent, name, original = wrapt.resolve_path(target, path)
        except (wrapt.PathResolutionError, AttributeError):
            return False
        owned = name in _own_dict(parent)
        if isinstance(original, staticmethod):
            replacement = staticmethod(make(original.__func__))
        else:
            replacement = make(original)
        setattr(parent, name, replacement)
        self.records.append(PatchRecord(parent, name, original, owned))
        return True

    @contextlib.contextmanager
    def showing_originals(self) -> Iterator[None]:
        """Show torch's own functions on the patched attributes for the duration of the block.

        Each attribute gets its original with every amp_patch wrapper peeled
        off (:func:`unwrapped`: another patch set installed before this one,
        such as the CPU half emulation, is under it), then the patches are
        put back. For code that must see torch without amp_patch (see
        :mod:`amp_patch.patching.dynamo`). Not thread-safe: other threads
        see the originals meanwhile.

        Example::

            >>> patcher = Patcher()
            >>> patcher.patch(torch, "mm", lambda original: lambda *args: original(*args))
            True
            >>> with patcher.showing_originals():
            ...     assert torch.mm is torch._C._VariableFunctions.mm
            >>> patcher.undo_all()
        """
        installed = [vars(r.parent)[r.name] for r in self.records]
        for record in reversed(self.records):
            _restore(record._replace(original=unwrapped(record.original)))
        try:
            yield
        finally:
            for record, replacement in zip(self.records, installed):
                setattr(record.parent, record.name, replacement)

    def undo_all(self) -> None:
        """Restore every patch, last first. Every undo runs even if one fails.

        Raises:
            RuntimeError: after all ran, naming the attributes that could not be restored.
        """
        failures = []
        while self.records:
            record = self.records.pop()
            try:
                _restore(record)
            except Exception as exc:  # keep going: a half-restored torch is worse
                failures.append(f"{_describe(record.parent)}.{record.name}: {exc!r}")
        if failures:
            raise RuntimeError("could not restore " + "; ".join(failures))


def unwrapped(obj: Any) -> Any:
    """``obj`` with amp_patch's wrappers peeled off.

    An amp_patch wrapper keeps what it wraps as ``__wrapped__`` and carries
    an attribute of its own named ``_amp_patch_*`` (the O1 wrappers'
    ``_amp_patch_policy``, the CPU half emulation's ``_amp_patch_cpu_half``);
    ``__wrapped__`` is followed through those only, so a torch function that
    is itself a ``functools.wraps`` wrapper stays as it is.

    Args:
        obj: any attribute value.

    Returns:
        the innermost object that is not an amp_patch wrapper.
    """
    while True:
        own = getattr(obj, "__dict__", None)
        if not (isinstance(own, dict) and "__wrapped__" in own
                and any(k.startswith("_amp_patch_") for k in own)):
            return obj
        obj = own["__wrapped__"]


def _restore(record: PatchRecord) -> None:
    if record.owned:
        setattr(record.parent, record.name, record.original)
    else:
        delattr(record.parent, record.name)


def _own_dict(parent: Any) -> dict:
    try:
        return vars(parent)
    except TypeError:
        return {}


def _describe(parent: Any) -> str:
    if inspect.ismodule(parent) or inspect.isclass(parent):
        return parent.__name__
    return type(parent).__name__
