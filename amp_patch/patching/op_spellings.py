"""Every spelling of every listed op in the installed torch, derived, not listed.

For an op of :data:`~amp_patch.patching.lists.O1`, the spellings are the
attributes of that name (or of a name that torch documents as its alias) in
each namespace that O1 patches:

- ``torch``, ``torch.nn.functional``, ``torch.Tensor``, ``torch.special``
  and ``torch.linalg``; an ATen name with a submodule prefix
  (``linalg_vecdot``) is looked up in that submodule (``torch.linalg.vecdot``);
- the in-place form ``<name>_`` in ``torch``, ``torch.Tensor`` and
  ``torch.nn.functional``;
- the ``Tensor`` operators ``__<name>__``, ``__r<name>__`` and
  ``__i<name>__`` (the last in place), also under Python's operator name
  where it differs (:data:`~amp_patch.patching.lists.OPERATOR_NAMES`);
- ``torch._VF`` for the recurrent kernels (:data:`~amp_patch.patching.lists.VF_OPS`).

Aliases come from torch's own docstrings ("Alias for :func:`torch.acos`"),
so ``torch.arccos``, ``torch.concat`` and ``torch.true_divide`` follow
``acos``, ``cat`` and ``div`` in any torch version that documents them.

Only names, targets and policies are derived here; the objects to wrap are
read from their attributes when :class:`~amp_patch.patching.patcher.Patcher`
installs the patches, so whatever another patch set installed before O1 is
what O1 wraps.
"""

from __future__ import annotations

import functools
import re
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

from amp_patch.patching import lists, rnn
from amp_patch.patching.wrappers import Policy

__all__ = ["Spelling", "spellings", "namespaces", "aliases"]


class Spelling(NamedTuple):
    """One patched attribute.

    Attributes:
        target: the module or class that holds it.
        prefix (str): ``target``'s printable name (``"torch.Tensor"``).
        name (str): the attribute name.
        op (str): the list entry it spells.
        policy (Policy): how its wrapper casts.
        message (str or None): a banned op's error text.
    """

    target: Any
    prefix: str
    name: str
    op: str
    policy: Policy
    message: str | None

    @property
    def qualname(self) -> str:
        """``prefix.name``, e.g. ``"torch.Tensor.softmax"``."""
        return f"{self.prefix}.{self.name}"


def namespaces() -> dict[str, Any]:
    """The namespaces O1 patches by op name: {printable prefix: module or class}."""
    return {"torch": torch, "torch.nn.functional": F, "torch.Tensor": torch.Tensor,
            "torch.special": torch.special, "torch.linalg": torch.linalg}


#: ATen name prefixes that Python spells as a submodule.
_SUBMODULES = {"linalg_": "torch.linalg", "special_": "torch.special"}
#: Where in-place forms are looked for.
_IN_PLACE_NAMESPACES = ("torch", "torch.nn.functional", "torch.Tensor")
_ALIAS_DOC = re.compile(r"Alias (?:for|of) :(?:func|meth):`~?(torch(?:\.\w+)*)\.(\w+)`")

_IN_PLACE_POLICY = {"half": Policy.IN_PLACE, "promote": Policy.IN_PLACE,
                    "fp32": Policy.IN_PLACE_FP32}


def _members(target: Any) -> dict[str, Any]:
    # A module's own dict, not getattr over dir(): torch's lazy submodules stay unimported.
    if isinstance(target, type):
        return {n: getattr(target, n, None) for n in dir(target)}
    return vars(target)


def _callable(target: Any, name: str) -> bool:
    try:
        value = getattr(target, name)
    except AttributeError:
        return False
    return callable(value) and not isinstance(value, type)


