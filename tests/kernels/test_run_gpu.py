"""benchmarks/run_gpu.sh --dry-run: every section of the GPU measuring command runs at a tiny size on CPU, and the
script stops loudly at the first failure."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "run_gpu.sh"


@pytest.mark.spawns
@pytest.mark.slow
def test_dry_run_runs_every_section():
    # the script calls python3: this interpreter's (the project's environment), not one without torch on the PATH
    env = dict(os.environ, OMP_NUM_THREADS="1", PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    res = subprocess.run(
        ["bash", str(SCRIPT), "--dry-run"], capture_output=True, text=True, env=env, timeout=600, check=False
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    for section in ("attention", "step", "token", "decode"):
        assert f"## {section} (limit" in res.stdout
    assert '"table": "step"' in res.stdout and '"table": "decode"' in res.stdout
    assert "# dry run: every section ran" in res.stdout


@pytest.mark.spawns
def test_script_is_strict():
    text = SCRIPT.read_text()
    assert "set -euo pipefail" in text and "trap collect EXIT" in text
    res = subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True, text=True, check=False)
    assert res.returncode == 0, res.stderr


@pytest.mark.spawns
def test_a_failing_section_is_named_and_the_run_goes_on(tmp_path):
    """A section that fails is named with its status on stderr, the later sections still run (device time is
    scarce), and the run exits with the first failing section's status."""
    bench = tmp_path / "benchmarks"
    bench.mkdir()
    (bench / "run_gpu.sh").write_text(SCRIPT.read_text())
    (bench / "bench_attention.py").write_text("import sys\nprint('attention ran')\nsys.exit(5)\n")
    (bench / "bench_norms.py").write_text("import sys\nprint('norms ran')\nsys.exit(4)\n")
    (bench / "bench_decode.py").write_text("import sys\nprint('decode ran', sys.argv[1:])\nsys.exit(3)\n")
    res = subprocess.run(
        ["bash", str(bench / "run_gpu.sh"), "--dry-run"], capture_output=True, text=True, timeout=60, check=False
    )
    assert res.returncode == 5, res.stderr
    assert "attention ran" in res.stdout and "norms ran" in res.stdout
    assert res.stdout.count("decode ran") == 5  # step, step with fused norms, compiled, token, decode
    sections = ("attention", 5), ("norms", 4), ("step", 3), ("step-fused-norms", 3), ("step-compiled", 3)
    for name, rc in (*sections, ("token", 3), ("decode", 3)):
        assert f"section {name} ended with exit status {rc}" in res.stderr
    assert "every section ran" not in res.stdout


@pytest.mark.spawns
def test_rows_measured_before_a_failure_are_kept(tmp_path):
    """The GPU run's rows up to the failure land in results/gpu/<date>-run.jsonl with the command and exit status."""
    import json

    bench = tmp_path / "benchmarks"
    (bench / "results").mkdir(parents=True)
    (bench / "run_gpu.sh").write_text(SCRIPT.read_text())
    (bench / "results" / "decode.jsonl").write_text('{"old": 1}\n')
    (bench / "bench_attention.py").write_text(
        "open('benchmarks/results/attention_gpu.jsonl', 'a').write('{\"provider\": \"sdpa\"}\\n')\n"
    )
    (bench / "bench_norms.py").write_text(
        "open('benchmarks/results/norms_gpu.jsonl', 'a').write('{\"kind\": \"rmsnorm\"}\\n')\n"
    )
    (bench / "bench_decode.py").write_text(
        "import sys\nopen('benchmarks/results/decode.jsonl', 'a').write('{\"table\": \"step\"}\\n')\nsys.exit(3)\n"
    )
    res = subprocess.run(
        ["bash", str(bench / "run_gpu.sh"), "mylabel"], capture_output=True, text=True, timeout=120, check=False
    )
    assert res.returncode == 3, res.stderr
    (run,) = (bench / "results" / "gpu").glob("*-run.jsonl")
    rows = [json.loads(line) for line in run.read_text().splitlines()]
    # every section ran: attention's row, the six decode sections' and the norms'
    assert [r.get("provider") or r.get("table") or r.get("kind") for r in rows] == ["sdpa"] + ["step"] * 6 + ["rmsnorm"]
    assert all(r["run_exit"] == 3 and r["command"] == "bash benchmarks/run_gpu.sh mylabel" for r in rows)


@pytest.mark.spawns
def test_rows_reach_out_after_every_section(tmp_path):
    """A device call cut off before the exit trap still returns the rows measured so far: after each section they
    are in $OUT/run-partial.jsonl (replaced by the day's file at the exit)."""
    import json

    bench = tmp_path / "benchmarks"
    (bench / "results").mkdir(parents=True)
    out = tmp_path / "out"
    out.mkdir()
    (bench / "run_gpu.sh").write_text(SCRIPT.read_text())
    (bench / "bench_attention.py").write_text(
        "open('benchmarks/results/attention_gpu.jsonl', 'a').write('{\"provider\": \"sdpa\"}\\n')\n"
    )
    (bench / "bench_norms.py").write_text("")
    (bench / "bench_decode.py").write_text(  # what $OUT holds when the next section starts
        "import os\np = os.path.join(os.environ['OUT'], 'run-partial.jsonl')\n"
        "open('seen.txt', 'a').write(open(p).read() if os.path.exists(p) else 'none\\n')\n"
    )
    res = subprocess.run(
        ["bash", str(bench / "run_gpu.sh"), "x"], capture_output=True, text=True, timeout=120, check=False,
        env={**os.environ, "OUT": str(out)}, cwd=tmp_path,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    first = json.loads((tmp_path / "seen.txt").read_text().splitlines()[0])
    assert first["provider"] == "sdpa" and first["run_exit"] is None
    assert not (out / "run-partial.jsonl").exists() and len(list(out.glob("*-run.jsonl"))) == 1
