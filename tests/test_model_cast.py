"""O0/O2/O3 model casting: params and buffers, batch norms, input and output hooks."""

from __future__ import annotations

from collections import OrderedDict, namedtuple

import numpy as np
import pytest
import torch
from torch import nn

import amp_patch as amp
from amp_patch.casting.model import cast_floating
from training_utils import convnet, mlp

Pair = namedtuple("Pair", "a b")


class Recorder(nn.Module):
    """Records what its forward received and returns it back."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(2, 2)
        self.seen = None

    def forward(self, *args, **kwargs):
        self.seen = (args, kwargs)
        return args, kwargs


@pytest.mark.parametrize("level,expected", [("O0", torch.float32), ("O2", "half"), ("O3", "half")])
def test_params_and_buffers_cast_keeping_identity(level, expected, half_dtype):
    model = convnet()
    params_before = list(model.parameters())
    m2 = amp.initialize(model, opt_level=level, half_dtype=half_dtype, verbosity=0)
    assert m2 is model
    assert all(a is b for a, b in zip(params_before, model.parameters()))
    want = half_dtype if expected == "half" else expected
    bn = model[1]
    keep = level == "O2"
    for name, p in model.named_parameters():
        is_bn = name.startswith("1.")
        assert p.dtype == (torch.float32 if keep and is_bn else want), name
    assert bn.running_mean.dtype == (torch.float32 if keep else want)
    assert bn.num_batches_tracked.dtype == torch.int64


def test_keep_batchnorm_override_and_sync_batchnorm():
    model = nn.Sequential(nn.Linear(3, 3), nn.SyncBatchNorm(3), nn.BatchNorm1d(3, affine=False))
    amp.initialize(model, opt_level="O3", keep_batchnorm_fp32=True, verbosity=0)
    assert model[0].weight.dtype == torch.bfloat16
    assert model[1].weight.dtype == torch.float32  # SyncBatchNorm is a _BatchNorm
    assert model[1].running_var.dtype == torch.float32
    assert model[2].running_mean.dtype == torch.bfloat16  # not affine: cast
    amp.deinitialize()
    model = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3))
    amp.initialize(model, opt_level="O2", keep_batchnorm_fp32="False", verbosity=0)
    assert model[1].weight.dtype == torch.bfloat16


def test_forward_runs_and_outputs_fp32_by_default():
    model = convnet()
    amp.initialize(model, opt_level="O2", verbosity=0)
    out = model(torch.randn(2, 3, 6, 6))
    assert out.dtype == torch.float32
    out.sum().backward()
    assert model[0].weight.grad.dtype == torch.bfloat16
    assert model[1].weight.grad.dtype == torch.float32


def test_cast_model_outputs():
    model = mlp()
    amp.initialize(model, opt_level="O3", cast_model_outputs=torch.bfloat16, verbosity=0)
    assert model(torch.randn(2, 8)).dtype == torch.bfloat16


def test_inputs_nested_containers_keep_types(half_dtype):
    model = Recorder()
    amp.initialize(model, opt_level="O2", half_dtype=half_dtype, verbosity=0)
    arr = np.ones(2)
    x32, x64, ids = torch.ones(2), torch.ones(2, dtype=torch.float64), torch.arange(2)
    od = OrderedDict(k=torch.ones(1))
    model([x32, (x64, ids)], Pair(x32, "s"), od, arr, key={"t": x32, "s": "str"})
    (lst, pair, od_seen, arr_seen), kwargs = model.seen
    assert type(lst) is list and lst[0].dtype == half_dtype
    assert type(lst[1]) is tuple and lst[1][0].dtype == torch.float64 and lst[1][1] is ids
    assert type(pair) is Pair and pair.a.dtype == half_dtype and pair.b == "s"
    assert type(od_seen) is OrderedDict and od_seen["k"].dtype == half_dtype
    assert arr_seen is arr
    assert kwargs["key"]["t"].dtype == half_dtype and kwargs["key"]["s"] == "str"
    # outputs: the same structure, cast to fp32
    (out_args, out_kwargs) = model(x32.to(half_dtype))
    assert out_args[0].dtype == torch.float32


def test_packed_sequence_input_is_cast():
    lstm = nn.LSTM(3, 4)
    amp.initialize(lstm, opt_level="O3", verbosity=0)
    seq = nn.utils.rnn.pack_padded_sequence(torch.randn(5, 2, 3), [5, 3])
    out, _ = lstm(seq)
    assert isinstance(out, nn.utils.rnn.PackedSequence)
    assert out.data.dtype == torch.float32 and out.batch_sizes.dtype == torch.int64


def test_o0_casts_model_and_inputs_to_fp32():
    model = Recorder().to(torch.bfloat16)
    amp.initialize(model, opt_level="O0", verbosity=0)
    assert model.lin.weight.dtype == torch.float32
    model(torch.ones(1, dtype=torch.bfloat16))
    assert model.seen[0][0].dtype == torch.float32


@pytest.mark.parametrize("level,cast", [("O2", False), ("O3", False), ("O1", None)])
def test_no_casting_means_no_hooks(level, cast):
    model = Recorder()
    amp.initialize(model, opt_level=level, cast_model_type=cast, verbosity=0)
    assert model.lin.weight.dtype == torch.float32
    assert not model._forward_hooks  # no output casting
    # O1's one pre-hook refreshes evaluation casts (patching.install); it casts nothing.
    expected = ["fresh_eval_casts"] if level == "O1" else []
    assert [h.__name__ for h in model._forward_pre_hooks.values()] == expected
    model(torch.ones(1, dtype=torch.bfloat16))
    assert model.seen[0][0].dtype == torch.bfloat16


def test_hooks_not_forward_and_removed_by_deinitialize():
    model = mlp()
    amp.initialize(model, opt_level="O2", verbosity=0)
    assert "forward" not in model.__dict__
    assert len(model._forward_pre_hooks) == 1 and len(model._forward_hooks) == 1
    amp.deinitialize()
    assert not model._forward_pre_hooks and not model._forward_hooks
    assert model[0].weight.dtype == torch.bfloat16  # keeps its current dtype


def test_cast_floating_leaves_other_things():
    assert cast_floating("abc", torch.bfloat16) == "abc"
    assert cast_floating(3.0, torch.bfloat16) == 3.0
    c = torch.ones(1, dtype=torch.complex64)
    assert cast_floating(c, torch.bfloat16) is c
    t = torch.ones(1, dtype=torch.bfloat16)
    assert cast_floating(t, torch.bfloat16) is t
