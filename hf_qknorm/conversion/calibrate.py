"""Calibrated initialisation of the norms that a conversion adds, and the statistics behind it.

A freshly initialised norm makes a pretrained model forget what it knew: an identity LayerNorm hands attention
unit-variance queries and keys, so the logits shrink and attention goes nearly uniform. :func:`calibrate` runs
calibration text through the original model, records per-layer and per-head statistics of q, k and v **before
RoPE** (the point where the norms sit), patches the model and initialises the new norm parameters in two steps:

1. Closed form. The norm maps its input ``x`` (the projection output) to ``w * n(x) + b``, where ``n`` is the
   parameter-free part (centre and scale for ``layernorm``, scale for ``rmsnorm``, divide by ``||x||_p`` for
   ``lp``). Per channel, pooled over heads and tokens because the parameters are shared by all heads, ``w`` and ``b``
   are the least-squares fit of the original activations ``y`` on ``n(x)``. For ``l2``/``lp`` the query norm's logit
   scale ``g`` starts at ``scaling * E||q||_p * E||k||_p``, so that ``g * q_hat . k_hat`` matches ``scaling * q . k``
   on average.
2. Distillation. Only the new norm parameters (and the logit scale) are trained, with Adam, to minimise the KL
   divergence between the original and the converted model's next-token distributions on the calibration text --
   a few thousand parameters, so a few hundred small steps are cheap. This fixes what a per-channel fit cannot see:
   the per-token norms that the norm removes and the interaction between layers.

Perplexities on held-out text (never used for calibration) are reported for the original model, for identity init,
for the closed-form fit alone and for the final calibrated init. For capped schemes the largest logit of each layer
on the calibration text is recorded, with a warning when it reaches half the cap (where ``c * tanh(s / c)`` starts to
bend ``s`` noticeably: by 8% at ``s = c / 2``).
"""

from __future__ import annotations

import math
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from .stats import ActivationRecorder, CalibrationReport, LayerStats, converted_max_logits
from ..modeling.families import Family
from ..modeling.norms import NORM_CLASSES, HeadLayerNorm, HeadLpNorm, HeadRMSNorm
from ..modeling.layout import find_layers
from ..modeling.patch import patch_model
from ..modeling.schemes import QKNormConfig

__all__ = ["CalibrationReport", "CalibrationSettings", "LayerStats", "calibrate", "closed_form_init", "distill",
           "new_norm_parameters"]


@dataclass
class CalibrationSettings:
    """How much text and how many steps calibration uses (the defaults suit models up to a few billion
    parameters on one GPU, and the bundled tiny model in about a minute on a CPU)."""

    block_len: int = 256          # tokens per block (BOS included)
    calibration_blocks: int = 64  # blocks of calibration text read (statistics and distillation)
    eval_blocks: int = 256        # held-out blocks for the perplexity report (all of the bundled held-out text)
    steps: int = 200              # Adam steps of distillation; 0 keeps the closed-form fit
    batch_size: int = 4           # blocks per distillation step (and per forward pass when measuring)
    lr: float = 0.3               # relative step size: each tensor moves by about lr * its initial RMS per step
    teacher_budget_mb: int = 1024  # memory for the cached teacher log-probs (float16); fewer blocks if exceeded
    seed: int = 0
    device: str = "auto"          # where calibration runs: "auto" (CUDA when available), "cpu", "cuda:1", ...
    threads: int | None = None    # CPU threads; None: 1 for small models on CPU, torch's default otherwise

    def resolved_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def __post_init__(self):
        for name in ("block_len", "calibration_blocks", "eval_blocks", "batch_size"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)!r}")
        if self.block_len < 2:
            raise ValueError(f"block_len must be >= 2, got {self.block_len}")
        if self.steps < 0:
            raise ValueError(f"steps must be >= 0, got {self.steps}")
        if not self.lr > 0:
            raise ValueError(f"lr must be positive, got {self.lr}")


# --------------------------------------------------------------------------------------------------------------------
# closed-form init and distillation of the patched model
# --------------------------------------------------------------------------------------------------------------------
def closed_form_init(model: nn.Module, family: Family, cfg: QKNormConfig, recorder: ActivationRecorder) -> None:
    """Set every new norm of the patched ``model`` from the recorded least-squares statistics."""
    with torch.no_grad():
        for attn, moments in zip((getattr(b, family.attention) for b in find_layers(model, family)),
                                 recorder.moments):
            for role in "qkv":
                norm = getattr(attn, f"{role}_norm", None)
                if norm is None or not moments[role].count:
                    continue
                _init_norm(norm, role, moments, float(attn.scaling))


