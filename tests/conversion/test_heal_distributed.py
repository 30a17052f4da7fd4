"""Healing across processes (issue 31): two gloo processes on the CPU against one process, on the bundled tiny Llama.

Layer ``i`` is fitted on rank ``i % world``, the self-generated heal text is shared out by batch, and rank 0 alone
writes: the healed tensors and the report's figures of every rank must equal one process's exactly (``torch.equal``,
one thread each), the generated text must be one process's, ``inputs="converted"`` must be refused, and the command
line under ``torchrun`` must write one folder equal to a one-process conversion, or nothing when a rank fails.

This file is also the worker: ``torchrun --nproc_per_node 2 tests/conversion/test_heal_distributed.py --worker OUT
SRC`` (every in-process scenario in one launch: process start-up dominates) and ``... --cli-failing-rank R OUT ARGS``
(the command line with rank ``R``'s layer fit failing).
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from hf_qknorm import QKNormConfig
from hf_qknorm.conversion.calibration.calibrate import CalibrationSettings
from hf_qknorm.conversion.healing.heal import HealSettings
from tests._support.convert_support import SHORT_TEXT, bundled_copy, leftovers, quiet
from tests._support.trainer_runs import free_port, launch_env

ROOT = Path(__file__).resolve().parents[2]
WORLD = 2

FAST = CalibrationSettings(
    block_len=64, calibration_blocks=8, eval_blocks=4, local_steps=10, agreement_tokens=0, threads=1
)
# 4 layers over 2 ranks; "self" with short answers in batches of 2: 5 answers, 3 batches (rank 0 two, rank 1 one)
HEAL = {
    mode: HealSettings(tokens=64 * 10, blocks=8, lr=1e-3, text=mode, self_tokens=5 * 16)
    for mode in ("self", "calibration")
}
# the end-to-end stage after the layer-wise one: on rank 0 alone, its result broadcast; the layer fits with
# attention-probability distillation (each rank reads the original's attention for its own layers)
HEAL["end_to_end"] = dataclasses.replace(
    HEAL["calibration"], end_to_end_tokens=64 * 5, end_to_end_lr=3e-4, attention_kl=1.0
)
SCHEME = QKNormConfig(scheme="qk_norm", norm="rmsnorm")
TIMING = ("seconds", "generation_seconds")  # the only fields of a report that may differ between runs


def _figures(heal: dict) -> dict:
    """A heal report without its timings (the end-to-end stage's included)."""
    out = {k: v for k, v in heal.items() if k not in TIMING}
    if out["end_to_end"] is not None:
        out["end_to_end"] = {k: v for k, v in out["end_to_end"].items() if k not in TIMING}
    return out


TEXT = dict(chats=3, openings=2, new_tokens=8, seed=7, batch_size=2)  # 5 prompts, 3 batches


# short self-generated answers in small batches, so that the batches are shared out even in a tiny test
SMALL_GENERATION = {"SELF_NEW_TOKENS": 16, "SELF_BATCH_SIZE": 2}


def _healed(src: Path, heal: HealSettings):
    """Calibration then healing as :func:`hf_qknorm.convert` runs them: ``(new tensors, report dict)``."""
    from hf_qknorm.conversion.orchestration.converter import _calibrated
    from hf_qknorm.conversion.orchestration.source import inspect_source
    from hf_qknorm.conversion.orchestration.texts import read_texts

    source = inspect_source(src)
    cfg = dataclasses.replace(SCHEME, eps=source.family.norm_eps(source.config, ""))
    texts = read_texts(SHORT_TEXT, None)
    _, values, report = _calibrated(source, cfg, texts, FAST, heal, torch.device("cpu"), False)
    return values, report.to_dict()


def _generated(src: Path, on_batch=None) -> str:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hf_qknorm.conversion.healing.selftext import self_generated_text

    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    return self_generated_text(model, AutoTokenizer.from_pretrained(src), SHORT_TEXT, on_batch=on_batch, **TEXT)


def _cli_args(src: Path, dst: Path) -> list[str]:
    text = src.parent / "calibration.txt"
    if not text.exists():
        text.write_text(SHORT_TEXT)
    return [
        "convert",
        str(src),
        str(dst),
        "--device",  # the reference and the launch (which sees no CUDA device) calibrate alike on a GPU machine too
        "cpu",
        "--scheme",
        "qk_norm",
        "--norm",
        "rmsnorm",
        "--heal-tokens",
        "640",
        "--heal-blocks",
        "8",
        "--heal-text",
        "calibration",
        "--block-len",
        "64",
        "--calibration-blocks",
        "8",
        "--eval-blocks",
        "4",
        "--local-steps",
        "10",
        "--agreement-tokens",
        "0",
        "--threads",
        "1",
        "--verify",
        "plugin",
        "--calibration-text",
        str(text),
        "--quiet",
        "--json",
    ]


# --------------------------------------------------------------------------------------------------------------------
# the launches
# --------------------------------------------------------------------------------------------------------------------
def _torchrun(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(WORLD)]
    cmd += ["--master_port", str(free_port()), *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=launch_env(), timeout=timeout, cwd=ROOT)


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    return bundled_copy(tmp_path_factory.mktemp("heal_dist") / "src")


@pytest.fixture(scope="module")
def launched(source, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("world2")
    res = _torchrun(__file__, "--worker", str(out), str(source))
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-6000:]
    return out


def _ranks(out: Path, name: str) -> list:
    return [torch.load(out / f"{name}.rank{r}.pt", weights_only=False) for r in range(WORLD)]


# --------------------------------------------------------------------------------------------------------------------
# (a) the healed tensors and the report, (b) the generated text, (c) the refusal of inputs="converted"
# --------------------------------------------------------------------------------------------------------------------
@pytest.mark.spawns(shared=True)  # one launch for all its cases, started by the first that runs
@pytest.mark.parametrize("mode", ["self", "calibration", "end_to_end"])
def test_two_ranks_heal_exactly_as_one_process(launched, source, mode, monkeypatch):
    import hf_qknorm.conversion.healing.heal as heal

    for name, value in SMALL_GENERATION.items():
        monkeypatch.setattr(heal, name, value)
    values, report = _healed(source, HEAL[mode])
    h = report["heal"]
    assert h["layers_kept"] == 4 and h["ppl_after"] < h["ppl_before"]  # healing did something on every layer
    assert (h["generated_tokens"] > 0) == (mode == "self")
    for r, (got_values, got_report, fitted) in enumerate(_ranks(launched, f"heal_{mode}")):
        assert fitted == [r, r + 2]  # layer i on rank i % 2 alone
        assert sorted(got_values) == sorted(values), r
        different = [k for k in values if not torch.equal(got_values[k], values[k])]
        assert different == [], (r, different)
        assert _figures(got_report["heal"]) == _figures(h)
    assert (h["end_to_end"] is not None) == (mode == "end_to_end")


@pytest.mark.spawns(shared=True)  # the launch the first of these tests starts
def test_healed_tensors_are_the_fits_not_the_start(launched, source):
    """Every layer's projections moved away from the source's on every rank -- those of the layers the other rank
    fitted included (the exchange, not only the local fits)."""
    old = load_file(source / "model.safetensors")
    for r, (values, _, _) in enumerate(_ranks(launched, "heal_calibration")):
        for i in range(4):
            key = f"model.layers.{i}.self_attn.q_proj.weight"
            assert not torch.equal(values[key], old[key]), (r, i)


@pytest.mark.spawns(shared=True)  # the launch the first of these tests starts
def test_every_rank_heals_from_rank_0s_calibration(launched, source):
    """Rank 1's calibration was moved (in the worker): both ranks still return one process's result."""
    values, report = _healed(source, HEAL["calibration"])
    for r, (got_values, got_report) in enumerate(_ranks(launched, "perturbed")):
        assert all(torch.equal(got_values[k], values[k]) for k in values), r
        assert _figures(got_report["heal"]) == _figures(report["heal"]), r


@pytest.mark.spawns(shared=True)  # the launch the first of these tests starts
def test_the_generated_text_is_one_processs(launched, source):
    counts = []
    text = _generated(source, on_batch=counts.append)
    assert counts == [2, 2, 1]  # one process: three batches
    got = _ranks(launched, "text")
    assert [g["text"] for g in got] == [text, text]
    # shared out for real: rank 0 generated batches 0 and 2 (rounds of 4 and 1 answers), rank 1 batch 1
    assert [g["rounds"] for g in got] == [[4, 1], [4]]


@pytest.mark.spawns(shared=True)  # the launch the first of these tests starts
def test_inputs_converted_is_refused_with_more_than_one_rank(launched):
    first, other = _ranks(launched, "converted")
    assert first["type"] == "ValueError" and "\n" not in first["message"]
    assert "heal inputs 'converted'" in first["message"] and "'original'" in first["message"]
    assert "2 processes" in first["message"]
    assert other["type"] == "FirstRankFailed" and other["original"] == first["message"]
    assert not first["dst_exists"] and not other["dst_exists"]


@pytest.mark.spawns(shared=True)  # the launch the first of these tests starts
def test_convert_returns_the_same_result_on_every_rank(launched):
    a, b = _ranks(launched, "api")
    assert a["path"] == b["path"] and a["files"] == b["files"] and a["files"]
    strip = lambda r: {k: v for k, v in r.items() if k not in ("seconds", "heal")}
    assert strip(a["report"]) == strip(b["report"])
    assert a["report"]["heal"] == b["report"]["heal"]  # rank 0's, broadcast: timing included
    assert a["folders"] == ["api"]  # one folder, nothing temporary beside it


# --------------------------------------------------------------------------------------------------------------------
# (d) the command line under torchrun, (e) a rank that fails
# --------------------------------------------------------------------------------------------------------------------
@pytest.mark.spawns
def test_command_line_under_torchrun_writes_one_folder_equal_to_one_process(source, tmp_path, capsys):
    from hf_qknorm.cli.main import main

    ref = tmp_path / "ref"
    assert main(_cli_args(source, ref / "out")) == 0
    one = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    parent = tmp_path / "dist"
    parent.mkdir()
    res = _torchrun("-m", "hf_qknorm.cli", *_cli_args(source, parent / "out"))
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-6000:]
    lines = [line for line in res.stdout.splitlines() if line.startswith("{")]
    assert len(lines) == 1  # rank 0 alone prints
    two = json.loads(lines[0])
    assert sorted(p.name for p in parent.iterdir()) == ["out"] and leftovers(parent) == []
    assert two["files"] == one["files"]
    want, got = load_file(ref / "out" / "model.safetensors"), load_file(parent / "out" / "model.safetensors")
    assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)
    assert _figures(two["report"]["heal"]) == _figures(one["report"]["heal"])
    record = json.loads((parent / "out" / "qknorm_conversion.json").read_text())
    assert _figures(record["heal"]) == _figures(one["report"]["heal"])


