"""Shared fixtures: tiny models built from configs (no downloads), the ``cuda`` marker, and the ``spawns`` marker
checked: a test that starts a process (a subprocess, a torch.distributed worker, a fresh interpreter) must say so."""

from __future__ import annotations

import os
import sys

# Some virtual machines advertise AMX but trap on it: oneDNN's bf16 kernels then die with "Illegal instruction".
# Capping oneDNN at AVX-512 BF16 keeps bf16 tests running everywhere (read at oneDNN's first use).
os.environ.setdefault("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_BF16")

import pytest  # noqa: E402
import torch  # noqa: E402

# Triton kernels run on CPU through the interpreter; it must be chosen before triton is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Tiny models: thread start-up costs more than the work, and a second thread contends badly on small machines.
torch.set_num_threads(1)


class _Spawns:
    """Counts the processes this interpreter starts: subprocess and multiprocessing's ``spawn``/``forkserver`` go
    through ``_posixsubprocess.fork_exec`` (or ``os.posix_spawn``), a ``fork`` start through ``os.fork``. A ``git``
    call (milliseconds: the docs' checks list the repository's files) and ``fc-list`` (matplotlib runs it twice when
    it builds its font cache, in whichever test first draws a plot on a machine without that cache: a clean CI
    machine) do not count; an interpreter, a shell script or a torch.distributed worker (seconds: each imports torch)
    does."""

    count = 0
    CHEAP = frozenset({"git", "fc-list"})
    # Triton compiling a kernel for a GPU runs its toolchain (ldconfig to find libcuda, the C compiler for the
    # launcher, ptxas for the cubin) once per kernel variant and caches the result: a JIT detail of whichever test
    # first launches that variant, not a process the test starts (under the interpreter, CI's mode, it runs none)
    TOOLCHAIN = os.sep + "triton" + os.sep

    @classmethod
    def _from_toolchain(cls) -> bool:
        frame = sys._getframe(2)
        while frame is not None:
            if cls.TOOLCHAIN in frame.f_code.co_filename:
                return True
            frame = frame.f_back
        return False

    @classmethod
    def install(cls):
        import _posixsubprocess
        import subprocess

        def counted(fn, argv_at):
            def wrapper(*args, **kwargs):
                argv = args[argv_at] if len(args) > argv_at else None
                program = os.path.basename(os.fsdecode(argv[0])) if argv else ""
                if program not in cls.CHEAP and not cls._from_toolchain():
                    cls.count += 1
                return fn(*args, **kwargs)

            return wrapper

        _posixsubprocess.fork_exec = counted(_posixsubprocess.fork_exec, 0)
        if hasattr(subprocess, "_fork_exec"):  # subprocess binds its own name for it
            subprocess._fork_exec = counted(subprocess._fork_exec, 0)
        os.fork = counted(os.fork, 99)
        for name in ("posix_spawn", "posix_spawnp"):  # subprocess's other way to start a program: (path, argv, env)
            if hasattr(os, name):
                setattr(os, name, counted(getattr(os, name), 1))


if os.name == "posix":
    _Spawns.install()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    before = _Spawns.count
    try:
        return (yield)
    finally:
        item.stash[_STARTED] = _Spawns.count - before  # a fixture's processes count for the first test that needs it


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    """A test that starts a process (in its body or its fixtures' set-up) without the ``spawns`` marker fails, and so
    does a marked one that passed without starting any, unless marked ``spawns(shared=True)`` (tests that share one
    launch, started by the first of them that runs). The marker is what lets ``-m "not spawns"`` give the quick
    in-process suite, so it must be true both ways."""
    before = _Spawns.count
    result = yield  # a failing or skipped test raises here and is reported as it is
    started = item.stash.get(_STARTED, 0) + _Spawns.count - before
    if os.name != "posix":
        return result
    marker = item.get_closest_marker("spawns")
    if started and marker is None:
        pytest.fail(f"{item.nodeid} started {started} process(es): mark it @pytest.mark.spawns", pytrace=False)
    if marker is not None and not started and not marker.kwargs.get("shared"):
        pytest.fail(f"{item.nodeid} is marked spawns but started no process: drop the marker", pytrace=False)
    return result


_STARTED = pytest.StashKey[int]()


# The test files that take longest (a minute or more of one worker on a 2-core machine, scripts/test.sh's
# --durations): collected first, so that pytest-xdist's workers, which take files in collection order, start on them
# and end on short files together instead of one waiting for the other's long file.
LONGEST_FIRST = (
    "tests/conversion/test_convert_every_type.py",
    "tests/kernels/test_kernels_compile.py",
    "tests/training/test_sharded.py",
    "tests/conversion/test_heal_distributed.py",
    "tests/modeling/test_telemetry.py",
    "tests/conversion/test_multimodal_convert.py",
    "tests/kernels/test_run_gpu.py",
)


def pytest_collection_modifyitems(config, items):
    rank = {path: i for i, path in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))  # stable: the rest keep their order
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """One intra-op thread for every test module, restored after it (a conversion or benchmark inside a test may
    change it): on a shared 2-core machine two threads make these small models 20-50x slower."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(autouse=True)
def seeded():
    """Torch's global generator seeded before every test: a test that draws from it sees the same numbers whichever
    tests ran before it in its process (scripts/test.sh spreads test files over worker processes)."""
    torch.manual_seed(0)


@pytest.fixture
def tiny():
    from tests._support.tiny_models import tiny_model

    return tiny_model


@pytest.fixture
def kernels_on_cpu():
    """For tests that push CPU tensors through the Triton kernels: those run only under Triton's interpreter
    (``TRITON_INTERPRET=1``, as CI and scripts/test.sh run), so elsewhere -- a GPU machine, where tests/kernels runs
    the kernels on CUDA -- the test is skipped with the reason, never run through a compiler that needs a GPU."""
    from hf_qknorm import kernels

    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("CPU tensors through the Triton kernels need TRITON_INTERPRET=1")
    if (reason := kernels.unavailable_reason()) is not None:
        pytest.skip(reason)
