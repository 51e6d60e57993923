"""``amp-patch run --device cpu``: the CUDA calls of a legacy training script, served by the CPU.

Apex-era scripts assume a GPU: ``model.cuda()``, ``torch.device("cuda")``,
``torch.cuda.synchronize()``, a data prefetcher on a side ``torch.cuda.Stream``
with ``record_stream()``, ``init_process_group("nccl")``. :class:`CudaOnCpu`
maps each of these onto the CPU for the script's run, so that the script can
be smoke-tested or compared on a machine without a GPU, unchanged. The CPU
plays one CUDA device on which every op finishes before the next starts, so
streams and events never have anything to wait for.

Every change is a recorded patch (:class:`~amp_patch.patching.patcher.Patcher`);
:meth:`CudaOnCpu.uninstall` puts every patched attribute back, the very same
object. A CUDA function the mapping has no CPU meaning for raises
:class:`CudaNotMappedError`, which names it.

**TorchScript.** ``torch.jit.script`` resolves a ``torch.*`` call by looking
the Python object up in TorchScript's builtin table (``torch.jit._builtins``),
keyed by ``id()``. A Python wrapper is not in it, so the compiler would try to
compile the wrapper's source and fail on the builtin inside. Each wrapper that
stands in for a builtin is therefore registered under the original's op for as
long as the mapping is installed: scripted code calls torch's own op, and
torch's own scripted modules (``torch.distributed.optim``) import. The device
arguments inside scripted code are not mapped: a scripted
``torch.zeros(2, device="cuda")`` still asks for a GPU.
"""

from __future__ import annotations

import contextlib
import copyreg
import functools
import importlib
import inspect
import logging
import time
from typing import Any, Callable

import torch
import torch.jit._builtins as _jit_builtins
import torch.utils._device as _device_module

import amp_patch
from amp_patch.patching.cpu_half import cpu_half_support
from amp_patch.patching.dynamo import RULES as _DYNAMO_RULES
from amp_patch.patching.patcher import Patcher, PatchRecord
from amp_patch.settings.dtypes import check_half_dtype

__all__ = ["CudaOnCpu", "CudaNotMappedError", "CpuStream", "CpuEvent", "MAPPED"]

logger = logging.getLogger("amp_patch")

_CPU = torch.device("cpu")
_REAL_DEVICE = torch.device  # torch's own class, whatever torch.device is while installed

#: What the mapping does, as (CUDA call, what it becomes on the CPU): the start-up message
#: and the docs say this. ``{half}`` is the run's half dtype.
MAPPED = (
    ("Module.cuda(), Tensor.cuda(), storage.cuda()",
     "the same object, on the CPU (non_blocking is moot)"),
    ("'cuda', 'cuda:N', torch.device('cuda'), an int device",
     "'cpu' in .to(), new_*(), every factory's device=, torch.load(map_location=), "
     "set_default_device()"),
    ("torch.device(0), torch.device('cuda'), torch.device('cuda', 0), "
     "torch.device(type='cuda', index=0)",
     "torch.device('cpu'); isinstance(x, torch.device) holds for every device"),
    ("torch.cuda.is_available(), device_count(), current_device(), set_device(), device()",
     "True, 1, the index last set: every CUDA index is the CPU"),
    ("torch.cuda.synchronize(), Stream, current_stream(), default_stream(), stream(), Event, "
     "Tensor.record_stream()", "CPU stand-ins with nothing to wait for: CPU ops finish in order"),
    (".half(), torch.cuda.HalfTensor, autocast('cuda') and GradScaler('cuda')",
     "{half}, and CPU autocast and GradScaler in {half}"),
    ("torch.cuda.FloatTensor and the other CUDA tensor types", "the CPU tensor types"),
    ("init_process_group('nccl'), DistributedDataParallel(device_ids=...), DataParallel",
     "'gloo', CPU DDP without device_ids, the module itself"),
    ("torch.cuda.manual_seed*(), seed*(), get/set_rng_state*()",
     "the CPU generator, which draws every random number"),
    ("torch.cuda.empty_cache(), ipc_collect(), torch.cuda.nvtx ranges, "
     "torch.cuda.cudart().cudaProfilerStart()/Stop(), torch.cuda.profiler", "nothing to do"),
    ("torch.cuda.get_device_capability()",
     "(0, 0): no CUDA architecture, so GPU-only kernels gated on it (flash-attn) stay off"),
    ("torch.accelerator.is_available(), current_accelerator(); "
     "torch.backends.cudnn.is_available(), version()",
     "False, None; False, None: as a CPU build of torch answers, so that torch's own checks "
     "(the optimizers' graph-capture check) stay on the CPU"),
)

