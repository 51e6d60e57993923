"""The multi-tensor ops: the dispatched kernels against the Python reference, bit for bit.

``torch.ops.amp_patch.*`` routes to the compiled kernel of the tensors' device
when one is built, and to the reference body otherwise; the reference bodies in
``amp_patch.ops`` are called directly as the oracle.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from conftest import DEVICES
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from amp_patch import ops

F32, F16, BF16, F64 = torch.float32, torch.float16, torch.bfloat16, torch.float64

# Sizes around the vector widths (8/16 floats, 16/32 halves) and their blocks.
ODD_SIZES = [1, 7, 15, 16, 17, 31, 33, 63, 65, 1023, 4099]


def _make(shape, dtype, device, layout="contiguous", gen=None):
    """A random tensor of ``shape`` whose memory layout is ``layout``.

    ``transposed`` and ``sliced`` are not contiguous (sliced is not even dense);
    ``channels_last`` is dense but not contiguous.
    """
    def rand(*s):
        return (torch.randn(s, generator=gen) * 100).to(dtype).to(device)

    if layout == "contiguous":
        return rand(*shape)
    if layout == "transposed":
        return rand(*reversed(shape)).t()
    if layout == "sliced":
        return rand(shape[0], 2 * shape[1])[:, ::2]
    if layout == "channels_last":
        return rand(*shape).contiguous(memory_format=torch.channels_last)
    raise ValueError(layout)


# Each case: a list of (shape, dtype, layout) tensor specs.
CASES = {
    "fp32": [((n,), F32, "contiguous") for n in ODD_SIZES],
    "bf16": [((n,), BF16, "contiguous") for n in ODD_SIZES],
    "fp16": [((n,), F16, "contiguous") for n in ODD_SIZES[:8]],
    "mixed": [((n,), dt, "contiguous") for n, dt in zip(ODD_SIZES, [F32, BF16, F16] * 4)],
    "transposed": [((33, 17), F32, "transposed"), ((5, 9), BF16, "transposed"), ((3, 7), F16, "transposed")],
    "sliced": [((9, 31), F32, "sliced"), ((4, 17), BF16, "sliced"), ((3, 5), F16, "sliced")],
    "channels_last": [((2, 3, 5, 7), F32, "channels_last"), ((2, 5, 3, 3), BF16, "channels_last")],
    "empty_tensors": [((0,), F32, "contiguous"), ((3,), BF16, "contiguous"), ((5, 0), BF16, "contiguous"),
                      ((0, 4), F16, "transposed")],
    # More tensors than one launch holds (CUDA: about 110), sizes crossing task boundaries on CPU.
    "many": [((1 + (37 * i) % 700,), [F32, BF16][i % 2], "contiguous") for i in range(230)],
    "large": [((3,), F32, "contiguous"), ((150_001,), F32, "contiguous"), ((70_003,), BF16, "contiguous"),
              ((5,), BF16, "contiguous")],
    # 0-dim tensors: a scalar parameter (a learned temperature, say) has a 0-dim grad.
    "scalars": [((), F32, "contiguous"), ((), BF16, "contiguous"), ((5,), F32, "contiguous"),
                ((), F16, "contiguous")],
    # fp64 grads (a parameter kept in double) among the usual dtypes; opmath is fp64 for them.
    "fp64": [((n,), F64, "contiguous") for n in ODD_SIZES[:7]] + [((), F64, "contiguous"),
                                                                 ((9, 5), F64, "transposed")],
    "mixed_fp64": [((n,), dt, "contiguous") for n, dt in zip(ODD_SIZES, [F64, F32, BF16, F64, F16] * 3)],
}


def _tensors(case, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [_make(shape, dt, device, layout, gen) for shape, dt, layout in CASES[case]]


def _like(tensors, dtype, contiguous=False, seed=1):
    """Fresh random tensors shaped like ``tensors``, in ``dtype`` (None: each one's own)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for t in tensors:
        new = (torch.randn(t.shape, generator=gen) * 100).to(dtype or t.dtype).to(t.device)
        if not contiguous and not t.is_contiguous() and t.dim() == 2 and t.numel():
            new = new.t().contiguous().t()
        out.append(new)
    return out


def _clone(tensors):
    """Copies with the same strides, so non-dense (sliced) cases stay non-dense."""
    return [torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device).copy_(t)
            for t in tensors]


