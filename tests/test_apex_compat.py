"""The served ``apex`` modules: Apex's signatures."""

from __future__ import annotations

import importlib.util
import inspect

import pytest
import torch
from torch import nn

from amp_patch.apex_compat import import_hook

HAS_LARC = importlib.util.find_spec("amp_patch.apex_compat.larc") is not None
LARC_MISSING = "amp_patch.apex_compat.larc (LARC, from the optim work) is not in this tree yet"


@pytest.fixture
def hook():
    with import_hook.apex_import_hook(shadow_apex=True) as finder:
        yield finder


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
    "apex.parallel.LARC": "optimizer, trust_coefficient=0.02, clip=True, eps=1e-08",
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
    if path == "apex.parallel.LARC" and not HAS_LARC:
        pytest.skip(LARC_MISSING)
    apex_lambda = eval(f"lambda {APEX_SIGNATURES[path]}: None")
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
