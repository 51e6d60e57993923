"""``apex.contrib.xentropy``: ``SoftmaxCrossEntropyLoss``, Apex's fused label-smoothed loss.

Apex's ``xentropy_cuda`` kernel fused log-softmax and the label-smoothed
cross entropy per row; the served class computes the same per-row losses
with torch's ``log_softmax`` (in fp32 for half logits), and its backward is
autograd's.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

__all__ = ["SoftmaxCrossEntropyLoss"]


def _losses(logits: Tensor, labels: Tensor, smoothing: float, padding_idx: int,
            half_to_float: bool) -> Tensor:
    if logits.dim() != 2 or labels.dim() != 1 or labels.shape[0] != logits.shape[0]:
        raise ValueError(f"SoftmaxCrossEntropyLoss: expected logits [N, C] and labels [N], got "
                         f"{tuple(logits.shape)} and {tuple(labels.shape)}")
    logp = torch.log_softmax(logits.float(), dim=-1)
    nll = -logp.gather(1, labels.long().unsqueeze(1)).squeeze(1)
    losses = nll * (1.0 - smoothing) - logp.mean(dim=-1) * smoothing if smoothing else nll
    losses = losses.masked_fill(labels == padding_idx, 0.0)
    return losses if half_to_float else losses.to(logits.dtype)


class SoftmaxCrossEntropyLoss:
    """Per-row softmax cross entropy with label smoothing: ``apex.contrib.xentropy``'s.

    Called as Apex's was, through :meth:`apply`; it returns the unreduced
    losses, one per row: ``(1 - smoothing) * nll + smoothing * mean(-log_softmax)``,
    0 where the label is ``padding_idx``; in fp32 when ``half_to_float``,
    otherwise in the logits' dtype.

    Example::

        >>> from apex.contrib.xentropy import SoftmaxCrossEntropyLoss   # under amp-patch run
        >>> losses = SoftmaxCrossEntropyLoss.apply(logits, labels, 0.1, 0, True)
        >>> losses.sum().backward()
    """

    @staticmethod
    def apply(logits: Tensor, labels: Tensor, smoothing: float = 0.0, padding_idx: int = 0,
              half_to_float: bool = False) -> Tensor:
        """The per-row losses (see the class); differentiable in ``logits``.

        Args:
            logits (Tensor): ``[N, C]`` scores.
            labels (Tensor): ``[N]`` class indices.
            smoothing (float, optional): label smoothing. Default: 0.
            padding_idx (int, optional): rows with this label get loss 0. Default: 0.
            half_to_float (bool, optional): return fp32 losses for half logits. Default: False.

        Returns:
            Tensor: ``[N]`` losses.

        Raises:
            ValueError: the shapes are not ``[N, C]`` and ``[N]``.
        """
        return _losses(logits, labels, float(smoothing), int(padding_idx), bool(half_to_float))

    def __call__(self, *args: Any) -> Tensor:
        return self.apply(*args)
