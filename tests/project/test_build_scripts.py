"""scripts/_gguf_build.py: a real-model build interrupted by Ctrl-C or SIGTERM leaves neither its staging folder nor a
half-written model folder behind."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
# A process started in the background by a non-interactive shell (a CI job, `cmd &`) inherits SIGINT ignored, and
# Python then installs no KeyboardInterrupt handler; the child restores the handler an interactive Ctrl-C meets.
CHILD = """
import signal, sys, time
from pathlib import Path
signal.signal(signal.SIGINT, signal.default_int_handler)
sys.path.insert(0, sys.argv[1])
from _gguf_build import staged, terminate_as_exit
terminate_as_exit()
with staged(Path(sys.argv[2]) / "model") as tmp:
    (tmp / "part.safetensors").write_bytes(b"x")
    print("staged", flush=True)
    time.sleep(60)
"""


@pytest.mark.spawns
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_an_interrupted_build_leaves_nothing(tmp_path, sig):
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(SCRIPTS), str(tmp_path)], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout.readline().strip() == "staged"
    assert any(p.name.startswith(".model.tmp-") for p in tmp_path.iterdir())
    proc.send_signal(sig)
    proc.wait(timeout=30)
    time.sleep(0.1)
    assert proc.returncode != 0
    assert list(tmp_path.iterdir()) == []
