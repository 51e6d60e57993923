"""``amp-patch run --device cpu``: CUDA calls mapped onto the CPU, and every patch undone."""

from __future__ import annotations

import importlib
import inspect
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import amp_patch
from amp_patch.cli import main as cli_main
from amp_patch.cli.run.cuda_on_cpu import CpuEvent, CpuStream, CudaNotMappedError, CudaOnCpu
from amp_patch.cli.run.command import run_script

CPU = torch.device("cpu")


def _namespaces() -> list:
    """Every object whose attributes the mapping may patch."""
    return [torch, torch.cuda, torch.cuda.nvtx, torch.random, torch.Tensor, torch.nn.Module,
            torch.UntypedStorage, torch.TypedStorage, torch.nn.parallel,
            torch.nn.parallel.DistributedDataParallel,
            importlib.import_module("torch.nn.parallel.data_parallel"), torch.distributed,
            torch.amp.autocast_mode.autocast, torch.amp.GradScaler, amp_patch,
            importlib.import_module("torch.cuda.profiler"), torch.accelerator,
            torch.backends.cudnn, torch.cpu]


def _snapshot() -> dict[int, tuple[object, dict]]:
    # Importing torch._dynamo rewraps torch.manual_seed; let that happen before, not between.
    importlib.import_module("torch._dynamo")
    return {id(ns): (ns, dict(vars(ns))) for ns in _namespaces()}


def _assert_same(before: dict[int, tuple[object, dict]], targets: list) -> None:
    assert targets, "the mapping patched nothing"
    patched_parents = {id(parent) for parent, _ in targets}
    assert patched_parents <= set(before), "a patched object is missing from the snapshot"
    for ns, attrs in before.values():
        # A submodule imported meanwhile (torch._dynamo, say) is an import, not a patch.
        now = {k: v for k, v in vars(ns).items() if k in attrs or not inspect.ismodule(v)}
        assert now.keys() == attrs.keys(), f"{ns}: added or removed: {now.keys() ^ attrs.keys()}"
        changed = [k for k in attrs if now[k] is not attrs[k]]
        assert not changed, f"{ns}: not the same object after uninstall: {changed}"


def test_uninstall_restores_every_attribute_identically():
    before = _snapshot()
    mapping = CudaOnCpu(torch.bfloat16)
    with mapping:
        assert torch.cuda.is_available() and mapping.installed
    assert not mapping.installed
    _assert_same(before, mapping.targets)
    # Twice in one process, as the same object.
    with mapping:
        pass
    _assert_same(before, mapping.targets)


SCRIPT = """
    import torch
    from apex import amp
    model = torch.nn.Linear(4, 2).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O1", verbosity=0)   # left live on purpose
    x = torch.randn(3, 4, device="cuda")
    with amp.scale_loss(model(x).float().sum(), opt) as scaled:
        scaled.backward()
    opt.step()
    torch.cuda.synchronize()
    RESULT.append(x.device)
"""


def test_run_script_undoes_mapping_and_the_scripts_session(tmp_path):
    """A library process that ran a script with --device cpu is left exactly as before."""
    script = tmp_path / "script.py"
    script.write_text("RESULT = __import__('builtins').RESULT\n" + textwrap.dedent(SCRIPT))
    import builtins

    builtins.RESULT = []
    before = _snapshot()
    cuda_available = torch.cuda.is_available()
    mapping = CudaOnCpu(torch.bfloat16)
    try:
        run_script(str(script), [], shadow_apex=True, cuda_on_cpu=mapping)
    finally:
        del builtins.RESULT
    assert amp_patch.session.current() is None  # O1's patches went with the session
    _assert_same(before, mapping.targets)
    assert torch.cuda.is_available() is cuda_available
    assert "apex" not in sys.modules


def test_install_failure_undoes_what_was_applied(monkeypatch):
    before = _snapshot()
    mapping = CudaOnCpu(torch.bfloat16)

    def boom() -> None:
        raise RuntimeError("late failure")

    monkeypatch.setattr(mapping, "_patch_amp_patch", boom)
    with pytest.raises(RuntimeError, match="late failure"):
        mapping.install()
    assert not mapping.installed
    _assert_same(before, mapping.targets)


