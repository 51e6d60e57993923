"""The served ``apex`` modules: star imports, Apex's signatures, ``_amp_state``, and loud misses."""

from __future__ import annotations

import importlib.util
import inspect
import io
import logging
import math

import pytest
import torch
from torch import nn
from torch.optim.optimizer import required

import amp_patch
from amp_patch.apex_compat import import_hook


@pytest.fixture
def hook():
    with import_hook.apex_import_hook(shadow_apex=True) as finder:
        yield finder


# ------------------------------------------------------------------ star imports

#: Apex's public names of each module that amp_patch serves.
STAR = {
    "apex": {"amp", "fp16_utils", "optimizers", "normalization", "parallel"},
    "apex.amp": {"init", "half_function", "float_function", "promote_function",
                 "register_half_function", "register_float_function",
                 "register_promote_function", "scale_loss", "disable_casts", "initialize",
                 "state_dict", "load_state_dict", "master_params"},
    "apex.fp16_utils": {"BN_convert_float", "network_to_half", "prep_param_lists",
                        "model_grads_to_master_grads", "master_params_to_model_params",
                        "tofp16", "to_python_float", "clip_grad_norm", "convert_module",
                        "convert_network", "FP16Model", "FP16_Optimizer", "LossScaler",
                        "DynamicLossScaler"},
    "apex.optimizers": {"FusedAdam", "FusedLAMB", "FusedMixedPrecisionLamb", "FusedSGD",
                        "FusedNovoGrad", "FusedAdagrad"},
    "apex.parallel": {"DistributedDataParallel", "SyncBatchNorm", "convert_syncbn_model",
                      "create_syncbn_process_group", "ReduceOp", "LARC"},
    "apex.normalization": {"FusedLayerNorm", "FusedRMSNorm"},
    "apex.multi_tensor_apply": {"MultiTensorApply", "multi_tensor_applier"},
}


@pytest.mark.parametrize("module", sorted(STAR))
def test_star_import_brings_apex_public_names(hook, module):
    namespace: dict = {}
    exec(f"from {module} import *", namespace)
    assert set(namespace) - {"__builtins__"} >= STAR[module]
    assert not {n for n in namespace if n.startswith("_") and n != "__builtins__"}


def test_every_served_module_has_its_target():
    """A served name whose amp_patch module is missing would fail only when a script imports it."""
    from amp_patch.apex_compat.import_hook import MODULES

    for name, mapping in MODULES.items():
        if mapping.target is not None:
            assert importlib.import_module(mapping.target), name


def test_star_import_fp16_utils_then_use(hook):
    namespace: dict = {}
    exec("from apex.fp16_utils import *\nvalue = to_python_float(torch.tensor([2.5]))",
         {"torch": torch} | namespace, namespace)
    assert namespace["value"] == 2.5


def test_convert_network_keeps_apex_rules(monkeypatch):
    """Apex's convert_network: affine batch norms stay fp32 (a non-affine one is cast), every
    other floating tensor is cast, float64 included, grads too, the same objects, and RNNs
    are flattened again; integer buffers are left."""
    from amp_patch.apex_compat.fp16_utils import convert_module, convert_network

    flattened = []
    monkeypatch.setattr(nn.LSTM, "flatten_parameters", lambda self: flattened.append(self))
    net = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.BatchNorm1d(4, affine=False),
                        nn.LSTM(4, 4)).double()
    net[0].weight.grad = torch.ones(4, 4, dtype=torch.float64)
    params = list(net.parameters())
    flattened.clear()  # .double() flattened it already
    assert convert_network(net, torch.bfloat16) is net
    assert all(a is b for a, b in zip(net.parameters(), params)) and flattened == [net[3]]
    assert net[0].weight.dtype == net[0].weight.grad.dtype == torch.bfloat16
    assert net[1].weight.dtype == net[1].running_mean.dtype == torch.float64  # as Apex: untouched
    assert net[2].running_mean.dtype == torch.bfloat16
    assert net[1].num_batches_tracked.dtype == torch.int64
    assert all(p.dtype == torch.bfloat16 for p in net[3].parameters())
    child = nn.Sequential(nn.Linear(2, 2))
    assert convert_module(child, torch.float16)[0].weight.dtype == torch.float32


