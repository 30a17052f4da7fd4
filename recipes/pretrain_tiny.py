"""Pretrain the tiny Llama that hf_qknorm ships in ``hf_qknorm/assets/tiny-llama``.

A plain ``LlamaForCausalLM`` (no plugin: it is the *source* model for conversion experiments) with a byte-level BPE
tokenizer trained on the same text, pretrained on one CPU thread in 10–15 minutes:

    python recipes/pretrain_tiny.py --out hf_qknorm/assets/tiny-llama

Tiny Shakespeare is small (347k training tokens at vocab 2048), so the budget is set by overfitting, not by time:
the default 1100 steps (about 13 epochs) end where held-out perplexity stops improving. A 2400-step run of the same
model reached held-out perplexity 38.9 at step 750 and 39.7 at step 1000 while its train loss kept falling (2.95).

The text is split with ``hf_qknorm.data.split_text`` (last 10% held out, as nanoGPT does for Tiny Shakespeare); the
tokenizer sees only the training part. Training samples random windows of the training tokens, each led by BOS;
held-out perplexity is measured on back-to-back BOS-led blocks of the held-out part. The folder gets float32
safetensors, the tokenizer, ``generation_config.json`` and ``TRAINING.md`` with the command, seed and results.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import sys
import time
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
from transformers.utils import logging as hf_logging

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a clone without installing
from hf_qknorm.cli.help import DefaultsFormatter  # noqa: E402
from hf_qknorm.data import perplexity, read_text, split_text, tokenize_blocks, tokenize_stream  # noqa: E402

PAD, BOS, EOS = "<pad>", "<s>", "</s>"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=DefaultsFormatter)
    p.add_argument("--text", default="tinyshakespeare", help="UTF-8 text file, or a bundled text name")
    p.add_argument("--out", default="runs/tiny-llama", help="output folder (save_pretrained)")
    p.add_argument("--seed", type=int, default=0, help="seed for init and batch sampling")
    p.add_argument("--steps", type=int, default=1100, help="optimizer steps")
    p.add_argument("--batch-size", type=int, default=16, help="sequences per step")
    p.add_argument("--context", type=int, default=256, help="tokens per training sequence, BOS included")
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    p.add_argument("--min-lr-ratio", type=float, default=0.05, help="final lr / peak lr of the cosine")
    p.add_argument("--warmup", type=int, default=100, help="linear warmup steps")
    p.add_argument("--weight-decay", type=float, default=0.1, help="AdamW decay on matrices (not norms)")
    p.add_argument("--grad-clip", type=float, default=1.0, help="max gradient norm")
    p.add_argument("--vocab-size", type=int, default=2048, help="BPE vocabulary, specials included")
    p.add_argument("--hidden-size", type=int, default=128, help="head_dim = hidden / heads")
    p.add_argument("--layers", type=int, default=4, help="decoder layers")
    p.add_argument("--heads", type=int, default=4, help="query heads")
    p.add_argument("--kv-heads", type=int, default=2, help="key/value heads (GQA)")
    p.add_argument("--intermediate-size", type=int, default=512, help="MLP width")
    p.add_argument("--max-positions", type=int, default=512, help="max_position_embeddings")
    p.add_argument("--val-fraction", type=float, default=0.1, help="held-out tail of the text")
    p.add_argument("--eval-every", type=int, default=250, help="steps between held-out evaluations")
    p.add_argument("--eval-blocks", type=int, default=32, help="held-out blocks used by periodic evaluations")
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    return p.parse_args(argv)


def train_tokenizer(text: str, vocab_size: int, model_max_length: int) -> PreTrainedTokenizerFast:
    """Byte-level BPE (GPT-2 style, no unknown tokens) whose encodings start with BOS, as Llama's do."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[PAD, BOS, EOS],  # ids 0, 1, 2
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([text], trainer=trainer)
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(
                single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
            ),
        ]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD, model_max_length=model_max_length
    )


def build_model(args, tokenizer) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=args.hidden_size,
        intermediate_size=args.intermediate_size,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.hidden_size // args.heads,
        max_position_embeddings=args.max_positions,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return LlamaForCausalLM(config)