def test_devices_tensors_and_modules_map_to_cpu():
    with CudaOnCpu(torch.bfloat16):
        model = torch.nn.Linear(3, 2)
        assert model.cuda() is model and model.cuda(1) is model
        x = torch.ones(2, 3)
        assert x.cuda(non_blocking=True) is x
        assert x.cuda(memory_format=torch.contiguous_format) is x
        dev = torch.device("cuda:0")
        for t in (torch.zeros(2, device="cuda"), torch.randn(2, device=dev),
                  torch.full((2,), 1.0, device="cuda:1"), torch.arange(3, device=0),
                  torch.tensor([1.0], device="cuda"), torch.empty_like(x, device="cuda"),
                  x.new_zeros(2, device="cuda"), x.to("cuda"), x.to(dev, torch.float64),
                  x.to(device="cuda:1"), x.to(0), model.to(dev).weight):
            assert t.device == CPU
        assert x.to("cuda", non_blocking=True) is x
        assert x.to(torch.float64).dtype == torch.float64  # dtypes pass through
        assert x.pin_memory() is x
        assert torch.cuda.FloatTensor([1.0]).device == CPU
        assert x.type("torch.cuda.DoubleTensor").dtype == torch.float64
        assert x.type(torch.cuda.LongTensor).dtype == torch.int64
        assert x.type() == "torch.FloatTensor"


def test_device_constructor_maps_cuda_and_stays_the_device_type(tmp_path):
    import copyreg
    import io
    import pickle
    import typing

    real = torch.device
    with CudaOnCpu(torch.bfloat16):
        for dev in (torch.device(0), torch.device("cuda"), torch.device("cuda", 0),
                    torch.device(type="cuda", index=0), torch.device("cuda:1"),
                    torch.device(real("cuda", 1)), torch.device("cuda", index=2)):
            assert type(dev) is real and dev == CPU
        assert torch.device("meta") == real("meta") and torch.device("cpu", 0) == real("cpu", 0)
        with pytest.raises(RuntimeError):
            torch.device("no-such-device")
        assert isinstance(torch.device("cuda"), torch.device)
        assert isinstance(torch.zeros(1).device, torch.device)
        assert not isinstance("cuda", torch.device)
        assert issubclass(real, torch.device)

        def f(x: torch.device | None = None) -> torch.device:
            return x

        assert typing.get_type_hints(f)["return"] is torch.device
        with torch.device("cuda"):
            assert torch.zeros(1).device == CPU
        torch.cuda.set_device("cuda:1")
        assert torch.cuda.current_device() == 1
        assert torch.zeros(1).to(torch.device("cuda")).device == CPU
        # A device pickles as torch's: the stream reads back where nothing is installed.
        blob = pickle.dumps({"d": torch.device("meta")})
        buf = io.BytesIO()
        torch.save({"d": torch.device("cuda")}, buf)
    assert torch.device is real and real not in copyreg.dispatch_table
    assert pickle.loads(blob) == {"d": real("meta")}
    buf.seek(0)
    assert torch.load(buf) == {"d": CPU}


def test_profiler_and_capability_queries_of_legacy_trainers():
    with CudaOnCpu(torch.bfloat16):
        # Apex's ImageNet example, --prof; OpenNMT-py's flash-attention check.
        assert torch.cuda.cudart().cudaProfilerStart() == 0
        assert torch.cuda.cudart().cudaProfilerStop() == 0
        torch.cuda.profiler.start()
        torch.cuda.profiler.stop()
        with torch.cuda.profiler.profile():
            pass
        assert torch.cuda.get_device_capability() == (0, 0)
        assert torch.cuda.get_device_capability(0)[0] < 8


