"""``apex.parallel.LARC``: Apex's name for :class:`amp_patch.optim.amp.larc.LARC`.

LARC lives in the optimizer machinery, since :func:`amp_patch.initialize`
and the optimizer records handle it at every level; this module only gives it
the place Apex code imports it from.
"""

from amp_patch.optim.amp.larc import LARC

__all__ = ["LARC"]
