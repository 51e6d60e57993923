"""Half compute on the CPU: host detection, emulated half matmuls, and their undo.

Emulation is forced both ways: through the detection (``cpu_half.override``, the
environment variable) with ``cpu_half_compute="auto"``, and through the
property itself (``"native"``, ``"emulate"``). On shapes this small the native
slow path (fp16 here) is affordable, so every case also runs natively.

Tolerances, in units in the last place (ulps) of the half dtype (eps: 2**-7
for bf16, 2**-10 for fp16) at a stated scale. An emulated op computes in fp32
and rounds its output once; a native half op accumulates in fp32 too (oneDNN
and torch's CPU kernels) and rounds once, in another order. So one op agrees
to within ``_OP_TOL`` = 2 ulps of its output's largest magnitude. Through a
small model those one-ulp differences feed later roundings: forward outputs
and updated params agree within ``_MODEL_TOL`` = 4 ulps of each tensor's
largest magnitude. A grad is a sum of terms that may cancel, and native half
kernels may reduce it in half while emulation reduces it in fp32; its error is
set by the size of the terms, not of the sum: grads agree within
``_GRAD_TOL`` = 2 ulps of the largest grad magnitude of the model. (Seen on an
avx512_bf16 host: at most 2, 1 and 0.7 ulps of those scales.) On a host of
the none kind (docs/install.md, "CPU host kinds") the native half kernels are
ATen's own loops, not oneDNN's, and reduce grads in bf16: seen up to 6 ulps
of that scale with the kind forced by ISA caps, so there grads agree within
``_GRAD_TOL_NONE`` = 8.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
import wrapt
from torch import nn

from torch.utils._python_dispatch import TorchDispatchMode

import amp_patch as amp
from amp_patch.patching import cpu_half
from amp_patch.settings.properties import Properties
from amp_patch.settings.levels import OPT_LEVELS
from amp_patch.settings.properties import CPU_HALF_MODES
from conftest import DEVICES

BF16, FP16 = torch.bfloat16, torch.float16
_KEY = {BF16: "bfloat16", FP16: "float16"}
_EPS = {BF16: 2.0**-7, FP16: 2.0**-10}
_OP_TOL = 2
_MODEL_TOL = 4
_GRAD_TOL = 2
_GRAD_TOL_NONE = 8
#: The levels that compute in half (O1-O3), from the registry.
LEVELS = [name for name, level in OPT_LEVELS.items() if level.computes_in_half]

#: Every patch target as found before any test ran (conftest leaves torch unpatched).
ORIGINALS = {(prefix, name): wrapt.resolve_path(ns, name)[2] for ns, prefix, name in cpu_half.targets()}
#: copyreg caches ``__slotnames__`` on a class the first time one of its instances is
#: pickled or deep-copied (other tests do that): torch's doing, not a patch of ours.
_COPYREG_CACHE = {"__slotnames__"}
OWN_TENSOR_NAMES = set(vars(torch.Tensor)) - _COPYREG_CACHE


def _current_targets() -> dict:
    return {(prefix, name): wrapt.resolve_path(ns, name)[2] for ns, prefix, name in cpu_half.targets()}


def _assert_unpatched() -> None:
    now = _current_targets()
    changed = [k for k, v in now.items() if v is not ORIGINALS[k]]
    assert not changed, f"not restored: {changed}"
    assert set(vars(torch.Tensor)) - _COPYREG_CACHE == OWN_TENSOR_NAMES


def _force(dtype: torch.dtype, native: bool):
    return cpu_half.override(**{_KEY[dtype]: native})


def _close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, ulps: int,
           scale: float | None = None) -> None:
    """``actual`` within ``ulps`` ulps of ``dtype`` at ``scale`` (default: ``expected``'s largest
    magnitude) of ``expected``."""
    assert actual.dtype == expected.dtype
    scale = scale or expected.float().abs().max().item() or 1.0
    err = (actual.float() - expected.float()).abs().max().item()
    assert err <= ulps * _EPS[dtype] * scale, f"max error {err:.3g} over {ulps} ulps of {scale:.3g}"


class _Kernels(TorchDispatchMode):
    """Records the floating input dtypes of each matmul-class kernel that runs inside it."""

    NAMES = ("mm", "conv", "attention", "dot", "mv")

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[str, set]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if any(n in name for n in self.NAMES):
            dtypes = {a.dtype for a in args if isinstance(a, torch.Tensor) and a.is_floating_point()}
            self.seen.append((name, dtypes))
        return func(*args, **(kwargs or {}))

    def assert_ran_in(self, dtype: torch.dtype) -> None:
        """Every kernel saw only fp32 inputs (``dtype`` fp32), or some ``dtype`` input (half)."""
        assert self.seen, "no matmul-class kernel ran"
        if dtype == torch.float32:
            wrong = [(n, d) for n, d in self.seen if d != {dtype}]
        else:
            wrong = [(n, d) for n, d in self.seen if dtype not in d]
        assert not wrong, f"kernels not in {dtype}: {wrong}"


@pytest.fixture
def detect_fresh(monkeypatch):
    """Detection as on a host with no environment override."""
    monkeypatch.delenv(cpu_half.ENV_VAR, raising=False)


# --------------------------------------------------------------------------- detection


def test_detection_agrees_with_onednn_and_is_cached(detect_fresh):
    s = amp.cpu_half_support()
    assert s is amp.cpu_half_support()
    assert s.source == "detected"
    checks = {BF16: torch.ops.mkldnn._is_mkldnn_bf16_supported,
              FP16: torch.ops.mkldnn._is_mkldnn_fp16_supported}
    for dtype, check in checks.items():
        d = s.of(dtype)
        assert d.onednn == check()
        assert s.native(dtype) == (d.matmul and d.conv)
        if not d.onednn:  # the probe only confirms a yes
            assert not (d.matmul or d.conv) and d.matmul_ratio is None and d.conv_ratio is None
            assert d.kind == "none"
        else:
            assert d.matmul == (d.matmul_ratio <= cpu_half.PROBE_RATIO_LIMIT)
            assert d.conv == (d.conv_ratio <= cpu_half.PROBE_RATIO_LIMIT)
            assert d.kind == ("native" if d.matmul and d.conv else "conv-only")


@pytest.mark.parametrize("answer, kind", [
    (cpu_half.DtypeSupport(True, True, True, 0.5, 0.6), "native"),
    (cpu_half.DtypeSupport(True, False, True, 2.8, 1.9), "conv-only"),
    (cpu_half.DtypeSupport(True, False, False, 4.9, 3.6), "conv-only"),
    (cpu_half.DtypeSupport(False, False, False), "none"),
    (cpu_half.DtypeSupport(None, True, True), "native"),
    (cpu_half.DtypeSupport(None, False, False), "none"),
])
def test_host_kind_of_each_answer(answer, kind):
    """oneDNN's yes without native speed is the middle kind; forced answers are the ends."""
    assert answer.kind == kind and kind in cpu_half.HOST_KINDS
    with cpu_half.override(bfloat16=answer) as s:
        assert s.bfloat16 is answer and s.as_dict()["bf16"]["kind"] == kind
        assert (f"host kind {kind}" in s.describe()) == (kind != "native")