def test_torch_cuda_queries_streams_and_events():
    with CudaOnCpu(torch.bfloat16) as mapping:
        assert torch.cuda.is_available() and torch.cuda.is_initialized()
        assert torch.cuda.device_count() == 1 and torch.cuda.current_device() == 0
        torch.cuda.set_device(1)
        assert torch.cuda.current_device() == 1 == mapping.index
        with torch.cuda.device("cuda:3"):
            assert torch.cuda.current_device() == 3
        with torch.cuda.device(torch.device("cuda:2")):  # made on the CPU: the index is gone
            assert torch.cuda.current_device() == 1
        assert torch.cuda.current_device() == 1
        assert "CPU" in torch.cuda.get_device_name(0)
        torch.cuda.synchronize()
        torch.cuda.synchronize(torch.device("cuda:0"))
        torch.cuda.empty_cache()
        torch.cuda.manual_seed_all(3)

        side = torch.cuda.Stream()
        assert isinstance(side, CpuStream) and isinstance(side, torch.cuda.Stream)
        main = torch.cuda.current_stream()
        assert main is torch.cuda.default_stream()
        with torch.cuda.stream(side):
            assert torch.cuda.current_stream() is side
            y = torch.ones(3).cuda(non_blocking=True)
        assert torch.cuda.current_stream() is main
        main.wait_stream(side)
        y.record_stream(main)
        assert side.query() and side.record_event().query()

        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        assert isinstance(start, CpuEvent)
        start.record()
        torch.mm(torch.randn(64, 64), torch.randn(64, 64))
        end.record()
        end.synchronize()
        assert start.elapsed_time(end) >= 0.0
        with pytest.raises(RuntimeError, match="enable_timing"):
            torch.cuda.Event().elapsed_time(end)

        torch.cuda.nvtx.range_push("forward")
        torch.cuda.nvtx.range_pop()
        state = torch.cuda.get_rng_state()
        a = torch.randn(3, device="cuda")
        torch.cuda.set_rng_state(state)
        assert torch.equal(torch.randn(3, device="cuda"), a)
        with torch.random.fork_rng():  # torch's own code, calling the mapped functions
            torch.randn(2)


@pytest.mark.parametrize("call, name", [
    (lambda: torch.cuda.get_device_properties(0), "torch.cuda.get_device_properties()"),
    (lambda: torch.cuda.memory_allocated(), "torch.cuda.memory_allocated()"),
    (lambda: torch.cuda.get_device_properties(), "torch.cuda.get_device_properties()"),
    (lambda: torch.cuda.CUDAGraph(), "torch.cuda.CUDAGraph()"),
    (lambda: torch.cuda.graph(None), "torch.cuda.graph()"),
    (lambda: torch.cuda.ExternalStream(0), "torch.cuda.ExternalStream()"),
    (lambda: torch.cuda.Event(interprocess=True), "torch.cuda.Event(interprocess=True)"),
])
def test_unmapped_calls_fail_naming_the_call(call, name):
    with CudaOnCpu(torch.bfloat16):
        with pytest.raises(CudaNotMappedError) as exc:
            call()
    assert str(exc.value).startswith(name)


def test_half_follows_the_half_dtype():
    with CudaOnCpu(torch.bfloat16):
        model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.BatchNorm1d(2)).cuda().half()
        assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
        assert model[1].num_batches_tracked.dtype == torch.int64
        assert torch.ones(2).half().dtype == torch.bfloat16
        assert torch.cuda.HalfTensor([1.0]).dtype == torch.bfloat16
        assert torch.ones(2).type("torch.cuda.HalfTensor").dtype == torch.bfloat16
        with torch.autocast("cuda"):
            assert torch.mm(torch.ones(2, 2), torch.ones(2, 2)).dtype == torch.bfloat16
        with pytest.warns(FutureWarning), torch.cuda.amp.autocast():
            assert torch.mm(torch.ones(2, 2), torch.ones(2, 2)).dtype == torch.bfloat16
        scaler = torch.amp.GradScaler("cuda")
        p = torch.nn.Parameter(torch.ones(2))
        opt = torch.optim.SGD([p], lr=0.1)
        scaler.scale(p.sum()).backward()
        scaler.step(opt)
        scaler.update()
        assert torch.equal(p.detach(), torch.full((2,), 0.9))
    with CudaOnCpu(torch.float16):
        assert torch.ones(2).half().dtype == torch.float16
        assert torch.cuda.HalfTensor([1.0]).dtype == torch.float16
    assert torch.ones(2).half().dtype == torch.float16


