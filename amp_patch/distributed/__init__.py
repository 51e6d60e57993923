"""amp under torch.distributed.

- :mod:`~amp_patch.distributed.fsdp`: what :func:`amp_patch.initialize` does
  to a model sharded with ``fully_shard`` (precision policies, sharded casts,
  the order guard), and :func:`~amp_patch.distributed.fsdp.local_tensor`,
  through which every fused op sees a DTensor's local shard.
- :mod:`~amp_patch.distributed.clip`: :func:`amp_patch.clip_grad_norm_`.

Nothing here imports ``torch.distributed.tensor`` or FSDP until a model uses them.
"""
