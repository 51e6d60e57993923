"""The fused optimizer ops: compiled kernels against the Python reference, bit for bit.

Each op is run on case tables (layouts, dtype mixes, empty and 0-dim tensors,
inf/NaN placements, lists that cross the CPU's task and tile boundaries) in
its variants (fp32 or half params, fp32 masters with half model copies,
weight decay modes), through ``torch.ops.amp_patch`` (the device's kernel)
and through the reference body in :mod:`amp_patch.ops`.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from conftest import DEVICES
from test_ops import assert_bitwise, clone_args

from amp_patch import ops
from amp_patch.ops import optimizer_ops

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
HALF = (F16, BF16)

# Sizes around the vector widths, the 1024-element tile and the 32768-element task.
SIZES = [1, 7, 16, 33, 1023, 1025, 4099]

# Each case: (shape, grad dtype, layout) per tensor.
CASES = {
    "fp32": [((n,), F32, "contiguous") for n in SIZES],
    "bf16": [((n,), BF16, "contiguous") for n in SIZES],
    "fp16": [((n,), F16, "contiguous") for n in SIZES[:5]],
    "mixed": [((n,), dt, "contiguous") for n, dt in zip(SIZES, [F32, BF16, F16] * 3)],
    "transposed": [((33, 17), F32, "transposed"), ((5, 9), BF16, "transposed"), ((3, 7), F16, "transposed")],
    "sliced": [((9, 31), F32, "sliced"), ((4, 17), BF16, "sliced")],
    "channels_last": [((2, 3, 5, 7), F32, "channels_last"), ((2, 5, 3, 3), BF16, "channels_last")],
    "empty_tensors": [((0,), F32, "contiguous"), ((3,), BF16, "contiguous"), ((5, 0), F32, "contiguous")],
    "zero_dim": [((), F32, "contiguous"), ((), BF16, "contiguous"), ((4,), F32, "contiguous")],
    # More than one CPU task (32768 elements) of small tensors, and tensors split across tasks.
    "many": [((1 + (37 * i) % 400,), [F32, BF16][i % 2], "contiguous") for i in range(200)],
    "large": [((3,), F32, "contiguous"), ((40_001,), F32, "contiguous"), ((20_003,), BF16, "contiguous")],
    # About ten CPU tasks: more than the threads, so that each owns a block and helps the others.
    "many_tasks": [((1 + (379 * i) % 3000,), [F32, BF16][i % 2], "contiguous") for i in range(200)],
}

# How params, state and model copies relate to the grads:
# "same": params and state in the grad's dtype (a pure fp32 or pure half model);
# "master": fp32 params and state, and a model copy in the grad's half dtype (O2).
PRECISIONS = ["same", "master"]


def _rand(shape, dtype, device, layout, gen, positive=False):
    def make(*s):
        t = torch.rand(s, generator=gen) + 0.01 if positive else torch.randn(s, generator=gen)
        return t.to(dtype).to(device)

    if layout == "transposed":
        return make(*reversed(shape)).t()
    if layout == "sliced":
        return make(shape[0], 2 * shape[1])[:, ::2]
    if layout == "channels_last":
        return make(*shape).contiguous(memory_format=torch.channels_last)
    return make(*shape)


def _lists(case, precision, device, n_state, seed=0, positive_state=(1,)):
    """grads, params, [state lists], model_params for a case."""
    gen = torch.Generator().manual_seed(seed)
    specs = CASES[case]
    grads = [_rand(s, dt, device, lay, gen) * 3 for s, dt, lay in specs]
    master = precision == "master"
    params = [_rand(s, F32 if master else dt, device, lay, gen) for s, dt, lay in specs]
    # State is contiguous where the grads are not dense: rows of mixed layouts take the slow path.
    state = [[_rand(s, F32 if master else dt, device, lay if lay == "channels_last" else "contiguous",
                    gen, positive=k in positive_state) for s, dt, lay in specs]
             for k in range(n_state)]
    model = ([_rand(s, dt if dt in HALF else BF16, device, lay, gen) for s, dt, lay in specs]
             if master else [])
    return grads, params, state, model


def _flag(device, value=0.0, dtype=torch.float32):
    return torch.full((1,), value, dtype=dtype, device=device)


def _scale(device):
    return torch.full((1,), 3.0 / 1024.0, device=device)


def _run_both(name, args):
    """Runs the dispatched op and the reference on separate copies; returns both copies."""
    got, want = clone_args(list(args)), clone_args(list(args))
    out_got = getattr(torch.ops.amp_patch, name)(*got)
    out_want = optimizer_ops._OPTIM_REFERENCE[name](*want)
    return got, want, out_got, out_want


def _assert_lists_equal(got, want):
    for a, b in zip(got, want):
        if isinstance(a, list):
            assert_bitwise(a, b)
        elif isinstance(a, torch.Tensor) and a.is_floating_point():
            assert_bitwise([a], [b])
        elif isinstance(a, torch.Tensor):
            assert torch.equal(a, b)


# ------------------------------------------------------------ argument builders

def _adam_args(case, precision, device, adam_w_mode=True, weight_decay=0.01, bias_correction=True,
               noop=None, inv_scale=True, step=3):
    g, p, (m, v), out = _lists(case, precision, device, 2)
    return ("multi_tensor_adam_",
            (g, p, m, v, out, noop, _scale(device) if inv_scale else None, 1e-3, 0.9, 0.999, 1e-8,
             weight_decay, step, adam_w_mode, bias_correction))


def _sgd_args(case, precision, device, momentum=0.9, nesterov=False, first_run=False,
              wd_after_momentum=False, weight_decay=1e-4, noop=None, inv_scale=True):
    g, p, (buf,), out = _lists(case, precision, device, 1, positive_state=())
    return ("multi_tensor_sgd_",
            (g, p, buf, out, noop, _scale(device) if inv_scale else None, 0.1, weight_decay,
             momentum, 0.1 if not nesterov else 0.0, nesterov, first_run, wd_after_momentum))


def _adagrad_args(case, precision, device, adagrad_w_mode=False, weight_decay=1e-3, noop=None,
                  inv_scale=True):
    g, p, (h,), out = _lists(case, precision, device, 1)
    return ("multi_tensor_adagrad_",
            (g, p, h, out, noop, _scale(device) if inv_scale else None, 1e-2, 1e-10, weight_decay,
             adagrad_w_mode))


def _novograd_args(case, precision, device, reg_inside_moment=False, weight_decay=1e-3,
                   noop=None, inv_scale=True):
    g, p, (m,), out = _lists(case, precision, device, 1, positive_state=())
    gen = torch.Generator().manual_seed(7)
    norms = (torch.rand(len(g), generator=gen) + 0.5).to(device)
    return ("multi_tensor_novograd_",
            (g, p, m, norms, out, noop, _scale(device) if inv_scale else None, 1e-3, 0.95, 0.98,
             1e-8, weight_decay, 4, True, True, reg_inside_moment))


def _lamb1_args(case, precision, device, adam_w_mode=True, weight_decay=0.01, use_nvlamb=False,
                max_grad_norm=1.0, noop=None, inv_scale=True):
    g, p, (m, v), _ = _lists(case, precision, device, 2)
    norm = torch.full((1,), 900.0, device=device)
    return ("multi_tensor_lamb_stage1_",
            (g, p, m, v, noop, _scale(device) if inv_scale else None, norm, max_grad_norm, 0.9,
             0.999, 1e-6, weight_decay, 2, True, True, adam_w_mode, use_nvlamb))


def _lamb2_args(case, precision, device, adam_w_mode=True, weight_decay=0.01, use_nvlamb=False,
                noop=None):
    _, p, (m, v), out = _lists(case, precision, device, 2)
    gen = torch.Generator().manual_seed(5)
    pn = (torch.rand(len(p), generator=gen) + 0.5).to(device)
    un = (torch.rand(len(p), generator=gen) + 0.5).to(device)
    if len(p) > 2:
        pn[0] = 0.0  # a zero norm: the ratio falls back to lr
        un[1] = 0.0
    return ("multi_tensor_lamb_stage2_",
            (p, m, v, pn, un, out, noop, 1e-3, 0.9, 0.999, 1e-6, weight_decay, 2, True, adam_w_mode,
             use_nvlamb))


BUILDERS = {
    "adam": _adam_args,
    "sgd": _sgd_args,
    "adagrad": _adagrad_args,
    "novograd": _novograd_args,
    "lamb_stage1": _lamb1_args,
    "lamb_stage2": _lamb2_args,
}

# Option sets per op: the modes whose arithmetic differs.
VARIANTS = {
    "adam": [{}, {"adam_w_mode": False}, {"weight_decay": 0.0, "bias_correction": False, "inv_scale": False},
             # Late steps: the first bias correction is 1.0f (its division skipped), then both.
             {"step": 1000}, {"step": 20000, "adam_w_mode": False}],
    "sgd": [{}, {"nesterov": True, "first_run": True}, {"wd_after_momentum": True},
            {"momentum": 0.0, "inv_scale": False}],
    "adagrad": [{}, {"adagrad_w_mode": True}, {"weight_decay": 0.0, "inv_scale": False}],
    "novograd": [{}, {"reg_inside_moment": True}, {"weight_decay": 0.0, "inv_scale": False}],
    "lamb_stage1": [{}, {"adam_w_mode": False}, {"weight_decay": 0.0, "max_grad_norm": 0.0},
                    {"weight_decay": 0.0, "use_nvlamb": True, "inv_scale": False}],
    "lamb_stage2": [{}, {"adam_w_mode": False}, {"weight_decay": 0.0}, {"weight_decay": 0.0, "use_nvlamb": True}],
}

# The kernels split into two parts that do not meet: the row planning, tiling and dtype
# conversion (the case tables' subject, shared by the variants of an op) and the arithmetic on
# fp32 tiles (the variants' subject, the same for every layout). So each op runs every case in
# its first variant, and its other variants run on the "mixed" case (fp32, bf16 and fp16 grads,
# sizes across the vector width and the tile): no case-by-variant product.
OTHER_VARIANTS = [(op, i) for op, vs in VARIANTS.items() for i in range(1, len(vs))]


def _check(name, args, got, want, out_got, out_want):
    _assert_lists_equal(got, want)
    if name == "multi_tensor_lamb_stage1_":
        # The norms are reductions (summed in another order): compared with float64.
        for a, b in zip(out_got, out_want):
            torch.testing.assert_close(a.cpu(), b.cpu(), rtol=1e-5, atol=1e-6, equal_nan=True)


# ------------------------------------------------------------ case tables

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("op", list(BUILDERS))
def test_kernel_matches_reference(device, case, precision, op):
    name, args = BUILDERS[op](case, precision, device, **VARIANTS[op][0])
    _check(name, args, *_run_both(name, args))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("op,variant", OTHER_VARIANTS, ids=[f"{o}-{i}" for o, i in OTHER_VARIANTS])
def test_variant_matches_reference(device, precision, op, variant):
    name, args = BUILDERS[op]("mixed", precision, device, **VARIANTS[op][variant])
    _check(name, args, *_run_both(name, args))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("op", list(BUILDERS))
def test_empty_lists(device, op):
    name, args = BUILDERS[op]("fp32", "same", device)
    empty = [[] if isinstance(a, list) else a for a in args]
    if op in ("novograd", "lamb_stage2"):
        empty = [torch.zeros(0, device=device) if isinstance(a, torch.Tensor) and a.dim() == 1
                 and a.numel() == len(args[0]) else a for a in empty]
    result = getattr(torch.ops.amp_patch, name)(*empty)
    if op == "lamb_stage1":
        assert result[0].shape == result[1].shape == (0,)


POSITIONS = ["first", "middle", "last"]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("op", list(BUILDERS))
@pytest.mark.parametrize("value", [float("inf"), float("-inf"), float("nan")], ids=["inf", "-inf", "nan"])
@pytest.mark.parametrize("where", POSITIONS)
def test_nonfinite_propagates_like_reference(device, op, value, where):
    """An inf/NaN grad (or param for stage 2) flows through the update as in the reference."""
    name, args = BUILDERS[op]("mixed", "master", device)
    poisoned = args[0][len(args[0]) // 2].view(-1)
    poisoned[{"first": 0, "middle": poisoned.numel() // 2, "last": -1}[where]] = value
    _check(name, args, *_run_both(name, args))


# ------------------------------------------------------------ skipped steps

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("op", list(BUILDERS))
@pytest.mark.parametrize("flag_dtype", [torch.float32, torch.int32], ids=["found_inf", "apex_noop"])
def test_noop_flag_changes_nothing(device, op, flag_dtype):
    """A set flag skips the whole step: every tensor keeps its bits, in kernel and reference."""
    name, args = BUILDERS[op]("mixed", "master", device, noop=_flag(device, 1, flag_dtype))
    before = clone_args(list(args))
    got, want, out_got, out_want = _run_both(name, args)
    _assert_lists_equal(got, before)
    _assert_lists_equal(want, before)
    if op == "lamb_stage1":
        assert not out_got[0].any() and not out_got[1].any()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("op", list(BUILDERS))
def test_clear_noop_flag_is_a_normal_step(device, op):
    name, args = BUILDERS[op]("mixed", "master", device, noop=_flag(device, 0.0))
    _, plain = BUILDERS[op]("mixed", "master", device)
    got, _, _, _ = _run_both(name, args)
    want, _, _, _ = _run_both(name, plain)
    _assert_lists_equal([a for a in got if isinstance(a, list)], [a for a in want if isinstance(a, list)])


# ------------------------------------------------- bias corrections from the device


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("step", [1, 2, 7, 1000, 123457])
@pytest.mark.parametrize("bias_correction", [True, False])
def test_adam_device_bias_corrections_equal_the_host_step(device, step, bias_correction):
    """Bias corrections made on the device from a step counter kept there (no host read) give
    the very step of the host's int, in the kernel and in the reference."""
    name, args = _adam_args("mixed", "master", device, bias_correction=bias_correction, step=step)
    counter = torch.tensor([step], dtype=torch.int32, device=device)
    corrections = ops.adam_bias_corrections(0.9, 0.999, counter, bias_correction)
    assert corrections.device == counter.device and corrections.dtype == torch.float32
    from_device = list(args[:12]) + [0] + list(args[13:]) + [corrections]
    got, _, _, _ = _run_both(name, from_device)
    want, _, _, _ = _run_both(name, args)
    _assert_lists_equal([a for a in got if isinstance(a, list)],
                        [a for a in want if isinstance(a, list)])
    ref = clone_args(list(from_device))
    optimizer_ops._OPTIM_REFERENCE[name](*ref)
    _assert_lists_equal([a for a in ref if isinstance(a, list)],
                        [a for a in want if isinstance(a, list)])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("beta1", [0.9, 0.999, 0.5, 0.99999])
