"""Overhead of the attention-logit monitor (``QKMonitorCallback``) on ``Trainer`` step time.

For each case (scheme x model size) the same short training run is timed with the monitor off and on (measuring
every ``--every`` steps), alternating off/on ``--repeats`` times so that a busy machine disturbs both alike. Step
time is the wall time between consecutive ``on_step_end`` events, taken by a callback that runs after the monitor,
so the monitor's own work (attaching, the statistics, detaching, ``Trainer.log``) is inside it. Two estimates:

* ``paired``: in the monitored runs, the extra time of a recorded step over the median unrecorded step of the same
  run, divided by ``every`` unrecorded steps -- the monitor's share of step time; robust to machine load.
* ``a/b``: mean step time of a monitored run over that of the unmonitored run just before it (median over the
  ``--repeats`` pairs); noisier.

Rows are appended to ``benchmarks/results/monitor.jsonl`` (machine, versions, command) and the table
``benchmarks/results/monitor.md`` is rewritten from all rows.

    python benchmarks/bench_monitor.py                         # CPU: schemes qk_norm_cap, qk_norm, none
    python benchmarks/bench_monitor.py --hidden 1024 --layers 8 --heads 16 --context 1024 --device cuda
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_BF16")

RESULTS = Path(__file__).parent / "results"
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def parse_args(argv=None):
    from hf_qknorm.cli.help import DefaultsFormatter

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=DefaultsFormatter)
    p.add_argument(
        "--schemes",
        nargs="+",
        default=["qk_norm_cap", "qk_norm", "none"],
        help="'none' is the unpatched model (the monitor uses forward hooks there)",
    )
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=30, help="timed steps per run (after --warmup)")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--every", type=int, default=10, help="the monitor's period N")
    p.add_argument("--repeats", type=int, default=5, help="off/on pairs")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--no-save", action="store_true", help="print only")
    return p.parse_args(argv)


class StepClock:
    """Wall time between consecutive step ends (runs after the monitor's on_step_end)."""

    def __init__(self):
        from transformers import TrainerCallback

        self.times, self.last = [], None
        clock = self

        class _CB(TrainerCallback):
            def on_step_end(self, args, state, control, **kw):
                import torch

                if torch.cuda.is_available():
                    torch.cuda.synchronize()
                now = time.perf_counter()
                if clock.last is not None:
                    clock.times.append((state.global_step, now - clock.last))
                clock.last = now

        self.callback = _CB()


def one_run(args, scheme: str, monitored: bool) -> list[tuple[int, float]]:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

    import hf_qknorm

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=2048,
        hidden_size=args.hidden,
        intermediate_size=4 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        max_position_embeddings=args.context,
    )
    model = LlamaForCausalLM(config).to(args.device, getattr(torch, args.dtype))
    if scheme != "none":
        hf_qknorm.patch_model(model, scheme)
    ids = torch.randint(0, 2048, (args.batch * (args.steps + args.warmup + 1), args.context))
    data = [{"input_ids": row, "labels": row} for row in ids]
    targs = TrainingArguments(
        output_dir="/tmp/bench_monitor",
        max_steps=args.steps + args.warmup + 1,
        per_device_train_batch_size=args.batch,
        learning_rate=1e-3,
        logging_steps=10**6,
        save_strategy="no",
        report_to="none",
        use_cpu=args.device == "cpu",
        disable_tqdm=True,
        dataloader_num_workers=0,
        seed=0,
    )
    trainer = Trainer(model=model, args=targs, train_dataset=data)
    if monitored:
        hf_qknorm.QKMonitorCallback.attach(trainer, every=args.every)
    clock = StepClock()
    trainer.add_callback(clock.callback)  # after the monitor: its on_step_end work is timed
    trainer.train()
    return [(step, t) for step, t in clock.times if step > args.warmup + 1]