def test_larc_is_served_from_parallel(hook):
    from apex.parallel import LARC
    from apex.parallel.LARC import LARC as larc_class
    import apex.parallel

    assert LARC is larc_class is apex.parallel.LARC
    assert inspect.isclass(LARC)


# ------------------------------------------------------------------- signatures

#: Apex's constructor and method signatures (from Apex's source, the commit before amp was deleted).
APEX_SIGNATURES = {
    "apex.fp16_utils.tofp16": "",
    "apex.fp16_utils.BN_convert_float": "module",
    "apex.fp16_utils.network_to_half": "network",
    "apex.fp16_utils.convert_module": "module, dtype",
    "apex.fp16_utils.convert_network": "network, dtype",
    "apex.fp16_utils.FP16Model": "network",
    "apex.fp16_utils.prep_param_lists": "model, flat_master=False",
    "apex.fp16_utils.model_grads_to_master_grads": "model_params, master_params, flat_master=False",
    "apex.fp16_utils.master_params_to_model_params":
        "model_params, master_params, flat_master=False",
    "apex.fp16_utils.to_python_float": "t",
    "apex.fp16_utils.FP16_Optimizer":
        "init_optimizer, static_loss_scale=1.0, dynamic_loss_scale=False, "
        "dynamic_loss_args=None, verbose=True",
    "apex.fp16_utils.FP16_Optimizer.zero_grad": "set_grads_to_None=False",
    "apex.fp16_utils.FP16_Optimizer.clip_master_grads": "max_norm, norm_type=2",
    "apex.fp16_utils.FP16_Optimizer.state_dict": "",
    "apex.fp16_utils.FP16_Optimizer.load_state_dict": "state_dict",
    "apex.fp16_utils.FP16_Optimizer.step": "closure=None",
    "apex.fp16_utils.FP16_Optimizer.backward": "loss, update_master_grads=True, retain_graph=False",
    "apex.fp16_utils.FP16_Optimizer.update_master_grads": "",
    "apex.fp16_utils.FP16_Optimizer.inspect_master_grad_data": "",
    "apex.fp16_utils.LossScaler": "scale=1",
    "apex.fp16_utils.LossScaler.has_overflow": "params",
    "apex.fp16_utils.LossScaler.update_scale": "overflow",
    "apex.fp16_utils.LossScaler.scale_gradient": "module, grad_in, grad_out",
    "apex.fp16_utils.LossScaler.backward": "loss, retain_graph=False",
    "apex.fp16_utils.DynamicLossScaler": "init_scale=2 ** 32, scale_factor=2.0, scale_window=1000",
    "apex.fp16_utils.DynamicLossScaler.has_overflow": "params",
    "apex.fp16_utils.DynamicLossScaler.update_scale": "overflow",
    "apex.fp16_utils.DynamicLossScaler.scale_gradient": "module, grad_in, grad_out",
    "apex.fp16_utils.DynamicLossScaler.backward": "loss, retain_graph=False",
    "apex.parallel.DistributedDataParallel":
        "module, message_size=10000000, delay_allreduce=False, shared_param=None, "
        "allreduce_trigger_params=None, retain_allreduce_buffers=False, "
        "allreduce_always_fp32=False, num_allreduce_streams=1, allreduce_communicators=None, "
        "gradient_average=True, gradient_predivide_factor=1.0, "
        "gradient_average_split_factor=None, prof=False",
    "apex.parallel.SyncBatchNorm": "num_features, eps=1e-05, momentum=0.1, affine=True, "
                                   "track_running_stats=True, process_group=None, "
                                   "channel_last=False, fuse_relu=False",
    "apex.parallel.SyncBatchNorm.forward": "input, z=None",
    "apex.parallel.convert_syncbn_model": "module, process_group=None, channel_last=False",
    "apex.parallel.create_syncbn_process_group": "group_size",
    "apex.normalization.FusedLayerNorm": "normalized_shape, eps=1e-05, elementwise_affine=True, "
                                         "memory_efficient=False",
    "apex.normalization.FusedRMSNorm": "normalized_shape, eps=1e-05, elementwise_affine=True, "
                                       "memory_efficient=False",
    "apex.multi_tensor_apply.MultiTensorApply": "chunk_size",
    "apex.parallel.LARC.LARC": "optimizer, trust_coefficient=0.02, clip=True, eps=1e-08",
    "apex.optimizers.FusedAdam":
        "params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-8, adam_w_mode=True, "
        "weight_decay=0., amsgrad=False, set_grad_none=True, capturable=False, "
        "master_weights=False",
    "apex.optimizers.FusedLAMB":
        "params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.01, "
        "amsgrad=False, adam_w_mode=True, grad_averaging=True, set_grad_none=True, "
        "max_grad_norm=1.0, use_nvlamb=False",
    "apex.optimizers.FusedMixedPrecisionLamb":
        "params, lr=1e-3, step=0, bias_correction=True, betas=(0.9, 0.999), eps=1e-6, "
        "weight_decay=0.01, amsgrad=False, adam_w_mode=True, grad_averaging=True, "
        "max_grad_norm=1.0, use_nvlamb=False, reduced_precision_dtype=None",
    "apex.optimizers.FusedSGD":
        "params, lr=required, momentum=0, dampening=0, weight_decay=0, nesterov=False, "
        "wd_after_momentum=False, materialize_master_grads=True, set_grad_none=False",
    "apex.optimizers.FusedNovoGrad":
        "params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-8, weight_decay=0., "
        "amsgrad=False, reg_inside_moment=False, grad_averaging=True, norm_type=2, "
        "init_zero=False, set_grad_none=True",
    "apex.optimizers.FusedAdagrad":
        "params, lr=1e-2, eps=1e-10, weight_decay=0., set_grad_none=True, adagrad_w_mode=False",
    # The 2019 spelling (apex/optimizers/fp16_optimizer.py before Apex 1904e48d).
    "apex.optimizers.FP16_Optimizer":
        "init_optimizer, static_loss_scale=1.0, dynamic_loss_scale=False, "
        "dynamic_loss_args=None, verbose=True",
    "apex.optimizers.FP16_Optimizer.zero_grad": "set_grads_to_None=True",
    "apex.optimizers.FP16_Optimizer.step": "closure=None",
    "apex.optimizers.FP16_Optimizer.backward": "loss",
}


