"""The instruction-count benchmark: how it reads callgrind's dumps, its refusal without valgrind, and a stopped
run. (A counted run takes minutes under valgrind: it is run by hand, its rows are in
benchmarks/results/decode.jsonl.)"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import bench_decode
import count_decode


def _dump(folder: Path, part: int, tag: str, total: int) -> None:
    (folder / f"cg.out.{part}").write_text(
        f"# callgrind format\nversion: 1\npart: {part}\n\ndesc: I1 cache: \ndesc: Timerange: Basic block 1 - 2\n"
        f"desc: Trigger: dump {tag}\n\npositions: line\nevents: Ir\nsummary: {total}\n\nfn=(1) f\n0 {total}\n"
        f"totals: {total}\n"
    )


def test_counts_are_read_between_each_providers_two_dumps(tmp_path):
    """A dump holds what ran since the one before: a provider's count is its ``after:`` dump's; the warm-up (before
    the first dump), ``before:`` dumps and the end of the program are not counted."""
    (tmp_path / "cg.out").write_text("desc: Trigger: Program termination\nsummary: 999\n")
    for part, (tag, total) in enumerate(
        [("before:sdpa", 5_000_000_000), ("after:sdpa", 1000), ("before:qk_norm", 7), ("after:qk_norm", 1250)], 1
    ):
        _dump(tmp_path, part, tag, total)
    assert count_decode._counts(tmp_path) == {"sdpa": 1000, "qk_norm": 1250}


def test_rows_print_as_a_table():
    row = {"table": "instructions", "shape": "tiny", "cache": "dynamic", "batch": 1, "prompt": 32, "steps": 10,
           "sdpa_instructions": 6600000, "qk_norm_instr": 0.9473, "qk_norm_floor_instr": 0.9707}  # fmt: skip
    table = bench_decode.markdown([row])
    assert "| shape | batch | prompt | sdpa instructions/forward | `qk_norm` | `qk_norm_floor` |" in table
    assert "| tiny | 1 | 32 | 6600000 | 0.947x | 0.971x |" in table


def test_without_valgrind_it_says_so_and_exits_2(monkeypatch, capsys):
    monkeypatch.setattr(count_decode.shutil, "which", lambda tool: None)
    monkeypatch.setattr(sys, "argv", ["count_decode.py", "--no-save"])
    with pytest.raises(SystemExit) as exit_info:
        count_decode.main()
    assert exit_info.value.code == 2
    assert "needs valgrind and callgrind_control (Debian: apt-get install valgrind)" in capsys.readouterr().err


@pytest.mark.spawns
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_stopped_count_stops_its_counted_run_and_leaves_nothing(tmp_path, signum):
    """SIGINT or SIGTERM while valgrind runs: the counted run is killed (not left running), the dumps' folder removed,
    no row written, and the exit is 130 (one line, no traceback) or 143. A stand-in ``valgrind`` that only waits
    plays the counted run."""
    bin_dir, scratch, pid_file = tmp_path / "bin", tmp_path / "tmp", tmp_path / "valgrind.pid"
    bin_dir.mkdir()
    scratch.mkdir()
    for tool, body in (("valgrind", f'echo $$ > "{pid_file}"\nexec sleep 120\n'), ("callgrind_control", "exit 0\n")):
        (bin_dir / tool).write_text(f"#!/bin/sh\n{body}")
        (bin_dir / tool).chmod(0o755)
    script = Path(__file__).resolve().parents[2] / "benchmarks" / "count_decode.py"
    results = bench_decode.RESULTS.read_bytes() if bench_decode.RESULTS.exists() else None
    env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", TMPDIR=str(scratch))
    # SIGINT at its default in the child whatever this process inherited: a suite started as a background job of a
    # shell without job control runs with SIGINT ignored, which the script respects (as under nohup), and then the
    # signal this test sends would do nothing
    proc = subprocess.Popen(
        [sys.executable, str(script)],
        env=env,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        deadline = time.monotonic() + 120
        while not (pid_file.exists() and pid_file.read_text().strip()):
            assert proc.poll() is None and time.monotonic() < deadline, "the counted run never started"
            time.sleep(0.05)
        valgrind = int(pid_file.read_text())
        proc.send_signal(signum)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == (130 if signum == signal.SIGINT else 143), (proc.returncode, err)
    assert "Traceback" not in err, err
    if signum == signal.SIGINT:
        assert err.strip() == "count_decode.py: interrupted; the counted run was stopped and nothing was written"
    with pytest.raises(ProcessLookupError):
        os.kill(valgrind, 0)  # killed and reaped by the benchmark, not left running
    assert list(scratch.iterdir()) == []
    assert (bench_decode.RESULTS.read_bytes() if bench_decode.RESULTS.exists() else None) == results
