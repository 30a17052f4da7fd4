"""Shared machinery of the evidence recipes (``lr_sweep.py``, ``lp_sweep.py``, ``conversion_recovery.py``).

One training run = one small Llama built from a ``LlamaConfig``, patched with :func:`hf_qknorm.patch_model` (or left
plain for the baseline and the architecture-preserving arms: the Q/K learning-rate rule,
:class:`hf_qknorm.QKLearningRate`,
and QK-Clip, :class:`hf_qknorm.QKClip`), trained on character-level text with AdamW (or Muon on the hidden matrices,
:class:`hf_qknorm.training.muon.MuonAdamW`) and a z-loss as in Wortsman et al. 2023 (arXiv:2309.14322), and measured
along the way:

* validation loss (fixed held-out blocks),
* the largest attention logit per layer, ``max scaling * q.k`` over causal pairs, pre-cap, with ``q``/``k``
  post-norm and post-RoPE, and the attention entropy, both measured by :class:`hf_qknorm.QKMonitor`;
* the output RMS of the QKV projections, the attention output projection and the second MLP layer (the layers
  whose outputs grow before divergence in Rybakov et al. 2024).

Each run writes one JSON file; a run whose file exists is skipped, so sweeps resume where they stopped.
Everything runs in float32 on one CPU thread per process.
"""

from __future__ import annotations

import os

# oneDNN's AMX bf16 kernels trap on some virtual machines; must be set before torch first uses oneDNN.
os.environ.setdefault("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_BF16")

import json
import math
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a clone without installing
import hf_qknorm
from hf_qknorm.data import read_text, split_text


class Arm(NamedTuple):
    """One arm of the sweep: what is patched and how the model is optimised."""

    scheme: str | None  # patch_model scheme, or None (the architecture stays as it is)
    patch: dict  # patch_model settings
    qk_lr: bool = False  # Anson & Aitchison's per-head Q/K learning rates (QKLearningRate)
    qk_clip: bool = False  # Kimi K2's QK-Clip after every step (QKClip)
    optimizer: str = "adamw"  # "adamw", or "muon" (Muon on the hidden matrices, AdamW on the rest)


SCHEMES: dict[str, Arm] = {
    "baseline": Arm(None, {}),
    "soft_cap": Arm("soft_cap", {}),
    "qk_norm": Arm("qk_norm", {"norm": "layernorm"}),
    "qk_norm_cap": Arm("qk_norm_cap", {"norm": "layernorm"}),
    "qkv_norm": Arm("qkv_norm", {"norm": "layernorm"}),
    "lp4": Arm("qk_norm", {"norm": "lp", "p": 4.0}),
    "qk_lr": Arm(None, {}, qk_lr=True),
    "qk_clip": Arm(None, {}, qk_clip=True),
    "muon": Arm(None, {}, optimizer="muon"),
    "muon_qk_clip": Arm(None, {}, qk_clip=True, optimizer="muon"),
    "muon_qk_lr": Arm(None, {}, qk_lr=True, optimizer="muon"),
}


@dataclass
class RunConfig:
    scheme: str = "baseline"
    lr: float = 1e-2
    seed: int = 0
    steps: int = 500
    warmup: int = 50
    batch_size: int = 16
    context: int = 128
    layers: int = 4
    hidden: int = 128
    heads: int = 4
    min_lr: float = 1e-5  # cosine floor (Wortsman et al.: 1e-5)
    weight_decay: float = 1e-4  # independent decay: theta -= lambda * theta per step scaled by schedule/peak
    z_loss: float = 1e-4
    grad_clip: float = 1.0
    eval_every: int = 50
    eval_blocks: int = 32  # held-out blocks for the periodic evaluations
    final_eval_blocks: int = 256  # held-out blocks for the final evaluation
    probe_every: int = 25  # steps between logit / RMS measurements
    text: str = "tinyshakespeare"
    p: float | None = None  # overrides the Lp exponent of an lp scheme (lp_sweep.py)
    qk_lr_tau: float = 1.0
    qk_clip_tau: float = 100.0  # Kimi K2's threshold
    extra: dict = field(default_factory=dict)

    def tag(self) -> str:
        p = "" if self.p is None else f"_p{self.p:g}"
        return f"{self.scheme}{p}_lr{self.lr:.4g}_s{self.seed}"


