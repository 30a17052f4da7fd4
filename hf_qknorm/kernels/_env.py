"""The library's on/off environment switches, read one way (docs/api.md: Environment variables).

It lives in the lowest floor that reads one (``kernels/`` may import nothing else from the package), so every floor
above can use it too. Standard library only: importing it never imports triton.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

ON = ("1", "on", "true", "yes")
OFF = ("0", "off", "false", "no")


class SwitchError(ValueError):
    """A switch holding a value that is neither on nor off: the user's setting, never the model's fault (the
    patch-time probe passes it on as it is instead of refusing the model type)."""


def switch(name: str, default, unset: str, environ: Mapping[str, str] | None = None):
    """``name``'s value in the environment: True for one of :data:`ON`, False for one of :data:`OFF` (case and
    surrounding spaces ignored), ``default`` where it is unset or empty. Anything else raises a one-line
    :class:`SwitchError` (a ``ValueError``) naming the value, the valid ones and ``unset`` (what leaving it unset
    means): a misspelt switch read as on or off would quietly measure the other path."""
    raw = (os.environ if environ is None else environ).get(name, "")
    value = raw.strip().lower()
    if not value:
        return default
    if value in ON:
        return True
    if value in OFF:
        return False
    raise SwitchError(f"{name}={raw!r} is not one of {', '.join(OFF + ON)} (or unset: {unset})")
