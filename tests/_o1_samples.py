"""Tiny sample inputs for every op in the O1 cast lists (shared by the O1 tests).

``SAMPLES[op](make)`` returns ``(args, kwargs)``; ``make(*shape)`` builds a
floating tensor in the dtype under test (values in (0.1, 0.9), so logs, roots
and inverse trig are defined). Integer arguments (targets, indices) are int64
whatever the dtype. The first arg is ``self`` for the method form. A spelling
whose signature differs from its op's has its own entry, keyed by its
qualified name (``"torch.kl_div"``).
"""

from __future__ import annotations

import pytest
import torch

from amp_patch.patching import wrappers

L = torch.long


def _lstm(make):
    return (make(2, 4), (make(2, 5), make(2, 5)), make(20, 4), make(20, 5)), {}


def _sequence(gates, lstm=False):
    # _VF.lstm(input, hx, params, has_biases, num_layers, dropout, train, bidirectional,
    # batch_first); the others take a tensor hx.
    def build(make):
        hx = (make(1, 2, 5), make(1, 2, 5)) if lstm else make(1, 2, 5)
        params = [make(gates * 5, 4), make(gates * 5, 5), make(gates * 5), make(gates * 5)]
        return (make(3, 2, 4), hx, params, True, 1, 0.0, False, False, False), {}
    return build


def _cell(gates):
    return lambda make: ((make(2, 4), make(2, 5), make(gates * 5, 4), make(gates * 5, 5)), {})