@pytest.mark.parametrize("half", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_amp_initialize_and_init_default_to_the_runs_half_dtype(half):
    with CudaOnCpu(half):
        model = torch.nn.Linear(4, 4).cuda()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        # An Apex script's float16 means "the half type" under the mapping.
        model, opt = amp_patch.initialize(model, opt, opt_level="O2", cast_model_type=torch.float16,
                                          verbosity=0)
        assert model.weight.dtype == half
        amp_patch.deinitialize()
        handle = amp_patch.init()
        assert amp_patch.session.current().props.half_dtype == half
        handle._deactivate()


def test_parallel_wrappers_on_the_cpu():
    with CudaOnCpu(torch.bfloat16):
        model = torch.nn.Linear(3, 2).cuda()
        dp = torch.nn.DataParallel(model)
        x = torch.randn(4, 3, device="cuda")
        assert torch.equal(dp(x), model(x))
        assert torch.equal(torch.nn.parallel.data_parallel(model, x, range(2)), model(x))


def test_torch_load_maps_cuda_locations(tmp_path):
    path = tmp_path / "ckpt.pt"
    torch.save({"w": torch.arange(3.0)}, path)
    with CudaOnCpu(torch.bfloat16):
        for kwargs in ({}, {"map_location": "cuda:1"}, {"map_location": {"cpu": "cuda:0"}},
                       {"map_location": lambda storage, loc: storage.cuda(0)}):
            assert torch.load(path, **kwargs)["w"].device == CPU


def _run_cli(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "amp_patch", "run", *args], capture_output=True,
                          text=True, timeout=300, cwd=tmp_path)


@pytest.mark.slow
def test_cli_says_once_what_it_maps(tmp_path):
    (tmp_path / "s.py").write_text(textwrap.dedent("""
        import torch
        from apex import amp
        m = torch.nn.Linear(2, 2).cuda()
        x = torch.randn(1, device="cuda")
        print("ok", torch.cuda.is_available(), x.device, m.weight.half().dtype)
    """))
    proc = _run_cli(tmp_path, "--device", "cpu", "s.py")
    assert proc.returncode == 0, proc.stderr
    assert "ok True cpu torch.bfloat16" in proc.stdout
    assert proc.stderr.count("the script's CUDA calls run on the CPU") == 1
    assert proc.stderr.count("CPU half compute: bf16") == 1  # machine.cpu_half_banner
    for what in ("Module.cuda()", "torch.cuda.synchronize()", "record_stream()",
                 "init_process_group"):
        assert what in proc.stderr
    proc = _run_cli(tmp_path, "--device", "cpu", "--half-dtype", "fp16", "s.py")
    assert proc.returncode == 0 and "ok True cpu torch.float16" in proc.stdout, proc.stderr


@pytest.mark.slow
def test_cli_unmapped_call_names_it(tmp_path):
    (tmp_path / "s.py").write_text("import torch\ntorch.cuda.max_memory_allocated()\n")
    proc = _run_cli(tmp_path, "--device", "cpu", "s.py")
    assert proc.returncode == 1
    assert "CudaNotMappedError: torch.cuda.max_memory_allocated() has no CPU mapping" in proc.stderr


@pytest.mark.parametrize("args, message", [
    (["--device", "cuda", "s.py"], "CUDA is not available"),
    (["--device", "tpu", "s.py"], "expected cpu, cuda or cuda:N"),
    (["--half-dtype", "fp16", "s.py"], "--half-dtype applies with --device cpu only"),
    (["--device", "cpu", "no_such_script.py"], "no such script: no_such_script.py"),
    (["--device", "cpu", "--half-dtype", "fp8", "s.py"], "invalid choice: 'fp8'"),
])
def test_run_usage_errors_exit_2(args, message, capsys, monkeypatch, tmp_path):
    if "cuda" in args and torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    (tmp_path / "s.py").write_text("raise SystemExit('the script must not start')\n")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exc:
        cli_main.main(["run", *args])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "usage: amp-patch run" in err