@pytest.mark.slow
@pytest.mark.parametrize("kind", cpu_half.HOST_KINDS)
def test_forced_kind_env_gives_that_kind_or_a_lower_one(kind):
    """The ISA caps of ``make test-hosts`` give their kind on a better host, never a better one."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("ONEDNN_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY", cpu_half.ENV_VAR)}
    env.update(cpu_half.FORCED_KIND_ENV[kind])
    proc = subprocess.run([sys.executable, "-c", "import amp_patch.patching.cpu_half as c; "
                           "print(c.cpu_half_support().bfloat16.kind)"],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert cpu_half.HOST_KINDS.index(proc.stdout.strip()) >= cpu_half.HOST_KINDS.index(kind)


def test_describe_is_one_line_with_host_kind_and_dict_is_json(detect_fresh):
    s = amp.cpu_half_support()
    line = s.describe()
    assert "\n" not in line and s.cpu in line and "bf16" in line and "fp16" in line
    if s.flags is not None and torch.backends.cpu.get_cpu_capability().startswith("AVX"):
        assert "avx512_bf16" in line and "AMX" in line and "avx512_fp16" in line
    d = json.loads(json.dumps(s.as_dict()))
    assert d["bf16"]["native"] == s.native(BF16) and d["fp16"]["native"] == s.native(FP16)
    assert d["host"] == s.host()


def test_probe_leaves_global_rng_alone():
    before = torch.get_rng_state()
    cpu_half.detect._probe(BF16, repeats=1)
    assert torch.equal(torch.get_rng_state(), before)


@pytest.mark.parametrize("value, bf16, fp16", [
    ("bf16", True, False), ("float16", False, True), ("bfloat16, fp16", True, True), ("none", False, False),
])
def test_env_var_replaces_detection(monkeypatch, value, bf16, fp16):
    monkeypatch.setenv(cpu_half.ENV_VAR, value)
    s = amp.cpu_half_support()
    assert (s.native(BF16), s.native(FP16), s.source) == (bf16, fp16, "env")


def test_env_var_rejects_unknown_names(monkeypatch):
    monkeypatch.setenv(cpu_half.ENV_VAR, "bf16,int8")
    with pytest.raises(ValueError, match=cpu_half.ENV_VAR):
        amp.cpu_half_support()


def test_override_nests_and_restores(detect_fresh):
    detected = amp.cpu_half_support()
    with cpu_half.override(bfloat16=False) as outer:
        assert amp.cpu_half_support() is outer and not outer.native(BF16)
        assert outer.float16 == detected.float16
        with cpu_half.override(float16=True) as inner:
            assert not inner.native(BF16) and inner.native(FP16) and inner.source == "override"
        assert amp.cpu_half_support() is outer
    assert amp.cpu_half_support() is detected


# --------------------------------------------------------------------------- the property and the plan


def test_property_default_and_validation():
    assert Properties.from_opt_level("O2", BF16).cpu_half_compute == "auto"
    assert Properties.from_opt_level("O2", BF16, cpu_half_compute="emulate").cpu_half_compute == "emulate"
    for bad in ("fast", "", "Auto", True, None):
        with pytest.raises(ValueError, match="cpu_half_compute must be 'auto'"):
            Properties(opt_level="O2", patch_torch_functions=False, cpu_half_compute=bad)


def test_initialize_rejects_bad_mode_and_changes_nothing():
    model = nn.Linear(4, 4)
    with pytest.raises(ValueError, match="cpu_half_compute"):
        amp.initialize(model, opt_level="O2", cpu_half_compute="emulated")
    assert model.weight.dtype == torch.float32
    _assert_unpatched()
    amp.initialize(model, opt_level="O2")  # no session was left behind


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("mode", CPU_HALF_MODES)
def test_plan(mode, native):
    with _force(BF16, native) as s:
        p = cpu_half.plan(mode, BF16)
    emulates = mode == "emulate" or (mode == "auto" and not native)
    assert (p.emulate_matmul, p.emulate_conv) == (emulates, emulates)
    assert p.mode == ("emulate" if emulates else "native")
    assert (p.host_matmul, p.host_conv) == (s.bfloat16.matmul, s.bfloat16.conv)
    assert json.loads(json.dumps(p.as_dict()))["half_dtype"] == "bf16"


def _bf16_support(**fields) -> cpu_half.CpuHalfSupport:
    """The detected answer with bf16's fields replaced."""
    s = amp.cpu_half_support()
    return dataclasses.replace(s, bfloat16=dataclasses.replace(s.bfloat16, **fields))


