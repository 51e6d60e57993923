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

Before it reaches ``_VF``, ``RNNBase.check_input`` rejects an input whose
dtype differs from the weights' unless torch's autocast is on. Under O1 the
kernel call is cast, so :func:`allow_half_inputs` patches that one method to
run torch's remaining checks (dimensions, sizes) on a stand-in of the
weights' dtype: a half input then runs as it did under Apex.
"""

from __future__ import annotations

import types

import torch
import torch.nn.modules.rnn as _rnn_module

from amp_patch.settings.dtypes import CASTABLE_DTYPES

__all__ = ["vf_module", "allow_half_inputs"]


def vf_module() -> types.ModuleType:
    """The namespace the recurrent modules call their kernels through (``torch._VF``).

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
    return vf


def allow_half_inputs(patcher, state) -> None:
    """Patch ``RNNBase.check_input`` so that O1 lets an input of another castable dtype through.

    While ``state.enabled``, an fp32, fp16 or bf16 input to a module whose
    weights are of another of these dtypes passes the dtype check (the
    patched ``_VF`` kernels cast it); every other check of torch's runs
    unchanged. With casts disabled the original check runs as it is.

    Args:
        patcher (Patcher): records the patch, so that undo restores the original.
        state (CastState): the session's casting state, read on every call.
    """
    def make(original):
        def check_input(self, input, batch_sizes):
            weight = self._flat_weights[0] if self._flat_weights else None
            if (state.enabled and weight is not None and input.dtype is not weight.dtype
                    and input.dtype in CASTABLE_DTYPES and weight.dtype in CASTABLE_DTYPES):
                # Only dtype, dim() and size(-1) are read: a meta tensor allocates nothing.
                input = torch.empty(input.shape, dtype=weight.dtype, device="meta")
            return original(self, input, batch_sizes)
        check_input.__wrapped__ = original
        return check_input

    patcher.patch(_rnn_module.RNNBase, "check_input", make)