#: One scripted call per remapped factory (``_factory_names``), ``x`` a 2x2 fp32 tensor and
#: ``path`` a file of 16 bytes; docs/run.md, "TorchScript".
SCRIPTED_FACTORIES = {
    "arange": "torch.arange(4)",
    "as_tensor": "torch.as_tensor([1.0, 2.0])",
    "asarray": "torch.asarray(x)",
    "bartlett_window": "torch.bartlett_window(4)",
    "blackman_window": "torch.blackman_window(4)",
    "empty": "torch.empty([2, 3])",
    "empty_like": "torch.empty_like(x)",
    "empty_permuted": "torch.empty_permuted([2, 3], [1, 0])",
    "empty_quantized": "torch.empty_quantized([2], torch.quantize_per_tensor(x, 0.1, 0, "
                       "torch.quint8))",
    "empty_strided": "torch.empty_strided([2, 3], [3, 1])",
    "eye": "torch.eye(3)",
    "from_file": "torch.from_file(path, False, 4)",
    "full": "torch.full([2, 2], 3.0)",
    "full_like": "torch.full_like(x, 3.0)",
    "hamming_window": "torch.hamming_window(4)",
    "hann_window": "torch.hann_window(4)",
    "kaiser_window": "torch.kaiser_window(4)",
    "linspace": "torch.linspace(0.0, 1.0, 5)",
    "logspace": "torch.logspace(0.0, 1.0, 5)",
    "normal": "torch.normal(0.0, 1.0, [3])",
    "ones": "torch.ones([2, 3])",
    "ones_like": "torch.ones_like(x)",
    "rand": "torch.rand([2, 3])",
    "rand_like": "torch.rand_like(x)",
    "randint": "torch.randint(0, 5, [3])",
    "randint_like": "torch.randint_like(x, 5)",
    "randn": "torch.randn([2, 3])",
    "randn_like": "torch.randn_like(x)",
    "randperm": "torch.randperm(5)",
    "range": "torch.range(0.0, 3.0)",
    "scalar_tensor": "torch.scalar_tensor(2.0)",
    "sparse_bsc_tensor": "torch.sparse_bsc_tensor(torch.tensor([0, 1]), torch.tensor([0]), "
                         "torch.ones([1, 2, 2]), [2, 2])",
    "sparse_bsr_tensor": "torch.sparse_bsr_tensor(torch.tensor([0, 1]), torch.tensor([0]), "
                         "torch.ones([1, 2, 2]), [2, 2])",
    "sparse_compressed_tensor": "torch.sparse_compressed_tensor(torch.tensor([0, 1, 2]), "
                                "torch.tensor([0, 1]), torch.tensor([1.0, 2.0]), [2, 2], "
                                "layout=torch.sparse_csr)",
    "sparse_coo_tensor": "torch.sparse_coo_tensor(torch.tensor([[0, 1], [1, 0]]), "
                         "torch.tensor([1.0, 2.0]), [2, 2])",
    "sparse_csc_tensor": "torch.sparse_csc_tensor(torch.tensor([0, 1, 2]), torch.tensor([0, 1]), "
                         "torch.tensor([1.0, 2.0]), [2, 2])",
    "sparse_csr_tensor": "torch.sparse_csr_tensor(torch.tensor([0, 1, 2]), torch.tensor([0, 1]), "
                         "torch.tensor([1.0, 2.0]), [2, 2])",
    "tensor": "x + torch.tensor(1.0)",
    "tril_indices": "torch.tril_indices(3, 3)",
    "triu_indices": "torch.triu_indices(3, 3)",
    "zeros": "torch.zeros([2, 3])",
    "zeros_like": "torch.zeros_like(x)",
}


def _script_factory(name: str, path: str):
    source = (f"def f(x: Tensor, path: str):\n"
              f"    return {SCRIPTED_FACTORIES[name]}\n")
    return torch.jit.CompilationUnit(source).f


def _comparable(t: torch.Tensor, values: bool) -> tuple:
    dense = t.dequantize() if t.is_quantized else t.to_dense() if t.layout != torch.strided else t
    return (t.shape, t.dtype, t.layout, dense.tolist() if values else None)


