"""Small models, seeded batches and snapshots shared by the training-loop tests."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import amp_patch as amp


def mlp(seed: int = 0, d_in: int = 8, hidden: int = 16, d_out: int = 4) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(d_in, hidden), nn.ReLU(), nn.Linear(hidden, d_out))


def convnet(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 3),
    )


class TinyLM(nn.Module):
    """A causal transformer language model small enough for unit tests (torch's own layers).

    The library's tests use it where a model with attention, layer norms and an
    embedding matters; the CLI's workloads (amp_patch.cli.compare.models) stay the CLI's.
    """

    def __init__(self, vocab: int = 64, d_model: int = 32, n_heads: int = 4, n_layers: int = 2,
                 seq_len: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model)
        self.pos = nn.Embedding(seq_len, d_model)
        layer = nn.TransformerEncoderLayer(d_model, n_heads, 4 * d_model, dropout=0.0,
                                           activation="gelu", batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, n_layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab, bias=False)
        # A bool mask: it suits every dtype the attention may run in.
        self.register_buffer("future", torch.ones(seq_len, seq_len, dtype=torch.bool).triu(1),
                             persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        t = tokens.shape[1]
        x = self.embed(tokens) + self.pos(torch.arange(t, device=tokens.device))
        x = self.blocks(x, mask=self.future[:t, :t], is_causal=True)
        return self.head(self.norm(x))


def tiny_lm(seed: int = 0, vocab: int = 64, seq_len: int = 16, batch: int = 4):
    """``(model, batch_fn, loss_fn)``: a :class:`TinyLM` and seeded token batches."""
    torch.manual_seed(seed)
    model = TinyLM(vocab=vocab, seq_len=seq_len)

    def batch_fn(step: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(1000 * seed + step)
        return torch.randint(vocab, (batch, seq_len + 1), generator=g)

    def loss_fn(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
        logits = model(tokens[:, :-1])
        return F.cross_entropy(logits.reshape(-1, vocab).float(), tokens[:, 1:].reshape(-1))

    return model, batch_fn, loss_fn


def mlp_batch(step: int, batch: int = 16, d_in: int = 8, d_out: int = 4):
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(batch, d_in, generator=g)
    teacher = torch.Generator().manual_seed(7)
    w = torch.randn(d_in, d_out, generator=teacher)
    return x, (x @ w).argmax(1)


def conv_batch(step: int, batch: int = 8):
    g = torch.Generator().manual_seed(2000 + step)
    x = torch.randn(batch, 3, 6, 6, generator=g)
    return x, (x.mean((1, 2, 3)) > 0).long() + (x[:, 0].mean((1, 2)) > 0).long()


def xent(out, y):
    return F.cross_entropy(out.float(), y)


def snapshot(models, optimizers) -> list[torch.Tensor]:
    """Clones of every param, buffer, stepped tensor (masters) and optimizer-state tensor."""
    out = []
    for m in models:
        out += [t.detach().clone() for t in m.state_dict().values()]
    for opt in optimizers:
        for p in amp.master_params(opt):
            out.append(p.detach().clone())
            for v in opt.state.get(p, {}).values():
                if isinstance(v, torch.Tensor):
                    out.append(v.detach().clone())
    return out


def leaves(obj) -> list:
    """The tensors and plain values in nested dicts (in key order), lists and tuples, in order."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for k in sorted(obj, key=str) for t in leaves(obj[k])]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in leaves(v)]
    return [obj]


def assert_same_leaves(a, b) -> None:
    """``a`` and ``b`` hold the same :func:`leaves`: tensors of one dtype and the same bits, and
    equal plain values."""
    la, lb = leaves(a), leaves(b)
    assert len(la) == len(lb)
    for x, y in zip(la, lb):
        if isinstance(x, torch.Tensor):
            assert isinstance(y, torch.Tensor) and x.dtype == y.dtype and torch.equal(x, y)
        else:
            assert x == y


def assert_identical(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    assert len(a) == len(b)
    for i, (x, y) in enumerate(zip(a, b)):
        assert x.dtype == y.dtype and x.shape == y.shape, i
        assert torch.equal(x, y) or (x.isnan() == y.isnan()).all() and torch.equal(
            x.nan_to_num(0.0), y.nan_to_num(0.0)), f"tensor {i} differs"


def train(model: nn.Module, optimizer, steps: int, batch_fn: Callable = mlp_batch,
          start: int = 0, skip_steps: frozenset = frozenset(), on_backward=None,
          record: Callable[[torch.Tensor], float] = torch.Tensor.item) -> list[float]:
    """The plain amp loop; returns the losses, each as ``record`` makes a number of it.
    ``skip_steps`` batches are left out entirely."""
    losses = []
    for step in range(start, start + steps):
        if step in skip_steps:
            continue
        x, y = batch_fn(step)
        loss = xent(model(x), y)
        with amp.scale_loss(loss, optimizer) as scaled:
            scaled.backward()
            if on_backward is not None:
                on_backward(step)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(record(loss))
    return losses


@contextlib.contextmanager
def single_thread():
    """One intra-op thread: for many tiny ops, several times faster than two on a loaded machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@contextlib.contextmanager
def count_host_syncs():
    """Counts every Tensor -> Python conversion (item, bool, float, int, tolist) inside."""
    counts = {"n": 0}
    names = ("item", "__bool__", "__float__", "__int__", "__index__", "tolist")
    originals = {n: getattr(torch.Tensor, n) for n in names}
    # Names inherited from TensorBase are deleted again, not shadowed, on the way out.
    owned = {n for n in names if n in vars(torch.Tensor)}

    def make(n):
        orig = originals[n]

        def counted(self, *a, **k):
            counts["n"] += 1
            return orig(self, *a, **k)
        return counted

    try:
        for n in names:
            setattr(torch.Tensor, n, make(n))
        yield counts
    finally:
        for n, orig in originals.items():
            if n in owned:
                setattr(torch.Tensor, n, orig)
            else:
                delattr(torch.Tensor, n)


class _DeviceReads(TorchDispatchMode):
    """Counts the aten ops that hand a device value to the host: ``_local_scalar_dense``
    (``item``, ``bool``, ``float``) and copies from an accelerator to the CPU."""

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.name()
        if name == "aten::_local_scalar_dense":
            self.reads.append(name)
        elif name in ("aten::_to_copy", "aten::copy_") and args:
            src = args[1] if name == "aten::copy_" else args[0]
            dst = kwargs.get("device") if name == "aten::_to_copy" else args[0].device
            if isinstance(src, torch.Tensor) and src.device.type != "cpu" and (
                    dst is not None and torch.device(dst).type == "cpu"):
                self.reads.append(f"{name} to cpu")
        return func(*args, **kwargs)


@contextlib.contextmanager
def count_device_reads():
    """Counts host reads of device values inside, at the dispatcher and at Python's conversions.

    Two counters, because neither sees everything: a ``TorchDispatchMode`` sees
    ``aten::_local_scalar_dense`` and device-to-host copies (what ``item`` and
    ``bool`` of a tensor run), and a wrapper of ``Tensor.tolist`` sees that
    method, which reads a CPU tensor's memory without dispatching. Yields a dict
    whose ``"n"`` is the sum and ``"ops"`` the names.
    """
    mode = _DeviceReads()
    counts: dict = {"n": 0, "ops": mode.reads}
    tolist = torch.Tensor.tolist

    def counted(self, *args, **kwargs):
        mode.reads.append("Tensor.tolist")
        return tolist(self, *args, **kwargs)

    torch.Tensor.tolist = counted  # type: ignore[method-assign]
    try:
        with mode:
            yield counts
    finally:
        del torch.Tensor.tolist  # inherited from TensorBase: deleted again, not shadowed
        counts["n"] = len(mode.reads)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (for a process group's rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(code: str, args: Callable[[int], list[str]], world: int = 2,
              timeout: float = 300) -> list[int]:
    """Run ``python -c code *args(rank)`` as ``world`` ranks of one rendezvous on 127.0.0.1, one
    thread each; return their exit codes (a rank still running at ``timeout`` is killed)."""
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
               WORLD_SIZE=str(world), OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, "-c", code, *args(r)], env=dict(env, RANK=str(r)))
             for r in range(world)]
    try:
        return [p.wait(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
