"""Instructions per decoding forward of patched models against the unpatched model on sdpa, counted by valgrind.

A shared machine's clock moves by several percent between runs, more than the host cost this project cuts per
change; an instruction count does not: the same code, inputs and hash seed count the same, whatever else runs
(``valgrind --tool=callgrind``, ``PYTHONHASHSEED=0``). What it does not see is time's other half -- cache misses,
which make code in a whole model cost more than in a loop -- so it ranks changes of host code, and the token table
(``bench_decode.py --table token``) says what they are worth in time.

It runs itself under callgrind: every provider (the unpatched model, each scheme, the ablations of
``bench_decode.py``) decodes one token at a time against a dynamic cache of ``prompt`` tokens cropped back after each
forward, as the token table does; callgrind's counters are dumped before and after ``--steps`` forwards of each. The
ratio is the unpatched model's instructions per forward over the provider's (above 1: fewer). Rows go to
``benchmarks/results/decode.jsonl`` (``"table": "instructions"``).

    python benchmarks/count_decode.py                                  # tiny shape, batch 1, prompt 32 (~5 min)
    python benchmarks/count_decode.py --schemes qk_norm qk_norm_floor --label mine

Needs valgrind (Debian: ``apt-get install valgrind``); it exits 2 saying so when it is missing. Stopped (SIGINT:
exit 130, SIGTERM: 143), it stops the counted run, removes the dumps and writes nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

# this folder's bench_decode: on the path however the script is started (python benchmarks/count_decode.py puts the
# folder there, runpy and importers do not)
sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_decode  # noqa: E402

from hf_qknorm.conversion.orchestration.tempdirs import stop_signals_raise


def _inner(args) -> None:
    """Under callgrind: build the providers, warm them, count ``--steps`` forwards of each between two dumps."""
    import torch

    torch.set_num_threads(1)

    def dump(tag: str) -> None:
        subprocess.run(["callgrind_control", "-d", tag, str(os.getpid())], check=True, capture_output=True)

    steps = bench_decode.token_steps(args.shape, args.batch, args.prompt, args.schemes, warm_up=5)
    with torch.no_grad():
        for name, step in steps.items():
            dump(f"before:{name}")
            for _ in range(args.steps):
                step()
            dump(f"after:{name}")


def _counts(folder: Path) -> dict[str, int]:
    """Instructions between each provider's two dumps: the dump files named ``after:<provider>`` (callgrind's
    ``desc: Trigger: dump <tag>``; a dump holds what ran since the one before)."""
    counts = {}
    for path in folder.glob("cg.out.*"):
        text = path.read_text(errors="replace")
        trigger = re.search(r"^desc: Trigger: dump after:(\S+)$", text, re.M)
        summary = re.search(r"^summary: (\d+)$", text, re.M)
        if trigger and summary:
            counts[trigger.group(1)] = int(summary.group(1))
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=tuple(bench_decode.SHAPES), default="tiny")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--steps", type=int, default=10)
    choices = (*bench_decode.SCHEMES, *bench_decode.ABLATIONS)
    parser.add_argument("--schemes", nargs="+", choices=choices, default=list(bench_decode.SCHEMES))
    parser.add_argument("--label", default="")
    parser.add_argument("--no-save", action="store_true")
    parser.add_argument("--inner", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.batch < 1 or args.prompt < 1 or args.steps < 1:
        parser.error(f"--batch, --prompt and --steps must be 1 or more, got {args.batch}, {args.prompt}, {args.steps}")
    if args.inner:
        _inner(args)
        return
    missing = [tool for tool in ("valgrind", "callgrind_control") if shutil.which(tool) is None]
    if missing:
        print(f"count_decode.py: needs {' and '.join(missing)} (Debian: apt-get install valgrind)", file=sys.stderr)
        sys.exit(2)
    # SIGINT and SIGTERM raise (stop_signals_raise): subprocess.run then kills the counted run, the dumps' folder is
    # removed and nothing is written; SIGTERM exits 143, SIGINT 130 with one line
    try:
        with stop_signals_raise() as guard, tempfile.TemporaryDirectory() as tmp:
            command = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={tmp}/cg.out", sys.executable,
                       __file__, *sys.argv[1:], "--inner"]  # fmt: skip
            env = dict(os.environ, PYTHONHASHSEED="0")
            # not subprocess.run: on KeyboardInterrupt it kills the child but waits for it only a quarter of a
            # second; and a signal while Popen starts the child (after the exec, before it returns) is held until
            # the child is known here, so that it is killed and waited for too
            run = None
            try:
                with guard.critical():
                    run = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                _, err = run.communicate()
            except BaseException:
                if run is not None:
                    run.kill()
                    run.wait()
                raise
            counts = _counts(Path(tmp))
    except KeyboardInterrupt:
        print("count_decode.py: interrupted; the counted run was stopped and nothing was written", file=sys.stderr)
        sys.exit(130)
    wanted = ["sdpa", *args.schemes]
    if run.returncode != 0 or set(counts) != set(wanted):
        print(err[-3000:], file=sys.stderr)
        print(
            f"count_decode.py: the counted run failed (exit {run.returncode}; counted {sorted(counts)})",
            file=sys.stderr,
        )
        sys.exit(1)
    per = {name: counts[name] / args.steps for name in wanted}
    row = {"table": "instructions", "shape": args.shape, "cache": "dynamic", "batch": args.batch,
           "prompt": args.prompt, "steps": args.steps, "sdpa_instructions": round(per["sdpa"])}  # fmt: skip
    row.update({f"{name}_instr": round(per["sdpa"] / per[name], 4) for name in args.schemes})
    row.update(bench_decode._environment(), label=args.label)
    print(json.dumps(row))
    print(bench_decode.markdown([row]))
    if not args.no_save:
        with bench_decode.RESULTS.open("a") as f:
            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
