"""Training runs shared by the multi-process tests (``tests/training/test_sharded.py``) and their single-process
references:
the same tiny model, data, optimizer and training controls (QK-Clip, the monitor, the Q/K learning-rate rule), with
the model whole in one process or sharded over gloo processes (FSDP2 ``fully_shard``, tensor parallelism).

The shapes are chosen so that the sharding is awkward: 3 query heads of 10 channels and 1 key head, so ``q_proj``'s
30 rows split 15/15 over 2 ranks and 8/8/8/6 over 4 (a head's rows straddle two ranks, the shards are uneven),
``k_proj``'s 10 rows 5/5 and 3/3/3/1, GPT-2's fused ``Conv1D`` ``c_attn`` ``(30, 90)`` splits its input dimension and
its bias (90,) splits Q, K and V columns mid-head. Tensor parallelism needs whole heads per rank: 8 heads, 4 key
heads.
"""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass, field

import torch

import hf_qknorm
from hf_qknorm.portable.layout import family_of, find_layers, unwrap
from tests._support.tiny_models import VOCAB, tiny_model

STEPS, BATCH, SEQ = 3, 4, 12
AWKWARD = {"hidden_size": 30, "num_attention_heads": 3, "num_key_value_heads": 1, "intermediate_size": 48}
TP_SHAPE = {"hidden_size": 64, "num_attention_heads": 8, "num_key_value_heads": 4, "intermediate_size": 64}


@dataclass(frozen=True)
class Spec:
    family: str = "llama"
    overrides: dict = field(default_factory=lambda: dict(AWKWARD))
    scheme: str | None = None
    shard: str = "fsdp"  # "fsdp" (data split over ranks) or "tp" (every rank sees the whole batch)
    reshard: bool = True
    mixed: bool = False  # FSDP2 MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)
    lora: bool = False
    muon: bool = False
    qk_lr: bool = True
    controls_first: bool = False  # create the controls before sharding (fully_shard then replaces the parameters)
    worlds: tuple = (2, 4)


SPECS = {
    "fsdp_llama": Spec(),
    "fsdp_patched_no_reshard": Spec(scheme="qk_norm_cap", reshard=False),
    "fsdp_gpt2": Spec(family="gpt2", overrides={"n_embd": 30, "n_head": 3}, controls_first=True),
    "fsdp_lora": Spec(scheme="qk_norm_cap", lora=True, qk_lr=False, worlds=(2,)),  # QK-Clip: the trained norms
    "fsdp_muon": Spec(muon=True, worlds=(2,)),
    "fsdp_mixed": Spec(mixed=True, worlds=(2, 4)),
    "tp_patched": Spec(overrides=dict(TP_SHAPE), scheme="qk_norm_cap", shard="tp"),
    "tp_llama": Spec(overrides=dict(TP_SHAPE), shard="tp", worlds=(2,)),
}


def batches(steps: int = STEPS) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    return [torch.randint(0, VOCAB, (BATCH, SEQ), generator=g) for _ in range(steps)]


def _amplify(model) -> None:
    """Logits large enough for QK-Clip to act on some heads (not all): q/k projections scaled up by a factor that
    grows with the head, or (a normalised model) the shared norm gains scaled up."""
    with torch.no_grad():
        for name, p in unwrap(model).named_parameters():
            if "q_norm" in name or "k_norm" in name:
                p.mul_(3.0).add_(0.1)
            elif ("q_proj" in name or "k_proj" in name) and p.dim() == 2:
                p.mul_(torch.linspace(2.0, 9.0, p.shape[0], dtype=p.dtype)[:, None])
            elif "c_attn.weight" in name:
                e = p.shape[1] // 3
                p[:, : 2 * e].mul_(torch.linspace(2.0, 9.0, 2 * e, dtype=p.dtype)[None])


def build(spec: Spec):
    model = tiny_model(spec.family, dtype=torch.float32 if spec.mixed else torch.float64, seed=5, **spec.overrides)
    if spec.scheme:
        hf_qknorm.patch_model(model, spec.scheme, softcap=100.0)
    _amplify(model)
    if spec.lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(
            model,
            LoraConfig(
                target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                r=2,
                init_lora_weights=False,
                modules_to_save=["q_norm", "k_norm"],  # under LoRA QK-Clip acts through the trained norm copies
            ),
        )
    return model.train()


def tau_for(model) -> float:
    """The median of the initial per-head maxima on the first batch: some heads clip, some do not."""
    monitor = hf_qknorm.QKMonitor(model, sync=False)
    with torch.no_grad(), monitor.record():
        model(batches()[0])
    heads = torch.tensor([v for row in monitor.head_max_logits.values() for v in row])
    return float(heads.median())


