"""D1: does ``make demo`` finish within 90 s on each CPU host kind?

``make demo`` is ``amp-patch compare --out DIR``: every default level of the
built-in LM, each in its own process. This script runs that command once per
CPU host kind (native, conv-only, none; docs/install.md, "CPU host kinds"),
each forced by oneDNN's and ATen's ISA caps
(``amp_patch.patching.cpu_half.FORCED_KIND_ENV``) in a fresh process, and reports its
wall time, the kind the detection found, the levels that ran (torch.autocast
is left out on the none kind), autocast's measured factor and its speed-up
over O0, and how busy the machine was. A cap only lowers a host: on a host
of a lower kind, the row says the kind that was found.

Run: ``python benchmarks/bench_demo_hosts.py`` (writes the "demo-hosts"
section of docs/benchmarks.md); ``--kinds conv-only`` for one kind;
``--no-write`` prints only.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import machine, markdown_table, publish

from amp_patch.patching.cpu_half import ENV_VAR, FORCED_KIND_ENV, HOST_KINDS

#: D1's target: ``make demo``'s wall time on every kind.
TARGET_S = 90.0


def _run(kind: str, out: Path) -> tuple[float, dict]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("ONEDNN_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY", ENV_VAR)}
    env.update(FORCED_KIND_ENV[kind])
    started = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "amp_patch", "compare", "--out", str(out)],
                          env=env, capture_output=True, text=True)
    wall = time.perf_counter() - started
    if proc.returncode != 0:
        raise SystemExit(f"make demo's compare failed on the {kind} kind:\n{proc.stdout}\n"
                         f"{proc.stderr}")
    return wall, json.loads((out / "results.json").read_text())


def _row(kind: str, wall: float, data: dict) -> list[str]:
    half = data["machine"]["cpu_half"]["bf16"]
    levels = data["levels"]
    autocast = levels.get("autocast")
    factor = half["matmul_ratio"]
    load = data["load"]
    share = load.get("others_share")
    return [
        kind + (" (forced: " + " ".join(f"{k}={v}" for k, v in FORCED_KIND_ENV[kind].items())
                + ")" if FORCED_KIND_ENV[kind] else " (as is)"),
        half["kind"],
        "-" if factor is None else f"{factor:.1f}x",
        f"{wall:.0f} s",
        "met" if wall <= TARGET_S else "**missed**",
        str(len(levels)),
        "left out" if autocast is None else
        f"{autocast['speedup_vs_O0']:.2f}x" if autocast.get("speedup_vs_O0") else "ran, n/a",
        f"{load['load_before'][0]:.2f}" if load.get("load_before") else "?",
        "?" if share is None else f"{share:.0%}",
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kinds", nargs="+", choices=HOST_KINDS, default=list(HOST_KINDS))
    parser.add_argument("--no-write", action="store_true", help="print, do not rewrite the report")
    ns = parser.parse_args()

    rows, warnings = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for kind in ns.kinds:
            wall, data = _run(kind, Path(tmp) / kind)
            rows.append(_row(kind, wall, data))
            print(" | ".join(rows[-1]), flush=True)
            warnings += [f"- {kind}: {w}" for w in data.get("warnings", [])]
    body = "\n".join([
        "## make demo on each CPU host kind (D1)",
        "",
        f"Machine: {machine()}.",
        "`make demo` (`amp-patch compare --out DIR`: the built-in LM, 60 steps, every default "
        "level) once per CPU host kind, forced by oneDNN's and ATen's ISA caps on this host "
        f"(`benchmarks/bench_demo_hosts.py`). Target D1: at most {TARGET_S:.0f} s of wall time "
        "on every kind, start-up included. \"bf16 matmul\" is the detection probe's bf16 "
        "matmul time over fp32's, which decides whether torch.autocast runs "
        "(docs/compare.md); \"others\" is the share of the CPU time other processes took "
        "during the run.",
        "",
        markdown_table(["kind", "detected", "bf16 matmul", "wall", "D1", "levels",
                        "autocast / O0", "load before", "others"], rows),
        "",
        "Warnings the runs printed (a warned run's times are not facts about the kinds):",
        *(warnings or ["- none"]),
    ])
    publish("demo-hosts", body, write=not ns.no_write)


if __name__ == "__main__":
    main()
