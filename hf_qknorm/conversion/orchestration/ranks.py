"""The processes of a conversion launched with ``torchrun`` or ``accelerate launch``: who am I, who is first, exchange.

A conversion runs the same on every rank and splits only work whose result does not depend on the split: the
self-generated heal text (batch ``b`` on rank ``b % world``, :mod:`hf_qknorm.conversion.healing.selftext`) and the
layer-wise healing fits (layer ``i`` on rank ``i % world``, :mod:`hf_qknorm.conversion.healing.heal`). Results travel as
picklable CPU objects (``all_gather_object`` / ``broadcast_object_list``), so gloo and nccl both carry them and every
rank ends with the same values, bit for bit, as one process computes. Without an initialised process group every
function here is the single process's no-op: rank 0 of a world of 1.

:func:`process_group` is what the command line (and :func:`hf_qknorm.convert`) use: when the launcher's environment
says ``WORLD_SIZE > 1`` and nobody initialised a group, it initialises one for the conversion (gloo on the CPU, nccl
with ``cuda:LOCAL_RANK`` on CUDA) and destroys it at the end.
"""

from __future__ import annotations

import datetime
import os
from contextlib import contextmanager

import torch

__all__ = [
    "FirstRankFailed",
    "all_in_order",
    "barrier",
    "broadcast",
    "first",
    "launched_rank",
    "launched_world",
    "local_cuda_index",
    "process_group",
    "rank",
    "world",
]

# The process group's timeout (the one :func:`process_group` creates): the longest a rank waits for the others --
# the other ranks wait while rank 0 alone writes, verifies and uploads the folder, or runs the end-to-end stage. A
# rank that exits is noticed sooner: torchrun and accelerate launch stop the other ranks, and gloo fails the peers'
# pending exchanges when a connection closes.
TIMEOUT_S = 6 * 3600


class FirstRankFailed(RuntimeError):
    """Raised on the other ranks when the work :func:`first` gave rank 0 failed; ``original`` is rank 0's exception
    (or a ``RuntimeError`` with its message when it could not travel)."""

    def __init__(self, original: BaseException):
        super().__init__(f"rank 0 failed: {type(original).__name__}: {original}")
        self.original = original


def _dist():
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None


def world() -> int:
    """The number of processes of the initialised process group (1 without one)."""
    dist = _dist()
    return dist.get_world_size() if dist is not None else 1


def rank() -> int:
    """This process's rank in the initialised process group (0 without one)."""
    dist = _dist()
    return dist.get_rank() if dist is not None else 0


def all_in_order(mine: dict, n: int) -> list:
    """Items ``0 .. n-1``, each computed on one rank: ``mine`` maps the indices this rank computed to their items.
    Returns every item in index order on every rank (``all_gather_object``); one process returns ``mine``'s."""
    dist = _dist()
    if dist is None or dist.get_world_size() == 1:
        merged = mine
    else:
        parts = [None] * dist.get_world_size()
        dist.all_gather_object(parts, mine)
        merged = {k: v for part in parts for k, v in part.items()}
    missing = [i for i in range(n) if i not in merged]
    if missing:
        raise RuntimeError(f"no rank computed item {missing[0]} of {n}")
    return [merged[i] for i in range(n)]


def broadcast(obj, src: int = 0):
    """``obj`` as rank ``src`` has it, on every rank (``broadcast_object_list``); one process returns ``obj``."""
    dist = _dist()
    if dist is None or dist.get_world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def first(fn):
    """``fn()`` computed on rank 0 alone, its value returned on every rank (``broadcast_object_list``); while rank 0
    works the others wait. An ``Exception`` of ``fn`` on rank 0 is raised there and, as :class:`FirstRankFailed`, on
    the others; an interruption (``KeyboardInterrupt``, SIGTERM) is not sent -- every rank receives the signal
    from the launcher. One process: ``fn()``."""
    if world() == 1:
        return fn()
    if rank() != 0:
        ok, value = broadcast(None)
        if not ok:
            raise FirstRankFailed(value)
        return value
    try:
        value = fn()
    except Exception as exc:
        broadcast((False, _portable(exc)))
        raise
    broadcast((True, value))
    return value


def _portable(exc: Exception) -> BaseException:
    """``exc`` if it survives pickling, else a ``RuntimeError`` with its message."""
    import pickle

    try:
        return pickle.loads(pickle.dumps(exc))
    except Exception:
        return RuntimeError(f"{type(exc).__name__}: {exc}")


def barrier() -> None:
    """Wait for every rank (nothing without a process group)."""
    dist = _dist()
    if dist is not None and dist.get_world_size() > 1:
        dist.barrier()


def launched_rank() -> int:
    """The rank a launcher put in the environment (``RANK``; 0 without one)."""
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        raise ValueError(f"RANK must be an integer, got {os.environ['RANK']!r}") from None


def launched_world() -> int:
    """The world size a launcher (``torchrun``, ``accelerate launch``) put in the environment (1 without one)."""
    try:
        return int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        raise ValueError(f"WORLD_SIZE must be an integer, got {os.environ['WORLD_SIZE']!r}") from None


def local_cuda_index() -> int:
    """This process's CUDA device under a launcher: ``LOCAL_RANK``, refused with the way out when the machine has
    fewer CUDA devices than the launcher started processes on it (CUDA would say only "invalid device ordinal")."""
    raw = os.environ.get("LOCAL_RANK", "0")
    try:
        index = int(raw)
    except ValueError:
        raise ValueError(f"LOCAL_RANK must be an integer, got {raw!r}") from None
    count = torch.cuda.device_count()
    if not 0 <= index < count:
        raise ValueError(
            f"LOCAL_RANK {index}: this machine has {count} CUDA device(s), one per process on CUDA; launch at most "
            f"{count} process(es) per machine (--nproc_per_node / --num_processes) or calibrate on the CPU "
            "(--device cpu)"
        )
    return index


@contextmanager
def process_group(device):
    """A process group for the conversion while in the block, when the environment asks for one and none exists.

    ``device`` (the calibration device, a ``torch.device`` or string): CUDA picks nccl and ``cuda:LOCAL_RANK`` --
    the device the block yields -- anything else gloo. With a group already initialised (by the caller, by
    accelerate) or ``WORLD_SIZE`` unset or 1, nothing is initialised and ``device`` is yielded unchanged."""
    import torch.distributed as dist

    device = torch.device(device)
    if _dist() is not None or launched_world() == 1:
        yield device
        return
    if not dist.is_available():
        raise RuntimeError("WORLD_SIZE > 1 but this PyTorch build has no torch.distributed")
    if device.type == "cuda":
        device = torch.device("cuda", local_cuda_index())
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        backend = "gloo"
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=TIMEOUT_S))
    try:
        yield device
    finally:
        dist.destroy_process_group()
