"""Progress of a conversion: a bar on a terminal, log lines everywhere else.

A conversion of a real checkpoint runs for minutes. When stderr is a terminal, :class:`Stage` shows a ``tqdm`` bar;
when it is not (a log file, a CI job, a notebook cell that captures output), the bar is off and the logger
``hf_qknorm.conversion`` receives one line per stage with its counts and elapsed time -- at the start, at least every
:data:`HEARTBEAT_S` seconds while it runs, and at the end -- so a silent run is never mistaken for a hung one.
``hf-qknorm convert`` shows these lines on stderr (``--quiet`` hides them).
"""

from __future__ import annotations

import contextlib
import logging
import sys
import time

logger = logging.getLogger("hf_qknorm.conversion")

HEARTBEAT_S = 20.0  # at most this long between two log lines of a running stage (the contract is 30 s)


def _is_tty() -> bool:
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):
        return False


class Stage:
    """One stage of a conversion with ``total`` units (blocks, layers, steps): ``with Stage(...) as s: s.update()``.

    ``enabled=False`` (``progress=False``) keeps only the final line, at DEBUG level."""

    def __init__(self, desc: str, total: int, unit: str = "", enabled: bool = True, clock=time.monotonic):
        self.desc, self.total, self.unit, self.enabled = desc, int(total), unit, enabled
        self.done, self.note = 0, ""
        self._clock = clock
        self._start = self._last = clock()
        self._bar = None
        if enabled and _is_tty():
            from tqdm.auto import tqdm

            self._bar = tqdm(total=self.total, desc=desc, unit=unit or "it", leave=False, file=sys.stderr)
        elif enabled:
            logger.info("%s: started (%d %s)", desc, self.total, unit or "units")

    @property
    def elapsed(self) -> float:
        return self._clock() - self._start

    def update(self, n: int = 1, note: str = "") -> None:
        self.done += n
        if note:
            self.note = note
        if self._bar is not None:
            self._bar.update(n)
            if note:
                self._bar.set_postfix_str(note, refresh=False)
        elif self.enabled and self._clock() - self._last >= HEARTBEAT_S:
            self._log(logging.INFO)

    def _log(self, level: int, final: bool = False) -> None:
        self._last = self._clock()
        state = "done" if final else "running"
        note = f"; {self.note}" if self.note else ""
        logger.log(
            level,
            "%s: %s, %d/%d %s in %.1f s%s",
            self.desc,
            state,
            self.done,
            self.total,
            self.unit or "units",
            self.elapsed,
            note,
        )

    def __enter__(self):
        return self

    def __exit__(self, exc_type, *exc):
        if self._bar is not None:
            self._bar.close()
        if exc_type is None:
            self._log(logging.INFO if self.enabled else logging.DEBUG, final=True)
        return False


@contextlib.contextmanager
def progress_logs(enabled: bool = True):
    """Send ``hf_qknorm.conversion`` INFO lines to stderr (for the command line) for the duration of the block, once;
    the handler is removed after it, so a program that runs the command line in-process keeps its logger as it was."""
    if not enabled or any(getattr(h, "_hf_qknorm", False) for h in logger.handlers):
        yield
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(message)s", "%H:%M:%S"))
    handler._hf_qknorm = True
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
