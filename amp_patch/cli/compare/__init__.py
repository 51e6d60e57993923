"""``amp-patch compare``: train one model under O0-O3 and torch.autocast, side by side.

Every level trains in its own persistent process, from the same seed on the
same batches, and the levels are timed round-robin (:mod:`amp_patch.cli.compare.round_robin`,
shared with ``benchmarks/bench_e2e.py``). Each speed is the median over the
timed rounds, with the min-max over rounds beside it; the host and its load
are recorded, and a warning is printed when they make the ratios unreliable.
With ``--nproc N`` each level trains data-parallel over N ranks of its own
(:mod:`amp_patch.cli.compare.data_parallel`), and every rank's peak memory is reported.

The command is split by concern: :mod:`~amp_patch.cli.compare.results`
(the measured run), :mod:`~amp_patch.cli.compare.table`,
:mod:`~amp_patch.cli.compare.plot` and :mod:`~amp_patch.cli.compare.command`
(options and output files).
"""

from amp_patch.cli.compare.command import DEMO_STEPS, FULL_STEPS, add_parser, check_model, validate
from amp_patch.cli.compare.plot import write_plot
from amp_patch.cli.compare.results import LEVELS, Comparison, LevelResult, run_compare
from amp_patch.cli.compare.table import render_table

__all__ = ["LEVELS", "DEMO_STEPS", "FULL_STEPS", "LevelResult", "Comparison", "add_parser",
           "run_compare", "render_table", "write_plot", "validate", "check_model"]
