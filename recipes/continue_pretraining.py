"""Continued pretraining of a converted checkpoint with transformers.Trainer.

A pretrained model (default: the bundled tiny Llama, pretrained on Tiny Shakespeare) is converted to the chosen
scheme -- norm weights added and calibrated on the training text so the converted model starts close to the
original (``hf_qknorm.convert``) -- and then trained further. Held-out perplexity is reported for the original,
the converted and the trained model. A few minutes on one CPU thread with the defaults:

    python recipes/continue_pretraining.py --scheme qk_norm --norm rmsnorm     # a Llama that is a Qwen3
    accelerate launch --multi_gpu --num_processes 2 recipes/continue_pretraining.py --model path/to/llama

Writes ``<out>/converted`` (the conversion, done once by the main process), ``<out>/final`` and
``<out>/results.json``.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402


def parse_args(argv=None):
    p = C.parser(__doc__.split("\n\n")[0], text="tinyshakespeare", steps=200, lr=1e-3)
    C.add_model_args(p)
    return p.parse_args(argv)


def main(argv=None):
    from transformers import AutoModelForCausalLM

    args = parse_args(argv)
    tokenizer, train_ds, val_blocks, targs, src, folder = C.prepare_converted_run(args, "continue_pretraining")
    results = {
        "recipe": "continue_pretraining",
        "source": str(src),
        "converted": str(folder),
        "ppl_source": C.ppl(AutoModelForCausalLM.from_pretrained(src), val_blocks),
    }
    model = AutoModelForCausalLM.from_pretrained(folder)
    results["ppl_converted"] = C.ppl(model, val_blocks)
    report = C.conversion_report(folder)
    if report is not None:
        results["conversion"] = {k: report.get(k) for k in ("export", "scheme", "calibration")}
    trainer = C.make_trainer(model, args, train_ds, targs)
    C.log(
        trainer,
        f"{type(model).__name__} from {folder}: held-out perplexity on {val_blocks[:, 1:].numel():,} "
        f"tokens: original {C.fmt(results['ppl_source'])}, converted {C.fmt(results['ppl_converted'])}; "
        f"world size {trainer.args.world_size}",
    )
    results.update(C.train(trainer, args))
    results["ppl_trained"] = C.ppl(model, val_blocks)
    C.log(trainer, f"held-out perplexity after {trainer.state.global_step} steps: {C.fmt(results['ppl_trained'])}")
    C.finish(trainer, args, results, save_model=model, tokenizer=tokenizer)


if __name__ == "__main__":
    main()