def _init_norm(norm: nn.Module, role: str, moments: dict, scaling: float) -> None:
    if isinstance(norm, HeadLayerNorm):
        w, b = moments[role].fit(intercept=True)
        norm.weight.copy_(w)
        norm.bias.copy_(b)
    elif isinstance(norm, HeadRMSNorm):
        norm.weight.copy_(moments[role].fit(intercept=False)[0])
    elif isinstance(norm, HeadLpNorm) and norm.scale == "channel":
        norm.weight.copy_(moments[role].fit(intercept=False)[0])
    elif isinstance(norm, HeadLpNorm) and norm.scale == "logit":
        mq, mk = moments["q"], moments["k"]
        norm.weight.fill_(scaling * (mq.norm_p_sum / mq.count) * (mk.norm_p_sum / mk.count))


def new_norm_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    """The parameters of the norms a patch added (``...q_norm.weight`` etc.), by state-dict name."""
    out = {}
    for name, module in model.named_modules():
        if isinstance(module, NORM_CLASSES) and name.rsplit(".", 1)[-1] in ("q_norm", "k_norm", "v_norm"):
            out.update({f"{name}.{k}": prm for k, prm in module.named_parameters()})
    return out


def distill(model: nn.Module, blocks: torch.Tensor, teacher: torch.Tensor, settings: CalibrationSettings,
            progress: bool = True) -> tuple[float, float]:
    """Train only the new norm parameters to match ``teacher`` (float16 log-probs ``(n_blocks, seq, vocab)``).

    Returns the mean KL (nats per token) on a fixed monitor batch before and after. Adam on tensors of very
    different scales: each parameter group's learning rate is ``settings.lr`` times the RMS of its initial value,
    and the rate decays with a cosine. The best parameters seen on the monitor batch are kept."""
    params = new_norm_parameters(model)
    frozen = [p for p in model.parameters() if p.requires_grad and all(p is not q for q in params.values())]
    for p in frozen:
        p.requires_grad_(False)
    gen = torch.Generator().manual_seed(settings.seed)
    monitor = torch.arange(min(len(blocks), settings.batch_size))
    try:
        groups = [{"params": [p], "lr": settings.lr * max(p.detach().pow(2).mean().sqrt().item(), 1e-2)}
                  for p in params.values()]
        for g in groups:
            g["base_lr"] = g["lr"]
        opt = torch.optim.Adam(groups, betas=(0.9, 0.99))
        kl_start = best = _kl(model, blocks[monitor], teacher[monitor])
        best_state = {k: p.detach().clone() for k, p in params.items()}
        model.train(False)  # dropout off: distillation matches the deterministic model
        bar = _progress(range(settings.steps), "calibrating (KL distillation)", progress)
        for step in bar:
            for g in opt.param_groups:
                g["lr"] = g["base_lr"] * 0.5 * (1 + math.cos(math.pi * step / max(1, settings.steps)))
            idx = torch.randint(0, len(blocks), (min(settings.batch_size, len(blocks)),), generator=gen)
            loss = _kl(model, blocks[idx], teacher[idx], grad=True)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            if (step + 1) % 25 == 0 or step + 1 == settings.steps:
                current = _kl(model, blocks[monitor], teacher[monitor])
                if current < best:
                    best, best_state = current, {k: p.detach().clone() for k, p in params.items()}
                if hasattr(bar, "set_postfix"):
                    bar.set_postfix(kl=f"{current:.4f}")
        with torch.no_grad():
            for k, p in params.items():
                p.copy_(best_state[k])
        return kl_start, best
    finally:
        for p in frozen:
            p.requires_grad_(True)


def _device(model) -> torch.device:
    return next(model.parameters()).device


def _kl(model, ids, teacher, grad: bool = False):
    device = _device(model)
    with torch.set_grad_enabled(grad):
        logq = F.log_softmax(model(input_ids=ids.to(device)).logits.float(), dim=-1)
        logp = teacher.to(device).float()
        kl = (logp.exp() * (logp - logq)).sum(-1).mean()
    return kl if grad else kl.item()


def _progress(iterable, desc: str, enabled: bool):
    if not enabled:
        return iterable
    from tqdm.auto import tqdm

    return tqdm(iterable, desc=desc, leave=False, file=sys.stderr, disable=None)  # None: off when not a TTY


