"""The runtime patch: schemes, per-head norms, the per-family table, ``patch_model`` and the ``qknorm_<base>``
model classes that saved folders load into."""