#: Legacy CUDA tensor types and the CPU types they become (HalfTensor follows the half dtype).
_TENSOR_TYPES = ("FloatTensor", "DoubleTensor", "BFloat16Tensor", "ByteTensor", "CharTensor",
                 "ShortTensor", "IntTensor", "LongTensor", "BoolTensor")
_HALF_TENSOR_TYPES = {torch.float16: "HalfTensor", torch.bfloat16: "BFloat16Tensor"}

#: Tensor methods that take a device argument.
_TENSOR_DEVICE_METHODS = ("new_empty", "new_zeros", "new_ones", "new_full", "new_empty_strided",
                          "new_tensor")


class CudaNotMappedError(RuntimeError):
    """A CUDA call that ``amp-patch run --device cpu`` has no CPU meaning for; the message names it.

    Example::

        >>> torch.cuda.get_device_properties(0)   # under amp-patch run --device cpu
        CudaNotMappedError: torch.cuda.get_device_properties() has no CPU mapping ...
    """


def _not_mapped(name: str, original: Any = None) -> Callable[..., Any]:
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise CudaNotMappedError(
            f"{name}() has no CPU mapping under `amp-patch run --device cpu`: it needs a real GPU. "
            "Run the script on a CUDA machine, or guard the call in the script.")

    refuse.__name__ = refuse.__qualname__ = name.rsplit(".", 1)[-1]
    # torch reads the function under a decorator of some torch.cuda names at import
    # (torch._dynamo takes torch.cuda.use_mem_pool.__wrapped__ from torch 2.14 on).
    if hasattr(original, "__wrapped__"):
        refuse.__wrapped__ = original.__wrapped__  # type: ignore[attr-defined]
    return refuse


def _refusing_class(name: str, original: type) -> Any:
    """A subclass of ``original`` that cannot be instantiated: the error names ``name``."""
    refuse = _not_mapped(name)

    def __new__(cls: type, *args: Any, **kwargs: Any) -> Any:
        refuse()

    try:
        return type(original.__name__, (original,), {"__new__": __new__,
                                                     "__module__": original.__module__})
    except TypeError:  # not subclassable: a function that refuses serves the same calls
        return refuse


def _cpu_if_cuda(device: Any) -> Any:
    """``device`` with every CUDA device replaced by the CPU; anything else unchanged."""
    if isinstance(device, torch.device):
        return _CPU if device.type == "cuda" else device
    if isinstance(device, str):
        try:
            return _CPU if _REAL_DEVICE(device).type == "cuda" else device
        except RuntimeError:
            return device  # not a device name: torch's own error says so
    if isinstance(device, int) and not isinstance(device, bool):
        return _CPU  # a bare index means a CUDA device
    return device


class _DeviceMeta(type):
    """The metaclass of :class:`_CpuDevice`: ``isinstance``/``issubclass`` ask torch's own class."""

    def __instancecheck__(cls, obj: Any) -> bool:
        return isinstance(obj, _REAL_DEVICE)

    def __subclasscheck__(cls, sub: type) -> bool:
        return sub is cls or issubclass(sub, _REAL_DEVICE)

    def __getattr__(cls, name: str) -> Any:
        return getattr(_REAL_DEVICE, name)  # torch.device.type and other class attributes


class _CpuDevice(metaclass=_DeviceMeta):
    """Stands in for the ``torch.device`` constructor: CUDA devices are made on the CPU.

    ``torch.device`` is a C type that cannot be subclassed. Calling this class
    returns a real :class:`torch.device` (so C code, ``==`` and hashing see
    torch's own objects), with every CUDA device, and a bare index, replaced by
    the CPU; ``isinstance(x, torch.device)`` and ``issubclass`` are answered by
    torch's class, and ``torch.device`` keeps working in annotations,
    ``X | None`` and ``with torch.device(...)`` blocks. The index of a CUDA
    device made with it is not kept: ``torch.cuda.set_device(torch.device("cuda", 1))``
    leaves ``current_device()`` as it was, where ``set_device(1)`` or
    ``set_device("cuda:1")`` sets it.

    Example::

        >>> torch.device(0), torch.device("cuda", 0), torch.device(type="cuda", index=0)
        (device(type='cpu'), device(type='cpu'), device(type='cpu'))
        >>> isinstance(torch.device("meta"), torch.device)
        True
    """

    def __new__(cls, *args: Any, **kwargs: Any) -> torch.device:  # type: ignore[misc]
        device = _REAL_DEVICE(*args, **kwargs) if not _is_bare_index(args, kwargs) else _CPU
        return _CPU if device.type == "cuda" else device


