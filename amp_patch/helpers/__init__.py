"""The helpers every layer may use: they import torch and nothing of amp_patch above them.

- :mod:`~amp_patch.helpers.logs`: the ``amp_patch`` logger's set-up.
- :mod:`~amp_patch.helpers.tensors`: a DTensor's local shard, and tensor lists grouped by
  (device, dtype) for the fused ops.
- :mod:`~amp_patch.helpers.agree`: verdicts every rank agrees on, through one small collective.
- :mod:`~amp_patch.helpers.teardown`: :func:`close_process_group` and
  :func:`wait_for_gloo_workers`, which keep gloo from aborting a process as it exits
  (docs/distributed.md).
"""

from amp_patch.helpers.teardown import close_process_group, wait_for_gloo_workers

__all__ = ["close_process_group", "wait_for_gloo_workers"]
