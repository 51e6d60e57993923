"""``amp-patch run``: run an Apex-era training script unchanged, with ``apex`` served by amp_patch."""

from __future__ import annotations

import argparse
import os
import runpy
import sys

from amp_patch.apex_compat import import_hook

__all__ = ["add_parser", "run_script"]

DESCRIPTION = """\
Run a Python script (or module, with -m) as __main__, with an import hook that
serves `apex` from amp_patch: apex.amp, apex.optimizers (FusedAdam, FusedSGD),
apex.parallel (DistributedDataParallel), apex.normalization, apex.fp16_utils
and apex.multi_tensor_apply / amp_C. The script needs no edits. An apex name
amp_patch does not provide fails at import with a message naming it, is logged
as a warning even if the script catches the error, and is listed at the end.

A real apex installed on this machine is used as it is, unless --shadow-apex
is given. Arguments after the script name are passed to the script.
"""

EPILOG = """\
examples:
  amp-patch run train.py --epochs 2 --lr 0.1
  python -m amp_patch run examples/legacy_apex_train.py --steps 20
  amp-patch run -m mypackage.train --config small.yaml
  torchrun --standalone --nproc_per_node 2 -m amp_patch run train_ddp.py
"""


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register the ``run`` subcommand."""
    p = subparsers.add_parser(
        "run", help="run an unchanged Apex (`from apex import amp`) script on amp_patch",
        description=DESCRIPTION, epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shadow-apex", action="store_true",
                   help="serve `apex` from amp_patch even if a real apex is installed")
    p.add_argument("-m", dest="module", action="store_true",
                   help="TARGET is a module name to run (like `python -m`), not a file")
    p.add_argument("target", metavar="TARGET", help="the script to run (or module, with -m)")
    p.add_argument("args", nargs=argparse.REMAINDER, help="arguments passed to the script")
    p.set_defaults(func=_main)
    return p


def run_script(target: str, args: list[str], *, module: bool = False,
               shadow_apex: bool = False) -> None:
    """Run ``target`` as ``__main__`` with ``sys.argv`` set and the Apex import hook installed.

    The hook and the modules it served are removed afterwards, as are the
    changes to ``sys.argv`` and ``sys.path``. A ``SystemExit`` raised by the
    script propagates.

    Args:
        target (str): a script path, or a module name when ``module`` is True.
        args (list of str): the script's arguments (``sys.argv[1:]``).
        module (bool, optional): run a module as ``python -m`` does. Default: False.
        shadow_apex (bool, optional): serve ``apex`` even if a real one is
            installed. Default: False.
    """
    real = import_hook.real_installations()
    if real and not shadow_apex:
        print(f"amp-patch run: using the installed {', '.join(real)} ({'; '.join(real.values())}); "
              "pass --shadow-apex to use amp_patch instead", file=sys.stderr)
    saved_argv, saved_path = sys.argv[:], sys.path[:]
    finder = import_hook.install(shadow_apex)
    try:
        if module:
            sys.argv = [target, *args]
            sys.path.insert(0, os.getcwd())
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            if not os.path.isfile(target):
                raise SystemExit(f"amp-patch run: no such script: {target}")
            sys.argv = [target, *args]
            # As `python script.py` does: the script's directory comes first on the path.
            sys.path.insert(0, os.path.dirname(os.path.abspath(target)))
            runpy.run_path(target, run_name="__main__")
    finally:
        import_hook.uninstall(finder)
        if finder.misses:
            # One line, so that a script that caught the ImportError and fell back is noticed.
            print(f"amp-patch run: {len(finder.misses)} apex name(s) not served by amp_patch "
                  f"(the script may have run without them): {', '.join(finder.misses)}",
                  file=sys.stderr)
        sys.argv[:] = saved_argv
        sys.path[:] = saved_path


def _main(ns: argparse.Namespace) -> int:
    run_script(ns.target, ns.args, module=ns.module, shadow_apex=ns.shadow_apex)
    return 0
