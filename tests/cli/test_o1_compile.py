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
from amp_patch.cli.compare import models

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


@pytest.mark.slow
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


_FIRST_IMPORT_IN_SESSION = r"""
import sys
import torch
import amp_patch
nn = torch.nn
# No optimizer: building one would import torch._dynamo before the session.
model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(64, 2))
amp_patch.initialize(model, opt_level="O1", half_dtype=torch.bfloat16, verbosity=0,
                     cpu_half_compute=sys.argv[1])
assert "torch._dynamo" not in sys.modules
import torch._dynamo  # first imported inside the session, as torch.compile would
explained = torch._dynamo.explain(lambda x: model(x).float().sum())(torch.randn(2, 3, 6, 6))
amp_patch.deinitialize()
from torch._dynamo import trace_rules
print(explained.graph_count, explained.graph_break_count,
      torch.conv2d in trace_rules.get_torch_obj_rule_map())
"""


# "emulate": the CPU half emulation's wrappers sit under O1's (patched first).
@pytest.mark.slow
@pytest.mark.parametrize("cpu_half", ["native", "emulate"])
def test_dynamo_first_imported_inside_a_session(cpu_half):
    import subprocess
    import sys
    done = subprocess.run([sys.executable, "-c", _FIRST_IMPORT_IN_SESSION, cpu_half],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["1", "0", "True"]


@pytest.mark.slow
@pytest.mark.parametrize("cpu_half", ["native", "emulate"])
def test_o1_over_cpu_half_emulation_traces_in_one_graph(cpu_half):
    w = _workload("convnet")
    model, _ = amp_patch.initialize(w.model, w.optimizer, opt_level="O1", half_dtype=HALF,
                                    verbosity=0, cpu_half_compute=cpu_half)
    batch = w.batch_fn(0)
    eager = w.loss_fn(model, batch)
    explained = torch._dynamo.explain(lambda b: w.loss_fn(model, b))(batch)
    assert explained.graph_break_count == 0, explained.break_reasons
    compiled = torch.compile(lambda b: w.loss_fn(model, b), backend="aot_eager")(batch)
    torch.testing.assert_close(compiled, eager)


def test_rules_rebuilt_inside_a_session_are_cleaned(wrapper_path):
    from torch._dynamo import trace_rules
    w = _workload("convnet")
    # torch's own, taken before the session: on a host without native bf16 convolutions the O1
    # wrapper's __wrapped__ is the CPU half emulation's wrapper, not torch's function.
    original_conv = torch.conv2d
    model, _ = amp_patch.initialize(w.model, w.optimizer, opt_level="O1", half_dtype=HALF,
                                    verbosity=0)
    trace_rules.clear_lru_cache()  # dynamo rebuilds its maps now, from the patched torch
    assert original_conv not in trace_rules.get_torch_obj_rule_map()
    amp_patch.deinitialize()
    assert original_conv in trace_rules.get_torch_obj_rule_map()
    w = _workload("convnet")
    model, _ = amp_patch.initialize(w.model, w.optimizer, opt_level="O1", half_dtype=HALF,
                                    verbosity=0)
    explained = torch._dynamo.explain(lambda b: w.loss_fn(model, b))(w.batch_fn(0))
    assert explained.graph_break_count == 0, explained.break_reasons
