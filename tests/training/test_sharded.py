"""Every training control on sharded models, over 2 and 4 gloo processes on the CPU, against one process.

FSDP2 (``fully_shard``: reshard after forward on and off, bf16/fp32 mixed precision, peft LoRA, Muon, GPT-2's fused
``Conv1D``, uneven shards with heads straddling ranks) and tensor parallelism (``hf_qknorm.parallelize_attention``):
QK-Clip, the monitor and the Q/K learning-rate rule train three steps, and the weights after those steps, the heads
clipped at each step, the maxima QK-Clip acted on, the logged monitor statistics and the Q/K factors must equal those
of one process training on the whole batch (``tests/_support/sharded_runs.py`` holds both sides). The 2-process run also
saves and resumes a sharded checkpoint (``torch.distributed.checkpoint``) and a full one (``save_pretrained``),
feeds QK-Clip non-finite and negative maxima, and checks what is refused.

This file is also the worker: ``torchrun --nproc_per_node N tests/training/test_sharded.py --worker OUT``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests._support import sharded_runs as S
from tests._support.trainer_runs import free_port, launch_env

ROOT = Path(__file__).resolve().parents[2]

_LAUNCHED: dict[int, Path] = {}
CKPT = "fsdp_patched_no_reshard"


def _launch(world: int, tmp_path_factory) -> Path:
    """Run the worker once per world size (every scenario in one launch: process start-up dominates)."""
    if world not in _LAUNCHED:
        out = tmp_path_factory.mktemp(f"world{world}")
        env = launch_env(ONEDNN_MAX_CPU_ISA="AVX512_CORE_BF16")
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            str(world),
            "--master_port",
            str(free_port()),
            __file__,
            "--worker",
            str(out),
        ]
        res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600, cwd=ROOT)
        assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-6000:]
        _LAUNCHED[world] = out
    return _LAUNCHED[world]


def _load(out: Path, name: str, world: int) -> list[dict]:
    return [torch.load(out / f"{name}.rank{r}.pt", weights_only=False) for r in range(world)]


CASES = [(w, n) for w in (2, 4) for n, spec in S.SPECS.items() if w in spec.worlds]


@pytest.mark.spawns(shared=True)  # one launch per world size, started by the first test that needs it
@pytest.mark.parametrize("world,name", CASES, ids=[f"{w}proc-{n}" for w, n in CASES])
def test_sharded_training_equals_one_process(world, name, tmp_path_factory):
    spec = S.SPECS[name]
    ranks = _load(_launch(world, tmp_path_factory), name, world)
    ref = S.reference_mixed(name, world) if spec.mixed else S.run(name)
    # fp32 weights with bf16 forwards: gradient sums in another order may flip a bf16 rounding of a weight
    rtol, atol = (1e-5, 1e-7) if spec.mixed else (1e-9, 1e-12)
    for got in ranks:
        assert got["tau"] == pytest.approx(ref["tau"], rel=1e-12)
        assert got["clipped"] == ref["clipped"], (got["clipped"], ref["clipped"])
        assert any(got["clipped"]) and not all(len(c) == sum(len(m) for m in got["S"][0]) for c in got["clipped"])
        for g_step, r_step in zip(got["S"], ref["S"]):
            for g, r in zip(g_step, r_step):
                torch.testing.assert_close(torch.tensor(g), torch.tensor(r), rtol=rtol * 10, atol=atol)
        for g_step, r_step in zip(got["gamma"], ref["gamma"]):
            assert g_step.keys() == r_step.keys()
            for key in g_step:
                assert g_step[key] == pytest.approx(r_step[key], rel=rtol * 10)
        for g_stats, r_stats in zip(got["monitor"], ref["monitor"]):
            keys = r_stats.keys() if not spec.mixed else ["qk/max_logit"]  # see reference_mixed
            for key in keys:
                assert g_stats[key] == pytest.approx(r_stats[key], rel=rtol * 10, abs=atol), key
        for g_heads, r_heads in zip(got["heads"], ref["heads"]):
            assert g_heads.keys() == r_heads.keys()
            for i in g_heads:
                torch.testing.assert_close(
                    torch.tensor(g_heads[i]), torch.tensor(r_heads[i]), rtol=rtol * 10, atol=atol
                )
        assert len(got["factors"]) == len(ref["factors"])
        for g_step, r_step in zip(got["factors"], ref["factors"]):  # per step, per layer: (f_Q, f_K)
            for g_f, r_f in zip(g_step, r_step):
                torch.testing.assert_close(
                    torch.tensor(g_f[0] + g_f[1]), torch.tensor(r_f[0] + r_f[1]), rtol=rtol, atol=atol
                )
        assert got["params"].keys() == ref["params"].keys()
        for key, value in ref["params"].items():
            assert torch.isfinite(got["params"][key]).all(), key
            torch.testing.assert_close(got["params"][key], value, rtol=rtol, atol=atol, msg=key)
        if spec.shard == "tp":  # the forward itself: the sharded model's logits are the whole model's
            torch.testing.assert_close(got["logits0"], ref["logits0"], rtol=1e-12, atol=1e-12)
    for other in ranks[1:]:  # every rank holds the same model (tensor parallel: the replicated norms included)
        for key, value in ranks[0]["params"].items():
            assert torch.equal(other["params"][key], value), key


@pytest.mark.spawns(shared=True)  # the launch the first of these tests starts
def test_sharded_checkpoints_load_back_and_resume_identically(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    out = _launch(2, tmp_path_factory)
    uninterrupted, resumed = (torch.load(out / f"ckpt_{k}.pt", weights_only=False) for k in ("a", "b"))
    assert uninterrupted["clipped"] == resumed["clipped"] and any(uninterrupted["clipped"])
    for key, value in uninterrupted["params"].items():
        assert torch.equal(resumed["params"][key], value), key
    # the full checkpoint (save_pretrained from the sharded run) is a patched model that still carries its scheme
    model = AutoModelForCausalLM.from_pretrained(out / "full", dtype=torch.float64)
    assert model.config.qknorm["scheme"] == "qk_norm_cap" and model.config.model_type == "qknorm_llama"
    for key, value in resumed["params"].items():
        torch.testing.assert_close(dict(model.named_parameters())[key], value, rtol=0, atol=0, msg=key)
    # the sharded (DCP) checkpoint loads into one process's unsharded model: the weights at the save
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(out / "dcp", out / "dcp.pt")
    saved = torch.load(out / "dcp.pt", weights_only=False)["model"]
    for key, value in uninterrupted["at_save"].items():
        assert torch.equal(saved[key], value), key


@pytest.mark.spawns(shared=True)  # the launch the first of these tests starts
def test_non_finite_and_negative_maxima_across_ranks(tmp_path_factory):
    """Megatron-LM's QK-Clip produced NaN weights when a head's maximum was <= 0 (a negative base under a fractional
    power, their PR #7517): here rank 0 records a NaN and +inf, rank 1 negative maxima; both ranks skip the
    non-finite heads, clip the others identically, and match one process given the combined maxima."""
    out = _launch(2, tmp_path_factory)
    r0, r1 = (torch.load(out / f"nonfinite.rank{r}.pt", weights_only=False) for r in range(2))
    assert r0["clipped"] == r1["clipped"] == [(0, 1), (1, 1)]
    assert r0["skipped"] == r1["skipped"] == [(0, 0), (1, 0)]
    model = S.build(S.SPECS["fsdp_llama"])
    import hf_qknorm

    clip = hf_qknorm.QKClip(model, tau=NONFINITE_TAU)
    clip.maxima = [torch.tensor(m, dtype=torch.float64) for m in NONFINITE_COMBINED]
    clip.step()
    for name, p in model.named_parameters():
        assert torch.isfinite(r0["params"][name]).all() and torch.equal(r0["params"][name], r1["params"][name])
        torch.testing.assert_close(r0["params"][name], p.detach(), rtol=0, atol=0, msg=name)


@pytest.mark.spawns(shared=True)  # the launch the first of these tests starts
def test_a_kv_shared_layer_under_tensor_parallelism(tmp_path_factory):
    """Tensor parallelism of a model whose last layer reuses an earlier layer's keys and values (no k/v projection to
    shard): each rank's KV-shared layer reads the key heads its store layer's rank holds, which are the ones its own
    query heads attend to -- the logits and the norms' gradients are the one process's."""
    out = _launch(2, tmp_path_factory)
    path = out / "kv_shared_tp.rank0.pt"
    if not path.exists():
        pytest.skip("gemma4_text is not in this Transformers")
    results = torch.load(path, weights_only=False)
    (single, g1), (sharded, g2) = results[False], results[True]
    torch.testing.assert_close(sharded, single, rtol=1e-10, atol=1e-10)
    assert g1.keys() == g2.keys() and any("layers.2.self_attn.q_norm" in n for n in g1)
    for name in g1:
        torch.testing.assert_close(g2[name], g1[name], rtol=1e-9, atol=1e-10)


@pytest.mark.spawns(shared=True)  # the launch the first of these tests starts
def test_qk_clip_scales_sharded_one_plus_w_gains_as_one_process_does(tmp_path_factory):
    """Gemma's own norms keep a gain of ``1 + w``; under FSDP2 their weights are shards, whose form QK-Clip reads off
    a whole copy: the clipped gains equal the one process's."""
    out = _launch(2, tmp_path_factory)
    (n1, g1), (n2, g2) = (torch.load(out / "gemma_norms_fsdp.rank0.pt", weights_only=False)[k] for k in (False, True))
    assert n1 > 0 and n1 == n2 and g1.keys() == g2.keys() and g1
    for name in g1:
        torch.testing.assert_close(g2[name], g1[name], rtol=1e-9, atol=1e-12)


