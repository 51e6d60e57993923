"""amp under torch.distributed: FSDP2 models, grad-norm clipping over shards, DCP checkpoints.

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

Nothing here imports ``torch.distributed.tensor`` or FSDP until a model uses them.
"""

from amp_patch.distributed.teardown import close_process_group, wait_for_gloo_workers

__all__ = ["close_process_group", "wait_for_gloo_workers"]
