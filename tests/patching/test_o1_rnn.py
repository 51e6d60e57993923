"""nn.RNN / GRU / LSTM and the cells under O1: half outputs, fp32 grads of fp32 weights."""

from __future__ import annotations

import pytest
import torch
from torch.nn.utils.rnn import pack_padded_sequence

import amp_patch
from amp_patch import session as amp_session


@pytest.fixture
def o1(half_dtype):
    amp_patch.initialize(torch.nn.Linear(1, 1), opt_level="O1", half_dtype=half_dtype,
                         verbosity=0)
    return half_dtype


def _outputs(out):
    seq, hidden = out
    seq = seq.data if hasattr(seq, "batch_sizes") else seq
    hidden = hidden if isinstance(hidden, tuple) else (hidden,)
    return seq, hidden


@pytest.mark.parametrize("kind", [torch.nn.RNN, torch.nn.GRU, torch.nn.LSTM])
@pytest.mark.parametrize("layers", [1, 2])
@pytest.mark.parametrize("bidirectional", [False, True], ids=["uni", "bi"])
@pytest.mark.parametrize("packed", [False, True], ids=["plain", "packed"])
def test_rnn_half_out_fp32_grads(o1, kind, layers, bidirectional, packed):
    rnn = kind(3, 4, num_layers=layers, bidirectional=bidirectional, batch_first=True)
    x = torch.randn(2, 3, 3)
    inp = pack_padded_sequence(x, [3, 2], batch_first=True) if packed else x
    cache = amp_session.current().casts.cache
    before = cache.casts
    seq, hidden = _outputs(rnn(inp))
    assert seq.dtype == o1 and all(h.dtype == o1 for h in hidden)
    n_weights = len(rnn._flat_weights)
    assert cache.casts - before == n_weights  # each flat weight cast once, through the cache
    (seq.float().sum() + sum(h.float().sum() for h in hidden)).backward()
    for p in rnn.parameters():
        assert p.dtype == torch.float32 and p.grad is not None and p.grad.dtype == torch.float32


def test_rnn_matches_a_half_reference(o1):
    torch.manual_seed(0)
    lstm = torch.nn.LSTM(3, 4)
    x = torch.randn(5, 2, 3)
    out, _ = lstm(x)
    amp_patch.deinitialize()
    ref = torch.nn.LSTM(3, 4).to(o1)
    ref.load_state_dict({k: v.to(o1) for k, v in lstm.state_dict().items()})
    expected, _ = ref(x.to(o1))
    torch.testing.assert_close(out, expected)


@pytest.mark.parametrize("kind", [torch.nn.RNNCell, torch.nn.GRUCell, torch.nn.LSTMCell])
def test_cells(o1, kind):
    cell = kind(3, 4)
    out = cell(torch.randn(2, 3))
    outs = out if isinstance(out, tuple) else (out,)
    assert all(o.dtype == o1 for o in outs)
    sum(o.float().sum() for o in outs).backward()
    assert all(p.grad.dtype == torch.float32 for p in cell.parameters())


def test_vf_patch_is_undone():
    before = {n: torch._VF.__dict__.get(n) for n in ("lstm", "gru", "rnn_tanh", "lstm_cell")}
    amp_patch.initialize(torch.nn.Linear(1, 1), opt_level="O1", verbosity=0)
    assert "lstm" in torch._VF.__dict__
    amp_patch.deinitialize()
    assert {n: torch._VF.__dict__.get(n) for n in before} == before
    assert torch._VF.lstm is torch._C._VariableFunctions.lstm


@pytest.mark.parametrize("kind", [torch.nn.RNN, torch.nn.GRU, torch.nn.LSTM])
@pytest.mark.parametrize("packed", [False, True], ids=["plain", "packed"])
@pytest.mark.parametrize("fp32_hidden", [False, True], ids=["no-hx", "fp32-hx"])
def test_rnn_takes_a_half_input(o1, kind, packed, fp32_hidden):
    # torch's RNNBase.check_input rejects an input whose dtype differs from the
    # weights' unless autocast is on; under O1, as under Apex, a half input runs.
    rnn = kind(3, 4, batch_first=True)
    x = torch.randn(2, 3, 3, dtype=o1)
    inp = pack_padded_sequence(x, [3, 2], batch_first=True) if packed else x
    hx = None
    if fp32_hidden:
        h = torch.zeros(1, 2, 4)
        hx = (h, h.clone()) if kind is torch.nn.LSTM else h
    seq, hidden = _outputs(rnn(inp, hx))
    assert seq.dtype == o1 and all(h.dtype == o1 for h in hidden)
    seq.float().sum().backward()
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in rnn.parameters())


def test_rnn_half_input_matches_fp32_input(o1):
    torch.manual_seed(0)
    lstm = torch.nn.LSTM(3, 4)
    x = torch.randn(5, 2, 3).to(o1)
    torch.testing.assert_close(lstm(x)[0], lstm(x.float())[0], rtol=0, atol=0)


def test_rnn_half_input_still_rejected_with_casts_disabled(o1):
    lstm = torch.nn.LSTM(3, 4)
    # torch's wording: "... does not match weight dtype" (2.13), "input must have the type" (2.6)
    refused = "does not match weight dtype|input must have the type"
    with amp_patch.disable_casts(), pytest.raises(ValueError, match=refused):
        lstm(torch.randn(5, 2, 3, dtype=o1))
    # The shape checks keep working under O1 for a half input.
    with pytest.raises(RuntimeError, match="input.size"):
        lstm(torch.randn(5, 2, 7, dtype=o1))


def test_rnn_check_input_patch_is_undone():
    before = torch.nn.RNNBase.__dict__["check_input"]
    amp_patch.initialize(torch.nn.Linear(1, 1), opt_level="O1", verbosity=0)
    assert torch.nn.RNNBase.__dict__["check_input"] is not before
    amp_patch.deinitialize()
    assert torch.nn.RNNBase.__dict__["check_input"] is before
