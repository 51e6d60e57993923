"""A training step with no host read (docs/design.md, "Host syncs").

Sync-free (the default), ``scale_loss``'s exit updates the loss scale on the
device and hands each optimizer its skip as a device flag; an optimizer that
takes the flag as a tensor (torch's ``fused=True`` Adam, AdamW and SGD) skips
on the device, so a whole iteration reads nothing on the host, overflow steps
included. Any other optimizer reads the flag once, in ``step()``. What the host
wants to know (the scale, the overflow message, a collapse) is read lazily.
Training is bitwise the same as with ``sync_free=False``, which reads at every
exit as Apex did.
"""

from __future__ import annotations

import logging

import pytest
import torch

import amp_patch as amp
from amp_patch import session as amp_session
from amp_patch.optim.amp.patched_methods import host_reads_per_step
from amp_patch.apex_compat.amp_state import LossScalerView
from amp_patch.cli import doctor
from amp_patch.optim.fused import FusedAdam, FusedSGD
from amp_patch.scaler import AmpScaler, LossScaleCollapseError
from training_utils import assert_identical, count_device_reads, mlp, mlp_batch, snapshot, xent

LEVELS = ["O0", "O1", "O2", "O3"]
#: Iterations whose grads get an inf: the step is skipped and the scale halves.
OVERFLOWS = (2, 5)
STEPS = 7

FUSED = {
    "adamw-fused": lambda params: torch.optim.AdamW(params, lr=1e-2, weight_decay=0.01,
                                                    fused=True),
    "sgd-fused": lambda params: torch.optim.SGD(params, lr=0.1, fused=True),
    # amp_patch's FusedAdam (fp32 state): its step counters and bias corrections on the device.
    "fused-adam": lambda params: FusedAdam(params, lr=1e-2, weight_decay=0.01),
    # amp_patch's FusedSGD (fp32 state): no step counter; a first step skipped on the device
    # leaves a zero buffer, which the next step reads to the same bits (no dampening).
    "fused-sgd": lambda params: FusedSGD(params, lr=0.1, momentum=0.9, nesterov=True),
}


def _run(level, half, optimizer, sync_free, steps=STEPS):
    """Train ``steps`` iterations; returns (device reads per iteration, final state, scale).

    Overflows are injected where the level checks for them: not on bf16's fast path (static
    scale 1.0, no masters), which checks nothing, as plain torch does not."""
    overflows = OVERFLOWS if half == torch.float16 or level == "O2" else ()
    model = mlp()
    opt = optimizer(model.parameters())
    amp.initialize(model, opt, opt_level=level, half_dtype=half, sync_free=sync_free,
                   loss_scale="dynamic" if half == torch.float16 else None, verbosity=0)
    reads = []
    for step in range(steps):
        x, y = mlp_batch(step)
        with count_device_reads() as counted:
            loss = xent(model(x), y)
            with amp.scale_loss(loss, opt) as scaled:
                scaled.backward()
                if step in overflows:
                    next(model.parameters()).grad.view(-1)[0] = float("inf")
            opt.step()
            opt.zero_grad()
        reads.append(counted["n"])
    scale = amp.state_dict()["loss_scaler0"]["loss_scale"]
    state = snapshot([model], [opt])
    # Group step counters (amp_patch's fused optimizers; a device tensor when kept there).
    steps = [int(g["step"].item() if isinstance(g.get("step"), torch.Tensor) else g.get("step", 0))
             for g in opt.param_groups]
    amp.deinitialize()
    return reads, state, scale, steps


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(FUSED))
@pytest.mark.parametrize("half", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("level", LEVELS)
def test_no_host_read_with_fused_optimizers(level, half, name):
    reads, state, scale, steps = _run(level, half, FUSED[name], sync_free=True)
    assert reads == [0] * STEPS
    # The same training, bit for bit, as when the host reads the overflow at every exit.
    host_reads, host_state, host_scale, host_steps = _run(level, half, FUSED[name],
                                                          sync_free=False)
    assert_identical(state, host_state)
    assert scale == host_scale
    assert steps == host_steps  # the group step counters: skipped steps not counted
    if half == torch.float16:
        assert scale == 2.0**16 / 2 ** len(OVERFLOWS)
        assert host_reads == [1] * STEPS  # Apex's one read per exit


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_other_optimizers_read_once_in_step(level):
    """torch's SGD without ``fused`` cannot take the flag: it reads it in step(), once."""
    make = lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9)  # noqa: E731
    reads, state, scale, _ = _run(level, torch.float16, make, sync_free=True)
    assert reads == [1] * STEPS
    _, host_state, host_scale, _ = _run(level, torch.float16, make, sync_free=False)
    assert_identical(state, host_state)
    assert scale == host_scale


