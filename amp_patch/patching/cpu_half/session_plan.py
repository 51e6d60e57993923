"""What a session does about half compute on the CPU: its plan, agreed over the ranks, installed.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from dataclasses import dataclass
from typing import Any, Callable

import torch

from amp_patch.helpers import agree
from amp_patch.patching.cpu_half.detect import (
    CpuHalfSupport,
    cpu_half_support,
)
from amp_patch.patching.cpu_half.emulate import _emulator, targets
from amp_patch.patching.dynamo import RULES as _DYNAMO_RULES
from amp_patch.patching.patcher import Patcher
from amp_patch.settings.dtypes import HALF_DTYPES, half_dtype_name

# The settings own the modes; the names here stay public.
from amp_patch.settings.properties import (
    Properties,
    check_cpu_half_mode as check_mode,
)

logger = logging.getLogger("amp_patch")


@dataclass(frozen=True)
class CpuHalfPlan:
    """What one session does about half compute on the CPU.

    Build it with :func:`plan`.

    Args:
        half_dtype (torch.dtype): the dtype the session computes in on the CPU.
        requested (str): the ``cpu_half_compute`` property: ``"auto"``,
            ``"native"`` or ``"emulate"``.
        emulate_matmul (bool): matmul-class ops are emulated.
        emulate_conv (bool): convolutions are emulated.
        host_matmul (bool): the host's matmul in ``half_dtype`` is native.
        host_conv (bool): the host's convolution in ``half_dtype`` is native.
    """

    half_dtype: torch.dtype
    requested: str
    emulate_matmul: bool
    emulate_conv: bool
    host_matmul: bool
    host_conv: bool

    @property
    def emulates(self) -> bool:
        """True when any op class is emulated."""
        return self.emulate_matmul or self.emulate_conv

    @property
    def mode(self) -> str:
        """``"native"``, ``"emulate"``, or, for one class, ``"emulate-matmul"`` /
        ``"emulate-conv"``."""
        if self.emulate_matmul and self.emulate_conv:
            return "emulate"
        if self.emulates:
            return "emulate-matmul" if self.emulate_matmul else "emulate-conv"
        return "native"

    def describe(self) -> str:
        """One sentence: what runs how, and why."""
        h = half_dtype_name(self.half_dtype)
        host = ("has native " + h if self.host_matmul and self.host_conv
                else f"has no native {h} " + ("convolution" if self.host_matmul else "matmul"))
        why = f"cpu_half_compute={self.requested!r}; this host {host}"
        if not self.emulates:
            slow = "" if self.host_matmul and self.host_conv else ": expect them to be slow"
            return f"{h} matmuls and convolutions run natively in {h} ({why}){slow}"
        what = {"emulate": "matmuls and convolutions", "emulate-matmul": "matmuls",
                "emulate-conv": "convolutions"}[self.mode]
        return (f"{h} {what} are emulated: computed in fp32 on fp32 copies of the {h} inputs, "
                f"outputs rounded to {h} ({why})")

    def as_dict(self) -> dict[str, Any]:
        """A JSON-able dict: the fields (the dtype as ``"bf16"``/``"fp16"``) and ``mode``."""
        out = dataclasses.asdict(self)
        out.update(half_dtype=half_dtype_name(self.half_dtype), mode=self.mode)
        return out


def plan(cpu_half_compute: str = "auto", half_dtype: torch.dtype = torch.bfloat16,
         support: CpuHalfSupport | None = None) -> CpuHalfPlan:
    """What ``cpu_half_compute`` means on this host for ``half_dtype``.

    ``"auto"`` emulates exactly the op classes (matmul, convolution) that the
    host does not run natively in ``half_dtype``; ``"native"`` emulates
    nothing; ``"emulate"`` emulates both.

    Args:
        cpu_half_compute (str, optional): ``"auto"``, ``"native"`` or ``"emulate"``.
            Default: ``"auto"``.
        half_dtype (torch.dtype, optional): torch.bfloat16 or torch.float16.
            Default: torch.bfloat16.
        support (CpuHalfSupport, optional): Default: :func:`cpu_half_support`.

    Returns:
        CpuHalfPlan: frozen; ``.emulates``, ``.mode``, ``.describe()``, ``.as_dict()``.

    Raises:
        ValueError: an unknown mode or a dtype that is not half.

    Example::

        >>> from amp_patch.patching.cpu_half import override
        >>> with override(float16=False):  # as on a host without avx512_fp16
        ...     amp_patch.patching.cpu_half.plan("auto", torch.float16).mode
        'emulate'
    """
    check_mode(cpu_half_compute)
    s = (support or cpu_half_support()).of(half_dtype)
    emulate = cpu_half_compute == "emulate"
    auto = cpu_half_compute == "auto"
    return CpuHalfPlan(half_dtype, cpu_half_compute,
                       emulate_matmul=emulate or (auto and not s.matmul),
                       emulate_conv=emulate or (auto and not s.conv),
                       host_matmul=s.matmul, host_conv=s.conv)


def _session_plan(props: Properties, models: list[torch.nn.Module]) -> CpuHalfPlan | None:
    """The plan of a session that computes in half on the CPU; None for one that does not."""
    if not props.enabled or not _on_cpu(models):
        return None
    if props.cast_model_type in HALF_DTYPES:
        dtype = props.cast_model_type
    elif props.patch_torch_functions:
        dtype = props.half_dtype
    else:
        return None
    return plan(props.cpu_half_compute, dtype)


def _on_cpu(models) -> bool:
    return all(t.device.type == "cpu" for m in models
               for t in (*m.parameters(), *m.buffers()) if t.is_floating_point())


#: The live session's plan: set by :func:`install`, cleared when that session closes.
_live_plan: CpuHalfPlan | None = None


def current_plan() -> CpuHalfPlan | None:
    """The live session's plan (decided at its :func:`amp_patch.initialize`), or None when no
    session computes in half on the CPU.

    Example::

        >>> with amp_patch.cpu_half.override(bfloat16=True):  # as on a host with native bf16
        ...     model, opt = amp.initialize(model, opt, opt_level="O2", half_dtype=torch.bfloat16)
        >>> amp_patch.patching.cpu_half.current_plan().mode
        'native'
    """
    return _live_plan


def banner(half_dtype: torch.dtype = torch.bfloat16, cpu_half_compute: str = "auto", *,
           support: CpuHalfSupport | None = None) -> str:
    """The text that tools print beside CPU speed figures: which compute mode ran, and why
    those figures do not predict GPU speed.

    Three lines: the plan (:meth:`CpuHalfPlan.describe`), the host
    (:meth:`CpuHalfSupport.describe`), and the caveat. ``amp-patch compare``,
    ``bench`` and ``make demo`` print it on CPU runs; a host without native
    half is where it matters most.

    Args:
        half_dtype (torch.dtype, optional): the half dtype of the run. Default: torch.bfloat16.
        cpu_half_compute (str, optional): the mode the run used. Default: ``"auto"``.
        support (CpuHalfSupport, optional): Default: :func:`cpu_half_support`.

    Returns:
        str: three lines, no trailing newline.

    Example::

        >>> len(amp_patch.patching.cpu_half.banner(torch.bfloat16).splitlines())
        3
    """
    support = support or cpu_half_support()
    p = plan(cpu_half_compute, half_dtype, support)
    h = half_dtype_name(half_dtype)
    if p.emulates:
        here = (f"here {h} matmuls ran at about fp32 speed (emulated), so O1-O3 run near O0's "
                "speed and their differences come from casts, elementwise ops and memory traffic")
    else:
        here = f"here they ran on this CPU's own {h} units, whose speed-up over fp32 is no guide"
    return "\n".join([
        f"CPU half compute: {p.describe()}.",
        f"Host: {support.describe()}.",
        "CPU speed ratios do not predict GPU speed: on a GPU, half matmuls run on tensor cores "
        f"several times faster than fp32; {here}.",
    ])


#: The last answer logged by :func:`install`, so that each is logged once.
_logged: CpuHalfSupport | None = None


def _log_once(support: CpuHalfSupport) -> None:
    global _logged
    if support is not _logged and logger.isEnabledFor(logging.INFO):
        _logged = support
        logger.info("CPU half compute on this host: %s", support.describe())


def _agreed(p: CpuHalfPlan | None) -> CpuHalfPlan | None:
    """``p``, emulating every op class that any rank of the process group emulates.

    The host's answer comes from a timed probe and an environment variable,
    either of which can differ between ranks (a busy core, another node);
    the plan decides the numerics, so the ranks take one plan: an op class
    is emulated everywhere if one rank must. Whether a plan exists at all
    follows from the session's properties and the models' device, the same
    on every rank. One all-reduce at initialize, only under torch.distributed.
    """
    if p is None or not agree.group_active():
        return p
    matmul, conv = (bool(v) for v in agree.agree_max([p.emulate_matmul, p.emulate_conv]))
    if (matmul, conv) == (p.emulate_matmul, p.emulate_conv):
        return p
    logger.info("CPU half compute: another rank emulates what this host runs natively; this "
                "rank emulates it too, so that all ranks compute alike")
    return dataclasses.replace(p, emulate_matmul=matmul, emulate_conv=conv)


def install(props: Properties, models: list[torch.nn.Module],
            on_close: Callable[..., None]) -> CpuHalfPlan | None:
    """Install the emulating wrappers when the session computes in half on a CPU that needs them.

    It is what :func:`amp_patch.initialize` calls, before the O1 patches.
    For models on the CPU it logs the host's answer (once per answer and
    process). When the session computes in half there (O1, or a model cast
    to half at O2/O3) the plan becomes :func:`current_plan` until the session
    closes; when the plan emulates, it patches the op classes that the plan
    names and registers their undo with ``on_close`` ("CPU half emulation").

    Args:
        props (Properties): the session's settings.
        models (list of torch.nn.Module): the models passed to initialize.
        on_close (callable): ``on_close(what, undo)`` registers an undo with the session.

    Returns:
        CpuHalfPlan or None: the plan; None when the session computes no half
        on the CPU (O0, models on CUDA, ``enabled=False``).

    Example::

        >>> from amp_patch.patching.cpu_half import override
        >>> from amp_patch.settings.properties import Properties
        >>> props = Properties.from_opt_level("O2", torch.bfloat16)
        >>> undos = []
        >>> with override(bfloat16=False):  # as on a host without native bf16
        ...     install(props, [model], lambda what, undo: undos.append(undo)).mode
        'emulate'
        >>> for undo in reversed(undos):  # what the session's close does
        ...     undo()
    """
    global _live_plan
    if not (props.enabled and _on_cpu(models)):
        return None
    _log_once(cpu_half_support())
    p = _agreed(_session_plan(props, models))
    if p is not None:
        def forget() -> None:
            global _live_plan
            if _live_plan is p:
                _live_plan = None

        _live_plan = p
        on_close("the live CPU half plan", forget)
    if p is None or not p.emulates:
        if p is not None:
            logger.debug("%s", p.describe())
        return p
    patcher = Patcher()
    dynamo_rules = None  # dynamo's maps once the patches are in (see patching/dynamo.py)

    def undo() -> None:
        try:
            patcher.undo_all()
        finally:
            _DYNAMO_RULES.drop_if_rebuilt(dynamo_rules)

    on_close("CPU half emulation", undo)
    for namespace, _, name in targets(p.emulate_matmul, p.emulate_conv):
        patcher.patch(namespace, name, functools.partial(_emulator, dtype=p.half_dtype, name=name))
    # As for O1's patches: torch.compile must keep knowing the functions emulated here, whatever
    # the level (an O2/O3 session emulates with no O1 patches above), and maps that dynamo builds
    # during the session must not outlive it with the emulating wrappers in them.
    dynamo_rules = _DYNAMO_RULES.snapshot(patcher)
    logger.info("%s", p.describe())
    return p
