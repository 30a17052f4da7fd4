"""Pretrain a small patched model from scratch on several processes with a plain training loop: FSDP2, tensor
parallelism or DDP, with QK-Clip, the attention-logit monitor and (optionally) the Q/K learning-rate rule.

One process per GPU, or gloo processes on a CPU-only machine (FSDP2's ``fully_shard`` and DTensor tensor parallelism
run on the CPU; accelerate and ``Trainer`` enable FSDP only on GPUs, hence this loop)::

    torchrun --nproc-per-node 2 recipes/pretrain_sharded.py                       # FSDP2 (default)
    torchrun --nproc-per-node 2 recipes/pretrain_sharded.py --shard tp            # heads split across ranks
    torchrun --nproc-per-node 2 recipes/pretrain_sharded.py --shard ddp
    accelerate launch --use_fsdp --fsdp_version 2 --num_processes 2 recipes/pretrain_sharded.py   # the same FSDP2 run
    torchrun --nproc-per-node 2 recipes/pretrain_sharded.py --resume latest       # continue from the last checkpoint

Under ``accelerate launch --use_fsdp`` the recipe reads accelerate's FSDP settings (version 2 required,
``--fsdp_reshard_after_forward``, ``--mixed_precision bf16``) and shards with ``fully_shard`` itself. Every
``--save-steps`` steps it writes ``<out>/checkpoint-<step>/``: a sharded ``torch.distributed.checkpoint`` of the
model and optimizer plus the training controls' state (``controls.json``); a resumed run continues exactly like the
uninterrupted one (data and learning rate are functions of the step). At the end ``<out>/final`` is a whole
``qknorm_<family>`` folder (``save_pretrained`` of the gathered weights, tokenizer included) and
``<out>/results.json`` holds the held-out perplexity, the last monitor record and the QK-Clip counters.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import train_scratch  # noqa: E402

import hf_qknorm  # noqa: E402
from hf_qknorm.modeling.sharding import all_reduce_sum, local_part  # noqa: E402
from hf_qknorm.portable.layout import family_of, find_layers, unwrap  # noqa: E402

SHARDS = ("fsdp", "tp", "ddp")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=C.DefaultsFormatter)
    p.add_argument(
        "--shard",
        choices=SHARDS,
        default=None,
        help="fsdp: FSDP2 full shard; tp: tensor-parallel "
        "attention (hf_qknorm.parallelize_attention); ddp: replicas (default: fsdp, or what accelerate "
        "launch configured)",
    )
    p.add_argument("--no-reshard", action="store_true", help="FSDP2 reshard_after_forward=False")
    p.add_argument("--bf16", action="store_true", help="FSDP2 mixed precision: bf16 parameters, fp32 reduction")
    p.add_argument("--text", default="tinyshakespeare", help="UTF-8 text file or a bundled text name")
    p.add_argument("--val-fraction", type=float, default=0.1)
    p.add_argument("--context", type=int, default=128, help="tokens per block, BOS included")
    p.add_argument("--eval-blocks", type=int, default=16, help="held-out blocks for the perplexity report")
    p.add_argument("--out", default="runs/pretrain_sharded")
    p.add_argument("--max-steps", type=int, default=60)
    p.add_argument("--batch-size", type=int, default=8, help="blocks per data-parallel rank per step")
    p.add_argument(
        "--optimizer",
        choices=("adamw", "muon"),
        default="adamw",
        help="muon: torch.optim.Muon on the hidden matrices, AdamW on the rest (hf_qknorm.training.muon.MuonAdamW)",
    )
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (Muon's, with --optimizer muon)")
    p.add_argument("--warmup-steps", type=int, default=5)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--save-steps", type=int, default=0, help="sharded checkpoint every N steps (0: none)")
    p.add_argument("--resume", default=None, help="checkpoint folder, or 'latest' in --out")
    p.add_argument("--logging-steps", type=int, default=10)
    p.add_argument("--threads", type=int, default=1, help="torch threads per process on CPU")
    q = p.add_argument_group("hf_qknorm")
    q.add_argument("--qk-clip-tau", type=float, default=50.0, help="QK-Clip threshold (0: off)")
    q.add_argument("--monitor-every", type=int, default=10, help="attention-logit monitor period (0: off)")
    q.add_argument("--qk-lr-tau", type=float, default=None, help="Q/K learning-rate rule with this tau (default off)")
    m = p.add_argument_group("model")
    m.add_argument("--family", choices=sorted(train_scratch.FAMILY_CONFIGS), default="llama")
    m.add_argument("--scheme", choices=("none",) + tuple(hf_qknorm.SCHEMES), default="qk_norm_cap")
    m.add_argument("--norm", choices=hf_qknorm.NORMS, default=None, help="default layernorm")
    m.add_argument("--softcap", type=float, default=None, help="default 50 for capped schemes")
    m.add_argument("--hidden-size", type=int, default=128)
    m.add_argument("--layers", type=int, default=4)
    m.add_argument("--heads", type=int, default=4)
    m.add_argument("--kv-heads", type=int, default=2, help="GQA key/value heads (not gpt2)")
    args = p.parse_args(argv)
    args.tokenizer = None
    return args


def from_accelerate(args) -> None:
    """Take the sharding from ``accelerate launch --use_fsdp ...`` when no ``--shard`` was given."""
    if os.environ.get("ACCELERATE_USE_FSDP", "false").lower() != "true":
        args.shard = args.shard or "fsdp"
        return
    if os.environ.get("FSDP_VERSION", "1") != "2":
        raise SystemExit("pretrain_sharded.py shards with FSDP2: launch with --fsdp_version 2")
    args.shard = args.shard or "fsdp"
    args.no_reshard = args.no_reshard or os.environ.get("FSDP_RESHARD_AFTER_FORWARD", "true") == "false"
    args.bf16 = args.bf16 or os.environ.get("ACCELERATE_MIXED_PRECISION", "no") == "bf16"


def init_distributed():
    """``(rank, world, device)``: one process per GPU with NCCL, else gloo on the CPU."""
    if not dist.is_initialized():
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)) % torch.cuda.device_count())
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    return rank, world, device


def shard(model, args, world: int, device):
    """The model sharded as ``--shard`` says; returns ``(model, data-parallel ranks)``. Patch first (done)."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device.type, (world,))
    if args.shard == "tp":
        return hf_qknorm.parallelize_attention(model, mesh), 1  # every rank sees the whole batch
    if args.shard == "ddp":
        return torch.nn.parallel.DistributedDataParallel(model), world
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    kw = {"mesh": mesh, "reshard_after_forward": not args.no_reshard}
    if args.bf16:
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in find_layers(unwrap(model), family_of(model)):
        fully_shard(block, **kw)
    return fully_shard(model, **kw), world