@pytest.mark.spawns(shared=True)  # the launch the first of these tests starts
def test_unsupported_layouts_are_refused_clearly(tmp_path_factory):
    out = _launch(2, tmp_path_factory)
    refused = torch.load(out / "refused.rank0.pt", weights_only=False)
    assert "fused Q/K/V projection" in refused["gpt2_tp"] and "FSDP2 or DDP" in refused["gpt2_tp"]
    assert "divisible by 2" in refused["heads_tp"] and "3 heads" in refused["heads_tp"]
    assert "already sharded by FSDP2" in refused["patch_after_fsdp"] and "Patch first" in refused["patch_after_fsdp"]
    assert "wrapped by DistributedDataParallel" in refused["patch_after_ddp"]
    assert "not summed across ranks" in refused["unsynced_tp"] and "parallelize_attention" in refused["unsynced_tp"]
    for key in ("fsdp1_clip", "fsdp1_qk_lr"):
        assert "FSDP version 1" in refused[key] and "fully_shard" in refused[key]
    assert "unsharded" in refused["unsharded_step"] and "after optimizer.step()" in refused["unsharded_step"]


@pytest.mark.spawns
def test_recipe_fsdp_resumes_identically(tmp_path):
    """``recipes/pretrain_sharded.py`` under torchrun (2 gloo processes, FSDP2, QK-Clip, monitor and the Q/K rule on):
    a run resumed from its step-2 sharded checkpoint ends with the uninterrupted run's weights, bit for bit, and the
    final folder is a whole patched model."""
    import json

    from safetensors.torch import load_file

    from hf_qknorm.data import bundled_text

    (tmp_path / "text.txt").write_text(bundled_text("tinyshakespeare")[:20_000], encoding="utf-8")
    common = [
        "--text",
        str(tmp_path / "text.txt"),
        "--max-steps",
        "4",
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
        "--logging-steps",
        "1",
        "--qk-clip-tau",
        "2.0",
        "--qk-lr-tau",
        "0.5",
    ]
    env = launch_env()

    def launch(*args):
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            "2",
            "--master_port",
            str(free_port()),
            str(ROOT / "recipes" / "pretrain_sharded.py"),
            *common,
            *args,
        ]
        res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600, cwd=tmp_path)
        assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-5000:]
        return res.stdout

    full = launch("--out", str(tmp_path / "a"), "--save-steps", "2")
    resumed = launch("--out", str(tmp_path / "b"), "--resume", str(tmp_path / "a" / "checkpoint-2"))
    assert "fsdp over 2 processes" in full and "resumed at step 2" in resumed
    a, b = (load_file(str(tmp_path / k / "final" / "model.safetensors")) for k in ("a", "b"))
    assert a.keys() == b.keys() and any("q_norm" in k for k in a)
    for key in a:
        assert torch.equal(a[key], b[key]), key
    config = json.loads((tmp_path / "a" / "final" / "config.json").read_text())
    assert config["model_type"] == "qknorm_llama" and config["qknorm"]["scheme"] == "qk_norm_cap"
    results = json.loads((tmp_path / "a" / "results.json").read_text())
    assert results["world_size"] == 2 and results["steps"] == 4 and results["clipped_steps"] >= 1
    last_b = json.loads((tmp_path / "b" / "results.json").read_text())["last"]
    for row in (last_b, results["last"]):
        row.pop("clip_seconds")  # a timing
    assert last_b == results["last"]  # the same loss, gradient norm, clipped heads and largest logit