def _served(path: str):
    parts = path.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            obj = getattr(obj, attr)
        return obj
    raise AssertionError(path)


@pytest.mark.parametrize("path", sorted(APEX_SIGNATURES))
def test_served_signature_starts_with_apex_signature(hook, path):
    # ``required`` is torch's marker of a mandatory lr, which FusedSGD's signature has.
    apex_lambda = eval(f"lambda {APEX_SIGNATURES[path]}: None", {"required": required})
    expected = list(inspect.signature(apex_lambda).parameters.values())
    obj = _served(path)
    params = list(inspect.signature(obj).parameters.values())
    if inspect.isfunction(obj) and "." in path.removeprefix("apex.").split(".", 1)[-1]:
        params = params[1:]  # a method: drop self
    assert [p.name for p in params[:len(expected)]] == [p.name for p in expected], path
    for ours, apex in zip(params, expected):
        assert ours.default == apex.default, f"{path}: {ours.name} defaults to {ours.default!r}"
        assert ours.kind == apex.kind, f"{path}: {ours.name} is {ours.kind}"
    for extra in params[len(expected):]:
        assert extra.default is not inspect.Parameter.empty or extra.kind == extra.VAR_KEYWORD, (
            f"{path}: extra parameter {extra.name} must be optional")


def test_sync_batch_norm_channel_last_and_fuse_relu(hook):
    from apex.parallel import SyncBatchNorm, convert_syncbn_model

    torch.manual_seed(0)
    x = torch.randn(4, 3, 5, 5)
    z = torch.randn(4, 3, 5, 5)
    plain = nn.BatchNorm2d(3)
    # Positionally, as Apex's signature has it: channel_last is the 7th argument.
    last = SyncBatchNorm(3, 1e-5, 0.1, True, True, None, True, True)
    expected = torch.relu(plain(x) + z)
    out = last(x.permute(0, 2, 3, 1), z.permute(0, 2, 3, 1))
    torch.testing.assert_close(out, expected.permute(0, 2, 3, 1))
    torch.testing.assert_close(last.running_mean, plain.running_mean)

    model = nn.Sequential(nn.Conv2d(3, 3, 1), nn.BatchNorm2d(3))
    weight = model[1].weight
    converted = convert_syncbn_model(model, channel_last=False)
    assert isinstance(converted[1], SyncBatchNorm) and converted[1].weight is weight


