"""The decode benchmark's token table on the tiny shape: one row per cell, every scheme's ratio, the Markdown table."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import bench_decode


def test_token_table_times_every_scheme_against_the_unpatched_model():
    row = bench_decode.token_cell("tiny", batch=2, prompt=8, rounds=2, schemes=["qk_norm", "qk_norm_cap"])
    assert row["table"] == "token" and row["cache"] == "dynamic" and (row["batch"], row["prompt"]) == (2, 8)
    assert row["sdpa_us"] > 0
    # a ratio of CPU times of the same work on one machine: far from 0 and from infinity, whatever the machine
    assert all(0.05 < row[f"{s}_cpu"] < 20 for s in ("qk_norm", "qk_norm_cap"))
    table = bench_decode.markdown([row])
    assert "| sdpa us/forward | `qk_norm` | `qk_norm_cap` |" in table
    assert f"| tiny | dynamic | 2 | 8 | {row['sdpa_us']} | {row['qk_norm_cpu']:.2f}x |" in table


def test_token_table_leaves_the_cache_as_it_found_it():
    """Each timed forward's key/value are cropped away: every forward sees the prompt's cache, never a growing one."""
    from transformers import DynamicCache

    seen = []
    original = DynamicCache.crop

    def crop(self, n):
        original(self, n)
        seen.append(self.get_seq_length())

    DynamicCache.crop = crop
    try:
        bench_decode.token_cell("tiny", batch=1, prompt=5, rounds=1, schemes=["qk_norm"])
    finally:
        DynamicCache.crop = original
    assert seen and set(seen) == {5}


@pytest.mark.spawns
def test_token_table_refuses_caches_it_does_not_time():
    """The token table times the dynamic cache only: asking it for another is an error naming it, not a silent swap."""
    script = Path(bench_decode.__file__)
    res = subprocess.run(
        [sys.executable, str(script), "--table", "token", "--caches", "static", "--no-save"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 2
    assert "--table token times the dynamic cache only, got --caches static" in res.stderr


def test_gpu_rows_are_read_by_their_wall_clock():
    """A CUDA row's ratios are wall time (the host waits for the GPU); a CPU row's CPU time; rows written before the
    device was recorded are CPU rows."""
    gpu = {"table": "token", "shape": "1b", "cache": "dynamic", "batch": 1, "prompt": 512, "sdpa_us": 5925.8,
           "qk_norm_cap_wall": 0.76, "device": "cuda: NVIDIA H100 80GB HBM3"}  # fmt: skip
    old = {k: v for k, v in gpu.items() if k not in ("qk_norm_cap_wall", "device")} | {"qk_norm_cap_cpu": 0.88}
    assert "| 1b | dynamic | 1 | 512 | 5925.8 | 0.76x |" in bench_decode.markdown([gpu])
    assert "| 1b | dynamic | 1 | 512 | 5925.8 | 0.88x |" in bench_decode.markdown([old])


def test_the_pytorch_route_and_a_missing_gpu(monkeypatch, capsys):
    """``--route pytorch`` runs every cell under kernel_policy(devices=()); ``--device cuda`` without a CUDA device is
    a one-line usage error (exit 2), not a traceback."""
    import json

    import pytest
    import torch

    from hf_qknorm.attention import current_kernel_policy

    seen = []
    real = bench_decode.token_cell
    monkeypatch.setattr(bench_decode, "token_cell", lambda *a: seen.append(current_kernel_policy().devices) or real(*a))
    base = ["bench_decode.py", "--table", "token", "--shapes", "tiny", "--batch", "1", "--prompt", "4", "--no-save"]
    monkeypatch.setattr(sys, "argv", base + ["--rounds", "1", "--schemes", "soft_cap", "--route", "pytorch"])
    bench_decode.main()
    assert seen == [()] and json.loads(capsys.readouterr().out.splitlines()[0])["soft_cap_cpu"] > 0
    if not torch.cuda.is_available():
        monkeypatch.setattr(sys, "argv", base + ["--device", "cuda"])
        with pytest.raises(SystemExit) as exit_:
            bench_decode.main()
        assert exit_.value.code == 2 and "--device cuda: torch sees no CUDA device here" in capsys.readouterr().err


def test_the_floor_ablations_compute_the_patched_models_logits_and_refuse_otherwise(monkeypatch):
    """``<scheme>_floor`` (the scheme's decoding with nothing around its arithmetic) is timed only after its decode
    matched the patched model's to the bit; a floor that computed anything else -- here a projection whose norm lost
    its bias -- is refused before any timing."""
    import torch

    models = bench_decode._providers("tiny", False, ["qk_norm_cap", "qk_norm_cap_floor", "qkv_norm_floor"])
    assert models["qk_norm_cap_floor"].config._attn_implementation == "qknorm_floor"
    row = bench_decode.token_cell("tiny", batch=2, prompt=8, rounds=1, schemes=["soft_cap_floor", "qk_norm_floor"])
    assert all(0.05 < row[f"{s}_cpu"] < 20 for s in ("soft_cap_floor", "qk_norm_floor"))

    real = bench_decode._floor_projection

    def biased(projection, norm, head_dim):
        with torch.no_grad():
            norm.bias.add_(0.5)  # the norm the floor reads, changed after the reference was copied
        return real(projection, norm, head_dim)

    monkeypatch.setattr(bench_decode, "_floor_projection", biased)
    with pytest.raises(AssertionError, match="the floor model's logits differ from the patched model's"):
        bench_decode._providers("tiny", False, ["qk_norm_floor"])


def test_the_aten_ablation_runs_its_model_without_the_native_op():
    """``<scheme>_aten`` turns the native op off while its model runs -- forward and the tiled path's backward -- and
    back on after, an exception included; the other providers keep it."""
    import torch

    from hf_qknorm.attention import native

    if native.MODULE is None:
        pytest.skip("the native op was not built here")
    saved = native.NATIVE[0]
    native.NATIVE[0] = native.MODULE
    seen = []

    class Spy:
        def __getattr__(self, name):
            seen.append(name)
            return getattr(native.MODULE, name)

    try:
        native.NATIVE[0] = Spy()
        models = bench_decode._providers("tiny", False, ["qk_norm_cap", "qk_norm_cap_aten"])
        seen.clear()  # patching ran its self-check's forward
        ids = torch.randint(3, 100, (1, 12))
        with torch.no_grad():
            models["qk_norm_cap_aten"].generate(ids, max_new_tokens=3, do_sample=False, pad_token_id=0)
        models["qk_norm_cap_aten"](ids, labels=ids).loss.backward()
        assert seen == [] and isinstance(native.NATIVE[0], Spy)
        with torch.no_grad():
            models["qk_norm_cap"].generate(ids, max_new_tokens=3, do_sample=False, pad_token_id=0)
        models["qk_norm_cap"](ids, labels=ids).loss.backward()
        assert "capped_f32" in seen and "backward_p_f32" in seen
        with pytest.raises(IndexError):
            models["qk_norm_cap_aten"](torch.full((1, 4), 10**6))  # an id past the vocabulary: the forward raises
        assert isinstance(native.NATIVE[0], Spy)  # restored all the same
    finally:
        native.NATIVE[0] = saved


def test_bench_native_times_every_shape_and_reports_its_errors(capsys):
    """``benchmarks/bench_native.py``: a row per shape, three times per row, the native op's and the ATen ops' error
    against float64 within float32's reach."""
    import bench_native

    from hf_qknorm.attention import native

    if native.MODULE is None:
        pytest.skip("the native op was not built here")
    saved = native.NATIVE[0]
    try:
        assert bench_native.main(["--rounds", "1"]) == 0
    finally:
        native.NATIVE[0] = saved
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert len(rows) == len(bench_native.SHAPES)
    for row in rows:
        cells = [cell.strip() for cell in row.strip("|").split("|")]
        errors = [float(cell.split("(")[1].rstrip(")")) for cell in cells[1:3]]
        assert all(0 <= error < 1e-5 for error in errors), row


def test_bench_native_times_the_tiled_passes(capsys):
    """``benchmarks/bench_native.py --passes``: a row per tile size, a positive time per pass and per ATen op."""
    import bench_native

    from hf_qknorm.attention import native

    if native.MODULE is None:
        pytest.skip("the native op was not built here")
    assert bench_native.main(["--passes", "--rounds", "1"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert [row.split("|")[1].strip() for row in rows] == ["16384", "524288"]
    for row in rows:
        times = [float(cell) for cell in row.strip("|").split("|")[1:]]
        assert len(times) == 7 and all(0 < t < 1e3 for t in times), row


def test_providers_take_every_place_in_turn():
    """The interleaved tables rotate the providers' order by one place per round: over as many rounds as there are
    providers, each runs at each place once, the unpatched model included."""
    import bench_decode

    items = {"sdpa": 0, "qk_norm": 1, "soft_cap": 2}
    orders = [[name for name, _ in bench_decode._rotated(items, r)] for r in range(3)]
    assert orders[0] == ["sdpa", "qk_norm", "soft_cap"]
    for place in range(3):
        assert sorted(order[place] for order in orders) == sorted(items)
    assert all(sorted(order) == sorted(items) for order in orders)


def test_step_rows_split_user_time_and_count_page_faults():
    """A step row gives CPU (user + system), wall and user-time ratios and page faults per step for each provider,
    and the report shows the user-time ratios and the faults beside the step table."""
    row = bench_decode.step_cell("bundled", 32, 2, ["soft_cap"])
    for key in ("soft_cap_cpu", "soft_cap_wall", "soft_cap_user"):
        assert 0.1 < row[key] < 10, (key, row[key])
    assert isinstance(row["sdpa_faults"], int) and row["sdpa_faults"] >= 0 and row["soft_cap_faults"] >= 0
    text = bench_decode.markdown([row])
    assert f"| bundled | 32 | {row['soft_cap_user']:.3f}x | {row['sdpa_faults']} / {row['soft_cap_faults']} |" in text
    assert isinstance(bench_decode._environment()["allocator"], dict)


def test_the_compiled_step_table_compiles_every_model(monkeypatch, capsys):
    """``--table step --compile`` runs every provider's step through torch.compile (a traced graph, here the quick
    aot_eager backend) and says so in its rows and table; ``--compile`` on the token table stays a usage error."""
    import json

    import torch

    compiled = []
    real = torch.nn.Module.compile
    monkeypatch.setattr(torch.nn.Module, "compile", lambda self, **kw: compiled.append(kw) or real(self, **kw))
    base = ["bench_decode.py", "--shapes", "tiny", "--seq", "8", "--rounds", "1", "--schemes", "qk_norm_cap"]
    base.append("--no-save")
    monkeypatch.setattr(sys, "argv", base + ["--table", "step", "--compile", "--compile-backend", "aot_eager"])
    bench_decode.main()
    out = capsys.readouterr().out
    row = json.loads(out.splitlines()[0])
    assert row["compiled"] is True and row["compile_backend"] == "aot_eager" and row["qk_norm_cap_cpu"] > 0
    assert compiled == [{"backend": "aot_eager"}] * 2  # the unpatched model and the scheme
    assert "| tiny | 8, compiled |" in out
    monkeypatch.setattr(sys, "argv", base + ["--table", "token", "--compile"])
    with pytest.raises(SystemExit) as exit_:
        bench_decode.main()
    assert exit_.value.code == 2 and "--compile times the training step" in capsys.readouterr().err
