"""The settings: plain values that every layer above reads, and nothing that acts.

- :mod:`~amp_patch.settings.dtypes`: the half dtypes, their names, and the names of the
  optimizer-state precisions.
- :mod:`~amp_patch.settings.levels`: the opt-level registry, O0-O3 (docs/opt_levels.md).
- :mod:`~amp_patch.settings.properties`: the frozen :class:`~amp_patch.Properties` of a
  session and their validation.
"""
