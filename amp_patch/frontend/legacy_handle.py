"""Apex's older handle API: ``amp.init()`` patches torch functions (O1) and nothing else."""

from __future__ import annotations

import logging

import torch

from amp_patch import session as _session
from amp_patch.frontend.lifecycle import install_casts
from amp_patch.helpers import logs as _logging
from amp_patch.patching import cpu_half
from amp_patch.settings.properties import Properties

__all__ = ["init", "AmpHandle"]

logger = logging.getLogger("amp_patch")


class AmpHandle:
    """What :func:`init` returns: the O1 function patching of one session.

    Args:
        session (AmpSession or None): the session holding the patches; None
            for a disabled handle.

    Example::

        >>> handle = amp.init(half_dtype=torch.float16)
        >>> a = b = torch.ones(2, 2)
        >>> handle.is_active()
        True
        >>> handle._deactivate()      # torch's functions are the originals again
        >>> handle.is_active()
        False
    """

    def __init__(self, session: _session.AmpSession | None) -> None:
        self._session = session

    def is_active(self) -> bool:
        """True while this handle's patches are installed."""
        return (self._session is not None and not self._session.closed
                and _session.current() is self._session)

    def _deactivate(self) -> None:
        """Undo this handle's patches (the same objects are restored). Idempotent."""
        if self.is_active():
            _session.reset()


def init(enabled: bool = True, loss_scale="dynamic", enable_caching: bool = True,
         verbose: bool = False, allow_banned: bool = False, *,
         half_dtype: torch.dtype | None = None) -> AmpHandle:
    """Apply O1 function patching alone, as Apex's ``amp.init()`` did.

    No model or optimizer is touched. The patches form a session of their
    own: :func:`amp_patch.initialize` cannot be called while the handle is
    active, and :func:`amp_patch.deinitialize` (or ``handle._deactivate()``)
    undoes them.

    Args:
        enabled (bool, optional): False returns an inactive handle and patches
            nothing. Default: True.
        loss_scale (float or str, optional): validated and kept in the session's
            properties, but it has no effect: :func:`init` makes no loss
            scaler (use :func:`amp_patch.initialize` for loss scaling).
            Default: ``"dynamic"``.
        enable_caching (bool, optional): cast each fp32 weight once per
            iteration. Default: True.
        verbose (bool, optional): log at debug level. Default: False.
        allow_banned (bool, optional): run banned functions (``binary_cross_entropy``)
            in fp32 instead of raising. Default: False.
        half_dtype (torch.dtype, optional): the half type of the patched
            functions. Default: fp16 when CUDA is available, else bf16.

    Returns:
        AmpHandle: with ``is_active()`` and ``_deactivate()``.

    Raises:
        RuntimeError: if a session (from :func:`amp_patch.initialize` or an
            earlier :func:`init`) is live.

    Example::

        >>> handle = amp.init(half_dtype=torch.float16)
        >>> a = b = torch.ones(2, 2)
        >>> torch.mm(a, b).dtype          # half under the patches
        torch.float16
        >>> handle._deactivate()
    """
    if not enabled:
        return AmpHandle(None)
    half = half_dtype or (torch.float16 if torch.cuda.is_available() else torch.bfloat16)
    props = Properties.from_opt_level("O1", half, loss_scale=loss_scale,
                                      verbosity=2 if verbose else 1)
    restore_logging = _logging.configure(props.verbosity)
    session = _session.AmpSession(props, [], [])
    try:
        _session.activate(session)
    except BaseException:
        restore_logging()
        raise
    session.on_close("the amp_patch logger's level and handler", restore_logging)
    try:
        # First, as in initialize: O1's wrappers call the emulating ones.
        session.cpu_half = cpu_half.install(props, session.models, session.on_close)
        install_casts(session, allow_banned=allow_banned, enable_caching=enable_caching)
    except BaseException:
        _session.reset()
        raise
    logger.info("amp_patch.init(): O1 function patching active (half dtype %s)", half)
    return AmpHandle(session)