def _int_view(t):
    return t.view({F32: torch.int32, F16: torch.int16, BF16: torch.int16, F64: torch.int64}[t.dtype])


def assert_bitwise(actual, expected):
    """Same dtype, shape and bits; NaNs must sit at the same places (payloads may differ)."""
    assert len(actual) == len(expected)
    for i, (a, e) in enumerate(zip(actual, expected)):
        assert a.dtype == e.dtype and a.shape == e.shape, f"tensor {i}"
        nan = torch.isnan(a)
        assert torch.equal(nan, torch.isnan(e)), f"tensor {i}: NaN positions differ"
        assert torch.equal(_int_view(a.contiguous())[~nan], _int_view(e.contiguous())[~nan]), (
            f"tensor {i}: values differ from the reference"
        )


def _flag(device, value=0.0):
    return torch.full((1,), value, dtype=torch.float32, device=device)


def _scale(device, value=1.0 / 1024.0 * 3.0):
    return torch.full((1,), value, dtype=torch.float32, device=device)


# ---------------------------------------------------------------- case tables

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", list(CASES))
def test_unscale_matches_reference(device, case):
    got = _tensors(case, device)
    want = _clone(got)
    f_got, f_want = _flag(device), _flag(device)
    ops.multi_tensor_unscale_(got, f_got, _scale(device))
    ops._unscale_ref(want, f_want, _scale(device))
    assert_bitwise(got, want)
    assert f_got.item() == f_want.item() == 0.0


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("dst_dtype", [F32, BF16, F64, None], ids=["to_fp32", "to_bf16", "to_fp64", "same"])
def test_unscale_copy_matches_reference(device, case, dst_dtype):
    src = _tensors(case, device)
    got = _like(src, dst_dtype)
    want = _clone(got)
    f_got, f_want = _flag(device), _flag(device)
    ops.multi_tensor_unscale_copy_(src, got, f_got, _scale(device))
    ops._unscale_copy_ref(src, want, f_want, _scale(device))
    assert_bitwise(got, want)
    assert f_got.item() == f_want.item() == 0.0


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("y_dtype", [F32, None], ids=["y_fp32", "y_same"])
@pytest.mark.parametrize("a,b", [(1.0 / 3.0, 0.7), (0.125, 1.0)])
def test_axpby_matches_reference(device, case, y_dtype, a, b):
    x = _tensors(case, device)
    got = _like(x, y_dtype, contiguous=True)
    want = _clone(got)
    f_got, f_want = _flag(device), _flag(device)
    ops.multi_tensor_axpby_(x, got, f_got, a, b)
    ops._axpby_ref(x, want, f_want, a, b)
    assert_bitwise(got, want)
    assert f_got.item() == f_want.item() == 0.0


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("dst_dtype", [F32, BF16, F16, F64], ids=["to_fp32", "to_bf16", "to_fp16", "to_fp64"])
def test_copy_matches_reference(device, case, dst_dtype):
    src = _tensors(case, device)
    got = _like(src, dst_dtype)
    want = _clone(got)
    ops.multi_tensor_copy_(src, got)
    ops._copy_ref(src, want)
    assert_bitwise(got, want)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("per_tensor", [True, False])
