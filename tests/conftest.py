"""Shared fixtures: device and dtype parameters, and a clean amp state around every test."""

from __future__ import annotations

import pytest
import torch

import amp_patch
from amp_patch.settings.dtypes import HALF_DTYPE_NAMES


def _cuda_param(value="cuda"):
    return pytest.param(
        value,
        marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA not available"),
    )


#: Devices to parametrize over; CUDA cases skip with a reason on machines without one.
DEVICES = ["cpu", _cuda_param()]

#: Half dtypes to test on a device (amp_patch.settings.dtypes.HALF_DTYPE_NAMES). fp16 on CPU is
#: orders of magnitude slower than fp32 (no native kernels here), so CPU fp16 tests use
#: tiny shapes only.
HALF_DTYPES = list(HALF_DTYPE_NAMES.values())


@pytest.fixture(params=DEVICES)
def device(request) -> str:
    return request.param


@pytest.fixture(params=HALF_DTYPES, ids=list(HALF_DTYPE_NAMES))
def half_dtype(request) -> torch.dtype:
    return request.param


@pytest.fixture(autouse=True)
def _clean_amp():
    """Every test starts and ends with torch unpatched and no live session."""
    amp_patch.deinitialize()
    yield
    amp_patch.deinitialize()