@pytest.mark.parametrize("step", [1, 2, 3, 7, 100, 1000, 16000])
@pytest.mark.parametrize("flush_denormal", [False, True], ids=["ieee", "flush_denormal"])
def test_adam_divides_by_its_bias_correction_to_the_bit(device, beta1, step, flush_denormal):
    """The quotient ``m / bc1`` is the true division's for moments of every magnitude.

    The CPU kernels multiply by ``1 / bc1`` in float64 instead of dividing when
    their data fits in the cache, as these 70 000 elements do (docs/optimizers.md,
    "Dividing by a bias correction"). With a zero grad, a
    zero second moment, ``eps`` 1, ``lr`` -1 and no decay, the new param of a
    zero param is the quotient itself, so its bits are compared, for random
    fp32 bit patterns (every exponent, subnormals, infinities, NaN) and the
    values around the subnormal range, against ``torch``'s division; also with
    denormals flushed (``torch.set_flush_denormal``), where both flush alike.
    """
    threads = torch.get_num_threads()
    if flush_denormal:
        if device != "cpu" or not torch.set_flush_denormal(True):
            pytest.skip("flushing denormals is a CPU mode, and this CPU has none")
        # The mode is the calling thread's: one thread keeps every op in it.
        torch.set_num_threads(1)
    try:
        gen = torch.Generator().manual_seed(step)
        bits = torch.randint(-2**31, 2**31, (1 << 16,), generator=gen, dtype=torch.int64)
        edges = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan"), 1e-45, -1e-45,
                              1.1754942e-38, 1.1754944e-38, -1.1754943e-38, 3.4028235e38, 1e-40])
        m = torch.cat([bits.to(torch.int32).view(torch.float32), edges,
                       torch.finfo(torch.float32).tiny * torch.rand(4096, generator=gen)]).to(device)
        zeros = torch.zeros_like(m)
        b1 = torch.tensor(beta1, dtype=torch.float32)  # the ops round betas to fp32 first
        bc1 = torch.tensor(1.0 - b1.item() ** step, dtype=torch.float64).float()
        expected = (b1 * m.cpu()) / bc1
        params, exp_avg = [zeros.clone()], [m.clone()]
        torch.ops.amp_patch.multi_tensor_adam_([zeros.clone()], params, exp_avg, [zeros.clone()],
                                               [], None, None, -1.0, beta1, 0.999, 1.0, 0.0, step,
                                               True, True)
        got = params[0].cpu()
        nonzero = expected != 0  # 0 - (-1 * -0.0) is +0.0: the zeros' signs are the rule's
        assert_bitwise([got[nonzero]], [expected[nonzero]])
        assert torch.equal(got[~nonzero], torch.zeros_like(got[~nonzero]))
        ref = [zeros.clone()], [m.clone()]
        optimizer_ops._OPTIM_REFERENCE["multi_tensor_adam_"](
            [zeros.clone()], ref[0], ref[1], [zeros.clone()], [], None, None, -1.0, beta1, 0.999,
            1.0, 0.0, step, True, True)
        assert_bitwise(params, ref[0])
    finally:
        torch.set_flush_denormal(False)
        torch.set_num_threads(threads)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", [(), (1,), (1, 1)], ids=["0-dim", "1", "1x1"])
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.float32])
def test_adam_bias_corrections_take_any_one_element_counter(device, shape, dtype):
    """Any one-element counter (Apex's int32 (1,), a 0-dim one, torch's float32) gives the
    float64 ``1 - beta**step`` of the betas rounded to fp32, rounded once to fp32."""
    betas = torch.tensor([0.9, 0.999], dtype=torch.float32).double()
    for step in (1, 2, 165, 1000, 123457):
        counter = torch.full(shape, step, dtype=dtype, device=device)
        got = ops.adam_bias_corrections(0.9, 0.999, counter, True)
        want = (1.0 - betas ** float(step)).float()
        assert got.shape == (2,) and got.dtype == torch.float32
        assert torch.equal(got.cpu(), want), (step, got, want)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", [(), (1,), (1, 1)], ids=["0-dim", "1", "1x1"])
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.float32])
@pytest.mark.parametrize("bias_correction", [True, False])
def test_adam_device_step_matches_reference_and_host_step(device, shape, dtype, bias_correction):
    """The fused counter op advances on a clear flag only (a NaN flag skips), and its
    corrections are the reference body's and the host step's, bit for bit."""
    betas = ops.fp32_betas(0.9, 0.999, torch.device(device))
    for start, flag in [(0, 0.0), (1, 0.0), (164, 0.0), (999, 1.0), (123456, 0.0),
                        (7, float("nan"))]:
        got_step = torch.full(shape, start, dtype=dtype, device=device)
        want_step = got_step.clone()
        found = torch.full((1,), flag, device=device)
        got = torch.ops.amp_patch.adam_device_step_(got_step, found, betas, bias_correction)
        want = optimizer_ops._adam_device_step_ref(want_step, found.clone(), betas,
                                                   bias_correction)
        assert torch.equal(got_step, want_step) and int(got_step.reshape(())) == (
            start + (flag == 0.0)), (start, flag)
        assert got.dtype == torch.float32 and torch.equal(got, want), (start, got, want)
        count = int(got_step.reshape(()))
        host = [optimizer_ops.ref.bias_corr(b, count, bias_correction)
                for b in (torch.tensor(0.9).item(), torch.tensor(0.999).item())]
        assert got.cpu().tolist() == host, (count, got, host)