def _is_bare_index(args: tuple, kwargs: dict) -> bool:
    """``torch.device(0)``: an int alone means the current accelerator, which CPU torch lacks."""
    value = args[0] if len(args) == 1 and not kwargs else None
    return isinstance(value, int) and not isinstance(value, bool)


_CpuDevice.__name__ = _CpuDevice.__qualname__ = "device"
_CpuDevice.__module__ = "torch"


def _reduce_device(device: torch.device) -> tuple:
    # A device pickles as a reference to ``torch.device``; pickle checks that the name finds the
    # very class, which is the stand-in while it is installed. The stream is unchanged: it
    # still reads back as torch's device wherever amp_patch is absent.
    return (torch.device, (device.type, device.index) if device.index is not None
            else (device.type,))


def _map_device_kwarg(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def on_cpu(*args: Any, **kwargs: Any) -> Any:
        if kwargs.get("device") is not None:
            kwargs["device"] = _cpu_if_cuda(kwargs["device"])
        return original(*args, **kwargs)

    return on_cpu


def _map_tensor_to(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def to(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if args and isinstance(args[0], (str, torch.device, int)):
            args = (_cpu_if_cuda(args[0]), *args[1:])
        if kwargs.get("device") is not None:
            kwargs["device"] = _cpu_if_cuda(kwargs["device"])
        return original(self, *args, **kwargs)

    return to


def _factory_names() -> list[str]:
    """Public ``torch.*`` functions whose ATen schema takes a ``device``: the factories."""
    names = {s.name.split("::", 1)[1] for s in torch._C._jit_get_all_schemas()
             if s.name.startswith("aten::") and any(a.name == "device" for a in s.arguments)}
    names.add("asarray")  # a Python binding, not an ATen op
    return sorted(n for n in names if not n.startswith("_") and callable(getattr(torch, n, None))
                  and not inspect.isclass(getattr(torch, n)))


class CpuEvent:
    """Stands in for ``torch.cuda.Event`` on the CPU.

    Every op has finished by the time the next Python line runs, so an
    event is complete as soon as it is recorded; with ``enable_timing`` it
    keeps the time it was recorded at, and :meth:`elapsed_time` gives
    milliseconds as CUDA's does.

    Args:
        enable_timing (bool, optional): allow :meth:`elapsed_time`. Default: False.
        blocking (bool, optional): accepted; nothing blocks. Default: False.
        interprocess (bool, optional): only False is supported. Default: False.

    Example::

        >>> start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        >>> start.record(); train_step(); end.record(); torch.cuda.synchronize()
        >>> start.elapsed_time(end)   # milliseconds
    """

    def __init__(self, enable_timing: bool = False, blocking: bool = False,
                 interprocess: bool = False, **kwargs: Any) -> None:
        if interprocess:
            raise CudaNotMappedError("torch.cuda.Event(interprocess=True) has no CPU mapping under "
                                     "`amp-patch run --device cpu`")
        self.enable_timing = enable_timing
        self.recorded_at: float | None = None

    def record(self, stream: Any = None) -> None:
        self.recorded_at = time.perf_counter()

    def wait(self, stream: Any = None) -> None:
        pass

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, end_event: "CpuEvent") -> float:
        """Milliseconds from this event's record to ``end_event``'s."""
        if not (self.enable_timing and end_event.enable_timing):
            raise RuntimeError("elapsed_time: both events must be created with enable_timing=True")
        if self.recorded_at is None or end_event.recorded_at is None:
            raise RuntimeError("elapsed_time: both events must be recorded first")
        return (end_event.recorded_at - self.recorded_at) * 1e3


class CpuStream:
    """Stands in for ``torch.cuda.Stream`` on the CPU: work on it is done when it is issued.

    Args:
        device (optional): accepted and ignored; the stream is the CPU's.
        priority (int, optional): kept as :attr:`priority`. Default: 0.

    Example::

        >>> side = torch.cuda.Stream()
        >>> with torch.cuda.stream(side):
        ...     x = x.cuda(non_blocking=True)
        >>> torch.cuda.current_stream().wait_stream(side)
    """

    def __init__(self, device: Any = None, priority: int = 0, **kwargs: Any) -> None:
        self.device = _CPU
        self.priority = priority

    def wait_stream(self, stream: Any) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass

    def record_event(self, event: CpuEvent | None = None) -> CpuEvent:
        event = event if event is not None else CpuEvent()
        event.record(self)
        return event

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


class _CpuCudart:
    """``torch.cuda.cudart()`` on the CPU: the profiler range calls succeed with nothing to do.

    Apex's ImageNet example brackets ``--prof`` iterations with
    ``torch.cuda.cudart().cudaProfilerStart()`` and ``cudaProfilerStop()``;
    each returns 0 (``cudaSuccess``) here, so ``torch.cuda.check_error`` and
    ``torch.cuda.profiler.start()`` pass.
    """

    def cudaProfilerStart(self) -> int:  # noqa: N802 - the CUDA runtime's name
        return 0

    def cudaProfilerStop(self) -> int:  # noqa: N802 - the CUDA runtime's name
        return 0


def check_error(res: int) -> None:
    """``torch.cuda.check_error`` for :class:`_CpuCudart`'s results: 0 is success."""
    if res != 0:
        raise RuntimeError(f"CUDA runtime call failed with error {res}")


class _StreamContext:
    """``torch.cuda.stream(s)``: ``s`` is the current stream inside the block."""

    def __init__(self, owner: "CudaOnCpu", stream: CpuStream | None) -> None:
        self.owner, self.stream = owner, stream

    def __enter__(self) -> CpuStream | None:
        streams = self.owner._streams
        streams.append(self.stream if self.stream is not None else streams[-1])
        return self.stream

    def __exit__(self, *exc: Any) -> None:
        self.owner._streams.pop()


class _DeviceContext:
    """``torch.cuda.device(i)``: ``i`` is the current index inside the block."""

    def __init__(self, owner: "CudaOnCpu", device: Any) -> None:
        self.owner, self.index = owner, _index(device)
        self.saved = owner.index

    def __enter__(self) -> None:
        self.saved = self.owner.index
        if self.index is not None:
            self.owner.index = self.index

    def __exit__(self, *exc: Any) -> None:
        self.owner.index = self.saved


def _index(device: Any) -> int | None:
    if device is None:
        return None
    if isinstance(device, int):
        return device if device >= 0 else None
    if isinstance(device, torch.Tensor):
        return None  # a CPU tensor has no CUDA index (device_of)
    device = _REAL_DEVICE(device)
    return device.index if device.type == "cuda" and device.index is not None else None


class CudaOnCpu:
    """Maps the CUDA entry points of legacy training scripts onto the CPU while installed.

    See :data:`MAPPED` for what each call becomes. Any other public
    ``torch.cuda`` function raises :class:`CudaNotMappedError` naming it.
    :meth:`uninstall` restores every patched attribute, the same object as
    before, in reverse order.

    Args:
        half_dtype (torch.dtype, optional): what ``.half()``, ``HalfTensor``
            and fp16 autocast mean in the run, and the half dtype
            ``amp.initialize`` and ``amp.init`` default to. Default: ``torch.bfloat16``.

    Attributes:
        index (int): the CUDA index the script last selected (``set_device``).
        targets (list of (object, str)): every attribute patched by the last
            :meth:`install`, kept after :meth:`uninstall` for inspection.

    Example::

        >>> with CudaOnCpu(torch.bfloat16):
        ...     model = Net().cuda()                  # stays on the CPU
        ...     x = torch.randn(4, 8, device="cuda")  # a CPU tensor
        ...     torch.cuda.synchronize()              # nothing to wait for
    """

    def __init__(self, half_dtype: torch.dtype = torch.bfloat16) -> None:
        self.half_dtype = check_half_dtype(half_dtype)
        self.index = 0
        self.default_stream = CpuStream()
        self._streams = [self.default_stream]
        self._patcher = Patcher()
        self._dynamo_rules: tuple | None = None
        self._pickles_devices = False
        # (id of a wrapper, the TorchScript op it was registered as): see the module's docstring.
        self._jit_builtins: list[tuple[int, str]] = []
        self.targets: list[tuple[Any, str]] = []

    @property
    def installed(self) -> bool:
        return len(self._patcher) > 0 or self._pickles_devices or bool(self._jit_builtins)

    def __enter__(self) -> "CudaOnCpu":
        self.install()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.uninstall()

    def summary(self) -> str:
        """What the mapping does, one line per group of calls (the start-up message)."""
        half = str(self.half_dtype).replace("torch.", "")
        lines = [f"  {what} -> {becomes.format(half=half)}" for what, becomes in MAPPED]
        return ("amp-patch run --device cpu: the script's CUDA calls run on the CPU:\n"
                + "\n".join(lines)
                + "\n  any other torch.cuda function raises CudaNotMappedError, naming it")

    # ------------------------------------------------------------------ install / uninstall

    def install(self) -> None:
        """Apply every patch. On failure, the ones applied are undone before the error propagates.

        Raises:
            RuntimeError: already installed.
        """
        if self.installed:
            raise RuntimeError("CudaOnCpu is already installed")
        self.targets = []
        self.index = 0
        self._streams = [self.default_stream]
        # TorchScript fills its builtin table from torch's attributes the first time it is
        # asked; filled while the wrappers are installed, it would hold the wrappers and miss
        # torch's own functions for the rest of the process.
        _jit_builtins._get_builtin_table()
        # The same for `with torch.device(...)`'s set of factory functions (a functools.cache):
        # built from the wrappers, it would miss torch's own factories once they are back, and
        # a model made under `with torch.device("meta")` would land on the CPU.
        _device_module._device_constructors()
        try:
            self._patch_tensors_and_modules()
            self._patch_devices()
            self._patch_torch_cuda()
            self._patch_precision()
            self._patch_accelerator()
            self._patch_parallel()
            self._patch_amp_patch()
            # As for O1's patches (patching/dynamo.py): torch.compile keeps knowing the functions
            # mapped here, and maps dynamo builds meanwhile must not outlive the mapping with
            # its wrappers in them (a later compile would break its graph on each).
            self._dynamo_rules = _DYNAMO_RULES.snapshot(self._patcher)
        except BaseException:
            self.uninstall()
            raise

    def uninstall(self) -> None:
        """Restore every patched attribute (a no-op when not installed)."""
        try:
            self._forget_jit_builtins()
            try:
                self._patcher.undo_all()
            finally:
                _DYNAMO_RULES.drop_if_rebuilt(self._dynamo_rules)
                self._dynamo_rules = None
        finally:
            if self._pickles_devices:
                if copyreg.dispatch_table.get(_REAL_DEVICE) is _reduce_device:
                    del copyreg.dispatch_table[_REAL_DEVICE]
                self._pickles_devices = False

    def _patch(self, parent: Any, name: str, make: Callable[[Any], Any]) -> None:
        if self._patcher.patch(parent, name, make):
            self.targets.append((parent, name))
            self._register_jit_builtin(self._patcher.records[-1].original, getattr(parent, name))
        else:
            logger.debug("amp-patch run --device cpu: %s has no %s in this torch", parent, name)

    def _register_jit_builtin(self, original: Any, replacement: Any) -> None:
        """Let TorchScript resolve ``replacement`` to the op of ``original``, if that is one."""
        table = _jit_builtins._get_builtin_table()
        op = table.get(id(original))
        if op is None or id(replacement) in table:
            return
        _jit_builtins._register_builtin(replacement, op)
        self._jit_builtins.append((id(replacement), op))

    def _forget_jit_builtins(self) -> None:
        table = _jit_builtins._get_builtin_table()
        while self._jit_builtins:
            key, op = self._jit_builtins.pop()
            if table.get(key) == op:
                del table[key]

    def _set(self, parent: Any, name: str, value: Any) -> None:
        self._patch(parent, name, lambda _original: value)

    # ------------------------------------------------------------------ the groups of patches

    def _patch_tensors_and_modules(self) -> None:
        def tensor_cuda(self_: torch.Tensor, device: Any = None, non_blocking: bool = False,
                        memory_format: torch.memory_format = torch.preserve_format) -> torch.Tensor:
            t = self_.cpu()
            if memory_format is torch.preserve_format:
                return t
            return t.contiguous(memory_format=memory_format)

        self._set(torch.Tensor, "cuda", tensor_cuda)
        self._set(torch.nn.Module, "cuda", lambda self_, device=None: self_)
        for storage in (torch.UntypedStorage, torch.TypedStorage):
            self._set(storage, "cuda", lambda self_, device=None, non_blocking=False: self_)
        # CPU memory is not stream-ordered: nothing to record, nothing to pin for a copy.
        self._set(torch.Tensor, "record_stream", lambda self_, stream: None)
        self._set(torch.Tensor, "pin_memory", lambda self_, device=None: self_)

    def _patch_devices(self) -> None:
        self._set(torch, "device", _CpuDevice)
        if _REAL_DEVICE not in copyreg.dispatch_table:
            copyreg.dispatch_table[_REAL_DEVICE] = _reduce_device
            self._pickles_devices = True
        self._patch(torch.Tensor, "to", _map_tensor_to)
        for name in _TENSOR_DEVICE_METHODS:
            self._patch(torch.Tensor, name, _map_device_kwarg)
        for name in _factory_names():
            self._patch(torch, name, _map_device_kwarg)
        self._patch(torch, "load", _map_load)
        self._patch(torch, "get_device_module", _map_get_device_module)
        self._patch(torch, "set_default_device", lambda original: functools.wraps(original)(
            lambda device: original(_cpu_if_cuda(device))))

    def _add_missing(self, parent: Any, name: str, value: Any) -> None:
        """Give ``parent`` an attribute this torch lacks; undone by deleting it."""
        if hasattr(parent, name):
            return
        setattr(parent, name, value)
        self._patcher.records.append(PatchRecord(parent, name, None, owned=False))
        self.targets.append((parent, name))

    def _patch_torch_cuda(self) -> None:
        cuda, rng = torch.cuda, torch.random
        get_state, set_state, initial_seed = rng.get_rng_state, rng.set_rng_state, rng.initial_seed
        # torch.device("cuda") is the CPU here, so torch's own device-generic code (torch
        # 2.6's fork_rng) looks the generator up in torch.cpu, which lacks it before 2.9.
        self._add_missing(torch.cpu, "get_rng_state", lambda device=None: get_state())
        self._add_missing(torch.cpu, "set_rng_state",
                          lambda new_state, device=None: set_state(new_state))
        name = f"CPU ({cpu_half_support().cpu}) under amp-patch run --device cpu"

        def set_device(device: Any) -> None:
            index = _index(device)
            if index is not None:
                self.index = index

        def set_stream(stream: CpuStream) -> None:
            self._streams[-1] = stream

        def set_rng_state_all(states: Any) -> None:
            for state in list(states)[:1]:
                set_state(state)

        cudart = _CpuCudart()
        mapped: dict[str, Any] = {
            "is_available": lambda: True,
            "is_initialized": lambda: True,
            "init": lambda: None,
            "device_count": lambda: 1,
            "current_device": lambda: self.index,
            "set_device": set_device,
            "get_device_name": lambda device=None: name,
            "synchronize": lambda device=None: None,
            "is_bf16_supported": lambda including_emulation=True: True,
            "is_current_stream_capturing": lambda: False,
            "empty_cache": lambda: None,
            "ipc_collect": lambda: None,
            "manual_seed": lambda seed: None,
            "manual_seed_all": lambda seed: None,
            "seed": lambda: None,
            "seed_all": lambda: None,
            "initial_seed": initial_seed,
            "get_rng_state": lambda device="cuda": get_state(),
            "set_rng_state": lambda new_state, device="cuda": set_state(new_state),
            "get_rng_state_all": lambda: [get_state()],
            "set_rng_state_all": set_rng_state_all,
            "Stream": CpuStream,
            "Event": CpuEvent,
            "current_stream": lambda device=None: self._streams[-1],
            "default_stream": lambda device=None: self.default_stream,
            "set_stream": set_stream,
            "stream": lambda stream: _StreamContext(self, stream),
            "StreamContext": lambda stream: _StreamContext(self, stream),
            "device": lambda device: _DeviceContext(self, device),
            "device_of": lambda obj: _DeviceContext(self, obj),
            "cudart": lambda: cudart,
            "get_device_capability": lambda device=None: (0, 0),
        }
        own = {n: getattr(cuda, n) for n in dir(cuda) if not n.startswith("_") and n not in mapped
               and (getattr(getattr(cuda, n), "__module__", "") or "").startswith("torch.cuda")}
        for n, value in mapped.items():
            self._set(cuda, n, value)
        for n, value in own.items():
            if inspect.isfunction(value) or inspect.isbuiltin(value):
                self._set(cuda, n, _not_mapped(f"torch.cuda.{n}", value))
            elif (inspect.isclass(value) and not issubclass(value, BaseException)
                  and n not in _TENSOR_TYPES + ("HalfTensor", "cudaStatus")):
                # CUDAGraph, graph, ExternalStream, MemPool, the storage types, ...;
                # exception types stay, so that `except torch.cuda.OutOfMemoryError` still works.
                self._set(cuda, n, _refusing_class(f"torch.cuda.{n}", value))
        # torch.cuda.profiler took its own references at import.
        profiler = importlib.import_module("torch.cuda.profiler")
        self._set(profiler, "cudart", lambda: cudart)
        self._set(profiler, "check_error", check_error)
        self._set(cuda, "check_error", check_error)
        nvtx = cuda.nvtx
        self._set(nvtx, "range_push", lambda msg: 0)
        self._set(nvtx, "range_pop", lambda: 0)
        self._set(nvtx, "mark", lambda msg: None)
        self._set(nvtx, "range", lambda msg, *args, **kwargs: contextlib.nullcontext())

    def _patch_accelerator(self) -> None:
        # torch's own code asks torch.accelerator and cudnn, not torch.cuda, whether a GPU
        # is there (a CUDA build of torch 2.14's optimizers check for graph capture on the
        # current accelerator's stream); they answer as a CPU build of torch does.
        accelerator = getattr(torch, "accelerator", None)
        if accelerator is not None:
            self._set(accelerator, "is_available", lambda: False)
            self._set(accelerator, "current_accelerator", lambda check_available=False: None)
        cudnn = torch.backends.cudnn
        self._set(cudnn, "is_available", lambda: False)
        self._set(cudnn, "version", lambda: None)

    def _patch_precision(self) -> None:
        half = self.half_dtype
        cuda_types = {getattr(torch.cuda, n): getattr(torch, n) for n in _TENSOR_TYPES}
        cuda_types[torch.cuda.HalfTensor] = getattr(torch, _HALF_TENSOR_TYPES[half])
        type_names = {f"torch.cuda.{n}": f"torch.{n}" for n in _TENSOR_TYPES}
        type_names["torch.cuda.HalfTensor"] = f"torch.{_HALF_TENSOR_TYPES[half]}"

        def cpu_type(t: Any) -> Any:
            if isinstance(t, str):
                return type_names.get(t, t)
            return cuda_types.get(t, t)

        for cuda_type, cpu in cuda_types.items():
            self._set(torch.cuda, cuda_type.__name__, cpu)

        def tensor_type(original: Callable[..., Any]) -> Callable[..., Any]:
            @functools.wraps(original)
            def type_(self_: torch.Tensor, dtype: Any = None, non_blocking: bool = False,
                      **kwargs: Any) -> Any:
                if dtype is None:
                    return original(self_, **kwargs)
                return original(self_, cpu_type(dtype), non_blocking, **kwargs)

            return type_

        self._patch(torch.Tensor, "type", tensor_type)
        self._patch(torch, "set_default_tensor_type",
                    lambda original: functools.wraps(original)(lambda t: original(cpu_type(t))))
        if half is not torch.float16:
            # Module.half() calls Tensor.half() on each floating tensor, so this covers both.
            self._set(torch.Tensor, "half", lambda self_, memory_format=torch.preserve_format:
                      self_.to(half, memory_format=memory_format))

        def autocast_init(original: Callable[..., None]) -> Callable[..., None]:
            @functools.wraps(original)
            def __init__(self_: Any, device_type: str, dtype: torch.dtype | None = None, *args: Any,
                         **kwargs: Any) -> None:
                if device_type == "cuda":
                    device_type = "cpu"
                    dtype = half if dtype in (None, torch.float16) else dtype
                original(self_, device_type, dtype, *args, **kwargs)

            return __init__

        def scaler_init(original: Callable[..., None]) -> Callable[..., None]:
            @functools.wraps(original)
            def __init__(self_: Any, device: str = "cuda", *args: Any, **kwargs: Any) -> None:
                original(self_, "cpu" if device == "cuda" else device, *args, **kwargs)

            return __init__

        self._patch(torch.amp.autocast_mode.autocast, "__init__", autocast_init)
        self._patch(torch.amp.GradScaler, "__init__", scaler_init)

    def _patch_parallel(self) -> None:
        def ddp_init(original: Callable[..., None]) -> Callable[..., None]:
            @functools.wraps(original)
            def __init__(self_: Any, module: torch.nn.Module, device_ids: Any = None,
                         output_device: Any = None, *args: Any, **kwargs: Any) -> None:
                # A CPU module takes no device_ids; the script's are CUDA indices.
                original(self_, module, None, None, *args, **kwargs)

            return __init__

        self._patch(torch.nn.parallel.DistributedDataParallel, "__init__", ddp_init)
        # DataParallel over no accelerator is the module itself, as on a CPU-only machine.
        self._set(importlib.import_module("torch.nn.parallel.data_parallel"),
                  "_get_available_device_type", lambda: None)

        def data_parallel(module: torch.nn.Module, inputs: Any, device_ids: Any = None,
                          output_device: Any = None, dim: int = 0,
                          module_kwargs: dict | None = None) -> Any:
            inputs = inputs if isinstance(inputs, tuple) else (inputs,)
            return module(*inputs, **(module_kwargs or {}))

        self._set(torch.nn.parallel, "data_parallel", data_parallel)
        if torch.distributed.is_available():
            self._patch(torch.distributed, "init_process_group", _map_init_process_group)

    def _patch_amp_patch(self) -> None:
        half = self.half_dtype

        def initialize(original: Callable[..., Any]) -> Callable[..., Any]:
            @functools.wraps(original)
            def on_cpu(*args: Any, **kwargs: Any) -> Any:
                # An Apex script's float16 meant "the half type"; on the CPU that is the run's.
                for key in ("cast_model_type", "cast_model_outputs"):
                    if kwargs.get(key) is torch.float16:
                        kwargs[key] = half
                kwargs.setdefault("half_dtype", half)
                return original(*args, **kwargs)

            return on_cpu

        def init(original: Callable[..., Any]) -> Callable[..., Any]:
            @functools.wraps(original)
            def on_cpu(*args: Any, **kwargs: Any) -> Any:
                kwargs.setdefault("half_dtype", half)
                return original(*args, **kwargs)

            return on_cpu

        self._patch(amp_patch, "initialize", initialize)
        self._patch(amp_patch, "init", init)


def _map_load(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def load(f: Any, map_location: Any = None, *args: Any, **kwargs: Any) -> Any:
        if map_location is None:
            map_location = _CPU  # a GPU checkpoint would restore onto its saved CUDA devices
        elif isinstance(map_location, dict):
            map_location = {k: str(_cpu_if_cuda(v)) for k, v in map_location.items()}
        elif not callable(map_location):
            map_location = _cpu_if_cuda(map_location)
        return original(f, map_location, *args, **kwargs)

    return load


def _map_get_device_module(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def get_device_module(device: Any = None) -> Any:
        # torch.device("cuda") is the CPU now, but torch.cuda (mapped) is still the module
        # torch's own code wants for "cuda" (torch.random.fork_rng, say).
        if isinstance(device, str) and device.split(":", 1)[0] == "cuda":
            return torch.cuda
        return original(device)

    return get_device_module


def _map_init_process_group(original: Callable[..., None]) -> Callable[..., None]:
    @functools.wraps(original)
    def init_process_group(backend: str | None = None, *args: Any, **kwargs: Any) -> None:
        if backend is not None and "nccl" in str(backend).lower():
            logger.info("amp-patch run --device cpu: init_process_group(backend=%r) -> 'gloo'",
                        backend)
            backend = "gloo"
        if kwargs.get("device_id") is not None:
            kwargs["device_id"] = None  # a CUDA device to bind the group to; gloo on CPU has none
        original(backend, *args, **kwargs)

    return init_process_group
