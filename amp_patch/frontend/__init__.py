"""The front end: the calls a training script makes (docs/api.md).

- :mod:`~amp_patch.frontend.lifecycle`: :func:`~amp_patch.initialize`,
  :func:`~amp_patch.deinitialize`, :func:`~amp_patch.state_dict`,
  :func:`~amp_patch.load_state_dict`.
- :mod:`~amp_patch.frontend.loss_scaling`: :func:`~amp_patch.scale_loss` and
  :func:`~amp_patch.master_params`.
- :mod:`~amp_patch.frontend.legacy_handle`: :func:`~amp_patch.init`, Apex's handle API.
- :mod:`~amp_patch.frontend.checkpoint`: :func:`~amp_patch.save_checkpoint` and
  :func:`~amp_patch.load_checkpoint`, with ``torch.distributed.checkpoint`` too.
- :mod:`~amp_patch.frontend.clip`: :func:`~amp_patch.clip_grad_norm_`, over shards too.
- :mod:`~amp_patch.frontend.debug`: ``AMP_PATCH_DEBUG_RANKS=1``, which compares each
  step's amp decisions across the ranks.

The public names are served by :mod:`amp_patch` itself; this package's modules are
where they live.
"""
