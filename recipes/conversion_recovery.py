"""Conversion recovery: continued pretraining of converted checkpoints against the unconverted original.

A model pretrained with plain attention (default: the bundled tiny Llama, made by ``recipes/pretrain_tiny.py``) is
converted with :func:`hf_qknorm.convert` to each scheme, once with identity-initialised norm weights
(``calibrate=False``) and once calibrated on the training text, and every converted model is trained further with
the same batches, schedule and seed as the unconverted original (the control arm)::

    python recipes/conversion_recovery.py run --workers 2    # resumable: one JSON per arm
    python recipes/conversion_recovery.py report             # docs/conversion_recovery/{table.md,loss_vs_step.png}

The run records go to ``benchmarks/runs/conversion_recovery/runs_lr<lr>/``, ``results.json`` beside them.

Reported per arm: the held-out loss right after conversion, along continued pretraining (every ``--eval-every``
steps on fixed held-out blocks) and at the end, and the number of steps after which the held-out loss is back
within 1% of the original model's held-out loss before any further training (``steps_to_recover``; 0 means the
conversion itself is within 1%). Calibration spends its own compute before step 0 (distillation of the new norm
weights only; its settings are in each record).
"""

from __future__ import annotations

import os

os.environ.setdefault("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_BF16")  # CPUs that advertise AMX but trap on it

import argparse
import json
import math
import shutil
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a clone without installing
import hf_qknorm
from hf_qknorm.conversion.calibrate import CalibrationSettings
from hf_qknorm.data import bundled_model_dir, perplexity, read_text, split_text, tokenize_blocks

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "docs" / "conversion_recovery"  # the summary table and plot the docs show
DATA = ROOT / "benchmarks" / "runs" / "conversion_recovery"  # the run records and results.json (out of docs/)
WORK = ROOT / "runs" / "conversion_recovery"  # converted checkpoints (not committed)
SCHEMES = ("soft_cap", "qk_norm", "qk_norm_cap", "qkv_norm")
INITS = ("identity", "calibrated")
TOLERANCE = 0.01  # "back within 1% of the original loss"


@dataclass
class ArmConfig:
    scheme: str | None = None  # None: the unconverted original (control)
    init: str | None = None  # "identity" or "calibrated"; None for the control and soft_cap (no new weights)
    norm: str = "layernorm"
    source: str | None = None  # model folder; None: the bundled tiny Llama
    text: str = "tinyshakespeare"
    steps: int = 300
    warmup: int = 30
    lr: float = 3e-4  # the source ended pretraining at 1.5e-4; see docs/evidence.md for 1e-3
    min_lr_ratio: float = 0.1  # cosine floor as a fraction of the peak
    weight_decay: float = 0.1
    batch_size: int = 16
    context: int = 256
    grad_clip: float = 1.0
    eval_every: int = 10
    eval_blocks: int = 48  # held-out blocks for the curve
    final_eval_blocks: int | None = None  # held-out blocks before and after training (None: all of them)
    seed: int = 0
    calibration: dict = field(default_factory=dict)  # CalibrationSettings overrides (default: the library's)

    def tag(self) -> str:
        if self.scheme is None:
            return "original"
        return self.scheme if self.init is None else f"{self.scheme}_{self.init}"


def arms(base: dict, schemes=SCHEMES) -> list[ArmConfig]:
    out = [ArmConfig(**base)]
    for s in schemes:
        if s == "soft_cap":  # the cap adds no weights: identity and calibrated are the same model
            out.append(ArmConfig(scheme=s, **base))
        else:
            out += [ArmConfig(scheme=s, init=i, **base) for i in INITS]
    return out


# ------------------------------------------------------------------------------------------------------------------
# one arm
# ------------------------------------------------------------------------------------------------------------------
def _data(cfg: ArmConfig, tokenizer):
    train, val = split_text(read_text(cfg.text), 0.1)  # the split pretrain_tiny.py and calibration use
    return tokenize_blocks(train, tokenizer, cfg.context), tokenize_blocks(val, tokenizer, cfg.context), train, val


def held_out_loss(model, blocks: torch.Tensor) -> float:
    """Mean next-token cross-entropy (nats) over every predicted position of ``blocks``."""
    return math.log(perplexity(model, blocks, batch_size=16))


