"""Learning-rate sweep of the attention schemes on a small Llama (Wortsman et al. 2023; Rybakov et al. 2024).

Trains a 4-layer, width-128, 4-head Llama (context 128, batch 16) on character-level Tiny Shakespeare for each
scheme over a log-spaced LR grid, one process per run with one thread, and records validation loss, the largest
attention logit per layer and the output RMS of the QKV, output-projection and second MLP layers::

    python recipes/lr_sweep.py run --workers 2        # resumable: finished runs are skipped
    python recipes/lr_sweep.py report                 # tables, results.json and plots under docs/lr_sweep/

``run`` first trains the coarse grid (seed 0) and the extra seeds at the ordinary LR, then adds one refining LR
per scheme between its largest stable and smallest diverged grid LR. Divergence rule (applied mechanically, see
:func:`diverged`): a run diverged when its loss became non-finite, or its final validation loss is at or above the
unigram loss of the validation text (it learned nothing beyond character frequencies), or its final validation
loss is more than ``SPIKE`` nats above the lowest validation loss it reached earlier (it blew up and did not recover).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _sweep_common import SCHEMES, RunConfig, char_data, load_runs, run_jobs  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "docs" / "lr_sweep"
GRID = [1e-3, 3e-3, 1e-2, 3e-2, 1e-1, 3e-1, 1.0]  # half-decades, Wortsman et al.'s grid extended to 1
ORDINARY_LR = 3e-3
SEEDS = (0, 1, 2)
SPIKE = 0.2  # nats
# Rybakov et al. 2024 (830M, see docs/evidence.md for the sources): max stable LR and perplexity at LR 3e-4
PAPER = {"baseline": (6e-3, 11.19), "soft_cap": (40e-3, 11.24), "qk_norm": (40e-3, 10.84),
         "qk_norm_cap": (60e-3, 11.00), "qkv_norm": (60e-3, 10.85)}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="train the missing runs")
    r.add_argument("--workers", type=int, default=2, help="parallel processes (one thread each)")
    r.add_argument("--schemes", nargs="+", default=list(SCHEMES), choices=list(SCHEMES))
    r.add_argument("--grid", nargs="+", type=float, default=GRID)
    r.add_argument("--seeds", nargs="+", type=int, default=list(SEEDS), help="seeds at the ordinary LR")
    r.add_argument("--ordinary-lr", type=float, default=ORDINARY_LR)
    r.add_argument("--steps", type=int, default=RunConfig.steps)
    r.add_argument("--warmup", type=int, default=RunConfig.warmup)
    r.add_argument("--no-refine", action="store_true", help="skip the refining LR between stable and diverged")
    r.add_argument("--text", default="tinyshakespeare", help="UTF-8 text file, or a bundled text name")
    r.add_argument("--out", default=str(OUT / "runs"))
    rep = sub.add_parser("report", help="summarise the runs into tables, results.json and plots")
    rep.add_argument("--runs", default=str(OUT / "runs"))
    rep.add_argument("--out", default=str(OUT))
    rep.add_argument("--text", default="tinyshakespeare")
    return p.parse_args(argv)


# ------------------------------------------------------------------------------------------------------------------
# the divergence rule and the summaries
# ------------------------------------------------------------------------------------------------------------------
def unigram_loss(text: str = "tinyshakespeare", context: int = 128) -> float:
    """Cross-entropy of the validation blocks under the training text's character frequencies (nats)."""
    train_ids, val_blocks, vocab = char_data(text, context)
    counts = Counter(train_ids.tolist())
    total = sum(counts.values())
    val = Counter(val_blocks[:, 1:].reshape(-1).tolist())
    n = sum(val.values())
    return -sum(c * math.log(counts.get(t, 0.5) / total) for t, c in val.items()) / n


def diverged(rec: dict, unigram: float) -> bool:
    final = rec["final_val"]
    if rec["nonfinite"] or final is None or not math.isfinite(final):
        return True
    if final >= unigram:
        return True
    earlier = [v for _, v in rec["val"][1:-1] if v is not None]
    return bool(earlier) and final > min(earlier) + SPIKE


def max_stable_lr(points: dict[float, bool]) -> tuple[float | None, float | None]:
    """``(largest stable LR below the first diverged one, first diverged LR)`` from ``{lr: diverged}``."""
    stable, first_div = None, None
    for lr in sorted(points):
        if points[lr]:
            first_div = lr
            break
        stable = lr
    return stable, first_div


def lr_sensitivity(losses: dict[float, float | None], init: float, grid) -> float:
    """Wortsman et al.: ``E_eta[min(l(eta), l0) - l*]`` over the grid (uniform in log LR), ``l*`` = best on grid."""
    vals = [min(losses[lr], init) if losses.get(lr) is not None else init for lr in grid]
    return sum(v - min(vals) for v in vals) / len(vals)


