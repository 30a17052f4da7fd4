"""The conversion-recovery recipe on a few steps: arms, conversion per init, the recovery metrics, the report."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "recipes"))
import conversion_recovery as cr

TINY = dict(
    steps=3,
    warmup=1,
    batch_size=2,
    context=64,
    eval_every=1,
    eval_blocks=2,
    final_eval_blocks=4,
    calibration=dict(block_len=64, calibration_blocks=4, eval_blocks=4, steps=2, batch_size=2),
)


def test_arms_cover_every_scheme_and_init():
    tags = [a.tag() for a in cr.arms({})]
    assert tags == [
        "original",
        "soft_cap",
        "qk_norm_identity",
        "qk_norm_calibrated",
        "qk_norm_cap_identity",
        "qk_norm_cap_calibrated",
        "qkv_norm_identity",
        "qkv_norm_calibrated",
    ]


def test_healed_arms_run_when_asked():
    tags = [a.tag() for a in cr.arms({}, ("soft_cap", "qk_norm"), cr.ALL_INITS)]
    assert tags == ["original", "soft_cap", "qk_norm_identity", "qk_norm_calibrated", "qk_norm_healed"]


def test_recovery_metrics():
    curve = [[0, 4.0], [10, 3.6], [20, 3.52], [30, 3.4]]
    assert cr.steps_to_recover(curve, 3.5 * 1.01) == 20
    assert cr.steps_to_recover(curve, 3.0) is None
    assert cr.steps_to_recover([[0, 3.5]], 3.5) == 0  # conversion itself within tolerance
    control = [[0, 3.5], [10, 3.45], [20, 3.40], [30, 3.38]]
    assert cr._steps_to_match(curve, control) == 30  # 3.4 <= 3.38 * 1.01, 3.52 > 3.40 * 1.01


def test_bad_arm_is_refused(tmp_path):
    with pytest.raises(ValueError, match="unknown scheme 'qk_nrom'.*qk_norm"):
        cr.run_arm(cr.ArmConfig(scheme="qk_nrom", **TINY), tmp_path)
    with pytest.raises(ValueError, match="unknown init 'zeros'"):
        cr.run_arm(cr.ArmConfig(scheme="qk_norm", init="zeros", **TINY), tmp_path)


def test_more_held_out_blocks_than_the_text_has_is_refused(tmp_path):
    """Asking for more evaluation blocks than exist would silently evaluate on fewer than the record says."""
    for name in ("eval_blocks", "final_eval_blocks"):
        cfg = cr.ArmConfig(**{**TINY, name: 10**6})
        with pytest.raises(ValueError, match=rf"{name}=1000000, but the held-out part of 'tinyshakespeare' has \d+"):
            cr.run_arm(cfg, tmp_path)


def test_report_needs_the_control_arm():
    rec = {"config": {**cr.asdict(cr.ArmConfig(scheme="qk_norm", init="identity"))}, "val": [[0, 4.0]]}
    with pytest.raises(ValueError, match="control arm 'original'"):
        cr.summarise([rec])


def test_runs_and_report(tmp_path):
    out, work = tmp_path / "runs", tmp_path / "work"
    cfgs = [
        cr.ArmConfig(**TINY),
        cr.ArmConfig(scheme="qk_norm", init="identity", **TINY),
        cr.ArmConfig(scheme="qk_norm", init="calibrated", **TINY),
        cr.ArmConfig(scheme="qk_norm", init="healed", heal={"tokens": 640, "blocks": 4, "self_tokens": 512}, **TINY),
    ]
    for c in cfgs:
        cr.run_job(c, str(out), str(work))
    # the curve so far is kept while an arm trains and removed once its record is written
    assert sorted(p.name for p in out.glob("*.json")) == [
        "original.json",
        "qk_norm_calibrated.json",
        "qk_norm_healed.json",
        "qk_norm_identity.json",
    ]
    assert not any(work.iterdir())  # converted checkpoints are removed once their arm is recorded
    runs = [json.loads(p.read_text()) for p in sorted(out.glob("*.json"))]
    for r in runs:
        assert [s for s, _ in r["val"]] == [0, 1, 2, 3]
    by = {cr.ArmConfig(**r["config"]).tag(): r for r in runs}
    assert by["qk_norm_identity"]["model_type"] == "qknorm_llama"
    assert by["qk_norm_calibrated"]["conversion"]["calibration"]["steps"] == 2
    assert "calibration" not in by["qk_norm_identity"]["conversion"]
    healed = by["qk_norm_healed"]["conversion"]["calibration"]["heal"]
    assert healed["steps_per_layer"] == 10 and healed["settings"]["blocks"] == 4
    # the control arm's step-0 loss is the unconverted model's: calibrated init starts closer to it than identity
    s = cr.write_report(runs, tmp_path / "report")
    arms = s["arms"]
    assert arms["original"]["gap_after_conversion_pct"] == 0.0
    assert (
        0
        < arms["qk_norm_calibrated"]["gap_after_conversion_pct"]
        < arms["qk_norm_identity"]["gap_after_conversion_pct"]
    )
    table = (tmp_path / "report" / "table.md").read_text()
    assert "| qk_norm_identity |" in table and "| qk_norm_calibrated |" in table and "| qk_norm_healed |" in table
    # recovery in tokens: steps x batch x context (TINY: 2 x 64 per step)
    for a in arms.values():
        rec = a["steps_to_recover"]
        assert a["tokens_to_recover"] == (None if rec is None else rec * 128)
        assert a["steps_run"] == 3
    assert (tmp_path / "report" / "loss_vs_step.png").stat().st_size > 0
    # resumable: a finished arm is not rerun
    stamp = (out / "original.json").stat().st_mtime_ns
    cr.run_job(cfgs[0], str(out), str(work))
    assert (out / "original.json").stat().st_mtime_ns == stamp


def test_report_regenerates_the_committed_table(tmp_path):
    """The default `report` reads benchmarks/runs/conversion_recovery/runs_lr0.0003 (the committed runs) and the
    table it writes is docs/conversion_recovery/table.md, the one the docs show."""
    root = Path(__file__).resolve().parents[2]
    args = cr.parse_args(["report"])
    assert Path(args.runs) == root / "benchmarks" / "runs" / "conversion_recovery" / "runs_lr0.0003"
    assert Path(args.out) == root / "docs" / "conversion_recovery"
    runs = [json.loads(p.read_text()) for p in sorted(Path(args.runs).glob("*.json"))]
    assert len(runs) == 11  # 8 arms, and the 3 healed ones (--inits healed)
    cr.write_report(runs, tmp_path / "docs", tmp_path / "results.json")
    assert (tmp_path / "docs" / "table.md").read_text() == (Path(args.out) / "table.md").read_text()
    committed = json.loads((Path(args.runs).parent / "results.json").read_text())
    assert json.loads((tmp_path / "results.json").read_text()) == committed


def test_an_arm_in_training_leaves_its_curve_so_far(tmp_path):
    seen = []
    cfg = cr.ArmConfig(scheme="qk_norm", init="identity", **TINY)
    rec = cr.run_arm(cfg, tmp_path, progress=lambda r: seen.append([s for s, _ in r["val"]]))
    assert seen == [[0, 1], [0, 1, 2], [0, 1, 2, 3]]  # after every evaluation, before the final one
    assert [s for s, _ in rec["val"]] == [0, 1, 2, 3] and "final" in rec


def test_report_shows_unfinished_arms_only_when_asked(tmp_path, capsys):
    runs = tmp_path / "runs"
    runs.mkdir()
    base = {**cr.asdict(cr.ArmConfig(**TINY)), "source": "x"}
    done = {"config": base, "source": "x", "final_initial": 3.5, "final": 3.4, "train_s": 1}
    done["val"] = [[0, 3.5], [1, 3.45]]
    cfg = {**base, "scheme": "qk_norm", "init": "identity"}
    partial = {"config": cfg, "source": "x", "final_initial": 4.0, "val": [[0, 4.0], [1, 3.9]], "train_s": 1}
    (runs / "original.json").write_text(json.dumps(done))
    (runs / "qk_norm_identity.partial.json").write_text(json.dumps({**partial, "unfinished": True}))
    out, results = tmp_path / "report", tmp_path / "summary.json"
    cr.main(["report", "--runs", str(runs), "--out", str(out), "--results", str(results)])
    assert "qk_norm_identity" not in (out / "table.md").read_text()
    cr.main(["report", "--runs", str(runs), "--out", str(out), "--results", str(results), "--include-unfinished"])
    table = (out / "table.md").read_text()
    assert "| qk_norm_identity (stopped at step 1) |" in table
    assert "not within 1 (128 tokens)" in table  # recovered neither to 3.5 x 1.01 nor to the control
    assert json.loads(results.read_text())["arms"]["qk_norm_identity"]["unfinished"] is True
    capsys.readouterr()


def test_report_of_another_runs_folder_does_not_overwrite_the_committed_summary(tmp_path):
    assert cr.results_path(cr.DEFAULT_RUNS) == cr.DATA / "results.json"
    assert cr.results_path(tmp_path / "smollm2") == tmp_path / "results_smollm2.json"


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--only", "qk_norm_cap_identiy"], "unknown arm(s) ['qk_norm_cap_identiy']"),
        (["--steps", "0"], "--steps must be at least 1, got 0"),
        (["--batch-size", "-2"], "--batch-size must be at least 1, got -2"),
        (["--final-eval-blocks", "0"], "--final-eval-blocks must be at least 1, got 0"),
        (["--warmup", "-1"], "--warmup must be between 0 and --steps (300), got -1"),
        (["--lr", "nan"], "--lr must be a positive number, got nan"),
        (["--lr", "0"], "--lr must be a positive number, got 0.0"),
        (["--text", "no/such/file.txt"], "text file not found"),
    ],
)
def test_run_refuses_bad_flags_before_any_arm(tmp_path, argv, message):
    with pytest.raises(SystemExit, match=re.escape(message)):
        cr.main(["run", "--out", str(tmp_path / "runs"), "--workers", "1", *argv])
    assert not (tmp_path / "runs").exists()


def test_the_smollm2_table_comes_from_its_committed_records(tmp_path):
    """docs/conversion_recovery/smollm2_135m/table.md (shown in docs/evidence.md) is what `report` makes of the
    committed SmolLM2-135M records, and every arm of the three schemes ran to its last step."""
    root = Path(__file__).resolve().parents[2]
    runs_dir = root / "benchmarks" / "runs" / "conversion_recovery" / "smollm2_135m"
    runs = [json.loads(p.read_text()) for p in sorted(runs_dir.glob("*.json"))]
    assert sorted(cr.ArmConfig(**r["config"]).tag() for r in runs) == sorted(
        [a.tag() for a in cr.arms({}, ("qk_norm", "qk_norm_cap", "qkv_norm"))] + ["qk_norm_healed"]
    )
    assert all(not r.get("unfinished") and r["val"][-1][0] == r["config"]["steps"] for r in runs)
    cr.write_report(runs, tmp_path / "docs", tmp_path / "results.json")
    docs = root / "docs" / "conversion_recovery" / "smollm2_135m"
    assert (tmp_path / "docs" / "table.md").read_text() == (docs / "table.md").read_text()
    committed = json.loads((runs_dir.parent / "results_smollm2_135m.json").read_text())
    assert json.loads((tmp_path / "results.json").read_text()) == committed
    rows = [line for line in (docs / "table.md").read_text().splitlines() if line.startswith("| ")]
    evidence = (root / "docs" / "evidence.md").read_text()
    assert all(row in evidence for row in rows)  # the table docs/evidence.md shows is this one