def test_fused_layer_norm_takes_memory_efficient_positionally(hook):
    from apex.normalization import FusedLayerNorm, FusedRMSNorm

    ln = FusedLayerNorm(8, 1e-5, True, True)
    assert ln.memory_efficient and ln.bias is not None
    x = torch.randn(2, 8)
    torch.testing.assert_close(ln(x), nn.functional.layer_norm(x, (8,), ln.weight, ln.bias))
    assert FusedRMSNorm(8, memory_efficient=True).eps == 1e-5


# ------------------------------------------------------------------- _amp_state

def _train_step(model, opt, amp, x, poison: bool = False):
    loss = model(x).float().square().mean()
    if poison:
        loss = loss * math.inf
    with amp.scale_loss(loss, opt) as scaled:
        scaled.backward()
    opt.step()
    opt.zero_grad()
    return loss.detach(), scaled.detach()


def test_amp_state_is_the_same_object_everywhere(hook):
    from apex import amp
    from apex.amp import _amp_state as a
    from apex.amp._amp_state import _amp_state as b, master_params
    from apex.amp.frontend import _amp_state as c
    import apex.amp._amp_state
    import apex.amp.frontend

    assert amp._amp_state is a is b is c is apex.amp.frontend._amp_state
    assert apex.amp._amp_state is a  # importing the submodule did not replace the attribute
    assert master_params is amp_patch.master_params
    assert not hasattr(a, "loss_scalers") and not hasattr(a, "opt_properties")
    with pytest.raises(AttributeError, match="initialize\\(\\) has not been called"):
        a.loss_scalers


def test_amp_state_loss_scaler_is_live_and_settable(hook):
    from apex import amp

    torch.manual_seed(0)
    model = nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    model, opt = amp.initialize(model, opt, opt_level="O2", loss_scale="dynamic", verbosity=0)
    scaler = amp._amp_state.loss_scalers[0]
    assert scaler.dynamic and scaler.loss_scale() == 2.0**16 and scaler._scale_seq_len == 2000
    assert scaler._max_loss_scale == 2.0**24 and scaler._min_loss_scale is None
    scaler._loss_scale = 2.0**20
    scaler._scale_seq_len = 2
    x = torch.randn(3, 4)
    loss, scaled = _train_step(model, opt, amp, x)
    assert torch.equal(scaled, loss * 2.0**20)
    assert amp._amp_state.loss_scalers[0].loss_scale() == 2.0**20
    assert scaler._unskipped == 1 and not scaler._has_overflow
    _train_step(model, opt, amp, x)
    assert scaler.loss_scale() == 2.0**21 and scaler._unskipped == 0  # doubled after 2
    _train_step(model, opt, amp, x, poison=True)
    assert scaler._has_overflow and scaler.loss_scale() == 2.0**20 and scaler._unskipped == 0
    assert amp.state_dict()["loss_scaler0"]["loss_scale"] == 2.0**20
    with pytest.raises(ValueError, match="positive finite"):
        scaler._loss_scale = 0.0
    with pytest.raises(AttributeError, match="read-only"):
        scaler._unskipped = 5
    with pytest.raises(AttributeError, match="amp.scale_loss"):
        scaler.update_scale()


def test_setting_loss_scale_takes_effect_on_the_static_fast_path(hook):
    from apex import amp

    model = nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    model, opt = amp.initialize(model, opt, opt_level="O1", verbosity=0)  # bf16: static 1.0
    amp._amp_state.loss_scalers[0]._loss_scale = 8.0
    x = torch.randn(3, 4)
    loss = model(x).float().sum()
    with amp.scale_loss(loss, opt) as scaled:
        assert torch.equal(scaled, loss.detach() * 8.0)
        scaled.backward()
    expected = x.sum(0).expand(4, 4)
    # Unscaled again (bf16 matmul rounding aside): not 8 times the gradient.
    torch.testing.assert_close(model.weight.grad, expected, rtol=2e-2, atol=2e-2)