def make_optimizer(model, args) -> torch.optim.AdamW:
    """AdamW with decay on matrices only (embeddings included, norms excluded), as nanoGPT does."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95), eps=1e-8)


def lr_at(step: int, args) -> float:
    """Linear warmup to ``lr``, then cosine down to ``min_lr_ratio * lr`` at the last step."""
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    progress = (step - args.warmup) / max(1, args.steps - args.warmup)
    ratio = args.min_lr_ratio + (1 - args.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    return args.lr * ratio


def random_batch(stream: torch.Tensor, args, bos_id: int, gen: torch.Generator) -> torch.Tensor:
    """``(batch, context)`` windows at random offsets of the training tokens, each led by BOS."""
    n_text = args.context - 1
    starts = torch.randint(0, len(stream) - n_text + 1, (args.batch_size,), generator=gen)
    windows = torch.stack([stream[s : s + n_text] for s in starts.tolist()])
    return torch.cat([torch.full((args.batch_size, 1), bos_id, dtype=torch.long), windows], dim=1)


def train(model, stream, val_blocks, args, bos_id) -> dict:
    gen = torch.Generator().manual_seed(args.seed)
    opt = make_optimizer(model, args)
    model.train()
    t0, log, ema = time.time(), [], None
    for step in range(args.steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args)
        batch = random_batch(stream, args, bos_id, gen)
        loss = model(input_ids=batch, labels=batch).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        opt.step()
        ema = loss.item() if ema is None else 0.95 * ema + 0.05 * loss.item()
        last = step + 1 == args.steps
        if (step + 1) % args.eval_every == 0 or last:
            val_ppl = perplexity(model, val_blocks[: args.eval_blocks])
            row = {
                "step": step + 1,
                "train_loss_ema": round(ema, 4),
                "val_ppl_subset": round(val_ppl, 3),
                "lr": round(lr_at(step, args), 6),
                "minutes": round((time.time() - t0) / 60, 2),
            }
            log.append(row)
            print(json.dumps(row), flush=True)
    return {"log": log, "train_seconds": time.time() - t0, "final_train_loss_ema": ema}


@torch.no_grad()
def final_train_loss(model, stream, args, n_blocks: int = 64) -> float:
    """Mean loss on fixed back-to-back training blocks (eval mode): the train side of the held-out comparison."""
    n_text = args.context - 1
    blocks = stream[: n_blocks * n_text].view(-1, n_text)
    bos = torch.full((blocks.shape[0], 1), model.config.bos_token_id, dtype=torch.long)
    return math.log(perplexity(model, torch.cat([bos, blocks], dim=1)))


def sample(model, tokenizer, prompt: str = "ROMEO:\n", max_new_tokens: int = 60) -> str:
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)
    return tokenizer.decode(out[0], skip_special_tokens=True)


def write_training_md(out: Path, args, results: dict, command: str) -> None:
    n_params = results["n_params"]
    lines = [
        "# tiny-llama: how it was made",
        "",
        "A plain `LlamaForCausalLM` (no hf_qknorm patch), float32, pretrained from scratch on Tiny Shakespeare by",
        "`recipes/pretrain_tiny.py`. It is the source model for conversion experiments and tests.",
        "",
        "```",
        command,
        "```",
        "",
        "| item | value |",
        "|---|---|",
        f"| seed | {args.seed} |",
        f"| steps x batch x context | {args.steps} x {args.batch_size} x {args.context} "
        f"({args.steps * args.batch_size * (args.context - 1):,} predicted tokens) |",
        f"| model | {args.layers} layers, hidden {args.hidden_size}, {args.heads} heads / {args.kv_heads} KV heads, "
        f"head_dim {args.hidden_size // args.heads}, MLP {args.intermediate_size}, tied embeddings, "
        f"{n_params:,} parameters |",
        f"| tokenizer | byte-level BPE, vocab {results['vocab_size']}, trained on the training split only; "
        f"encodings start with `{BOS}` |",
        f"| data | `{args.text}`: first {1 - args.val_fraction:.0%} train ({results['train_tokens']:,} tokens), "
        f"last {args.val_fraction:.0%} held out ({results['val_tokens']:,} tokens) |",
        f"| optimizer | AdamW (0.9, 0.95), peak lr {args.lr}, {args.warmup} warmup steps, cosine to "
        f"{args.min_lr_ratio} x peak, weight decay {args.weight_decay}, grad clip {args.grad_clip} |",
        f"| hardware | CPU, torch.set_num_threads({args.threads}); torch {torch.__version__}, "
        f"transformers {results['transformers']} |",
        f"| wall time (training loop) | {results['train_seconds'] / 60:.1f} min |",
        f"| final train loss (EMA of batch losses) | {results['final_train_loss_ema']:.4f} |",
        f"| final train loss (eval mode, {results['train_eval_tokens']:,} training tokens) "
        f"| {results['train_loss']:.4f} |",
        f"| **held-out loss / perplexity** ({results['val_blocks']} blocks of {args.context}, "
        f"{results['val_eval_tokens']:,} predicted tokens) "
        f"| **{math.log(results['val_ppl']):.4f} / {results['val_ppl']:.2f}** |",
        f"| held-out bits per character | {results['val_bpc']:.3f} "
        f"({results['chars_per_token']:.2f} characters per token) |",
        "",
        "Perplexity is per BPE token (`hf_qknorm.data.perplexity` over `tokenize_blocks(val, tok, "
        f"{args.context})`, BOS-led blocks).",
        "Per character it is exp(bits per char x ln 2) = "
        f"{math.exp(results['val_bpc'] * math.log(2)):.2f}, the figure to compare with character-level models.",
        "",
        "Greedy sample from `ROMEO:\\n`:",
        "",
        "```",
        results["sample"],
        "```",
        "",
        f"Evaluations during training (held-out perplexity on the first {args.eval_blocks} held-out blocks):",
        "",
        "| step | train loss (EMA) | held-out ppl | lr | minutes |",
        "|---|---|---|---|---|",
    ]
    lines += [
        f"| {r['step']} | {r['train_loss_ema']} | {r['val_ppl_subset']} | {r['lr']} | {r['minutes']} |"
        for r in results["log"]
    ]
    (out / "TRAINING.md").write_text("\n".join(lines) + "\n", encoding="utf-8")


def main(argv=None) -> None:
    args = parse_args(argv)
    hf_logging.disable_progress_bar()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    command = "python " + " ".join(shlex.quote(a) for a in [os.path.relpath(__file__)] + (argv or sys.argv[1:]))
    out = Path(args.out)

    try:
        train_text, val_text = split_text(read_text(args.text), args.val_fraction)
    except (OSError, ValueError) as err:
        raise SystemExit(f"pretrain_tiny.py: error: {err}") from None
    tokenizer = train_tokenizer(train_text, args.vocab_size, args.max_positions)
    stream = tokenize_stream(train_text, tokenizer)
    val_blocks = tokenize_blocks(val_text, tokenizer, args.context)
    model = build_model(args, tokenizer)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"train tokens {len(stream):,}  held-out blocks {tuple(val_blocks.shape)}  params {n_params:,}", flush=True)

    results = train(model, stream, val_blocks, args, tokenizer.bos_token_id)
    results["val_ppl"] = perplexity(model, val_blocks)
    results["train_loss"] = final_train_loss(model, stream, args)
    val_chars = len(tokenizer.decode(val_blocks[:, 1:].reshape(-1)))
    results.update(
        n_params=n_params,
        vocab_size=len(tokenizer),
        train_tokens=len(stream),
        val_blocks=val_blocks.shape[0],
        val_tokens=len(tokenize_stream(val_text, tokenizer)),
        val_eval_tokens=val_blocks[:, 1:].numel(),
        train_eval_tokens=64 * (args.context - 1),
        transformers=__import__("transformers").__version__,
        chars_per_token=val_chars / val_blocks[:, 1:].numel(),
    )
    results["val_bpc"] = math.log(results["val_ppl"]) * results["val_eval_tokens"] / val_chars / math.log(2)
    results["sample"] = sample(model, tokenizer)
    print(
        f"held-out ppl {results['val_ppl']:.3f}  train loss {results['train_loss']:.4f}  bpc {results['val_bpc']:.3f}  "
        f"wall {results['train_seconds'] / 60:.1f} min\n{results['sample']}",
        flush=True,
    )

    out.mkdir(parents=True, exist_ok=True)
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id
    )
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    write_training_md(out, args, results, command)
    print(f"saved to {out}", flush=True)


if __name__ == "__main__":
    main()