def test_auto_emulates_only_the_op_class_that_is_not_native():
    p = cpu_half.plan("auto", BF16, _bf16_support(matmul=True, conv=False))
    assert p.mode == "emulate-conv" and "convolutions are emulated" in p.describe()


def test_banner_says_which_mode_ran_and_warns_about_gpu_speed():
    with _force(BF16, False):
        text = cpu_half.banner(BF16)
    assert len(text.splitlines()) == 3
    assert "emulated" in text and "fp32 speed" in text and "GPU" in text
    with _force(BF16, True):
        text = cpu_half.banner(BF16)
    assert "natively" in text and "GPU" in text


# --------------------------------------------------------------------------- installing and undoing


def _patched_names() -> set:
    """The targets that emulation patched, seen through O1's wrappers (``__wrapped__``) too."""
    out = set()
    for key, fn in _current_targets().items():
        while fn is not None and fn is not ORIGINALS[key]:
            if hasattr(fn, "_amp_patch_cpu_half"):
                out.add(key)
                break
            fn = getattr(fn, "__wrapped__", None)
    return out


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("how", ["detection", "mode"])
def test_emulation_installs_and_deinitialize_restores_the_same_objects(level, how):
    model, opt = nn.Linear(4, 4), None
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    if how == "detection":
        with _force(BF16, False):
            amp.initialize(model, opt, opt_level=level, half_dtype=BF16)
    else:
        with _force(BF16, True):
            amp.initialize(model, opt, opt_level=level, half_dtype=BF16, cpu_half_compute="emulate")
    assert cpu_half.current_plan().mode == "emulate"
    assert _patched_names() == set(ORIGINALS)  # every spelling, under O1's wrappers at O1
    amp.deinitialize()
    _assert_unpatched()
    assert cpu_half.current_plan() is None


