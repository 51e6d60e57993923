"""``apex.normalization`` for ``amp-patch run``: the fused norms are torch's norms.

torch's LayerNorm and RMSNorm have fused kernels. These classes are those
norms with Apex's constructor arguments: Apex's fourth positional argument
was ``memory_efficient`` (recompute in backward to save memory; the results
are the same), where torch's is ``bias``.
"""

from __future__ import annotations

from torch import nn

__all__ = ["FusedLayerNorm", "FusedRMSNorm"]


class _ApexNormArgs:
    """Apex's constructor arguments in front of a torch norm (the next class in the MRO)."""

    def __init__(self, normalized_shape, eps: float = 1e-5, elementwise_affine: bool = True,
                 memory_efficient: bool = False) -> None:
        super().__init__(normalized_shape, eps=eps, elementwise_affine=elementwise_affine)
        self.memory_efficient = memory_efficient


class FusedLayerNorm(_ApexNormArgs, nn.LayerNorm):
    """Apex's ``FusedLayerNorm``: torch's LayerNorm with Apex's arguments.

    Args:
        normalized_shape (int or tuple): the trailing shape to normalise over.
        eps (float, optional): Default: 1e-5.
        elementwise_affine (bool, optional): learn a scale and a shift. Default: True.
        memory_efficient (bool, optional): accepted; torch's kernel decides
            what it keeps for backward, and the results are the same. Default: False.

    Example::

        >>> FusedLayerNorm(64)(torch.randn(2, 64)).shape
        torch.Size([2, 64])
    """


class FusedRMSNorm(_ApexNormArgs, nn.RMSNorm):
    """Apex's ``FusedRMSNorm``: torch's RMSNorm with Apex's arguments and default ``eps`` of 1e-5.

    Args:
        normalized_shape (int or tuple): the trailing shape to normalise over.
        eps (float, optional): Default: 1e-5 (torch's own default differs).
        elementwise_affine (bool, optional): learn a scale. Default: True.
        memory_efficient (bool, optional): accepted, as for :class:`FusedLayerNorm`.
            Default: False.

    Example::

        >>> FusedRMSNorm(64)(torch.randn(2, 64)).shape
        torch.Size([2, 64])
    """
