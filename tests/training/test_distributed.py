"""Two CPU processes (gloo) under ``accelerate launch``: the from-scratch recipe trains a patched model with DDP
through Trainer (monitor, Q/K learning-rate control and QK-Clip callbacks on) and every rank ends with identical
parameters, norm weights included, logs the same (whole-step) monitor statistics and clips the same heads; then
FSDP2 (``fully_shard``) trains a patched model on the same two processes with the monitor and the Q/K learning-rate
rule and matches a single-process run on the whole batch. The training controls under FSDP2 and tensor parallelism
in depth: ``tests/training/test_sharded.py``.

This file is also the worker: ``accelerate launch tests/training/test_distributed.py --worker OUT``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests._support.trainer_runs import free_port, launch_env

ROOT = Path(__file__).resolve().parents[2]
FSDP_STEPS, FSDP_BATCH = 3, 4


def _recipe_args(out: Path, text: Path) -> list[str]:
    return [
        "--text",
        str(text),
        "--out",
        str(out / "run"),
        "--max-steps",
        "3",
        "--batch-size",
        "2",
        "--context",
        "32",
        "--hidden-size",
        "32",
        "--layers",
        "2",
        "--heads",
        "2",
        "--kv-heads",
        "1",
        "--eval-blocks",
        "2",
        "--monitor-every",
        "1",
        "--qk-lr-tau",
        "0.5",
        "--qk-clip-tau",
        "1.0",
        "--logging-steps",
        "1",
        "--dump-rank-state",
        str(out / "ddp"),
    ]


def _fsdp_batches():
    import torch

    from tests._support.tiny_models import VOCAB

    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (FSDP_BATCH, 16), generator=g) for _ in range(FSDP_STEPS)]


def _fsdp_model():
    import torch

    import hf_qknorm
    from tests._support.tiny_models import tiny_model

    model = tiny_model("llama", dtype=torch.float64, seed=2)
    hf_qknorm.patch_model(model, "qk_norm_cap", softcap=20.0)
    model.train()
    return model


def _worker(out: Path) -> None:
    sys.path.insert(0, str(ROOT / "recipes"))
    import torch
    import torch.distributed as dist
    import train_scratch
    from torch.distributed.fsdp import fully_shard

    train_scratch.main(_recipe_args(out, out / "text.txt"))  # DDP through Trainer; accelerate set up gloo

    import hf_qknorm

    rank, world = dist.get_rank(), dist.get_world_size()
    model = _fsdp_model()
    mesh = torch.distributed.device_mesh.init_device_mesh("cpu", (world,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    sharded = type(model.model.layers[0].self_attn.q_norm.weight).__name__
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    monitor, qk = hf_qknorm.QKMonitor(model), hf_qknorm.QKLearningRate(model, tau=0.5)
    logits = []
    for step, ids in enumerate(_fsdp_batches()):
        mine = ids[rank::world]  # equal halves: the mean of the ranks' mean losses is the whole batch's mean
        with monitor.record(step) as stats:
            loss = model(mine, labels=mine).loss
        loss.backward()
        qk.step(opt)
        opt.zero_grad()
        logits.append(stats["qk/max_logit"])
    full = {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}
    torch.save({"params": full, "sharded": sharded, "logits": logits}, out / f"fsdp_rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()
    # Everything is saved. Leave without the interpreter's teardown: on a loaded machine gloo's threads sometimes
    # abort it ("terminate called without an active exception", exit -6, seen in CI's oldest lane), which would fail
    # the run after its results are written. Same exit as tests/training/test_sharded.py's worker.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


@pytest.mark.spawns
def test_two_processes_ddp_recipe_and_fsdp(tmp_path):
    import torch
    from safetensors import safe_open

    import hf_qknorm
    from hf_qknorm.data import bundled_text

    (tmp_path / "text.txt").write_text(bundled_text("tinyshakespeare")[:40_000], encoding="utf-8")
    cmd = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--multi_gpu",
        "--num_processes",
        "2",
        "--num_machines",
        "1",
        "--mixed_precision",
        "no",
        "--dynamo_backend",
        "no",
        "--main_process_port",
        str(free_port()),
        __file__,
        "--worker",
        str(tmp_path),
    ]
    env = launch_env(ONEDNN_MAX_CPU_ISA="AVX512_CORE_BF16")
    proc = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]

    # DDP: identical replicas, norm weights included, although each rank saw different data
    ranks = []
    for r in range(2):
        with safe_open(str(tmp_path / "ddp" / f"rank{r}.safetensors"), "pt") as f:
            ranks.append(({k: f.get_tensor(k) for k in f.keys()}, f.metadata()))
    (a, meta_a), (b, meta_b) = ranks
    assert meta_a["world_size"] == "2" and a.keys() == b.keys()
    assert sum(k.endswith("self_attn.q_norm.weight") for k in a) == 2 and any("k_norm.bias" in k for k in a)
    for key in a:
        assert torch.equal(a[key], b[key]), key
    init = torch.ones_like(a["model.layers.0.self_attn.q_norm.weight"])
    assert not torch.equal(a["model.layers.0.self_attn.q_norm.weight"], init)  # the norms trained
    hist_a, hist_b = (json.loads(m["extra"])["monitor"] for m in (meta_a, meta_b))
    assert len(hist_a) == 3 and hist_a == hist_b  # the statistics of the whole step, over both ranks' batches
    clip_a, clip_b = (json.loads(m["extra"])["qk_clip"] for m in (meta_a, meta_b))
    assert clip_a and clip_a == clip_b  # QKClipCallback: the same heads clipped by the same factors on both ranks
    results = json.loads((tmp_path / "run" / "results.json").read_text())
    assert results["world_size"] == 2 and results["steps"] == 3
    assert (tmp_path / "run" / "final" / "config.json").is_file()

    # FSDP2 over the same two gloo processes (monitor and Q/K learning-rate rule on): equal to one process training
    # on the whole batch, the monitor's logged maxima included
    f0, f1 = (torch.load(tmp_path / f"fsdp_rank{r}.pt") for r in range(2))
    assert f0["sharded"] == "DTensor" and f0["logits"] == f1["logits"]
    ref = _fsdp_model()
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    monitor, qk = hf_qknorm.QKMonitor(ref), hf_qknorm.QKLearningRate(ref, tau=0.5)
    for step, ids in enumerate(_fsdp_batches()):
        with monitor.record() as stats:
            ref(ids, labels=ids).loss.backward()
        qk.step(opt)
        opt.zero_grad()
        assert f0["logits"][step] == pytest.approx(stats["qk/max_logit"], rel=1e-12)
    for name, p in ref.named_parameters():
        assert torch.equal(f0["params"][name], f1["params"][name]), name
        torch.testing.assert_close(f0["params"][name], p.detach(), rtol=1e-9, atol=1e-11, msg=name)


if __name__ == "__main__" and "--worker" in sys.argv:
    _worker(Path(sys.argv[sys.argv.index("--worker") + 1]))
