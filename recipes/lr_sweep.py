"""Learning-rate sweep of the attention schemes on a small Llama (Wortsman et al. 2023; Rybakov et al. 2024).

Trains a 4-layer, width-128, 4-head Llama (context 128, batch 16) on character-level Tiny Shakespeare for each
scheme over a log-spaced LR grid, one process per run with one thread, and records validation loss, the largest
attention logit per layer and the output RMS of the QKV, output-projection and second MLP layers::

    python recipes/lr_sweep.py run --workers 2        # resumable: one JSON per run in benchmarks/runs/lr_sweep/runs
    python recipes/lr_sweep.py report                 # docs/lr_sweep/: table.md, plots; results.json beside the runs

``run`` first trains the coarse grid (seed 0) and the extra seeds at the ordinary LR, then adds one refining LR
per scheme between its largest stable and smallest diverged grid LR, then (once a scheme's edge is bracketed within
a factor 1.5) the extra seeds at its largest stable and first diverged LR, which tell whether a difference in max
stable LR between schemes is real or one seed's luck.

Arms: the patched schemes, the plain baseline, and the architecture-preserving controls on the unpatched model --
Anson & Aitchison's Q/K learning rates (``qk_lr``), Kimi K2's QK-Clip (``qk_clip``, tau 100), Muon on the hidden
matrices (``muon``), and Muon with QK-Clip (``muon_qk_clip``, MuonClip) or with the Q/K rule (``muon_qk_lr``).
Divergence rule (applied mechanically, see
:func:`diverged`): a run diverged when its loss became non-finite, or its final validation loss is at or above the
character-bigram loss of the validation text (2.48 nats: it does no better than a model without attention; Wortsman
et al. compare diverged runs with a 0-layer bigram model), or its final validation loss is more than ``SPIKE`` nats
above the lowest validation loss it reached earlier (it blew up and did not recover).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _sweep_common import SCHEMES, RunConfig, char_data, load_runs

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "docs" / "lr_sweep"  # the summary table and plots the docs show
DATA = ROOT / "benchmarks" / "runs" / "lr_sweep"  # the run records and results.json (bulk data stays out of docs/)
GRID = [1e-3, 3e-3, 1e-2, 3e-2, 1e-1, 3e-1, 1.0]  # half-decades, Wortsman et al.'s grid extended to 1
SENS_GRID = [3e-3, 1e-2, 3e-2, 1e-1, 3e-1, 1.0]  # the LR range [a, b] of the sensitivity metric
ORDINARY_LR = 3e-3
SEEDS = (0, 1, 2)
SPIKE = 0.2  # nats
# Rybakov et al. 2024 (830M, see docs/evidence.md for the sources): max stable LR and perplexity at LR 3e-4
PAPER = {
    "baseline": (6e-3, 11.19),
    "soft_cap": (40e-3, 11.24),
    "qk_norm": (40e-3, 10.84),
    "qk_norm_cap": (60e-3, 11.00),
    "qkv_norm": (60e-3, 10.85),
}


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
    r.add_argument(
        "--edge-seeds",
        nargs="*",
        type=int,
        default=[1, 2],
        help="extra seeds at each scheme's max stable and first diverged LR (none: skip)",
    )
    r.add_argument("--text", default="tinyshakespeare", help="UTF-8 text file, or a bundled text name")
    r.add_argument("--out", default=str(DATA / "runs"))
    rep = sub.add_parser("report", help="summarise the runs into tables, results.json and plots")
    rep.add_argument("--runs", default=str(DATA / "runs"))
    rep.add_argument("--out", default=str(OUT))
    rep.add_argument("--text", default="tinyshakespeare")
    return p.parse_args(argv)


# ------------------------------------------------------------------------------------------------------------------
# the divergence rule and the summaries
# ------------------------------------------------------------------------------------------------------------------
def bigram_loss(text: str = "tinyshakespeare", context: int = 128) -> float:
    """Cross-entropy (nats/char) of the validation blocks under the training text's character-bigram frequencies
    (add-0.5 smoothing): the loss of a model that uses only the previous character, i.e. no attention at all."""
    import torch

    train_ids, val_blocks, vocab = char_data(text, context)
    counts = torch.full((vocab, vocab), 0.5, dtype=torch.float64)
    counts.index_put_(
        (train_ids[:-1], train_ids[1:]), torch.ones(len(train_ids) - 1, dtype=torch.float64), accumulate=True
    )
    probs = counts / counts.sum(1, keepdim=True)
    x, y = val_blocks[:, :-1].reshape(-1), val_blocks[:, 1:].reshape(-1)
    return float(-probs[x, y].log().mean())


def diverged(rec: dict, bigram: float) -> bool:
    """The divergence rule: non-finite loss, or a final validation loss no better than the bigram loss, or a final
    validation loss more than ``SPIKE`` nats above the lowest one the run reached earlier."""
    final = rec["final_val"]
    if rec["nonfinite"] or final is None or not math.isfinite(final):
        return True
    if final >= bigram:
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
    return math.fsum(v - min(vals) for v in vals) / len(vals)


def summarise(runs: list[dict], bigram: float) -> dict:
    out = {}
    for scheme in SCHEMES:
        rs = [r for r in runs if r["config"]["scheme"] == scheme and r["config"].get("p") is None]
        if not rs:
            continue
        seed0 = {r["config"]["lr"]: r for r in rs if r["config"]["seed"] == 0}
        points = {lr: diverged(r, bigram) for lr, r in seed0.items()}
        stable, first_div = max_stable_lr(points)
        grid = [lr for lr in SENS_GRID if lr in seed0 or (first_div is not None and lr > first_div)]
        losses = {lr: r["final_val"] for lr, r in seed0.items()}
        init = math.fsum(r["init_val"] for r in seed0.values()) / len(seed0)
        finite = {lr: v for lr, v in losses.items() if v is not None}
        best_lr = min(finite, key=finite.get) if finite else None
        ordinary = [r["final_val"] for r in rs if r["config"]["lr"] == ORDINARY_LR and r["final_val"] is not None]
        edge = {}  # every seed's verdict at the seed-0 edge LRs
        for lr in (stable, first_div):
            if lr is not None and lr != ORDINARY_LR:
                edge[f"{lr:g}"] = {r["config"]["seed"]: diverged(r, bigram) for r in rs if r["config"]["lr"] == lr}
        out[scheme] = {
            "max_stable_lr": stable,
            "first_diverged_lr": first_div,
            # LRs above the first diverged one that were not run count as l0 (they are assumed to diverge)
            "lr_sensitivity": lr_sensitivity(losses, init, grid) if len(grid) == len(SENS_GRID) else None,
            "best_loss": finite.get(best_lr),
            "best_lr": best_lr,
            "init_loss": init,
            "ordinary_lr": ORDINARY_LR,
            "ordinary_losses": ordinary,
            "ordinary_mean": math.fsum(ordinary) / len(ordinary) if ordinary else None,
            "ordinary_std": _std(ordinary),
            "edge_seeds": edge,
            "peak_logit_all": _peak_logit_all(rs),
            "per_lr": {
                f"{lr:g}": {
                    "final_val": r["final_val"],
                    "diverged": points[lr],
                    "max_logit_peak": _peak_logit(r),
                    "wall_s": r["wall_s"],
                }
                for lr, r in sorted(seed0.items())
            },
        }
    return out


def _std(xs):
    if len(xs) < 2:
        return None
    m = math.fsum(xs) / len(xs)
    return math.sqrt(math.fsum((x - m) ** 2 for x in xs) / (len(xs) - 1))


def _peak_logit_all(rs: list[dict]) -> float | None:
    vals = [v for v in (_peak_logit(r) for r in rs) if v is not None]
    return max(vals) if vals else None


def _peak_logit(rec: dict) -> float | None:
    vals = [v for p in rec["probe"] for v in p["max_logit"] if v is not None and math.isfinite(v)]
    return max(vals) if vals else None


# ------------------------------------------------------------------------------------------------------------------
# run
# ------------------------------------------------------------------------------------------------------------------
def coarse_jobs(args) -> list[RunConfig]:  # the whole fixed grid (used by tests and for reference)
    base = dict(steps=args.steps, warmup=args.warmup, text=args.text)
    # ordinary LR first (all seeds), then outward: the edge-defining high LRs before the slow low-LR end
    order = sorted(args.grid, key=lambda lr: (lr != args.ordinary_lr, -lr if lr > args.ordinary_lr else 10 - lr))
    jobs = [RunConfig(scheme=s, lr=lr, seed=0, **base) for lr in order for s in args.schemes]
    seeds = [
        RunConfig(scheme=s, lr=args.ordinary_lr, seed=seed, **base)
        for seed in args.seeds
        if seed != 0
        for s in args.schemes
    ]
    lowest = len(jobs) - len(args.schemes) if min(args.grid) < args.ordinary_lr else len(jobs)
    return jobs[:lowest] + seeds + jobs[lowest:]  # the extra seeds before the lowest (least telling) LR


def _known(runs: list[dict], scheme: str, bigram: float) -> dict[float, bool]:
    return {
        r["config"]["lr"]: diverged(r, bigram)
        for r in runs
        if r["config"]["scheme"] == scheme and r["config"]["seed"] == 0
    }


def _edge_job(points: dict[float, bool], grid: list[float], start: float) -> float | None:
    """Next grid LR of a scheme's edge search (assumes a run stable at LR ``a`` is stable below ``a``, and one
    diverged at ``a`` diverges above it): start at ``start``, go up while stable, down while diverged."""
    stable = [lr for lr in grid if points.get(lr) is False]
    div = [lr for lr in grid if points.get(lr) is True]
    if start not in points:
        return start
    hi_s = max(stable, default=0.0)
    lo_d = min(div, default=None)
    if lo_d is None:  # stable so far: one grid step up
        above = [lr for lr in grid if lr > hi_s]
        return above[0] if above else None
    below = [lr for lr in grid if hi_s < lr < lo_d]  # diverged: one grid step down, until the edge is bracketed
    return below[-1] if below else None


def next_jobs(args, runs: list[dict], bigram: float) -> list[RunConfig]:
    """All runs still wanted, most telling first: ordinary LR (seed 0) -> each scheme's stability edge on the
    grid -> extra seeds at the ordinary LR -> the grid LRs below each edge (for the LR sensitivity) -> one refining
    LR inside each edge -> the rest of the grid."""
    base = dict(steps=args.steps, warmup=args.warmup, text=args.text)
    mk = lambda s, lr, seed=0: RunConfig(scheme=s, lr=lr, seed=seed, **base)
    grid = sorted(args.grid)
    wanted = [mk(s, args.ordinary_lr) for s in args.schemes]
    for s in args.schemes:
        lr = _edge_job(_known(runs, s, bigram), grid, 0.1 if 0.1 in grid else grid[len(grid) // 2])
        if lr is not None:
            wanted.append(mk(s, lr))
    paper_first = sorted(args.schemes, key=lambda s: s not in PAPER)
    wanted += [mk(s, args.ordinary_lr, seed) for s in paper_first for seed in args.seeds if seed != 0]
    for lr in sorted(SENS_GRID, reverse=True):  # grid LRs below each edge: the LR-sensitivity metric needs them
        for s in args.schemes:
            stable, first_div = max_stable_lr(_known(runs, s, bigram))
            if lr in grid and (first_div is None or lr < first_div):
                wanted.append(mk(s, lr))
    if not args.no_refine:
        for s in args.schemes:
            stable, first_div = max_stable_lr(_known(runs, s, bigram))
            if stable is not None and first_div is not None and first_div / stable > 1.5:
                wanted.append(mk(s, float(f"{math.sqrt(stable * first_div):.2g}")))
    for s in args.schemes:  # extra seeds at the edge, once it is bracketed (refined)
        stable, first_div = max_stable_lr(_known(runs, s, bigram))
        if stable is not None and first_div is not None and (args.no_refine or first_div / stable <= 1.5):
            wanted += [mk(s, lr, seed) for lr in (stable, first_div) for seed in args.edge_seeds if seed != 0]
    wanted += [
        mk(s, lr) for lr in sorted(grid, key=lambda x: abs(math.log(x / args.ordinary_lr))) for s in args.schemes
    ]
    seen, out = set(), []
    for c in wanted:
        if c.tag() not in seen:
            seen.add(c.tag())
            out.append(c)
    return out


def cmd_run(args) -> None:
    """Schedule runs one at a time as workers free up, re-planning from the results so far (the edge search of
    a scheme waits for its previous edge run). Finished runs are skipped, so it resumes after an interruption."""
    import concurrent.futures as cf
    import multiprocessing as mp

    from _sweep_common import _worker_init, run_job

    bigram = bigram_loss(args.text)
    out = Path(args.out)
    inflight: dict = {}
    with cf.ProcessPoolExecutor(args.workers, mp_context=mp.get_context("spawn"), initializer=_worker_init) as ex:
        while True:
            runs = load_runs(out) if out.exists() else []
            done = {RunConfig(**{k: v for k, v in r["config"].items()}).tag() for r in runs}
            busy = {c.scheme for c in inflight.values() if c.lr not in (args.ordinary_lr, 1e-2)}
            for c in next_jobs(args, runs, bigram):
                if len(inflight) >= args.workers:
                    break
                if c.tag() in done or c.tag() in {x.tag() for x in inflight.values()}:
                    continue
                if c.scheme in busy and c.lr not in (args.ordinary_lr, 1e-2) and c.seed == 0:
                    continue  # its edge search depends on the run in flight
                inflight[ex.submit(run_job, c, out)] = c
                busy.add(c.scheme) if c.lr not in (args.ordinary_lr, 1e-2) else None
                print(f"start {c.tag()}", flush=True)
            if not inflight:
                break
            finished, _ = cf.wait(list(inflight), return_when=cf.FIRST_COMPLETED)
            for f in finished:
                c = inflight.pop(f)
                err = f.exception()
                print(f"{'FAILED' if err else 'done'} {c.tag()} {err or ''}", flush=True)
                if err:
                    return


# ------------------------------------------------------------------------------------------------------------------
# report
# ------------------------------------------------------------------------------------------------------------------
def _fmt(x, spec=".3f"):
    return "–" if x is None else format(x, spec)


def table_md(summary: dict) -> str:
    rows = [
        "| scheme | max stable LR | first diverged LR | LR sensitivity | best loss (at LR) | "
        f"loss at LR {ORDINARY_LR:g}, mean ± sd (n) | paper max stable LR | paper ppl |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for scheme, s in summary.items():
        paper = PAPER.get(scheme, (None, None))
        ordinary = (
            f"{s['ordinary_mean']:.3f} ± {_fmt(s['ordinary_std'])} ({len(s['ordinary_losses'])})"
            if s["ordinary_mean"] is not None
            else "–"
        )
        edge = ("≥ " if s["first_diverged_lr"] is None else "") + _fmt(s["max_stable_lr"], "g")  # not bracketed
        rows.append(
            f"| {scheme} | {edge} | {_fmt(s['first_diverged_lr'], 'g')} | "
            f"{_fmt(s['lr_sensitivity'])} | {_fmt(s['best_loss'])} ({_fmt(s['best_lr'], 'g')}) | "
            f"{ordinary} | {_fmt(paper[0], 'g')} | {_fmt(paper[1], '.2f')} |"
        )
    return "\n".join(rows) + "\n"


def edge_md(summary: dict) -> str:
    """Seeds that diverged at each scheme's seed-0 edge: a max stable LR is established when every seed is stable
    there and every seed diverges at the next LR."""
    rows = [
        "| scheme | max stable LR (seeds diverged) | first diverged LR (seeds diverged) | established |",
        "|---|---|---|---|",
    ]
    for scheme, s in summary.items():
        cells = []
        for lr in (s["max_stable_lr"], s["first_diverged_lr"]):
            seeds = s["edge_seeds"].get(f"{lr:g}", {}) if lr is not None else {}
            cells.append("–" if lr is None else f"{lr:g} ({sum(seeds.values())}/{len(seeds)})")
        stable_ok = (
            all(not d for d in s["edge_seeds"].get(f"{s['max_stable_lr']:g}", {0: True}).values())
            if s["max_stable_lr"] is not None
            else False
        )
        div_ok = (
            all(s["edge_seeds"].get(f"{s['first_diverged_lr']:g}", {0: False}).values())
            if s["first_diverged_lr"] is not None
            else False
        )
        n = [
            len(s["edge_seeds"].get(f"{lr:g}", {}))
            for lr in (s["max_stable_lr"], s["first_diverged_lr"])
            if lr is not None
        ]
        verdict = (
            "yes"
            if stable_ok and div_ok and min(n, default=0) >= 3
            else ("not yet (fewer than 3 seeds)" if min(n, default=0) < 3 else "no: seeds disagree")
        )
        rows.append(f"| {scheme} | {cells[0]} | {cells[1]} | {verdict} |")
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
        cells = [
            _fmt((s["per_lr"].get(f"{lr:g}") or {}).get("max_logit_peak"), ".3g") if f"{lr:g}" in s["per_lr"] else ""
            for lr in lrs
        ]
        rows.append(f"| {scheme} | " + " | ".join(cells) + " |")
    return "\n".join(rows) + "\n"


def rms_md(runs: list[dict], lrs=(ORDINARY_LR, 1e-1)) -> str:
    """Final-step output RMS (max over layers) of the QKV / out-proj / FC2 layers and the largest logit, seed 0."""
    rows = ["| scheme | LR | QKV out RMS | out-proj RMS | FC2 out RMS | largest logit |", "|---|---|---|---|---|---|"]
    for lr in lrs:
        for scheme in SCHEMES:
            rec = next(
                (
                    r
                    for r in runs
                    if r["config"]["scheme"] == scheme and r["config"]["lr"] == lr and r["config"]["seed"] == 0
                ),
                None,
            )
            if rec is None:
                continue
            last = rec["probe"][-1]
            cells = [
                max((v for v in last[k] if v is not None), default=None)
                for k in ("rms_qkv", "rms_proj", "rms_fc2", "max_logit")
            ]
            rows.append(f"| {scheme} | {lr:g} | " + " | ".join(_fmt(c, ".3g") for c in cells) + " |")
    return "\n".join(rows) + "\n"


def plot_loss_vs_lr(summary: dict, path: Path, bigram: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for scheme, s in summary.items():
        pts = sorted((float(lr), c["final_val"]) for lr, c in s["per_lr"].items())
        top = s["init_loss"]
        xs = [lr for lr, _ in pts]
        ys = [min(v, top) if v is not None else top for _, v in pts]
        ax.plot(xs, ys, marker="o", label=scheme, **_style(scheme))
    ax.axhline(bigram, color="grey", ls=":", lw=1, label="character-bigram loss (divergence line)")
    ax.set_xscale("log")
    ax.set_xlabel("peak learning rate")
    ax.set_ylabel("final validation loss (nats/char), capped at init loss")
    ax.set_title("Final loss vs LR (4L d128 Llama, char Tiny Shakespeare, seed 0)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _style(scheme: str) -> dict:
    """One colour per scheme (tab20: more schemes than tab10 has colours); Muon arms dashed."""
    import matplotlib

    colours = matplotlib.colormaps["tab20"].colors
    return {
        "color": colours[list(SCHEMES).index(scheme) * 2 % 20 + (list(SCHEMES).index(scheme) * 2 >= 20)],
        "ls": "--" if scheme.startswith("muon") else "-",
    }


def plot_logits_vs_step(runs: list[dict], lr: float, path: Path, key: str = "max_logit") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8.5, 4.5))
    for scheme in SCHEMES:
        rec = next(
            (
                r
                for r in runs
                if r["config"]["scheme"] == scheme
                and r["config"]["lr"] == lr
                and r["config"]["seed"] == 0
                and r["config"].get("p") is None
            ),
            None,
        )
        if rec is None:
            continue
        steps = [p["step"] for p in rec["probe"]]
        pick = min if key == "entropy" else max  # collapse shows in the lowest-entropy layer
        vals = [pick((v for v in p.get(key, []) if v is not None), default=float("nan")) for p in rec["probe"]]
        ax.plot(steps, vals, label=scheme, **_style(scheme))
    tau = next((r["config"]["qk_clip_tau"] for r in runs if "qk_clip_tau" in r["config"]), None)
    if key == "max_logit" and tau is not None:
        ax.axhline(tau, color="grey", ls=":", lw=1, label=f"QK-Clip tau = {tau:g}")
    ax.set_yscale("linear" if key == "entropy" else "log")
    ax.set_xlabel("step")
    label = {
        "entropy": "attention entropy, nats (min over layers)",
        "max_logit": "largest attention logit (max over layers)",
        "rms_qkv": "QKV output RMS (max over layers)",
        "rms_proj": "attention out-proj output RMS (max over layers)",
        "rms_fc2": "second MLP layer output RMS (max over layers)",
    }[key]
    ax.set_ylabel(label)
    ax.set_title(f"{label} at LR {lr:g}, seed 0")
    ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5))
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def cmd_report(args) -> None:
    runs = [r for r in load_runs(args.runs) if r["config"].get("p") is None]
    bigram = bigram_loss(args.text)
    summary = summarise(runs, bigram)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = runs[0]["config"] if runs else {}
    meta = {
        "grid": GRID,
        "sensitivity_grid": SENS_GRID,
        "ordinary_lr": ORDINARY_LR,
        "spike_nats": SPIKE,
        "bigram_loss": bigram,
        "steps": cfg.get("steps"),
        "warmup": cfg.get("warmup"),
        "n_runs": len(runs),
        "total_wall_s": round(sum(r["wall_s"] for r in runs)),
        "paper": PAPER,
    }
    (Path(args.runs).parent / "results.json").write_text(json.dumps({"meta": meta, "schemes": summary}, indent=1))
    (out / "table.md").write_text(
        "## LR sweep summary\n\n"
        + table_md(summary)
        + "\n## Seeds at each scheme's edge (diverged/run)\n\n"
        + edge_md(summary)
        + "\n## Final validation loss per LR (seed 0; † = diverged)\n\n"
        + per_lr_md(summary)
        + "\n## Largest attention logit seen during the run (max over layers and probe steps; seed 0)\n\n"
        + peak_logit_md(summary)
        + "\n## Output RMS and largest logit at the last step (max over layers; seed 0)\n\n"
        + rms_md(runs)
    )
    plot_loss_vs_lr(summary, out / "loss_vs_lr.png", bigram)
    for lr in (1e-1, 3e-2):
        plot_logits_vs_step(runs, lr, out / f"max_logit_vs_step_lr{lr:g}.png")
    for key in ("rms_qkv", "rms_proj", "rms_fc2", "entropy"):
        plot_logits_vs_step(runs, 1e-1, out / f"{key}_vs_step_lr0.1.png", key)
    print((out / "table.md").read_text())


def main(argv=None) -> None:
    args = parse_args(argv)
    {"run": cmd_run, "report": cmd_report}[args.cmd](args)


if __name__ == "__main__":
    main()