@functools.cache
def aliases() -> dict[str, frozenset[str]]:
    """Each name's documented aliases in the patched namespaces, as groups of bare names.

    Read from the docstrings of the installed torch: ``torch.arccos`` says
    "Alias for :func:`torch.acos`", so ``aliases()["acos"]`` holds
    ``"arccos"`` (and ``aliases()["arccos"]`` holds ``"acos"``).

    Returns:
        dict: {name: every name it is linked to, itself included}.
    """
    parent: dict[str, str] = {}

    def find(n: str) -> str:
        while parent.get(n, n) != n:
            n = parent[n]
        return n

    known = namespaces()
    for target in known.values():
        for name, value in _members(target).items():
            doc = getattr(value, "__doc__", None)
            if not isinstance(doc, str) or "Alias" not in doc:
                continue
            match = _ALIAS_DOC.search(doc)
            if match is None or match.group(1) not in known:
                continue
            other = match.group(2)
            if not _callable(known[match.group(1)], other):
                continue
            parent[find(name)] = find(other)
    groups: dict[str, set[str]] = {}
    for n in list(parent):
        groups.setdefault(find(n), set()).add(n)
    for root, members in groups.items():
        members.add(root)
    return {n: frozenset(members) for members in groups.values() for n in members}


def _names(op: str) -> list[tuple[str | None, str]]:
    """(namespace prefix or None for all, bare name) pairs that spell ``op``."""
    out: list[tuple[str | None, str]] = []
    for aten_prefix, module in _SUBMODULES.items():
        if op.startswith(aten_prefix):
            out.append((module, op[len(aten_prefix):]))
    for name in sorted(aliases().get(op, {op})):
        out.append((None, name))
    return out


def _op_spellings(op: str, policy_name: str, message: str | None) -> list[tuple[str, str, Policy]]:
    """(prefix, attribute name, policy) for each spelling of ``op`` in the installed torch."""
    known = namespaces()
    policy = Policy(policy_name)
    in_place = _IN_PLACE_POLICY.get(policy_name)
    found: list[tuple[str, str, Policy]] = []

    def add(prefix: str, name: str, p: Policy) -> None:
        if _callable(known[prefix], name):
            found.append((prefix, name, p))

    for only, name in _names(op):
        for prefix in ([only] if only else known):
            add(prefix, name, policy)
            if in_place is not None and prefix in _IN_PLACE_NAMESPACES:
                add(prefix, name + "_", in_place)
        if only is None:
            for operator in (name,) + lists.OPERATOR_NAMES.get(name, ()):
                add("torch.Tensor", f"__{operator}__", policy)
                add("torch.Tensor", f"__r{operator}__", policy)
                if in_place is not None:
                    add("torch.Tensor", f"__i{operator}__", in_place)
    if op in lists.VF_OPS:
        found.append(("torch._VF", op, policy))
    return found


@functools.cache
def spellings() -> tuple[Spelling, ...]:
    """Every attribute O1 patches for :data:`~amp_patch.patching.lists.O1`, in list order.

    Raises:
        RuntimeError: if one attribute spells ops of different policies (a list
            or alias error that would make the cast depend on the spelling).

    Example::

        >>> for s in spellings():
        ...     if s.op == "softmax":
        ...         print(s.qualname)
        torch.softmax
        torch.nn.functional.softmax
        torch.Tensor.softmax
        torch.special.softmax
    """
    vf = rnn.vf_module()
    targets = {**namespaces(), "torch._VF": vf}
    messages = dict(lists.O1.banned)
    out: dict[tuple[str, str], Spelling] = {}
    for op, policy_name in lists.O1.policies().items():
        for prefix, name, policy in _op_spellings(op, policy_name, messages.get(op)):
            key = (prefix, name)
            if key in out:
                if out[key].policy is not policy:
                    raise RuntimeError(
                        f"amp_patch O1: {prefix}.{name} spells {out[key].op!r} "
                        f"({out[key].policy.value}) and {op!r} ({policy.value})")
                continue
            out[key] = Spelling(targets[prefix], prefix, name, op, policy, messages.get(op))
    return tuple(out.values())