@pytest.mark.parametrize("device", DEVICES)
def test_adam_device_step_checks_its_tensors(device):
    step, betas = torch.zeros(1, dtype=torch.int32, device=device), ops.fp32_betas(
        0.9, 0.999, torch.device(device))
    for args, match in [((torch.zeros(2, dtype=torch.int32, device=device), torch.zeros(1, device=device),
                          betas), "one element"),
                        ((step, torch.zeros(1, device=device), betas.float()), "float64"),
                        ((step, torch.zeros(1, dtype=torch.float64, device=device), betas), "float32")]:
        with pytest.raises(RuntimeError, match=match):
            torch.ops.amp_patch.adam_device_step_(*args, True)


@pytest.mark.parametrize("device", DEVICES)
def test_adam_device_step_opcheck(device):
    torch.library.opcheck(torch.ops.amp_patch.adam_device_step_.default,
                          (torch.zeros(1, dtype=torch.int32, device=device),
                           torch.zeros(1, device=device),
                           ops.fp32_betas(0.9, 0.999, torch.device(device)), True))


@pytest.mark.parametrize("device", DEVICES)
def test_adam_bias_corrections_are_checked(device):
    name, args = _adam_args("mixed", "master", device)
    for bad, match in [(torch.ones(3, device=device), "2 elements"),
                       (torch.ones(2, dtype=torch.float64, device=device), "float32")]:
        with pytest.raises(RuntimeError, match=match):
            getattr(torch.ops.amp_patch, name)(*args, bad)


