"""A conversion stopped half-way: real ``hf-qknorm convert`` processes killed by SIGTERM, SIGINT and SIGKILL while a
shard is on disk in their temporary folder, and the next run's cleanup of what a killed run left (never the folder of
a conversion that is still running)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from hf_qknorm.cli.main import main
from hf_qknorm.conversion.orchestration import tempdirs
from tests._support.convert_support import leftovers, save_source

# The real command line, slowed down after the first shard is written so that the signal lands mid-write.
SLOW_CONVERT = textwrap.dedent("""
    import signal, sys, time
    # a shell's background job starts with SIGINT ignored, which the command respects (as under nohup): not here
    signal.signal(signal.SIGINT, signal.default_int_handler)
    from pathlib import Path
    import hf_qknorm.conversion.output.shards as shards
    ready, real = Path(sys.argv[1]), shards._save

    def slow_save(*args):
        real(*args)
        ready.write_text("a shard is written")
        time.sleep(300)

    shards._save = slow_save
    from hf_qknorm.cli.main import main
    sys.exit(main(sys.argv[2:]))
""")


def _start(tmp_path: Path, dst: Path) -> tuple[subprocess.Popen, Path]:
    save_source(tmp_path / "src", "llama", max_shard_size="40KB")
    (tmp_path / "slow.py").write_text(SLOW_CONVERT)
    ready = tmp_path / "ready"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[2]), os.environ.get("PYTHONPATH", "")]),
    }
    proc = subprocess.Popen(
        [
            sys.executable,
            str(tmp_path / "slow.py"),
            str(ready),
            "convert",
            str(tmp_path / "src"),
            str(dst),
            "--no-calibration",
            "--quiet",
            "--verify",
            "plugin",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    deadline = time.time() + 300
    while not ready.exists():
        if proc.poll() is not None or time.time() > deadline:
            proc.kill()
            pytest.fail(f"the conversion never wrote a shard: {proc.communicate()}")
        time.sleep(0.1)
    return proc, ready


@pytest.mark.spawns
@pytest.mark.parametrize("signum,status", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_stop_signal_cleans_up_and_says_so(tmp_path, signum, status):
    dst = tmp_path / "out"
    proc, _ = _start(tmp_path, dst)
    assert any(any((tmp_path / name).glob("*.safetensors")) for name in leftovers(tmp_path))  # mid-write
    proc.send_signal(signum)
    _, err = proc.communicate(timeout=120)
    lines = [line for line in err.strip().splitlines() if line.strip()]
    assert proc.returncode == status and len(lines) == 1, err
    name = "SIGTERM" if signum == signal.SIGTERM else "interrupted"
    assert lines[0].startswith("error: ") and name in lines[0] and "nothing half-written was left" in lines[0]
    assert not dst.exists() and leftovers(tmp_path) == []


@pytest.mark.spawns
def test_sigkill_leftovers_are_removed_by_the_next_run(tmp_path, capsys):
    dst = tmp_path / "out"
    proc, _ = _start(tmp_path, dst)
    proc.kill()  # SIGKILL: no code runs
    proc.communicate(timeout=120)
    stale = leftovers(tmp_path)
    assert len(stale) == 1 and any((tmp_path / stale[0]).glob("*.safetensors"))
    assert stale[0].startswith(f".out.tmp-{proc.pid}.")
    live = tmp_path / f".other.tmp-{tempdirs._owner_tag()}-running1"  # a conversion of this very process
    live.mkdir()
    code = main(["convert", str(tmp_path / "src"), str(dst), "--no-calibration", "--quiet", "--verify", "plugin"])
    out = capsys.readouterr().out
    assert code == 0 and (dst / "model.safetensors.index.json").is_file()
    assert (
        f"removed {tmp_path / stale[0]}, left by an interrupted conversion (process {proc.pid}, no longer "
        f"running)" in out
    )
    assert leftovers(tmp_path) == [live.name]  # still running: kept


def _dead_pid() -> int:
    proc = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    return int(proc.stdout)


@pytest.mark.spawns
def test_remove_stale_keeps_what_may_be_running(tmp_path):
    machine = tempdirs._machine()
    me, start = os.getpid(), tempdirs._start_ticks(os.getpid()) or 0
    dead = _dead_pid()
    names = {
        "dead": f".a.tmp-{dead}.1@{machine}-abcd1234",
        "running": f".b.tmp-{me}.{start}@{machine}-abcd1234",
        "other machine": f".c.tmp-{dead}.1@{'0' * 12}-abcd1234",
        "not ours": ".d.tmp-abcd1234",
    }
    if start:  # where start times are known, a reused PID is told apart from its first owner
        names["reused pid"] = f".e.tmp-{me}.{start + 1}@{machine}-abcd1234"
    for name in names.values():
        (tmp_path / name).mkdir()
        (tmp_path / name / "model.safetensors").write_bytes(b"partial")
    # an --overwrite killed between its two renames: the previous destination is put back
    old = tmp_path / f".f.old-{dead}.1@{machine}-abcd1234"
    (old / "previous").mkdir(parents=True)
    (old / "previous" / "config.json").write_text("{}")
    # killed after the swap: the new destination is in place, the moved-aside old one is removed
    done = tmp_path / f".g.old-{dead}.1@{machine}-abcd1234"
    (done / "previous").mkdir(parents=True)
    (tmp_path / "g").mkdir()
    lines = tempdirs.remove_stale(tmp_path)
    remaining = sorted(p.name for p in tmp_path.iterdir())
    assert remaining == sorted([names["running"], names["other machine"], names["not ours"], "f", "g"])
    assert (tmp_path / "f" / "config.json").read_text() == "{}"
    assert any(line.startswith(f"restored {tmp_path / 'f'}") for line in lines)
    assert sum(line.startswith("removed ") for line in lines) == len(lines) - 1 == 3 + ("reused pid" in names)


@pytest.fixture
def python_sigint():
    """Python's own SIGINT handler for the test (a shell's background job starts with SIGINT ignored)."""
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, before)


def test_signal_guard_defers_inside_the_critical_section(python_sigint):
    with tempdirs.stop_signals_raise() as guard:
        if not guard.saved:
            pytest.skip("signal handlers are not the defaults here")
        with pytest.raises(tempdirs.Terminated) as info:
            with guard.critical():
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(0.05)
                survived = True  # the signal arrived, but the section ran to its end
        assert survived and info.value.code == 143
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1)
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
