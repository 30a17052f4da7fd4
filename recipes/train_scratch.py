"""Pretrain a small patched model from scratch with transformers.Trainer.

A Llama-style model (or any supported family) is built from a config, patched with the chosen scheme before its
first step, and trained on the bundled Tiny Shakespeare (or ``--text``) with the bundled BPE tokenizer; the
attention-logit monitor logs every ``--monitor-every`` steps, and ``--qk-lr-tau`` adds Anson & Aitchison's Q/K
learning-rate control. About two minutes on one CPU thread with the defaults:

    python recipes/train_scratch.py --scheme qk_norm_cap --lr 3e-3
    accelerate launch --multi_gpu --num_processes 2 recipes/train_scratch.py     # 2 processes (gloo on CPU)

Writes ``<out>/final`` (a ``qknorm_<family>`` folder plus tokenizer) and ``<out>/results.json`` (held-out
perplexity, last monitor record, alerts).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402

import hf_qknorm  # noqa: E402

FAMILY_CONFIGS = {
    "llama": "LlamaConfig",
    "mistral": "MistralConfig",
    "qwen2": "Qwen2Config",
    "qwen3": "Qwen3Config",
    "gpt2": "GPT2Config",
}


def parse_args(argv=None):
    p = C.parser(__doc__.split("\n\n")[0], text="tinyshakespeare", steps=300, lr=3e-3)
    m = p.add_argument_group("model")
    m.add_argument("--family", choices=sorted(FAMILY_CONFIGS), default="llama")
    m.add_argument(
        "--scheme",
        choices=("none",) + tuple(hf_qknorm.SCHEMES),
        default="qk_norm_cap",
        help="'none' trains the unpatched baseline",
    )
    m.add_argument("--norm", choices=hf_qknorm.NORMS, default=None, help="default layernorm")
    m.add_argument("--softcap", type=float, default=None, help="default 50 for capped schemes")
    m.add_argument("--hidden-size", type=int, default=128)
    m.add_argument("--layers", type=int, default=4)
    m.add_argument("--heads", type=int, default=4)
    m.add_argument("--kv-heads", type=int, default=2, help="GQA key/value heads (not gpt2)")
    m.add_argument("--tokenizer", default=None, help="tokenizer folder (default: the bundled tiny Llama's)")
    return p.parse_args(argv)


def build_model(args, tokenizer):
    import transformers

    vocab = len(tokenizer)
    if args.family == "gpt2":
        config = transformers.GPT2Config(
            vocab_size=vocab,
            n_embd=args.hidden_size,
            n_layer=args.layers,
            n_head=args.heads,
            n_positions=max(512, args.context),
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
        )
    else:
        extra = {"head_dim": args.hidden_size // args.heads} if args.family == "qwen3" else {}
        config = getattr(transformers, FAMILY_CONFIGS[args.family])(
            vocab_size=vocab,
            hidden_size=args.hidden_size,
            intermediate_size=4 * args.hidden_size,
            num_hidden_layers=args.layers,
            num_attention_heads=args.heads,
            num_key_value_heads=args.kv_heads,
            max_position_embeddings=max(512, args.context),
            tie_word_embeddings=True,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
            **extra,
        )
    transformers.set_seed(args.seed)
    model = transformers.AutoModelForCausalLM.from_config(config)
    if args.scheme != "none":
        hf_qknorm.patch_model(model, args.scheme, norm=args.norm, softcap=args.softcap)
    return model


def main(argv=None):
    args = parse_args(argv)
    C.setup(args, "train_scratch")
    tokenizer = C.load_tokenizer(args.tokenizer)
    train_ds, val_blocks = C.text_blocks(args, tokenizer)
    model = build_model(args, tokenizer)
    trainer = C.make_trainer(model, args, train_ds)
    C.log(
        trainer,
        f"{args.family} {args.scheme}: {sum(p.numel() for p in model.parameters()):,} parameters, "
        f"{len(train_ds)} training blocks of {args.context}, world size {trainer.args.world_size}",
    )
    results = {
        "recipe": "train_scratch",
        "family": args.family,
        "scheme": args.scheme,
        "qknorm": getattr(model.config, "qknorm", None),
        **C.train(trainer, args),
    }
    results["val_ppl"] = C.ppl(model, val_blocks)
    C.log(
        trainer,
        f"held-out perplexity {C.fmt(results['val_ppl'])} after {trainer.state.global_step} steps "
        f"({results['train_seconds'] / 60:.1f} min)",
    )
    C.finish(trainer, args, results, save_model=model, tokenizer=tokenizer)


if __name__ == "__main__":
    main()
