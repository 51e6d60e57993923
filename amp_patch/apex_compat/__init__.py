"""Apex compatibility: the ``amp_C`` / ``multi_tensor_applier`` kernel shims and, for
``amp-patch run``, the modules served as ``apex.*`` by :mod:`amp_patch.apex_compat.import_hook`."""
