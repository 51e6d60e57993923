"""The import hook behind ``amp-patch run``: ``apex`` and Apex's compiled modules, from amp_patch.

A :class:`sys.meta_path` finder answers imports of ``apex``, its supported
submodules, and the top-level compiled modules Apex's ``setup.py`` installed
(``amp_C``, ``apex_C``, ``fused_adam_cuda``; :data:`COMPILED_MODULES` lists
them all, with what to use instead of those not served) with small modules
whose attributes come from amp_patch (see :data:`MODULES`). Each served module holds, in its
``__dict__``, the public names Apex's module had that amp_patch serves, and
its ``__all__`` lists them, so ``from apex.fp16_utils import *`` and
``'state_dict' in amp.__dict__`` behave as with Apex.

Anything else under ``apex``, and every other compiled module of Apex, fails
at import with :class:`ApexUnsupportedError`, a subclass of
:class:`ImportError` whose message names what is missing, so that
a script's own ``try: ... except ImportError`` fallbacks keep working. Such a
miss is never silent: it is logged as a warning naming the name and what to use
instead, even when the script catches the error, and the finder records it in
:attr:`ApexFinder.misses` (``amp-patch run`` prints a summary at the end).

Every module it serves is a package with an empty ``__path__``. That makes
``from apex.normalization import MixedFusedLayerNorm`` ask the finder about
``apex.normalization.MixedFusedLayerNorm`` when the attribute is missing, so the error
names the unsupported attribute rather than Python's generic
"cannot import name".

It also answers Transformer Engine's PyTorch spelling of FP8 training:
``transformer_engine.pytorch`` (``Linear``, ``LayerNorm``, ``LayerNormLinear``,
``fp8_autocast``) and ``transformer_engine.common.recipe`` (``DelayedScaling``,
``Float8CurrentScaling``, ``Format``), served by
:mod:`amp_patch.apex_compat.transformer_engine`; its other names are refused in
the same way, with what to use instead.

A real ``apex`` (or ``amp_C``, or ``transformer_engine``) found on ``sys.path``
is left alone unless the hook is installed with ``shadow_apex=True``.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import logging
import sys
import types
from dataclasses import dataclass, field
from typing import Callable, Iterator

__all__ = ["ApexUnsupportedError", "ApexFinder", "MODULES", "COMPILED_MODULES", "install",
           "uninstall", "apex_import_hook"]

logger = logging.getLogger("amp_patch")


@dataclass(frozen=True)
class _Mapping:
    target: str | None  # module whose attributes are served; None: only submodules
    what: str  # for the list of supported names in error messages
    #: The public names of Apex's module: those the target has are served and form ``__all__``.
    #: Empty: the target's own ``__all__``.
    apex_all: tuple[str, ...] = ()
    #: Names served from another module than the target, each from a ``"module:attribute"``:
    #: private ones, names Apex's module no longer has (neither goes into ``__all__``), and
    #: names whose served object is not the target's own.
    extras: dict[str, str] = field(default_factory=dict)


_AMP_STATE_MODULE = "amp_patch.apex_compat.amp_state"
_AMP_STATE = {"_amp_state": f"{_AMP_STATE_MODULE}:amp_state"}
_FP16_UTILS = "amp_patch.apex_compat.fp16_utils"
_OPTIMIZERS_2019 = "amp_patch.apex_compat.optimizers_2019"
_FP16UTIL_NAMES = ("BN_convert_float", "network_to_half", "prep_param_lists",
                   "model_grads_to_master_grads", "master_params_to_model_params", "tofp16",
                   "to_python_float", "clip_grad_norm", "convert_module", "convert_network",
                   "FP16Model")
_AMP_NAMES = ("init", "half_function", "float_function", "promote_function",
              "register_half_function", "register_float_function", "register_promote_function",
              "scale_loss", "disable_casts", "initialize", "state_dict", "load_state_dict",
              "master_params")

_CONTRIB_OPTIMIZERS = "amp_patch.apex_compat.contrib.optimizers"
_CONTRIB_XENTROPY = "amp_patch.apex_compat.contrib.xentropy"
_SOFTMAX_HINT = ("torch.softmax on the scaled, masked scores, or "
                 "torch.nn.functional.scaled_dot_product_attention")
_ATTENTION_HINT = ("torch.nn.functional.scaled_dot_product_attention or "
                   "torch.nn.MultiheadAttention")
_DIST_OPT_HINT = ("torch.distributed.optim.ZeroRedundancyOptimizer, or FSDP with "
                  "torch.optim.AdamW(fused=True)")
_NCCL_HINT = "torch.distributed's NCCL collectives and send/recv"
_TE = "amp_patch.apex_compat.transformer_engine"
_TE_ROOT = "transformer_engine"
_TE_BLOCKS = ("te.Linear / te.LayerNormLinear (served) for the GEMMs inside a torch block, "
              "torch.nn.functional.scaled_dot_product_attention for attention")

#: The names served, and where their attributes come from.
MODULES: dict[str, _Mapping] = {
    "apex": _Mapping(None, "the package",
                     ("amp", "fp16_utils", "optimizers", "normalization", "parallel", "contrib")),
    "apex.amp": _Mapping("amp_patch", "amp_patch's public API, and _amp_state", _AMP_NAMES,
                         _AMP_STATE),
    "apex.amp.frontend": _Mapping("amp_patch",
                                  "initialize, state_dict, load_state_dict, _amp_state",
                                  ("initialize", "state_dict", "load_state_dict"),
                                  _AMP_STATE),
    "apex.amp._amp_state": _Mapping(_AMP_STATE_MODULE, "_amp_state (a live view), master_params",
                                    ("master_params",), _AMP_STATE),
    # FusedAdam tells the 2019 FusedAdam (its keywords) from the current one; FP16_Optimizer is
    # the 2019 name, which the current apex.optimizers no longer has.
    "apex.optimizers": _Mapping(
        "amp_patch.optim.fused",
        "FusedAdam, FusedLAMB, FusedMixedPrecisionLamb, FusedSGD, FusedNovoGrad, FusedAdagrad; "
        "and the 2019 FP16_Optimizer and FusedAdam",
        ("FusedSGD", "FusedAdam", "FusedNovoGrad", "FusedLAMB", "FusedAdagrad",
         "FusedMixedPrecisionLamb"),
        {"FusedAdam": f"{_OPTIMIZERS_2019}:FusedAdam",
         "FP16_Optimizer": f"{_OPTIMIZERS_2019}:FP16_Optimizer"}),
    "apex.parallel": _Mapping(
        "amp_patch.apex_compat.parallel",
        "DistributedDataParallel, SyncBatchNorm, convert_syncbn_model, LARC",
        ("DistributedDataParallel", "Reducer", "SyncBatchNorm", "convert_syncbn_model",
         "create_syncbn_process_group", "ReduceOp", "LARC")),
    "apex.parallel.LARC": _Mapping("amp_patch.apex_compat.larc", "LARC", ("LARC",)),
    "apex.normalization": _Mapping(
        "amp_patch.apex_compat.normalization", "FusedLayerNorm, FusedRMSNorm",
        ("FusedLayerNorm", "MixedFusedLayerNorm", "FusedRMSNorm", "MixedFusedRMSNorm")),
    "apex.fp16_utils": _Mapping(
        _FP16_UTILS, "FP16_Optimizer, LossScaler, DynamicLossScaler, network_to_half, ...",
        (*_FP16UTIL_NAMES, "FP16_Optimizer", "LossScaler", "DynamicLossScaler")),
    "apex.fp16_utils.fp16util": _Mapping(_FP16_UTILS, "network_to_half, ...", _FP16UTIL_NAMES),
    "apex.fp16_utils.fp16_optimizer": _Mapping(_FP16_UTILS, "FP16_Optimizer", ("FP16_Optimizer",)),
    "apex.fp16_utils.loss_scaler": _Mapping(
        _FP16_UTILS, "LossScaler, DynamicLossScaler",
        ("LossScaler", "DynamicLossScaler", "to_python_float")),
    "apex.multi_tensor_apply": _Mapping("amp_patch.ops.multi_tensor_apply",
                                        "multi_tensor_applier, MultiTensorApply",
                                        ("MultiTensorApply", "multi_tensor_applier")),
    "apex.contrib": _Mapping(None, "the package", ("optimizers", "xentropy", "clip_grad")),
    "apex.contrib.optimizers": _Mapping(
        _CONTRIB_OPTIMIZERS, "FP16_Optimizer, FusedAdam (Apex's contrib protocol)",
        ("FP16_Optimizer", "FusedAdam")),
    "apex.contrib.optimizers.fp16_optimizer": _Mapping(_CONTRIB_OPTIMIZERS, "FP16_Optimizer",
                                                       ("FP16_Optimizer",)),
    "apex.contrib.optimizers.fused_adam": _Mapping(_CONTRIB_OPTIMIZERS, "FusedAdam",
                                                   ("FusedAdam",)),
    "apex.contrib.xentropy": _Mapping(_CONTRIB_XENTROPY, "SoftmaxCrossEntropyLoss",
                                      ("SoftmaxCrossEntropyLoss",)),
    "apex.contrib.xentropy.softmax_xentropy": _Mapping(_CONTRIB_XENTROPY, "SoftmaxCrossEntropyLoss",
                                                       ("SoftmaxCrossEntropyLoss",)),
    "apex.contrib.clip_grad": _Mapping("amp_patch.apex_compat.contrib.clip_grad",
                                       "clip_grad_norm_ (torch's)", ("clip_grad_norm_",)),
    "amp_C": _Mapping("amp_patch.apex_compat.amp_C",
                      "multi_tensor_scale, multi_tensor_axpby, multi_tensor_l2norm, "
                      "multi_tensor_unscale_l2norm, update_scale_hysteresis"),
    "apex_C": _Mapping("amp_patch.apex_compat.apex_C", "flatten, unflatten"),
    "fused_adam_cuda": _Mapping("amp_patch.apex_compat.fused_adam_cuda",
                                "adam, adam_mt (Apex's arithmetic)"),
    # Transformer Engine's PyTorch spelling of FP8 training (docs/fp8.md).
    "transformer_engine": _Mapping(None, "the package", ("pytorch", "common")),
    "transformer_engine.pytorch": _Mapping(
        _TE, "Linear, LayerNorm, LayerNormLinear, fp8_autocast (and autocast)",
        ("Linear", "LayerNorm", "LayerNormLinear", "fp8_autocast", "autocast",
         "is_fp8_enabled")),
    "transformer_engine.common": _Mapping(None, "the package", ("recipe",)),
    "transformer_engine.common.recipe": _Mapping(
        _TE, "DelayedScaling, Float8CurrentScaling, Format",
        ("DelayedScaling", "Float8CurrentScaling", "Format", "Recipe")),
}

#: Every top-level module Apex's ``setup.py`` compiled (amp as of its removal), to None when
#: :data:`MODULES` serves it, else to what to use instead. The import hook answers them all.
COMPILED_MODULES: dict[str, str | None] = {
    "amp_C": None,
    "apex_C": None,
    "fused_adam_cuda": None,
    "syncbn": "apex.parallel.SyncBatchNorm (served) or torch.nn.SyncBatchNorm",
    "fused_layer_norm_cuda": "apex.normalization.FusedLayerNorm / FusedRMSNorm (served), or "
                             "torch.nn.LayerNorm / torch.nn.RMSNorm",
    "fused_lamb_cuda": "apex.optimizers.FusedLAMB (served)",
    "mlp_cuda": "torch.nn.Linear layers and activations (amp_patch casts them under O1-O3)",
    "fused_dense_cuda": "torch.nn.Linear (amp_patch casts it under O1-O3)",
    "fused_weight_gradient_mlp_cuda": "torch.nn.Linear; autograd computes its weight gradient",
    "xentropy_cuda": "apex.contrib.xentropy.SoftmaxCrossEntropyLoss (served) or "
                     "torch.nn.functional.cross_entropy(label_smoothing=...)",
    "scaled_upper_triang_masked_softmax_cuda": _SOFTMAX_HINT,
    "generic_scaled_masked_softmax_cuda": _SOFTMAX_HINT,
    "scaled_masked_softmax_cuda": _SOFTMAX_HINT,
    "scaled_softmax_cuda": _SOFTMAX_HINT,
    "fused_rotary_positional_embedding": "rotary embeddings written in torch ops (the model's "
                                         "own, or torchtune's RotaryPositionalEmbeddings)",
    "fast_layer_norm": "torch.nn.LayerNorm, or apex.normalization.FusedLayerNorm (served)",
    "fmhalib": _ATTENTION_HINT,
    "fast_multihead_attn": _ATTENTION_HINT,
    "bnp": "torch.nn.BatchNorm2d (channels_last)",
    "cudnn_gbn_lib": "torch.nn.BatchNorm2d, or torch.nn.SyncBatchNorm for group BN",
    "group_norm_cuda": "torch.nn.GroupNorm",
    "group_norm_v2_cuda": "torch.nn.GroupNorm",
    "focal_loss_cuda": "torchvision.ops.sigmoid_focal_loss",
    "fused_index_mul_2d": "torch.index_select followed by a multiply",
    "permutation_search_cuda": "torch.sparse.to_sparse_semi_structured (2:4 sparsity)",
    "transducer_joint_cuda": "torchaudio.functional.rnnt_loss with the joint in torch ops",
    "transducer_loss_cuda": "torchaudio.functional.rnnt_loss",
    "distributed_adam_cuda": _DIST_OPT_HINT,
    "distributed_lamb_cuda": _DIST_OPT_HINT,
    "peer_memory_cuda": _NCCL_HINT,
    "nccl_p2p_cuda": _NCCL_HINT,
    "_nccl_version_getter": "torch.cuda.nccl.version()",
    "_apex_nccl_allocator": _NCCL_HINT,
    "_apex_gpu_direct_storage": "torch.cuda.gds",
    "fast_bottleneck": "torch.nn.Conv2d, BatchNorm2d and ReLU (torch.compile fuses them)",
    "fused_conv_bias_relu": "torch.nn.Conv2d and ReLU (torch.compile fuses them)",
}

# What to use instead, for names people are likely to meet.
_HINTS: dict[str, str] = {
    "apex.normalization.MixedFusedLayerNorm": "torch.nn.LayerNorm under opt_level='O1'",
    "apex.normalization.MixedFusedRMSNorm": "torch.nn.RMSNorm under opt_level='O1'",
    "apex.parallel.Reducer": "torch.nn.parallel.DistributedDataParallel, or "
                             "torch.distributed.all_reduce on the gradients",
    "apex.parallel.multiproc": "torchrun",
    "apex.amp": "the public apex.amp API and _amp_state, which amp_patch serves (amp.initialize, "
                "amp.scale_loss, amp.state_dict, ...)",
    "apex.contrib": "torch's own ops (torch.optim's fused=True optimizers, "
                    "torch.nn.functional.scaled_dot_product_attention, torch.nn.GroupNorm, ...); "
                    "of apex.contrib only optimizers.FP16_Optimizer / FusedAdam, "
                    "xentropy.SoftmaxCrossEntropyLoss and clip_grad.clip_grad_norm_ are served",
    "apex.contrib.optimizers.FusedLAMB": "apex.optimizers.FusedLAMB (served)",
    "apex.contrib.optimizers.FusedSGD": "apex.optimizers.FusedSGD (served)",
    "apex.contrib.optimizers.DistributedFusedAdam": "torch.distributed.optim."
                                                    "ZeroRedundancyOptimizer, or FSDP",
    "apex.contrib.optimizers.DistributedFusedLAMB": "torch.distributed.optim."
                                                    "ZeroRedundancyOptimizer, or FSDP",
    "apex.contrib.layer_norm": "torch.nn.LayerNorm, or apex.normalization.FusedLayerNorm (served)",
    "apex.contrib.multihead_attn": "torch.nn.MultiheadAttention or "
                                   "torch.nn.functional.scaled_dot_product_attention",
    "apex.contrib.fmha": "torch.nn.functional.scaled_dot_product_attention",
    "apex.contrib.groupbn": "torch.nn.BatchNorm2d / torch.nn.SyncBatchNorm",
    "apex.contrib.cudnn_gbn": "torch.nn.BatchNorm2d / torch.nn.SyncBatchNorm",
    "apex.contrib.group_norm": "torch.nn.GroupNorm",
    "apex.contrib.focal_loss": "torchvision.ops.sigmoid_focal_loss",
    "apex.contrib.sparsity": "torch.sparse.to_sparse_semi_structured (2:4 sparsity)",
    "apex.contrib.transducer": "torchaudio.functional.rnnt_loss",
    "apex.contrib.bottleneck": "torch.nn.Conv2d, BatchNorm2d and ReLU (torch.compile fuses them)",
    "apex.contrib.conv_bias_relu": "torch.nn.Conv2d and ReLU (torch.compile fuses them)",
    "apex.contrib.index_mul_2d": "torch.index_select followed by a multiply",
    "apex.transformer": "torch.distributed.tensor.parallel, or Megatron-LM; Apex's Megatron-style "
                        "parallel utilities are not provided",
    "apex.mlp": "torch.nn.Linear layers (amp_patch casts them under O1-O3)",
    "apex.RNN": "torch.nn.LSTM / GRU (supported under O1)",
    "apex.reparameterization": "torch.nn.utils.parametrizations.weight_norm",
    "apex.fused_dense": "torch.nn.Linear (amp_patch casts it under O1-O3)",
}


_HINTS.update({
    "transformer_engine": "transformer_engine.pytorch (Linear, LayerNorm, LayerNormLinear, "
                          "fp8_autocast) and transformer_engine.common.recipe (served)",
    "transformer_engine.common": "transformer_engine.common.recipe (DelayedScaling, "
                                 "Float8CurrentScaling, Format; served)",
    "transformer_engine.jax": "transformer_engine.pytorch (served)",
    "transformer_engine.pytorch.RMSNorm": "torch.nn.RMSNorm, or "
                                          "te.LayerNormLinear(normalization='RMSNorm')",
    "transformer_engine.pytorch.LayerNormMLP": "te.LayerNormLinear, an activation, then te.Linear",
    "transformer_engine.pytorch.TransformerLayer": _TE_BLOCKS,
    "transformer_engine.pytorch.MultiheadAttention": _TE_BLOCKS,
    "transformer_engine.pytorch.DotProductAttention":
        "torch.nn.functional.scaled_dot_product_attention",
    "transformer_engine.pytorch.GroupedLinear": "one te.Linear per group",
    "transformer_engine.pytorch.fp8_model_init": "plain te.Linear layers (the weights keep their "
                                                 "precision; their FP8 cast is per iteration)",
    "transformer_engine.pytorch.checkpoint": "torch.utils.checkpoint.checkpoint",
    "transformer_engine.pytorch.make_graphed_callables": "torch.cuda.make_graphed_callables",
    "transformer_engine.pytorch.distributed": "torch.distributed and torch.utils.checkpoint",
    "transformer_engine.pytorch.optimizers": "amp_patch.optimizers (FusedAdam, FusedSGD, ...)",
    "transformer_engine.common.recipe.MXFP8BlockScaling": "DelayedScaling or "
                                                          "Float8CurrentScaling",
    "transformer_engine.common.recipe.Float8BlockScaling": "Float8CurrentScaling, or "
                                                           "amp.initialize(fp8='rowwise')",
    "transformer_engine.common.recipe.NVFP4BlockScaling": "DelayedScaling or "
                                                          "Float8CurrentScaling (FP8)",
})
_HINTS.update({name: hint for name, hint in COMPILED_MODULES.items() if hint is not None})
_HINTS.update({f"fused_adam_cuda.{name}": "fused_adam_cuda.adam / adam_mt (served); the helpers of "
               "Apex's distributed optimizers are not provided"
               for name in ("reversible_adam", "maybe_adam_undo", "maybe_cast", "maybe_cast_mt",
                            "strided_check_finite")})


class ApexUnsupportedError(ImportError):
    """An ``apex`` name that amp_patch's compatibility layer does not provide."""


