"""Write a calibration text that mixes WikiText with SmolLM2's own chat answers and continuations.

Half of the characters are the first 90% of the bundled WikiText-2 slice (the default calibration text of
``bench_convert_real.py``), half are the original model's own sampled answers to questions about WikiText topics,
through its chat template, and continuations of code and prose openings
(:func:`hf_qknorm.conversion.healing.selftext.self_generated_text`; 48 chat turns and 16 openings of 128 tokens, seed
0). The file used for the "mixed_self_text" rows of ``benchmarks/results/convert_real_agreement.jsonl`` is
``benchmarks/results/calibration_mixed_self.txt`` (generated before the topic finder read section titles, so its
questions are about the first words of lines; regenerating writes different questions).

    python benchmarks/make_self_calibration.py --out mixed.txt
    python benchmarks/make_self_calibration.py --out benchmarks/results/heal_text_mixed_self.txt --chats 192 \
        --openings 64 --new-tokens 256                                  # the heal text of bench_heal.py's mixed rows
    python benchmarks/bench_convert_real.py --calibration-text mixed.txt --method mixed_self_text
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--src", type=Path, default=ROOT / "models" / "smollm2-135m")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--chats", type=int, default=48, help="chat answers to sample (questions on WikiText topics)")
    p.add_argument("--openings", type=int, default=16, help="continuations of code and prose openings to sample")
    p.add_argument("--new-tokens", type=int, default=128, help="tokens sampled per answer or continuation")
    p.add_argument("--share", type=float, default=0.5, help="share of the characters that are self-generated")
    args = p.parse_args(argv)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hf_qknorm.conversion.healing.selftext import mixed_text, self_generated_text
    from hf_qknorm.data import bundled_text, split_text

    torch.set_num_threads(args.threads)
    tok = AutoTokenizer.from_pretrained(args.src)
    model = AutoModelForCausalLM.from_pretrained(args.src, dtype=torch.float32).eval()
    wiki = split_text(bundled_text("wikitext2"), 0.1)[0]
    t0 = time.time()
    generated = self_generated_text(
        model, tok, wiki, chats=args.chats, openings=args.openings, new_tokens=args.new_tokens
    )
    args.out.write_text(mixed_text(wiki, generated, args.share))
    print(f"wrote {args.out}: {len(tok(generated).input_ids):,} generated tokens in {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
