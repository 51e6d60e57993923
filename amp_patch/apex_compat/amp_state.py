"""``apex.amp._amp_state`` for ``amp-patch run``: a live view of the amp session.

Apex kept amp's state in one module-level object, ``_amp_state``, and many
training scripts reach into it: to set the first loss scale
(``_amp_state.loss_scalers[0]._loss_scale = 2**20``), to log it
(``loss_scalers[0].loss_scale()``), to tell a skipped step
(``loss_scalers[0]._unskipped == 0``), or to read the chosen properties.
:data:`amp_state` answers those attributes from the live
:class:`~amp_patch.session.AmpSession`, so a value read is always the
current one and a value set changes what amp_patch does next.

Only the attributes that public scripts were found to use are served; any
other raises :class:`AttributeError` naming amp_patch's public equivalent.
"""

from __future__ import annotations

from typing import Any

from amp_patch import session as _session
from amp_patch.helpers import logs as _logging
from amp_patch.frontend.legacy_handle import AmpHandle
from amp_patch.frontend.loss_scaling import master_params
from amp_patch.scaler import AmpScaler

__all__ = ["AmpState", "LossScalerView", "OptPropertiesView", "amp_state", "master_params"]

_NO_SESSION = "amp.initialize() has not been called (or amp.deinitialize() ended the session)"

#: Apex's option names, the keys of ``opt_properties.options``.
_APEX_OPTIONS = ("enabled", "opt_level", "cast_model_type", "patch_torch_functions",
                 "keep_batchnorm_fp32", "master_weights", "loss_scale")


class _View:
    """Served attributes are properties; anything else is an error that says what to use."""

    __slots__ = ()
    _what = "object"
    _methods: tuple[str, ...] = ()  # served methods, listed in error messages with the properties
    _hints: dict[str, str] = {}
    _default_hint = ""

    def _served(self) -> list[str]:
        return sorted(n for n in dir(type(self)) if isinstance(getattr(type(self), n), property)
                      or n in self._methods)

    def __getattr__(self, name: str) -> Any:
        prop = getattr(type(self), name, None)
        if isinstance(prop, property):
            # The getter raised AttributeError (no live session); call it again for its message.
            return prop.fget(self)
        if name.startswith("__"):
            raise AttributeError(name)
        raise AttributeError(self._unserved(name))

    def __setattr__(self, name: str, value: Any) -> None:
        prop = getattr(type(self), name, None)
        if isinstance(prop, property) and prop.fset is not None:
            prop.fset(self, value)
            return
        if isinstance(prop, property):
            raise AttributeError(f"{self._what}.{name} is read-only under amp_patch. "
                                 + self._hints.get(name, self._default_hint))
        raise AttributeError(self._unserved(name))

    def _unserved(self, name: str) -> str:
        return (f"{self._what}.{name} is not served by amp_patch. "
                + self._hints.get(name, self._default_hint)
                + f" Served: {', '.join(self._served())}.")


_SCALE_LOSS_DOES_IT = ("amp.scale_loss(loss, optimizer) unscales the gradients, checks them and "
                       "updates the scale when its block exits.")


