"""``apex.fp16_utils`` for ``amp-patch run``: the manual mixed-precision helpers.

Apex's ``fp16_utils`` predates ``amp``: helpers to cast a network to half
while keeping batch norms in fp32, to keep fp32 master copies of the
parameters by hand, and :class:`FP16_Optimizer` with the old
:class:`LossScaler` / :class:`DynamicLossScaler`, which do the master weights
and loss scaling for a model the script made half itself (those three live
in :mod:`amp_patch.apex_compat.fp16_optimizer`). "fp16" means the half dtype
of the device, as everywhere in amp_patch: float16 on CUDA, bfloat16
elsewhere (fp16 matmuls on most CPUs are hundreds of times slower than fp32).
"""

from __future__ import annotations

from typing import Iterable

import torch
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torch.nn.modules.batchnorm import _BatchNorm

from amp_patch.apex_compat.fp16_optimizer import DynamicLossScaler, FP16_Optimizer, LossScaler
from amp_patch.casting.model import cast_module, cast_own_tensors

__all__ = [
    "FP16_Optimizer",
    "LossScaler",
    "DynamicLossScaler",
    "tofp16",
    "BN_convert_float",
    "network_to_half",
    "convert_module",
    "convert_network",
    "FP16Model",
    "prep_param_lists",
    "model_grads_to_master_grads",
    "master_params_to_model_params",
    "to_python_float",
    "clip_grad_norm",
]

#: torch's gradient-norm clipping, which Apex re-exported.
clip_grad_norm = nn.utils.clip_grad_norm_


def _half_for(device: torch.device) -> torch.dtype:
    return torch.float16 if device.type == "cuda" else torch.bfloat16


def _model_device(module: nn.Module) -> torch.device:
    for t in module.parameters():
        return t.device
    return torch.device("cpu")


