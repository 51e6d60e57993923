"""The import hook behind ``amp-patch run``: ``apex`` and ``amp_C`` names served by amp_patch.

A :class:`sys.meta_path` finder answers imports of ``apex``, its supported
submodules, and ``amp_C`` with small modules whose attributes come from
amp_patch (see :data:`MODULES`). Anything else under ``apex`` fails at import
with :class:`ApexUnsupportedError`, a subclass of :class:`ImportError` whose
message names what is missing, so that a script's own
``try: ... except ImportError`` fallbacks keep working.

Every module it serves is a package with an empty ``__path__``. That makes
``from apex.optimizers import FusedLAMB`` ask the finder about
``apex.optimizers.FusedLAMB`` when the attribute is missing, so the error
names the unsupported attribute rather than Python's generic
"cannot import name".

A real ``apex`` (or ``amp_C``) found on ``sys.path`` is left alone unless the
hook is installed with ``shadow_apex=True``.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
from dataclasses import dataclass
from typing import Iterator

__all__ = ["ApexUnsupportedError", "ApexFinder", "MODULES", "install", "uninstall", "apex_import_hook"]


@dataclass(frozen=True)
class _Mapping:
    target: str | None  # module whose public names are served; None: only submodules
    what: str  # for the list of supported names in error messages


#: The names served, and where their attributes come from.
MODULES: dict[str, _Mapping] = {
    "apex": _Mapping(None, "the package"),
    "apex.amp": _Mapping("amp_patch", "amp_patch's public API"),
    "apex.optimizers": _Mapping("amp_patch.apex_compat.optimizers", "FusedAdam, FusedSGD"),
    "apex.parallel": _Mapping(
        "amp_patch.apex_compat.parallel",
        "DistributedDataParallel, SyncBatchNorm, convert_syncbn_model"),
    "apex.normalization": _Mapping("amp_patch.apex_compat.normalization",
                                   "FusedLayerNorm, FusedRMSNorm"),
    "apex.fp16_utils": _Mapping(
        "amp_patch.apex_compat.fp16_utils",
        "network_to_half, BN_convert_float, FP16Model, prep_param_lists, ... (not FP16_Optimizer)"),
    "apex.multi_tensor_apply": _Mapping("amp_patch.apex_compat.multi_tensor_apply",
                                        "multi_tensor_applier, MultiTensorApply"),
    "amp_C": _Mapping("amp_patch.apex_compat.amp_C",
                      "multi_tensor_scale, multi_tensor_axpby, multi_tensor_l2norm"),
}

_AMP_O2_HINT = ("amp.initialize(model, optimizer, opt_level='O2') with amp.scale_loss(loss, "
                "optimizer) keeps fp32 master weights and scales the loss")

# What to do instead, for names people are likely to meet.
_HINTS: dict[str, str] = {
    "apex.fp16_utils.FP16_Optimizer": _AMP_O2_HINT,
    "apex.fp16_utils.LossScaler": _AMP_O2_HINT,
    "apex.fp16_utils.DynamicLossScaler": _AMP_O2_HINT,
    "apex.optimizers.FusedLAMB": "no LAMB in torch.optim; use a LAMB implementation of your choice",
    "apex.optimizers.FusedNovoGrad": "no NovoGrad in torch.optim",
    "apex.optimizers.FusedAdagrad": "use torch.optim.Adagrad(..., fused=True)",
    "apex.normalization.MixedFusedLayerNorm": "use torch.nn.LayerNorm under opt_level='O1'",
    "apex.contrib": "Apex's contrib CUDA extensions are not provided",
    "apex.transformer": "Apex's Megatron-style tensor/pipeline parallel utilities are not provided",
    "apex.mlp": "use torch.nn.Linear layers (amp_patch casts them under O1-O3)",
    "apex.RNN": "use torch.nn.LSTM / GRU (supported under O1)",
    "apex.reparameterization": "use torch.nn.utils.parametrizations.weight_norm",
}


class ApexUnsupportedError(ImportError):
    """An ``apex`` name that amp_patch's compatibility layer does not provide."""


def unsupported_message(name: str) -> str:
    """The error message for the unsupported name ``name`` (e.g. ``"apex.contrib.xyz"``)."""
    hint = next((h for key, h in _HINTS.items() if name == key or name.startswith(key + ".")), None)
    supported = "; ".join(f"{n} ({m.what})" for n, m in MODULES.items() if n != "apex")
    return (f"{name} is not supported by amp_patch's Apex compatibility layer (amp-patch run)."
            + (f" Instead: {hint}." if hint else "")
            + f" Supported: {supported}. See docs/migration.md.")