def shard(model, spec: Spec, world: int):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh("cpu", (world,))
    if spec.shard == "tp":
        return hf_qknorm.parallelize_attention(model, mesh)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if spec.mixed else None
    kwargs = {"mesh": mesh, "reshard_after_forward": spec.reshard, **({"mp_policy": mp} if mp else {})}
    for block in find_layers(unwrap(model), family_of(model)):
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    return model


def optimizer(model, spec: Spec):
    if spec.muon:
        from hf_qknorm.training.muon import MuonAdamW

        return MuonAdamW(model, lr=0.02, adamw_lr=1e-2, weight_decay=0.1)
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.1)


def full_params(model) -> dict[str, torch.Tensor]:
    """Every parameter, whole (a collective for sharded ones: every rank calls it)."""
    out = {}
    for name, p in model.named_parameters():
        p = p.detach()
        out[name] = (p.full_tensor() if hasattr(p, "full_tensor") else p).clone()
    return out


@contextlib.contextmanager
def float64_newton_schulz(on: bool = True):
    """torch's Muon orthogonalises in bfloat16; sharded, its matmuls round differently from one process's. To test
    the sharding itself (not bf16 rounding), both sides run the same Newton-Schulz iteration in float64."""
    import torch.optim._muon as muon

    original = muon._zeropower_via_newtonschulz

    def ns64(grad, ns_coefficients, ns_steps, eps):
        a, b, c = ns_coefficients
        x = grad.double()
        if grad.size(0) > grad.size(1):
            x = x.T
        x = x / x.norm().clamp(min=eps)
        for _ in range(ns_steps):
            gram = x @ x.T
            x = a * x + (b * gram + c * gram @ gram) @ x
        return x.T if grad.size(0) > grad.size(1) else x

    if on:
        muon._zeropower_via_newtonschulz = ns64
    try:
        yield
    finally:
        muon._zeropower_via_newtonschulz = original


def _record(out, clip, monitor, qk, stats, clipped) -> None:
    out["clipped"].append(sorted((layer, head) for layer, head, *_ in clipped))
    out["gamma"].append({(layer, head): g for layer, head, _, g in clipped})
    out["S"].append(clip.last_maxima)
    out["monitor"].append(dict(stats))
    out["heads"].append({i: list(v) for i, v in monitor.head_max_logits.items()})
    if qk is not None:
        out["factors"].append([(fq.tolist(), fk.tolist()) for fq, fk in qk.last_factors])


def controls(model, tau: float, spec: Spec, initial_norms=None):
    """``(QKClip, QKMonitor, QKLearningRate or None)`` on ``model``."""
    qk = hf_qknorm.QKLearningRate(model, tau=0.7, initial_norms=initial_norms) if spec.qk_lr else None
    return hf_qknorm.QKClip(model, tau=tau, alpha=0.5), hf_qknorm.QKMonitor(model), qk


def train(model, opt, ctl, steps, out, *, rank=0, world=1, split=False, muon=False) -> None:
    """One optimizer step per ``(step, ids)`` of ``steps``, every control on, each step recorded into ``out``."""
    clip, monitor, qk = ctl
    with float64_newton_schulz(muon):
        for step, ids in steps:
            mine = ids[rank::world] if split else ids  # data parallel: each rank its slice of the batch
            with monitor.record(step) as stats:
                loss = model(mine, labels=mine).loss
            loss.backward()
            qk.step(opt) if qk is not None else opt.step()
            clipped = clip.step()
            opt.zero_grad()
            _record(out, clip, monitor, qk, stats, clipped)


def _empty_record(tau: float) -> dict:
    return {"tau": tau, "clipped": [], "gamma": [], "S": [], "monitor": [], "heads": [], "factors": []}


def run(name: str, rank: int = 0, world: int = 1, sharded: bool = False) -> dict:
    """Train ``STEPS`` steps of ``SPECS[name]`` with every control on; the record of what happened."""
    spec = SPECS[name]
    model = build(spec)
    tau = tau_for(model)
    ctl = controls(model, tau, spec) if spec.controls_first else None
    if sharded:
        model = shard(model, spec, world)
    opt = optimizer(model, spec)
    ctl = ctl or controls(model, tau, spec)
    out = _empty_record(tau)
    model.eval()
    with torch.no_grad():
        out["logits0"] = model(batches()[0]).logits.detach().clone()
    model.train()
    train(
        model,
        opt,
        ctl,
        enumerate(batches()),
        out,
        rank=rank,
        world=world,
        split=sharded and spec.shard == "fsdp",
        muon=spec.muon,
    )
    out["params"] = full_params(model)
    return out