# ------------------------------------------------------------ one-pass O2 contract

@pytest.mark.parametrize("device", DEVICES)
def test_adam_half_grads_into_masters_and_model_in_one_call(device):
    """Half grads times inv_scale update fp32 masters; the model copy is the rounded master."""
    name, args = _adam_args("bf16", "master", device)
    grads, masters, model = args[0], args[1], args[4]
    grads_before = clone_args(grads)
    torch.ops.amp_patch.multi_tensor_adam_(*args)
    assert_bitwise(grads, grads_before)  # grads are read only
    assert_bitwise(model, [m.to(BF16) for m in masters])


@pytest.mark.parametrize("device", DEVICES)
def test_lamb_stage1_norms_match_float64(device):
    name, args = _lamb1_args("large", "master", device, use_nvlamb=True)
    params = clone_args(args[1])
    pn, un = getattr(torch.ops.amp_patch, name)(*args)
    exact = torch.stack([p.double().norm() for p in params]).cpu()
    torch.testing.assert_close(pn.double().cpu(), exact, rtol=1e-6, atol=0)
    assert (un > 0).all()


@pytest.mark.parametrize("threads", [2, 3, 7])
def test_results_do_not_depend_on_the_thread_count(threads):
    """Uneven blocks of tasks per thread, and threads taking over others' tasks, change no bit."""
    saved = torch.get_num_threads()
    name, args = _lamb1_args("many_tasks", "master", "cpu", use_nvlamb=True)
    try:
        torch.set_num_threads(1)
        one = clone_args(list(args))
        out_one = getattr(torch.ops.amp_patch, name)(*one)
        torch.set_num_threads(threads)
        many = clone_args(list(args))
        out_many = getattr(torch.ops.amp_patch, name)(*many)
    finally:
        torch.set_num_threads(saved)
    _assert_lists_equal(one, many)
    assert_bitwise(list(out_one), list(out_many))