_READERS = {
    "torch-adamw-fused": FUSED["adamw-fused"],
    "torch-sgd": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
    "fused-adam": lambda params: FusedAdam(params, lr=1e-2),
    "fused-sgd": lambda params: FusedSGD(params, lr=0.1, momentum=0.9),
}


@pytest.mark.parametrize("name", sorted(_READERS))
@pytest.mark.parametrize("level", ["O1", "O2"])
def test_reads_per_step_are_what_doctor_says(level, name):
    """host_reads_per_step (amp-patch doctor's 'host syncs' row) is what an iteration reads."""
    reads, _, _, _ = _run(level, torch.float16, _READERS[name], sync_free=True)
    model = mlp()
    expected = host_reads_per_step(_READERS[name](model.parameters()))
    assert reads[1:] == [expected] * (STEPS - 1)
    assert expected == (0 if name in ("torch-adamw-fused", "fused-adam", "fused-sgd") else 1)
    assert "amp_patch FusedAdam, FusedSGD (fp32 state): 0 per step" in doctor._host_syncs()


def test_fused_sgd_momentum_reads_the_flag_until_its_buffers_exist():
    """torch's fused SGD leaves a new momentum buffer uninitialised when its first step is
    skipped on the device: until the buffers exist, the flag is read on the host instead."""
    make = lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9, fused=True)  # noqa: E731
    model = mlp()
    opt = make(model.parameters())
    amp.initialize(model, opt, opt_level="O2", half_dtype=torch.float16, verbosity=0)
    reads = []
    for step in range(3):
        with count_device_reads() as counted:
            _iteration(model, opt, step, overflow=step == 0)
        reads.append(counted["n"])
    assert reads == [1, 1, 0]  # skipped (no buffer made), first step (made), then on the device
    assert all(torch.isfinite(s["momentum_buffer"]).all() for s in opt.state.values())


def test_fused_sgd_with_dampening_reads_the_flag_until_its_buffers_exist():
    """amp_patch's FusedSGD with dampening: a skipped first step would leave its new buffers at
    zero, which the next step would weigh by 1 - dampening; it reads the flag until they exist,
    and trains as with sync_free=False."""
    make = lambda params: FusedSGD(params, lr=0.1, momentum=0.9, dampening=0.5)  # noqa: E731
    states = []
    for sync_free in (True, False):
        model = mlp()
        opt = make(model.parameters())
        amp.initialize(model, opt, opt_level="O2", half_dtype=torch.float16, sync_free=sync_free,
                       verbosity=0)
        reads = []
        for step in range(3):
            with count_device_reads() as counted:
                _iteration(model, opt, step, overflow=step == 0)
            reads.append(counted["n"])
        states.append(snapshot([model], [opt]))
        amp.deinitialize()
        if sync_free:
            assert reads == [1, 1, 0]
    assert_identical(*states)


def _iteration(model, opt, step, overflow=False):
    x, y = mlp_batch(step)
    with amp.scale_loss(xent(model(x), y), opt) as scaled:
        scaled.backward()
        if overflow:
            model[2].bias.grad[0] = float("nan")
    opt.step()
    opt.zero_grad()


def test_skipped_step_changes_nothing_on_the_device():
    """An overflowed step of a fused optimizer runs with the flag set and changes nothing:
    params, moments and step counters (the fused kernels' own skip)."""
    model = mlp()
    opt = FUSED["adamw-fused"](model.parameters())
    amp.initialize(model, opt, opt_level="O1", half_dtype=torch.float16, verbosity=0)
    for step in range(2):
        x, y = mlp_batch(step)
        with amp.scale_loss(xent(model(x), y), opt) as scaled:
            scaled.backward()
            if step == 1:
                before = snapshot([model], [opt])
                model[0].weight.grad[0, 0] = float("nan")
        opt.step()
        opt.zero_grad()
    assert_identical(snapshot([model], [opt]), before)


