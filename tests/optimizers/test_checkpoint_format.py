"""The fused optimizers' checkpoints keep their format: keys, dtypes and contents, bit for bit.

``data/fused_state_dicts.pt`` holds the state dicts (and params) that each case
below gave after three steps when it was written; the cases run again here
must give the same, and a fresh optimizer must load them and step on as the
one that saved them. Regenerate it only for a deliberate format change:
``python tests/optimizers/test_checkpoint_format.py`` writes it.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

from amp_patch.optim.fused import FusedAdagrad, FusedAdam, FusedLAMB, FusedMixedPrecisionLamb
from amp_patch.optim.fused import FusedNovoGrad, FusedSGD

DATA = Path(__file__).with_name("data") / "fused_state_dicts.pt"
#: The CPU kernels the data was written with (torch.backends.cpu.get_cpu_capability()).
WRITTEN_WITH = "AVX512"
#: Cases whose steps reduce (LAMB's norms): the vector width of the running kernels sets the
#: summation order, so under other kernels their values agree to rounding, not to the bit.
REDUCING = {"lamb_bf16", "lamb_mixed"}


def _exact(name: str) -> bool:
    return name not in REDUCING or torch.backends.cpu.get_cpu_capability() == WRITTEN_WITH


def _params(dtype: torch.dtype) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(64, 64, generator=g).to(dtype)),
            torch.nn.Parameter(torch.randn(64, generator=g).to(dtype))]


def _lean(opt: Any, fmt: str, stochastic: bool = False) -> Any:
    opt.set_state_format(fmt, stochastic_rounding=stochastic)
    return opt


#: name -> (param dtype, optimizer over those params)
CASES: dict[str, tuple[torch.dtype, Callable[[list], Any]]] = {
    "adam_fp32": (torch.float32, lambda ps: FusedAdam(ps, lr=1e-2, weight_decay=0.01)),
    "adam_int8": (torch.float32, lambda ps: _lean(FusedAdam(ps, lr=1e-2), "int8")),
    "adam_fp8_bf16_params": (torch.bfloat16,
                             lambda ps: _lean(FusedAdam(ps, lr=1e-2), "fp8", stochastic=True)),
    "adam_masters": (torch.bfloat16, lambda ps: FusedAdam(ps, lr=1e-2, master_weights=True)),
    "sgd_int8": (torch.float32,
                 lambda ps: _lean(FusedSGD(ps, lr=0.1, momentum=0.9), "int8")),
    "sgd_fp32": (torch.float16, lambda ps: FusedSGD(ps, lr=0.1, momentum=0.9, nesterov=True)),
    "lamb_bf16": (torch.float32, lambda ps: _lean(FusedLAMB(ps, lr=1e-2), "bf16")),
    "lamb_mixed": (torch.bfloat16, lambda ps: FusedMixedPrecisionLamb(
        ps, lr=1e-2, reduced_precision_dtype=torch.bfloat16)),
    "novograd": (torch.float32, lambda ps: FusedNovoGrad(ps, lr=1e-2)),
    "adagrad": (torch.float32, lambda ps: FusedAdagrad(ps, lr=1e-2)),
}


def _grads(params: list[torch.Tensor], step: int) -> None:
    g = torch.Generator().manual_seed(100 + step)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g).to(p.dtype)


def run(name: str, steps: int = 3) -> tuple[list[torch.Tensor], Any]:
    """The params and optimizer of case ``name`` after ``steps`` steps."""
    dtype, make = CASES[name]
    params = _params(dtype)
    opt = make(params)
    for step in range(steps):
        _grads(params, step)
        opt.step()
    return params, opt


def _same(a: Any, b: Any, where: str, exact: bool = True) -> None:
    if isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b), (where, list(a), list(b))
        for key in a:
            _same(a[key], b[key], f"{where}.{key}", exact)
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{where}[{i}]", exact)
    elif isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), where
        assert (a.dtype, a.shape) == (b.dtype, b.shape), (where, a.dtype, b.dtype)
        if not exact and a.is_floating_point():
            # A few roundings of bf16 apart (see REDUCING): both such cases keep bf16 state or
            # params, and a state element rounded the other way moves the fp32 values with it.
            eps = torch.finfo(torch.bfloat16).eps
            torch.testing.assert_close(a.float(), b.float(), rtol=4 * eps, atol=4 * eps,
                                       msg=f"{where} differs")
            return
        assert torch.equal(a.view(torch.uint8) if a.dim() else a, b.view(torch.uint8)
                           if b.dim() else b), f"{where} differs"
    else:
        assert a == b, (where, a, b)


@pytest.fixture(scope="module")
def saved() -> dict[str, Any]:
    return torch.load(DATA, weights_only=True)


@pytest.mark.parametrize("name", list(CASES))
def test_state_dict_is_as_saved(name, saved):
    """The same steps give the same state dict: keys, dtypes and every bit."""
    params, opt = run(name)
    _same(opt.state_dict(), saved[name]["state_dict"], name, _exact(name))
    _same([p.detach() for p in params], saved[name]["params"], f"{name} params", _exact(name))


@pytest.mark.parametrize("name", list(CASES))
def test_saved_state_dict_loads_and_steps_on(name, saved):
    """A fresh optimizer loads the saved checkpoint and steps as the one that saved it."""
    params, opt = run(name, steps=4)
    dtype, make = CASES[name]
    loaded = [torch.nn.Parameter(p.clone()) for p in saved[name]["params"]]
    fresh = make(loaded)
    fresh.load_state_dict(saved[name]["state_dict"])
    _grads(loaded, 3)
    fresh.step()
    _same(fresh.state_dict(), opt.state_dict(), name, _exact(name))
    _same([p.detach() for p in loaded], [p.detach() for p in params], f"{name} params",
          _exact(name))


if __name__ == "__main__":
    out = {}
    for case in CASES:
        ps, o = run(case)
        out[case] = {"state_dict": o.state_dict(), "params": [p.detach().clone() for p in ps]}
    DATA.parent.mkdir(exist_ok=True)
    torch.save(out, DATA)
    print(f"wrote {DATA} with {len(out)} cases", file=sys.stderr)