def test_only_the_class_that_is_not_native_is_patched(monkeypatch):
    support = _bf16_support(matmul=True, conv=False)
    monkeypatch.setattr(cpu_half.session_plan, "cpu_half_support", lambda: support)
    amp.initialize(nn.Linear(2, 2), opt_level="O3")
    patched = _patched_names()
    conv = {(p, n) for _, p, n in cpu_half.targets(matmul=False)}
    assert patched == conv
    amp.deinitialize()
    _assert_unpatched()


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("how", ["detection", "mode"])
def test_native_installs_nothing(level, how):
    model = nn.Linear(4, 4)
    if how == "detection":
        with _force(BF16, True):
            amp.initialize(model, opt_level=level, half_dtype=BF16)
    else:
        with _force(BF16, False):
            amp.initialize(model, opt_level=level, half_dtype=BF16, cpu_half_compute="native")
    assert cpu_half.current_plan().mode == "native"
    assert not _patched_names()


def test_no_half_compute_no_plan():
    with _force(BF16, False):
        amp.initialize(nn.Linear(2, 2), opt_level="O0")
        assert cpu_half.current_plan() is None and not _patched_names()
        amp.deinitialize()
        amp.initialize(nn.Linear(2, 2), opt_level="O2", enabled=False)
        assert cpu_half.current_plan() is None and not _patched_names()
        amp.deinitialize()
        amp.initialize(nn.Linear(2, 2), opt_level="O2", cast_model_type=False)
        assert cpu_half.current_plan() is None and not _patched_names()


def test_detection_logged_once_per_answer(caplog):
    caplog.set_level(logging.INFO, logger="amp_patch")
    with cpu_half.override(bfloat16=False):
        for _ in range(2):
            amp.initialize(nn.Linear(2, 2), opt_level="O0")
            amp.deinitialize()
    host_lines = [r for r in caplog.records if "CPU half compute on this host" in r.getMessage()]
    assert len(host_lines) == 1 and "bf16 not native" in host_lines[0].getMessage()


def test_legacy_init_emulates_and_deactivate_restores():
    with _force(BF16, False):
        handle = amp.init()
    try:
        assert cpu_half.current_plan().mode == "emulate" and _patched_names()
    finally:
        handle._deactivate()
    _assert_unpatched()


# --------------------------------------------------------------------------- op by op


def _r(*shape, dtype=BF16, seed=[0]):
    seed[0] += 1
    g = torch.Generator().manual_seed(seed[0])
    return torch.randn(*shape, generator=g).to(dtype)


