"""The O1 cast lists: data only.

A list names ops, not spellings. :mod:`amp_patch.patching.op_spellings` finds
every place where the installed torch exposes each op (``torch``,
``torch.nn.functional``, the ``Tensor`` method and its operators, the
in-place forms, ``torch.special`` and ``torch.linalg``, the aliases that
torch documents) and gives each the op's policy. So ``torch.softmax``,
``x.softmax`` and ``F.softmax`` cast alike, and a new torch release is
covered without editing these lists.

O1 casts by the union of two sources:

- :data:`APEX`: what Apex's amp patched (its ``lists/`` and RNN support),
  named as ops (Apex's ``Tensor.__matmul__`` is the op ``matmul``).
- :data:`AUTOCAST_CUDA`: ``torch.autocast``'s CUDA lists, copied from the
  ``AT_FORALL_*`` op lists of ``aten/src/ATen/autocast_mode.h`` and the
  CUDA registrations of ``autocast_mode.cpp`` in torch
  :data:`AUTOCAST_TORCH_VERSION`. ``fp32_set_opt_dtype`` and
  ``fp32_append_dtype`` ops are on the fp32 list: O1 casts their inputs,
  which gives the same fp32 result.

Op names follow ATen: ``linalg_vecdot`` is spelled ``torch.linalg.vecdot``
in Python. Ops that the installed torch does not expose in any patched
namespace are skipped.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

__all__ = [
    "OpLists", "APEX", "AUTOCAST_CUDA", "AUTOCAST_TORCH_VERSION", "O1", "VF_OPS",
    "OPERATOR_NAMES", "NATIVE_PROMOTION", "BCE_MESSAGE", "union",
]


@dataclass(frozen=True)
class OpLists:
    """Op names by policy.

    Args:
        half (tuple of str): cast floating args to ``half_dtype``.
        fp32 (tuple of str): cast floating args to fp32.
        promote (tuple of str): cast mixed floating args to the widest.
        sequence_promote (tuple of str): promote over the tensors of the first arg.
        banned (tuple of (str, str)): op name and message; raise on half args.

    In-place forms (``exp_``, ``add_``, ``__iadd__``) are derived: those of
    fp32 ops raise on a half ``self``; those of half and promote ops cast
    their other args to ``self``'s dtype.
    """

    half: tuple[str, ...] = ()
    fp32: tuple[str, ...] = ()
    promote: tuple[str, ...] = ()
    sequence_promote: tuple[str, ...] = ()
    banned: tuple[tuple[str, str], ...] = ()

    def policies(self) -> dict[str, str]:
        """``{op: policy name}`` over every list (``"banned"`` included)."""
        out = {}
        for f in fields(self):
            for entry in getattr(self, f.name):
                out[entry[0] if f.name == "banned" else entry] = f.name
        return out


def union(*sources: OpLists) -> OpLists:
    """The lists of all ``sources`` merged, first occurrence first.

    Raises:
        ValueError: if one op is on lists of different policies.
    """
    seen: dict[str, str] = {}
    for source in sources:
        for op, policy in source.policies().items():
            if seen.setdefault(op, policy) != policy:
                raise ValueError(f"op {op!r} is on the {seen[op]} and the {policy} lists")
    merged = {}
    for f in fields(OpLists):
        entries = [e for source in sources for e in getattr(source, f.name)]
        merged[f.name] = tuple(dict.fromkeys(entries))
    return OpLists(**merged)


BCE_MESSAGE = (
    "binary_cross_entropy is unsafe in {dtype}: the sigmoid before it loses precision and "
    "its log saturates. Use torch.nn.functional.binary_cross_entropy_with_logits or "
    "torch.nn.BCEWithLogitsLoss, which fuse the sigmoid into the loss and are safe under "
    "amp_patch O1. To run binary_cross_entropy in fp32 anyway, pass allow_banned=True."
)

RNN_CELLS = ("lstm_cell", "gru_cell", "rnn_tanh_cell", "rnn_relu_cell")
#: What nn.RNN/GRU/LSTM call: the whole-sequence kernels (plain and packed).
RNN_SEQUENCE = ("lstm", "gru", "rnn_tanh", "rnn_relu")
#: The ops that ``torch.nn``'s recurrent modules reach through ``torch._VF`` (see rnn.py).
VF_OPS = RNN_SEQUENCE + RNN_CELLS

APEX = OpLists(
    half=(
        "conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d",
        "conv_tbc", "prelu", "addmm", "addmv", "addr", "matmul", "mm", "mv", "addbmm", "baddbmm",
        "bmm", "linear",
    ) + RNN_SEQUENCE + RNN_CELLS,
    fp32=(
        "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "reciprocal",
        "rsqrt", "sinh", "tan", "pow", "cumprod", "cumsum", "dist", "norm", "prod", "std", "sum",
        "var", "renorm",
        "interpolate", "grid_sample", "softplus", "softmin", "log_softmax", "softmax", "gelu",
        "layer_norm", "group_norm", "local_response_norm", "normalize", "cosine_similarity",
        "poisson_nll_loss", "cosine_embedding_loss", "cross_entropy", "hinge_embedding_loss",
        "kl_div", "l1_loss", "mse_loss", "margin_ranking_loss", "multilabel_margin_loss",
        "multilabel_soft_margin_loss", "multi_margin_loss", "nll_loss",
        "binary_cross_entropy_with_logits", "smooth_l1_loss", "soft_margin_loss",
        "triplet_margin_loss", "ctc_loss",
        # Apex's rule: a tensor leaves for the host in fp32.
        "cpu",
    ),
    promote=(
        "addcdiv", "addcmul", "atan2", "cross", "bilinear", "dot", "add", "div", "mul", "sub",
        "eq", "equal", "ge", "gt", "le", "lt", "ne",
    ),
    sequence_promote=("cat", "stack"),
    banned=(("binary_cross_entropy", BCE_MESSAGE),),
)

#: The torch release whose autocast lists :data:`AUTOCAST_CUDA` copies.
AUTOCAST_TORCH_VERSION = "2.13.0"

AUTOCAST_CUDA = OpLists(
    # AT_FORALL_LOWER_PRECISION_FP, and cudnn_convolution(_transpose) from autocast_mode.cpp.
    half=(
        "_convolution", "conv1d", "conv2d", "conv3d", "conv_tbc", "conv_transpose1d",
        "conv_transpose2d", "conv_transpose3d", "convolution", "prelu", "addmm", "addmv", "addr",
        "matmul", "einsum", "mm", "mv", "linalg_vecdot", "linear", "addbmm", "baddbmm", "bmm",
        "chain_matmul", "linalg_multi_dot", "_thnn_fused_lstm_cell", "_thnn_fused_gru_cell",
        "lstm_cell", "gru_cell", "rnn_tanh_cell", "rnn_relu_cell",
        "_scaled_dot_product_flash_attention", "scaled_dot_product_attention",
        "cudnn_convolution", "cudnn_convolution_transpose",
    ),
    # AT_FORALL_FP32, AT_FORALL_FP32_SET_OPT_DTYPE, AT_FORALL_DIFFERENT_REDISPATCH_SIGNATURE.
    fp32=(
        "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p",
        "reciprocal", "rsqrt", "sinh", "tan", "pow", "softplus", "layer_norm",
        "native_layer_norm", "rms_norm", "group_norm", "frobenius_norm", "nuclear_norm",
        "cosine_similarity", "poisson_nll_loss", "cosine_embedding_loss", "nll_loss",
        "nll_loss2d", "hinge_embedding_loss", "kl_div", "l1_loss", "smooth_l1_loss", "huber_loss",
        "mse_loss", "margin_ranking_loss", "multilabel_margin_loss", "soft_margin_loss",
        "triplet_margin_loss", "multi_margin_loss", "binary_cross_entropy_with_logits", "dist",
        "pdist", "cdist", "renorm", "logsumexp", "upsample_nearest1d", "_upsample_nearest_exact1d",
        "upsample_nearest2d", "_upsample_nearest_exact2d", "upsample_nearest3d",
        "_upsample_nearest_exact3d", "upsample_linear1d", "upsample_bilinear2d",
        "_upsample_bilinear2d_aa", "upsample_trilinear3d", "upsample_bicubic2d",
        "_upsample_bicubic2d_aa",
        "prod", "softmax", "log_softmax", "cumprod", "cumsum", "linalg_vector_norm",
        "linalg_matrix_norm", "sum",
        "norm",
    ),
    # AT_FORALL_PROMOTE.
    promote=(
        "addcdiv", "addcmul", "atan2", "bilinear", "cross", "dot", "vdot", "grid_sampler",
        "index_put", "tensordot", "scatter_add",
    ),
    banned=(("binary_cross_entropy", BCE_MESSAGE),),
)

#: Every op O1 casts, by policy.
O1 = union(APEX, AUTOCAST_CUDA)

#: The promote ops whose own type promotion computes what O1's cast to the widest dtype would,
#: when the two tensors are both 0-dim or neither: elementwise ops that widen each element
#: exactly and compute in the wider dtype, and whose backward autograd narrows to each input's
#: dtype as the cast's backward would. O1 calls them uncast then: the same values and grads,
#: without a cast and its autograd node (docs/o1_lists.md, "Promote").
NATIVE_PROMOTION = frozenset({"add", "sub", "mul", "div", "eq", "ne", "lt", "le", "gt", "ge"})

#: Python's operator names where they differ from the op's (``a / b`` is ``div``).
#: Each also gives the reflected and in-place forms (``__rtruediv__``, ``__itruediv__``).
OPERATOR_NAMES = {"div": ("truediv",)}
