"""``apex.normalization`` for ``amp-patch run``: the fused norms are torch's norms.

torch's LayerNorm and RMSNorm have fused kernels and the same constructor
arguments as Apex's ``FusedLayerNorm`` and ``FusedRMSNorm``.
"""

from torch import nn

__all__ = ["FusedLayerNorm", "FusedRMSNorm"]

#: Apex's ``FusedLayerNorm(normalized_shape, eps=1e-5, elementwise_affine=True)``.
FusedLayerNorm = nn.LayerNorm


class FusedRMSNorm(nn.RMSNorm):
    """Apex's ``FusedRMSNorm``: torch's RMSNorm with Apex's default ``eps`` of 1e-5.

    Args:
        normalized_shape (int or tuple): the trailing shape to normalise over.
        eps (float, optional): Default: 1e-5 (torch's own default differs).
        elementwise_affine (bool, optional): learn a scale. Default: True.
    """

    def __init__(self, normalized_shape, eps: float = 1e-5, elementwise_affine: bool = True) -> None:
        super().__init__(normalized_shape, eps=eps, elementwise_affine=elementwise_affine)