def make_optimizer(model, args):
    if args.optimizer == "muon":
        from hf_qknorm.training.muon import MuonAdamW

        return MuonAdamW(model, lr=args.lr, adamw_lr=args.lr, weight_decay=args.weight_decay)
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    rest = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": rest, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.95),
    )


def optimizers(opt) -> list:
    """The plain optimizers behind ``opt`` (``torch.distributed.checkpoint`` handles those)."""
    return [opt.muon, opt.adamw] if hasattr(opt, "muon") else [opt]


def lr_factor(step: int, args) -> float:
    """Linear warmup, then cosine to 10% at the last step: a function of the step, so resuming is exact."""
    if step < args.warmup_steps:
        return (step + 1) / args.warmup_steps
    progress = (step - args.warmup_steps) / max(1, args.max_steps - args.warmup_steps)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def batch(blocks: torch.Tensor, step: int, args, dp: int, dp_rank: int) -> torch.Tensor:
    """This rank's share of step ``step``'s batch: ``batch_size * dp`` blocks drawn with a seed of the step."""
    g = torch.Generator().manual_seed(args.seed * 1_000_003 + step)
    idx = torch.randint(0, blocks.shape[0], (args.batch_size * dp,), generator=g)
    return blocks[idx[dp_rank::dp]]


def clip_grad_norm(model, max_norm: float) -> float:
    """Global gradient norm over whole, FSDP-sharded and tensor-parallel gradients alike (each ``DTensor`` shard's
    squares summed over the groups it is split across), then clipped to ``max_norm``."""
    buckets: dict[tuple, torch.Tensor] = {}
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    for g in grads:
        part = local_part(g, "gradient")
        sq = part.tensor.detach().float().square().sum()
        buckets[part.groups] = buckets.get(part.groups, 0) + sq
    total = sum(float(all_reduce_sum(sq.reshape(1), groups)) for groups, sq in buckets.items())
    norm = math.sqrt(total)
    if max_norm > 0 and norm > max_norm:
        for g in grads:
            local_part(g).tensor.mul_(max_norm / (norm + 1e-6))
    return norm


def build(args, tokenizer, world, device):
    """Model (patched, then sharded), optimizer and the training controls."""
    model = train_scratch.build_model(args, tokenizer).to(device)
    model, dp = shard(model, args, world, device)
    opt = make_optimizer(model, args)
    clip = hf_qknorm.QKClip(model, tau=args.qk_clip_tau) if args.qk_clip_tau > 0 else None
    monitor = hf_qknorm.QKMonitor(model) if args.monitor_every > 0 else None
    qk = hf_qknorm.QKLearningRate(model, tau=args.qk_lr_tau) if args.qk_lr_tau else None
    return model, dp, opt, {"clip": clip, "monitor": monitor, "qk": qk}


def save_checkpoint(folder: Path, model, opt, ctl, step: int, history: list, rank: int) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, optimizers(opt))
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(folder))
    if rank == 0:
        state = {"step": step, "history": history, **{k: ctl[k].state_dict() for k in ("clip", "qk") if ctl[k]}}
        (folder / "controls.json").write_text(json.dumps(state) + "\n")
    dist.barrier()