def summarise(runs: list[dict], unigram: float) -> dict:
    out = {}
    for scheme in SCHEMES:
        rs = [r for r in runs if r["config"]["scheme"] == scheme and r["config"].get("p") is None]
        if not rs:
            continue
        seed0 = {r["config"]["lr"]: r for r in rs if r["config"]["seed"] == 0}
        points = {lr: diverged(r, unigram) for lr, r in seed0.items()}
        stable, first_div = max_stable_lr(points)
        grid = [lr for lr in GRID if lr in seed0]
        losses = {lr: r["final_val"] for lr, r in seed0.items()}
        init = sum(r["init_val"] for r in seed0.values()) / len(seed0)
        finite = {lr: v for lr, v in losses.items() if v is not None}
        best_lr = min(finite, key=finite.get) if finite else None
        ordinary = [r["final_val"] for r in rs if r["config"]["lr"] == ORDINARY_LR and r["final_val"] is not None]
        out[scheme] = {
            "max_stable_lr": stable, "first_diverged_lr": first_div,
            "lr_sensitivity": lr_sensitivity(losses, init, grid) if len(grid) == len(GRID) else None,
            "best_loss": finite.get(best_lr), "best_lr": best_lr, "init_loss": init,
            "ordinary_lr": ORDINARY_LR, "ordinary_losses": ordinary,
            "ordinary_mean": sum(ordinary) / len(ordinary) if ordinary else None,
            "ordinary_std": _std(ordinary),
            "per_lr": {f"{lr:g}": {"final_val": r["final_val"], "diverged": points[lr],
                                   "max_logit_peak": _peak_logit(r), "wall_s": r["wall_s"]}
                       for lr, r in sorted(seed0.items())},
        }
    return out


def _std(xs):
    if len(xs) < 2:
        return None
    m = sum(xs) / len(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))


def _peak_logit(rec: dict) -> float | None:
    vals = [v for p in rec["probe"] for v in p["max_logit"] if v is not None and math.isfinite(v)]
    return max(vals) if vals else None


# ------------------------------------------------------------------------------------------------------------------
# run
# ------------------------------------------------------------------------------------------------------------------
def coarse_jobs(args) -> list[RunConfig]:
    base = dict(steps=args.steps, warmup=args.warmup, text=args.text)
    # ordinary LR first (all seeds), then outward: the edge-defining high LRs before the slow low-LR end
    order = sorted(args.grid, key=lambda lr: (lr != args.ordinary_lr, -lr if lr > args.ordinary_lr else 10 - lr))
    jobs = [RunConfig(scheme=s, lr=lr, seed=0, **base) for lr in order for s in args.schemes]
    seeds = [RunConfig(scheme=s, lr=args.ordinary_lr, seed=seed, **base)
             for seed in args.seeds if seed != 0 for s in args.schemes]
    lowest = len(jobs) - len(args.schemes) if min(args.grid) < args.ordinary_lr else len(jobs)
    return jobs[:lowest] + seeds + jobs[lowest:]  # the extra seeds before the lowest (least telling) LR


def refine_jobs(args, unigram: float) -> list[RunConfig]:
    runs = load_runs(args.out)
    jobs = []
    for scheme in args.schemes:
        seed0 = {r["config"]["lr"]: r for r in runs if r["config"]["scheme"] == scheme and r["config"]["seed"] == 0}
        stable, first_div = max_stable_lr({lr: diverged(r, unigram) for lr, r in seed0.items()})
        if stable is not None and first_div is not None and first_div / stable > 1.5:
            lr = float(f"{math.sqrt(stable * first_div):.2g}")
            jobs.append(RunConfig(scheme=scheme, lr=lr, seed=0, steps=args.steps, warmup=args.warmup,
                                  text=args.text))
    return jobs


def cmd_run(args) -> None:
    run_jobs(coarse_jobs(args), args.out, args.workers)
    if not args.no_refine:
        unigram = unigram_loss(args.text)
        for _ in range(2):  # two bisections: the edge to within a factor ~1.35
            jobs = refine_jobs(args, unigram)
            if not jobs:
                break
            run_jobs(jobs, args.out, args.workers)


# ------------------------------------------------------------------------------------------------------------------
# report
# ------------------------------------------------------------------------------------------------------------------
def _fmt(x, spec=".3f"):
    return "–" if x is None else format(x, spec)


def table_md(summary: dict) -> str:
    rows = ["| scheme | max stable LR | first diverged LR | LR sensitivity | best loss (at LR) | "
            f"loss at LR {ORDINARY_LR:g}, mean ± sd (n) | paper max stable LR | paper ppl |",
            "|---|---|---|---|---|---|---|---|"]
    for scheme, s in summary.items():
        paper = PAPER.get(scheme, (None, None))
        ordinary = (f"{s['ordinary_mean']:.3f} ± {_fmt(s['ordinary_std'])} ({len(s['ordinary_losses'])})"
                    if s["ordinary_mean"] is not None else "–")
        rows.append(f"| {scheme} | {_fmt(s['max_stable_lr'], 'g')} | {_fmt(s['first_diverged_lr'], 'g')} | "
                    f"{_fmt(s['lr_sensitivity'])} | {_fmt(s['best_loss'])} ({_fmt(s['best_lr'], 'g')}) | "
                    f"{ordinary} | {_fmt(paper[0], 'g')} | {_fmt(paper[1], '.2f')} |")
    return "\n".join(rows) + "\n"


