"""Built-in models with seeded synthetic data, for ``amp-patch compare`` and the benchmarks.

Every model is exposed as a *factory* that returns a :class:`Workload`, a
named tuple ``(model, optimizer, batch_fn, loss_fn)``:

- ``model``: a :class:`torch.nn.Module` on the requested device, in fp32;
- ``optimizer``: a :class:`torch.optim.Optimizer` over its parameters;
- ``batch_fn(step)``: the batch of training step ``step``; the same step gives
  the same batch in every process (it is drawn from a generator seeded by
  ``seed`` and ``step``), so that runs under different opt levels see the
  same data;
- ``loss_fn(model, batch)``: runs the model on the batch and returns the
  scalar loss.

A user's model for ``amp-patch compare --model pkg.module:factory`` follows
the same contract. The factory may accept any of the keyword arguments
``device``, ``batch_size`` and ``seed``; those it accepts are passed (see
:func:`build`).

The data are synthetic but learnable, so that loss curves fall and differences
between precisions show: the language model reads sequences from a fixed
sparse bigram chain, the MLP and the conv net classify inputs made by a fixed
random teacher.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from amp_patch.optim.fused import FusedAdam, FusedSGD

__all__ = [
    "Workload",
    "LMConfig",
    "BENCH_LM",
    "COMPARE_LM",
    "TransformerLM",
    "causal_self_attention",
    "lm",
    "mlp",
    "convnet",
    "BUILTIN",
    "resolve",
    "build",
    "default_batch_size",
    "parameter_count",
    "fused_variant",
]


class Workload(NamedTuple):
    """What a factory returns: ``(model, optimizer, batch_fn, loss_fn)``."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    batch_fn: Callable[[int], Any]
    loss_fn: Callable[[nn.Module, Any], torch.Tensor]


def _generator(seed: int, step: int) -> torch.Generator:
    # One independent stream per (seed, step): batch k is the same whichever steps ran before it.
    g = torch.Generator()
    g.manual_seed((seed * 1_000_003 + step) & 0x7FFF_FFFF_FFFF_FFFF)
    return g


# --------------------------------------------------------------------------- language model


@dataclass(frozen=True)
class LMConfig:
    """Size of the GPT-style language model.

    Args:
        vocab (int): vocabulary size.
        d_model (int): width of the residual stream.
        n_layers (int): number of pre-LN transformer blocks.
        n_heads (int): attention heads per block.
        seq_len (int): tokens per sequence.
        batch_size (int): sequences per batch.
        mlp_ratio (int): hidden width of the MLP over ``d_model``.
        lr (float): AdamW learning rate.
        branching (int): successors each token may have in the synthetic
            bigram chain; the best reachable loss is about ``log(branching)``.
        fused (bool): build AdamW with ``fused=True`` (torch's one-kernel
            implementation) instead of torch's default for the device.
        fused_adam (bool): build amp_patch's :class:`~amp_patch.optim.fused.FusedAdam`
            (AdamW mode, the same hyper-parameters) instead of torch's AdamW;
            under O2 it takes the one-pass step.
    """

    vocab: int = 8192
    d_model: int = 512
    n_layers: int = 4
    n_heads: int = 8
    seq_len: int = 128
    batch_size: int = 8
    mlp_ratio: int = 4
    lr: float = 1e-3
    branching: int = 4
    fused: bool = False
    fused_adam: bool = False


#: The benchmark's default LM (E1 and E2 in docs/design.md, "Performance targets"): about
#: 21 M parameters.
BENCH_LM = LMConfig()

#: The default of ``amp-patch compare``: small enough that five levels train in
#: about a minute on two CPU cores, large enough that matmuls dominate the step,
#: and a vocabulary small enough that the loss falls visibly within 100 steps.
COMPARE_LM = LMConfig(vocab=512, d_model=256, n_layers=2, n_heads=4, seq_len=128, batch_size=8,
                      lr=3e-3)


