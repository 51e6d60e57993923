"""``amp-patch run``: an Apex-era script, unchanged, with ``apex`` served by amp_patch.

- :mod:`~amp_patch.cli.run.command`: the command (options, the import hook, the script).
- :mod:`~amp_patch.cli.run.cuda_on_cpu`: ``--device cpu``, which maps a CUDA script's
  calls onto the CPU.
"""

from amp_patch.cli.run.command import add_parser, run_script

__all__ = ["add_parser", "run_script"]