# --------------------------------------------------------------------------------------------------------------------
# the worker
# --------------------------------------------------------------------------------------------------------------------
NONFINITE_TAU = 4.0
NONFINITE = [  # per rank, per layer: the maxima each rank "recorded" (3 query heads)
    [[float("nan"), 8.0, -5.0], [float("inf"), 0.5, -1.0]],
    [[1.0, 1.0, float("-inf")], [-3.0, 12.0, 0.0]],
]
NONFINITE_COMBINED = [[float("nan"), 8.0, -5.0], [float("inf"), 12.0, 0.0]]


def _checkpoint(out: Path, rank: int, world: int) -> None:
    """Train 2 steps, save (DCP + the controls' state), train 2 more; a fresh sharded model loads the checkpoint and
    trains the same 2 steps; the resumed model is also saved whole with ``save_pretrained``."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_state_dict,
        set_state_dict,
    )

    from hf_qknorm.portable.layout import unwrap

    spec, data = S.SPECS[CKPT], list(enumerate(S.batches(4)))

    def fresh(initial_norms=None):
        model = S.build(spec)
        tau = S.tau_for(model)
        model = S.shard(model, spec, world)
        opt = S.optimizer(model, spec)
        return model, opt, S.controls(model, tau, spec, initial_norms), S._empty_record(tau)

    model, opt, ctl, a = fresh()
    S.train(model, opt, ctl, data[:2], a, rank=rank, world=world, split=True)
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(out / "dcp"))
    state = {"clip": ctl[0].state_dict(), "qk": ctl[2].state_dict()}
    a["at_save"] = S.full_params(model)
    S.train(model, opt, ctl, data[2:], a, rank=rank, world=world, split=True)
    a["params"] = S.full_params(model)

    model, opt, ctl, b = fresh(initial_norms=state["qk"]["initial_norms"])
    msd, osd = get_state_dict(model, opt)
    loaded = {"model": msd, "optim": osd}
    dcp.load(loaded, checkpoint_id=str(out / "dcp"))
    set_state_dict(model, opt, model_state_dict=loaded["model"], optim_state_dict=loaded["optim"])
    ctl[0].load_state_dict(state["clip"])
    S.train(model, opt, ctl, data[2:], b, rank=rank, world=world, split=True)
    b["params"] = S.full_params(model)
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        unwrap(model).save_pretrained(out / "full", state_dict=full)
        a["clipped"], b["clipped"] = a["clipped"][2:], b["clipped"]  # the steps both ran
        torch.save(a, out / "ckpt_a.pt")
        torch.save(b, out / "ckpt_b.pt")
    dist.barrier()


def _nonfinite(out: Path, rank: int, world: int) -> None:
    import hf_qknorm

    model = S.shard(S.build(S.SPECS["fsdp_llama"]), S.SPECS["fsdp_llama"], world)
    clip = hf_qknorm.QKClip(model, tau=NONFINITE_TAU)
    clip.maxima = [torch.tensor(m, dtype=torch.float64) for m in NONFINITE[rank]]
    clipped = clip.step()
    torch.save(
        {
            "clipped": [(i, h) for i, h, *_ in clipped],
            "skipped": [(i, h) for i, h, _ in clip.last_skipped],
            "params": S.full_params(model),
        },
        out / f"nonfinite.rank{rank}.pt",
    )


def _refusals(out: Path, rank: int, world: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    import hf_qknorm
    from tests._support.tiny_models import tiny_model

    mesh = init_device_mesh("cpu", (world,))
    refused = {}

    def refuse(key, fn):
        try:
            fn()
        except (ValueError, NotImplementedError, RuntimeError) as err:
            refused[key] = str(err)

    refuse("gpt2_tp", lambda: hf_qknorm.parallelize_attention(S.build(S.SPECS["fsdp_gpt2"]), mesh))
    refuse("heads_tp", lambda: hf_qknorm.parallelize_attention(S.build(S.SPECS["fsdp_llama"]), mesh))
    sharded = S.shard(S.build(S.SPECS["fsdp_llama"]), S.SPECS["fsdp_llama"], world)
    refuse("patch_after_fsdp", lambda: hf_qknorm.patch_model(sharded, "qk_norm"))
    ddp = torch.nn.parallel.DistributedDataParallel(tiny_model("llama"))
    refuse("patch_after_ddp", lambda: hf_qknorm.patch_model(ddp, "qk_norm"))
    qwen3 = tiny_model("qwen3", dtype=torch.float64, **{**S.TP_SHAPE, "head_dim": 8})
    for layer in qwen3.model.layers:  # torch's own parallelize_module: Qwen3's q_norm/k_norm gradients left partial
        parallelize_module(
            layer.self_attn,
            mesh,
            {
                "q_proj": ColwiseParallel(),
                "k_proj": ColwiseParallel(),
                "v_proj": ColwiseParallel(),
                "o_proj": RowwiseParallel(),
            },
        )
    refuse("unsynced_tp", lambda: hf_qknorm.QKClip(qwen3))
    from torch.distributed.fsdp import FullyShardedDataParallel

    fsdp1 = FullyShardedDataParallel(tiny_model("llama"), device_id=torch.device("cpu"))
    refuse("fsdp1_clip", lambda: hf_qknorm.QKClip(fsdp1))  # before any read of its (freed) weight views
    refuse("fsdp1_qk_lr", lambda: hf_qknorm.QKLearningRate(fsdp1))
    spec = S.SPECS[CKPT]
    model = S.shard(S.build(spec), spec, world)
    clip = hf_qknorm.QKClip(model, tau=1.0)
    ids = S.batches()[0][rank::world]
    loss = model(ids, labels=ids).loss  # reshard_after_forward=False: the weights stay gathered until backward
    refuse("unsharded_step", clip.step)
    loss.backward()
    if rank == 0:
        torch.save(refused, out / "refused.rank0.pt")


def _kv_shared_tp(out: Path, rank: int, world: int) -> None:
    """A capped Gemma 4 whose last layer reuses an earlier layer's keys and values, in one process and tensor-
    parallel: logits and the norms' gradients (float64)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if "gemma4_text" not in CONFIG_MAPPING:
        return
    from torch.distributed.device_mesh import init_device_mesh

    import hf_qknorm
    from tests._support.tiny_models import kv_shared_gemma4

    ids = torch.randint(3, 100, (2, 9), generator=torch.Generator().manual_seed(3))
    results = {}
    for sharded in (False, True):
        model = kv_shared_gemma4().to(torch.float64)
        hf_qknorm.patch_model(model, scheme="qk_norm_cap", norm="layernorm", softcap=2.0)
        if sharded:
            hf_qknorm.parallelize_attention(model, init_device_mesh("cpu", (world,)))
        logits = model(ids).logits
        logits.square().mean().backward()
        grads = {
            n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).detach().clone()
            for n, p in model.named_parameters()
            if "_norm" in n and p.grad is not None
        }
        results[sharded] = (logits.detach(), grads)
    if rank == 0:
        torch.save(results, out / "kv_shared_tp.rank0.pt")