def causal_self_attention(qkv: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Causal multi-head attention over a fused projection ``qkv`` of shape (b, t, 3c).

    Splits it into q, k and v, runs ``F.scaled_dot_product_attention`` per
    head and returns the heads joined again, (b, t, c), for the output projection.

    Example::

        >>> causal_self_attention(torch.randn(2, 5, 3 * 8), n_heads=2).shape
        torch.Size([2, 5, 8])
    """
    b, t, c3 = qkv.shape
    c = c3 // 3
    q, k, v = qkv.split(c, dim=-1)
    # (b, t, c) -> (b, heads, t, c/heads), the layout SDPA expects.
    q, k, v = (z.view(b, t, n_heads, c // n_heads).transpose(1, 2) for z in (q, k, v))
    att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return att.transpose(1, 2).reshape(b, t, c)


class _Block(nn.Module):
    def __init__(self, d_model: int, n_heads: int, mlp_ratio: int) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.ln1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.ln2 = nn.LayerNorm(d_model)
        self.fc1 = nn.Linear(d_model, mlp_ratio * d_model)
        self.fc2 = nn.Linear(mlp_ratio * d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.proj(causal_self_attention(self.qkv(self.ln1(x)), self.n_heads))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class TransformerLM(nn.Module):
    """A small GPT-style causal language model: pre-LN blocks of SDPA attention and a GELU MLP.

    The output head is not tied to the embedding, so that the parameter count
    matches the benchmark's description (about 21 M for :data:`BENCH_LM`).

    Args:
        config (LMConfig): the sizes.
    """

    def __init__(self, config: LMConfig) -> None:
        super().__init__()
        if config.d_model % config.n_heads:
            raise ValueError(f"d_model ({config.d_model}) must be divisible by n_heads "
                             f"({config.n_heads})")
        self.config = config
        self.tok = nn.Embedding(config.vocab, config.d_model)
        self.pos = nn.Embedding(config.seq_len, config.d_model)
        self.blocks = nn.ModuleList(
            _Block(config.d_model, config.n_heads, config.mlp_ratio) for _ in range(config.n_layers)
        )
        self.ln_f = nn.LayerNorm(config.d_model)
        self.head = nn.Linear(config.d_model, config.vocab, bias=False)
        for name, p in self.named_parameters():
            if p.dim() >= 2:
                nn.init.normal_(p, std=0.02)
            elif name.endswith("bias"):
                nn.init.zeros_(p)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits of shape ``(batch, seq, vocab)`` for int64 ``tokens`` of shape
        ``(batch, seq)``."""
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.tok(tokens) + self.pos(positions)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def lm(
    device: str | torch.device = "cpu",
    batch_size: int | None = None,
    seed: int = 0,
    config: LMConfig = COMPARE_LM,
    **overrides: Any,
) -> Workload:
    """A GPT-style language model on token sequences from a fixed sparse bigram chain.

    Each token has ``config.branching`` possible successors, drawn once from
    ``seed``, so the loss falls from about ``log(vocab)`` towards
    ``log(branching)`` as the model learns the chain.

    Args:
        device (str or torch.device, optional): where the model and batches live.
            Default: ``"cpu"``.
        batch_size (int, optional): overrides ``config.batch_size``.
        seed (int, optional): seeds the weights and the data. Default: 0.
        config (LMConfig, optional): the sizes. Default: :data:`COMPARE_LM`;
            the benchmarks use :data:`BENCH_LM`.
        **overrides: fields of :class:`LMConfig` to replace, e.g. ``d_model=384``.

    Returns:
        Workload: ``(model, optimizer, batch_fn, loss_fn)``; the optimizer is AdamW
        (torch's, or amp_patch's FusedAdam with ``fused_adam``).

    Example::

        >>> model, opt, batch_fn, loss_fn = lm(config=BENCH_LM)
        >>> loss = loss_fn(model, batch_fn(0))
    """
    cfg = dataclasses.replace(config, **overrides)
    if batch_size is not None:
        cfg = dataclasses.replace(cfg, batch_size=batch_size)
    device = torch.device(device)
    torch.manual_seed(seed)
    model = TransformerLM(cfg).to(device)
    if cfg.fused and cfg.fused_adam:
        raise ValueError("LMConfig: choose one of fused (torch's AdamW) and fused_adam "
                         "(amp_patch's FusedAdam)")
    if cfg.fused_adam:
        optimizer: torch.optim.Optimizer = FusedAdam(model.parameters(), lr=cfg.lr,
                                                     weight_decay=0.01)
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.01,
                                      fused=True if cfg.fused else None)
    successors = torch.randint(cfg.vocab, (cfg.vocab, cfg.branching),
                               generator=_generator(seed, -1))

    def batch_fn(step: int) -> torch.Tensor:
        g = _generator(seed, step)
        tokens = torch.empty(cfg.batch_size, cfg.seq_len + 1, dtype=torch.long)
        tokens[:, 0] = torch.randint(cfg.vocab, (cfg.batch_size,), generator=g)
        choice = torch.randint(cfg.branching, (cfg.batch_size, cfg.seq_len), generator=g)
        for t in range(cfg.seq_len):
            tokens[:, t + 1] = successors[tokens[:, t], choice[:, t]]
        return tokens.to(device)

    def loss_fn(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
        logits = model(tokens[:, :-1])
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(),
                               tokens[:, 1:].reshape(-1))

    return Workload(model, optimizer, batch_fn, loss_fn)


