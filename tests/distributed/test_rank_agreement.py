"""Every rank makes the same amp decision, in real training loops (docs/distributed.md).

The loops of ``_loop_cases.py`` (a: an evaluation forward with grad on
between steps; b: evaluation under ``no_grad`` and ``eval()``; c: gradient
accumulation with FSDP2's ``set_requires_gradient_sync(False)`` and DDP's
``no_sync()``; d: activation checkpointing inside sharded blocks; e: two
forwards before the backwards of two losses; f: a frozen submodule, and an
unused parameter under DDP's ``find_unused_parameters``; g: an overflow on
one rank only, in fp16; h: a DCP resume from world size 1 onto 2, then loop
a) at O0-O3, on FSDP2 and on DDP; and FSDP2 with low-precision optimizer
state, ``lean:*``. One group of 2 gloo processes, started at
the first test of this module, runs them all with ``AMP_PATCH_DEBUG_RANKS=1``;
each test reads its case's outcome. The parts that need no process group are
tested here directly.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import _dist_cases
import _loop_cases
import amp_patch as amp
from amp_patch.frontend import debug
from amp_patch.helpers import agree
from amp_patch.patching import regather
from amp_patch.casting.fsdp import cpu_fsdp_supported
from amp_patch.patching.cache import WeightCastCache

_outcomes: dict[str, str] = {}

#: The reason FSDP2's cases skip on a torch whose FSDP2 cannot run on the CPU (docs/install.md).
NO_CPU_FSDP2 = (f"torch {torch.__version__}'s FSDP2 cannot run on the CPU "
                "(torch.cpu.Stream has no record_event)")


def _runs_here(name: str) -> bool:
    """The debug case shards with FSDP2 too."""
    return cpu_fsdp_supported() or not (":fsdp2:" in name or name == "debug_names_the_decision")


def _outcome(name: str, tmp_path_factory) -> str:
    if not _outcomes:
        names = [name for name in _loop_cases.CASES if _runs_here(name)]
        _outcomes.update(_dist_cases.launch(
            2, names, tmp_path_factory.mktemp("loops"), "loops", script=_loop_cases.__file__,
            env={debug.ENV_VAR: "1"}))
    return _outcomes[name]


def _check(name: str, tmp_path_factory) -> None:
    if not _runs_here(name):
        pytest.skip(NO_CPU_FSDP2)
    result = _outcome(name, tmp_path_factory)
    if result != "ok":
        pytest.fail(f"{name} on 2 ranks:\n{result}", pytrace=False)


@pytest.mark.slow
@pytest.mark.parametrize("level", _dist_cases.LEVELS)
@pytest.mark.parametrize("strategy", _loop_cases.STRATEGIES)
@pytest.mark.parametrize("loop", _loop_cases.LOOPS)
def test_ranks_agree_and_match_one_process(loop, strategy, level, tmp_path_factory):
    _check(f"{loop}:{strategy}:{level}", tmp_path_factory)


@pytest.mark.slow
@pytest.mark.parametrize("setting", sorted(_loop_cases.LEAN))
def test_fsdp2_shards_lean_optimizer_state(setting, tmp_path_factory):
    """Low-precision optimizer state on FSDP2 (docs/lean_state.md): the ops step the local shards, codes
    and scales are DTensors sharded on dim 0, an overflow on one rank changes no bit on any,
    and a DCP checkpoint resumes bit for bit."""
    _check(f"lean:fsdp2:{setting}", tmp_path_factory)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(_loop_cases.NORMED))
def test_sharded_norms_are_the_whole_tensors(name, tmp_path_factory):
    """FusedLAMB and FusedNovoGrad on FSDP2's shards step as on the whole tensors: their grad,
    trust-ratio and per-tensor norms are summed over the shards."""
    _check(f"normed:{name}", tmp_path_factory)


@pytest.mark.slow
def test_debug_ranks_names_the_decision(tmp_path_factory):
    """A cast or a loss scale on one rank only: RanksDisagreeError names it, before backward."""
    _check("debug_names_the_decision", tmp_path_factory)


# --------------------------------------------------------------------------- one process


def test_forget_drops_only_those_params():
    cache = WeightCastCache()
    a, b = nn.Parameter(torch.ones(4)), nn.Parameter(torch.ones(4))
    ca, cb = cache.cast(a, torch.bfloat16), cache.cast(b, torch.bfloat16)
    cache.cast(a, torch.float16)
    cache.forget([a])
    assert cache.cast(b, torch.bfloat16) is cb
    assert cache.cast(a, torch.bfloat16) is not ca
    assert cache.casts == 4


def test_digest_follows_the_casts_in_order():
    def digest(sizes):
        cache = WeightCastCache()
        for n in sizes:
            cache.cast(nn.Parameter(torch.ones(n)), torch.bfloat16)
        return cache.digest

    assert digest([3, 5]) == digest([3, 5])
    assert digest([3, 5]) != digest([5, 3])
    assert digest([3, 5]) != digest([3])


def test_agree_is_the_identity_in_one_process():
    assert not agree.group_active()
    assert agree.agree_max([True, 0.5]) == [1.0, 0.5]
    assert agree.agree_min([False]) == [0.0]
    assert agree.check_kernels(True) is True


def test_debug_mode_is_off_by_default(monkeypatch):
    monkeypatch.delenv(debug.ENV_VAR, raising=False)
    model = nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    amp.initialize(model, opt, opt_level="O1", verbosity=0)
    assert amp.session.current().rank_check is None
    amp.deinitialize()
    monkeypatch.setenv(debug.ENV_VAR, "1")
    amp.initialize(model, opt, opt_level="O1", loss_scale="dynamic", verbosity=0)
    check = amp.session.current().rank_check
    assert isinstance(check, debug.RankCheck)
    with amp.scale_loss(model(torch.ones(2, 4)).float().sum(), opt) as scaled:
        scaled.backward()  # one process: counted, nothing to compare
    assert check.calls == 1


def test_regather_does_nothing_without_fsdp():
    model = nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    amp.initialize(model, opt, opt_level="O1", verbosity=0)
    session = amp.session.current()
    assert regather.install(session.casts, [], session.on_close) == 0