def _op_cases(h):
    """(id, function, inputs): every spelling the emulation covers."""
    a, b, c = _r(5, 6, dtype=h), _r(6, 7, dtype=h), _r(5, 7, dtype=h)
    ba, bb, bc = _r(3, 5, 6, dtype=h), _r(3, 6, 7, dtype=h), _r(3, 5, 7, dtype=h)
    v, u = _r(6, dtype=h), _r(5, dtype=h)
    x1, w1 = _r(2, 4, 9, dtype=h), _r(3, 4, 3, dtype=h)
    x2, w2, bias = _r(2, 4, 6, 6, dtype=h), _r(3, 4, 3, 3, dtype=h), _r(3, dtype=h)
    x3, w3 = _r(1, 2, 4, 4, 4, dtype=h), _r(3, 2, 2, 2, 2, dtype=h)
    wt1, wt2, wt3 = _r(4, 3, 2, dtype=h), _r(4, 3, 2, 2, dtype=h), _r(2, 3, 2, 2, 2, dtype=h)
    q, k, vv = _r(2, 2, 5, 4, dtype=h), _r(2, 2, 5, 4, dtype=h), _r(2, 2, 5, 4, dtype=h)
    tbc_x, tbc_w, tbc_b = _r(7, 2, 4, dtype=h), _r(3, 4, 5, dtype=h), _r(5, dtype=h)
    return [
        ("torch.mm", lambda x, y: torch.mm(x, y), (a, b)),
        ("torch.matmul", lambda x, y: torch.matmul(x, y), (ba, bb)),
        ("operator @", lambda x, y: x @ y, (a, b)),
        ("Tensor.mm", lambda x, y: x.mm(y), (a, b)),
        ("Tensor.matmul", lambda x, y: x.matmul(y), (a, b)),
        ("torch.bmm", lambda x, y: torch.bmm(x, y), (ba, bb)),
        ("Tensor.bmm", lambda x, y: x.bmm(y), (ba, bb)),
        ("torch.addmm", lambda z, x, y: torch.addmm(z, x, y, beta=0.5, alpha=2.0), (c, a, b)),
        ("Tensor.addmm", lambda z, x, y: z.addmm(x, y), (c, a, b)),
        ("torch.baddbmm", lambda z, x, y: torch.baddbmm(z, x, y), (bc, ba, bb)),
        ("Tensor.baddbmm", lambda z, x, y: z.baddbmm(x, y), (bc, ba, bb)),
        ("torch.addbmm", lambda z, x, y: torch.addbmm(z, x, y), (c, ba, bb)),
        ("Tensor.addbmm", lambda z, x, y: z.addbmm(x, y), (c, ba, bb)),
        ("torch.mv", lambda x, y: torch.mv(x, y), (a, v)),
        ("Tensor.mv", lambda x, y: x.mv(y), (a, v)),
        ("torch.addmv", lambda z, x, y: torch.addmv(z, x, y), (u, a, v)),
        ("Tensor.addmv", lambda z, x, y: z.addmv(x, y), (u, a, v)),
        ("torch.dot", lambda x, y: torch.dot(x, y), (v, v)),
        ("Tensor.dot", lambda x, y: x.dot(y), (v, v)),
        ("torch.einsum", lambda x, y: torch.einsum("bij,bjk->bik", x, y), (ba, bb)),
        ("torch.einsum list", lambda x, y: torch.einsum("ij,jk->ik", [x, y]), (a, b)),
        ("linalg.matmul", lambda x, y: torch.linalg.matmul(x, y), (a, b)),
        ("linalg.multi_dot", lambda x, y, z: torch.linalg.multi_dot([x, y, z.T]), (a, b, c)),
        ("F.linear", lambda x, w, b_: F.linear(x, w, b_), (a, _r(7, 6, dtype=h), _r(7, dtype=h))),
        ("F.sdpa", lambda q_, k_, v_: F.scaled_dot_product_attention(q_, k_, v_, is_causal=True),
         (q, k, vv)),
        ("F.conv1d", lambda x, w: F.conv1d(x, w, padding=1), (x1, w1)),
        ("torch.conv1d", lambda x, w: torch.conv1d(x, w), (x1, w1)),
        ("F.conv2d", lambda x, w, b_: F.conv2d(x, w, b_, padding=1), (x2, w2, bias)),
        ("torch.conv2d", lambda x, w, b_: torch.conv2d(x, w, b_, stride=2), (x2, w2, bias)),
        ("F.conv3d", lambda x, w: F.conv3d(x, w), (x3, w3)),
        ("torch.conv3d", lambda x, w: torch.conv3d(x, w), (x3, w3)),
        ("F.conv_transpose1d", lambda x, w: F.conv_transpose1d(x, w, stride=2), (x1, wt1)),
        ("torch.conv_transpose1d", lambda x, w: torch.conv_transpose1d(x, w), (x1, wt1)),
        ("F.conv_transpose2d", lambda x, w, b_: F.conv_transpose2d(x, w, b_), (x2, wt2, bias)),
        ("torch.conv_transpose2d", lambda x, w: torch.conv_transpose2d(x, w), (x2, wt2)),
        ("F.conv_transpose3d", lambda x, w: F.conv_transpose3d(x, w), (x3, wt3)),
        ("torch.conv_transpose3d", lambda x, w: torch.conv_transpose3d(x, w), (x3, wt3)),
        ("torch.convolution", lambda x, w: torch.convolution(x, w, None, [1, 1], [0, 0], [1, 1],
                                                              False, [0, 0], 1), (x2, w2)),
        ("F.conv_tbc", lambda x, w, b_: F.conv_tbc(x, w, b_, 1), (tbc_x, tbc_w, tbc_b)),
        ("torch.conv_tbc", lambda x, w, b_: torch.conv_tbc(x, w, b_), (tbc_x, tbc_w, tbc_b)),
        ("nn.Conv2d", nn.Conv2d(4, 3, 3).to(h), (x2,)),
        ("nn.ConvTranspose2d", nn.ConvTranspose2d(4, 3, 2, stride=2).to(h), (x2,)),
        ("nn.Linear", nn.Linear(6, 7).to(h), (a,)),
    ]


