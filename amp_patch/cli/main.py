"""The ``amp-patch`` command: ``compare``, ``run``, ``bench`` and ``doctor``."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import amp_patch
from amp_patch.cli import compare, doctor, run
from amp_patch.cli.options import UsageError

__all__ = ["main", "build_parser"]

EPILOG = """\
examples:
  amp-patch compare                        # O0-O3 and torch.autocast on the built-in LM
  amp-patch compare --full --out out/      # the docs/compare.md run: 100 steps, table, JSON, PNG
  amp-patch compare --model mlp --steps 50 --out out/
  amp-patch compare --model mypkg.models:make_workload --levels O0 O2 --json results.json
  amp-patch compare --nproc 2              # each level data-parallel over 2 ranks (DDP)
  amp-patch run train.py --epochs 1        # an unchanged `from apex import amp` script
  amp-patch run --device cpu main_amp.py   # a GPU script (.cuda(), streams, nccl) on the CPU
  amp-patch bench                          # kernel and end-to-end benchmarks (source checkout)
  amp-patch doctor                         # torch, compiler, kernels: a report for bug reports

`amp-patch COMMAND --help` describes each command. Docs: docs/ in the repository.
"""

#: The benchmark scripts, in the order `bench` runs them; missing ones are skipped.
BENCHMARKS = (
    "bench_kernels.py", "bench_optimizers.py", "bench_overhead.py", "bench_host_bound.py",
    "bench_compile.py",
    "bench_o2_step.py", "bench_cpu_half.py", "bench_e2e.py", "bench_lean_state.py",
    "bench_compare_repeat.py", "bench_gloo_exit.py",
)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``amp-patch`` command."""
    parser = argparse.ArgumentParser(
        prog="amp-patch",
        description="Apex-style automatic mixed precision (O0-O3) for current PyTorch: "
                    "compare the opt levels on a model, or run an Apex-era script unchanged.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"amp_patch {amp_patch.__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    compare.add_parser(sub)
    run.add_parser(sub)
    _add_bench_parser(sub)
    doctor.add_parser(sub)
    return parser


def _add_bench_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "bench", help="run the benchmark scripts and rewrite docs/benchmarks.md (source checkout)",
        description="Run the scripts in the repository's benchmarks/ directory "
                    f"({', '.join(BENCHMARKS)}, those present), each printing a table and "
                    "rewriting its section of docs/benchmarks.md. Needs a source checkout.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n  amp-patch bench\n  amp-patch bench --only kernels e2e\n")
    p.add_argument("--only", nargs="+", metavar="NAME",
                   choices=[b[len("bench_"):-len(".py")] for b in BENCHMARKS],
                   help="run only these ("
                        + ", ".join(b[len("bench_"):-len(".py")] for b in BENCHMARKS) + ")")
    p.set_defaults(func=_bench, parser=p)


def _bench(ns: argparse.Namespace) -> int:
    root = Path(amp_patch.__file__).resolve().parent.parent / "benchmarks"
    wanted = [b for b in BENCHMARKS if ns.only is None or b[len("bench_"):-len(".py")] in ns.only]
    scripts = [root / b for b in wanted if (root / b).is_file()]
    if not scripts:
        print(f"amp-patch bench: no benchmark scripts found in {root}. The benchmarks are not part "
              "of the installed package; run this from a source checkout of amp_patch "
              "(`pip install -e .` there, then `make bench`).", file=sys.stderr)
        return 2
    failed = []
    for script in scripts:
        print(f"== {script.name}", flush=True)
        if subprocess.run([sys.executable, str(script)], cwd=root.parent).returncode != 0:
            failed.append(script.name)
    if failed:
        print(f"amp-patch bench: failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``amp-patch`` console script and of ``python -m amp_patch``.

    Args:
        argv (list of str, optional): the arguments. Default: ``sys.argv[1:]``.

    Returns:
        int: the exit status.
    """
    ns = build_parser().parse_args(argv)
    try:
        return ns.func(ns)
    except UsageError as exc:
        # argparse's convention for bad options: usage, the message, exit status 2.
        ns.parser.error(str(exc))  # exits with status 2
        raise  # unreachable: parser.error exits
