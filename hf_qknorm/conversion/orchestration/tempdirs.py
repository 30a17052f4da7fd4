"""The temporary folders a conversion writes into, and what happens to them when the process is stopped.

A conversion writes into a hidden folder beside its destination and renames it into place when complete
(:func:`staging`). Three ways a process can stop half-way:

- SIGINT (Ctrl-C) raises ``KeyboardInterrupt`` and SIGTERM (``kill``, a job scheduler, ``docker stop``) raises
  :class:`Terminated` in the main thread (:func:`stop_signals_raise`), so the cleanup code runs and the temporary
  folder is removed. The few statements that swap an existing destination out (``--overwrite``) run with both
  signals deferred (:meth:`SignalGuard.critical`), so a signal never lands between two renames.
- SIGKILL (or a power cut) runs no code at all. The temporary folder's name records its owner -- the process id,
  the process's start time and a hash of the machine and PID namespace -- so the next conversion into the same
  parent folder removes the folders whose owner is gone (:func:`remove_stale`, with a log line for each) and never
  touches one that belongs to a conversion still running, here or on another machine sharing the folder.
"""

from __future__ import annotations

import errno
import hashlib
import os
import re
import shutil
import signal
import socket
import tempfile
import threading
from contextlib import contextmanager
from pathlib import Path

__all__ = ["SignalGuard", "Terminated", "check_writable", "make_temp", "remove_stale", "staging", "stop_signals_raise"]

# .<dst name>.<tmp|old>-<pid>.<start ticks>@<machine>-<mkdtemp's random suffix>
_NAME = re.compile(
    r"^\.(?P<dst>.+)\.(?P<kind>tmp|old)-(?P<pid>\d+)\.(?P<start>\d+)@(?P<machine>[0-9a-f]{12})-"
    r"[A-Za-z0-9_]+$"
)


class Terminated(SystemExit):
    """SIGTERM arrived while a conversion was writing. A ``SystemExit`` (status 143 = 128 + SIGTERM), so a program
    that does not catch it exits quietly with that status after the cleanup has run."""

    def __init__(self, signum: int = signal.SIGTERM):
        super().__init__(128 + signum)
        self.signum = signum

    def __str__(self) -> str:
        return f"terminated by {signal.Signals(self.signum).name}"