class LossScalerView(_View):
    """One loss scaler, with the attributes of Apex's ``apex.amp.scaler.LossScaler``.

    Reads and writes go to the amp_patch :class:`~amp_patch.scaler.AmpScaler`
    behind it: setting ``_loss_scale`` changes the scale that the next
    :func:`amp_patch.scale_loss` (or ``FP16_Optimizer.backward``) uses.

    Args:
        scaler (amp_patch.scaler.AmpScaler): the scaler to show.

    Example::

        >>> from apex.amp._amp_state import _amp_state      # under amp-patch run
        >>> _amp_state.loss_scalers[0]._loss_scale = 2.0**20
        >>> _amp_state.loss_scalers[0].loss_scale()
        1048576.0
    """

    __slots__ = ("_scaler",)
    _what = "_amp_state.loss_scalers[i]"
    _methods = ("loss_scale",)
    _hints = {
        "clear_overflow_state": _SCALE_LOSS_DOES_IT,
        "update_scale": _SCALE_LOSS_DOES_IT,
        "unscale": _SCALE_LOSS_DOES_IT,
        "unscale_with_stashed": _SCALE_LOSS_DOES_IT,
        "_overflow_buf": "the overflow flag is a device tensor inside amp_patch; _has_overflow "
                         "tells whether the last iteration overflowed.",
    }
    _default_hint = ("amp.state_dict() and amp.load_state_dict() save and restore the scale and "
                     "the count of clean iterations.")

    def __init__(self, scaler: AmpScaler) -> None:
        object.__setattr__(self, "_scaler", scaler)

    def loss_scale(self) -> float:
        """The current loss scale."""
        return self._scaler.loss_scale

    def _set_scale_seq_len(self, value: int) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"_scale_seq_len must be a positive int, got {value!r}")
        self._scaler.scale_window = value

    _loss_scale = property(lambda self: self._scaler.loss_scale,
                           lambda self, value: setattr(self._scaler, "loss_scale", value),
                           doc="The current loss scale; setting it changes the next iteration's.")
    _unskipped = property(lambda self: self._scaler.state_dict()["unskipped"],
                          doc="Clean iterations since the last overflow or scale increase.")
    _has_overflow = property(lambda self: self._scaler.last_overflow,
                             doc="Whether the last iteration found an inf or NaN (and skipped).")
    _scale_seq_len = property(lambda self: self._scaler.scale_window, _set_scale_seq_len,
                              doc="Clean iterations after which a dynamic scale doubles.")
    _max_loss_scale = property(lambda self: self._scaler.max_loss_scale,
                               doc="Ceiling of the dynamic scale.")
    _min_loss_scale = property(lambda self: self._scaler.min_loss_scale,
                               doc="Floor of the dynamic scale (None: amp_patch's, 2**-24).")
    dynamic = property(lambda self: self._scaler.dynamic, doc="True for dynamic loss scaling.")

    def __repr__(self) -> str:
        return f"<apex loss scaler view of {self._scaler!r}>"


class OptPropertiesView(_View):
    """The session's properties under Apex's names, with Apex's ``options`` dict.

    Args:
        props (amp_patch.Properties): the properties to show.

    Example::

        >>> from apex import amp                             # under amp-patch run
        >>> model, opt = amp.initialize(model, opt, opt_level="O2")
        >>> view = amp._amp_state.opt_properties
        >>> view.opt_level, view.options["master_weights"]
        ('O2', True)
        >>> view.opt_level = "O1"
        Traceback (most recent call last):
        ...
        AttributeError: _amp_state.opt_properties.opt_level is read-only under amp_patch. ...
    """

    __slots__ = ("_props",)
    _what = "_amp_state.opt_properties"
    _default_hint = "Pass options to amp.initialize(); amp_patch's Properties holds them, frozen."

    def __init__(self, props) -> None:
        object.__setattr__(self, "_props", props)

    @property
    def options(self) -> dict[str, Any]:
        """Apex's seven options and their values, as a new dict."""
        return {name: getattr(self._props, name) for name in _APEX_OPTIONS}

    enabled = property(lambda self: self._props.enabled, doc="False when amp is disabled.")
    opt_level = property(lambda self: self._props.opt_level, doc="``\"O0\"`` to ``\"O3\"``.")
    cast_model_type = property(lambda self: self._props.cast_model_type,
                               doc="The model's dtype under O2/O3, else None.")
    patch_torch_functions = property(lambda self: self._props.patch_torch_functions,
                                     doc="True under O1.")
    keep_batchnorm_fp32 = property(lambda self: self._props.keep_batchnorm_fp32,
                                   doc="Batch norms stay fp32 in a half model.")
    master_weights = property(lambda self: self._props.master_weights,
                              doc="fp32 master weights are kept.")
    loss_scale = property(lambda self: self._props.loss_scale,
                          doc="The loss scale asked for: a number or ``\"dynamic\"``.")

    def __repr__(self) -> str:
        return f"<apex opt_properties view: {self.options}>"