@torch.no_grad()
def teacher_log_probs(model: nn.Module, blocks: torch.Tensor, batch_size: int, progress: bool = True,
                      desc: str = "running the original model") -> torch.Tensor:
    """Float16 next-token log-probabilities ``(n_blocks, seq, vocab)`` of ``model`` on ``blocks``."""
    out = []
    for start in _progress(range(0, len(blocks), batch_size), desc, progress):
        logits = model(input_ids=blocks[start:start + batch_size].to(_device(model))).logits.float()
        out.append(F.log_softmax(logits, dim=-1).to(torch.float16).cpu())  # the cache lives in host memory
    return torch.cat(out)


@torch.no_grad()
def perplexity(model: nn.Module, blocks: torch.Tensor, batch_size: int = 8) -> float:
    """Token perplexity on ``blocks`` (every position but the first of each block is a target)."""
    from ..data import perplexity as _ppl

    return _ppl(model, blocks, batch_size=batch_size)


# --------------------------------------------------------------------------------------------------------------------
# the whole procedure
# --------------------------------------------------------------------------------------------------------------------
def calibrate(model: nn.Module, family: Family, cfg: QKNormConfig, calib_blocks: torch.Tensor,
              eval_blocks: torch.Tensor, settings: CalibrationSettings | None = None,
              progress: bool = True) -> CalibrationReport:
    """Patch the unpatched ``model`` in place with ``cfg`` and initialise its new norms from ``calib_blocks``.

    ``calib_blocks`` and ``eval_blocks`` are ``(n_blocks, block_len)`` token ids; the perplexity report is on
    ``eval_blocks`` only. Returns the :class:`CalibrationReport`.
    """
    settings = settings or CalibrationSettings()
    with _threads(model, settings.threads):
        return _calibrate(model, family, cfg, calib_blocks, eval_blocks, settings, progress)


SMALL_CPU_MODEL = 20_000_000  # parameters


@contextmanager
def _threads(model: nn.Module, threads: int | None):
    """Intra-op threads during calibration. ``None``: one thread for models under ``SMALL_CPU_MODEL`` parameters
    on CPU -- their matrices are too small to gain from more, and on a busy machine extra threads spin (the bundled
    model calibrated 20-50x slower with two threads than with one on a loaded 2-core VM); torch's default otherwise."""
    before = torch.get_num_threads()
    if threads is None and _device(model).type == "cpu" \
            and sum(p.numel() for p in model.parameters()) < SMALL_CPU_MODEL:
        threads = 1
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _calibrate(model, family, cfg, calib_blocks, eval_blocks, settings, progress) -> CalibrationReport:
    t0 = time.time()
    model.eval()
    bs = settings.batch_size
    per_block = calib_blocks.shape[1] * model.config.get_text_config().vocab_size * 2
    n_teacher = max(1, min(len(calib_blocks), settings.teacher_budget_mb * 2**20 // per_block))
    ppl_original = perplexity(model, eval_blocks, bs)
    recorder = ActivationRecorder(model, family, cfg)
    with recorder:
        teacher = teacher_log_probs(model, calib_blocks[:n_teacher], bs, progress)
        if n_teacher < len(calib_blocks):  # statistics see every block, the cached teacher only the first ones
            teacher_log_probs(model, calib_blocks[n_teacher:], bs, progress, "collecting statistics")
    layers = recorder.layer_stats()
    patch_model(model, cfg.scheme, norm=cfg.norm if cfg.norms_qk else None, softcap=cfg.softcap, eps=cfg.eps,
                p=cfg.p)
    ppl_identity = perplexity(model, eval_blocks, bs)
    kl_start = kl_end = None
    if cfg.norms_qk:
        closed_form_init(model, family, cfg, recorder)
    ppl_ls = perplexity(model, eval_blocks, bs) if cfg.norms_qk else ppl_identity
    if cfg.norms_qk and settings.steps > 0:
        kl_start, kl_end = distill(model, calib_blocks[:n_teacher], teacher, settings, progress)
    ppl_cal = perplexity(model, eval_blocks, bs) if kl_end is not None else ppl_ls
    report = CalibrationReport(
        scheme=cfg.to_dict(), ppl_original=ppl_original, ppl_identity=ppl_identity, ppl_least_squares=ppl_ls,
        ppl_calibrated=ppl_cal, calibration_tokens=calib_blocks.numel(), eval_tokens=eval_blocks[:, 1:].numel(),
        steps=settings.steps if cfg.norms_qk else 0, kl_start=kl_start, kl_end=kl_end, seconds=0.0,
        layers=layers, cap=cfg.softcap)
    converted_max_logits(model, family, calib_blocks, report, bs)
    report.seconds = time.time() - t0
    return report