# ------------------------------------------------------------------------------------------------------------------
# data: character-level, as in nanoGPT's shakespeare_char and the Lp-QKNorm paper
# ------------------------------------------------------------------------------------------------------------------
_DATA_CACHE: dict = {}


def char_data(text_name: str, context: int):
    """``(train_ids, val_blocks, vocab_size)``: char ids of the training 90% and ``(n, context)`` held-out blocks."""
    key = (text_name, context)
    if key not in _DATA_CACHE:
        text = read_text(text_name)
        chars = sorted(set(text))
        stoi = {c: i for i, c in enumerate(chars)}
        train, val = split_text(text, 0.1)
        train_ids = torch.tensor([stoi[c] for c in train], dtype=torch.long)
        val_ids = torch.tensor([stoi[c] for c in val], dtype=torch.long)
        n = (len(val_ids) - 1) // context
        val_blocks = val_ids[: n * context].view(n, context)
        _DATA_CACHE[key] = (train_ids, val_blocks, len(chars))
    return _DATA_CACHE[key]


def random_batch(train_ids: torch.Tensor, batch: int, context: int, gen: torch.Generator) -> torch.Tensor:
    starts = torch.randint(0, len(train_ids) - context, (batch,), generator=gen)
    return torch.stack([train_ids[s : s + context] for s in starts.tolist()])


# ------------------------------------------------------------------------------------------------------------------
# model
# ------------------------------------------------------------------------------------------------------------------
def build_model(cfg: RunConfig, vocab: int):
    """A small Llama from config (MHA, untied embeddings, no biases), patched per ``cfg.scheme``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(cfg.seed)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=cfg.hidden,
        intermediate_size=4 * cfg.hidden,
        num_hidden_layers=cfg.layers,
        num_attention_heads=cfg.heads,
        num_key_value_heads=cfg.heads,
        head_dim=cfg.hidden // cfg.heads,
        max_position_embeddings=cfg.context,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        attn_implementation="sdpa",
    )
    model = LlamaForCausalLM(config)
    apply_scheme(model, cfg.scheme, cfg.p)
    return model


def apply_scheme(model, scheme: str, p: float | None = None):
    patch_scheme, kwargs = SCHEMES[scheme].scheme, SCHEMES[scheme].patch
    if patch_scheme is not None:
        kwargs = dict(kwargs)
        if p is not None:
            kwargs["p"] = float(p)
        hf_qknorm.patch_model(model, patch_scheme, **kwargs)
    return model


# ------------------------------------------------------------------------------------------------------------------
# measurements
# ------------------------------------------------------------------------------------------------------------------
class Monitor:
    """Records, on demand, per layer: the largest attention logit and attention entropy (measured by the library's
    :class:`hf_qknorm.QKMonitor`, pre-cap, post-norm, post-RoPE) and the output RMS of QKV / o_proj / down_proj."""

    def __init__(self, model):
        self.model = model
        self.qk = hf_qknorm.QKMonitor(model)  # its alerts (logit growth, saturated cap) are kept in the run record
        self.stats: dict[str, float] = {}
        self.rms: dict[str, dict[int, float]] = {"qkv": {}, "proj": {}, "fc2": {}}
        self._handles = []
        self._sq: dict[int, list] = {}

    def _rms_hook(self, kind, idx):
        def hook(module, inputs, output):
            o = output.detach().float()
            if kind == "qkv":  # q, k, v outputs pooled: the RMS of the concatenated QKV output
                acc = self._sq.setdefault(idx, [0.0, 0])
                acc[0] += float(o.pow(2).sum())
                acc[1] += o.numel()
                self.rms["qkv"][idx] = math.sqrt(acc[0] / acc[1])
            else:
                self.rms[kind][idx] = float(o.pow(2).mean().sqrt())

        return hook

    def at(self, step: int) -> Monitor:
        """Use as ``with monitor.at(step):`` so alerts name the step."""
        self.step = step
        return self

    def __enter__(self):
        self.stats, self._sq = {}, {}
        self.rms = {"qkv": {}, "proj": {}, "fc2": {}}
        self.qk.start()
        for i, layer in enumerate(self.model.model.layers):
            attn = layer.self_attn
            for name in ("q_proj", "k_proj", "v_proj"):
                self._handles.append(getattr(attn, name).register_forward_hook(self._rms_hook("qkv", i)))
            self._handles.append(attn.o_proj.register_forward_hook(self._rms_hook("proj", i)))
            self._handles.append(layer.mlp.down_proj.register_forward_hook(self._rms_hook("fc2", i)))
        return self

    def __exit__(self, *exc):
        for h in self._handles:
            h.remove()
        self._handles = []
        self.stats = self.qk.stop(getattr(self, "step", None))

    def snapshot(self) -> dict:
        n = len(self.model.model.layers)
        layer = lambda i, name: self.stats.get(f"qk/layer{i}/{name}")
        return {
            "max_logit": [layer(i, "max_logit") for i in range(n)],
            "entropy": [layer(i, "entropy") for i in range(n)],
            **{f"rms_{k}": [v.get(i) for i in range(n)] for k, v in self.rms.items()},
        }


# ------------------------------------------------------------------------------------------------------------------
# optimisation
# ------------------------------------------------------------------------------------------------------------------
def lr_at(step: int, cfg: RunConfig) -> float:
    """Linear warmup to ``cfg.lr``, then cosine to ``min(cfg.min_lr, cfg.lr)`` (Wortsman et al.)."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    floor = min(cfg.min_lr, cfg.lr)
    progress = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return floor + (cfg.lr - floor) * 0.5 * (1 + math.cos(math.pi * progress))