# --------------------------------------------------------------------------------------------------------------------
# owners
# --------------------------------------------------------------------------------------------------------------------
def _start_ticks(pid: int) -> int | None:
    """Start time of process ``pid`` in clock ticks since boot (Linux ``/proc``); None where unknown."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    try:  # the command name (field 2) may contain spaces and parentheses: split after its closing one
        return int(stat[stat.rindex(")") + 2 :].split()[19])
    except (ValueError, IndexError):
        return None


def _machine() -> str:
    """12 hex digits naming this machine, boot and PID namespace: a PID means the same process only within them
    (two containers on one host, or two hosts sharing a network folder, can both have a process 1234)."""
    parts = [socket.gethostname()]
    for path in ("/proc/sys/kernel/random/boot_id", "/proc/self/ns/pid"):
        try:
            parts.append(Path(path).read_text().strip() if "boot_id" in path else str(os.stat(path).st_ino))
        except OSError:
            parts.append("-")
    return hashlib.sha1("|".join(parts).encode()).hexdigest()[:12]


def _owner_tag() -> str:
    return f"{os.getpid()}.{_start_ticks(os.getpid()) or 0}@{_machine()}"


def _owner_gone(pid: int, start: int, machine: str) -> bool:
    """True only when the owner is certainly not running: same machine and namespace, and no process ``pid``, or
    a process ``pid`` that started at another time (the id was reused)."""
    if machine != _machine():
        return False  # cannot see that process: assume it is running
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # exists, owned by another user
        pass
    now = _start_ticks(pid)
    return bool(start) and now is not None and now != start


def make_temp(dst: Path, kind: str = "tmp") -> Path:
    """A new empty hidden folder beside ``dst`` named after this process (``kind``: ``tmp`` for the output being
    written, ``old`` for a destination being swapped out). An ``OSError`` names the folder it could not write."""
    dst = Path(dst)
    try:
        return Path(tempfile.mkdtemp(prefix=f".{dst.name}.{kind}-{_owner_tag()}-", dir=dst.parent))
    except OSError as exc:
        raise OSError(exc.errno, f"cannot create a folder in {dst.parent}: {exc.strerror}") from None


def check_writable(dst: Path) -> None:
    """Fail now -- not after an hour of calibration -- when a folder cannot be created where ``dst`` goes: a
    read-only file system, no permission, a file in the way. Creates and removes one empty folder."""
    dst = Path(dst)
    existing = next(p for p in [dst.parent, *dst.parent.parents] if p.exists())
    if not existing.is_dir():
        raise FileExistsError(f"cannot write {dst}: {existing} is a file, not a folder")
    try:
        probe = tempfile.mkdtemp(prefix=f".{dst.name}.tmp-{_owner_tag()}-", dir=existing)
    except OSError as exc:
        raise _write_error(exc, dst) from None
    os.rmdir(probe)


def remove_stale(parent: Path, log=None) -> list[str]:
    """Remove the temporary folders in ``parent`` left by conversions that were killed (their owner is gone).

    An ``old`` folder is a destination that an ``--overwrite`` had moved aside: if the destination is missing (the
    process died between the two renames) it is put back, else it is removed. Folders of running conversions, of
    other machines, and anything not named by :func:`make_temp` are left alone. Returns what was done, one line each
    (also passed to ``log``). Never raises: a folder that cannot be removed is reported and left."""
    done = []
    try:
        entries = sorted(Path(parent).iterdir())
    except OSError:
        return done
    for path in entries:
        m = _NAME.match(path.name)
        if not m or not path.is_dir() or not _owner_gone(int(m["pid"]), int(m["start"]), m["machine"]):
            continue
        why = f"left by an interrupted conversion (process {m['pid']}, no longer running)"
        try:
            previous, dst = path / "previous", path.parent / m["dst"]
            if m["kind"] == "old" and previous.is_dir() and not dst.exists():
                os.replace(previous, dst)
                done.append(f"restored {dst} from {path.name}, {why}")
            shutil.rmtree(path)
            done.append(f"removed {path}, {why}")
        except OSError as exc:
            done.append(f"could not remove {path} ({why}): {exc}")
    for line in done:
        if log is not None:
            log(line)
    return done


@contextmanager
def staging(dst: Path, overwrite: bool = True, log=None):
    """Yield a temporary folder beside ``dst``; on success it is renamed to ``dst`` (replacing an existing one only
    with ``overwrite``), on any error -- SIGINT and SIGTERM included -- it is removed together with any parent
    folders this created. Temporary folders of earlier conversions that were killed are removed first (said in
    ``log``); see :mod:`hf_qknorm.conversion.orchestration.tempdirs`. A write error names ``dst`` and says it is
    unchanged."""
    created = [p for p in [dst.parent, *dst.parent.parents] if not p.exists()]
    try:
        dst.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise _write_error(exc, dst) from None
    remove_stale(dst.parent, log)
    with stop_signals_raise() as guard:
        try:
            tmp = make_temp(dst)
        except OSError:
            _remove_created(created)
            raise
        try:
            yield tmp
            os.chmod(tmp, 0o755)
            with guard.critical():  # no signal between the renames
                if dst.exists() and not overwrite:
                    raise FileExistsError(
                        f"destination {dst} appeared while converting; nothing was replaced "
                        "(pass overwrite=True / --overwrite to replace it)"
                    )
                if dst.exists():  # --overwrite: swap the old folder out only now that the new one is complete
                    old = make_temp(dst, "old")
                    os.replace(dst, old / "previous")
                    try:
                        os.replace(tmp, dst)
                    except BaseException:
                        os.replace(old / "previous", dst)
                        shutil.rmtree(old, ignore_errors=True)
                        raise
                    shutil.rmtree(old, ignore_errors=True)
                else:
                    os.replace(tmp, dst)
        except BaseException as exc:
            with guard.critical():  # a second signal must not cut the cleanup short
                shutil.rmtree(tmp, ignore_errors=True)
                _remove_created(created)
            if (
                isinstance(exc, OSError)
                and exc.errno is not None
                and (exc.filename is None or str(exc.filename).startswith((str(tmp), str(dst))))
            ):
                raise _write_error(exc, dst) from exc
            raise


def _remove_created(created: list[Path]) -> None:
    for p in created:  # innermost first
        try:
            p.rmdir()
        except OSError:
            break


def _write_error(exc: OSError, dst: Path) -> OSError:
    """``exc`` (a full disk, a read-only file system...) as one line that names the destination."""
    name = errno.errorcode.get(exc.errno, str(exc.errno))
    return OSError(
        exc.errno, f"cannot write {dst}: {exc.strerror or exc} ({name}); nothing was left behind and {dst} is unchanged"
    )


# --------------------------------------------------------------------------------------------------------------------
# signals
# --------------------------------------------------------------------------------------------------------------------
class SignalGuard:
    """While active: SIGTERM raises :class:`Terminated`; SIGINT raises ``KeyboardInterrupt`` as usual; inside
    :meth:`critical` both are deferred to its end."""

    def __init__(self):
        self.depth = 0
        self.pending: int | None = None
        self.saved: dict[int, object] = {}

    def _handle(self, signum, frame):
        if self.depth:
            self.pending = self.pending or signum
            return
        raise Terminated(signum) if signum != signal.SIGINT else KeyboardInterrupt()

    @contextmanager
    def critical(self):
        self.depth += 1
        try:
            yield
        finally:
            self.depth -= 1
        if not self.depth and self.pending is not None:
            signum, self.pending = self.pending, None
            raise Terminated(signum) if signum != signal.SIGINT else KeyboardInterrupt()


_ACTIVE: SignalGuard | None = None


@contextmanager
def stop_signals_raise():
    """Yield a :class:`SignalGuard`. Handlers are installed only in the main thread and only over the defaults
    (SIGTERM's ``SIG_DFL``, SIGINT's ``default_int_handler``): a program with its own handlers keeps them. Nested
    uses share the outer guard (the command line installs one for a whole run, the converter one for its writing).
    The previous handlers are restored on exit."""
    global _ACTIVE
    if _ACTIVE is not None:
        yield _ACTIVE
        return
    guard = SignalGuard()
    if threading.current_thread() is threading.main_thread():
        for signum, default in ((signal.SIGTERM, signal.SIG_DFL), (signal.SIGINT, signal.default_int_handler)):
            if signal.getsignal(signum) is default:
                guard.saved[signum] = signal.signal(signum, guard._handle)
    _ACTIVE = guard if guard.saved else None
    try:
        yield guard
    finally:
        _ACTIVE = None if _ACTIVE is guard else _ACTIVE
        for signum, previous in guard.saved.items():
            signal.signal(signum, previous)
