"""torch.compile under amp_patch: no graph breaks, O1's casting decisions kept.

Under compilation the O1 wrappers lower to plain casts (no weight cache), so
dynamo traces the built-in models into one graph at every level. The models
are tiny; ``aot_eager`` runs AOTAutograd (where the wrappers see fake
tensors) without inductor's C++ build.
"""

from __future__ import annotations

import pytest
import torch

import amp_patch
from amp_patch import session as amp_session
from amp_patch.cli import models

from _o1_samples import wrapper_path  # noqa: F401  (fixture: both wrapper paths)

HALF = torch.bfloat16


def _workload(name):
    if name == "lm":
        return models.lm(config=models.LMConfig(vocab=64, d_model=32, n_layers=2, n_heads=2,
                                                seq_len=8, batch_size=2))
    return models.convnet(batch_size=2, image_size=8, channels=4)


def _forward(name, model, batch):
    return model(batch[:, :-1]) if name == "lm" else model(batch[0])


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _explain(name, level):
    w = _workload(name)
    model, _ = amp_patch.initialize(w.model, w.optimizer, opt_level=level, half_dtype=HALF,
                                    verbosity=0)
    batch = w.batch_fn(0)
    # An eager step first fills O1's weight cache: its checks must not reach the graph.
    w.loss_fn(model, batch).backward()
    return torch._dynamo.explain(lambda b: w.loss_fn(model, b))(batch)


@pytest.mark.parametrize("name", ["lm", "convnet"])
def test_o1_traces_in_one_graph(wrapper_path, name):
    explained = _explain(name, "O1")
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons


@pytest.mark.parametrize("level", ["O2", "O3"])
@pytest.mark.parametrize("name", ["lm", "convnet"])
def test_o2_o3_trace_in_one_graph(name, level):
    explained = _explain(name, level)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons


@pytest.mark.parametrize("name", ["lm", "convnet"])
def test_compiled_o1_keeps_eager_dtypes_and_grads(wrapper_path, name):
    w = _workload(name)
    model, _ = amp_patch.initialize(w.model, w.optimizer, opt_level="O1", half_dtype=HALF,
                                    verbosity=0)
    batch = w.batch_fn(0)
    # The dtype of every module output; dynamo traces the hooks into the graph.
    seen = []
    for m in model.modules():
        if m is not model:
            m.register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    eager = _forward(name, model, batch)
    eager_dtypes, seen[:] = list(seen), []
    eager.float().sum().backward()
    eager_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    cache = amp_session.current().casts.cache
    cache.clear()
    out = _forward(name, torch.compile(model, backend="aot_eager"), batch)
    assert len(cache) == 0  # the compiled graph casts; it leaves the cache alone
    assert seen == eager_dtypes
    assert HALF in seen and (name == "convnet" or torch.float32 in seen)
    assert out.dtype == eager.dtype == HALF
    torch.testing.assert_close(out, eager, rtol=0.02, atol=0.02)
    out.float().sum().backward()
    for p, g in zip(model.parameters(), eager_grads):
        assert p.grad.dtype == torch.float32
        torch.testing.assert_close(p.grad, g, rtol=0.05, atol=0.02)


def test_compiled_o1_follows_disable_casts(wrapper_path):
    amp_patch.initialize(torch.nn.Linear(1, 1), opt_level="O1", half_dtype=HALF, verbosity=0)
    lin = torch.nn.Linear(4, 4)
    fn = torch.compile(lambda x: torch.nn.functional.linear(x, lin.weight).softmax(-1),
                       backend="aot_eager")
    x = torch.randn(2, 4)
    assert fn(x).dtype == torch.float32  # linear in bf16, softmax back to fp32
    assert fn(x.to(HALF)).dtype == torch.float32
    with amp_patch.disable_casts():
        assert fn(x).dtype == torch.float32
        with pytest.raises(RuntimeError):
            fn(x.to(HALF))  # no cast: bf16 input with an fp32 weight


def test_eval_forward_compiles_without_breaks(wrapper_path):
    w = _workload("convnet")
    model, _ = amp_patch.initialize(w.model, w.optimizer, opt_level="O1", half_dtype=HALF,
                                    verbosity=0)
    model.eval()
    with torch.no_grad():
        model(w.batch_fn(0)[0])
        explained = torch._dynamo.explain(model)(w.batch_fn(1)[0])
    assert explained.graph_break_count == 0, explained.break_reasons