def _hint(name: str) -> str | None:
    # The longest matching key wins: apex.amp.scaler's hint over apex's.
    keys = [k for k in _HINTS if name == k or name.startswith(k + ".")]
    return _HINTS[max(keys, key=len)] if keys else None


def unsupported_message(name: str) -> str:
    """The error message for the unsupported name ``name`` (e.g. ``"apex.contrib.xyz"``)."""
    hint = _hint(name)
    te = name.partition(".")[0] == _TE_ROOT
    supported = "; ".join(f"{n} ({m.what})" for n, m in MODULES.items()
                          if n not in ("apex", _TE_ROOT, f"{_TE_ROOT}.common")
                          and (n.partition(".")[0] == _TE_ROOT) == te)
    layer, doc = ("Transformer Engine", "docs/fp8.md") if te else ("Apex", "docs/migration.md")
    return (f"{name} is not supported by amp_patch's {layer} compatibility layer (amp-patch run)."
            + (f" Use instead: {hint}." if hint else "")
            + f" Supported: {supported}. See {doc}.")


def _public_names(module: types.ModuleType) -> list[str]:
    names = getattr(module, "__all__", None)
    if names is None:
        names = [n for n in vars(module) if not n.startswith("_")]
    return list(names)


class _ShimModule(types.ModuleType):
    """A served module: Apex's public names in ``__dict__``, the target's others on use."""

    def __init__(self, name: str, mapping: _Mapping, on_miss: Callable[[str], None]) -> None:
        super().__init__(name, f"{name}, served by amp_patch ({mapping.what}).")
        self._amp_patch_mapping = mapping
        self._amp_patch_on_miss = on_miss

    def _populate(self) -> None:
        mapping = self._amp_patch_mapping
        if mapping.target is None:
            prefix = self.__name__ + "."
            self.__all__ = [n for n in mapping.apex_all if prefix + n in MODULES]
            return
        target = importlib.import_module(mapping.target)
        names = [n for n in mapping.apex_all if hasattr(target, n)] or _public_names(target)
        for name in names:
            self.__dict__[name] = getattr(target, name)
        for name, source in mapping.extras.items():
            module, _, attr = source.partition(":")
            self.__dict__[name] = getattr(importlib.import_module(module), attr)
        self.__all__ = names

    def __getattr__(self, attr: str):
        if attr.startswith("__") or attr.startswith("_amp_patch_"):
            raise AttributeError(attr)
        mapping = self._amp_patch_mapping
        if mapping.target is None:
            if f"{self.__name__}.{attr}" in MODULES:
                return importlib.import_module(f"{self.__name__}.{attr}")
        else:
            target = importlib.import_module(mapping.target)
            if not attr.startswith("_") and attr in _public_names(target):
                return getattr(target, attr)
        name = f"{self.__name__}.{attr}"
        self._amp_patch_on_miss(name)
        raise AttributeError(unsupported_message(name))

    def __dir__(self) -> list[str]:
        return sorted(set(super().__dir__()) | set(getattr(self, "__all__", [])))