def lr_at(step: int, cfg: ArmConfig) -> float:
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    progress = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    floor = cfg.lr * cfg.min_lr_ratio
    return floor + (cfg.lr - floor) * 0.5 * (1 + math.cos(math.pi * progress))


def convert_arm(cfg: ArmConfig, src: Path, train_text: str, val_text: str, work: Path) -> tuple[Path, dict]:
    """Convert ``src`` for this arm into ``work/<tag>`` (redone every time: conversion is part of the arm)."""
    dst = work / cfg.tag()
    t0 = time.time()
    res = hf_qknorm.convert(
        src,
        dst,
        config=hf_qknorm.QKNormConfig(scheme=cfg.scheme, norm=cfg.norm if cfg.scheme != "soft_cap" else None),
        calibration=CalibrationSettings(**cfg.calibration),
        calibrate=cfg.init == "calibrated",
        calibration_text=train_text,
        eval_text=val_text,
        overwrite=True,
        progress=False,
        log=lambda *a: None,
    )
    info = {"convert_s": round(time.time() - t0, 1), "export": res.export}
    if res.report is not None:
        info["calibration"] = {k: v for k, v in res.report.to_dict().items() if k != "layers"}
    return dst, info


def run_arm(cfg: ArmConfig, work: Path = WORK) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(1)
    src = Path(cfg.source) if cfg.source else bundled_model_dir()
    tokenizer = AutoTokenizer.from_pretrained(src)
    train_blocks, val_blocks, train_text, val_text = _data(cfg, tokenizer)
    curve_blocks = val_blocks[: cfg.eval_blocks]
    val_blocks = val_blocks[: cfg.final_eval_blocks]
    rec = {"config": asdict(cfg), "source": str(src)}
    if cfg.scheme is not None and cfg.scheme not in SCHEMES:
        raise ValueError(f"unknown scheme {cfg.scheme!r}; choose one of {SCHEMES} (or None for the control arm)")
    if cfg.init not in (None, *INITS):
        raise ValueError(f"unknown init {cfg.init!r}; choose one of {INITS}")
    if cfg.scheme is None:
        folder = src
    else:
        folder, info = convert_arm(cfg, src, train_text, val_text, work)
        rec["conversion"] = info
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    rec["model_type"] = model.config.model_type
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": rest, "weight_decay": 0.0}],
        lr=cfg.lr,
        betas=(0.9, 0.95),
        eps=1e-8,
    )
    gen = torch.Generator().manual_seed(cfg.seed)  # the same batches in every arm
    rec["final_initial"] = held_out_loss(model, val_blocks)
    rec["val"] = [[0, held_out_loss(model, curve_blocks)]]
    rec["train"] = []
    model.train()
    t0 = time.time()
    for step in range(cfg.steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(step, cfg)
        idx = torch.randint(0, train_blocks.shape[0], (cfg.batch_size,), generator=gen)
        ids = train_blocks[idx]
        loss = model(input_ids=ids, labels=ids).loss
        if not torch.isfinite(loss):
            rec["nonfinite_step"] = step
            break
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        if step % 10 == 0:
            rec["train"].append([step, float(loss.detach())])
        if (step + 1) % cfg.eval_every == 0:
            rec["val"].append([step + 1, held_out_loss(model, curve_blocks)])
    rec["final"] = held_out_loss(model, val_blocks)
    rec["train_s"] = round(time.time() - t0, 1)
    rec["versions"] = {"torch": torch.__version__, "hf_qknorm": hf_qknorm.__version__}
    return rec


def run_job(cfg: ArmConfig, out_dir: str, work: str) -> str:
    out = Path(out_dir) / f"{cfg.tag()}.json"
    if out.exists():
        return str(out)
    rec = run_arm(cfg, Path(work))
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(rec, allow_nan=False))
    os.replace(tmp, out)
    if cfg.scheme is not None:
        shutil.rmtree(Path(work) / cfg.tag(), ignore_errors=True)
    return str(out)


# ------------------------------------------------------------------------------------------------------------------
# summary
# ------------------------------------------------------------------------------------------------------------------
def steps_to_recover(curve: list, target: float) -> int | None:
    """First evaluated step whose held-out loss is at most ``target`` (None if never)."""
    for step, loss in curve:
        if loss is not None and loss <= target:
            return int(step)
    return None


