"""``apex.parallel`` for ``amp-patch run``: DistributedDataParallel, SyncBatchNorm and LARC.

torch's :class:`~torch.nn.parallel.DistributedDataParallel` does what Apex's
did (bucketed all-reduce overlapped with backward), so Apex's class is torch's
with Apex's constructor arguments: the tuning ones are mapped or ignored, the
ones that change what is computed and that torch cannot express raise.
:class:`SyncBatchNorm` is torch's with Apex's arguments (``channel_last``,
``fuse_relu``) and Apex's ``forward(input, z=None)``. ``LARC`` is amp_patch's
(``amp_patch.apex_compat.larc``), re-exported here as Apex did.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from amp_patch.apex_compat.larc import LARC

__all__ = ["DistributedDataParallel", "SyncBatchNorm", "convert_syncbn_model",
           "create_syncbn_process_group", "ReduceOp", "LARC"]

logger = logging.getLogger("amp_patch")

#: torch.distributed's reduction ops, which Apex re-exported.
ReduceOp = dist.ReduceOp


#: Devices on which torch's SyncBatchNorm has its kernels; elsewhere the statistics are
#: all-reduced by :func:`_all_reduced_batch_norm`.
_TORCH_SYNC_DEVICES = ("cuda", "hpu", "xpu", torch._C._get_privateuse1_backend_name())


class SyncBatchNorm(_BatchNorm):
    """Apex's ``SyncBatchNorm``: torch's, with Apex's arguments and ``forward(input, z=None)``.

    Statistics are reduced over the process group in training when
    torch.distributed is initialized; otherwise it is a plain batch norm. On
    CUDA (and the other devices torch's :class:`~torch.nn.SyncBatchNorm` has
    kernels for) it runs torch's; on the CPU, where torch's refuses, the batch
    mean and variance are all-reduced with autograd-aware collectives, so the
    gradients are those of the whole batch too. It is not a
    :class:`torch.nn.SyncBatchNorm` instance, because DistributedDataParallel
    rejects those on the CPU.

    Args:
        num_features (int): the channel count ``C``.
        eps (float, optional): Default: 1e-5.
        momentum (float, optional): running-statistics momentum (None: cumulative
            average). Default: 0.1.
        affine (bool, optional): learn a scale and shift. Default: True.
        track_running_stats (bool, optional): Default: True.
        process_group (optional): the group to synchronise over. Default: the world.
        channel_last (bool, optional): the channel is the input's last
            dimension (``N, ..., C``) rather than its second. Default: False.
        fuse_relu (bool, optional): apply ReLU to the output (after adding
            ``z``). Default: False.

    Example::

        >>> bn = SyncBatchNorm(16, channel_last=True, fuse_relu=True)
        >>> bn(torch.randn(4, 8, 8, 16)).shape
        torch.Size([4, 8, 8, 16])
    """

    _check_input_dim = nn.SyncBatchNorm._check_input_dim
    _check_non_zero_input_channels = nn.SyncBatchNorm._check_non_zero_input_channels

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1,
                 affine: bool = True, track_running_stats: bool = True, process_group=None,
                 channel_last: bool = False, fuse_relu: bool = False) -> None:
        super().__init__(num_features, eps=eps, momentum=momentum, affine=affine,
                         track_running_stats=track_running_stats)
        self.process_group = process_group
        self.channel_last = channel_last
        self.fuse_relu = fuse_relu

    def forward(self, input: torch.Tensor, z: torch.Tensor | None = None) -> torch.Tensor:
        """Normalise ``input``, add ``z`` if given, then ReLU if ``fuse_relu``."""
        # A 2-d input is (N, C) either way, as in Apex.
        channel_last = self.channel_last and input.dim() > 2
        x = input.movedim(-1, 1) if channel_last else input
        if x.device.type in _TORCH_SYNC_DEVICES:
            out = nn.SyncBatchNorm.forward(self, x)
        else:  # torch's refuses to synchronise here, even over a world of one
            group = self._sync_group()
            out = _BatchNorm.forward(self, x) if group is None else self._synced_forward(x, group)
        if channel_last:
            out = out.movedim(1, -1)
        if z is not None:
            out = out + z
        return F.relu(out) if self.fuse_relu else out

    def _sync_group(self):
        """The group whose statistics to use, or None when this process's are the batch's."""
        if not (self.training and dist.is_available() and dist.is_initialized()):
            return None
        group = self.process_group or dist.group.WORLD
        return group if dist.get_world_size(group) > 1 else None

    def _synced_forward(self, x: torch.Tensor, group) -> torch.Tensor:
        # The bookkeeping of torch's forward in training; the statistics come from the group.
        self._check_input_dim(x)
        self._check_non_zero_input_channels(x)
        factor = 0.0 if self.momentum is None else self.momentum
        if self.track_running_stats:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:  # a cumulative average, as torch's
                factor = 1.0 / self.num_batches_tracked.item()
        tracked = self.track_running_stats
        return _all_reduced_batch_norm(x, self.weight, self.bias,
                                       self.running_mean if tracked else None,
                                       self.running_var if tracked else None,
                                       self.eps, factor, group)

    def extra_repr(self) -> str:
        return (super().extra_repr()
                + f", channel_last={self.channel_last}, fuse_relu={self.fuse_relu}")


def _all_reduced_batch_norm(x: torch.Tensor, weight, bias, running_mean, running_var,
                            eps: float, momentum: float, group) -> torch.Tensor:
    """Batch norm with the statistics of the whole group's batch, in fp32, differentiable.

    Two all-reduces (the sum with the count, then the sum of squared
    deviations) rather than one of sums and sums of squares, whose difference
    would cancel in fp32. Their backward all-reduces the gradients, which is
    what makes each rank's input gradient that of the whole batch.
    """
    from torch.distributed.nn.functional import all_reduce

    dims = [0, *range(2, x.dim())]
    shape = [1, -1] + [1] * (x.dim() - 2)
    xf = x.float()
    count = torch.full((1,), x.numel() // x.size(1), dtype=torch.float32, device=x.device)
    sums = all_reduce(torch.cat([xf.sum(dims), count]), group=group)
    n = sums[-1]
    mean = sums[:-1] / n
    centered = xf - mean.view(shape)
    var = all_reduce(centered.square().sum(dims), group=group) / n
    y = centered * torch.rsqrt(var + eps).view(shape)
    if weight is not None:
        y = y * weight.float().view(shape) + bias.float().view(shape)
    if running_mean is not None:
        with torch.no_grad():
            running_mean.mul_(1.0 - momentum).add_(mean * momentum)
            running_var.mul_(1.0 - momentum).add_(var * (n / (n - 1)) * momentum)
    return y.to(x.dtype)


class DistributedDataParallel(nn.parallel.DistributedDataParallel):
    """Apex's ``DistributedDataParallel``, as torch's.

    Like Apex's, it takes no ``device_ids``: the module stays on the device it
    is on. Gradients are averaged over the processes.

    Args:
        module (torch.nn.Module): the model, already on its device.
        message_size (int, optional): elements per all-reduce bucket; mapped
            to torch's ``bucket_cap_mb`` at 4 bytes per element. Default: 1e7.
        delay_allreduce (bool, optional): accepted; torch always overlaps the
            all-reduce with backward, which gives the same gradients.
        gradient_predivide_factor (float, optional): accepted; the result is
            the average either way, as in Apex.
        allreduce_always_fp32 (bool, optional): accepted with a warning:
            torch reduces gradients in their own dtype.
        gradient_average (bool, optional): only True is supported.
        shared_param, allreduce_trigger_params, allreduce_communicators:
            not supported; must be None.

    Other Apex arguments (``retain_allreduce_buffers``,
    ``num_allreduce_streams``, ``gradient_average_split_factor``, ``prof``)
    only tuned Apex's own implementation and are ignored.

    Raises:
        ValueError: an argument whose meaning torch's DDP cannot reproduce.
    """

    def __init__(self, module: nn.Module, message_size: int = 10_000_000,
                 delay_allreduce: bool = False, shared_param=None, allreduce_trigger_params=None,
                 retain_allreduce_buffers: bool = False, allreduce_always_fp32: bool = False,
                 num_allreduce_streams: int = 1, allreduce_communicators=None,
                 gradient_average: bool = True, gradient_predivide_factor: float = 1.0,
                 gradient_average_split_factor=None, prof: bool = False) -> None:
        for name, value in (("shared_param", shared_param),
                            ("allreduce_trigger_params", allreduce_trigger_params),
                            ("allreduce_communicators", allreduce_communicators)):
            if value is not None:
                raise ValueError(f"apex.parallel.DistributedDataParallel({name}=...) is not "
                                 "supported by amp_patch (it maps to torch's DistributedDataParallel)")
        if not gradient_average:
            raise ValueError("apex.parallel.DistributedDataParallel(gradient_average=False) is not "
                             "supported: torch's DistributedDataParallel always averages gradients")
        if allreduce_always_fp32:
            logger.warning("apex.parallel.DistributedDataParallel(allreduce_always_fp32=True): "
                           "torch all-reduces gradients in their own dtype")
        super().__init__(module, bucket_cap_mb=message_size * 4 / 2**20)


def convert_syncbn_model(module: nn.Module, process_group=None,
                         channel_last: bool = False) -> nn.Module:
    """Replace every batch norm in ``module`` by a :class:`SyncBatchNorm`, as Apex's did.

    The new layers take over the old ones' parameters (the same
    :class:`~torch.nn.Parameter` objects, so an optimizer made before still
    steps them) and running statistics.

    Args:
        module (torch.nn.Module): the model (or a single batch norm).
        process_group (optional): the group to synchronise over. Default: the world.
        channel_last (bool, optional): the new layers expect ``N, ..., C``
            inputs. Default: False.

    Returns:
        torch.nn.Module: the converted module (``module`` itself unless it is a batch norm).

    Example::

        >>> model = convert_syncbn_model(model)
    """
    out = module
    if isinstance(module, _BatchNorm):
        out = SyncBatchNorm(module.num_features, module.eps, module.momentum, module.affine,
                            module.track_running_stats, process_group, channel_last=channel_last)
        with torch.no_grad():
            if module.affine:
                out.weight, out.bias = module.weight, module.bias
            out.running_mean = module.running_mean
            out.running_var = module.running_var
            out.num_batches_tracked = module.num_batches_tracked
        out.train(module.training)
    for name, child in module.named_children():
        out.add_module(name, convert_syncbn_model(child, process_group, channel_last))
    return out


def create_syncbn_process_group(group_size: int):
    """Split the world into groups of ``group_size`` consecutive ranks; return this rank's.

    Every process must call it: each group is created on all of them.

    Args:
        group_size (int): ranks per group; 0 means the whole world (returns None).

    Returns:
        The process group of this rank, or None for the world.

    Raises:
        ValueError: ``group_size`` does not divide the world size.

    Example::

        >>> group = create_syncbn_process_group(2)
        >>> model = convert_syncbn_model(model, process_group=group)
    """
    if group_size == 0:
        return None
    world = dist.get_world_size()
    if group_size < 0 or group_size > world or world % group_size:
        raise ValueError(f"create_syncbn_process_group: group_size {group_size} must divide the "
                         f"world size {world}")
    mine = None
    for start in range(0, world, group_size):
        group = dist.new_group(ranks=list(range(start, start + group_size)))
        if start <= dist.get_rank() < start + group_size:
            mine = group
    return mine
