"""Trainers that drive Apex's amp from their own code, each written the way the library does.

docs/migration.md, "Trainers and libraries", lists the idioms and the libraries
that use them. Every trainer here imports Apex's amp through the import hook
(``import apex.amp``), as the library would, and runs at O0-O3 on tiny models.
"""

from __future__ import annotations

import contextlib
import copy
import io
from typing import Any, Iterator

import pytest
import torch
from torch import nn

import amp_patch
from amp_patch.optim.amp.stash import ALREADY_INITIALIZED
from amp_patch.apex_compat import import_hook

LEVELS = ["O0", "O1", "O2", "O3"]
#: (half dtype, loss scale): bf16 with its default static scale, and fp16 with dynamic
#: loss scaling (tiny shapes: fp16 matmuls are slow on a CPU).
PRECISIONS = [pytest.param((torch.bfloat16, None), id="bf16"),
              pytest.param((torch.float16, "dynamic"), id="fp16-dynamic")]


@pytest.fixture
def apex_amp():
    """``apex.amp`` as a library imports it, served by amp_patch's import hook."""
    with import_hook.apex_import_hook(shadow_apex=True):
        import apex.amp

        yield apex.amp


def _model(seed: int, device: str) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)).to(device)


def _batch(i: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + i)
    return torch.randn(3, 4, generator=g).to(device), torch.randn(3, 2, generator=g).to(device)


def _loss(model: nn.Module, i: int, device: str) -> torch.Tensor:
    x, y = _batch(i, device)
    return nn.functional.mse_loss(model(x).float(), y)


