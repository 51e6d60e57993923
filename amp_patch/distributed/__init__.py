"""amp under torch.distributed: FSDP2 models, grad-norm clipping over shards, DCP checkpoints,
and the rule that every rank makes the same amp decision (docs/distributed.md).

- :mod:`~amp_patch.distributed.fsdp`: what :func:`amp_patch.initialize` does
  to a model sharded with ``fully_shard`` (precision policies, sharded casts,
  the order guard), and :func:`~amp_patch.distributed.fsdp.local_tensor`,
  through which every fused op sees a DTensor's local shard.
- :mod:`~amp_patch.distributed.clip`: :func:`amp_patch.clip_grad_norm_`.
- :mod:`~amp_patch.distributed.checkpoint`: :func:`amp_patch.save_checkpoint`
  and :func:`amp_patch.load_checkpoint` with ``torch.distributed.checkpoint``.
- :mod:`~amp_patch.distributed.teardown`: :func:`close_process_group` and
  :func:`wait_for_gloo_workers`, which keep gloo from aborting a process
  as it exits.
- :mod:`~amp_patch.distributed.regather`: O1's weight-cast cache on FSDP2
  models, where a cast lives no longer than the all-gather it cast.
- :mod:`~amp_patch.distributed.agree`: the verdicts the ranks agree on
  through one small collective (the CPU-half plan, the kernel check).
- :mod:`~amp_patch.distributed.debug`: ``AMP_PATCH_DEBUG_RANKS=1``, which
  compares each step's amp decisions across the ranks.

Nothing here imports ``torch.distributed.tensor`` or FSDP until a model uses them.
"""

from amp_patch.distributed.teardown import close_process_group, wait_for_gloo_workers

__all__ = ["close_process_group", "wait_for_gloo_workers"]