def _overflowing_iteration(model, opt):
    x, y = mlp_batch(0)
    with amp.scale_loss(xent(model(x), y), opt) as scaled:
        scaled.backward()
        model[2].bias.grad[0] = float("nan")
    opt.step()
    opt.zero_grad()


def test_overflow_message_comes_at_the_host_read(caplog):
    model = mlp()
    opt = FUSED["sgd-fused"](model.parameters())
    amp.initialize(model, opt, opt_level="O2", half_dtype=torch.float16, loss_scale="dynamic",
                   host_read_interval=3, verbosity=1)
    message = "Gradient overflow.  Skipping step, loss scaler 0 reducing loss scale to"
    with caplog.at_level(logging.INFO, logger="amp_patch"):
        caplog.clear()
        _overflowing_iteration(model, opt)
        assert not [r for r in caplog.records if message in r.getMessage()]
        # Asking for the scale (Apex's _amp_state.loss_scalers[0].loss_scale()) reads it, and
        # the message of the overflow comes with it.
        assert LossScalerView(amp_session.current().scalers[0]).loss_scale() == 2.0**15
        assert [r.getMessage() for r in caplog.records if message in r.getMessage()] == [
            f"{message} 32768.0"]
        caplog.clear()
        for _ in range(3):  # the third update reads: two overflows since the last read
            _overflowing_iteration(model, opt)
        got = [r.getMessage() for r in caplog.records if message in r.getMessage()]
    assert got == [f"{message} 4096.0 (3 overflows since the last read of the scale)"]


def test_collapse_raises_at_the_next_host_read():
    model = mlp()
    opt = FUSED["sgd-fused"](model.parameters())
    amp.initialize(model, opt, opt_level="O1", half_dtype=torch.float16, loss_scale="dynamic",
                   min_loss_scale=2.0**15, host_read_interval=2, verbosity=0)
    before = snapshot([model], [opt])
    _overflowing_iteration(model, opt)  # 2**16 -> 2**15, the floor
    with pytest.raises(LossScaleCollapseError, match=r"2\.bias"):
        _overflowing_iteration(model, opt)  # would fall below: found now, at the second read
    opt.step()  # whoever catches the collapse still does not step on these grads
    assert_identical(snapshot([model], [opt]), before)


def test_scaler_on_the_device_follows_the_host_rule():
    """update_on_device and the host's reading of it give the rule of docs/design.md: halve on
    overflow, double after scale_window clean updates, capped and floored."""
    ours = AmpScaler("dynamic", max_loss_scale=2.0**17, host_read_interval=10**6)
    ours.scale_window = 3
    flags = [0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 1, 1]
    expected, scale, clean = [], 2.0**16, 0
    for hit in flags:
        ours.device_tensors(torch.device("cpu")).found_inf.fill_(float(hit))
        flag = ours.update_on_device()
        assert flag is not None and flag.item() == float(hit)
        if hit:
            scale, clean = scale / 2, 0
        else:
            clean += 1
            if clean == 3:
                scale, clean = min(scale * 2, 2.0**17), 0
        expected.append(scale)
    assert ours._unread
    assert ours.loss_scale == expected[-1]
    assert ours.state_dict() == {"loss_scale": expected[-1], "unskipped": 0,
                                 "skipped": 3, "dynamic": True, "consecutive_skips": 2}
    assert ours.device_tensors(torch.device("cpu")).inv_scale.item() == 1 / expected[-1]


def test_loaded_state_replaces_unread_updates():
    scaler = AmpScaler("dynamic", host_read_interval=10**6)
    scaler.device_tensors(torch.device("cpu")).found_inf.fill_(1.0)
    scaler.update_on_device()
    scaler.load_state_dict({"loss_scale": 512.0, "unskipped": 7})
    assert scaler.state_dict()["loss_scale"] == 512.0 and scaler.state_dict()["unskipped"] == 7
    scaler.update_on_device()
    assert scaler.loss_scale == 512.0 and scaler.state_dict()["unskipped"] == 8


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "10"])
def test_host_read_interval_is_validated(bad):
    with pytest.raises(ValueError, match="host_read_interval"):
        amp.initialize(mlp(), opt_level="O1", host_read_interval=bad, verbosity=0)