def load_checkpoint(folder: Path, model, opt, ctl) -> tuple[int, list]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    msd, osd = get_state_dict(model, optimizers(opt))
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=str(folder))
    set_state_dict(model, optimizers(opt), model_state_dict=state["model"], optim_state_dict=state["optim"])
    saved = json.loads((folder / "controls.json").read_text())
    if ctl["clip"] is not None and "clip" in saved:
        ctl["clip"].load_state_dict(saved["clip"])
    if ctl["qk"] is not None and "qk" in saved:
        ctl["qk"].load_state_dict(saved["qk"])
    return int(saved["step"]), saved["history"]


def resume_folder(args) -> Path | None:
    if args.resume != "latest":
        return Path(args.resume) if args.resume else None
    found = sorted(Path(args.out).glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[-1]))
    return found[-1] if found else None


def train_step(model, opt, ctl, ids, step, args) -> dict:
    """One optimizer step with the controls; returns what to log (loss averaged over ranks)."""
    monitor = ctl["monitor"] if args.monitor_every and (step + 1) % args.monitor_every == 0 else None
    for group, base in zip(opt.param_groups, args.base_lrs):
        group["lr"] = base * lr_factor(step, args)
    if monitor is not None:
        monitor.start()
    loss = model(input_ids=ids, labels=ids).loss
    stats = monitor.stop(step) if monitor is not None else {}
    loss.backward()
    grad_norm = clip_grad_norm(model, args.grad_clip)
    if ctl["qk"] is not None:
        ctl["qk"].step(opt)
    else:
        opt.step()
    t_clip = time.perf_counter()
    clipped = ctl["clip"].step() if ctl["clip"] is not None else []
    t_clip = time.perf_counter() - t_clip  # the clip's own step: its all-reduce and the rescale
    opt.zero_grad(set_to_none=True)
    mean_loss = loss.detach().float().reshape(1)
    dist.all_reduce(mean_loss)
    return {
        "step": step + 1,
        "loss": float(mean_loss) / dist.get_world_size(),
        "grad_norm": grad_norm,
        "clipped_heads": len(clipped),
        "clip_seconds": t_clip,
        **({"max_logit": stats["qk/max_logit"]} if stats else {}),
    }


def save_final(model, args, tokenizer, rank: int) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        unwrap(model).save_pretrained(Path(args.out) / "final", state_dict=full)
        tokenizer.save_pretrained(Path(args.out) / "final")
    dist.barrier()


def main(argv=None):
    args = parse_args(argv)
    from_accelerate(args)
    rank, world, device = init_distributed()
    C.setup(args, "pretrain_sharded")
    torch.manual_seed(args.seed)
    tokenizer = C.load_tokenizer()
    train_ds, val_blocks = C.text_blocks(args, tokenizer)
    model, dp, opt, ctl = build(args, tokenizer, world, device)
    args.base_lrs = [g["lr"] for g in opt.param_groups]
    start, history = 0, []
    folder = resume_folder(args)
    if folder is not None:
        start, history = load_checkpoint(folder, model, opt, ctl)
    log = print if rank == 0 else (lambda *a, **k: None)
    log(
        f"{args.family} {args.scheme}, {args.shard} over {world} processes ({device.type}), "
        f"{sum(p.numel() for p in model.parameters()):,} parameters"
        + (f", resumed at step {start} from {folder}" if folder is not None else ""),
        flush=True,
    )
    t0 = time.time()
    for step in range(start, args.max_steps):
        ids = batch(train_ds.blocks, step, args, dp, rank % dp if dp > 1 else 0).to(device)
        row = train_step(model, opt, ctl, ids, step, args)
        history.append(row)
        if (step + 1) % args.logging_steps == 0 or step + 1 == args.max_steps:
            log(
                json.dumps(
                    {k: round(v, 4) if isinstance(v, float) else v for k, v in row.items() if k != "clip_seconds"}
                ),
                flush=True,
            )
        if args.save_steps and (step + 1) % args.save_steps == 0:
            save_checkpoint(Path(args.out) / f"checkpoint-{step + 1}", model, opt, ctl, step + 1, history, rank)
    results = {
        "recipe": "pretrain_sharded",
        "shard": args.shard,
        "world_size": world,
        "steps": args.max_steps,
        "train_seconds": round(time.time() - t0, 1),
        "val_ppl": C.ppl(model, val_blocks),
        "qknorm": getattr(unwrap(model).config, "qknorm", None),
        "last": history[-1] if history else None,
        "clipped_steps": ctl["clip"].clipped_steps if ctl["clip"] else None,
        "clip_step_seconds": round(sum(r.get("clip_seconds", 0.0) for r in history[start:]), 3),
    }
    save_final(model, args, tokenizer, rank)
    if rank == 0:
        (Path(args.out) / "results.json").write_text(json.dumps(results, indent=1, default=str) + "\n")
        log(
            f"held-out perplexity {C.fmt(results['val_ppl'])} after {args.max_steps} steps "
            f"({results['train_seconds']:.0f} s); final model in {Path(args.out) / 'final'}",
            flush=True,
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    # Every rank has saved, written and left its process group: leave without the interpreter's teardown, in which
    # gloo's threads can abort on a loaded machine ("terminate called without an active exception", signal 6) and
    # turn a finished run into a failed rank (as hf-qknorm does under a launcher: hf_qknorm/cli/main.py).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