def measure(args, scheme: str) -> dict:
    off_means, on_means, paired, ratios = [], [], [], []
    recorded, unrecorded = [], []
    for _ in range(args.repeats):
        off = one_run(args, scheme, monitored=False)
        on = one_run(args, scheme, monitored=True)
        off_means.append(statistics.fmean(t for _, t in off))
        on_means.append(statistics.fmean(t for _, t in on))
        ratios.append(on_means[-1] / off_means[-1] - 1.0)
        rec = [t for step, t in on if (step - 1) % args.every == 0]  # global_step k ends the step begun at k-1
        plain = [t for step, t in on if (step - 1) % args.every != 0]
        base = statistics.median(plain)
        paired.append(statistics.fmean(t - base for t in rec) / (args.every * base))
        recorded += rec
        unrecorded.append(base)
    off_m, on_m = statistics.median(off_means), statistics.median(on_means)
    return {
        "step_ms_off": 1e3 * off_m,
        "step_ms_on": 1e3 * on_m,
        "recorded_step_ms": 1e3 * statistics.median(recorded),
        "unrecorded_step_ms": 1e3 * statistics.median(unrecorded),
        "overhead_paired": statistics.median(paired),
        "overhead_ab": statistics.median(ratios),
    }


def machine() -> dict:
    import torch
    import transformers

    dev = torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor() or platform.machine()
    return {
        "host_cpus": os.cpu_count(),
        "device_name": dev,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
    }


def write_markdown(rows: list[dict]) -> None:
    lines = [
        "# Attention-logit monitor overhead",
        "",
        "`QKMonitorCallback(every=N)` in a `Trainer` run: step time with the monitor off and on. `paired` is the",
        "extra time of a recorded step over the median unrecorded step of the same run, divided by N steps",
        "(the monitor's share of step time); `a/b` compares the mean step time of a monitored run with the",
        "unmonitored run just before it (median over pairs; noisier on a busy machine). Generated by",
        "`benchmarks/bench_monitor.py` from `monitor.jsonl`.",
        "",
        "| date | device | threads | scheme | model (hidden x layers, heads/kv) | batch x context | N | "
        "step off (ms) | step on (ms) | recorded step (ms) | overhead paired | overhead a/b |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['date'][:10]} | {r['device']} ({r['device_name']}) | {r['threads']} | {r['scheme']} | "
            f"{r['hidden']} x {r['layers']}, {r['heads']}/{r['kv_heads']} | {r['batch']} x {r['context']} | "
            f"{r['every']} | {r['step_ms_off']:.1f} | {r['step_ms_on']:.1f} | {r['recorded_step_ms']:.1f} | "
            f"{100 * r['overhead_paired']:.2f}% | {100 * r['overhead_ab']:.2f}% |"
        )
    (RESULTS / "monitor.md").write_text("\n".join(lines) + "\n")


def main(argv=None):
    args = parse_args(argv)
    import torch
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    torch.set_num_threads(args.threads)
    base = {
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        **machine(),
        "device": args.device,
        "threads": args.threads,
        "dtype": args.dtype,
        "hidden": args.hidden,
        "layers": args.layers,
        "heads": args.heads,
        "kv_heads": args.kv_heads,
        "context": args.context,
        "batch": args.batch,
        "steps": args.steps,
        "every": args.every,
        "repeats": args.repeats,
        "command": "python " + " ".join([os.path.relpath(__file__)] + (argv or sys.argv[1:])),
    }
    rows = []
    for scheme in args.schemes:
        row = {**base, "scheme": scheme, **measure(args, scheme)}
        rows.append(row)
        print(
            json.dumps(
                {
                    k: (round(v, 4) if isinstance(v, float) else v)
                    for k, v in row.items()
                    if k
                    in ("scheme", "step_ms_off", "step_ms_on", "recorded_step_ms", "overhead_paired", "overhead_ab")
                }
            ),
            flush=True,
        )
    if not args.no_save:
        RESULTS.mkdir(parents=True, exist_ok=True)
        with open(RESULTS / "monitor.jsonl", "a") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
        all_rows = [json.loads(line) for line in (RESULTS / "monitor.jsonl").read_text().splitlines() if line]
        write_markdown(all_rows)


if __name__ == "__main__":
    main()