@pytest.mark.spawns
@pytest.mark.parametrize("failing", [0, 1])
def test_a_failing_rank_stops_the_launch_and_writes_nothing(source, tmp_path, failing):
    parent = tmp_path / "dist"
    parent.mkdir()
    res = _torchrun(__file__, "--cli-failing-rank", str(failing), *_cli_args(source, parent / "out"))
    assert res.returncode != 0
    assert "error: injected failure of a layer fit" in res.stderr
    assert list(parent.iterdir()) == []


@pytest.mark.parametrize("local_rank", ["1", "2", "-1", "one"])
def test_a_launch_with_more_processes_than_cuda_devices_is_refused_by_name(monkeypatch, local_rank):
    """torchrun starting two processes on a machine with one GPU: the second rank's calibration on CUDA is refused
    with the way out, before any CUDA call (CUDA itself would say only "invalid device ordinal")."""
    from hf_qknorm.conversion.orchestration import ranks

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: pytest.fail(f"set_device({d}) reached"))
    monkeypatch.setattr(ranks, "_dist", lambda: None)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", local_rank)
    with pytest.raises(ValueError, match=f"LOCAL_RANK.*{local_rank}") as err:
        with ranks.process_group("cuda"):
            pytest.fail("the block ran")
    if local_rank.lstrip("-").isdigit():
        assert "1 CUDA device(s)" in str(err.value) and "--device cpu" in str(err.value)
    monkeypatch.setenv("LOCAL_RANK", "0")  # the first rank's device exists: the index is returned
    assert ranks.local_cuda_index() == 0


