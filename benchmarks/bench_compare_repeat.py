"""Is ``amp-patch compare`` repeatable? Two runs in a row, each ratio against the other's spread.

compare, run twice in a row on the same quiet machine, should give
speed ratios within its reported spread. That is a property of the
machine as much as of compare, so it is measured here rather than asserted in
a test: this script runs ``amp-patch compare`` twice with the same arguments
and reports, for each level, the first run's speed-up over O0 with its
min-max over rounds, the second run's speed-up, whether it falls inside, and
the warnings each run printed (load, spread).

Run: ``python benchmarks/bench_compare_repeat.py`` (writes the
"compare-repeat" section of docs/benchmarks.md); ``--no-write`` prints only.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from common import machine, markdown_table, publish

#: What each of the two runs trains: small enough for a minute, rounds enough for a spread.
COMPARE_ARGS = ("--model", "mlp", "--steps", "27", "--warmup", "3", "--rounds", "8",
                "--levels", "O0", "O1", "O3")


def _run(out: Path) -> dict:
    proc = subprocess.run([sys.executable, "-m", "amp_patch", "compare", *COMPARE_ARGS,
                           "--json", str(out)], capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"amp-patch compare failed:\n{proc.stdout}\n{proc.stderr}")
    return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-write", action="store_true", help="print, do not rewrite the report")
    ns = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        first, second = (_run(Path(tmp) / name) for name in ("a.json", "b.json"))
    rows, inside = [], 0
    levels = [lvl for lvl in first["levels"] if lvl != "O0"]
    for level in levels:
        low, high = first["levels"][level]["speedup_range"]
        again = second["levels"][level]["speedup_vs_O0"]
        ok = low <= again <= high
        inside += ok
        rows.append([level, f"{first['levels'][level]['speedup_vs_O0']:.2f}x",
                     f"{low:.2f}-{high:.2f}x", f"{again:.2f}x", "yes" if ok else "**no**"])
    warnings = [f"- run {i}: {w}" for i, run in enumerate((first, second), 1)
                for w in run.get("warnings", [])] or ["- none"]
    body = "\n".join([
        "## compare, run twice in a row",
        "",
        f"Machine: {machine()}.",
        f"`amp-patch compare {' '.join(COMPARE_ARGS)}`, twice. Each level's speed-up over O0 in "
        "the second run, against the first run's median and min-max over rounds "
        f"({inside} of {len(levels)} inside).",
        "",
        markdown_table(["level", "run 1 speed-up", "run 1 min-max", "run 2 speed-up",
                        "inside"], rows),
        "",
        "Warnings the runs printed (a warned run's spread is not a fact about the levels):",
        *warnings,
    ])
    publish("compare-repeat", body, write=not ns.no_write)


if __name__ == "__main__":
    main()
