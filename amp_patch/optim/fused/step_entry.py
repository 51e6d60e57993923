"""Optimizer entries without torch's per-call profiler label: ``step()`` and ``zero_grad()``.

``torch.optim.Optimizer`` wraps every subclass's ``step`` (``profile_hook_step``):
the wrapper opens a ``record_function`` and walks the global and per-optimizer
pre- and post-hooks at every call, whether or not a profiler or a hook is
there; its ``zero_grad`` opens a label too. On a step bound by the host that
costs as much as the rest of the step's Python (docs/benchmarks.md, section
host-bound). This module gives the same entries for less:

- :func:`hooked_step`: the fused optimizers' ``step``, marked ``hooked`` so that
  torch does not wrap it again;
- :func:`run_step_hooks` and :func:`unlabelled_step`: amp's patched ``step`` of
  a torch optimizer calls torch's body through them
  (:mod:`amp_patch.optim.amp.patched_methods`);
- :func:`grads_to_none`: ``zero_grad(set_to_none=True)``'s loop, for both.

Each keeps what torch's wrapper does:

- the step pre-hooks, global then the optimizer's, called as torch calls them,
  ``hook(optimizer, args, kwargs)`` with the optimizer first in ``args`` (a hook
  may return new ``(args, kwargs)``), and the post-hooks, the optimizer's then
  global;
- ``_optimizer_step_code()``, where torch's profiler looks at the optimizer;
- the label ``Optimizer.step#<class>.step`` while a profiler runs (and always
  under ``torch.compile``, which handles the label itself);
- for :func:`hooked_step`, grad mode off for the body, as ``torch.no_grad()``
  would (the body turns it on for a closure).

A subclass's own ``step`` that calls ``super().step()`` runs the hooks once:
only the entry that ``type(opt).step`` names runs them.

Example::

    >>> from amp_patch.optim.fused import FusedSGD
    >>> opt = FusedSGD([torch.nn.Parameter(torch.ones(2))], lr=0.1)
    >>> calls = []
    >>> handle = opt.register_step_pre_hook(lambda o, args, kwargs: calls.append(args[0] is o))
    >>> opt.step(); calls
    [True]
    >>> handle.remove()
"""

from __future__ import annotations

import functools
from typing import Any, Callable, TypeVar

import torch
from torch.optim import optimizer as _torch_optimizer

__all__ = ["hooked_step", "labelled", "run_step_hooks", "unlabelled_step", "grads_to_none"]

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

    def without_grad(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return body(*args, **kwargs)
        torch.set_grad_enabled(False)
        try:
            return body(*args, **kwargs)
        finally:
            torch.set_grad_enabled(True)

    @functools.wraps(body)
    def step(self: Any, *args: Any, **kwargs: Any) -> Any:
        if type(self).step is not step:  # reached through super() from the entry that ran them
            return without_grad(self, *args, **kwargs)
        if labelled():
            with torch.autograd.profiler.record_function(
                    f"Optimizer.step#{type(self).__name__}.step"):
                return run_step_hooks(self, without_grad, (self, *args), kwargs)
        return run_step_hooks(self, without_grad, (self, *args), kwargs)

    step.hooked = True  # type: ignore[attr-defined]
    return step  # type: ignore[return-value]


def labelled() -> bool:
    """Whether an optimizer's ``step``/``zero_grad`` should open torch's ``record_function``
    label: while a profiler runs, and under ``torch.compile`` (which handles labels itself)."""
    return torch.compiler.is_compiling() or torch.autograd._profiler_enabled()


def run_step_hooks(opt: Any, body: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    """``body(*args, **kwargs)`` between ``opt``'s step hooks, as torch's wrapper runs them.

    torch's order: pre-hooks (global, then the optimizer's), the body, the
    profiler's look (``_optimizer_step_code()``), post-hooks (the optimizer's,
    then global). No label: the caller opens it where :func:`labelled`.

    Args:
        opt (torch.optim.Optimizer): the optimizer whose hooks run.
        body (callable): the step body, called with the (possibly replaced) arguments.
        args (tuple): positional arguments, ``opt`` first, as torch hands them to the hooks.
        kwargs (dict): keyword arguments.

    Raises:
        RuntimeError: a pre-hook returned something other than None or ``(args, kwargs)``.
    """
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
    out = body(*args, **kwargs)
    opt._optimizer_step_code()
    post = opt._optimizer_step_post_hooks
    if post or _GLOBAL_POST_HOOKS:
        for hook in (*post.values(), *_GLOBAL_POST_HOOKS.values()):
            hook(opt, args, kwargs)
    return out


#: The code of the wrapper torch's ``Optimizer.profile_hook_step`` puts around a ``step``.
_TORCH_STEP_WRAPPER = torch.optim.Optimizer.profile_hook_step(lambda *a, **k: None).__code__


def unlabelled_step(step: Any) -> Callable[..., Any] | None:
    """The body of a torch-wrapped ``step``, to call through :func:`run_step_hooks`, or None.

    Args:
        step: a class's ``step`` as torch's ``Optimizer`` left it (anything else gives None).

    Returns:
        callable or None: the function torch's ``profile_hook_step`` wrapped
        (its ``__wrapped__``), when ``step`` is that wrapper and no label is
        wanted (:func:`labelled` is False); else None, and ``step`` is called as it is.

    Example::

        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> unlabelled_step(type(opt).step) is torch.optim.SGD.step.__wrapped__
        True
    """
    if getattr(step, "__code__", None) is not _TORCH_STEP_WRAPPER or labelled():
        return None
    return getattr(step, "__wrapped__", None)


def grads_to_none(opt: Any) -> None:
    """Set the grad of every param of ``opt`` to None: ``zero_grad(set_to_none=True)``'s loop
    without torch's label (call it where :func:`labelled` is False)."""
    for group in opt.param_groups:
        for p in group["params"]:
            if p.grad is not None:  # reading .grad costs less than setting it
                p.grad = None
