"""The O1 cast lists: data only.

Each namespace (``torch``, ``torch.nn.functional``, ``torch.Tensor``,
``torch._VF``) gets a :class:`CastLists`. The names are the union of what
Apex patched and what ``torch.autocast`` casts; names that the installed
torch lacks are skipped when patching. Dotted names (``linalg.multi_dot``)
are resolved from the namespace.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["CastLists", "TORCH", "FUNCTIONAL", "TENSOR", "VF", "BCE_MESSAGE", "in_place"]


@dataclass(frozen=True)
class CastLists:
    """The names of one namespace, by policy.

    Args:
        half (tuple of str): cast floating args to ``half_dtype``.
        fp32 (tuple of str): cast floating args to fp32.
        promote (tuple of str): cast mixed floating args to the widest.
        sequence_promote (tuple of str): promote over the tensors of the first arg.
        banned (tuple of (str, str)): name and message; raise on half args.
        in_place_fp32 (tuple of str): in-place forms of fp32 functions: raise
            when ``self`` is half, else cast the other args to ``self``'s dtype.
        in_place (tuple of str): other in-place forms: cast the other args to
            ``self``'s dtype.
    """

    half: tuple[str, ...] = ()
    fp32: tuple[str, ...] = ()
    promote: tuple[str, ...] = ()
    sequence_promote: tuple[str, ...] = ()
    banned: tuple[tuple[str, str], ...] = ()
    in_place_fp32: tuple[str, ...] = ()
    in_place: tuple[str, ...] = ()


def _unique(names: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(dict.fromkeys(names))


def in_place(names: tuple[str, ...]) -> tuple[str, ...]:
    """The in-place spelling (``exp`` -> ``exp_``) of each plain name; dunders and dotted names have none."""
    return tuple(n + "_" for n in names if not n.startswith("__") and "." not in n)


BCE_MESSAGE = (
    "binary_cross_entropy is unsafe in {dtype}: the sigmoid before it loses precision and "
    "its log saturates. Use torch.nn.functional.binary_cross_entropy_with_logits or "
    "torch.nn.BCEWithLogitsLoss, which fuse the sigmoid into the loss and are safe under "
    "amp_patch O1. To run binary_cross_entropy in fp32 anyway, pass allow_banned=True."
)

RNN_CELLS = ("lstm_cell", "gru_cell", "rnn_tanh_cell", "rnn_relu_cell")
#: What nn.RNN/GRU/LSTM call: the whole-sequence kernels (plain and packed).
RNN_SEQUENCE = ("lstm", "gru", "rnn_tanh", "rnn_relu")

_TORCH_HALF = (
    "conv1d", "conv2d", "conv3d", "conv_tbc", "conv_transpose1d", "conv_transpose2d",
    "conv_transpose3d", "convolution", "prelu", "addmm", "addmv", "addr", "matmul", "mm", "mv",
    "bmm", "baddbmm", "addbmm", "einsum", "chain_matmul", "linalg.multi_dot", "linalg.vecdot",
) + RNN_CELLS

_POINTWISE_FP32 = (
    "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p",
    "reciprocal", "rsqrt", "sinh", "tan", "pow",
)
_REDUCTION_FP32 = (
    "cumprod", "cumsum", "dist", "norm", "prod", "std", "sum", "var", "logsumexp", "renorm",
    "pdist", "cdist",
)
_TORCH_FP32 = _POINTWISE_FP32 + _REDUCTION_FP32

_TORCH_PROMOTE = (
    "addcdiv", "addcmul", "atan2", "cross", "bilinear", "dot", "vdot", "tensordot", "index_put",
    "scatter_add", "add", "sub", "mul", "div", "eq", "ne", "lt", "le", "gt", "ge",
)
_SEQUENCE_PROMOTE = ("cat", "stack")

TORCH = CastLists(
    half=_TORCH_HALF,
    fp32=_TORCH_FP32,
    promote=_TORCH_PROMOTE,
    sequence_promote=_SEQUENCE_PROMOTE,
    in_place_fp32=in_place(_TORCH_FP32),
    in_place=in_place(_TORCH_HALF + _TORCH_PROMOTE),
)

_F_FP32 = (
    "softmax", "log_softmax", "softmin", "softplus", "gelu", "layer_norm", "group_norm",
    "rms_norm", "local_response_norm", "normalize", "cosine_similarity", "interpolate",
    "grid_sample",
)
_LOSSES_FP32 = (
    "cross_entropy", "nll_loss", "kl_div", "l1_loss", "mse_loss", "smooth_l1_loss", "huber_loss",
    "poisson_nll_loss", "cosine_embedding_loss", "hinge_embedding_loss", "margin_ranking_loss",
    "multilabel_margin_loss", "multilabel_soft_margin_loss", "multi_margin_loss",
    "soft_margin_loss", "triplet_margin_loss", "ctc_loss", "binary_cross_entropy_with_logits",
)

FUNCTIONAL = CastLists(
    half=(
        "linear", "conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d",
        "conv_transpose3d", "conv_tbc", "scaled_dot_product_attention",
    ),
    fp32=_F_FP32 + _LOSSES_FP32,
    banned=(("binary_cross_entropy", BCE_MESSAGE),),
)

# Apex's rule, kept: almost every torch function is also a Tensor method, so the
# Tensor lists are the Tensor-only names plus the torch lists (missing ones skipped).
_TENSOR_PROMOTE_OPERATORS = (
    "__add__", "__radd__", "__sub__", "__rsub__", "__mul__", "__rmul__", "__truediv__",
    "__rtruediv__", "__div__", "__rdiv__", "__eq__", "__ne__", "__lt__", "__le__", "__gt__",
    "__ge__",
)
TENSOR = CastLists(
    half=_unique(("__matmul__", "matmul", "mm", "mv", "bmm", "addmm", "baddbmm") + _TORCH_HALF),
    fp32=_unique(("__pow__", "__rpow__", "pow", "cpu") + _TORCH_FP32),
    promote=_TENSOR_PROMOTE_OPERATORS + _TORCH_PROMOTE,
    sequence_promote=(),
    in_place_fp32=_unique(("__ipow__",) + in_place(_TORCH_FP32)),
    in_place=("__iadd__", "__isub__", "__imul__", "__itruediv__", "__idiv__")
    + in_place(_TORCH_HALF + _TORCH_PROMOTE),
)

# nn.RNNBase and the nn.*Cell modules call these through ``torch._VF`` (see rnn.py).
VF = CastLists(half=RNN_SEQUENCE + RNN_CELLS)
