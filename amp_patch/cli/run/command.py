"""``amp-patch run``: run an Apex-era training script unchanged, ``apex`` served by amp_patch."""

from __future__ import annotations

import argparse
import logging
import os
import runpy
import sys

import amp_patch
from amp_patch.helpers import logs as _logging
from amp_patch import session as _session
from amp_patch.apex_compat import import_hook
from amp_patch.cli.run.cuda_on_cpu import CudaOnCpu
from amp_patch.cli.host_facts import HostFacts, cpu_half_banner
from amp_patch.cli.options import UsageError, parse_device
from amp_patch.cli.compare.trainer import HALF_DTYPES
from amp_patch.helpers import wait_for_gloo_workers

__all__ = ["add_parser", "run_script"]

logger = logging.getLogger("amp_patch")

DESCRIPTION = """\
Run a Python script (or module, with -m) as __main__, with an import hook that
serves `apex` from amp_patch: apex.amp, apex.optimizers (FusedAdam, FusedLAMB,
FusedMixedPrecisionLamb, FusedSGD, FusedNovoGrad, FusedAdagrad), apex.parallel
(DistributedDataParallel), apex.normalization, apex.fp16_utils,
apex.multi_tensor_apply, apex.contrib.optimizers (FP16_Optimizer, FusedAdam),
apex.contrib.xentropy and apex.contrib.clip_grad, and Apex's compiled modules
amp_C, apex_C and fused_adam_cuda; and Transformer Engine's FP8 spelling
(transformer_engine.pytorch: Linear, LayerNorm, LayerNormLinear, fp8_autocast;
transformer_engine.common.recipe: DelayedScaling, Float8CurrentScaling, Format)
on amp_patch's FP8 ops, on the CPU and on GPUs without TE. The script needs no
edits. An apex name (or
another of Apex's compiled modules: syncbn, fused_layer_norm_cuda, ...) that
amp_patch does not provide fails at import with a message naming it and what
to use instead, is logged as a warning even if the script catches the error,
and is listed at the end.

A real apex installed on this machine is used as it is, unless --shadow-apex
is given. Arguments after the script name are passed to the script.

--device cpu runs a script written for a GPU on the CPU, unchanged: for the
script's run, .cuda(), "cuda" devices, torch.cuda.is_available() and
synchronize(), streams and events, record_stream(), init_process_group("nccl")
and the other CUDA entry points of Apex-era scripts are mapped onto the CPU
(the start-up message lists them; docs/run.md has the details). .half() and
HalfTensor mean --half-dtype (default bf16, the CPU half type; fp16 matmuls
are hundreds of times slower on most CPUs), and so does an fp16
cast_model_type. A CUDA call with no CPU meaning fails with an error naming
it. Everything is undone when the script ends.

When the script has used gloo (torch.distributed on the CPU), the run waits
for gloo's worker threads before the interpreter exits, so that a DDP script
does not abort at exit (amp_patch.helpers.wait_for_gloo_workers).
"""