def test_amp_state_properties_handle_and_errors(hook):
    from apex import amp
    from apex.amp._amp_state import _amp_state

    model = nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    amp.initialize(model, opt, opt_level="O1", verbosity=0)
    props = _amp_state.opt_properties
    assert props.options["opt_level"] == "O1" and props.patch_torch_functions
    assert props.options["cast_model_type"] is None and props.enabled
    assert _amp_state.verbosity == 0
    _amp_state.verbosity = 2
    assert _amp_state.verbosity == 2
    _amp_state.allow_incoming_model_not_fp32 = True
    assert _amp_state.allow_incoming_model_not_fp32
    handle = _amp_state.handle
    assert handle.is_active()
    handle._clear_cache()
    with pytest.raises(AttributeError, match="frozen"):
        props.opt_level = "O2"
    with pytest.raises(AttributeError, match="amp.state_dict\\(\\)") as exc:
        _amp_state.hard_override_xyz
    assert "loss_scalers" in str(exc.value)  # it lists what is served
    handle._deactivate()
    assert amp_patch.session.current() is None

    amp.initialize(nn.Linear(2, 2), opt_level="O2", verbosity=0)
    assert not _amp_state.handle.is_active() and _amp_state.opt_properties.master_weights


def test_amp_state_verbosity_does_not_keep_a_closed_session_alive():
    import gc
    import weakref

    from amp_patch.apex_compat.amp_state import amp_state

    model = nn.Linear(2, 2)
    amp_patch.initialize(model, opt_level="O2", verbosity=0)
    amp_state.verbosity = 0
    assert amp_state.verbosity == 0
    session = weakref.ref(amp_patch.session.current())
    amp_patch.deinitialize()
    del model
    gc.collect()
    assert session() is None
    amp_patch.initialize(nn.Linear(2, 2), opt_level="O2", verbosity=1)
    assert amp_state.verbosity == 1  # the value set belonged to the closed session


# -------------------------------------------------------------- no silent misses

def test_caught_import_of_unserved_name_still_warns(hook, caplog):
    caplog.set_level(logging.WARNING, logger="amp_patch")
    for _ in range(2):
        try:
            from apex.contrib.multihead_attn import SelfMultiheadAttn  # noqa: F401
        except ImportError:
            pass
    try:
        from apex.normalization import MixedFusedLayerNorm  # noqa: F401
    except ImportError:
        pass
    try:
        import fused_layer_norm_cuda  # noqa: F401  (one of Apex's compiled modules)
    except ImportError:
        pass
    records = [r.getMessage() for r in caplog.records if r.name == "amp_patch"]
    assert len(records) == 3  # once per name
    assert records[0].startswith("apex.contrib.multihead_attn is not provided by amp_patch; use "
                                 "instead: torch.nn.MultiheadAttention")
    assert "apex.normalization.MixedFusedLayerNorm is not provided" in records[1]
    assert records[2].startswith("fused_layer_norm_cuda is not provided by amp_patch; use instead: "
                                 "apex.normalization.FusedLayerNorm")
    assert list(hook.misses) == ["apex.contrib.multihead_attn",
                                 "apex.normalization.MixedFusedLayerNorm", "fused_layer_norm_cuda"]


def test_unserved_attribute_warns(hook, caplog):
    caplog.set_level(logging.WARNING, logger="amp_patch")
    import apex.amp

    with pytest.raises(AttributeError, match="not supported"):
        apex.amp.scaler
    assert "apex.amp.scaler" in hook.misses
    assert any("apex.amp.scaler is not provided" in r.getMessage() for r in caplog.records)


# ------------------------------------------------------------------ timm contract

def test_amp_dict_has_state_dict_and_state_is_plain_data(hook):
    from apex import amp

    assert "state_dict" in amp.__dict__ and "load_state_dict" in amp.__dict__
    model = nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    model, opt = amp.initialize(model, opt, opt_level="O2", loss_scale="dynamic", verbosity=0)
    _train_step(model, opt, amp, torch.randn(2, 4))
    buf = io.BytesIO()
    torch.save({"amp": amp.state_dict(), "optimizer": opt.state_dict()}, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)
    amp.load_state_dict(loaded["amp"])
    assert loaded["amp"] == amp.state_dict()