def per_lr_md(summary: dict) -> str:
    lrs = sorted({float(lr) for s in summary.values() for lr in s["per_lr"]})
    rows = ["| scheme | " + " | ".join(f"{lr:g}" for lr in lrs) + " |", "|---" * (len(lrs) + 1) + "|"]
    for scheme, s in summary.items():
        cells = []
        for lr in lrs:
            c = s["per_lr"].get(f"{lr:g}")
            if c is None:
                cells.append("")
            else:
                v = "NaN" if c["final_val"] is None else f"{c['final_val']:.3f}"
                cells.append(f"**{v}**†" if c["diverged"] else v)
        rows.append(f"| {scheme} | " + " | ".join(cells) + " |")
    return "\n".join(rows) + "\n"


def peak_logit_md(summary: dict) -> str:
    lrs = sorted({float(lr) for s in summary.values() for lr in s["per_lr"]})
    rows = ["| scheme | " + " | ".join(f"{lr:g}" for lr in lrs) + " |", "|---" * (len(lrs) + 1) + "|"]
    for scheme, s in summary.items():
        cells = [_fmt((s["per_lr"].get(f"{lr:g}") or {}).get("max_logit_peak"), ".3g") if f"{lr:g}" in s["per_lr"]
                 else "" for lr in lrs]
        rows.append(f"| {scheme} | " + " | ".join(cells) + " |")
    return "\n".join(rows) + "\n"


def plot_loss_vs_lr(summary: dict, path: Path, unigram: float) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for scheme, s in summary.items():
        pts = sorted((float(lr), c["final_val"]) for lr, c in s["per_lr"].items())
        top = s["init_loss"]
        xs = [lr for lr, _ in pts]
        ys = [min(v, top) if v is not None else top for _, v in pts]
        ax.plot(xs, ys, marker="o", label=scheme)
    ax.axhline(unigram, color="grey", ls=":", lw=1, label="unigram loss (divergence line)")
    ax.set_xscale("log")
    ax.set_xlabel("peak learning rate")
    ax.set_ylabel("final validation loss (nats/char), capped at init loss")
    ax.set_title("Final loss vs LR (4L d128 Llama, char Tiny Shakespeare, seed 0)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_logits_vs_step(runs: list[dict], lr: float, path: Path, key: str = "max_logit") -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for scheme in SCHEMES:
        rec = next((r for r in runs if r["config"]["scheme"] == scheme and r["config"]["lr"] == lr
                    and r["config"]["seed"] == 0 and r["config"].get("p") is None), None)
        if rec is None:
            continue
        steps = [p["step"] for p in rec["probe"]]
        vals = [max((v for v in p[key] if v is not None), default=float("nan")) for p in rec["probe"]]
        ax.plot(steps, vals, label=scheme)
    ax.set_yscale("log")
    ax.set_xlabel("step")
    label = {"max_logit": "largest attention logit (max over layers)", "rms_qkv": "QKV output RMS (max over layers)",
             "rms_proj": "attention out-proj output RMS (max over layers)",
             "rms_fc2": "second MLP layer output RMS (max over layers)"}[key]
    ax.set_ylabel(label)
    ax.set_title(f"{label} at LR {lr:g}, seed 0")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def cmd_report(args) -> None:
    runs = [r for r in load_runs(args.runs) if r["config"].get("p") is None]
    unigram = unigram_loss(args.text)
    summary = summarise(runs, unigram)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = runs[0]["config"] if runs else {}
    meta = {"grid": GRID, "ordinary_lr": ORDINARY_LR, "spike_nats": SPIKE, "unigram_loss": unigram,
            "steps": cfg.get("steps"), "warmup": cfg.get("warmup"), "n_runs": len(runs),
            "total_wall_s": round(sum(r["wall_s"] for r in runs)), "paper": PAPER}
    (out / "results.json").write_text(json.dumps({"meta": meta, "schemes": summary}, indent=1))
    (out / "table.md").write_text(
        "## LR sweep summary\n\n" + table_md(summary)
        + "\n## Final validation loss per LR (seed 0; † = diverged)\n\n" + per_lr_md(summary)
        + "\n## Largest attention logit seen during the run (max over layers and probe steps; seed 0)\n\n"
        + peak_logit_md(summary))
    plot_loss_vs_lr(summary, out / "loss_vs_lr.png", unigram)
    for lr in (1e-1, 3e-2):
        plot_logits_vs_step(runs, lr, out / f"max_logit_vs_step_lr{lr:g}.png")
    for key in ("rms_qkv", "rms_proj", "rms_fc2"):
        plot_logits_vs_step(runs, 1e-1, out / f"{key}_vs_step_lr0.1.png", key)
    print((out / "table.md").read_text())


def main(argv=None) -> None:
    args = parse_args(argv)
    {"run": cmd_run, "report": cmd_report}[args.cmd](args)


if __name__ == "__main__":
    main()