def reference_mixed(name: str, world: int) -> dict:
    """What FSDP2 with ``MixedPrecisionPolicy(bf16 params, fp32 reduce)`` computes, in one process: each rank's
    slice runs forward and backward on a bf16 copy of the fp32 weights; the bf16 gradients, cast to fp32, are
    averaged over the slices; the optimizer and the controls act on the fp32 weights, QK-Clip with the maxima the
    bf16 forwards recorded."""
    spec = SPECS[name]
    master = build(spec)
    tau = tau_for(master)
    shadow = copy.deepcopy(master)
    for p in shadow.parameters():  # parameters only: FSDP2 leaves buffers (RoPE's inv_freq) in float32
        p.data = p.data.to(torch.bfloat16)
    opt = optimizer(master, spec)
    clip = hf_qknorm.QKClip(master, tau=tau, alpha=0.5)  # the master never runs a forward: it only clips
    seen = hf_qknorm.QKClip(shadow, tau=tau)  # records the bf16 forwards' maxima (never steps)
    qk = hf_qknorm.QKLearningRate(master, tau=0.7) if spec.qk_lr else None
    out = _empty_record(tau)
    for step, ids in enumerate(batches()):
        with torch.no_grad():
            for ps, pm in zip(shadow.parameters(), master.parameters()):
                ps.copy_(pm)
        grads = {n: torch.zeros_like(p) for n, p in master.named_parameters()}
        tops, heads = [], {}
        for r in range(world):
            monitor = hf_qknorm.QKMonitor(shadow, sync=False)
            with monitor.record(step) as stats:
                loss = shadow(ids[r::world], labels=ids[r::world]).loss
            loss.backward()
            for n, p in shadow.named_parameters():
                grads[n] += p.grad.float()
            shadow.zero_grad()
            tops.append(stats["qk/max_logit"])
            for i, v in monitor.head_max_logits.items():
                heads[i] = [max(a, b) for a, b in zip(heads.get(i, v), v)]
        for n, p in master.named_parameters():
            p.grad = grads[n] / world
        qk.step(opt) if qk is not None else opt.step()
        clip.maxima, seen.maxima = seen.maxima, [None] * len(seen.maxima)
        clipped = clip.step()
        opt.zero_grad()
        monitor.head_max_logits = heads
        _record(out, clip, monitor, qk, {"qk/max_logit": max(tops)}, clipped)
    out["params"] = full_params(master)
    return out


def report(folder: str, world: int) -> list[str]:
    """Markdown rows: the largest differences between the sharded runs a worker saved in ``folder``
    (``torchrun --nproc_per_node WORLD tests/training/test_sharded.py --worker FOLDER``) and one process."""
    rows = []
    for name, spec in SPECS.items():
        if world not in spec.worlds:
            continue
        ranks = [torch.load(f"{folder}/{name}.rank{r}.pt", weights_only=False) for r in range(world)]
        ref = reference_mixed(name, world) if spec.mixed else run(name)

        def worst(pairs):
            return max((abs(a - b) for a, b in pairs), default=float("nan"))

        weights = max(float((g["params"][k] - v).abs().max()) for g in ranks for k, v in ref["params"].items())
        maxima = worst(
            (a, b) for g in ranks for gs, rs in zip(g["S"], ref["S"]) for gl, rl in zip(gs, rs) for a, b in zip(gl, rl)
        )
        stats = worst((g["monitor"][i][k], r[k]) for g in ranks for i, r in enumerate(ref["monitor"]) for k in r)
        factors = worst(
            (a, b)
            for g in ranks
            for gs, rs in zip(g["factors"], ref["factors"])
            for gl, rl in zip(gs, rs)
            for a, b in zip(gl[0] + gl[1], rl[0] + rl[1])
        )
        same = all(g["clipped"] == ref["clipped"] for g in ranks)
        logits = float((ranks[0]["logits0"] - ref["logits0"]).abs().max()) if spec.shard == "tp" else float("nan")
        rows.append(
            f"| {world} | {name} | {weights:.1e} | {maxima:.1e} | {stats:.1e} | "
            f"{'equal' if same else 'DIFFERENT'} ({sum(len(c) for c in ref['clipped'])} head-steps) | "
            f"{factors:.1e} | {logits:.1e} |"
        )
    return rows


if __name__ == "__main__":  # python -m tests._support.sharded_runs OUT2 2 [OUT4 4]
    import sys

    torch.set_num_threads(1)
    print("| processes | run | weights | QK-Clip maxima | monitor | clipped heads | Q/K factors | TP logits |")
    print("|---|---|---|---|---|---|---|---|")
    for folder, world in zip(sys.argv[1::2], sys.argv[2::2]):
        print("\n".join(report(folder, int(world))))
