"""``--help`` text shared by ``hf-qknorm``'s recipes and benchmarks."""

from __future__ import annotations

import argparse


class DefaultsFormatter(argparse.HelpFormatter):
    """Like ``argparse.ArgumentDefaultsHelpFormatter``, but adds ``(default: X)`` only where it says something: not
    when the help already states its default (which printed it twice: ``(default 3) (default: 3)``), not for
    ``None``/``False`` defaults nor for on/off flags."""

    def _get_help_string(self, action):
        text = action.help or ""
        if (
            "default" in text.lower()
            or any(action.default is v for v in (None, False, argparse.SUPPRESS))
            or isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction))
        ):  # `is`: 0 == False
            return text
        if action.option_strings or action.nargs in (argparse.OPTIONAL, argparse.ZERO_OR_MORE):
            return f"{text} (default: %(default)s)"
        return text
