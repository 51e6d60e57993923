"""``apex.parallel`` for ``amp-patch run``: DistributedDataParallel and SyncBatchNorm on torch's.

torch's :class:`~torch.nn.parallel.DistributedDataParallel` does what Apex's
did (bucketed all-reduce overlapped with backward), so Apex's class is torch's
with Apex's constructor arguments: the tuning ones are mapped or ignored, the
ones that change what is computed and that torch cannot express raise.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

__all__ = ["DistributedDataParallel", "SyncBatchNorm", "convert_syncbn_model"]

logger = logging.getLogger("amp_patch")

#: torch's SyncBatchNorm; Apex's had the same constructor arguments.
SyncBatchNorm = nn.SyncBatchNorm


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


def convert_syncbn_model(module: nn.Module, process_group=None, channel_last: bool = False) -> nn.Module:
    """Replace every BatchNorm in ``module`` by :class:`torch.nn.SyncBatchNorm`, as Apex's did.

    Args:
        module (torch.nn.Module): the model.
        process_group (optional): the group to synchronise over. Default: the world.
        channel_last (bool, optional): only False is supported.

    Returns:
        torch.nn.Module: the converted module.
    """
    if channel_last:
        raise ValueError("apex.parallel.convert_syncbn_model(channel_last=True) is not supported")
    return nn.SyncBatchNorm.convert_sync_batchnorm(module, process_group)


del torch
