"""Where the recurrent modules reach their kernels, so O1 can cast them.

``nn.RNN``, ``nn.GRU`` and ``nn.LSTM`` (``torch.nn.modules.rnn``) call
``_VF.lstm`` / ``_VF.gru`` / ``_VF.rnn_tanh`` / ``_VF.rnn_relu`` with the
input (a tensor, or the data of a packed sequence plus its int64
``batch_sizes``), the hidden state and ``self._flat_weights``; the cell
modules call ``_VF.lstm_cell`` and friends. ``_VF`` is the one
``torch._VF`` module object, whose ``__getattr__`` forwards to
``torch._C._VariableFunctions``, and the names are looked up on it at call
time. So an attribute set on ``torch._VF`` is what the modules call, and
deleting it again restores the forwarding: nothing in ``nn`` is touched.

The half policy then casts the input, the hidden state and the flat
weights (the latter through the weight cache, as they are fp32 leaves), so
the output is half and the fp32 weights get fp32 gradients.
"""

from __future__ import annotations

import types

import torch
import torch.nn.modules.rnn as _rnn_module

from amp_patch.patching.lists import VF, CastLists

__all__ = ["targets"]


def targets() -> list[tuple[types.ModuleType, CastLists]]:
    """The namespaces the recurrent modules call, with their cast lists.

    Raises:
        RuntimeError: if ``torch.nn.modules.rnn`` no longer reaches its kernels
            through ``torch._VF`` (a torch version this code does not know).
    """
    vf = getattr(_rnn_module, "_VF", None)
    if vf is not torch._VF:
        raise RuntimeError(
            "amp_patch: torch.nn.modules.rnn no longer calls its kernels through torch._VF; "
            "O1 cannot cast nn.RNN/GRU/LSTM on this torch version"
        )
    return [(vf, VF)]