def _gemma_norms_fsdp(out: Path, rank: int, world: int) -> None:
    """QK-Clip on an unpatched Gemma 3, its own ``1 + w`` q/k norms sharded by FSDP2: the gains after one clipped
    step, in one process and sharded."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM

    import hf_qknorm
    from hf_qknorm.verification.tiny import tiny_config

    ids = torch.randint(3, 100, (2, 9), generator=torch.Generator().manual_seed(4))
    results = {}
    for sharded in (False, True):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(tiny_config("gemma3_text")).to(torch.float64)
        model.set_attn_implementation("qknorm")
        if sharded:
            mesh = init_device_mesh("cpu", (world,))
            for block in model.model.layers:
                fully_shard(block, mesh=mesh)
            fully_shard(model, mesh=mesh)
        clip = hf_qknorm.QKClip(model, tau=0.05)
        model.train()
        model(ids)
        clipped = clip.step()
        gains = {
            n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
            for n, p in model.named_parameters()
            if "q_norm" in n or "k_norm" in n
        }
        results[sharded] = (len(clipped), gains)
    if rank == 0:
        torch.save(results, out / "gemma_norms_fsdp.rank0.pt")


def _worker(out: Path) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    for name, spec in S.SPECS.items():
        if world in spec.worlds:
            start = time.perf_counter()
            torch.save(S.run(name, rank, world, sharded=True), out / f"{name}.rank{rank}.pt")
            if rank == 0:
                print(f"{name}: {time.perf_counter() - start:.1f} s", flush=True)
    if world == 2:
        _checkpoint(out, rank, world)
        _nonfinite(out, rank, world)
        _refusals(out, rank, world)
        _kv_shared_tp(out, rank, world)
        _gemma_norms_fsdp(out, rank, world)
    dist.destroy_process_group()
    # Everything is saved. Leave without the interpreter's teardown: on a loaded machine gloo's threads sometimes
    # abort it ("terminate called without an active exception", exit -6, seen on the previous release's code too),
    # which failed the run after its results were written.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__" and "--worker" in sys.argv:
    _worker(Path(sys.argv[sys.argv.index("--worker") + 1]))
