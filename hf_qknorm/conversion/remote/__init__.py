"""Self-contained modelling code copied into exported ``qknorm_<base>`` folders (``trust_remote_code=True``).

The two modules here import nothing from ``hf_qknorm``; ``tests/test_export.py`` keeps them in sync with the plugin.
"""
