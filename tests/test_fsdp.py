"""FSDP2 (fully_shard) under amp on CPU gloo with 2 and 4 ranks.

The distributed cases live in _dist_cases.py and run many to a process group
(starting processes costs more than the cases); each test here reads its
case's outcome.
"""

from __future__ import annotations

import pytest

import _dist_cases

WORLDS = {"w2": 2, "w4": 4}


def _check(group: str, name: str, tmp_path_factory) -> None:
    result = _dist_cases.outcome(group, name, tmp_path_factory)
    if result != "ok":
        pytest.fail(f"{name} with {_dist_cases.GROUPS[group][0]} ranks:\n{result}", pytrace=False)


@pytest.mark.slow
@pytest.mark.parametrize("group", list(WORLDS))
@pytest.mark.parametrize("level", _dist_cases.LEVELS)
def test_fsdp_matches_single_process(group, level, tmp_path_factory):
    """Same global batch, same losses and weights as one process, within reduction order."""
    _check(group, f"match:{level}", tmp_path_factory)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["o1_patched_inside_fsdp", "deinitialize_restores_policy",
                                  "initialize_after_a_forward", "reduce_dtype_override",
                                  "failed_initialize_puts_shards_back", "one_host_sync"])
def test_fsdp_two_ranks(name, tmp_path_factory):
    _check("w2", name, tmp_path_factory)


@pytest.mark.slow
def test_initialize_orders(tmp_path_factory):
    """initialize then fully_shard fails at the first forward, naming the order that works."""
    _check("w2", "orders", tmp_path_factory)


@pytest.mark.slow
@pytest.mark.parametrize("group", list(WORLDS))
def test_overflow_on_one_rank_skips_everywhere(group, tmp_path_factory):
    _check(group, "overflow_skips_everywhere", tmp_path_factory)


@pytest.mark.slow
@pytest.mark.parametrize("group", list(WORLDS))
def test_o2_memory_is_one_nth(group, tmp_path_factory):
    _check(group, "o2_memory_is_sharded", tmp_path_factory)

