"""save_checkpoint / load_checkpoint (torch.distributed.checkpoint): exact resumes, resharding.

The multi-process cases (FSDP2 and DDP on CPU gloo; 2 -> 4 and 4 -> 2 ranks) live in
_dist_cases.py; the single-process ones run here (DCP works without a process group).
"""

from __future__ import annotations

import pytest
import torch

import _dist_cases
import amp_patch as amp
from training_utils import assert_identical, conv_batch, convnet, mlp, snapshot, train

from amp_patch.casting.fsdp import cpu_fsdp_supported


def _check(group: str, name: str, tmp_path_factory) -> None:
    result = _dist_cases.outcome(group, name, tmp_path_factory)
    if result != "ok":
        pytest.fail(f"{name} with {_dist_cases.GROUPS[group][0]} ranks:\n{result}", pytrace=False)


@pytest.mark.slow
@pytest.mark.parametrize("group,kind", [("w2", "fsdp"), ("w4", "fsdp"), ("w2", "ddp")])
def test_resume_same_world_size_is_exact(group, kind, tmp_path_factory):
    if kind == "fsdp" and not cpu_fsdp_supported():
        pytest.skip(f"torch {torch.__version__}'s FSDP2 cannot run on the CPU (torch.cpu.Stream has no record_event)")
    _check(group, f"dcp_resume:{kind}", tmp_path_factory)


@pytest.mark.slow
@pytest.mark.parametrize("level", ["O0", "O2"])
@pytest.mark.parametrize("saved,loaded", [(2, 4), (4, 2)])
def test_resume_other_world_size_same_losses(level, saved, loaded, tmp_path_factory):
    if not cpu_fsdp_supported():  # the checkpoints are saved from FSDP2-sharded models
        pytest.skip(f"torch {torch.__version__}'s FSDP2 cannot run on the CPU (torch.cpu.Stream has no record_event)")
    group = "w4" if loaded == 4 else "w2-after-w4"
    _check(group, f"reshard_load:{level}:{saved}", tmp_path_factory)


def _run(level: str, seed: int):
    model = mlp(seed)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    return amp.initialize(model, opt, opt_level=level, loss_scale="dynamic", verbosity=0)


@pytest.mark.parametrize("level", ["O0", "O1", "O2", "O3"])
def test_single_process_resume_is_exact(level, tmp_path):
    model, opt = _run(level, 0)
    train(model, opt, 2)
    amp.save_checkpoint(tmp_path / "ckpt", model, opt, extra={"epoch": {"n": 7}})
    train(model, opt, 2, start=2)
    expected = snapshot([model], [opt]) + [torch.rand(3)]
    scale = amp.state_dict()
    amp.deinitialize()

    torch.manual_seed(99)
    model, opt = _run(level, 1)
    extra = {"epoch": {"n": 0}}
    amp.load_checkpoint(tmp_path / "ckpt", model, opt, extra=extra)
    assert extra == {"epoch": {"n": 7}}
    train(model, opt, 2, start=2)
    assert_identical(snapshot([model], [opt]) + [torch.rand(3)], expected)
    assert amp.state_dict() == scale


def test_o2_checkpoint_holds_the_masters(tmp_path):
    import torch.distributed.checkpoint as dcp

    model, opt = _run("O2", 0)
    train(model, opt, 1)
    amp.save_checkpoint(tmp_path / "ckpt", model, opt)
    keys = dcp.FileSystemReader(tmp_path / "ckpt").read_metadata().state_dict_metadata
    assert "optimizer.amp_master_params.0.weight" in keys
    assert "optimizer.state.2.weight.exp_avg" in keys and "amp.loss_scaler0.loss_scale" in keys
    assert keys["model.0.weight"].properties.dtype == torch.float32  # the masters, not half
    assert "rng.rank0.cpu" in keys


def test_load_errors(tmp_path):
    model, opt = _run("O1", 0)
    train(model, opt, 1)
    with pytest.raises(ValueError, match="taken"):
        amp.save_checkpoint(tmp_path / "x", model, opt, extra={"rng": 1})
    amp.save_checkpoint(tmp_path / "ckpt", model, opt)
    other = torch.optim.Adam([{"params": list(model.parameters())[:2]},
                              {"params": list(model.parameters())[2:]}], lr=1e-2)
    with pytest.raises(ValueError, match="has 1 param groups, this Adam has 2"):
        amp.load_checkpoint(tmp_path / "ckpt", model, other)
    stranger = torch.optim.Adam([torch.nn.Parameter(torch.ones(2))])
    with pytest.raises(ValueError, match="belongs to none of the models"):
        amp.save_checkpoint(tmp_path / "y", model, stranger)


def test_fp32_checkpoint_loads_into_an_amp_run(tmp_path):
    model = mlp(0)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    amp.save_checkpoint(tmp_path / "fp32", model, opt)  # no amp session: no loss scalers saved
    model2, opt2 = _run("O2", 1)
    amp.load_checkpoint(tmp_path / "fp32", model2, opt2)
    for p, m in zip(model.parameters(), amp.master_params(opt2)):
        assert torch.equal(p, m)  # the masters take the fp32 weights exactly
    assert amp.state_dict()["loss_scaler0"]["loss_scale"] == 2.0**16


def _live(model, opt) -> list[torch.Tensor]:
    """Clones of the model's own params (half under O2), the masters and the optimizer state."""
    return [p.detach().clone() for p in model.parameters()] + snapshot([model], [opt])


@pytest.mark.parametrize("case", ["groups", "num_losses"])
def test_failed_load_changes_nothing(case, tmp_path):
    """Every check runs before dcp.load writes the live tensors in place."""
    def run(seed, num_losses=1):
        model = convnet(seed)
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        model, opt = amp.initialize(model, opt, opt_level="O2", verbosity=0,
                                    num_losses=num_losses)
        train(model, opt, 2, batch_fn=conv_batch)
        return model, opt

    amp.save_checkpoint(tmp_path / "ckpt", *run(0, num_losses=2 if case == "num_losses" else 1))
    amp.deinitialize()
    model, opt = run(1)
    if case == "groups":
        params = [p for g in opt.param_groups for p in g["params"]]
        split = torch.optim.Adam([{"params": params[:2]}, {"params": params[2:]}], lr=1e-2)
        opt.param_groups = split.param_groups
    before = _live(model, opt)
    error, message = {
        "groups": (ValueError, "has 1 param groups, this Adam has 2"),
        "num_losses": (RuntimeError, r"loss scalers \['loss_scaler0', 'loss_scaler1'\].*"
                                     "num_losses=1"),
    }[case]
    with pytest.raises(error, match=message):
        amp.load_checkpoint(tmp_path / "ckpt", model, opt)
    assert_identical(_live(model, opt), before)
