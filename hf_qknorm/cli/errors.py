"""How the command line reports a failure: one line on stderr and an exit status, whatever went wrong.

:func:`describe` sorts an exception into a kind -- a check that failed, bad input or a problem of the environment
(a missing or unreadable file, a full disk, a read-only folder, no CUDA, an unreachable Hub), an unexpected internal
error, an interruption -- and words it as one line. Library code raises ``ValueError``/``OSError`` with messages that
name the bad value; this module only shapes them (the traceback is printed with ``--debug``).
"""

from __future__ import annotations

import argparse
import errno

# exit status by kind of failure (README: Command line)
EXIT_CODES = {"check": 1, "input": 2, "internal": 3, "interrupted": 130, "terminated": 143}


class OneLineParser(argparse.ArgumentParser):
    """``argparse`` with usage errors as one line (``error: <command>: <problem> (see <command> --help)``)."""

    def error(self, message):
        self.exit(2, f"error: {self.prog}: {message} (see {self.prog} --help)\n")


def _one_line(text: str) -> str:
    return " ".join(part.strip() for part in str(text).splitlines() if part.strip())


def _os_message(exc: OSError) -> str:
    if not exc.strerror:  # raised with a message only (e.g. an unreachable Hub)
        return str(exc)
    name = errno.errorcode.get(exc.errno or -1)
    text = exc.strerror
    for path in (exc.filename, exc.filename2):
        if path is not None:
            text += f": {path}"
    return text if not name or name in text else f"{text} ({name})"


def _out_of_memory(exc: BaseException) -> bool:
    if isinstance(exc, MemoryError):
        return True
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and ("out of memory" in text or "not enough memory" in text)


def describe(exc: BaseException) -> tuple[str | None, str]:
    """``(kind, one-line message)`` for ``exc``; kind ``None`` means: let it propagate (``SystemExit``)."""
    from ..conversion.orchestration.checks import ConversionCheckError
    from ..conversion.orchestration.tempdirs import Terminated

    if isinstance(exc, Terminated):
        return "terminated", f"{exc}; stopped cleanly (nothing half-written was left)"
    if isinstance(exc, SystemExit):
        return None, ""
    if isinstance(exc, KeyboardInterrupt):
        return "interrupted", "interrupted; stopped cleanly (nothing half-written was left)"
    if isinstance(exc, ConversionCheckError):
        return "check", _one_line(exc)
    if _out_of_memory(exc):
        return "input", (
            f"out of memory ({_one_line(exc)[:200]}); use a smaller --batch-size or --block-len, another "
            "--device, or a machine with more memory"
        )
    if isinstance(exc, OSError):
        return "input", _one_line(_os_message(exc))
    if isinstance(exc, (ValueError, ImportError)):
        return "input", _one_line(exc) or type(exc).__name__
    message = _one_line(exc) or "(no message)"
    return "internal", (
        f"internal error: {type(exc).__name__}: {message}. This is a bug in hf_qknorm: rerun with "
        "--debug and report the traceback"
    )
