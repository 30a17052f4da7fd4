"""The ``hf-qknorm`` command line (``python -m hf_qknorm.cli``)."""

from .main import main

__all__ = ["main"]