def _emulating_session(h: torch.dtype) -> None:
    amp.initialize(nn.Linear(1, 1), opt_level="O3", half_dtype=h, cpu_half_compute="emulate",
                   verbosity=0)


@pytest.mark.parametrize("h", [BF16, FP16], ids=["bf16", "fp16"])
def test_each_spelling_computes_in_fp32_and_rounds_once(h):
    cases = _op_cases(h)
    # Unpatched: the fp32 computation that emulation must reproduce bit for bit, and native half.
    expected, native = {}, {}
    for name, fn, inputs in cases:
        with torch.no_grad():
            if isinstance(fn, nn.Module):
                ref_mod = _fp32_copy(fn)
                expected[name] = ref_mod(*[t.float() for t in inputs]).to(h)
            else:
                expected[name] = fn(*[t.float() for t in inputs]).to(h)
            native[name] = fn(*inputs)
    _emulating_session(h)
    for name, fn, inputs in cases:
        out = fn(*inputs)
        assert out.dtype == h, name
        assert torch.equal(out, expected[name]), name
        _close(out, native[name], h, _OP_TOL)


def _fp32_copy(module: nn.Module) -> nn.Module:
    import copy

    return copy.deepcopy(module).float()


@pytest.mark.parametrize("h", [BF16, FP16], ids=["bf16", "fp16"])
def test_backward_runs_in_fp32_with_half_grads(h):
    x, w, b = _r(4, 6, dtype=h), _r(5, 6, dtype=h), _r(5, dtype=h)
    img, k = _r(2, 3, 6, 6, dtype=h), _r(4, 3, 3, 3, dtype=h)

    def run(emulated: bool):
        leaves = [t.clone().requires_grad_() for t in (x, w, b, img, k)]
        lx, lw, lb, limg, lk = leaves
        y = F.linear(lx, lw, lb).sum() + F.conv2d(limg, lk).square().sum()
        y.backward()
        return [t.grad for t in leaves]

    ref = [g for g in _reference_grads(x, w, b, img, k, h)]
    native = run(False)
    _emulating_session(h)
    emulated = run(True)
    scale = _largest(native)
    for e, r, n in zip(emulated, ref, native):
        assert e.dtype == h == n.dtype
        assert torch.equal(e, r)
        _close(e, n, h, _GRAD_TOL, scale)


def _largest(tensors) -> float:
    return max(t.float().abs().max().item() for t in tensors)


def _reference_grads(x, w, b, img, k, h):
    leaves = [t.clone().requires_grad_() for t in (x, w, b, img, k)]
    lx, lw, lb, limg, lk = leaves
    lin = F.linear(lx.float(), lw.float(), lb.float()).to(h)
    conv = F.conv2d(limg.float(), lk.float()).to(h)
    (lin.sum() + conv.square().sum()).backward()
    return [t.grad for t in leaves]