# --------------------------------------------------------------------------- MLP


def mlp(
    device: str | torch.device = "cpu",
    batch_size: int | None = None,
    seed: int = 0,
    in_features: int = 256,
    hidden: int = 1024,
    layers: int = 4,
    classes: int = 16,
    lr: float = 1e-3,
    fused_adam: bool = False,
) -> Workload:
    """An MLP of ``layers`` Linear layers with GELU, classifying the output of a fixed random
    teacher.

    Args:
        device (str or torch.device, optional): where the model and batches live.
            Default: ``"cpu"``.
        batch_size (int, optional): samples per batch. Default: 256.
        seed (int, optional): seeds the weights, the teacher and the data. Default: 0.
        in_features (int, optional): input width. Default: 256.
        hidden (int, optional): hidden width. Default: 1024.
        layers (int, optional): number of Linear layers (at least 2). Default: 4.
        classes (int, optional): number of classes. Default: 16.
        lr (float, optional): Adam learning rate. Default: 1e-3.
        fused_adam (bool, optional): build amp_patch's
            :class:`~amp_patch.optim.fused.FusedAdam` (Adam mode, the same
            hyper-parameters) instead of torch's Adam. Default: False.

    Returns:
        Workload: ``(model, optimizer, batch_fn, loss_fn)``; the optimizer is Adam.
    """
    if layers < 2:
        raise ValueError(f"layers must be at least 2, got {layers}")
    batch_size = batch_size or _BATCH_SIZES["mlp"]
    device = torch.device(device)
    torch.manual_seed(seed)
    widths = [in_features] + [hidden] * (layers - 1) + [classes]
    mods: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(widths[:-1], widths[1:])):
        mods.append(nn.Linear(a, b))
        if i < layers - 1:
            mods.append(nn.GELU())
    model = nn.Sequential(*mods).to(device)
    optimizer: torch.optim.Optimizer = (
        FusedAdam(model.parameters(), lr=lr, adam_w_mode=False) if fused_adam
        else torch.optim.Adam(model.parameters(), lr=lr))
    teacher = torch.randn(in_features, classes, generator=_generator(seed, -1))

    def batch_fn(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(batch_size, in_features, generator=_generator(seed, step))
        return x.to(device), (x @ teacher).argmax(dim=1).to(device)

    def loss_fn(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(model(x).float(), y)

    return Workload(model, optimizer, batch_fn, loss_fn)


# --------------------------------------------------------------------------- conv net


def convnet(
    device: str | torch.device = "cpu",
    batch_size: int | None = None,
    seed: int = 0,
    image_size: int = 32,
    channels: int = 32,
    classes: int = 10,
    lr: float = 0.05,
    fused_sgd: bool = False,
) -> Workload:
    """A small conv net with BatchNorm (three conv-BN-ReLU stages), on noisy class templates.

    Each class has a fixed random 3-channel template; an image is its class's
    template plus Gaussian noise. BatchNorm is what ``keep_batchnorm_fp32``
    (O2) is about, so this model shows that difference.

    Args:
        device (str or torch.device, optional): where the model and batches live.
            Default: ``"cpu"``.
        batch_size (int, optional): images per batch. Default: 64.
        seed (int, optional): seeds the weights, the templates and the data. Default: 0.
        image_size (int, optional): height and width. Default: 32.
        channels (int, optional): channels of the first stage (doubled per stage). Default: 32.
        classes (int, optional): number of classes. Default: 10.
        lr (float, optional): SGD (momentum 0.9) learning rate. Default: 0.05.
        fused_sgd (bool, optional): build amp_patch's
            :class:`~amp_patch.optim.fused.FusedSGD` (the same hyper-parameters)
            instead of torch's SGD. Default: False.

    Returns:
        Workload: ``(model, optimizer, batch_fn, loss_fn)``; the optimizer is SGD.
    """
    batch_size = batch_size or _BATCH_SIZES["convnet"]
    device = torch.device(device)
    torch.manual_seed(seed)
    c = channels

    def stage(cin: int, cout: int) -> list[nn.Module]:
        return [nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(),
                nn.MaxPool2d(2)]

    model = nn.Sequential(
        *stage(3, c), *stage(c, 2 * c), *stage(2 * c, 4 * c),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4 * c, classes),
    ).to(device)
    optimizer: torch.optim.Optimizer = (
        FusedSGD(model.parameters(), lr=lr, momentum=0.9) if fused_sgd
        else torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9))
    templates = torch.randn(classes, 3, image_size, image_size, generator=_generator(seed, -1))

    def batch_fn(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = _generator(seed, step)
        y = torch.randint(classes, (batch_size,), generator=g)
        x = templates[y] + 1.5 * torch.randn(batch_size, 3, image_size, image_size, generator=g)
        return x.to(device), y.to(device)

    def loss_fn(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(model(x).float(), y)

    return Workload(model, optimizer, batch_fn, loss_fn)


# --------------------------------------------------------------------------- lookup

#: Built-in factories by the name ``--model`` takes.
BUILTIN: dict[str, Callable[..., Workload]] = {"lm": lm, "mlp": mlp, "convnet": convnet}

#: Each built-in's argument that builds amp_patch's fused optimizer in place of torch's.
_FUSED_FLAGS = {"lm": "fused_adam", "mlp": "fused_adam", "convnet": "fused_sgd"}

#: The batch size of each built-in factory when none is given.
_BATCH_SIZES = {"lm": COMPARE_LM.batch_size, "mlp": 256, "convnet": 64}


def default_batch_size(spec: str) -> int | None:
    """The batch size the factory named by ``spec`` builds when none is passed, if known unbuilt.

    Args:
        spec (str): a built-in name or ``"pkg.module:factory"`` (imported).

    Returns:
        int or None: a built-in's default, or the integer default of the
        factory's ``batch_size`` parameter; None when it has none.

    Example::

        >>> default_batch_size("lm")
        8
    """
    if spec in _BATCH_SIZES:
        return _BATCH_SIZES[spec]
    try:
        param = inspect.signature(resolve(spec)).parameters.get("batch_size")
    except (TypeError, ValueError):
        return None
    default = None if param is None else param.default
    return default if isinstance(default, int) and not isinstance(default, bool) else None


def fused_variant(spec: str) -> Any:
    """The workload ``spec`` with amp_patch's fused optimizer in place of torch's, for the rows
    that need one (:data:`amp_patch.cli.compare.trainer.PRESETS`).

    A built-in gets the same optimizer as amp_patch's
    :class:`~amp_patch.optim.fused.FusedAdam` (``lm``, ``mlp``) or
    :class:`~amp_patch.optim.fused.FusedSGD` (``convnet``), with the same
    hyper-parameters. A user's ``pkg.module:factory`` is returned as it is: its
    own optimizer decides whether such a row can run.

    Args:
        spec (str): a built-in name or ``"pkg.module:factory"``.

    Returns:
        str or callable: a picklable factory, or ``spec``.

    Example::

        >>> fused_variant("convnet").keywords
        {'fused_sgd': True}
        >>> fused_variant("mypkg.models:make")
        'mypkg.models:make'
    """
    if spec in _FUSED_FLAGS:
        return functools.partial(BUILTIN[spec], **{_FUSED_FLAGS[spec]: True})
    return spec


def resolve(spec: str) -> Callable[..., Workload]:
    """The factory named by ``spec``: a built-in name or ``"pkg.module:factory"``.

    Args:
        spec (str): ``"lm"``, ``"mlp"``, ``"convnet"``, or an importable
            ``module:attribute`` (dots in the attribute walk into objects).

    Returns:
        callable: the factory.

    Raises:
        ValueError: ``spec`` is neither a built-in name nor of the form ``module:factory``.
        ImportError: the module cannot be imported.
        AttributeError: the module has no such attribute.
    """
    if spec in BUILTIN:
        return BUILTIN[spec]
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(
            f"unknown model {spec!r}: use a built-in name ({', '.join(BUILTIN)}) or "
            "'pkg.module:factory'"
        )
    obj: Any = importlib.import_module(module_name)
    for part in attr.split("."):
        obj = getattr(obj, part)
    if not callable(obj):
        raise TypeError(f"{spec} is not callable")
    return obj


def build(
    factory: Callable[..., Any],
    device: str | torch.device = "cpu",
    batch_size: int | None = None,
    seed: int = 0,
) -> Workload:
    """Call ``factory`` with those of ``device``, ``batch_size`` and ``seed`` that it accepts.

    A ``batch_size`` of None is not passed, so the factory's own default holds.

    Args:
        factory (callable): a built-in factory or a user's.
        device (str or torch.device, optional): Default: ``"cpu"``.
        batch_size (int, optional): Default: the factory's own.
        seed (int, optional): Default: 0.

    Returns:
        Workload: the factory's ``(model, optimizer, batch_fn, loss_fn)``.

    Raises:
        TypeError: the factory did not return four items of the right kinds.
    """
    offered = {"device": device, "seed": seed}
    if batch_size is not None:
        offered["batch_size"] = batch_size
    params = inspect.signature(factory).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    kwargs = {k: v for k, v in offered.items() if takes_any or k in params}
    result = factory(**kwargs)
    if not (isinstance(result, tuple) and len(result) == 4):
        raise TypeError(
            f"the model factory {getattr(factory, '__qualname__', factory)!r} must return "
            f"(model, optimizer, batch_fn, loss_fn); got {type(result).__name__}"
        )
    model, optimizer, batch_fn, loss_fn = result
    if not isinstance(model, nn.Module) or not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            "the model factory must return (model: nn.Module, optimizer: torch.optim.Optimizer, "
            f"batch_fn, loss_fn); got ({type(model).__name__}, {type(optimizer).__name__}, ...)"
        )
    if not (callable(batch_fn) and callable(loss_fn)):
        raise TypeError("the model factory's batch_fn and loss_fn must be callable")
    return Workload(model, optimizer, batch_fn, loss_fn)


def parameter_count(model: nn.Module) -> int:
    """Number of parameter elements in ``model``."""
    return sum(p.numel() for p in model.parameters())