# ------------------------------------------------------------ errors

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("impl", ["dispatched", "reference"])
def test_mismatched_lists_raise(device, impl):
    name, args = _adam_args("fp32", "same", device)
    run = getattr(torch.ops.amp_patch, name) if impl == "dispatched" else optimizer_ops._OPTIM_REFERENCE[name]
    short = list(args)
    short[2] = args[2][:-1]
    with pytest.raises(RuntimeError, match="list lengths differ"):
        run(*short)
    wrong = list(args)
    wrong[3] = [torch.zeros(5, device=device)] + args[3][1:]
    with pytest.raises(RuntimeError, match="shape"):
        run(*wrong)


def test_native_kernel_names_op_list_and_dtype():
    if not ops.has_native_kernel("cpu", "multi_tensor_adam_"):
        pytest.skip("extension not built")
    name, args = _adam_args("fp32", "same", "cpu")
    args = list(args)
    args[2] = [t.double() for t in args[2]]
    with pytest.raises(RuntimeError, match=r"multi_tensor_adam_: exp_avgs\[0\] has dtype Double"):
        torch.ops.amp_patch.multi_tensor_adam_(*args)


def test_sgd_momentum_needs_buffers():
    name, args = _sgd_args("fp32", "same", "cpu")
    args = list(args)
    args[2] = []
    for run in (torch.ops.amp_patch.multi_tensor_sgd_, optimizer_ops._sgd_ref):
        with pytest.raises(RuntimeError, match="momentum_buffers has 0 tensors"):
            run(*args)