def test_in_place_and_out_forms():
    h = BF16
    a, b, c = _r(5, 6), _r(6, 7), _r(5, 7)
    ba, bb, bc = _r(3, 5, 6), _r(3, 6, 7), _r(3, 5, 7)
    v, u = _r(6), _r(5)
    cases = [(c, "addmm_", (a, b)), (bc, "baddbmm_", (ba, bb)), (c, "addbmm_", (ba, bb)),
             (u, "addmv_", (a, v))]
    expected = [getattr(s.float(), name)(*[t.float() for t in args]).to(h) for s, name, args in cases]
    expected_out = torch.mm(a.float(), b.float()).to(h)
    _emulating_session(h)
    for (s, name, args), exp in zip(cases, expected):
        target = s.clone()
        assert getattr(target, name)(*args) is target
        assert target.dtype == h and torch.equal(target, exp), name
    out = torch.empty(5, 7, dtype=h)
    assert torch.mm(a, b, out=out) is out and torch.equal(out, expected_out)


@pytest.mark.parametrize("device", ["meta", DEVICES[1]])
def test_calls_off_the_cpu_pass_straight_through(device):
    a = torch.ones(3, 4, dtype=BF16, device=device)
    b = torch.ones(4, 2, dtype=BF16, device=device)
    before = torch.mm(a, b)
    _emulating_session(BF16)
    after = torch.mm(a, b)
    assert after.device == before.device and after.dtype == BF16
    if device != "meta":
        assert torch.equal(after, before)


def test_other_dtypes_and_mixed_calls_pass_straight_through():
    a32, b32 = torch.randn(3, 4), torch.randn(4, 2)
    expected = torch.mm(a32, b32)
    with pytest.raises(RuntimeError) as native_error:
        torch.mm(a32.bfloat16(), b32)
    _emulating_session(BF16)
    assert torch.equal(torch.mm(a32, b32), expected)
    with pytest.raises(RuntimeError) as emulated_error:
        torch.mm(a32.bfloat16(), b32)
    assert str(emulated_error.value) == str(native_error.value)
    # fp16 is not the session's dtype: it runs as it would natively.
    assert torch.mm(a32.half(), b32.half()).dtype == FP16


def test_o1_wrappers_call_the_emulated_ops():
    x, w, b = torch.randn(4, 6), torch.randn(5, 6, requires_grad=True), torch.randn(5)
    expected = F.linear(x.bfloat16().float(), w.detach().bfloat16().float(),
                        b.bfloat16().float()).bfloat16()
    with _force(BF16, False):
        amp.initialize(nn.Linear(1, 1), opt_level="O1", half_dtype=BF16, verbosity=0)
    with _Kernels() as kernels:
        out = F.linear(x, w, b)
    kernels.assert_ran_in(torch.float32)
    assert out.dtype == BF16 and torch.equal(out, expected)


# --------------------------------------------------------------------------- whole models at O1-O3