class _Handle(AmpHandle):
    """Apex's ``_amp_state.handle``: active while O1 patches are installed."""

    def is_active(self) -> bool:
        """True while the session's torch-function casts are installed."""
        return super().is_active() and self._session.casts is not None

    def _clear_cache(self) -> None:
        """Drop the O1 weight casts of this iteration (amp.scale_loss does it on exit)."""
        if self.is_active():
            self._session.casts.cache.clear()


def _serial(session: _session.AmpSession | None) -> int | None:
    return None if session is None else session.serial


class AmpState(_View):
    """Apex's ``_amp_state``, answered from the live amp_patch session.

    Served attributes: ``loss_scalers`` (a list of :class:`LossScalerView`),
    ``opt_properties``, ``verbosity`` (settable), ``allow_incoming_model_not_fp32``
    (settable; amp_patch accepts models of any float dtype either way),
    ``handle``, ``min_loss_scale`` and ``max_loss_scale``. Those that describe
    a session raise :class:`AttributeError` while none is live, as Apex's did
    before ``initialize``.

    Example::

        >>> from apex import amp                             # under amp-patch run
        >>> model, opt = amp.initialize(model, opt, opt_level="O2")
        >>> amp._amp_state.loss_scalers[0]._loss_scale = 2.0**20
        >>> amp._amp_state.opt_properties.master_weights
        True
    """

    __slots__ = ("_verbosity", "_allow_not_fp32")
    _what = "_amp_state"
    _hints = {
        "hard_override": "amp_patch has no override of its checks; pass valid options.",
        "handle": "amp.deinitialize() ends the session and restores torch.",
    }
    _default_hint = ("amp_patch's public API: amp.state_dict(), amp.load_state_dict(), "
                     "amp.master_params(optimizer), amp.deinitialize().")

    def __init__(self) -> None:
        object.__setattr__(self, "_verbosity", None)
        object.__setattr__(self, "_allow_not_fp32", False)

    @staticmethod
    def _session(attr: str) -> _session.AmpSession:
        session = _session.current()
        if session is None:
            raise AttributeError(f"_amp_state.{attr}: {_NO_SESSION}")
        return session

    @property
    def loss_scalers(self) -> list[LossScalerView]:
        """One view per loss scaler of the live session (empty when amp is disabled)."""
        return [LossScalerView(s) for s in self._session("loss_scalers").scalers]

    @property
    def opt_properties(self) -> OptPropertiesView:
        """The live session's properties, under Apex's names."""
        return OptPropertiesView(self._session("opt_properties").props)

    @property
    def handle(self) -> _Handle:
        """The session's handle: ``is_active()``, ``_clear_cache()``, ``_deactivate()``."""
        return _Handle(self._session("handle"))

    @property
    def min_loss_scale(self) -> float | None:
        """The ``min_loss_scale`` passed to initialize."""
        return self._session("min_loss_scale").props.min_loss_scale

    @property
    def max_loss_scale(self) -> float:
        """The ``max_loss_scale`` passed to initialize."""
        return self._session("max_loss_scale").props.max_loss_scale

    @property
    def verbosity(self) -> int:
        """The logging verbosity: the session's, unless set since it began (1 with no session)."""
        session = _session.current()
        if self._verbosity is not None and self._verbosity[0] == _serial(session):
            return self._verbosity[1]
        return session.props.verbosity if session is not None else 1

    @verbosity.setter
    def verbosity(self, value: int) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"verbosity must be an int >= 0, got {value!r}")
        restore_logging = _logging.configure(value)
        session = _session.current()
        if session is not None:
            session.on_close("the amp_patch logger's level and handler", restore_logging)
        # The session's serial, not the session: a closed session must not be kept alive.
        object.__setattr__(self, "_verbosity", (_serial(_session.current()), value))

    @property
    def allow_incoming_model_not_fp32(self) -> bool:
        """Apex's switch for half models at initialize; amp_patch accepts them regardless."""
        return self._allow_not_fp32

    @allow_incoming_model_not_fp32.setter
    def allow_incoming_model_not_fp32(self, value: bool) -> None:
        object.__setattr__(self, "_allow_not_fp32", bool(value))

    def __repr__(self) -> str:
        return f"<apex _amp_state view of {_session.current()!r}>"


#: The one instance, served as ``apex.amp._amp_state``.
amp_state = AmpState()