SAMPLES = {
    # half
    "conv1d": lambda m: ((m(1, 2, 5), m(3, 2, 3)), {}),
    "conv2d": lambda m: ((m(1, 2, 4, 4), m(3, 2, 3, 3)), {}),
    "conv3d": lambda m: ((m(1, 2, 3, 3, 3), m(3, 2, 2, 2, 2)), {}),
    "conv_tbc": lambda m: ((m(5, 1, 2), m(3, 2, 4), m(4)), {}),
    "conv_transpose1d": lambda m: ((m(1, 2, 5), m(2, 3, 3)), {}),
    "conv_transpose2d": lambda m: ((m(1, 2, 3, 3), m(2, 3, 2, 2)), {}),
    "conv_transpose3d": lambda m: ((m(1, 2, 2, 2, 2), m(2, 3, 2, 2, 2)), {}),
    "convolution": lambda m: ((m(1, 2, 4, 4), m(3, 2, 3, 3), None, [1, 1], [0, 0], [1, 1],
                               False, [0, 0], 1), {}),
    "prelu": lambda m: ((m(1, 2, 3), m(2)), {}),
    "addmm": lambda m: ((m(2, 3), m(2, 4), m(4, 3)), {}),
    "addmv": lambda m: ((m(2), m(2, 3), m(3)), {}),
    "addr": lambda m: ((m(2, 3), m(2), m(3)), {}),
    "matmul": lambda m: ((m(2, 3), m(3, 4)), {}),
    "__matmul__": lambda m: ((m(2, 3), m(3, 4)), {}),
    "mm": lambda m: ((m(2, 3), m(3, 4)), {}),
    "mv": lambda m: ((m(2, 3), m(3)), {}),
    "bmm": lambda m: ((m(2, 2, 3), m(2, 3, 4)), {}),
    "baddbmm": lambda m: ((m(2, 2, 4), m(2, 2, 3), m(2, 3, 4)), {}),
    "addbmm": lambda m: ((m(2, 4), m(2, 2, 3), m(2, 3, 4)), {}),
    "einsum": lambda m: (("ij,jk->ik", m(2, 3), m(3, 4)), {}),
    "chain_matmul": lambda m: ((m(2, 3), m(3, 4), m(4, 2)), {}),
    "linalg_multi_dot": lambda m: (([m(2, 3), m(3, 4), m(4, 2)],), {}),
    "linalg_vecdot": lambda m: ((m(2, 3), m(2, 3)), {}),
    "_convolution": lambda m: ((m(1, 2, 4, 4), m(3, 2, 3, 3), None, [1, 1], [0, 0], [1, 1],
                                False, [0, 0], 1, False, False, True, True), {}),
    # No CPU kernel: the tests check the dtypes that reach the kernel (see reached_dtypes).
    "cudnn_convolution": lambda m: ((m(1, 2, 4, 4), m(3, 2, 3, 3), [0, 0], [1, 1], [1, 1], 1,
                                     False, False, False), {}),
    "cudnn_convolution_transpose": lambda m: ((m(1, 2, 4, 4), m(2, 3, 3, 3), [0, 0], [0, 0],
                                               [1, 1], [1, 1], 1, False, False, False), {}),
    "_scaled_dot_product_flash_attention": lambda m: ((m(1, 2, 3, 8), m(1, 2, 3, 8),
                                                       m(1, 2, 3, 8)), {}),
    "torch.Tensor.__rmatmul__": lambda m: ((m(3, 4), m(2, 3)), {}),
    "lstm": _sequence(4, lstm=True),
    "gru": _sequence(3),
    "rnn_tanh": _sequence(1),
    "rnn_relu": _sequence(1),
    "lstm_cell": _lstm,
    "gru_cell": _cell(3),
    "rnn_tanh_cell": _cell(1),
    "rnn_relu_cell": _cell(1),
    "linear": lambda m: ((m(2, 4), m(3, 4), m(3)), {}),
    "scaled_dot_product_attention": lambda m: ((m(1, 2, 3, 4), m(1, 2, 3, 4), m(1, 2, 3, 4)), {}),
    # fp32: pointwise and reductions
    **{n: (lambda m: ((m(2, 3),), {})) for n in (
        "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p",
        "reciprocal", "rsqrt", "sinh", "tan", "norm", "prod", "std", "sum", "var", "cpu",
        "softplus", "gelu", "normalize")},
    "pow": lambda m: ((m(2, 3), m(2, 3)), {}),
    "__pow__": lambda m: ((m(2, 3), m(2, 3)), {}),
    "__rpow__": lambda m: ((m(2, 3), 2.0), {}),
    "cumprod": lambda m: ((m(2, 3), 1), {}),
    "cumsum": lambda m: ((m(2, 3), 1), {}),
    "logsumexp": lambda m: ((m(2, 3), 1), {}),
    "dist": lambda m: ((m(2, 3), m(2, 3)), {}),
    "renorm": lambda m: ((m(2, 3), 2, 0, 1.0), {}),
    "pdist": lambda m: ((m(3, 4),), {}),
    "cdist": lambda m: ((m(2, 3), m(4, 3)), {}),
    "softmax": lambda m: ((m(2, 3), -1), {}),
    "log_softmax": lambda m: ((m(2, 3), -1), {}),
    "softmin": lambda m: ((m(2, 3), -1), {}),
    "layer_norm": lambda m: ((m(2, 3), (3,)), {}),
    "native_layer_norm": lambda m: ((m(2, 3), (3,), m(3), m(3), 1e-5), {}),
    "frobenius_norm": lambda m: ((m(2, 3), [0, 1]), {}),
    "nuclear_norm": lambda m: ((m(2, 3),), {}),
    "linalg_vector_norm": lambda m: ((m(2, 3),), {}),
    "linalg_matrix_norm": lambda m: ((m(2, 3),), {}),
    "group_norm": lambda m: ((m(2, 4, 3), 2), {}),
    "rms_norm": lambda m: ((m(2, 3), (3,)), {}),
    "local_response_norm": lambda m: ((m(1, 4, 3), 2), {}),
    "cosine_similarity": lambda m: ((m(2, 3), m(2, 3)), {}),
    "interpolate": lambda m: ((m(1, 2, 4),), {"scale_factor": 2.0}),
    "grid_sample": lambda m: ((m(1, 2, 3, 3), m(1, 2, 2, 2) * 2 - 1), {"align_corners": False}),
    # fp32: losses
    "cross_entropy": lambda m: ((m(2, 3), torch.tensor([0, 2])), {}),
    "nll_loss": lambda m: ((m(2, 3), torch.tensor([0, 2])), {}),
    "kl_div": lambda m: ((m(2, 3), m(2, 3)), {"reduction": "batchmean"}),
    "torch.kl_div": lambda m: ((m(2, 3), m(2, 3)), {}),
    "l1_loss": lambda m: ((m(2, 3), m(2, 3)), {}),
    "mse_loss": lambda m: ((m(2, 3), m(2, 3)), {}),
    "smooth_l1_loss": lambda m: ((m(2, 3), m(2, 3)), {}),
    "huber_loss": lambda m: ((m(2, 3), m(2, 3)), {}),
    "poisson_nll_loss": lambda m: ((m(2, 3), m(2, 3)), {}),
    "torch.poisson_nll_loss": lambda m: ((m(2, 3), m(2, 3), True, False, 1e-8, 1), {}),
    "cosine_embedding_loss": lambda m: ((m(2, 3), m(2, 3), torch.tensor([1, -1])), {}),
    "hinge_embedding_loss": lambda m: ((m(2, 3), torch.tensor([[1, -1, 1], [-1, 1, 1]])), {}),
    "margin_ranking_loss": lambda m: ((m(2), m(2), torch.tensor([1, -1])), {}),
    "multilabel_margin_loss": lambda m: ((m(2, 3), torch.tensor([[0, -1, 0], [2, 1, -1]])), {}),
    "multilabel_soft_margin_loss": lambda m: ((m(2, 3), torch.tensor([[0, 1, 0], [1, 1, 0]])), {}),
    "multi_margin_loss": lambda m: ((m(2, 3), torch.tensor([0, 2])), {}),
    "soft_margin_loss": lambda m: ((m(2, 3), torch.tensor([[1, -1, 1], [-1, 1, 1]])), {}),
    "triplet_margin_loss": lambda m: ((m(2, 3), m(2, 3), m(2, 3)), {}),
    "ctc_loss": lambda m: ((m(5, 1, 3), torch.tensor([[1, 2]]), torch.tensor([5]),
                            torch.tensor([2])), {}),
    "binary_cross_entropy_with_logits": lambda m: ((m(2, 3), m(2, 3)), {}),
    "binary_cross_entropy": lambda m: ((m(2, 3), m(2, 3)), {}),
    # promote
    "addcdiv": lambda m: ((m(2, 3), m(2, 3), m(2, 3)), {}),
    "addcmul": lambda m: ((m(2, 3), m(2, 3), m(2, 3)), {}),
    "atan2": lambda m: ((m(2, 3), m(2, 3)), {}),
    "cross": lambda m: ((m(2, 3), m(2, 3)), {"dim": 1}),
    "bilinear": lambda m: ((m(2, 3), m(2, 4), m(5, 3, 4)), {}),
    "dot": lambda m: ((m(3), m(3)), {}),
    "vdot": lambda m: ((m(3), m(3)), {}),
    "tensordot": lambda m: ((m(2, 3), m(3, 4)), {"dims": 1}),
    "index_put": lambda m: ((m(3), (torch.tensor([1]),), m(1)), {}),
    "grid_sampler": lambda m: ((m(1, 2, 3, 3), m(1, 2, 2, 2) * 2 - 1, 0, 0, False), {}),
    "equal": lambda m: ((m(2, 3), m(2, 3)), {}),
    "scatter_add": lambda m: ((m(3), 0, torch.tensor([0, 2]), m(2)), {}),
    **{n: (lambda m: ((m(2, 3), m(2, 3)), {})) for n in (
        "add", "sub", "mul", "div", "eq", "ne", "lt", "le", "gt", "ge", "__add__", "__radd__",
        "__sub__", "__rsub__", "__mul__", "__rmul__", "__truediv__", "__rtruediv__", "__div__",
        "__rdiv__", "__eq__", "__ne__", "__lt__", "__le__", "__gt__", "__ge__", "__iadd__",
        "__isub__", "__imul__", "__itruediv__", "__idiv__", "__ipow__")},
    # sequence promote
    "cat": lambda m: (([m(2, 3), m(2, 3)],), {}),
    "stack": lambda m: (([m(2, 3), m(2, 3)],), {}),
}