class tofp16(nn.Module):  # noqa: N801 - Apex's name
    """Casts its floating input to a half dtype (the first module of :func:`network_to_half`).

    Args:
        dtype (torch.dtype, optional): the target. Default: float16 for CUDA
            inputs, bfloat16 otherwise.

    Example::

        >>> tofp16()(torch.ones(2)).dtype          # a CPU input
        torch.bfloat16
        >>> tofp16()(torch.arange(2)).dtype        # integers pass
        torch.int64
    """

    def __init__(self, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.dtype = dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not x.is_floating_point():
            return x
        return x.to(self.dtype or _half_for(x.device))


def BN_convert_float(module: nn.Module) -> nn.Module:  # noqa: N802 - Apex's name
    """Cast every affine batch norm in ``module`` back to fp32, in place.

    Args:
        module (torch.nn.Module): the (half) model.

    Returns:
        torch.nn.Module: ``module`` itself.

    Example::

        >>> net = BN_convert_float(nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)).half())
        >>> net[0].weight.dtype, net[1].weight.dtype
        (torch.float16, torch.float32)
    """
    for m in module.modules():
        if isinstance(m, _BatchNorm) and m.affine:
            m.float()
    return module


def network_to_half(network: nn.Module, dtype: torch.dtype | None = None) -> nn.Module:
    """Cast ``network`` to half with fp32 batch norms, behind a :class:`tofp16` input cast.

    Args:
        network (torch.nn.Module): the model.
        dtype (torch.dtype, optional): Default: float16 on CUDA, else bfloat16.

    Returns:
        torch.nn.Sequential: ``Sequential(tofp16(), network)``.

    Example::

        >>> net = network_to_half(nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)))
        >>> net(torch.randn(2, 4)).dtype        # on the CPU
        torch.bfloat16
    """
    dtype = dtype or _half_for(_model_device(network))
    return nn.Sequential(tofp16(dtype), BN_convert_float(network.to(dtype)))


def convert_module(module: nn.Module, dtype: torch.dtype) -> nn.Module:
    """Cast the floating parameters and buffers of ``module`` itself (not its children) to ``dtype``.

    Every floating dtype is cast, float64 included, as Apex did; their grads
    are cast too, and the tensors stay the same objects
    (:func:`amp_patch.casting.model.cast_own_tensors`).

    Args:
        module (torch.nn.Module): the module.
        dtype (torch.dtype): the target dtype.

    Returns:
        torch.nn.Module: ``module`` itself.

    Example::

        >>> seq = nn.Sequential(nn.Linear(4, 4))
        >>> convert_module(seq, torch.bfloat16)[0].weight.dtype    # the child is not cast
        torch.float32
    """
    cast_own_tensors(module, dtype, castable=None)
    return module


def convert_network(network: nn.Module, dtype: torch.dtype) -> nn.Module:
    """Cast ``network`` to ``dtype`` in place, leaving affine batch norms as they are.

    Each other module is cast as by :func:`convert_module`; recurrent modules
    then flatten their weights again, as Apex did.

    Args:
        network (torch.nn.Module): the model.
        dtype (torch.dtype): the target dtype.

    Returns:
        torch.nn.Module: ``network`` itself.

    Example::

        >>> net = convert_network(nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)), torch.float16)
        >>> net[0].weight.dtype, net[1].weight.dtype
        (torch.float16, torch.float32)
    """
    cast_module(network, dtype, keep_batchnorm_fp32=True, castable=None)
    for m in network.modules():
        if isinstance(m, nn.RNNBase):
            m.flatten_parameters()
    return network


class FP16Model(nn.Module):
    """A network converted to half (batch norms fp32) whose floating inputs are cast to half.

    Args:
        network (torch.nn.Module): the model, converted in place.
        dtype (torch.dtype, optional): Default: float16 on CUDA, else bfloat16.

    Example::

        >>> model = FP16Model(nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)))
        >>> model(torch.randn(2, 4)).dtype      # fp32 input cast on the way in (CPU: bf16)
        torch.bfloat16
    """

    def __init__(self, network: nn.Module, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.dtype = dtype or _half_for(_model_device(network))
        self.network = convert_network(network, self.dtype)

    def forward(self, *inputs):
        return self.network(*(x.to(self.dtype) if torch.is_tensor(x) and x.is_floating_point()
                              else x for x in inputs))


def prep_param_lists(model: nn.Module, flat_master: bool = False):
    """The model's trainable params and fp32 master copies of them.

    Args:
        model (torch.nn.Module): the (half) model.
        flat_master (bool, optional): one flat fp32 master tensor instead of
            one per parameter; needs all params of one dtype. Default: False.

    Returns:
        tuple: ``(model_params, master_params)``, both lists.

    Example::

        >>> model_params, master_params = prep_param_lists(nn.Linear(4, 4).half())
        >>> [(p.dtype, m.dtype) for p, m in zip(model_params, master_params)]
        [(torch.float16, torch.float32), (torch.float16, torch.float32)]
    """
    model_params = [p for p in model.parameters() if p.requires_grad]
    if flat_master:
        flat = _flatten_dense_tensors([p.detach() for p in model_params]).float()
        master = nn.Parameter(flat)
        master.grad = torch.zeros_like(master)
        return model_params, [master]
    masters = [nn.Parameter(p.detach().clone().float()) for p in model_params]
    return model_params, masters


def model_grads_to_master_grads(model_params: Iterable[torch.Tensor],
                                master_params: list[torch.Tensor], flat_master: bool = False) -> None:
    """Copy the model's grads into the fp32 masters' grads (None grads stay None).

    Args:
        model_params (iterable of Tensor): the model's params, from :func:`prep_param_lists`.
        master_params (list of Tensor): their masters, from the same call.
        flat_master (bool, optional): the masters are one flat tensor. Default: False.

    Example::

        >>> loss.backward()                   # grads on the half model
        >>> model_grads_to_master_grads(model_params, master_params)
        >>> optimizer.step()                  # an optimizer over master_params
    """
    model_params = list(model_params)
    if flat_master:
        master_params[0].grad.data.copy_(_flatten_dense_tensors([p.grad.data for p in model_params]))
        return
    for model, master in zip(model_params, master_params):
        if model.grad is None:
            master.grad = None
        elif master.grad is None:
            master.grad = model.grad.detach().float()
        else:
            master.grad.copy_(model.grad)


def master_params_to_model_params(model_params: Iterable[torch.Tensor],
                                  master_params: list[torch.Tensor], flat_master: bool = False) -> None:
    """Copy the fp32 masters' values back into the (half) model params.

    Args:
        model_params (iterable of Tensor): the model's params, from :func:`prep_param_lists`.
        master_params (list of Tensor): their masters, from the same call.
        flat_master (bool, optional): the masters are one flat tensor. Default: False.

    Example::

        >>> optimizer.step()                  # an optimizer over master_params
        >>> master_params_to_model_params(model_params, master_params)
    """
    model_params = list(model_params)
    if flat_master:
        for model, master in zip(model_params,
                                 _unflatten_dense_tensors(master_params[0].data, model_params)):
            model.data.copy_(master)
        return
    for model, master in zip(model_params, master_params):
        model.data.copy_(master.data)


def to_python_float(t) -> float:
    """A Python float from a one-element tensor (or a number).

    Args:
        t (Tensor or sequence): a one-element tensor, or a sequence whose first
            item is the number.

    Returns:
        float: the value.

    Example::

        >>> to_python_float(torch.tensor([2.5]))
        2.5
    """
    return t.item() if hasattr(t, "item") else float(t[0])
