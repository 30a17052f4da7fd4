"""Which converted attention layers cost a converted model its answers?

Loads an original folder and a converted (calibrated or healed) folder of it, and measures on the bundled agreement
prompts (:mod:`hf_qknorm.conversion.orchestration.agreement`: the original's greedy answers, 16 new tokens) how far
the converted model's next-token distribution along those answers is from the original's: mean KL (nats per token),
teacher-forced top-1 agreement and greedy prefix agreement. Then the same for the original with the converted
attention layers put in its place

* ``single``: one layer at a time (what that layer's conversion costs on its own), and
* ``upto``: layers ``0..i`` (how the cost builds up over depth),

and the original's top-1/top-2 logit margin where the converted model picks another token (near-ties flip first).
The converted layer is the converted model's attention module itself, so this works where that module computes in
the original's block (a ``qk_norm`` Llama written as Qwen3, Gemma 3 as Gemma 3). Rows go to
``benchmarks/results/heal_attribution.jsonl`` (one per run, every layer in it); docs/conversion.md reads them.

    python benchmarks/heal_attribution.py --src models/smollm2-135m --converted out/healed --threads 2
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

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "heal_attribution.jsonl"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--src", required=True, help="the original model folder")
    p.add_argument("--converted", required=True, help="a converted folder of it (hf-qknorm convert's output)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    p.add_argument("--new-tokens", type=int, default=16, help="tokens of each greedy answer (default 16)")
    p.add_argument("--results", default=str(RESULTS), help="JSONL file the row is appended to")
    p.add_argument("--no-save", action="store_true", help="do not append to the results file")
    p.add_argument("--note", default="", help="a note stored with the row (what the converted folder is)")
    return p.parse_args(argv)


def _fail(message: str) -> None:
    print(f"heal_attribution: {message}", file=sys.stderr)
    raise SystemExit(2)


def main(argv=None) -> int:
    args = parse_args(argv)
    for name in ("src", "converted"):
        if not (Path(getattr(args, name)) / "config.json").is_file():
            _fail(f"--{name} {getattr(args, name)!r} is not a model folder (no config.json)")
    if args.threads < 1 or args.new_tokens < 1:
        _fail(f"--threads and --new-tokens must be >= 1, got {args.threads} and {args.new_tokens}")

    import torch
    from torch.nn import functional as F
    from transformers import AutoTokenizer

    from hf_qknorm.conversion.orchestration.agreement import encode_prompt, load_prompts, reference_continuations
    from hf_qknorm.conversion.output.shards import load_pretrained
    from hf_qknorm.portable.layout import family_of, find_layers

    torch.set_num_threads(args.threads)
    t0 = time.time()
    tokenizer = AutoTokenizer.from_pretrained(args.src)
    original = load_pretrained(args.src, dtype=torch.float32).eval()
    converted = load_pretrained(args.converted, dtype=torch.float32).eval()
    try:
        family = family_of(original)
    except (TypeError, ValueError) as exc:
        _fail(f"cannot find the decoder layers of {type(original).__name__}: {exc}")
    blocks, new_blocks = find_layers(original, family), find_layers(converted, family)
    if len(blocks) != len(new_blocks):
        _fail(f"{len(blocks)} layers in --src, {len(new_blocks)} in --converted: not a conversion of it")
    prompts = load_prompts()
    refs = reference_continuations(original, tokenizer, prompts, args.new_tokens)
    seqs = [(encode_prompt(tokenizer, p), r) for p, r in zip(prompts, refs)]

    @torch.no_grad()
    def logits(model):
        out = []
        for ids, ref in seqs:
            x = torch.tensor([ids + ref])
            out.append(model(x, use_cache=False).logits[0, len(ids) - 1 : len(ids) - 1 + len(ref)].float())
        return out

    base = logits(original)

    def score(model) -> dict:
        hits, prefix, kl = [], [], []
        for (_, ref), a, b in zip(seqs, base, logits(model)):
            h = (b.argmax(-1) == torch.tensor(ref)).tolist()
            hits += h
            prefix.append((h.index(False) if False in h else len(h)) / len(ref))
            kl += F.kl_div(b.log_softmax(-1), a.log_softmax(-1), log_target=True, reduction="none").sum(-1).tolist()
        return {
            "kl": sum(kl) / len(kl),
            "top1": sum(hits) / len(hits),
            "prefix": sum(prefix) / len(prefix),
            "hits": hits,
        }

    def swapped(layers) -> dict:
        saved = [getattr(b, family.attention) for b in blocks]
        try:
            for j in layers:
                setattr(blocks[j], family.attention, getattr(new_blocks[j], family.attention))
            return score(original)
        finally:
            for b, a in zip(blocks, saved):
                setattr(b, family.attention, a)

    whole = score(converted)
    margins = []
    for a in base:
        top = a.topk(2, -1).values
        margins += (top[:, 0] - top[:, 1]).tolist()
    misses = [m for m, h in zip(margins, whole.pop("hits")) if not h]
    print(f"converted: KL {whole['kl']:.4f}, top-1 {100 * whole['top1']:.1f}%, prefix {100 * whole['prefix']:.1f}%")
    if misses:
        print(
            f"the original's top-1/top-2 logit margin: median {statistics.median(margins):.2f} over all "
            f"{len(margins)} positions, {statistics.median(misses):.2f} at the {len(misses)} the converted model misses"
        )
    layers = {"single": [], "upto": []}
    for mode in layers:
        for i in range(len(blocks)):
            s = swapped([i] if mode == "single" else range(i + 1))
            s.pop("hits")
            layers[mode].append(s)
            print(f"{mode} {i:3d}: KL {s['kl']:.4f}, top-1 {100 * s['top1']:.1f}%, prefix {100 * s['prefix']:.1f}%")
    row = {
        "src": os.path.abspath(args.src),
        "converted": os.path.abspath(args.converted),
        "conversion": _conversion(Path(args.converted)),
        "whole": whole,
        "margin_median": statistics.median(margins),
        "margin_median_at_misses": statistics.median(misses) if misses else None,
        "misses": len(misses),
        "positions": len(margins),
        "single": layers["single"],
        "upto": layers["upto"],
        "new_tokens": args.new_tokens,
        "prompts": len(prompts),
        "seconds": time.time() - t0,
        "threads": args.threads,
        "note": args.note,
        "time": dt.datetime.now().isoformat(timespec="seconds"),
        "machine": platform.machine(),
        "torch": torch.__version__,
        "command": "python benchmarks/heal_attribution.py " + " ".join(sys.argv[1:] if argv is None else argv),
    }
    if not args.no_save:
        with open(args.results, "a", encoding="utf-8") as f:
            f.write(json.dumps(row) + "\n")
    return 0


def _conversion(folder: Path) -> dict:
    """The converted folder's scheme, norm, cap and heal settings, from its ``qknorm_conversion.json``."""
    try:
        record = json.loads((folder / "qknorm_conversion.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    scheme = record.get("scheme") or {}
    heal = record.get("heal") or {}
    return {k: scheme.get(k) for k in ("scheme", "norm", "softcap")} | {"heal": heal.get("settings")}


if __name__ == "__main__":
    raise SystemExit(main())