def maker(dtype: torch.dtype, requires_grad: bool = False, seed: int = 0):
    """``make(*shape)`` for :data:`SAMPLES`: tensors of ``dtype`` with values in (0.1, 0.9)."""
    gen = torch.Generator().manual_seed(seed)

    def make(*shape):
        t = (torch.rand(*shape, generator=gen) * 0.8 + 0.1).to(dtype)
        return t.requires_grad_() if requires_grad else t
    return make


def sample(spelling, dtype: torch.dtype, requires_grad: bool = False):
    """``(args, kwargs)`` for a :class:`~amp_patch.patching.Spelling` (its own entry, else
    its op's), or for an op name."""
    if isinstance(spelling, str):
        return SAMPLES[spelling](maker(dtype, requires_grad))
    build = SAMPLES.get(spelling.qualname) or SAMPLES[spelling.op]
    return build(maker(dtype, requires_grad))


#: Ops with no kernel for CPU tensors: their casts are checked where they reach the kernel.
NO_CPU_KERNEL = {"cudnn_convolution", "cudnn_convolution_transpose",
                 "_scaled_dot_product_flash_attention"}


def call(spelling, args, kwargs):
    """Call a spelling as user code would: a method on ``args[0]``, else the attribute."""
    if spelling.target is torch.Tensor:
        return getattr(args[0], spelling.name)(*args[1:], **kwargs)
    return getattr(spelling.target, spelling.name)(*args, **kwargs)


