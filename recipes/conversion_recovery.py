"""Conversion recovery: continued pretraining of converted checkpoints against the unconverted original.

A model pretrained with plain attention (default: the bundled tiny Llama, made by ``recipes/pretrain_tiny.py``) is
converted with :func:`hf_qknorm.convert` to each scheme, once with identity-initialised norm weights
(``calibrate=False``) and once calibrated on the training text, and every converted model is trained further with
the same batches, schedule and seed as the unconverted original (the control arm)::

    python recipes/conversion_recovery.py run --workers 2    # resumable: one JSON per arm
    python recipes/conversion_recovery.py report             # docs/conversion_recovery/{table.md,loss_vs_step.png}

The run records go to ``benchmarks/runs/conversion_recovery/runs_lr<lr>/``, ``results.json`` beside them (another
``--runs`` folder: ``results_<folder>.json``). A real checkpoint (SmolLM2-135M, ``scripts/build_smollm2.py``) on the
WikiText-2 raw test split, as docs/evidence.md reports::

    python recipes/conversion_recovery.py run --source models/smollm2-135m --text path/to/wikitext2_test.raw \\
        --schemes qk_norm qk_norm_cap qkv_norm --batch-size 4 --steps 80 --warmup 8 --lr 1e-4 --eval-every 8 \\
        --eval-blocks 8 --final-eval-blocks 32 --out benchmarks/runs/conversion_recovery/smollm2_135m
    python recipes/conversion_recovery.py report --runs benchmarks/runs/conversion_recovery/smollm2_135m \\
        --out docs/conversion_recovery/smollm2_135m

While an arm trains, ``<tag>.partial.json`` beside the records holds its curve so far (rewritten atomically after
each evaluation, removed when the arm's record is written); ``report --include-unfinished`` shows such curves,
marked, beside the finished arms.

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
from hf_qknorm.conversion.calibration.calibrate import CalibrationSettings
from hf_qknorm.conversion.healing.heal import HealSettings
from hf_qknorm.data import bundled_model_dir, perplexity, read_text, split_text, tokenize_blocks

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "docs" / "conversion_recovery"  # the summary table and plot the docs show
DATA = ROOT / "benchmarks" / "runs" / "conversion_recovery"  # the run records and results.json (out of docs/)
WORK = ROOT / "runs" / "conversion_recovery"  # converted checkpoints (not committed)
SCHEMES = ("soft_cap", "qk_norm", "qk_norm_cap", "qkv_norm")
INITS = ("identity", "calibrated")  # the default arms; "healed" (convert --heal) runs when asked: --inits
ALL_INITS = (*INITS, "healed")
TOLERANCE = 0.01  # "back within 1% of the original loss"
DEFAULT_RUNS = DATA / "runs_lr0.0003"  # the committed runs of the bundled tiny Llama (docs/evidence.md)


@dataclass
class ArmConfig:
    scheme: str | None = None  # None: the unconverted original (control)
    init: str | None = None  # "identity", "calibrated" or "healed"; None for the control and soft_cap (no new weights)
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
    heal: dict = field(default_factory=dict)  # HealSettings overrides for the healed arms (default: the library's)

    def tag(self) -> str:
        if self.scheme is None:
            return "original"
        return self.scheme if self.init is None else f"{self.scheme}_{self.init}"


def tokens_per_step(config: dict) -> int:
    """Training tokens per step of a run record's ``config``."""
    return config["batch_size"] * config["context"]


def arms(base: dict, schemes=SCHEMES, inits=INITS) -> list[ArmConfig]:
    out = [ArmConfig(**base)]
    for s in schemes:
        if s == "soft_cap":  # the cap adds no weights: identity and calibrated are the same model
            out.append(ArmConfig(scheme=s, **base))
        else:
            out += [ArmConfig(scheme=s, init=i, **base) for i in inits]
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
        calibration=CalibrationSettings(**{"agreement_tokens": 0, **cfg.calibration}),
        calibrate=cfg.init in ("calibrated", "healed"),
        heal=HealSettings(**cfg.heal) if cfg.init == "healed" else None,
        calibration_text=train_text,
        eval_text=val_text,
        overwrite=True,
        # the arm trains the written model with the plugin: checked loaded that way; the load without the plugin (a
        # second interpreter per arm) is hf-qknorm convert's own check, tested with the conversion
        verify="plugin",
        progress=False,
        log=lambda *a: None,
    )
    info = {"convert_s": round(time.time() - t0, 1), "export": res.export}
    if res.report is not None:
        info["calibration"] = {k: v for k, v in res.report.to_dict().items() if k != "layers"}
    return dst, info


