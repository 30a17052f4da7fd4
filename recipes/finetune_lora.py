"""LoRA fine-tuning of a patched model with peft and transformers.Trainer.

LoRA adapters go on the attention projections and the new norm weights train with them (``modules_to_save``);
the patched attention normalises the LoRA-adapted queries and keys. The base is a patched model -- by default the
bundled tiny Llama (pretrained on Tiny Shakespeare), converted first -- and the default data is a different
domain (the bundled WikiText-2 slice). At the end the adapters are merged (``merge_and_unload``) into a plain
patched model. A few minutes on one CPU thread with the defaults:

    python recipes/finetune_lora.py --r 8 --lr 3e-3
    accelerate launch --multi_gpu --num_processes 2 recipes/finetune_lora.py --model path/to/converted

Writes ``<out>/adapter`` (peft adapter with the norm weights), ``<out>/final`` (the merged patched model) and
``<out>/results.json`` (held-out perplexity of the base, the adapted and the merged model).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402

import hf_qknorm  # noqa: E402


def parse_args(argv=None):
    p = C.parser(__doc__.split("\n\n")[0], text="wikitext2", steps=150, lr=3e-3, qk_lr=False)
    C.add_model_args(p, scheme="qk_norm")
    lora = p.add_argument_group("LoRA")
    lora.add_argument("--r", type=int, default=8, help="LoRA rank")
    lora.add_argument("--lora-alpha", type=int, default=16)
    lora.add_argument("--lora-dropout", type=float, default=0.0)
    lora.add_argument("--freeze-norms", action="store_true", help="do not train the q/k(/v) norm weights")
    args = p.parse_args(argv)
    args.weight_decay = 0.0 if "--weight-decay" not in (argv or sys.argv) else args.weight_decay
    return args


def main(argv=None):
    from transformers import AutoModelForCausalLM

    args = parse_args(argv)
    tokenizer, train_ds, val_blocks, targs, src, folder = C.prepare_converted_run(args, "finetune_lora")
    results = {"recipe": "finetune_lora", "base": str(folder)}
    if src != folder:
        results["ppl_source"] = C.ppl(AutoModelForCausalLM.from_pretrained(src), val_blocks)
    base = AutoModelForCausalLM.from_pretrained(folder)
    results["ppl_base"] = C.ppl(base, val_blocks)
    model = hf_qknorm.prepare_lora(
        base, r=args.r, lora_alpha=args.lora_alpha, lora_dropout=args.lora_dropout, train_norms=not args.freeze_norms
    )
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    results["trainable_parameters"] = trainable
    trainer = C.make_trainer(model, args, train_ds, targs)
    C.log(
        trainer,
        f"LoRA r={args.r} on {type(base).__name__}: {trainable:,} trainable parameters "
        f"(modules_to_save: {model.peft_config['default'].modules_to_save}); base held-out perplexity "
        f"{C.fmt(results['ppl_base'])}; world size {trainer.args.world_size}",
    )
    results.update(C.train(trainer, args))
    results["ppl_lora"] = C.ppl(model, val_blocks)
    if trainer.is_world_process_zero():
        model.save_pretrained(Path(args.out) / "adapter")
    merged = model.merge_and_unload()
    results["ppl_merged"] = C.ppl(merged, val_blocks)
    C.log(
        trainer,
        f"held-out perplexity: base {C.fmt(results['ppl_base'])} -> LoRA {C.fmt(results['ppl_lora'])} "
        f"(merged {C.fmt(results['ppl_merged'])}) after {trainer.state.global_step} steps",
    )
    C.finish(trainer, args, results, save_model=merged, tokenizer=tokenizer)


if __name__ == "__main__":
    main()