class _Reached(Exception):
    def __init__(self, dtypes):
        super().__init__(dtypes)
        self.dtypes = dtypes


def reached_dtypes(spelling, args, kwargs):
    """The dtypes of the floating tensors that reach the kernel of ``spelling.op``.

    The call is stopped there by a dispatch mode, so this works for kernels that
    do not exist on the CPU.
    """
    from torch.utils._python_dispatch import TorchDispatchMode

    class Stop(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, a=(), kw=None):
            if func.overloadpacket.__name__ == spelling.op:
                raise _Reached(tuple(t.dtype for t in floating(list(a) + list((kw or {}).values()))))
            return func(*a, **(kw or {}))

    try:
        with Stop():
            call(spelling, args, kwargs)
    except _Reached as reached:
        return reached.dtypes
    raise AssertionError(f"{spelling.qualname} never reached aten::{spelling.op}")


def floating(obj):
    """The floating tensors in ``obj`` (nested lists/tuples), in order."""
    if isinstance(obj, torch.Tensor):
        return [obj] if obj.is_floating_point() else []
    if isinstance(obj, (list, tuple)):
        return [t for item in obj for t in floating(item)]
    return []


def retype(obj, fn):
    """``obj`` with ``fn`` applied to every floating tensor (lists/tuples rebuilt)."""
    if isinstance(obj, torch.Tensor):
        return fn(obj) if obj.is_floating_point() else obj
    if isinstance(obj, (list, tuple)):
        return type(obj)(retype(item, fn) for item in obj)
    if isinstance(obj, dict):
        return {k: retype(v, fn) for k, v in obj.items()}
    return obj


#: The two implementations of the O1 wrappers: Python, and the C fast path (when built).
WRAPPER_PATHS = [
    "python",
    pytest.param("native", marks=pytest.mark.skipif(not wrappers.native_available(),
                                                    reason="extension not built")),
]


@pytest.fixture(params=WRAPPER_PATHS)
def wrapper_path(request, monkeypatch):
    """Which wrappers the next ``initialize`` installs (import this fixture into a test module)."""
    monkeypatch.setattr(wrappers, "_use_native", request.param == "native")
    return request.param