def make_optimizer(model, cfg: RunConfig) -> torch.optim.Optimizer:
    """AdamW (0.9, 0.95), eps 1e-8. Decay on matrices only, *independent* of the LR as in Wortsman et al.:
    torch's decoupled decay multiplies by lr, so ``weight_decay = lambda / peak_lr`` gives ``lambda * schedule``.

    Muon arms: ``torch.optim.Muon`` on the hidden matrices with ``adjust_lr_fn="match_rms_adamw"`` (Moonlight /
    Kimi K2: each update's RMS matches AdamW's, so one LR grid serves both optimizers; momentum 0.95, Nesterov), and
    the same AdamW on embeddings, output head and vectors; the same independent decay."""
    if SCHEMES[cfg.scheme].optimizer == "muon":
        from hf_qknorm.training.muon import MuonAdamW

        return MuonAdamW(
            model,
            lr=cfg.lr,
            weight_decay=cfg.weight_decay / cfg.lr,
            muon_kwargs={"adjust_lr_fn": "match_rms_adamw"},
            adamw_kwargs={"betas": (0.9, 0.95), "eps": 1e-8},
        )
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay / cfg.lr}, {"params": rest, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8)


def lm_loss(logits: torch.Tensor, ids: torch.Tensor, z_loss: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Next-token cross-entropy and ``ce + z_loss * mean(logsumexp^2)`` (Wortsman et al.'s output z-loss)."""
    logits = logits[:, :-1].float().reshape(-1, logits.shape[-1])
    targets = ids[:, 1:].reshape(-1)
    ce = F.cross_entropy(logits, targets)
    z = torch.logsumexp(logits, dim=-1).pow(2).mean()
    return ce, ce + z_loss * z


@torch.no_grad()
def evaluate(model, blocks: torch.Tensor, batch: int = 32) -> float:
    model.eval()
    total, n = 0.0, 0
    for s in range(0, blocks.shape[0], batch):
        ids = blocks[s : s + batch]
        ce, _ = lm_loss(model(input_ids=ids).logits, ids, 0.0)
        total += float(ce) * ids.shape[0]
        n += ids.shape[0]
    model.train()
    return total / n


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None


def train_run(cfg: RunConfig, model=None, log=None) -> dict:
    """Train one run and return its record (config, curves, final validation loss, wall time)."""
    torch.set_num_threads(1)
    train_ids, val_blocks, vocab = char_data(cfg.text, cfg.context)
    model = build_model(cfg, vocab) if model is None else model
    model.train()
    opt = make_optimizer(model, cfg)
    arm = SCHEMES[cfg.scheme]
    rule = hf_qknorm.QKLearningRate(model, tau=cfg.qk_lr_tau) if arm.qk_lr else None
    clip = hf_qknorm.QKClip(model, tau=cfg.qk_clip_tau) if arm.qk_clip else None
    gen = torch.Generator().manual_seed(1000 + cfg.seed)
    eval_set = val_blocks[: cfg.eval_blocks]
    rec = {"config": asdict(cfg), "train": [], "val": [], "probe": []}
    mon = Monitor(model)
    rec["val"].append([0, evaluate(model, eval_set)])
    t0, nonfinite = time.time(), False
    for step in range(cfg.steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(step, cfg)
        ids = random_batch(train_ids, cfg.batch_size, cfg.context, gen)
        measure = step % cfg.probe_every == 0 or step == cfg.steps - 1
        if measure:
            with mon.at(step):
                logits = model(input_ids=ids).logits
            rec["probe"].append({"step": step, **mon.snapshot()})
        else:
            logits = model(input_ids=ids).logits
        ce, loss = lm_loss(logits, ids, cfg.z_loss)
        if not torch.isfinite(loss):
            nonfinite = True
            rec["train"].append([step, None])
            break
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        if rule is not None:
            rule.step(opt)  # Anson & Aitchison's per-head W_Q / W_K learning rates around the optimizer's step
        else:
            opt.step()
        if clip is not None:
            clip.step()  # QK-Clip: heads whose largest logit passed tau are rescaled after the step
        if step % 10 == 0:
            rec["train"].append([step, float(ce.detach()), _finite(float(gnorm))])
        if (step + 1) % cfg.eval_every == 0 and step + 1 < cfg.steps:
            v = evaluate(model, eval_set)
            rec["val"].append([step + 1, _finite(v)])
            if log:
                log(f"{cfg.tag()} step {step + 1} val {v:.4f} ({time.time() - t0:.0f}s)")
    final = float("nan") if nonfinite else evaluate(model, val_blocks[: cfg.final_eval_blocks])
    rec["val"].append([cfg.steps, _finite(final)])
    rec["alerts"] = [{k: a[k] for k in ("step", "layer", "kind", "max_logit")} for a in mon.qk.alerts]
    if clip is not None:
        rec["qk_clip"] = {"tau": clip.tau, "clipped_steps": clip.clipped_steps, "steps": clip.steps}
    rec.update(
        final_val=_finite(final),
        init_val=rec["val"][0][1],
        nonfinite=nonfinite,
        wall_s=round(time.time() - t0, 1),
        versions={"torch": torch.__version__, "hf_qknorm": getattr(hf_qknorm, "__version__", "?")},
    )
    return rec


def run_job(cfg: RunConfig, out_dir: str | Path) -> str:
    """Run ``cfg`` unless its result file exists; write it atomically. Returns the file path."""
    out = Path(out_dir) / f"{cfg.tag()}.json"
    if out.exists():
        return str(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    rec = train_run(cfg)
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(rec, allow_nan=False))
    os.replace(tmp, out)
    return str(out)


def _worker_init():
    torch.set_num_threads(1)


def run_jobs(cfgs: list[RunConfig], out_dir: str | Path, workers: int = 2) -> None:
    """Run the jobs whose results are missing, ``workers`` processes with one thread each."""
    import concurrent.futures as cf
    import multiprocessing as mp

    todo = [c for c in cfgs if not (Path(out_dir) / f"{c.tag()}.json").exists()]
    print(f"{len(cfgs) - len(todo)} of {len(cfgs)} runs done; running {len(todo)} on {workers} workers", flush=True)
    if workers <= 1:
        for c in todo:
            t = time.time()
            run_job(c, out_dir)
            print(f"done {c.tag()} {time.time() - t:.0f}s", flush=True)
        return
    with cf.ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn"), initializer=_worker_init) as ex:
        futs = {ex.submit(run_job, c, out_dir): c for c in todo}
        for f in cf.as_completed(futs):
            c = futs[f]
            try:
                f.result()
                print(f"done {c.tag()}", flush=True)
            except Exception as err:  # one failed run must not stop the sweep
                print(f"FAILED {c.tag()}: {err!r}", flush=True)


def load_runs(out_dir: str | Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(Path(out_dir).glob("*.json"))]
