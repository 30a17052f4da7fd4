"""Moved to :mod:`hf_qknorm.portable.schemes` (this path works for one release, with a ``FutureWarning``)."""

from .._moved import alias

alias(__name__, "hf_qknorm.portable.schemes")