def run_arm(cfg: ArmConfig, work: Path = WORK, progress=None) -> dict:
    """Convert (unless the control arm), then train; ``progress(record)`` is called after every evaluation."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(1)
    src = Path(cfg.source) if cfg.source else bundled_model_dir()
    tokenizer = AutoTokenizer.from_pretrained(src)
    train_blocks, val_blocks, train_text, val_text = _data(cfg, tokenizer)
    for name in ("eval_blocks", "final_eval_blocks"):
        wanted = getattr(cfg, name)
        if wanted is not None and wanted > val_blocks.shape[0]:
            raise ValueError(
                f"{name}={wanted}, but the held-out part of {cfg.text!r} has {val_blocks.shape[0]} blocks of "
                f"{cfg.context} tokens; ask for at most {val_blocks.shape[0]}"
            )
    curve_blocks = val_blocks[: cfg.eval_blocks]
    val_blocks = val_blocks[: cfg.final_eval_blocks]
    rec = {"config": asdict(cfg), "source": str(src)}
    if cfg.scheme is not None and cfg.scheme not in SCHEMES:
        raise ValueError(f"unknown scheme {cfg.scheme!r}; choose one of {SCHEMES} (or None for the control arm)")
    if cfg.init not in (None, *ALL_INITS):
        raise ValueError(f"unknown init {cfg.init!r}; choose one of {ALL_INITS}")
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
            rec["train_s"] = round(time.time() - t0, 1)
            if progress is not None:
                progress(rec)
    rec["final"] = held_out_loss(model, val_blocks)
    rec["train_s"] = round(time.time() - t0, 1)
    rec["versions"] = {"torch": torch.__version__, "hf_qknorm": hf_qknorm.__version__}
    return rec


def _write_json(path: Path, rec: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(rec, allow_nan=False))
    os.replace(tmp, path)


def run_job(cfg: ArmConfig, out_dir: str, work: str) -> str:
    out = Path(out_dir) / f"{cfg.tag()}.json"
    if out.exists():
        return str(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(f"{cfg.tag()}.partial.json")
    rec = run_arm(cfg, Path(work), progress=lambda r: _write_json(partial, {**r, "unfinished": True}))
    _write_json(out, rec)
    partial.unlink(missing_ok=True)
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
        per_step = tokens_per_step(r["config"])
        recovered = steps_to_recover(r["val"], ref_curve * (1 + TOLERANCE))
        final, orig_final = r.get("final"), orig.get("final")
        out["arms"][tag] = {
            "scheme": r["config"]["scheme"],
            "init": r["config"]["init"],
            "loss_after_conversion": r["final_initial"],
            "gap_after_conversion_pct": 100 * (r["final_initial"] / ref_final - 1),
            "steps_to_recover": recovered,
            "tokens_to_recover": None if recovered is None else recovered * per_step,
            "steps_to_match_control": _steps_to_match(r["val"], orig["val"]),
            "steps_run": r["val"][-1][0],
            "final_loss": final,
            "final_vs_control_pct": None if final is None or orig_final is None else 100 * (final / orig_final - 1),
            "calibration_s": cal.get("seconds"),
            "train_s": r["train_s"],
        }
        if r.get("unfinished"):
            out["arms"][tag]["unfinished"] = True
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
    order = ["original"] + [t for s in SCHEMES for t in (s, *(f"{s}_{i}" for i in ALL_INITS))]
    rows = [(t, summary["arms"][t]) for t in order if t in summary["arms"]]
    fmt = lambda x, spec=".4f": "–" if x is None else format(x, spec)
    lines = [
        f"Source: {Path(runs[0]['source']).name} (held-out loss {ref['held_out_loss']:.4f} nats/token on all "
        f"held-out blocks; {ref['curve_blocks_loss']:.4f} on the {cfg['eval_blocks']} curve blocks). Continued "
        f"pretraining: {cfg['steps']} steps x {cfg['batch_size']} x {cfg['context']} tokens, AdamW (0.9, 0.95), "
        f"peak LR {cfg['lr']:g}, {cfg['warmup']} warmup steps, cosine to {cfg['min_lr_ratio']:g} x peak, weight "
        f"decay {cfg['weight_decay']:g}, seed {cfg['seed']}; the same batches in every arm. Norms: {cfg['norm']}.",
        "",
        "| arm | loss after conversion | gap | steps (tokens) to within 1% of original | steps to within 1% of control "
        "| final loss | final vs control |",
        "|---|---|---|---|---|---|---|",
    ]
    per_step = tokens_per_step(cfg)
    for tag, a in rows:
        rec, match, ran = a["steps_to_recover"], a["steps_to_match_control"], a["steps_run"]
        matched = "–" if tag == "original" else f"not within {ran}" if match is None else str(match)
        steps = f"not within {ran}" if rec is None else str(rec)
        vs_control = a["final_vs_control_pct"]
        name = f"{tag} (stopped at step {ran})" if a.get("unfinished") else tag
        lines.append(
            f"| {name} | {fmt(a['loss_after_conversion'])} | {a['gap_after_conversion_pct']:+.1f}% | "
            f"{steps} ({(rec if rec is not None else ran) * per_step:,} tokens) | {matched} | "
            f"{fmt(a['final_loss'])} | {'–' if vs_control is None else format(vs_control, '+.2f') + '%'} |"
        )
    n_final = cfg["final_eval_blocks"]
    lines += [
        "",
        f"Loss after conversion and final loss: {'all' if n_final is None else n_final} held-out blocks. Steps: first "
        f"evaluation (every {cfg['eval_every']} steps, on the curve blocks) at or below 1.01 x the reference; "
        f"{per_step:,} training tokens per step.",
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
    lowest = min(v for r in runs for _, v in r["val"] if v is not None)
    for ax, ylim in zip(axes, (None, (min(ref * 0.97, lowest * 0.99), ref * 1.08))):
        for r in runs:
            c = r["config"]
            tag = ArmConfig(**c).tag()
            tokens, vals = zip(*[(s * tokens_per_step(c), v) for s, v in r["val"] if v is not None])
            ax.plot(
                tokens,
                vals,
                color=colors[c["scheme"]],
                lw=2 if c["scheme"] is None else 1.3,
                ls={"identity": "--", "healed": ":"}.get(c["init"], "-"),
                label=f"{tag} (unfinished)" if r.get("unfinished") else tag,
            )
        ax.axhline(ref, color="gray", lw=0.8)
        ax.axhspan(ref, ref * (1 + TOLERANCE), color="gray", alpha=0.15, label="within 1% of original")
        ax.set_xlabel("continued-pretraining tokens")
        ax.set_ylabel("held-out loss (nats/token)")
        if ylim:
            ax.set_ylim(*ylim)
            ax.set_title("zoom on the original's loss")
        else:
            ax.set_yscale("log")
            ax.set_title("conversion recovery (dashed: identity init, solid: calibrated, dotted: healed)")
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
    r.add_argument("--only", nargs="+", default=None, metavar="ARM", help="run only these arms (e.g. original)")
    r.add_argument(
        "--inits",
        nargs="+",
        default=list(INITS),
        choices=list(ALL_INITS),
        help="the converted arms' inits: identity, calibrated, healed (calibrated, then convert --heal with the "
        "library's HealSettings) (default: identity calibrated)",
    )
    r.add_argument("--text", default=ArmConfig.text, help="training text: a bundled name or a UTF-8 file")
    r.add_argument("--steps", type=int, default=ArmConfig.steps)
    r.add_argument("--warmup", type=int, default=None, help="warmup steps (default: a tenth of --steps)")
    r.add_argument("--lr", type=float, default=ArmConfig.lr)
    r.add_argument("--batch-size", type=int, default=ArmConfig.batch_size, help="blocks per step")
    r.add_argument("--context", type=int, default=ArmConfig.context, help="tokens per block")
    r.add_argument("--eval-every", type=int, default=ArmConfig.eval_every, help="steps between held-out evaluations")
    r.add_argument("--eval-blocks", type=int, default=ArmConfig.eval_blocks, help="held-out blocks for the curve")
    r.add_argument(
        "--final-eval-blocks", type=int, default=None, help="held-out blocks before and after training (default: all)"
    )
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--out", default=None, help="run records (default: benchmarks/runs/conversion_recovery/runs_lr<lr>)")
    r.add_argument("--work", default=str(WORK), help="where converted checkpoints are written (then removed)")
    rep = sub.add_parser("report", help="table.md, results.json and loss_vs_step.png from the runs")
    rep.add_argument("--runs", default=str(DEFAULT_RUNS))
    rep.add_argument("--out", default=str(OUT))
    rep.add_argument(
        "--results",
        default=None,
        help="the summary JSON (default: results.json beside the default runs folder, results_<RUNS>.json otherwise)",
    )
    rep.add_argument(
        "--include-unfinished", action="store_true", help="also show arms still training (their *.partial.json)"
    )
    return p.parse_args(argv)


def cmd_run(args) -> None:
    import concurrent.futures as cf
    import multiprocessing as mp

    args.out = args.out or str(DATA / f"runs_lr{args.lr:g}")
    for name in ("steps", "batch_size", "context", "eval_every", "eval_blocks", "final_eval_blocks"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.warmup is not None and not 0 <= args.warmup <= args.steps:
        raise SystemExit(f"--warmup must be between 0 and --steps ({args.steps}), got {args.warmup}")
    if not (math.isfinite(args.lr) and args.lr > 0):
        raise SystemExit(f"--lr must be a positive number, got {args.lr}")
    try:
        read_text(args.text)  # a missing or empty text file fails here, before any arm starts
    except (OSError, ValueError) as err:
        raise SystemExit(f"--text: {err}") from None
    base = dict(
        norm=args.norm,
        source=args.source,
        text=args.text,
        steps=args.steps,
        lr=args.lr,
        seed=args.seed,
        warmup=max(1, args.steps // 10) if args.warmup is None else args.warmup,
        batch_size=args.batch_size,
        context=args.context,
        eval_every=args.eval_every,
        eval_blocks=args.eval_blocks,
        final_eval_blocks=args.final_eval_blocks,
    )
    every = arms(base, args.schemes, args.inits)
    unknown = sorted(set(args.only or ()) - {c.tag() for c in every})
    if unknown:
        raise SystemExit(f"unknown arm(s) {unknown}; the arms of these schemes are {[c.tag() for c in every]}")
    chosen = [c for c in every if args.only is None or c.tag() in args.only]
    todo = [c for c in chosen if not (Path(args.out) / f"{c.tag()}.json").exists()]
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


def results_path(runs: Path) -> Path:
    """Where ``report`` writes the summary of ``runs``: beside the folder, one file per folder."""
    if runs.resolve() == DEFAULT_RUNS.resolve():
        return runs.parent / "results.json"
    return runs.parent / f"results_{runs.name}.json"


def main(argv=None):
    args = parse_args(argv)
    if args.cmd == "run":
        cmd_run(args)
    else:
        paths = sorted(Path(args.runs).glob("*.json"))
        if not args.include_unfinished:  # <tag>.partial.json: an arm still training
            paths = [p for p in paths if not p.name.endswith(".partial.json")]
        runs = [json.loads(p.read_text()) for p in paths]
        finished = {ArmConfig(**r["config"]).tag() for r in runs if not r.get("unfinished")}
        runs = [r for r in runs if not r.get("unfinished") or ArmConfig(**r["config"]).tag() not in finished]
        if not runs:
            raise SystemExit(f"no runs in {args.runs}; run `python recipes/conversion_recovery.py run` first")
        write_report(runs, Path(args.out), Path(args.results) if args.results else results_path(Path(args.runs)))
        print((Path(args.out) / "table.md").read_text())


if __name__ == "__main__":
    main()
