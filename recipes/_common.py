"""What the training recipes share: arguments, data, the Trainer with the hf_qknorm callbacks, and the report.

Every recipe runs on a CPU in minutes with its defaults (bundled text, the bundled tiny Llama) and scales up
unchanged under ``accelerate launch`` (DDP; one process per GPU, or gloo processes on a CPU-only machine)::

    python recipes/train_scratch.py
    accelerate launch --multi_gpu --num_processes 2 recipes/train_scratch.py   # on CPU: 2 gloo processes

On a machine without a GPU, ``--multi_gpu`` only selects accelerate's torchrun launcher; the recipe sees no CUDA,
sets ``use_cpu`` and accelerate picks gloo.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_BF16")  # CPUs that advertise AMX but trap on it

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a clone without installing
import hf_qknorm  # noqa: E402
from hf_qknorm.cli.help import DefaultsFormatter  # noqa: E402
from hf_qknorm.data import bundled_model_dir, perplexity, read_text, split_text, tokenize_blocks  # noqa: E402
from hf_qknorm.upstream import checkpointing_arguments  # noqa: E402


class Blocks(torch.utils.data.Dataset):
    """Fixed-length token blocks as ``{"input_ids", "labels"}`` rows (the model shifts the labels)."""

    def __init__(self, blocks: torch.Tensor):
        self.blocks = blocks

    def __len__(self):
        return self.blocks.shape[0]

    def __getitem__(self, i):
        return {"input_ids": self.blocks[i], "labels": self.blocks[i]}


def parser(
    doc: str, *, text: str, steps: int, lr: float, batch_size: int = 16, context: int = 128, qk_lr: bool = True
) -> argparse.ArgumentParser:
    """The arguments every recipe takes; a recipe adds its own."""
    p = argparse.ArgumentParser(description=doc, formatter_class=DefaultsFormatter)
    d = p.add_argument_group("data")
    d.add_argument(
        "--text",
        default=text,
        help="UTF-8 text file, or a bundled text name (tinyshakespeare, "
        "wikitext2); the last --val-fraction is held out",
    )
    d.add_argument("--val-fraction", type=float, default=0.1)
    d.add_argument("--context", type=int, default=context, help="tokens per training block, BOS included")
    d.add_argument("--eval-blocks", type=int, default=32, help="held-out blocks for the perplexity report")
    t = p.add_argument_group("training")
    t.add_argument("--out", default=None, help="output folder (default runs/<recipe>)")
    t.add_argument("--max-steps", type=int, default=steps, help="optimizer steps")
    t.add_argument("--batch-size", type=int, default=batch_size, help="blocks per device per step")
    t.add_argument("--grad-accum", type=int, default=1, help="gradient accumulation steps")
    t.add_argument("--lr", type=float, default=lr, help="peak learning rate (cosine schedule)")
    t.add_argument("--warmup-steps", type=int, default=max(1, steps // 20))
    t.add_argument("--weight-decay", type=float, default=0.1)
    t.add_argument("--grad-clip", type=float, default=1.0)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--gradient-checkpointing", action="store_true", help="recompute activations in backward")
    t.add_argument("--bf16", action="store_true", help="bf16 mixed precision (GPU)")
    t.add_argument("--save-steps", type=int, default=0, help="checkpoint every N steps (0: only the final model)")
    t.add_argument("--resume", default=None, help="checkpoint folder to resume from, or 'latest' in --out")
    t.add_argument("--logging-steps", type=int, default=10)
    t.add_argument("--report-to", default="none", help="Trainer reporters: none, tensorboard, wandb, all ...")
    t.add_argument("--threads", type=int, default=1, help="torch threads per process on CPU")
    t.add_argument(
        "--fsdp",
        action="store_true",
        help="shard with FSDP2 (full shard) instead of DDP (GPUs only: "
        "accelerate enables FSDP only there; on CPU use recipes/pretrain_sharded.py)",
    )
    q = p.add_argument_group("hf_qknorm")
    q.add_argument("--monitor-every", type=int, default=10, help="attention-logit monitor period (0: off)")
    q.add_argument(
        "--qk-clip-tau", type=float, default=None, help="QK-Clip (Kimi K2) with this threshold (default: off)"
    )
    if qk_lr:
        q.add_argument(
            "--qk-lr-tau",
            type=float,
            default=None,
            help="Anson & Aitchison Q/K learning-rate control with this tau (default: off)",
        )
        q.add_argument(
            "--qk-lr-rule",
            choices=("norm_ratio", "constant"),
            default="norm_ratio",
            help="norm_ratio: lr(W_Q) = tau*lr*||W_K||_0/||W_K||, per head; constant: tau*lr",
        )
    q.add_argument(
        "--dump-rank-state",
        default=None,
        metavar="DIR",
        help="write every rank's final parameters to DIR/rank<r>.safetensors (replica check)",
    )
    return p


def setup(args, recipe: str) -> None:
    from transformers.utils import logging as hf_logging

    if args.out is None:
        args.out = str(Path("runs") / recipe)
    if not torch.cuda.is_available():
        torch.set_num_threads(args.threads)
    hf_logging.set_verbosity_warning()
    hf_logging.disable_progress_bar()


def load_tokenizer(path=None):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path or bundled_model_dir())


def text_blocks(args, tokenizer) -> tuple[Blocks, torch.Tensor]:
    """Training blocks (back to back) and held-out blocks of ``--text``."""
    train, val = split_text(read_text(args.text), args.val_fraction)
    args.train_text, args.val_text = train, val  # conversion calibrates on the training part only
    train_blocks = tokenize_blocks(train, tokenizer, args.context)
    val_blocks = tokenize_blocks(val, tokenizer, args.context, max_blocks=args.eval_blocks)
    return Blocks(train_blocks), val_blocks


def training_arguments(args, **overrides):
    from transformers import TrainingArguments

    kw = dict(
        output_dir=args.out,
        max_steps=args.max_steps,
        per_device_train_batch_size=args.batch_size,
        gradient_accumulation_steps=args.grad_accum,
        learning_rate=args.lr,
        lr_scheduler_type="cosine",
        warmup_steps=args.warmup_steps,
        weight_decay=args.weight_decay,
        max_grad_norm=args.grad_clip,
        adam_beta2=0.95,
        seed=args.seed,
        data_seed=args.seed,
        logging_steps=args.logging_steps,
        save_strategy="steps" if args.save_steps else "no",
        save_steps=args.save_steps or 500,
        report_to=args.report_to,
        use_cpu=not torch.cuda.is_available(),
        bf16=args.bf16,
        dataloader_num_workers=0,
        disable_tqdm=True,
        ddp_find_unused_parameters=False,
        # the keywords' names depend on the Transformers version (renamed in 5.23)
        **checkpointing_arguments(args.gradient_checkpointing, use_reentrant=False),
    )
    if args.fsdp:
        if not torch.cuda.is_available():
            raise SystemExit(
                "--fsdp needs GPUs: accelerate (and so Trainer) enables FSDP only for multi-GPU "
                "runs; on CPU the Trainer recipes use DDP over gloo, and recipes/pretrain_sharded.py "
                "trains with FSDP2 (fully_shard over gloo) in a plain loop"
            )
        kw.update(fsdp=True, fsdp_config={"version": 2, "reshard_after_forward": True})
    kw.update(overrides)
    return TrainingArguments(**kw)


def make_trainer(model, args, train_ds, targs=None):
    """A ``Trainer`` with the Q/K learning-rate and QK-Clip callbacks (when asked) and the attention-logit monitor."""
    from transformers import Trainer

    callbacks = []
    if getattr(args, "qk_lr_tau", None) is not None:
        callbacks.append(hf_qknorm.QKLearningRateCallback(tau=args.qk_lr_tau, rule=args.qk_lr_rule))
    if getattr(args, "qk_clip_tau", None) is not None:
        callbacks.append(hf_qknorm.QKClipCallback(tau=args.qk_clip_tau))
    trainer = Trainer(model=model, args=targs or training_arguments(args), train_dataset=train_ds, callbacks=callbacks)
    trainer.qk_monitor = None
    if args.monitor_every:
        trainer.qk_monitor = hf_qknorm.QKMonitorCallback.attach(trainer, every=args.monitor_every)
    return trainer


def add_model_args(p, *, scheme: str = "qk_norm_cap") -> None:
    """``--model`` and the conversion settings (continued pretraining and LoRA start from a converted model)."""
    m = p.add_argument_group("model")
    m.add_argument(
        "--model",
        default=None,
        help="model folder (default: the bundled tiny Llama). A plain model "
        "is converted first (hf_qknorm.convert, calibrated on the training text) into <out>/converted; "
        "a patched one (qknorm_* or a converted qwen3 folder) is used as it is",
    )
    m.add_argument("--scheme", choices=tuple(hf_qknorm.SCHEMES), default=scheme)
    m.add_argument("--norm", choices=hf_qknorm.NORMS, default=None, help="default layernorm")
    m.add_argument("--softcap", type=float, default=None, help="default 50 for capped schemes")
    m.add_argument(
        "--calib-steps",
        type=int,
        default=100,
        help="distillation steps of the calibration (0: closed-form fit only; -1: no calibration, identity init)",
    )
    m.add_argument("--calib-blocks", type=int, default=32, help="calibration blocks of --context tokens")


def _already_patched(folder: Path) -> bool:
    raw = json.loads((folder / "config.json").read_text())
    return (
        str(raw.get("model_type", "")).startswith("qknorm_")
        or raw.get("qknorm") is not None
        or (folder / "qknorm_conversion.json").is_file()
    )


def _convert(src: Path, dst: Path, args) -> None:
    try:
        from hf_qknorm.conversion.calibration.calibrate import CalibrationSettings
        from hf_qknorm.conversion.orchestration.converter import convert
    except ImportError:  # conversion not installed: identity init through patch_model
        convert = None
    if convert is None:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(src)
        hf_qknorm.patch_model(model, args.scheme, norm=args.norm, softcap=args.softcap)
        model.save_pretrained(dst)
        load_tokenizer(src).save_pretrained(dst)
        return
    settings = CalibrationSettings(
        block_len=args.context,
        calibration_blocks=args.calib_blocks,
        eval_blocks=args.eval_blocks,
        steps=max(0, args.calib_steps),
        seed=args.seed,
    )
    # quiet: the conversion's own report measures on blocks spread over the held-out text, the recipe on its first
    # --eval-blocks blocks; printing both gave two different "original" perplexities. The recipe prints its own.
    convert(
        src,
        dst,
        config=hf_qknorm.QKNormConfig(scheme=args.scheme, norm=args.norm, softcap=args.softcap),
        calibration=settings,
        calibrate=args.calib_steps >= 0,
        calibration_text=args.train_text,
        eval_text=args.val_text,
        overwrite=True,
        progress=False,
        log=lambda *a: None,
    )
    print(
        f"converted {src} to {args.scheme} in {dst} (calibration report: {dst / 'qknorm_conversion.json'})", flush=True
    )


def prepare_converted_run(args, recipe: str):
    """The shared start of the recipes that train a converted checkpoint: set up, tokenise the text with the
    source's tokenizer, build the training arguments and convert (once, on the main process).
    Returns ``(tokenizer, train_ds, val_blocks, targs, source folder, converted folder)``."""
    setup(args, recipe)
    tokenizer = load_tokenizer(Path(args.model) if args.model else bundled_model_dir())
    train_ds, val_blocks = text_blocks(args, tokenizer)
    targs = training_arguments(args)
    src, folder = source_and_converted(args, targs)
    return tokenizer, train_ds, val_blocks, targs, src, folder


def source_and_converted(args, targs):
    """``(source folder, folder of the patched model to train)``; converts on the main process when needed
    (the other processes wait for it, then read the same folder)."""
    src = Path(args.model) if args.model else bundled_model_dir()
    if _already_patched(src):
        return src, src
    dst = Path(args.out) / "converted"
    with targs.main_process_first(local=False, desc="conversion"):
        if not (dst / "config.json").is_file():
            _convert(src, dst, args)
    return src, dst


def conversion_report(folder: Path) -> dict | None:
    path = Path(folder) / "qknorm_conversion.json"
    return json.loads(path.read_text()) if path.is_file() else None


def resume_path(args):
    if args.resume != "latest":
        return args.resume
    ckpts = sorted(Path(args.out).glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[-1]))
    return str(ckpts[-1]) if ckpts else None


def train(trainer, args) -> dict:
    """Train (resuming when asked); returns the wall time and the mean training loss."""
    start = time.time()
    out = trainer.train(resume_from_checkpoint=resume_path(args))
    return {"train_seconds": round(time.time() - start, 1), "train_loss": out.training_loss}


def log(trainer, *msg) -> None:
    if trainer.is_world_process_zero():
        print(*msg, flush=True)


def ppl(model, val_blocks) -> float:
    return perplexity(model, val_blocks.to(next(model.parameters()).device))


def finish(trainer, args, results: dict, save_model=None, tokenizer=None) -> dict:
    """Save the final model (main process), the replica dump (every rank) and ``results.json``."""
    state = trainer.state
    monitor = getattr(trainer, "qk_monitor", None)
    history = monitor.history if monitor else []
    clip = next((c for c in trainer.callback_handler.callbacks if isinstance(c, hf_qknorm.QKClipCallback)), None)
    results.update(
        steps=state.global_step,
        world_size=trainer.args.world_size,
        last_logged_loss=next((r["loss"] for r in reversed(state.log_history) if "loss" in r), None),
        monitor_last=history[-1] if history else None,
        monitor_alerts=monitor.alerts if monitor else [],
    )
    if clip is not None:
        results["qk_clip"] = {"tau": clip.tau, "clipped_steps": clip.clip.clipped_steps, "steps": clip.clip.steps}
    if args.dump_rank_state:
        dump_rank_state(
            trainer.model,
            args.dump_rank_state,
            trainer.args.process_index,
            trainer.args.world_size,
            {"monitor": history, "qk_clip": clip.history if clip is not None else []},
        )
    out = Path(args.out)
    if save_model is trainer.model:
        trainer.save_model(str(out / "final"))  # every rank joins: gathers FSDP shards where there are any
    if trainer.is_world_process_zero():
        out.mkdir(parents=True, exist_ok=True)
        if save_model is not None and save_model is not trainer.model:
            save_model.save_pretrained(out / "final")
        if save_model is not None and tokenizer is not None:
            tokenizer.save_pretrained(out / "final")
        (out / "results.json").write_text(json.dumps(results, indent=1, default=str) + "\n")
        print(json.dumps({k: v for k, v in results.items() if not isinstance(v, (dict, list))}), flush=True)
    return results


def dump_rank_state(model, folder, rank: int, world_size: int, extra: dict | None = None) -> None:
    """Every parameter of this rank's replica (norm weights included), for comparing ranks after training."""
    from safetensors.torch import save_file

    def full(p):  # FSDP2 parameters are DTensor shards: gather them (a collective every rank joins)
        return p.full_tensor() if hasattr(p, "full_tensor") else p

    Path(folder).mkdir(parents=True, exist_ok=True)
    tensors = {n: full(p.detach()).cpu().clone().contiguous() for n, p in model.named_parameters()}
    meta = {"world_size": str(world_size), "extra": json.dumps(extra or {})}
    save_file(tensors, str(Path(folder) / f"rank{rank}.safetensors"), metadata=meta)


def fmt(x: float) -> str:
    return "nan" if x is None or not math.isfinite(x) else f"{x:.3f}"