def test_sync_free_is_validated():
    with pytest.raises(ValueError, match="sync_free"):
        amp.initialize(mlp(), opt_level="O1", sync_free="yes", verbosity=0)


def _compiled_training(level, half, backend, steps=20, overflows=(3, 9)):
    """Forward, loss and scale_loss (its exit included) in one compiled function with
    ``fullgraph=True``; the optimizer steps after it. Returns (losses, final scale, graphs)."""
    from torch._dynamo.utils import counters

    model = mlp()
    opt = FUSED["adamw-fused"](model.parameters())
    amp.initialize(model, opt, opt_level=level, half_dtype=half, verbosity=0,
                   loss_scale="dynamic" if half == torch.float16 else None)

    def forward_backward(x, y, poison):
        loss = xent(model(x), y) * poison
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        return loss.detach()

    torch._dynamo.reset()
    counters.clear()
    step_fn = forward_backward if backend is None else torch.compile(
        forward_backward, fullgraph=True, backend=backend)
    losses = []
    for step in range(steps):
        x, y = mlp_batch(step)
        # An inf loss where an overflow should be: a tensor input, so no recompile.
        poison = torch.tensor(float("inf") if step in overflows else 1.0)
        losses.append(step_fn(x, y, poison))
        opt.step()
        opt.zero_grad()
    scale = amp_session.current().scalers[0].loss_scale
    amp.deinitialize()
    return torch.stack(losses), scale, counters["stats"]["unique_graphs"]


_COMPILED = [pytest.param(level, half, marks=[] if (level, half) == ("O2", torch.float16)
                          else [pytest.mark.slow], id=f"{level}-{str(half)[6:]}")
             for level in ("O1", "O2", "O3") for half in (torch.float16, torch.bfloat16)]


@pytest.mark.skipif(not hasattr(torch._dynamo.config, "trace_autograd_ops"),
                    reason="this torch cannot trace backward() inside a compiled region")
@pytest.mark.parametrize("level, half", _COMPILED)
def test_step_compiles_whole_and_trains_as_eager(level, half):
    """No host read is left in scale_loss, so it compiles into the forward's graph: no graph
    break, one recompile (the scaler's device state made at the first update), and with
    aot_eager (the same aten ops) the very losses and final scale of eager training."""
    with torch._dynamo.config.patch(trace_autograd_ops=True):
        compiled, scale, graphs = _compiled_training(level, half, "aot_eager")
    eager, eager_scale, _ = _compiled_training(level, half, None)
    assert graphs <= 2
    assert torch.equal(compiled.nan_to_num(0.0, 0.0, 0.0), eager.nan_to_num(0.0, 0.0, 0.0))
    assert scale == eager_scale
    if half == torch.float16:
        assert scale == 2.0**16 / 4


@pytest.mark.slow
@pytest.mark.skipif(not hasattr(torch._dynamo.config, "trace_autograd_ops"),
                    reason="this torch cannot trace backward() inside a compiled region")
def test_step_compiled_by_inductor_trains_as_eager():
    """Inductor fuses and reorders the arithmetic and may keep a fused fp16 intermediate in
    fp32: the losses agree to a few fp16 roundings (2**-10 each), not to the bit. (Where the
    host has no native fp16 matmul, eager emulates it, which widens the gap to 5e-5.)"""
    from torch._inductor import config as inductor_config
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    # Inductor's AVX2 code (a host without AVX-512, or one held to AVX2 by ATEN_CPU_CAPABILITY)
    # computes this step's loss, fp16 times a 0-dim input under a dynamic scale, as NaN on
    # torch 2.13, where its scalar and AVX-512 code give eager's (docs/design.md, "Compiled
    # whole"). What this test is about is amp's graph, so there it compiles scalar code.
    scalar = {"cpp.simdlen": 1} if str(pick_vec_isa()) == "avx2" else {}
    with torch._dynamo.config.patch(trace_autograd_ops=True), inductor_config.patch(scalar):
        compiled, scale, graphs = _compiled_training("O2", torch.float16, "inductor")
    eager, eager_scale, _ = _compiled_training("O2", torch.float16, None)
    assert graphs <= 2 and scale == eager_scale
    finite = torch.isfinite(eager)
    assert torch.equal(finite, torch.isfinite(compiled))
    torch.testing.assert_close(compiled[finite], eager[finite], rtol=2.0**-8, atol=1e-5)


