"""Random small networks built from patched ops run under O1 without dtype errors,
within bf16 tolerance of fp32."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings, strategies as st

import amp_patch

WIDTH = 6

# Each layer maps (batch, WIDTH) -> (batch, WIDTH), mixing the policies: half ops,
# fp32 ops, promote ops and sequence promote, so dtypes meet across them.
LAYERS = {
    "linear": lambda x, w: F.linear(x, w["w"], w["b"]),
    "matmul": lambda x, w: x @ w["w"].t(),
    "addmm": lambda x, w: torch.addmm(w["b"], x, w["w"].t()),
    "layer_norm": lambda x, w: F.layer_norm(x, (WIDTH,)),
    "softmax": lambda x, w: F.softmax(x, -1) * WIDTH,
    "gelu": lambda x, w: F.gelu(x),
    "exp_scaled": lambda x, w: torch.exp(x * 0.1),
    "residual_add": lambda x, w: x + F.linear(x, w["w"]),
    "mul_param": lambda x, w: x * w["b"],
    "cat_split": lambda x, w: torch.cat([x[:, :3], F.linear(x, w["w"])[:, 3:]], dim=1),
    "stack_mean": lambda x, w: torch.stack([x, F.linear(x, w["w"])]).mean(0),
    "sum_keep": lambda x, w: x - x.sum(-1, keepdim=True) / WIDTH,
    "conv1d": lambda x, w: F.conv1d(x.unsqueeze(1), w["k"], padding=1).squeeze(1),
}


def _params(n, seed):
    gen = torch.Generator().manual_seed(seed)
    return [{"w": torch.nn.Parameter(torch.randn(WIDTH, WIDTH, generator=gen) / WIDTH ** 0.5),
             "b": torch.nn.Parameter(torch.randn(WIDTH, generator=gen) * 0.1),
             "k": torch.nn.Parameter(torch.randn(1, 1, 3, generator=gen) * 0.5)}
            for _ in range(n)]


def _run(layers, params, x):
    for name, w in zip(layers, params):
        x = LAYERS[name](x, w)
    return F.mse_loss(x.float(), torch.zeros_like(x, dtype=torch.float32))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(layers=st.lists(st.sampled_from(sorted(LAYERS)), min_size=1, max_size=6),
       seed=st.integers(0, 2**16))
def test_random_networks(layers, seed):
    params = _params(len(layers), seed)
    x = torch.randn(4, WIDTH, generator=torch.Generator().manual_seed(seed + 1)).requires_grad_()
    reference = _run(layers, params, x)
    amp_patch.initialize(torch.nn.Linear(1, 1), opt_level="O1", half_dtype=torch.bfloat16,
                         verbosity=0)
    try:
        loss = _run(layers, params, x)
        loss.backward()
    finally:
        amp_patch.deinitialize()
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss, reference, rtol=0.1, atol=0.05)
    for p in [x] + [t for w in params for t in w.values()]:
        assert p.grad is None or (p.grad.dtype == torch.float32 and torch.isfinite(p.grad).all())