def summarise(runs: list[dict]) -> dict:
    by_tag = {ArmConfig(**r["config"]).tag(): r for r in runs}
    if "original" not in by_tag:
        raise ValueError("the control arm 'original' has not run yet; run `conversion_recovery.py run` first")
    orig = by_tag["original"]
    ref_curve = orig["val"][0][1]  # the original model's loss on the curve blocks, before further training
    ref_final = orig["final_initial"]
    out = {
        "reference": {"curve_blocks_loss": ref_curve, "held_out_loss": ref_final, "tolerance": TOLERANCE},
        "arms": {},
    }
    for tag, r in by_tag.items():
        cal = (r.get("conversion") or {}).get("calibration") or {}
        out["arms"][tag] = {
            "scheme": r["config"]["scheme"],
            "init": r["config"]["init"],
            "loss_after_conversion": r["final_initial"],
            "gap_after_conversion_pct": 100 * (r["final_initial"] / ref_final - 1),
            "steps_to_recover": steps_to_recover(r["val"], ref_curve * (1 + TOLERANCE)),
            "steps_to_match_control": _steps_to_match(r["val"], orig["val"]),
            "final_loss": r["final"],
            "final_vs_control_pct": 100 * (r["final"] / orig["final"] - 1),
            "calibration_s": cal.get("seconds"),
            "train_s": r["train_s"],
        }
    return out


def _steps_to_match(curve: list, control: list) -> int | None:
    """First evaluated step at which the arm is within 1% of the control arm at the same step."""
    ctrl = {s: v for s, v in control}
    for step, loss in curve:
        if step in ctrl and loss is not None and loss <= ctrl[step] * (1 + TOLERANCE):
            return int(step)
    return None


def write_report(runs: list[dict], out: Path, results: Path | None = None) -> dict:
    """``table.md`` and ``loss_vs_step.png`` into ``out``; the summary as JSON into ``results`` (default:
    ``out/results.json``; the command writes it beside the runs folder, out of docs/)."""
    summary = summarise(runs)
    cfg = runs[0]["config"]
    ref = summary["reference"]
    order = ["original"] + [t for s in SCHEMES for t in (s, f"{s}_identity", f"{s}_calibrated")]
    rows = [(t, summary["arms"][t]) for t in order if t in summary["arms"]]
    fmt = lambda x, spec=".4f": "–" if x is None else format(x, spec)
    lines = [
        f"Source: {Path(runs[0]['source']).name} (held-out loss {ref['held_out_loss']:.4f} nats/token on all "
        f"held-out blocks; {ref['curve_blocks_loss']:.4f} on the {cfg['eval_blocks']} curve blocks). Continued "
        f"pretraining: {cfg['steps']} steps x {cfg['batch_size']} x {cfg['context']} tokens, AdamW (0.9, 0.95), "
        f"peak LR {cfg['lr']:g}, {cfg['warmup']} warmup steps, cosine to {cfg['min_lr_ratio']:g} x peak, weight "
        f"decay {cfg['weight_decay']:g}, seed {cfg['seed']}; the same batches in every arm. Norms: {cfg['norm']}.",
        "",
        "| arm | loss after conversion | gap | steps to within 1% of original | steps to within 1% of control "
        "| final loss | final vs control |",
        "|---|---|---|---|---|---|---|",
    ]
    for tag, a in rows:
        rec = a["steps_to_recover"]
        match = a["steps_to_match_control"]
        matched = "–" if tag == "original" else fmt(match, "d") if match is not None else "never"
        lines.append(
            f"| {tag} | {fmt(a['loss_after_conversion'])} | {a['gap_after_conversion_pct']:+.1f}% | "
            f"{'not within ' + str(cfg['steps']) if rec is None else rec} | "
            f"{matched} | "
            f"{fmt(a['final_loss'])} | {a['final_vs_control_pct']:+.2f}% |"
        )
    lines += [
        "",
        "Loss after conversion and final loss: all held-out blocks. Steps: first evaluation (every "
        f"{cfg['eval_every']} steps, on the curve blocks) at or below 1.01 x the reference.",
    ]
    out.mkdir(parents=True, exist_ok=True)
    (out / "table.md").write_text("\n".join(lines) + "\n")
    results = results or out / "results.json"
    results.parent.mkdir(parents=True, exist_ok=True)
    results.write_text(json.dumps(summary, indent=1))
    _plot(runs, summary, out / "loss_vs_step.png")
    return summary