def _bits(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _assert_same_bits(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


# ------------------------------------------------------------------ Apex's marker


@pytest.mark.parametrize("level", LEVELS)
def test_marker_set_and_second_initialize_refused_with_apexs_message(level, device):
    """The issue's reproducer: the marker is there, and a second initialize names the real
    cause at every level (at O2 the parameter check used to fire first)."""
    model = _model(0, device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp_patch.initialize(model, opt, opt_level=level, verbosity=0)
    assert hasattr(opt, "_amp_stash") and opt._amp_stash.lazy_init_called
    with pytest.raises(RuntimeError, match=ALREADY_INITIALIZED):
        amp_patch.initialize(model, opt, opt_level=level, verbosity=0)
    with pytest.raises(RuntimeError, match=ALREADY_INITIALIZED):
        amp_patch.initialize(model, [torch.optim.SGD(model.parameters(), lr=0.1), opt],
                             opt_level="O2", verbosity=0)
    # Without that optimizer: amp_patch's own error, also before the parameter check.
    with pytest.raises(RuntimeError, match="already called and is still in effect"):
        amp_patch.initialize(_model(1, device), torch.optim.SGD(model.parameters(), lr=0.1),
                             opt_level=level, verbosity=0)
    assert amp_patch.session.current() is not None  # the refusals left the session live
    amp_patch.deinitialize()
    assert not any(hasattr(opt, n) for n in ("_amp_stash", "_lazy_init_maybe_master_weights",
                                             "_amp_lazy_init"))
    amp_patch.initialize(model, opt, opt_level=level, verbosity=0)  # allowed again
    assert hasattr(opt, "_amp_stash")


def test_marker_with_enabled_false_stops_a_lazy_trainer():
    model = _model(0, "cpu")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    amp_patch.initialize(model, opt, enabled=False, verbosity=0)
    assert not opt._amp_stash.already_patched and not opt._amp_stash.params_have_scaled_gradients
    assert opt._amp_stash.all_fp16_params == [] and len(opt._amp_stash.all_fp32_params) == 4
    amp_patch.deinitialize()
    assert not hasattr(opt, "_amp_stash")


def test_larc_carries_the_marker_and_its_optimizer_is_refused():
    from amp_patch.apex_compat.larc import LARC

    model = _model(0, "cpu")
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    larc = LARC(inner)
    amp_patch.initialize(model, larc, opt_level="O1", verbosity=0)
    assert hasattr(larc, "_amp_stash")
    amp_patch.deinitialize()
    amp_patch.initialize(model, larc, opt_level="O1", verbosity=0)
    with pytest.raises(RuntimeError, match=ALREADY_INITIALIZED):
        amp_patch.initialize(model, LARC(inner), opt_level="O1", verbosity=0)


@pytest.mark.parametrize("level", LEVELS)
def test_stash_lists_are_amps_own_params_and_masters(level, device):
    model = _model(0, device)
    opt = torch.optim.SGD([{"params": model[0].parameters()}], lr=0.1)
    model, opt = amp_patch.initialize(model, opt, opt_level=level, verbosity=0,
                                      half_dtype=torch.bfloat16)
    opt.add_param_group({"params": list(model[2].parameters())})
    stash = opt._amp_stash
    params = list(model.parameters())
    if level == "O2":
        masters = list(amp_patch.master_params(opt))
        assert all(a is b for a, b in zip(stash.all_fp32_from_fp16_params, masters))
        assert len(stash.all_fp32_from_fp16_params) == 4 == len(stash.all_fp16_params)
        assert all(a is b for a, b in zip(stash.all_fp16_params, params))
        assert [len(g) for g in stash.fp16_groups] == [2, 2]
        assert stash.all_fp32_from_fp32_params == []
        assert not hasattr(stash, "all_fp32_params")
        # A view, not a copy: a step moves the very tensors the stash hands out.
        before = stash.all_fp32_from_fp16_params[0].detach().clone()
        with amp_patch.scale_loss(_loss(model, 0, device), opt) as scaled:
            scaled.backward()
        opt.step()
        assert not torch.equal(stash.all_fp32_from_fp16_params[0], before)
    else:
        assert not hasattr(stash, "all_fp32_from_fp16_params")  # Apex's own test for masters
        half = level == "O3"
        assert [p is q for p, q in zip(stash.all_fp16_params if half else stash.all_fp32_params,
                                       params)] == [True] * 4


def test_stash_flags_follow_the_iteration():
    """``params_have_scaled_gradients`` under ``delay_unscale``; ``already_patched`` from an
    overflow to the skipped step (fp16, dynamic scale)."""
    model = _model(0, "cpu")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp_patch.initialize(model, opt, opt_level="O2", half_dtype=torch.float16,
                                      verbosity=0)
    stash = opt._amp_stash
    with amp_patch.scale_loss(_loss(model, 0, "cpu"), opt, delay_unscale=True) as scaled:
        scaled.backward()
    assert stash.params_have_scaled_gradients and not stash.already_patched
    with amp_patch.scale_loss(_loss(model, 1, "cpu") * float("inf"), opt) as scaled:
        scaled.backward()
    assert stash.already_patched and not stash.params_have_scaled_gradients
    opt.step()
    assert not stash.already_patched
    with pytest.raises(AttributeError, match="cannot be set"):
        stash.already_patched = True
    stash.lazy_init_called = True  # checkpoint code sets it
    stash.trainer_note = "kept"  # other attributes may be hung on it, as on Apex's
    assert opt._amp_stash.trainer_note == "kept"


@pytest.mark.parametrize("level", LEVELS)
def test_marker_survives_state_dict_round_trip_and_lr_schedulers(level):
    model = _model(0, "cpu")
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    before = torch.optim.lr_scheduler.StepLR(opt, step_size=1)
    model, opt = amp_patch.initialize(model, opt, opt_level=level, verbosity=0)
    stash = opt._amp_stash
    after = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.5)
    for i in range(2):
        with amp_patch.scale_loss(_loss(model, i, "cpu"), opt) as scaled:
            scaled.backward()
        opt.step()
        before.step()
        after.step()
    opt.load_state_dict(opt.state_dict())
    assert opt._amp_stash is stash
    assert copy.deepcopy(opt.state_dict()).keys() == opt.state_dict().keys()


# ------------------------------------------------------------------ an optimizer wrapper
# MMEngine's ApexOptimWrapper: initialize lazily in a per-iteration context while the
# optimizer has no `_amp_stash`, on the bare module of a wrapped model; amp's state inside the
# optimizer's own checkpoint entry, kept aside until initialize when loaded before it.


class LazyApexOptimWrapper:
    """An optimizer wrapper in the shape of a trainer library's (see the section above)."""

    def __init__(self, optimizer: torch.optim.Optimizer, amp: Any, **amp_kwargs: Any) -> None:
        self.optimizer = optimizer
        self.amp = amp
        self.amp_kwargs = amp_kwargs
        self._pending_amp_state: dict | None = None

    @contextlib.contextmanager
    def optim_context(self, model: nn.Module) -> Iterator[None]:
        if not hasattr(self.optimizer, "_amp_stash"):
            if isinstance(model, nn.parallel.DistributedDataParallel):
                model = model.module
            model, self.optimizer = self.amp.initialize(model, self.optimizer, **self.amp_kwargs)
            if self._pending_amp_state is not None:
                self.amp.load_state_dict(self._pending_amp_state)
                self._pending_amp_state = None
        yield

    def update_params(self, loss: torch.Tensor) -> None:
        with self.amp.scale_loss(loss, self.optimizer) as scaled_loss:
            scaled_loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad()

    def state_dict(self) -> dict:
        state = self.optimizer.state_dict()
        state["apex_amp"] = self.amp.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        state = dict(state)
        if "apex_amp" in state:
            if hasattr(self.optimizer, "_amp_stash"):
                self.amp.load_state_dict(state.pop("apex_amp"))
            else:
                self._pending_amp_state = state.pop("apex_amp")
        self.optimizer.load_state_dict(state)


def _train(model: nn.Module, wrapper: LazyApexOptimWrapper, iters: range, device: str) -> None:
    for i in iters:
        with wrapper.optim_context(model):
            loss = _loss(model, i, device)
        wrapper.update_params(loss)


def _fresh(seed: int, device: str, amp: Any, **amp_kwargs: Any):
    model = _model(seed, device)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    return model, LazyApexOptimWrapper(opt, amp, **amp_kwargs)


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("level", LEVELS)
def test_lazy_wrapper_trains_and_resumes_bit_exactly(level, precision, device, apex_amp):
    """40 iterations, initialized lazily behind the marker, against 20 + a checkpoint of the
    trainer's own dict (model, and optimizer with amp's state inside its entry) + 20 in a
    fresh model and optimizer."""
    half, loss_scale = precision
    kwargs = dict(opt_level=level, loss_scale=loss_scale, verbosity=0, half_dtype=half)
    model, wrapper = _fresh(0, device, apex_amp, **kwargs)
    _train(model, wrapper, range(40), device)
    expected, expected_amp = _bits(model), apex_amp.state_dict()
    amp_patch.deinitialize()

    model, wrapper = _fresh(0, device, apex_amp, **kwargs)
    _train(model, wrapper, range(20), device)
    buffer = io.BytesIO()
    torch.save({"state_dict": model.state_dict(), "optimizer": wrapper.state_dict()}, buffer)
    amp_patch.deinitialize()

    buffer.seek(0)
    checkpoint = torch.load(buffer, weights_only=False)
    assert "apex_amp" in checkpoint["optimizer"]
    model, wrapper = _fresh(7, device, apex_amp, **kwargs)  # other initial weights
    model.load_state_dict(checkpoint["state_dict"])
    wrapper.load_state_dict(checkpoint["optimizer"])  # before initialize: amp's state waits
    _train(model, wrapper, range(20, 40), device)
    _assert_same_bits(_bits(model), expected)
    assert apex_amp.state_dict() == expected_amp


# ------------------------------------------------------------------ checkpoint code


@pytest.mark.parametrize("level", LEVELS)
def test_lazy_init_calls_before_loading_master_params(level, apex_amp):
    """NVIDIA's BERT trainers: ``_lazy_init_maybe_master_weights()``, ``lazy_init_called``,
    the optimizer's state, then each saved master copied into ``amp.master_params``."""
    def build(seed):
        model = _model(seed, "cpu")
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        return apex_amp.initialize(model, opt, opt_level=level, verbosity=0)

    def train(model, opt, iters):
        for i in iters:
            with apex_amp.scale_loss(_loss(model, i, "cpu"), opt) as scaled_loss:
                scaled_loss.backward()
            opt.step()
            opt.zero_grad()

    model, opt = build(0)
    train(model, opt, range(10))
    checkpoint = copy.deepcopy({
        "model": model.state_dict(), "optimizer": opt.state_dict(),
        "master params": list(apex_amp.master_params(opt))})
    train(model, opt, range(10, 20))
    expected = _bits(model)
    amp_patch.deinitialize()

    model, opt = build(3)
    model.load_state_dict(checkpoint["model"])
    opt._lazy_init_maybe_master_weights()
    opt._amp_stash.lazy_init_called = True
    opt.load_state_dict(checkpoint["optimizer"])
    for param, saved_param in zip(apex_amp.master_params(opt), checkpoint["master params"]):
        param.data.copy_(saved_param.data)
    train(model, opt, range(10, 20))
    _assert_same_bits(_bits(model), expected)


# ------------------------------------------------------------------ clipping, accumulation


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("level", LEVELS)
def test_accumulation_with_delay_unscale_and_clipping_on_master_params(level, precision,
                                                                        apex_amp):
    """A trainer's step with gradient accumulation: ``delay_unscale`` on every micro-batch
    but the last, then ``clip_grad_norm_(amp.master_params(optimizer))`` and ``step()``."""
    half, loss_scale = precision
    accumulation, max_norm = 2, 0.05
    model = _model(0, "cpu")
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    model, opt = apex_amp.initialize(model, opt, opt_level=level, loss_scale=loss_scale,
                                     half_dtype=half, verbosity=0)
    reference = _model(0, "cpu")
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.05)
    norms = []
    for step in range(8):
        for micro in range(accumulation):
            i = step * accumulation + micro
            delay_unscale = micro != accumulation - 1
            with apex_amp.scale_loss(_loss(model, i, "cpu") / accumulation, opt,
                                     delay_unscale=delay_unscale) as scaled_loss:
                scaled_loss.backward()
            (_loss(reference, i, "cpu") / accumulation).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(apex_amp.master_params(opt), max_norm)))
        clipped = torch.linalg.vector_norm(torch.stack(
            [p.grad.float().norm() for p in apex_amp.master_params(opt)]))
        assert clipped <= max_norm * (1 + 1e-2)
        opt.step()
        opt.zero_grad()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), max_norm)
        ref_opt.step()
        ref_opt.zero_grad()
    assert all(n > max_norm for n in norms)  # the clip did clip
    if level == "O0":  # fp32 with a static scale of 1: plain torch's bits
        _assert_same_bits(_bits(model), _bits(reference))
    else:
        for p, q in zip(model.parameters(), reference.parameters()):
            torch.testing.assert_close(p.float(), q, atol=0.05, rtol=0.05)


