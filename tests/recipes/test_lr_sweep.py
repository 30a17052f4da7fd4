"""The evidence recipes' machinery on a few steps: runs, probes, the Q/K LR rule, resume, divergence rule, summary."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "recipes"))
import _sweep_common as sc
import lr_sweep

TINY = dict(
    steps=4,
    warmup=2,
    layers=2,
    hidden=32,
    heads=2,
    context=32,
    batch_size=4,
    eval_every=2,
    eval_blocks=4,
    final_eval_blocks=8,
    probe_every=2,
)


@pytest.mark.parametrize("scheme", list(sc.SCHEMES))
def test_run_records_everything(scheme):
    rec = sc.train_run(sc.RunConfig(scheme=scheme, lr=1e-2, **TINY))
    assert math.isfinite(rec["final_val"]) and rec["init_val"] > rec["final_val"] - 1.0
    probe = rec["probe"][-1]
    for key in ("max_logit", "entropy", "rms_qkv", "rms_proj", "rms_fc2"):
        assert len(probe[key]) == 2 and all(v is not None and v > 0 for v in probe[key])


def _qk(model):
    attn = model.model.layers[0].self_attn
    x = torch.randn(2, 7, attn.config.hidden_size)
    shape = (2, 7, -1, attn.head_dim)
    q = attn.q_proj(x).view(shape).transpose(1, 2)
    k = attn.k_proj(x).view(shape).transpose(1, 2)
    return attn, x, q, k


def test_plain_and_patched_probes_agree():
    """An identity-initialised qk_norm model's probe and the plain hook measure the same formula."""
    cfg = sc.RunConfig(scheme="baseline", **TINY)
    plain = sc.build_model(cfg, 10)
    patched = sc.build_model(sc.RunConfig(scheme="soft_cap", **TINY), 10)  # same seed -> same weights
    ids = torch.randint(0, 10, (2, 16))
    with sc.Monitor(plain) as m1, torch.no_grad():
        plain(input_ids=ids)
    with sc.Monitor(patched) as m2, torch.no_grad():
        patched(input_ids=ids)
    assert m1.snapshot()["max_logit"] == pytest.approx(m2.snapshot()["max_logit"], rel=1e-5)
    assert not hasattr(patched.model.layers[0].self_attn, "_qknorm_probes")  # removed on exit


def test_qk_lr_scheme_uses_the_library_rule(monkeypatch):
    """The sweep's qk_lr runs step through hf_qknorm.QKLearningRate, once per optimizer step."""
    import hf_qknorm

    calls = []
    real = hf_qknorm.QKLearningRate.step
    monkeypatch.setattr(hf_qknorm.QKLearningRate, "step", lambda self, opt: calls.append(1) or real(self, opt))
    sc.train_run(sc.RunConfig(scheme="qk_lr", lr=1e-2, **TINY))
    assert len(calls) == TINY["steps"]
    calls.clear()
    sc.train_run(sc.RunConfig(scheme="baseline", lr=1e-2, **TINY))
    assert calls == []


def test_resume_skips_finished_runs(tmp_path):
    cfg = sc.RunConfig(scheme="qk_norm", lr=1e-2, **TINY)
    path = Path(sc.run_job(cfg, tmp_path))
    stamp = path.stat().st_mtime_ns
    sc.run_jobs([cfg], tmp_path, workers=1)
    assert path.stat().st_mtime_ns == stamp
    assert len(sc.load_runs(tmp_path)) == 1


def test_divergence_rule_and_summary():
    def rec(lr, final, vals=(3.0,), nonfinite=False):
        return {
            "config": {"scheme": "baseline", "lr": lr, "seed": 0, "p": None},
            "final_val": final,
            "init_val": 4.2,
            "nonfinite": nonfinite,
            "val": [[0, 4.2], *[[1, v] for v in vals], [2, final]],
            "probe": [{"max_logit": [1.0, 2.0]}],
            "wall_s": 1.0,
        }

    assert not lr_sweep.diverged(rec(1e-3, 2.0), bigram=3.3)
    assert lr_sweep.diverged(rec(1e-3, None, nonfinite=True), bigram=3.3)
    assert lr_sweep.diverged(rec(1e-3, 3.4, vals=(3.5,)), bigram=3.3)  # no better than bigram
    assert lr_sweep.diverged(rec(1e-3, 2.5, vals=(2.0,)), bigram=3.3)  # blew up, did not recover
    assert lr_sweep.max_stable_lr({1e-3: False, 1e-2: False, 1e-1: True, 1.0: False}) == (1e-2, 1e-1)
    grid = [1e-3, 1e-2, 1e-1]
    assert lr_sweep.lr_sensitivity({1e-3: 2.0, 1e-2: 1.5, 1e-1: None}, 4.0, grid) == pytest.approx((0.5 + 2.5) / 3)