def _plot(runs, summary, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {
        None: "black",
        "soft_cap": "tab:orange",
        "qk_norm": "tab:blue",
        "qk_norm_cap": "tab:green",
        "qkv_norm": "tab:red",
    }
    ref = summary["reference"]["curve_blocks_loss"]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, ylim in zip(axes, (None, (ref * 0.97, ref * 1.08))):
        for r in runs:
            c = r["config"]
            tag = ArmConfig(**c).tag()
            steps, vals = zip(*[(s, v) for s, v in r["val"] if v is not None])
            ax.plot(
                steps,
                vals,
                color=colors[c["scheme"]],
                lw=2 if c["scheme"] is None else 1.3,
                ls="--" if c["init"] == "identity" else "-",
                label=tag,
            )
        ax.axhline(ref, color="gray", lw=0.8)
        ax.axhspan(ref, ref * (1 + TOLERANCE), color="gray", alpha=0.15, label="within 1% of original")
        ax.set_xlabel("continued-pretraining step")
        ax.set_ylabel("held-out loss (nats/token)")
        if ylim:
            ax.set_ylim(*ylim)
            ax.set_title("zoom on the original's loss")
        else:
            ax.set_yscale("log")
            ax.set_title("conversion recovery (dashed: identity init, solid: calibrated)")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ------------------------------------------------------------------------------------------------------------------
# command line
# ------------------------------------------------------------------------------------------------------------------
def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="run the arms whose results are missing")
    r.add_argument("--workers", type=int, default=2, help="parallel processes (one thread each)")
    r.add_argument("--schemes", nargs="+", default=list(SCHEMES), choices=list(SCHEMES))
    r.add_argument("--norm", default="layernorm", choices=list(hf_qknorm.NORMS))
    r.add_argument("--source", default=None, help="pretrained model folder (default: the bundled tiny Llama)")
    r.add_argument("--steps", type=int, default=ArmConfig.steps)
    r.add_argument("--lr", type=float, default=ArmConfig.lr)
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--out", default=None, help="run records (default: benchmarks/runs/conversion_recovery/runs_lr<lr>)")
    r.add_argument("--work", default=str(WORK), help="where converted checkpoints are written (then removed)")
    rep = sub.add_parser("report", help="table.md, results.json and loss_vs_step.png from the runs")
    rep.add_argument("--runs", default=str(DATA / f"runs_lr{ArmConfig.lr:g}"))
    rep.add_argument("--out", default=str(OUT))
    return p.parse_args(argv)


def cmd_run(args) -> None:
    import concurrent.futures as cf
    import multiprocessing as mp

    args.out = args.out or str(DATA / f"runs_lr{args.lr:g}")
    base = dict(
        norm=args.norm,
        source=args.source,
        steps=args.steps,
        lr=args.lr,
        seed=args.seed,
        warmup=max(1, args.steps // 10),
    )
    todo = [c for c in arms(base, args.schemes) if not (Path(args.out) / f"{c.tag()}.json").exists()]
    print(f"{len(todo)} arm(s) to run", flush=True)
    if args.workers <= 1:
        for c in todo:
            run_job(c, args.out, args.work)
            print(f"done {c.tag()}", flush=True)
        return
    with cf.ProcessPoolExecutor(args.workers, mp_context=mp.get_context("spawn")) as ex:
        futs = {ex.submit(run_job, c, args.out, args.work): c for c in todo}
        for f in cf.as_completed(futs):
            err = f.exception()
            print(f"{'FAILED' if err else 'done'} {futs[f].tag()} {err or ''}", flush=True)


def main(argv=None):
    args = parse_args(argv)
    if args.cmd == "run":
        cmd_run(args)
    else:
        runs = [json.loads(p.read_text()) for p in sorted(Path(args.runs).glob("*.json"))]
        if not runs:
            raise SystemExit(f"no runs in {args.runs}; run `python recipes/conversion_recovery.py run` first")
        write_report(runs, Path(args.out), Path(args.runs).parent / "results.json")
        print((Path(args.out) / "table.md").read_text())


if __name__ == "__main__":
    main()
