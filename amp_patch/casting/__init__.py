"""Model casting: what O2 and O3 do to a model's parameters, buffers and forward.

- :mod:`~amp_patch.casting.model`: the casts and the input/output hooks of O2/O3.
- :mod:`~amp_patch.casting.fsdp`: a model sharded with ``fully_shard`` (FSDP2): its
  precision policy fitted to the level, the sharded casts and the order guard.
"""