class _Net(nn.Module):
    """Convolutions, a transposed convolution, attention, einsum, @ and bmm, with norms and
    elementwise ops between them."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.deconv = nn.ConvTranspose2d(8, 4, 2, stride=2)
        self.norm = nn.LayerNorm(16)
        self.qkv = nn.Linear(16, 48)
        self.mix = nn.Parameter(torch.randn(16, 16) / 4)
        self.head = nn.Linear(16, 10)
        self.trace: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.gelu(self.conv(x))                           # (2, 8, 4, 4)
        h = self.deconv(h)                                  # (2, 4, 8, 8)
        t = h.reshape(2, 16, 16)
        q, k, v = self.qkv(self.norm(t)).split(16, dim=-1)
        q, k, v = (z.view(2, 16, 2, 8).transpose(1, 2) for z in (q, k, v))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(2, 16, 16)
        mixed = torch.einsum("btc,cd->btd", att, self.mix.to(att.dtype)) + att @ self.mix.to(att.dtype)
        gram = torch.bmm(mixed, mixed.transpose(1, 2)).softmax(-1)
        out = self.head(torch.bmm(gram, mixed)).mean(1)
        self.trace = [h, att, mixed, gram, out]
        return out


def _train_step(level: str, h: torch.dtype, how: str, emulate: bool):
    torch.manual_seed(0)
    model = _Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(2, 3, 4, 4), torch.tensor([1, 7])
    outputs: list[tuple[str, torch.Tensor]] = []
    for name, mod in model.named_modules():
        if name:
            mod.register_forward_hook(lambda m, i, o, name=name: outputs.append((name, o)))
    kwargs = dict(opt_level=level, half_dtype=h, loss_scale=128.0, verbosity=0)
    if how == "mode":
        with _force(h, not emulate):  # the host's answer is the opposite: the mode must win
            model, opt = amp.initialize(model, opt, cpu_half_compute="emulate" if emulate else "native",
                                        **kwargs)
    else:
        with _force(h, not emulate):
            model, opt = amp.initialize(model, opt, **kwargs)
    assert cpu_half.current_plan().mode == ("emulate" if emulate else "native")
    with _Kernels() as kernels:
        loss = F.cross_entropy(model(x).float(), y)
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
    kernels.assert_ran_in(torch.float32 if emulate else h)
    grads = [p.grad.clone() for p in model.parameters()]
    opt.step()
    result = dict(outputs=outputs + [(f"trace{i}", t) for i, t in enumerate(model.trace)],
                  grads=grads, params=[p.detach().clone() for p in model.parameters()],
                  masters=[p.detach().clone() for p in amp.master_params(opt)])
    amp.deinitialize()
    return result


@pytest.mark.parametrize("h", [BF16, FP16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("how", ["detection", "mode"])
@pytest.mark.parametrize("level", LEVELS)
def test_levels_give_native_dtypes_and_close_values(level, how, h):
    # The kind of the host's own kernels, whatever the steps below force for the plan.
    grad_tol = _GRAD_TOL_NONE if amp.cpu_half_support().of(h).kind == "none" else _GRAD_TOL
    native = _train_step(level, h, how, emulate=False)
    emulated = _train_step(level, h, how, emulate=True)
    _assert_unpatched()
    for kind in ("outputs", "grads", "params", "masters"):
        assert len(native[kind]) == len(emulated[kind]), kind
        if kind == "outputs":
            assert [n for n, _ in native[kind]] == [n for n, _ in emulated[kind]]
            pairs = [(n_t, e_t) for (_, n_t), (_, e_t) in zip(native[kind], emulated[kind])]
        else:
            pairs = list(zip(native[kind], emulated[kind]))
        assert [n.dtype for n, _ in pairs] == [e.dtype for _, e in pairs], kind
        scale = _largest(native["grads"]) if kind == "grads" else None
        for n, e in pairs:
            _close(e, n, h, grad_tol if kind == "grads" else _MODEL_TOL, scale)
    if level != "O1":  # the model itself computes in half
        assert native["grads"][0].dtype == h


@pytest.mark.parametrize("level", ["O2", "O3"])
def test_fp16_auto_emulates_on_a_host_without_native_fp16(level, detect_fresh):
    if amp.cpu_half_support().float16.matmul:
        pytest.skip("this host has native fp16 matmul")
    model = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level=level, half_dtype=FP16, verbosity=0)
    assert cpu_half.current_plan().mode == "emulate" and _patched_names()
    loss = model(torch.randn(4, 8)).float().square().mean()
    with amp.scale_loss(loss, opt) as scaled:
        scaled.backward()
    opt.step()
    assert {p.grad.dtype for p in model.parameters()} == {FP16}


def test_emulated_model_compiles_without_graph_breaks():
    model = nn.Sequential(nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 4))
    amp.initialize(model, opt_level="O3", cpu_half_compute="emulate", verbosity=0)
    explanation = torch._dynamo.explain(model)(torch.randn(8, 16).bfloat16())
    assert explanation.graph_break_count == 0, explanation.break_reasons


@pytest.mark.parametrize("level", ["O1", "O2", "O3"])
def test_dynamo_knows_the_emulated_functions_in_and_after_a_session(level):
    """torch.compile's maps hold torch's own functions, not the emulating wrappers, whatever
    the level: an O2/O3 session emulates with no O1 patches above (docs/design.md, Layers)."""
    from torch._dynamo import trace_rules

    conv = torch.conv2d
    trace_rules.clear_lru_cache()  # as if no compile had run in this process yet
    with _force(BF16, False):
        amp.initialize(nn.Linear(4, 4), opt_level=level, half_dtype=BF16, verbosity=0)
    assert torch.conv2d is not conv and cpu_half.current_plan().emulate_conv
    assert conv in trace_rules.get_torch_obj_rule_map()
    trace_rules.clear_lru_cache()
    assert conv not in trace_rules.get_torch_obj_rule_map()  # rebuilt from the patched torch
    amp.deinitialize()
    assert torch.conv2d is conv and conv in trace_rules.get_torch_obj_rule_map()