def test_torchscript_resolves_every_mapped_factory_to_torchs_op():
    """Each factory's wrapper is found in TorchScript's builtin table under the original's op,
    and only while the mapping is installed (docs/run.md, "TorchScript")."""
    from amp_patch.cli.run.cuda_on_cpu import _factory_names
    from torch.jit._builtins import _find_builtin

    names = _factory_names()
    assert set(names) <= set(SCRIPTED_FACTORIES), "a new factory needs a scripted call above"
    originals = {n: getattr(torch, n) for n in names}
    ops = {n: _find_builtin(f) for n, f in originals.items()}
    assert all(ops.values())
    with CudaOnCpu(torch.bfloat16):
        wrappers = {n: getattr(torch, n) for n in names}
        assert all(wrappers[n] is not originals[n] for n in names)
        assert {n: _find_builtin(w) for n, w in wrappers.items()} == ops
        assert _find_builtin(torch.device) == "aten::device"
    assert {n: _find_builtin(f) for n, f in originals.items()} == ops
    assert not any(_find_builtin(w) for w in wrappers.values())


@pytest.mark.parametrize("name", sorted(SCRIPTED_FACTORIES))
def test_scripted_factory_runs_under_the_mapping(name, tmp_path):
    if not callable(getattr(torch, name, None)):
        pytest.skip(f"torch.{name} is not in this torch")
    path = tmp_path / "data.bin"
    path.write_bytes(bytes(16))
    x = torch.arange(4.0).reshape(2, 2)
    try:
        torch.manual_seed(0)
        expected = _script_factory(name, str(path))(x, str(path))
    except Exception as exc:  # torch's own limit, not the mapping's
        pytest.skip(f"TorchScript cannot script torch.{name} here: {type(exc).__name__}")
    values = not name.startswith("empty")
    with CudaOnCpu(torch.bfloat16):
        torch.manual_seed(0)
        got = _script_factory(name, str(path))(x, str(path))
    assert _comparable(got, values) == _comparable(expected, values)


def test_script_and_trace_under_the_mapping():
    """``torch.jit.script`` and ``torch.jit.trace`` of code that calls mapped factories."""
    with CudaOnCpu(torch.bfloat16):
        @torch.jit.script
        def shift(x: torch.Tensor) -> torch.Tensor:
            return x + torch.tensor(1.0) + torch.zeros_like(x)

        class Net(torch.nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.lin = torch.nn.Linear(2, 2)

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                return self.lin(x) + torch.ones(2, device=x.device)

        net = Net().cuda()
        scripted = torch.jit.script(net)
        x = torch.randn(3, 2, device="cuda")
        traced = torch.jit.trace(net, (x,))
        assert torch.equal(shift(torch.ones(2)), torch.full((2,), 2.0))
        assert torch.equal(scripted(x), net(x)) and torch.equal(traced(x), net(x))
    # Compiled under the mapping, they keep working without it.
    assert torch.equal(shift(torch.ones(2)), torch.full((2,), 2.0))
    assert torch.equal(scripted(x), net(x))


@pytest.mark.slow
def test_cli_torchscript_and_torch_distributed_optim(tmp_path):
    """torch's own scripted modules import, and a script's scripted function runs."""
    (tmp_path / "t.py").write_text(textwrap.dedent("""
        import torch
        import torch.distributed.optim

        @torch.jit.script
        def f(x):
            return x + torch.tensor(1.0)

        print("ok", f(torch.ones(2, device="cuda")).tolist())
    """))
    proc = _run_cli(tmp_path, "--device", "cpu", "t.py")
    assert proc.returncode == 0, proc.stderr
    assert "ok [2.0, 2.0]" in proc.stdout


def test_device_context_knows_torchs_factories_after_the_mapping():
    """`with torch.device(...)` keeps a cached set of factory functions: built while the
    mapping's wrappers were installed, it would miss torch's own factories after it, and a
    model made under `with torch.device("meta")` would land on the CPU."""
    import torch.utils._device as device_module

    device_module._device_constructors.cache_clear()  # as in a process that never used it
    with CudaOnCpu(torch.bfloat16):
        with torch.device("cuda"):
            assert torch.zeros(1).device == CPU
    with torch.device("meta"):
        assert torch.zeros(1).device.type == "meta"
        assert torch.nn.Linear(2, 2).weight.device.type == "meta"
