"""The entry of a fused optimizer's ``step()``: torch's step hooks and profiler label, for less.

(``zero_grad`` likewise opens torch's label only while :func:`labelled`.)

``torch.optim.Optimizer`` wraps every subclass's ``step`` (``profile_hook_step``):
the wrapper opens a ``record_function`` and walks the global and per-optimizer
pre- and post-hooks at every call, whether or not a profiler or a hook is
there. On a step bound by the host that costs as much as the rest of the step's
Python (docs/benchmarks.md, section host-bound). :func:`hooked_step` gives the
fused optimizers the same entry, marked ``hooked`` so that torch does not wrap
it again:

- the step pre-hooks, global then the optimizer's (a hook may return new
  ``(args, kwargs)``), and the post-hooks, the optimizer's then global, as torch
  calls them;
- ``_optimizer_step_code()``, where torch's profiler looks at the optimizer;
- the label ``Optimizer.step#<class>.step`` while a profiler runs (and always
  under ``torch.compile``, which handles the label itself);
- grad mode off for the body, as ``torch.no_grad()`` would (the body turns it
  on for a closure).

A subclass's own ``step`` that calls ``super().step()`` runs the hooks once:
only the entry that ``type(opt).step`` names runs them.

Example::

    >>> from amp_patch.optim.fused import FusedSGD
    >>> opt = FusedSGD([torch.nn.Parameter(torch.ones(2))], lr=0.1)
    >>> calls = []
    >>> handle = opt.register_step_pre_hook(lambda o, args, kwargs: calls.append("pre"))
    >>> opt.step(); calls
    ['pre']
    >>> handle.remove()
"""

from __future__ import annotations

import functools
from typing import Any, Callable, TypeVar

import torch
from torch.optim import optimizer as _torch_optimizer

__all__ = ["hooked_step", "labelled"]

_Step = TypeVar("_Step", bound=Callable[..., Any])

# torch's registries of global step hooks (``register_optimizer_step_pre_hook`` and
# ``..._post_hook``), dicts that torch fills and empties in place.
_GLOBAL_PRE_HOOKS: dict = getattr(_torch_optimizer, "_global_optimizer_pre_hooks", {})
_GLOBAL_POST_HOOKS: dict = getattr(_torch_optimizer, "_global_optimizer_post_hooks", {})


def hooked_step(body: _Step) -> _Step:
    """``body`` (an optimizer's ``step(self, ...)``) as a step entry torch leaves as it is.

    Args:
        body (callable): the step; it runs with grad mode off.

    Returns:
        callable: the entry, with ``hooked = True`` (what torch's ``Optimizer`` checks before
        wrapping ``step``).
    """

    @functools.wraps(body)
    def step(self: Any, *args: Any, **kwargs: Any) -> Any:
        if type(self).step is not step:  # reached through super() from the entry that ran them
            return _without_grad(body, self, args, kwargs)
        if labelled():
            with torch.autograd.profiler.record_function(
                    f"Optimizer.step#{type(self).__name__}.step"):
                return _with_hooks(self, body, args, kwargs)
        return _with_hooks(self, body, args, kwargs)

    step.hooked = True  # type: ignore[attr-defined]
    return step  # type: ignore[return-value]


def labelled() -> bool:
    """Whether an optimizer's ``step``/``zero_grad`` should open torch's ``record_function``
    label: while a profiler runs, and under ``torch.compile`` (which handles labels itself)."""
    return torch.compiler.is_compiling() or torch.autograd._profiler_enabled()


def _with_hooks(opt: Any, body: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    """torch's order: pre-hooks (global, then the optimizer's), the step, the profiler's
    look, post-hooks (the optimizer's, then global)."""
    pre = opt._optimizer_step_pre_hooks
    if _GLOBAL_PRE_HOOKS or pre:
        for hook in (*_GLOBAL_PRE_HOOKS.values(), *pre.values()):
            result = hook(opt, args, kwargs)
            if result is None:
                continue
            if not (isinstance(result, tuple) and len(result) == 2):
                raise RuntimeError(f"{type(opt).__name__}.step's pre-hook {hook!r} must return "
                                   f"None or a tuple (new_args, new_kwargs), but got {result!r}")
            args, kwargs = result
    out = _without_grad(body, opt, args, kwargs)
    opt._optimizer_step_code()
    post = opt._optimizer_step_post_hooks
    if post or _GLOBAL_POST_HOOKS:
        for hook in (*post.values(), *_GLOBAL_POST_HOOKS.values()):
            hook(opt, args, kwargs)
    return out


def _without_grad(body: Callable[..., Any], opt: Any, args: tuple, kwargs: dict) -> Any:
    enabled = torch.is_grad_enabled()
    if not enabled:
        return body(opt, *args, **kwargs)
    torch.set_grad_enabled(False)
    try:
        return body(opt, *args, **kwargs)
    finally:
        torch.set_grad_enabled(enabled)
