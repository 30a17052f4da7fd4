"""The ``hf-qknorm`` command line (``python -m hf_qknorm.cli``)."""

from .main import entry, main

__all__ = ["entry", "main"]