def _public_names(module: types.ModuleType) -> list[str]:
    names = getattr(module, "__all__", None)
    if names is None:
        names = [n for n in vars(module) if not n.startswith("_")]
    return list(names)


class _ShimModule(types.ModuleType):
    """A served module: its public attributes are looked up, on use, in its target module."""

    def __init__(self, name: str, mapping: _Mapping) -> None:
        super().__init__(name, f"{name}, served by amp_patch ({mapping.what}).")
        self._amp_patch_mapping = mapping

    def _target_names(self) -> tuple[types.ModuleType | None, list[str]]:
        target = self._amp_patch_mapping.target
        if target is None:
            prefix = self.__name__ + "."
            return None, [n[len(prefix):] for n in MODULES if n.startswith(prefix)]
        module = importlib.import_module(target)
        return module, _public_names(module)

    def __getattr__(self, attr: str):
        if attr.startswith("__") or attr == "_amp_patch_mapping":
            raise AttributeError(attr)
        module, names = self._target_names()
        if attr in names:
            if module is None:
                return importlib.import_module(f"{self.__name__}.{attr}")
            return getattr(module, attr)
        raise AttributeError(unsupported_message(f"{self.__name__}.{attr}"))

    def __dir__(self) -> list[str]:
        return sorted(set(super().__dir__()) | set(self._target_names()[1]))


class _ShimLoader(importlib.abc.Loader):
    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        return _ShimModule(spec.name, MODULES[spec.name])

    def exec_module(self, module: types.ModuleType) -> None:
        """Nothing to run: attributes are resolved on access."""


class ApexFinder(importlib.abc.MetaPathFinder):
    """Finds ``apex``, ``apex.*`` and ``amp_C`` imports and serves them from amp_patch.

    Args:
        roots (set of str): the top-level names to answer (``"apex"``,
            ``"amp_C"``); those that a real installation provides are left out
            by :func:`install` unless shadowing was asked for.
    """

    def __init__(self, roots: set[str]) -> None:
        self.roots = frozenset(roots)
        self._loader = _ShimLoader()

    def find_spec(self, fullname: str, path=None, target=None):
        if fullname.partition(".")[0] not in self.roots:
            return None
        if fullname not in MODULES:
            raise ApexUnsupportedError(unsupported_message(fullname), name=fullname)
        return importlib.util.spec_from_loader(fullname, self._loader, is_package=True)


_ROOTS = ("apex", "amp_C")


def real_installations() -> dict[str, str]:
    """Top-level names among ``apex`` and ``amp_C`` that a real installation provides, with its origin."""
    found = {}
    for root in _ROOTS:
        spec = importlib.machinery.PathFinder.find_spec(root)
        if spec is not None:
            found[root] = spec.origin or (list(spec.submodule_search_locations or []) or ["?"])[0]
    return found


def install(shadow_apex: bool = False) -> ApexFinder:
    """Put an :class:`ApexFinder` first on ``sys.meta_path``.

    Args:
        shadow_apex (bool, optional): serve ``apex`` and ``amp_C`` even when a
            real installation exists. Default: False.

    Returns:
        ApexFinder: the installed finder; pass it to :func:`uninstall`.
    """
    roots = set(_ROOTS)
    if not shadow_apex:
        roots -= set(real_installations())
    for name in [n for n in sys.modules if n.partition(".")[0] in roots]:
        del sys.modules[name]  # a stale module would bypass the finder
    finder = ApexFinder(roots)
    sys.meta_path.insert(0, finder)
    return finder


def uninstall(finder: ApexFinder) -> None:
    """Remove ``finder`` and forget the modules it served."""
    with contextlib.suppress(ValueError):
        sys.meta_path.remove(finder)
    for name, module in list(sys.modules.items()):
        if isinstance(module, _ShimModule):
            del sys.modules[name]


@contextlib.contextmanager
def apex_import_hook(shadow_apex: bool = False) -> Iterator[ApexFinder]:
    """Serve ``apex`` and ``amp_C`` from amp_patch inside the ``with`` block.

    Args:
        shadow_apex (bool, optional): also when a real installation exists. Default: False.

    Example::

        >>> with apex_import_hook():
        ...     from apex import amp
        >>> amp.initialize is amp_patch.initialize
        True
    """
    finder = install(shadow_apex)
    try:
        yield finder
    finally:
        uninstall(finder)
