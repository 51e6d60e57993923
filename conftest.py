"""The docstring examples of amp_patch, run as doctests by ``make test`` (plain ``pytest``).

Plain ``pytest`` collects the examples of every module under amp_patch/
(pyproject's testpaths name it), as ``pytest --doctest-modules amp_patch``
would, without turning doctest collection on for tests/.

Every example sees ``torch``, ``nn``, ``F``, ``amp`` (and ``amp_patch``), ``ops``,
a fresh small ``model`` (4 features in, 2 out) with its SGD ``optimizer`` (also
``opt``), a batch ``x``, ``y`` and a ``loss_fn``, and runs with no live amp
session before or after it. The tests under tests/ have their own conftest.py;
nothing here applies to them.

:data:`NOT_RUN` names the examples that cannot run on their own, each with the
reason: they need a GPU, a process group, the ``apex`` import hook of
``amp-patch run``, files, or the training script they are a fragment of.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from _pytest.doctest import DoctestItem, DoctestModule
from torch import nn
from torch.nn import functional as F

import amp_patch
from amp_patch import ops

_APEX = "imports apex: it runs under `amp-patch run`, which maps the apex imports"
_APEX_SCRIPT = "a fragment of an Apex-era training script: its tensors come from the script"
_LINEAR = "a fragment: `linear` is a model's nn.Linear"
_SCRIPT = "a fragment of a training script: its grads, masters and loss come from the script"

#: Docstring examples that are not run, by doctest name (a name ending in "." covers a
#: module), with the reason.
NOT_RUN: dict[str, str] = {
    "amp_patch.apex_compat.apex_C.flatten": _APEX,
    "amp_patch.apex_compat.apex_C.unflatten": _APEX,
    "amp_patch.apex_compat.contrib.optimizers.FP16_Optimizer": _APEX_SCRIPT,
    "amp_patch.apex_compat.contrib.optimizers.FP16_Optimizer.state_dict": _APEX_SCRIPT,
    "amp_patch.apex_compat.contrib.optimizers.FusedAdam": _APEX_SCRIPT,
    "amp_patch.apex_compat.contrib.xentropy.SoftmaxCrossEntropyLoss": _APEX,
    "amp_patch.apex_compat.fused_adam_cuda.adam": _APEX_SCRIPT,
    "amp_patch.apex_compat.fused_adam_cuda.adam_mt": _APEX_SCRIPT,
    "amp_patch.apex_compat.amp_state.AmpState": _APEX,
    "amp_patch.apex_compat.amp_state.LossScalerView": _APEX,
    "amp_patch.apex_compat.amp_state.OptPropertiesView": _APEX,
    "amp_patch.apex_compat.optimizers_2019.FusedAdam": _APEX,
    "amp_patch.apex_compat.amp_C.multi_tensor_axpby": _APEX_SCRIPT,
    "amp_patch.apex_compat.amp_C.multi_tensor_l2norm": _APEX_SCRIPT,
    "amp_patch.apex_compat.amp_C.multi_tensor_scale": _APEX_SCRIPT,
    "amp_patch.apex_compat.amp_C.multi_tensor_unscale_l2norm": _APEX_SCRIPT,
    "amp_patch.apex_compat.amp_C.update_scale_hysteresis": _APEX_SCRIPT,
    "amp_patch.apex_compat.fp16_optimizer.DynamicLossScaler": _APEX_SCRIPT,
    "amp_patch.apex_compat.fp16_optimizer.FP16_Optimizer": _APEX_SCRIPT,
    "amp_patch.apex_compat.fp16_optimizer.LossScaler": _APEX_SCRIPT,
    "amp_patch.apex_compat.fp16_utils.master_params_to_model_params": _APEX_SCRIPT,
    "amp_patch.apex_compat.fp16_utils.model_grads_to_master_grads": _APEX_SCRIPT,
    "amp_patch.ops.multi_tensor_apply.MultiTensorApply": _APEX_SCRIPT,
    "amp_patch.apex_compat.optimizers_2019.FP16_Optimizer": _APEX_SCRIPT,
    "amp_patch.apex_compat.optimizers_2019.FP16_Optimizer.backward": _APEX_SCRIPT,
    "amp_patch.apex_compat.optimizers_2019.FP16_Optimizer.cur_scale": _APEX_SCRIPT,
    "amp_patch.apex_compat.optimizers_2019.FP16_Optimizer.step": _APEX_SCRIPT,
    "amp_patch.apex_compat.optimizers_2019.FusedAdam2019": _APEX_SCRIPT,
    "amp_patch.apex_compat.optimizers_2019.FusedAdam2019.step": _APEX_SCRIPT,
    "amp_patch.apex_compat.parallel.create_syncbn_process_group": "needs a process group",
    "amp_patch.cli.run.cuda_on_cpu.": "CUDA calls mapped to the CPU: runs inside `amp-patch run`",
    "amp_patch.cli.run.command.run_script": "runs a script file",
    "amp_patch.cli.compare.results.run_compare": (
        "trains every level in its own process for minutes "
        "(tests/cli/test_cli_compare.py runs it)"),
    "amp_patch.cli.host_facts.LoadMonitor": "the share depends on the machine's load",
    "amp_patch.cli.options.parse_device": "needs two GPUs",
    "amp_patch.cli.compare.data_parallel.launch": (
        "spawns processes, which need an importable entry function"),
    "amp_patch.cli.compare.data_parallel.shard": "needs an initialized process group",
    "amp_patch.cli.compare.trainer.LevelTrainer":
        "needs a workload of amp_patch.cli.compare.models",
    "amp_patch.patching.cpu_half.detect.CpuHalfSupport": "the answer depends on the host's CPU",
    "amp_patch.frontend.checkpoint.": "writes and reads a checkpoint under torch.distributed",
    "amp_patch.frontend.clip.clip_grad_norm_": _SCRIPT,
    "amp_patch.casting.fsdp.prepare": "needs a process group and fully_shard",
    "amp_patch.helpers.teardown.": "needs a process group",
    "amp_patch.ops.optimizer_ops.multi_tensor_adam_": _SCRIPT,
    "amp_patch.ops.optimizer_ops.multi_tensor_adagrad_": _SCRIPT,
    "amp_patch.ops.optimizer_ops.multi_tensor_novograd_": _SCRIPT,
    "amp_patch.ops.optimizer_ops.multi_tensor_lamb_stage1_": _SCRIPT,
    "amp_patch.ops.optimizer_ops.multi_tensor_lamb_stage2_": _SCRIPT,
    "amp_patch.optim.amp.state_dict_hooks.install_optimizer_hooks": _SCRIPT,
    "amp_patch.optim.amp.master_weights.clear_grads": _SCRIPT,
    "amp_patch.optim.fused._base.FusedOptimizer.load_state_dict": "reads a checkpoint file",
    "amp_patch.optim.fused._base.FusedOptimizer.fused_step_inputs": _SCRIPT,
    "amp_patch.optim.fused.batches.FusedStepInputs": _SCRIPT,
    "amp_patch.patching.cache.WeightCastCache": _LINEAR,
    "amp_patch.patching.cache.WeightCastCache.forget": _LINEAR,
    "amp_patch.frontend.debug.RankCheck": "needs an initialized process group",
    "amp_patch.frontend.debug.install": "needs an initialized process group",
    "amp_patch.patching.regather.install": "needs an FSDP2 model at O1 in a process group",
    "amp_patch.scaler.AmpScaler.snapshot": _SCRIPT,
    "amp_patch.scaler.unscale_grads": _SCRIPT,
}


#: Docstring examples that start processes, by doctest name: marked slow, as the tests that
#: do are, so that ``make test-fast`` (``-m "not slow"``) leaves them out.
SLOW: dict[str, str] = {
    "amp_patch.cli.compare.round_robin.LevelPool": "starts a worker process per level",
    "amp_patch.cli.doctor.report": "runs the compiler to read its version",
}

_PACKAGE = Path(__file__).resolve().parent / "amp_patch"


def pytest_collect_file(file_path: Path, parent: pytest.Collector) -> pytest.Collector | None:
    """The examples of a module under amp_patch/ (pytest's own plugin does it under
    ``--doctest-modules``; ``__main__.py`` is never imported)."""
    if (file_path.suffix == ".py" and _PACKAGE in file_path.parents
            and file_path.name != "__main__.py" and not parent.config.option.doctestmodules):
        return DoctestModule.from_parent(parent, path=file_path)
    return None


def _reason(name: str) -> str | None:
    for key, reason in NOT_RUN.items():
        if name == key or (key.endswith(".") and name.startswith(key)):
            return reason
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if isinstance(item, DoctestItem):
            reason = _reason(item.name)
            if reason is not None:
                item.add_marker(pytest.mark.skip(reason=f"docstring example not run: {reason}"))
            if item.name in SLOW:
                item.add_marker(pytest.mark.slow)


@pytest.fixture(autouse=True)
def _docstring_example_globals(request: pytest.FixtureRequest, doctest_namespace: dict):
    if not isinstance(request.node, DoctestItem):
        yield
        return
    amp_patch.deinitialize()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    doctest_namespace.update(torch=torch, nn=nn, F=F, amp=amp_patch, amp_patch=amp_patch,
                             ops=ops, model=model, optimizer=optimizer, opt=optimizer,
                             x=torch.randn(3, 4), y=torch.randn(3, 2), loss_fn=nn.MSELoss())
    yield
    amp_patch.deinitialize()