class _ShimLoader(importlib.abc.Loader):
    def __init__(self, finder: "ApexFinder") -> None:
        self._finder = finder

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        return _ShimModule(spec.name, MODULES[spec.name], self._finder.record_miss)

    def exec_module(self, module: types.ModuleType) -> None:
        """Fill the module's names, then load the submodules that share a name with one of them."""
        module._populate()
        # ``import apex.parallel.LARC`` would otherwise replace the attribute ``LARC`` (the
        # class) by the submodule; loaded here first, the import finds it in sys.modules
        # and leaves the parent alone, as Apex's own imports did.
        for child in MODULES:
            head, _, attr = child.rpartition(".")
            if head == module.__name__ and attr in module.__dict__ and child not in sys.modules:
                sub = importlib.util.module_from_spec(
                    importlib.util.spec_from_loader(child, self, is_package=True))
                sys.modules[child] = sub
                self.exec_module(sub)


class ApexFinder(importlib.abc.MetaPathFinder):
    """Finds ``apex``, ``apex.*`` and Apex's compiled modules' imports, served from amp_patch.

    Args:
        roots (set of str): the top-level names to answer (``"apex"``,
            ``"amp_C"``, ``"fused_adam_cuda"``, ...: :data:`COMPILED_MODULES`); those
            that a real installation provides are left out
            by :func:`install` unless shadowing was asked for.

    Attributes:
        misses (dict): each Apex name asked for and not served, in order, to
            what to use instead (or None). Each is logged once, as a warning.
    """

    def __init__(self, roots: set[str]) -> None:
        self.roots = frozenset(roots)
        self.misses: dict[str, str | None] = {}
        self._loader = _ShimLoader(self)

    def record_miss(self, name: str) -> None:
        """Log, once per name, that the script asked for an Apex name amp_patch does not serve."""
        if name in self.misses:
            return
        hint = _hint(name)
        self.misses[name] = hint
        logger.warning("%s is not provided by amp_patch%s. If the script catches this ImportError "
                       "it now runs without it.", name, f"; use instead: {hint}" if hint else
                       " (docs/migration.md lists what is served)")

    def find_spec(self, fullname: str, path=None, target=None):
        if fullname.partition(".")[0] not in self.roots:
            return None
        mapping = MODULES.get(fullname)
        if mapping is None:
            self.record_miss(fullname)
            raise ApexUnsupportedError(unsupported_message(fullname), name=fullname)
        return importlib.util.spec_from_loader(fullname, self._loader, is_package=True)


_ROOTS = ("apex", *COMPILED_MODULES, _TE_ROOT)


def real_installations() -> dict[str, str]:
    """Top-level names among ``apex`` and Apex's compiled modules that a real installation
    provides, with its origin."""
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