# ------------------------------------------------------------ registration

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("op", list(BUILDERS))
def test_opcheck(device, op):
    name, args = BUILDERS[op]("mixed", "master", device)
    torch.library.opcheck(getattr(torch.ops.amp_patch, name).default, args)


def test_native_cpu_kernels_serve_every_optimizer_op():
    if not ops.has_native_kernel("cpu"):
        if os.environ.get("AMP_PATCH_REQUIRE_EXT") == "1":
            pytest.fail("AMP_PATCH_REQUIRE_EXT=1 but the CPU kernels are not registered")
        pytest.skip("extension not built")
    for name in optimizer_ops._OPTIM_SCHEMAS:
        assert ops.has_native_kernel("cpu", name), name


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA not available")
def test_cuda_kernels_serve_every_optimizer_op():
    """A CUDA build that silently dropped the optimizer kernels would fall back to the reference."""
    for name in optimizer_ops._OPTIM_SCHEMAS:
        assert ops.has_native_kernel("cuda", name), name


@pytest.mark.slow
@pytest.mark.parametrize("capability", ["AVX2", "DEFAULT"])
def test_every_cpu_isa_matches_reference(capability):
    """Forcing torch onto a lower ISA (ATEN_CPU_CAPABILITY) selects the matching optimizer loops."""
    if not ops.has_native_kernel("cpu", "multi_tensor_adam_"):
        pytest.skip("extension not built")
    code = textwrap.dedent(
        """
        import sys
        sys.path[:0] = ["tests", "tests/ops"]
        import torch
        from amp_patch import _C
        import test_optimizers_ops as t
        print(_C.cpu_capability())
        for op, variants in t.VARIANTS.items():
            for precision in t.PRECISIONS:
                for variant in variants:
                    name, args = t.BUILDERS[op]("mixed", precision, "cpu", **variant)
                    t._check(name, args, *t._run_both(name, args))
        print("ok")
        """
    )
    env = {**os.environ, "ATEN_CPU_CAPABILITY": capability.lower()}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=300, cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    assert proc.returncode == 0 and proc.stdout.split() == [capability, "ok"], proc.stdout + proc.stderr