# --------------------------------------------------------------------------------------------------------------------
# the worker
# --------------------------------------------------------------------------------------------------------------------
def _worker(out: Path, src: Path) -> None:
    import torch.distributed as dist

    import hf_qknorm
    import hf_qknorm.conversion.healing.heal as heal
    from hf_qknorm.conversion.orchestration.ranks import FirstRankFailed

    for name, value in SMALL_GENERATION.items():
        setattr(heal, name, value)

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.set_num_threads(1)
    fitted, fit = [], heal._fit

    def recorded(attn, calls, targets, settings, block_len, seed, *rest):  # this rank's layers (seed: + layer)
        fitted.append(seed)
        return fit(attn, calls, targets, settings, block_len, seed, *rest)

    heal._fit = recorded
    for mode, settings in HEAL.items():
        fitted.clear()
        torch.save((*_healed(src, settings), list(fitted)), out / f"heal_{mode}.rank{rank}.pt")
    heal._fit = fit
    # rank 1 calibrates to other values (as another device might): every rank must heal from rank 0's
    import hf_qknorm.conversion.calibration.layerwise as layerwise

    calibrate = layerwise.calibrate_checkpoint

    def perturbed(*args, **kwargs):
        values, report = calibrate(*args, **kwargs)
        return ({k: v + 1e-3 * rank for k, v in values.items()}, report)

    layerwise.calibrate_checkpoint = perturbed
    torch.save(_healed(src, HEAL["calibration"]), out / f"perturbed.rank{rank}.pt")
    layerwise.calibrate_checkpoint = calibrate
    rounds = []
    torch.save({"text": _generated(src, rounds.append), "rounds": rounds}, out / f"text.rank{rank}.pt")

    dst = out / "converted_dst"
    try:
        hf_qknorm.convert(
            src,
            dst,
            config=SCHEME,
            calibration=FAST,
            heal=dataclasses.replace(HEAL["calibration"], inputs="converted"),
            calibration_text=SHORT_TEXT,
            progress=False,
            log=quiet,
        )
        got = {"type": "none", "message": ""}
    except FirstRankFailed as exc:
        got = {"type": "FirstRankFailed", "message": str(exc), "original": str(exc.original)}
    except ValueError as exc:
        got = {"type": "ValueError", "message": str(exc)}
    got["dst_exists"] = dst.exists()
    torch.save(got, out / f"converted.rank{rank}.pt")

    api = out / "api_parent"
    result = hf_qknorm.convert(
        src,
        api / "api",
        config=SCHEME,
        calibration=FAST,
        heal=HEAL["calibration"],
        calibration_text=SHORT_TEXT,
        progress=False,
        log=quiet,
        verify="plugin",
    )
    folders = sorted(p.name for p in api.iterdir())
    torch.save(
        {"path": str(result.path), "files": result.files, "report": result.report.to_dict(), "folders": folders},
        out / f"api.rank{rank}.pt",
    )
    dist.destroy_process_group()
    _leave(0)


def _leave(code: int) -> None:
    """Leave without the interpreter's teardown, which gloo sometimes aborts on a loaded machine (see
    tests/training/test_sharded.py's worker); everything is saved."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _cli_failing(rank: int, argv: list[str]) -> None:
    """The command line, with rank ``rank``'s first layer fit raising."""
    import hf_qknorm.conversion.healing.heal as heal
    from hf_qknorm.cli.main import main

    if int(os.environ["RANK"]) == rank:

        def failing(*args, **kwargs):
            raise ValueError("injected failure of a layer fit")

        heal._fit = failing
    _leave(main(argv))


if __name__ == "__main__" and "--worker" in sys.argv:
    at = sys.argv.index("--worker")
    _worker(Path(sys.argv[at + 1]), Path(sys.argv[at + 2]))
elif __name__ == "__main__" and "--cli-failing-rank" in sys.argv:
    at = sys.argv.index("--cli-failing-rank")
    _cli_failing(int(sys.argv[at + 1]), sys.argv[at + 2 :])