# ------------------------------------------------------------------------ CUDA

_NEEDS_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA not available")


@_NEEDS_CUDA
@pytest.mark.parametrize("level", LEVELS)
def test_cuda_step_passes_sync_debug_mode_error(level):
    """On CUDA, torch's sync debug mode turns any host sync into an error: a whole iteration,
    overflow included, passes under it."""
    model = mlp().cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    # Dynamic at every level (O0 and O3 default to a static 1.0, which checks nothing).
    amp.initialize(model, opt, opt_level=level, half_dtype=torch.float16, loss_scale="dynamic",
                   verbosity=0)
    batches = [tuple(t.cuda() for t in mlp_batch(step)) for step in range(5)]
    for step, (x, y) in enumerate(batches):
        # The first iteration makes the state (host-to-device writes); the steady state after
        # it must not sync.
        torch.cuda.set_sync_debug_mode("error" if step else "default")
        try:
            with amp.scale_loss(xent(model(x), y) * (float("inf") if step == 2 else 1.0),
                                opt) as scaled:
                scaled.backward()
            opt.step()
            opt.zero_grad()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert amp_session.current().scalers[0].loss_scale == 2.0**15


def _graph_training(capture: bool, steps: int = 12, overflows=(4, 9), optimizer=None):
    """O2 fp16 on CUDA, torch's AdamW(fused=True, capturable=True) unless ``optimizer`` makes
    another: the whole iteration (forward, backward, scale_loss, step) captured in one CUDA
    graph and replayed, or run eagerly."""
    model = mlp().cuda()
    opt = optimizer(model.parameters()) if optimizer is not None else torch.optim.AdamW(
        model.parameters(), lr=torch.tensor(1e-2, device="cuda"), fused=True, capturable=True)
    amp.initialize(model, opt, opt_level="O2", half_dtype=torch.float16, verbosity=0)
    x, y = (t.cuda() for t in mlp_batch(0))
    poison = torch.ones((), device="cuda")
    loss_out = torch.zeros((), device="cuda")

    def iteration():
        loss = xent(model(x), y) * poison
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
        loss_out.copy_(loss.detach())

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up off the capture: the state is made here
        for _ in range(3):
            iteration()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    if capture:
        with torch.cuda.graph(graph):
            iteration()
    losses = []
    for step in range(steps):
        x.copy_(mlp_batch(step)[0].cuda())
        y.copy_(mlp_batch(step)[1].cuda())
        poison.fill_(float("inf") if step in overflows else 1.0)
        graph.replay() if capture else iteration()
        losses.append(loss_out.clone())
    torch.cuda.synchronize()
    scale = amp_session.current().scalers[0].loss_scale
    state = snapshot([model], [opt])
    amp.deinitialize()
    return torch.stack(losses), scale, state


@_NEEDS_CUDA
def test_cuda_graph_captures_the_whole_step():
    """Nothing in the iteration reads the host, so one CUDA graph holds all of it, and its
    replays train as eager iterations do, overflow steps included (docs/design.md, "Host
    syncs")."""
    replayed, scale, state = _graph_training(capture=True)
    eager, eager_scale, eager_state = _graph_training(capture=False)
    assert scale == eager_scale == 2.0**16 / 4
    assert torch.equal(replayed.nan_to_num(0.0, 0.0, 0.0), eager.nan_to_num(0.0, 0.0, 0.0))
    assert_identical(state, eager_state)


@_NEEDS_CUDA
def test_cuda_graph_captures_the_step_of_amp_patch_fused_adam():
    """The same with amp_patch's FusedAdam (fp32 state), whose step counters and bias
    corrections stay on the device: its step is inside the graph too."""
    make = lambda params: FusedAdam(params, lr=1e-2, weight_decay=0.01)  # noqa: E731
    replayed, scale, state = _graph_training(capture=True, optimizer=make)
    eager, eager_scale, eager_state = _graph_training(capture=False, optimizer=make)
    assert scale == eager_scale == 2.0**16 / 4
    assert torch.equal(replayed.nan_to_num(0.0, 0.0, 0.0), eager.nan_to_num(0.0, 0.0, 0.0))
    assert_identical(state, eager_state)