EPILOG = """\
examples:
  amp-patch run train.py --epochs 2 --lr 0.1
  amp-patch run --device cpu main_amp.py --opt-level O2 -b 8     # a GPU script, on the CPU
  amp-patch run --device cpu --half-dtype fp16 dcgan.py          # .half() as fp16 (slow on CPU)
  python -m amp_patch run examples/legacy_apex_train.py --steps 20
  amp-patch run -m mypackage.train --config small.yaml
  torchrun --standalone --nproc_per_node 2 -m amp_patch run --device cpu train_ddp.py
"""


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register the ``run`` subcommand."""
    p = subparsers.add_parser(
        "run", help="run an unchanged Apex (`from apex import amp`) script on amp_patch",
        description=DESCRIPTION, epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shadow-apex", action="store_true",
                   help="serve `apex` from amp_patch even if a real apex is installed")
    p.add_argument("--device", default=None, metavar="DEVICE",
                   help="cpu: map the script's CUDA calls onto the CPU; cuda[:N]: check that it "
                        "exists (default: run as is)")
    p.add_argument("--half-dtype", choices=sorted(HALF_DTYPES), default=None,
                   help="with --device cpu: what .half() and fp16 mean in the run (default: bf16)")
    p.add_argument("-m", dest="module", action="store_true",
                   help="TARGET is a module name to run (like `python -m`), not a file")
    p.add_argument("target", metavar="TARGET", help="the script to run (or module, with -m)")
    p.add_argument("args", nargs=argparse.REMAINDER, help="arguments passed to the script")
    p.set_defaults(func=_main, parser=p)
    return p


def run_script(target: str, args: list[str], *, module: bool = False, shadow_apex: bool = False,
               cuda_on_cpu: CudaOnCpu | None = None) -> None:
    """Run ``target`` as ``__main__`` with ``sys.argv`` set and the Apex import hook installed.

    Afterwards the hook and the modules it served are removed, an amp
    session the script left live is undone, then ``cuda_on_cpu`` (when
    given), and ``sys.argv`` and ``sys.path`` are put back; last, it waits
    for gloo's worker threads (:func:`~amp_patch.helpers.wait_for_gloo_workers`),
    so that the interpreter does not exit under them. A ``SystemExit``
    raised by the script propagates.

    Args:
        target (str): a script path, or a module name when ``module`` is True.
        args (list of str): the script's arguments (``sys.argv[1:]``).
        module (bool, optional): run a module as ``python -m`` does. Default: False.
        shadow_apex (bool, optional): serve ``apex`` even if a real one is
            installed. Default: False.
        cuda_on_cpu (CudaOnCpu, optional): a mapping of CUDA calls onto the
            CPU, installed for the script's run. Default: none.

    Raises:
        UsageError: ``target`` is not a file (and ``module`` is False).

    Example::

        >>> run_script("main_amp.py", ["--opt-level", "O2"], cuda_on_cpu=CudaOnCpu(torch.bfloat16))
    """
    if not module and not os.path.isfile(target):
        raise UsageError(f"no such script: {target}")
    real = import_hook.real_installations()
    if real and not shadow_apex:
        print(f"amp-patch run: using the installed {', '.join(real)} ({'; '.join(real.values())}); "
              "pass --shadow-apex to use amp_patch instead", file=sys.stderr)
    saved_argv, saved_path = sys.argv[:], sys.path[:]
    live_before = _session.current()
    finder = import_hook.install(shadow_apex)
    try:
        if cuda_on_cpu is not None:
            cuda_on_cpu.install()
            logger.info(cuda_on_cpu.summary())
            half = next(k for k, v in HALF_DTYPES.items() if v is cuda_on_cpu.half_dtype)
            logger.info(cpu_half_banner(HostFacts.collect("cpu"), half))
        sys.argv = [target, *args]
        if module:
            sys.path.insert(0, os.getcwd())
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            # As `python script.py` does: the script's directory comes first on the path.
            sys.path.insert(0, os.path.dirname(os.path.abspath(target)))
            runpy.run_path(target, run_name="__main__")
    finally:
        try:
            if _session.current() is not None and _session.current() is not live_before:
                amp_patch.deinitialize()
        finally:
            if cuda_on_cpu is not None:
                cuda_on_cpu.uninstall()
            import_hook.uninstall(finder)
            if finder.misses:
                # One line, so that a script that caught the ImportError and fell back is noticed.
                print(f"amp-patch run: {len(finder.misses)} apex name(s) not served by amp_patch "
                      f"(the script may have run without them): {', '.join(finder.misses)}",
                      file=sys.stderr)
            sys.argv[:] = saved_argv
            sys.path[:] = saved_path
            wait_for_gloo_workers()


def _main(ns: argparse.Namespace) -> int:
    mapping = None
    if ns.device is not None:
        device = parse_device(ns.device)
        if device.type == "cpu":
            mapping = CudaOnCpu(HALF_DTYPES[ns.half_dtype or "bf16"])
    if ns.half_dtype is not None and mapping is None:
        raise UsageError("--half-dtype applies with --device cpu only; elsewhere the script's own "
                         "choice of half type holds")
    if mapping is not None:
        _logging.configure(1)  # the start-up message says what is mapped
    run_script(ns.target, ns.args, module=ns.module, shadow_apex=ns.shadow_apex,
               cuda_on_cpu=mapping)
    return 0
