"""``apex.contrib.clip_grad``: ``clip_grad_norm_``, which is torch's.

Apex's ``clip_grad_norm_`` was a drop-in for ``torch.nn.utils.clip_grad_norm_``
(the same arguments and result, computed with Apex's multi-tensor L2 norm);
torch's own now fuses the norm (``foreach``), so it is served as it is.
"""

from __future__ import annotations

from torch.nn.utils import clip_grad_norm_

__all__ = ["clip_grad_norm_"]