def test_lp_sweep_jobs_set_the_exponent():
    import lp_sweep

    args = lp_sweep.parse_args(["run", "--ps", "2.5", "--seeds", "0", "1", "--steps", "4"])
    cfgs = lp_sweep.jobs(args)
    assert [(c.p, c.seed) for c in cfgs] == [(2.5, 0), (2.5, 1)] and len({c.tag() for c in cfgs}) == 2
    model = sc.build_model(sc.RunConfig(scheme="lp4", p=2.5, **TINY), 10)
    assert model.config.qknorm["norm"] == "lp" and model.config.qknorm["p"] == 2.5
    fake = [{"config": {"p": 2.5}, "final_val": v} for v in (1.0, 1.2)]
    s = lp_sweep.summarise(fake)["2.5"]
    assert s["mean"] == pytest.approx(1.1) and s["std"] == pytest.approx(0.1414, abs=1e-3)


def test_qk_clip_and_muon_arms(monkeypatch):
    """qk_clip arms clip with hf_qknorm.QKClip after every step (tau set low here so it bites); muon arms optimise
    with MuonAdamW (Muon on the hidden matrices)."""
    from hf_qknorm.training.muon import MuonAdamW

    steps = []
    real = MuonAdamW.step
    monkeypatch.setattr(MuonAdamW, "step", lambda self, closure=None: steps.append(1) or real(self, closure))
    rec = sc.train_run(sc.RunConfig(scheme="muon_qk_clip", lr=1e-2, qk_clip_tau=0.05, **TINY))
    assert rec["qk_clip"]["steps"] == TINY["steps"] and rec["qk_clip"]["clipped_steps"] >= 1
    assert len(steps) == TINY["steps"]
    rec = sc.train_run(sc.RunConfig(scheme="qk_clip", lr=1e-2, qk_clip_tau=1e6, **TINY))
    assert rec["qk_clip"]["clipped_steps"] == 0 and len(steps) == TINY["steps"]  # AdamW here


def test_edge_seeds_once_the_edge_is_bracketed():
    args = lr_sweep.parse_args(["run", "--schemes", "baseline"])

    def rec(lr, seed, final):
        return {
            "config": {"scheme": "baseline", "lr": lr, "seed": seed, "p": None},
            "final_val": final,
            "nonfinite": False,
            "val": [[0, 4.0], [10, 2.0], [20, final]],
        }

    runs = [rec(3e-3, 0, 1.8), rec(3e-2, 0, 1.9), rec(1e-1, 0, 3.0)]  # edge 0.03 / 0.1: not yet refined
    tags = {c.tag() for c in lr_sweep.next_jobs(args, runs, bigram=2.48)}
    assert "baseline_lr0.055_s0" in tags and not {"baseline_lr0.03_s1", "baseline_lr0.1_s1"} & tags
    runs.append(rec(0.055, 0, 3.0))  # refined once: edge 0.03 / 0.055, still more than a factor 1.5
    tags = {c.tag() for c in lr_sweep.next_jobs(args, runs, bigram=2.48)}
    assert "baseline_lr0.041_s0" in tags and not {"baseline_lr0.03_s1", "baseline_lr0.055_s1"} & tags
    runs.append(rec(0.041, 0, 1.9))  # edge 0.041 / 0.055: bracketed
    tags = {c.tag() for c in lr_sweep.next_jobs(args, runs, bigram=2.48)}
    assert {"baseline_lr0.041_s1", "baseline_lr0.041_s2", "baseline_lr0.055_s1", "baseline_lr0.055_s2"} <= tags


ROOT = Path(__file__).resolve().parents[2]


def test_default_paths_are_where_the_docs_say():
    """Run records live under benchmarks/runs/ (bulk data out of docs/); the reports write docs/lr_sweep/."""
    import lp_sweep

    for mod, data in ((lr_sweep, "lr_sweep"), (lp_sweep, "lp_sweep")):
        run, rep = mod.parse_args(["run"]), mod.parse_args(["report"])
        assert Path(run.out) == Path(rep.runs) == ROOT / "benchmarks" / "runs" / data / "runs"
        assert Path(rep.out) == ROOT / "docs" / "lr_sweep"
        assert len(sc.load_runs(rep.runs)) >= 15, f"{rep.runs} holds the committed runs"
    assert not list((ROOT / "docs").rglob("*.json")), "run data belongs under benchmarks/runs/, not docs/"


def test_lp_report_regenerates_the_committed_summary(tmp_path):
    """`lp_sweep.py report` on the committed runs writes the committed table and results.json, beside the runs."""
    import shutil

    import lp_sweep

    data = ROOT / "benchmarks" / "runs" / "lp_sweep"
    shutil.copytree(data / "runs", tmp_path / "runs")
    lp_sweep.main(["report", "--runs", str(tmp_path / "runs"), "--out", str(tmp_path / "docs")])
    assert (tmp_path / "docs" / "lp_table.md").read_text() == (ROOT / "docs" / "lr_sweep" / "lp_table.md").read_text()
    assert json.loads((tmp_path / "results.json").read_text()) == json.loads((data / "results.json").read_text())