# ------------------------------------------------------------------ _amp_state reads


def test_amp_state_reads_of_logging_code(apex_amp):
    """Megatron-style logging reads ``_amp_state.loss_scalers[0].loss_scale()``; other code
    reads ``_amp_state.opt_properties``: the live session's values."""
    from apex.amp._amp_state import _amp_state

    model = _model(0, "cpu")
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    model, opt = apex_amp.initialize(model, opt, opt_level="O2", half_dtype=torch.float16,
                                     loss_scale="dynamic", verbosity=0)
    assert _amp_state.opt_properties.opt_level == "O2"
    assert _amp_state.opt_properties.master_weights
    assert _amp_state.loss_scalers[0].loss_scale() == 2.0**16
    with apex_amp.scale_loss(_loss(model, 0, "cpu") * float("inf"), opt) as scaled_loss:
        scaled_loss.backward()
    opt.step()
    assert _amp_state.loss_scalers[0].loss_scale() == 2.0**15
    assert apex_amp.state_dict()["loss_scaler0"]["loss_scale"] == 2.0**15


# ------------------------------------------------------------------ several losses


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("level", LEVELS)
def test_gan_trainer_with_a_loss_id_per_loss(level, precision, apex_amp):
    """A GAN trainer: both models and both optimizers through one initialize (a dict of
    optimizers, as MMGeneration keeps them), ``num_losses=3`` and one ``loss_id`` per loss,
    Apex's DCGAN layout."""
    half, loss_scale = precision
    torch.manual_seed(0)
    nets = {"generator": nn.Sequential(nn.Linear(2, 4), nn.Tanh()),
            "discriminator": nn.Sequential(nn.Linear(4, 4), nn.LeakyReLU(), nn.Linear(4, 1))}
    # eps=1e-4: O3 steps fp16 params with fp16 state, where Adam's default 1e-8 is zero.
    optimizers = {k: torch.optim.Adam(m.parameters(), lr=1e-2, eps=1e-4)
                  for k, m in nets.items()}
    names = ["generator", "discriminator"]
    models, opts = apex_amp.initialize([nets[k] for k in names], [optimizers[k] for k in names],
                                       opt_level=level, num_losses=3, loss_scale=loss_scale,
                                       half_dtype=half, verbosity=0)
    optimizers = dict(zip(names, opts))
    gen, disc = models
    bce = nn.BCEWithLogitsLoss()
    g = torch.Generator().manual_seed(0)
    for _ in range(5):
        real = torch.randn(3, 4, generator=g)
        noise = torch.randn(3, 2, generator=g)
        optimizers["discriminator"].zero_grad()
        err_real = bce(disc(real).float(), torch.ones(3, 1))
        with apex_amp.scale_loss(err_real, optimizers["discriminator"], loss_id=0) as scaled:
            scaled.backward()
        fake = gen(noise)
        err_fake = bce(disc(fake.detach()).float(), torch.zeros(3, 1))
        with apex_amp.scale_loss(err_fake, optimizers["discriminator"], loss_id=1) as scaled:
            scaled.backward()
        optimizers["discriminator"].step()
        optimizers["generator"].zero_grad()
        err_gen = bce(disc(fake).float(), torch.ones(3, 1))
        with apex_amp.scale_loss(err_gen, optimizers["generator"], loss_id=2) as scaled:
            scaled.backward()
        optimizers["generator"].step()
    state = apex_amp.state_dict()
    assert sorted(state) == ["loss_scaler0", "loss_scaler1", "loss_scaler2"]
    assert all(torch.isfinite(p).all() for m in models for p in m.parameters())
    assert all(hasattr(o, "_amp_stash") for o in optimizers.values())
    with pytest.raises(RuntimeError, match="loss_id"):
        with apex_amp.scale_loss(err_gen.detach(), optimizers["generator"], loss_id=3):
            pass


# ------------------------------------------------------------------ DDP before initialize


@pytest.mark.slow
@pytest.mark.parametrize("level", LEVELS)
def test_lazy_wrapper_initializes_the_bare_module_of_a_ddp_model(level, apex_amp, tmp_path):
    """The wrapper meets the model already in DDP and passes ``model.module`` to initialize
    (the model itself is refused). With one rank, training equals the model trained
    without DDP, bit for bit."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1)
    try:
        results = []
        for wrap in (True, False):
            model, wrapper = _fresh(0, "cpu", apex_amp, opt_level=level, verbosity=0)
            outer = nn.parallel.DistributedDataParallel(model) if wrap else model
            if wrap:
                with pytest.raises(TypeError, match="already wrapped in DistributedDataParallel"):
                    apex_amp.initialize(outer, wrapper.optimizer, opt_level=level, verbosity=0)
            _train(outer, wrapper, range(6), "cpu")
            results.append(_bits(model))
            amp_patch.deinitialize()
        _assert_same_bits(*results)
    finally:
        dist.destroy_process_group()