def test_l2norm_matches_float64(device, case, per_tensor):
    x = _tensors(case, device)
    total, norms = ops.multi_tensor_l2norm(x, per_tensor)
    exact = torch.stack([t.double().pow(2).sum() for t in x]).sqrt() if x else torch.zeros(0)
    assert total.dtype == norms.dtype == torch.float32
    assert total.shape == () and total.device.type == torch.device(device).type
    torch.testing.assert_close(total.double().cpu(), exact.norm().cpu(), rtol=1e-5, atol=1e-6)
    if per_tensor:
        torch.testing.assert_close(norms.double().cpu(), exact.cpu(), rtol=1e-5, atol=1e-6)
    else:
        assert norms.numel() == 0
    ref_total, ref_norms = ops._l2norm_ref(x, per_tensor)
    torch.testing.assert_close(total.cpu(), ref_total.cpu(), rtol=1e-5, atol=1e-6)
    assert norms.shape == ref_norms.shape


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", list(CASES))
def test_unscale_l2norm_matches_float64(device, case):
    """The norm of x * inv_scale, x untouched; like l2norm, checked against fp64 (the order of sums differs)."""
    x = _tensors(case, device)
    before = _clone(x)
    inv = _scale(device, 2.0**-7)
    total, norms = ops.multi_tensor_unscale_l2norm(x, inv, True)
    assert_bitwise(x, before)
    scaled = [t.to(torch.float64 if t.dtype == F64 else F32) * inv.reshape(()) for t in x]
    exact = torch.stack([t.double().pow(2).sum() for t in scaled]).sqrt()
    assert total.dtype == norms.dtype == F32 and total.shape == ()
    torch.testing.assert_close(norms.double().cpu(), exact.cpu(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(total.double().cpu(), exact.norm().cpu(), rtol=1e-5, atol=1e-6)
    ref_total, ref_norms = ops._unscale_l2norm_ref(x, inv, True)
    torch.testing.assert_close(norms.cpu(), ref_norms.cpu(), rtol=1e-5, atol=1e-6)
    total_only, none = ops.multi_tensor_unscale_l2norm(x, inv, False)
    assert none.numel() == 0 and torch.equal(total_only, total)


@pytest.mark.parametrize("device", DEVICES)
def test_unscale_l2norm_unscales_before_squaring(device):
    """Scaled fp32 grads whose squares overflow fp32 still have a finite unscaled norm."""
    x = [torch.full((100,), 1e25, device=device), torch.full((3,), 65504.0, device=device, dtype=F16)]
    total, norms = ops.multi_tensor_unscale_l2norm(x, _scale(device, 2.0**-24), True)
    assert torch.isfinite(total).item() and not torch.isfinite(x[0].square()).any()
    torch.testing.assert_close(norms.cpu(), torch.tensor([1e25 * 2.0**-24 * 10, 65504.0 * 2.0**-24 * 3**0.5]))
    x[0][7] = float("nan")
    total, norms = ops.multi_tensor_unscale_l2norm(x, _scale(device), True)
    assert torch.isnan(total).item() and torch.isnan(norms[0]).item()


def _hysteresis_state(device, scale, growth, hyst):
    return (torch.full((1,), scale, dtype=F32, device=device),
            torch.full((1,), growth, dtype=torch.int32, device=device),
            torch.full((1,), hyst, dtype=torch.int32, device=device))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("seed", range(4))
def test_update_scale_hysteresis_matches_reference(device, seed):
    """Bit-identical scale and trackers at every step of a random flag sequence (NaN and negative flags too)."""
    gen = torch.Generator().manual_seed(seed)
    growth_factor, backoff_factor = [(2.0, 0.5), (1.0001, 0.3), (3.0, 0.999), (2.0**100, 2.0**-100)][seed]
    interval, hysteresis = [(3, 2), (1, 1), (5, 4), (2, 3)][seed]
    flags = [0.0, 1.0, float("nan"), -1.0, float("inf"), 0.5]
    weights = torch.tensor([8.0, 4.0, 0.5, 0.5, 0.5, 0.5])
    got = _hysteresis_state(device, 65536.0, 0, hysteresis)
    want = _hysteresis_state(device, 65536.0, 0, hysteresis)
    for step in range(300):
        found = _flag(device, flags[int(torch.multinomial(weights, 1, generator=gen))])
        ops.update_scale_hysteresis(*got, found, growth_factor, backoff_factor, interval, hysteresis)
        ops._update_scale_hysteresis_ref(*want, found, growth_factor, backoff_factor, interval, hysteresis)
        for g, w, name in zip(got, want, ["scale", "growth_tracker", "hysteresis_tracker"]):
            assert torch.equal(g, w), f"step {step} ({found.item()}): {name} {g.item()} != {w.item()}"


@pytest.mark.parametrize("device", DEVICES)
def test_update_scale_hysteresis_rules(device):
    scale, growth, hyst = _hysteresis_state(device, 1024.0, 0, 2)
    inf, clean = _flag(device, 1.0), _flag(device, 0.0)

    def step(found):
        ops.update_scale_hysteresis(scale, growth, hyst, found, 2.0, 0.5, 3, 2)
        return scale.item(), growth.item(), hyst.item()

    assert step(clean) == (1024.0, 1, 2)
    assert step(inf) == (1024.0, 0, 1)    # hysteresis absorbs the first inf
    assert step(inf) == (512.0, 0, 0)     # used up: back off
    assert step(inf) == (256.0, 0, -1)    # and keep backing off
    assert step(clean) == (256.0, 1, 2)   # a clean step restores it
    assert step(clean) == (256.0, 2, 2)
    assert step(clean) == (512.0, 0, 2)   # growth_interval clean steps: grow
    scale.fill_(3e38)
    step(clean), step(clean)
    assert step(clean) == (torch.tensor(3e38).item(), 0, 2)  # no growth to inf


@pytest.mark.parametrize("device", DEVICES)
def test_update_scale_hysteresis_checks_its_state(device):
    scale, growth, hyst = _hysteresis_state(device, 1024.0, 0, 2)
    with pytest.raises(RuntimeError, match="growth_tracker must be a one-element Int tensor"):
        ops.update_scale_hysteresis(scale, growth.float(), hyst, _flag(device), 2.0, 0.5, 3, 2)
    with pytest.raises(RuntimeError, match="current_scale must be a one-element Float tensor"):
        ops.update_scale_hysteresis(torch.ones(2, device=device), growth, hyst, _flag(device), 2.0, 0.5, 3, 2)


@pytest.mark.parametrize("device", DEVICES)
def test_empty_lists(device):
    found_inf = _flag(device)
    ops.multi_tensor_unscale_([], found_inf, _scale(device))
    ops.multi_tensor_unscale_copy_([], [], found_inf, _scale(device))
    ops.multi_tensor_axpby_([], [], found_inf, 2.0, 1.0)
    ops.multi_tensor_copy_([], [])
    total, norms = ops.multi_tensor_l2norm([], True)
    assert found_inf.item() == 0.0
    assert total.item() == 0.0 and norms.numel() == 0


# ------------------------------------------------------------ inf/NaN and found_inf

POSITIONS = ["first", "middle", "last"]


def _index(n, where):
    return {"first": 0, "middle": n // 2, "last": n - 1}[where]


def _poison(tensors, value, which, where):
    """Put ``value`` at element ``where`` of tensor ``which``; returns that tensor's index."""
    i = _index(len(tensors), which)
    flat = tensors[i].view(-1)
    flat[_index(flat.numel(), where)] = value
    return i


def _nonfinite_case(device):
    # Mixed dtypes and sizes that straddle vector blocks and CPU tasks.
    gen = torch.Generator().manual_seed(3)
    specs = [(33, F32), (40_000, BF16), (17, F16), (70_001, F32), (1023, BF16), (301, F64)]
    return [_make((n,), dt, device, gen=gen) for n, dt in specs]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("value", [float("inf"), float("-inf"), float("nan")], ids=["inf", "-inf", "nan"])
@pytest.mark.parametrize("which", POSITIONS)
@pytest.mark.parametrize("where", POSITIONS)
def test_nonfinite_sets_found_inf(device, value, which, where):
    x = _nonfinite_case(device)
    _poison(x, value, which, where)

    got, want = _clone(x), _clone(x)
    f_got, f_want = _flag(device), _flag(device)
    ops.multi_tensor_unscale_(got, f_got, _scale(device))
    ops._unscale_ref(want, f_want, _scale(device))
    assert_bitwise(got, want)
    assert f_got.item() == f_want.item() == 1.0

    dst_got, dst_want = _like(x, F32), _like(x, F32)
    f_got, f_want = _flag(device), _flag(device)
    ops.multi_tensor_unscale_copy_(x, dst_got, f_got, _scale(device))
    ops._unscale_copy_ref(x, dst_want, f_want, _scale(device))
    assert_bitwise(dst_got, dst_want)
    assert f_got.item() == f_want.item() == 1.0

    y_got, y_want = _like(x, F32), _like(x, F32)
    f_got, f_want = _flag(device), _flag(device)
    ops.multi_tensor_axpby_(x, y_got, f_got, 0.5, 1.0)
    ops._axpby_ref(x, y_want, f_want, 0.5, 1.0)
    assert_bitwise(y_got, y_want)
    assert f_got.item() == f_want.item() == 1.0


@pytest.mark.parametrize("device", DEVICES)
def test_axpby_checks_only_x(device):
    x = _nonfinite_case(device)
    y = _like(x, F32)
    y[1][5] = float("inf")
    found_inf = _flag(device)
    ops.multi_tensor_axpby_(x, y, found_inf, 0.5, 1.0)
    assert found_inf.item() == 0.0


@pytest.mark.parametrize("device", DEVICES)
def test_found_inf_is_never_cleared(device):
    x = _nonfinite_case(device)
    found_inf = _flag(device, 1.0)
    ops.multi_tensor_unscale_(_clone(x), found_inf, _scale(device))
    ops.multi_tensor_unscale_copy_(x, _like(x, F32), found_inf, _scale(device))
    ops.multi_tensor_axpby_(x, _like(x, F32), found_inf, 1.0, 1.0)
    assert found_inf.item() == 1.0


@pytest.mark.parametrize("device", DEVICES)
def test_l2norm_propagates_nonfinite(device):
    x = _nonfinite_case(device)
    i = _poison(x, float("inf"), "middle", "last")
    total, norms = ops.multi_tensor_l2norm(x, True)
    assert total.item() == float("inf") and norms[i].item() == float("inf")
    _poison(x, float("nan"), "first", "first")
    total, norms = ops.multi_tensor_l2norm(x, True)
    assert torch.isnan(total).item() and torch.isnan(norms[0]).item()


@pytest.mark.parametrize("device", DEVICES)
def test_fp64_is_computed_in_fp64(device):
    """fp64 values beyond fp32's range are finite, and keep their precision through every op."""
    x = torch.tensor([1e300, -3e-310, 1.0 + 2.0**-40, 0.1], dtype=F64, device=device)
    inv = _scale(device, 2.0**-16)
    found_inf = _flag(device)
    got = [x.clone()]
    ops.multi_tensor_unscale_(got, found_inf, inv)
    assert found_inf.item() == 0.0
    assert torch.equal(got[0], x * 2.0**-16)
    y = [torch.full((4,), 1.0 + 2.0**-45, dtype=F64, device=device)]
    ops.multi_tensor_axpby_([x], y, found_inf, 0.1, 3.0)
    assert torch.equal(y[0], 0.1 * x + 3.0 * (1.0 + 2.0**-45))
    total, norms = ops.multi_tensor_l2norm([x[1:]], True)
    torch.testing.assert_close(total.double(), x[1:].norm(), rtol=1e-6, atol=0)


class _ScaledModel(torch.nn.Module):
    """An fp32 layer with fp64 parameters around it: a 0-dim temperature and a bias."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(6, 4)
        self.temperature = torch.nn.Parameter(torch.tensor(1.5, dtype=F64))
        self.bias = torch.nn.Parameter(torch.linspace(-1, 1, 4, dtype=F64))

    def forward(self, x):
        return ((self.lin(x).double() + self.bias) / self.temperature).pow(2).mean()


def _train_fp64(opt_level, loss_scale, steps=3):
    import amp_patch

    model = _ScaledModel()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp_patch.initialize(model, opt, opt_level=opt_level, loss_scale=loss_scale, verbosity=0)
    gen = torch.Generator().manual_seed(5)
    grads = []
    for _ in range(steps):
        opt.zero_grad()
        loss = model(torch.randn(8, 6, generator=gen))
        with amp_patch.scale_loss(loss, opt) as scaled:
            scaled.backward()
        grads.append([p.grad.clone() for p in model.parameters()])
        opt.step()
    scale = amp_patch.state_dict()["loss_scaler0"]["loss_scale"]
    assert scale == (65536.0 if loss_scale == "dynamic" else loss_scale), "a step was skipped"
    amp_patch.deinitialize()
    return [p.detach().clone() for p in model.parameters()], grads


@pytest.mark.parametrize("opt_level", ["O0", "O1"])
def test_fp64_parameter_trains_under_dynamic_scale(opt_level):
    """Scaling by a power of two is exact, so the dynamic scale changes no bit of an fp64 grad."""
    params, grads = _train_fp64(opt_level, "dynamic")
    ref_params, ref_grads = _train_fp64(opt_level, 1.0)
    assert params[0].dtype == F64 and params[0].dim() == 0  # the temperature
    for g, r in zip(grads, ref_grads):
        assert_bitwise(g, r)
    assert_bitwise(params, ref_params)
    assert not torch.equal(params[0], torch.tensor(1.5, dtype=F64)), "no step was taken"


# ------------------------------------------------------------ errors

@pytest.mark.parametrize("device", DEVICES)
def test_mismatched_lists_raise(device):
    a = [torch.zeros(3, device=device), torch.zeros(4, device=device)]
    with pytest.raises(RuntimeError, match="list lengths differ"):
        ops.multi_tensor_copy_(a, a[:1])
    with pytest.raises(RuntimeError, match="shape"):
        ops.multi_tensor_unscale_copy_(a, [a[0], torch.zeros(5, device=device)], _flag(device), _scale(device))


@pytest.mark.parametrize("device", DEVICES)
def test_unsupported_dtype_is_named_by_native_kernel(device):
    if not ops.has_native_kernel(device):
        pytest.skip("extension not built")
    with pytest.raises(RuntimeError, match="multi_tensor_unscale_.*Int"):
        ops.multi_tensor_unscale_([torch.ones(3, dtype=torch.int32, device=device)], _flag(device),
                                  _scale(device))


# ------------------------------------------------------------ registration

def _opcheck_args(name, device):
    x = [_make((n,), dt, device) for n, dt in [(7, F32), (33, BF16), (4, F32)]]
    y = _like(x, F32)
    return {
        "multi_tensor_unscale_": (x, _flag(device), _scale(device)),
        "multi_tensor_unscale_copy_": (x, y, _flag(device), _scale(device)),
        "multi_tensor_axpby_": (x, y, _flag(device), 0.5, 2.0),
        "multi_tensor_l2norm": (x, True),
        "multi_tensor_copy_": (x, y),
        "multi_tensor_unscale_l2norm": (x, _scale(device), True),
        "update_scale_hysteresis": (_flag(device, 1024.0), torch.zeros(1, dtype=torch.int32, device=device),
                                    torch.full((1,), 2, dtype=torch.int32, device=device), _flag(device, 1.0),
                                    2.0, 0.5, 100, 2),
    }[name]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", sorted(ops._SCHEMAS))
def test_opcheck(device, name):
    op = getattr(torch.ops.amp_patch, name).default
    torch.library.opcheck(op, _opcheck_args(name, device))


def test_native_cpu_kernel_serves_cpu():
    if not ops.has_native_kernel("cpu"):
        if os.environ.get("AMP_PATCH_REQUIRE_EXT") == "1":
            pytest.fail("AMP_PATCH_REQUIRE_EXT=1 but the CPU kernels are not registered: extension not built")
        pytest.skip("extension not built")
    assert ops.native_extension_loaded()
    for name in ops._SCHEMAS:
        assert ops.has_native_kernel("cpu", name), name


def _run_python(code, **env):
    full_env = {**os.environ, **env}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=full_env,
                          capture_output=True, text=True, timeout=120)


def test_reference_serves_when_extension_absent():
    proc = _run_python(
        """
        import torch
        import amp_patch
        from amp_patch import ops
        assert not ops.native_extension_loaded()
        assert not ops.has_native_kernel("cpu")
        g = [torch.tensor([1.0, 2.0, float("inf")]), torch.tensor([4.0], dtype=torch.bfloat16)]
        found_inf = torch.zeros(1)
        ops.multi_tensor_unscale_(g, found_inf, torch.full((1,), 0.5))
        assert found_inf.item() == 1.0
        assert g[0][:2].tolist() == [0.5, 1.0] and g[1].item() == 2.0
        total, _ = ops.multi_tensor_l2norm([torch.tensor([3.0, 4.0])], False)
        assert total.item() == 5.0
        print("ok")
        """,
        AMP_PATCH_NO_EXT="1",
    )
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr


@pytest.mark.parametrize("capability", ["AVX2", "DEFAULT"])
def test_every_cpu_isa_matches_reference(capability):
    """Forcing torch onto a lower ISA (ATEN_CPU_CAPABILITY) selects our matching loops."""
    if not ops.has_native_kernel("cpu"):
        pytest.skip("extension not built")
    proc = _run_python(
        """
        import torch
        from amp_patch import _C, ops
        print(_C.cpu_capability())
        gen = torch.Generator().manual_seed(0)
        dts = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
        x = [(torch.randn(n, generator=gen) * 100).to(dts[i % 4]) for i, n in enumerate([1, 17, 33, 1023, 40001, 65])]
        x[3][7] = float("inf")
        for dst_dt in dts:
            y = [torch.randn(t.shape, generator=gen).to(dst_dt) for t in x]
            y2 = [t.clone() for t in y]
            f1, f2 = torch.zeros(1), torch.zeros(1)
            ops.multi_tensor_unscale_copy_(x, y, f1, torch.full((1,), 0.3))
            ops._unscale_copy_ref(x, y2, f2, torch.full((1,), 0.3))
            assert f1.item() == f2.item() == 1.0
            assert all(torch.equal(a.nan_to_num(), b.nan_to_num()) for a, b in zip(y, y2))
            ops.multi_tensor_axpby_(x, y, f1, 0.3, 0.9)
            ops._axpby_ref(x, y2, f2, 0.3, 0.9)
            assert all(torch.equal(a.nan_to_num(), b.nan_to_num()) for a, b in zip(y, y2))
            ops.multi_tensor_copy_(x, y)
            ops._copy_ref(x, y2)
            assert all(torch.equal(a.nan_to_num(), b.nan_to_num()) for a, b in zip(y, y2))
        x[3][7] = 0.0
        total, _ = ops.multi_tensor_l2norm(x, False)
        torch.testing.assert_close(total.double(), torch.cat([t.double() for t in x]).norm(), rtol=1e-5, atol=0)
        print("ok")
        """,
        ATEN_CPU_CAPABILITY=capability.lower(),
    )
    assert proc.returncode == 0 and proc.stdout.split() == [capability, "ok"], proc.stdout + proc.stderr


# ------------------------------------------------------------ property

_DTYPE = st.sampled_from([F32, BF16, F16, F64])
_TENSOR = st.tuples(st.integers(0, 3000), _DTYPE, st.sampled_from(["contiguous", "sliced"]))


@pytest.mark.parametrize("device", DEVICES)
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(specs=st.lists(_TENSOR, max_size=8), dst_dtype=_DTYPE, seed=st.integers(0, 2**16))
def test_property_random_lists(device, specs, dst_dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    x = [_make((2, (n + 1) // 2) if layout == "sliced" else (n,), dt, device, layout, gen)
         for n, dt, layout in specs]
    got, want = _clone(x), _clone(x)
    f_got, f_want = _flag(device), _flag(device)
    ops.multi_tensor_unscale_(got, f_got, _scale(device))
    ops._unscale_ref(want, f_want, _scale(device))
    assert_bitwise(got, want)
    y_got = _like(x, dst_dtype, seed=seed)
    y_want = _clone(y_got)
    ops.multi_tensor_axpby_(x, y_got, f_got, 0.25, 0.5)
    ops._axpby_ref(x, y_want, f_want, 0.25, 0.5)
    assert_bitwise(y_got, y_want)
    assert f_got.item() == f_want.item()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("offset", [0, 1, 3, 7, 15, 17])
def test_unscale_copy_into_misaligned_contiguous_views(device, offset):
    """fp32 outputs that start off a vector boundary: a short head, then streamed stores."""
    gen = torch.Generator().manual_seed(offset)
    storage = torch.zeros(40_000 + 64, device=device)
    sizes = [5_003, 1, 33, 20_000]
    dst, start = [], offset
    for n in sizes:
        dst.append(storage[start:start + n])  # contiguous, base not 64-byte aligned
        start += n + 5
    src = [torch.randn(n, generator=gen).bfloat16().to(device) for n in sizes]
    src[0][2] = float("inf")     # inside the unaligned head
    src[3][-1] = float("nan")    # in the streamed part's tail
    want = [torch.empty_like(d) for d in dst]
    got_flag, want_flag = torch.zeros(1, device=device), torch.zeros(1, device=device)
    inv = torch.full((1,), 0.25, device=device)
    ops.multi_tensor_unscale_copy_(src, dst, got_flag, inv)
    ops._unscale_copy_ref(src, want, want_flag, inv)
    for g, w in zip(dst, want):
        assert torch.equal(g.nan_to_num(), w.nan_to_num())
        assert torch.equal(g.isnan(), w.isnan())
    assert got_flag.item() == want_flag.item() == 1.0
    outside = torch.ones_like(storage, dtype=torch.bool)
    start = offset
    for n in sizes:
        outside[start:start + n] = False
        start += n + 5
    assert not storage[outside].any(), "a store reached outside its tensor"


# ------------------------------------------------------------ aliasing lists

# DEVICES[1] carries the skip-without-CUDA mark.
BACKENDS = ["reference", "native-cpu", pytest.param("native-cuda", marks=DEVICES[1].marks)]

_ALIAS_MSG = "overlap in memory"


def _call(backend, name, *args):
    """Call op ``name`` through the reference body or through the dispatcher."""
    if backend == "reference":
        return getattr(ops, {"multi_tensor_unscale_": "_unscale_ref",
                             "multi_tensor_unscale_copy_": "_unscale_copy_ref",
                             "multi_tensor_axpby_": "_axpby_ref",
                             "multi_tensor_copy_": "_copy_ref"}[name])(*args)
    return getattr(ops, name)(*args)


def _backend_device(backend):
    if backend == "native-cpu" and not ops.has_native_kernel("cpu"):
        pytest.skip("extension not built")
    return "cuda" if backend == "native-cuda" else "cpu"


@pytest.mark.parametrize("backend", BACKENDS)
def test_aliasing_lists_raise(backend):
    device = _backend_device(backend)
    buf = torch.randn(64, device=device)
    a, b, c = buf[:8], buf[8:16], buf[16:24]
    g = torch.randn(10, device=device)
    flag, inv = _flag(device), _scale(device)
    bad = [
        # The same grad twice would be unscaled twice.
        ("multi_tensor_unscale_", ([g, g], flag, inv)),
        ("multi_tensor_unscale_", ([buf[:10], buf[5:15]], flag, inv)),
        # dst[0] is src[1]: src[1] is read before or after it is overwritten.
        ("multi_tensor_unscale_copy_", ([a, b], [b, c], flag, inv)),
        ("multi_tensor_unscale_copy_", ([a, b], [buf[4:12], c], flag, inv)),
        # Two writes into one place.
        ("multi_tensor_copy_", ([a, b], [c, c])),
        ("multi_tensor_copy_", ([a, b], [buf[24:32], buf[30:38]])),
        # A dst that overlaps its own src but is not the very same view.
        ("multi_tensor_copy_", ([a], [buf[1:9]])),
        # y[0] overlaps x[1].
        ("multi_tensor_axpby_", ([a, buf[20:28]], [buf[16:24], buf[40:48]], flag, 0.5, 1.0)),
        # An fp32 dst laid over the bytes of a bf16 src from the same address.
        ("multi_tensor_unscale_copy_", ([buf.view(torch.bfloat16)[:8]], [buf[:8]], flag, inv)),
    ]
    for name, args in bad:
        before = buf.clone()
        with pytest.raises(RuntimeError, match=f"amp_patch::{name}: .*{_ALIAS_MSG}"):
            _call(backend, name, *args)
        assert torch.equal(buf, before), f"{name} wrote before raising"
    assert flag.item() == 0.0


@pytest.mark.parametrize("backend", BACKENDS)
def test_disjoint_and_identical_lists_are_accepted(backend):
    """Adjacent slices of one buffer, a source read twice, and dst[i] that *is* src[i] are fine."""
    device = _backend_device(backend)
    inv = _scale(device)
    buf = torch.randn(64, device=device)
    slices = [buf[:10], buf[10:20], buf[20:20], buf[20:21]]
    want = [t.clone() for t in slices]
    _call(backend, "multi_tensor_unscale_", slices, _flag(device), inv)
    ops._unscale_ref(want, _flag(device), inv)
    assert_bitwise(slices, want)

    g = [torch.randn(7, device=device), torch.randn(3, device=device).bfloat16()]
    want = [t.clone() for t in g]
    _call(backend, "multi_tensor_unscale_copy_", g, g, _flag(device), inv)  # Apex's O1 [grads, grads]
    ops._unscale_ref(want, _flag(device), inv)
    assert_bitwise(g, want)

    w = torch.randn(5, device=device)
    out = [torch.empty(5, device=device), torch.empty(5, device=device, dtype=BF16)]
    _call(backend, "multi_tensor_copy_", [w, w], out)
    assert_bitwise(out, [w.clone(), w.bfloat16()])

    y = [torch.randn(9, device=device)]
    want = [2.0 * y[0] + 0.5 * y[0]]
    _call(backend, "multi_tensor_axpby_", y, y, _flag(device), 2.0, 0.5)
    assert_bitwise(y, want)
