"""Calibrated initialisation of the norms that a conversion adds: the settings, and the optional end-to-end polish.

A freshly initialised norm makes a pretrained model forget what it knew: an identity LayerNorm hands attention
unit-variance queries and keys, so the logits shrink and attention goes nearly uniform. Calibration runs text
through the original model and sets the new norm parameters so that the converted model stays close to it:

1. **Layer by layer** (:mod:`hf_qknorm.conversion.calibration.layerwise`, always): the checkpoint is streamed one
   decoder block at a time; each layer's new norms get a per-channel least-squares closed form, then a fit of the
   patched attention layer's output to the original layer's output on the same calibration activations
   (:mod:`hf_qknorm.conversion.calibration.localfit`). Memory: one block plus the activations.
2. **End-to-end KL polish** (:func:`polish`, ``steps > 0``, for models that fit in memory): only the new norm
   parameters are trained, with Adam, to minimise the KL divergence between the original and the converted model's
   next-token distributions on the calibration text.

Perplexities on held-out text (never used for calibration) are reported for the original model, for identity init,
for the closed-form fit alone and for the final calibrated init. For capped schemes the largest logit of each layer
on the calibration text is recorded, with a warning when it reaches half the cap (where ``c * tanh(s / c)`` starts to
bend ``s`` noticeably: by 8% at ``s = c / 2``).
"""

from __future__ import annotations

import logging
import os
import time
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.nn import functional as F

from ...portable.families import text_runner
from ..orchestration.progress import Stage
from .optim import cosine_adam
from .stats import CalibrationReport, LayerStats, converted_max_logits

__all__ = ["CalibrationReport", "CalibrationSettings", "LayerStats", "distill", "new_norm_parameters", "polish"]

logger = logging.getLogger("hf_qknorm.conversion")


@dataclass
class CalibrationSettings:
    """How much text and how many steps calibration uses. The defaults finish a conversion of a 135M-parameter
    model (SmolLM2-135M, 30 layers) in a few minutes on a 2-core CPU and convert the bundled tiny model in seconds;
    the layer-wise pass needs memory for one decoder block plus the activations, whatever the model size."""

    # metadata["help"]: the command line's help for each field (`hf-qknorm convert`'s flags are made from these)
    block_len: int = field(
        default=256,
        metadata={"help": "tokens per calibration block, BOS included (capped at the model's context length)"},
    )
    calibration_blocks: int = field(
        default=16, metadata={"help": "blocks of calibration text read (statistics, layer-wise fit, distillation)"}
    )
    eval_blocks: int = field(default=16, metadata={"help": "held-out blocks for the perplexity report"})
    local_steps: int = field(
        default=100,
        metadata={
            "help": "Adam steps per layer fitting the new norms to the original attention layer's output, one "
            "calibration block per step; 0 keeps the least-squares fit"
        },
    )
    local_lr: float = field(default=0.1, metadata={"help": "layer-wise step size: relative change of a gain per step"})
    steps: int = field(
        default=0,
        metadata={
            "help": "Adam steps of end-to-end KL distillation of the new norm parameters after the layer-wise fit; "
            "loads the whole model (0: none)"
        },
    )
    batch_size: int = field(default=4, metadata={"help": "blocks per distillation step and per forward pass"})
    lr: float = field(default=0.3, metadata={"help": "distillation step size, relative to each tensor's initial RMS"})
    teacher_budget_mb: int = field(
        default=1024,
        metadata={
            "help": "memory (MiB) for the cached teacher log-probs of the distillation; fewer blocks if exceeded"
        },
    )
    seed: int = field(default=0, metadata={"help": "random seed of the distillation batches"})
    device: str = field(
        default="auto",
        metadata={"help": "where calibration runs: auto (CUDA when available, else CPU), cpu, cuda, cuda:1, ..."},
    )
    threads: int | None = field(
        default=None,
        metadata={
            "help": "CPU threads for calibration (default: 1 for models under 20M parameters, whose matrices gain "
            "nothing from more; torch's default otherwise)"
        },
    )
    agreement_tokens: int = field(
        default=16,
        metadata={
            "help": "after writing, compare the greedy answers of the written model with the original's on the bundled "
            "prompts (facts, arithmetic, code, instructions, chat turns) over this many new tokens; loads each "
            "whole model in float32 in turn; 0 skips it"
        },
    )

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
        for name in ("steps", "local_steps", "agreement_tokens"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        for name in ("lr", "local_lr"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")


# --------------------------------------------------------------------------------------------------------------------
# end-to-end KL distillation of the patched model (the optional polish)
# --------------------------------------------------------------------------------------------------------------------
def new_norm_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    """The parameters of the norms a patch added (``...q_norm.weight`` etc., wherever the scheme put them), by
    state-dict name."""
    out = {}
    for name, module in model.named_modules():
        for slot in module.__dict__.get("_qknorm_norms", {}).values():  # a patched attention module's norms
            prefix = f"{name}.{slot}" if name else slot
            out.update({f"{prefix}.{k}": prm for k, prm in module._modules[slot].named_parameters()})
    return out


def distill(
    model: nn.Module, blocks: torch.Tensor, teacher: torch.Tensor, settings: CalibrationSettings, progress: bool = True
) -> tuple[float, float]:
    """Train only the new norm parameters to match ``teacher`` (float16 log-probs ``(n_blocks, seq, vocab)``).

    Returns the mean KL (nats per token) on a fixed monitor batch before and after. Adam on tensors of very
    different scales: each parameter group's learning rate is ``settings.lr`` times the RMS of its initial value,
    and the rate decays with a cosine. The best parameters seen on the monitor batch are kept."""
    params = new_norm_parameters(model)
    frozen = [p for p in model.parameters() if p.requires_grad and all(p is not q for q in params.values())]
    for p in frozen:
        p.requires_grad_(False)
    for p in params.values():
        p.requires_grad_(True)
    gen = torch.Generator().manual_seed(settings.seed)
    monitor = torch.arange(min(len(blocks), settings.batch_size))
    run = text_runner(model)  # where text runs (BLIP-2: its language model), found once
    try:
        groups = [
            {"params": [p], "lr": settings.lr * max(p.detach().pow(2).mean().sqrt().item(), 1e-2)}
            for p in params.values()
        ]
        kl_start = _kl(run, blocks[monitor], teacher[monitor])
        best = [kl_start, {k: p.detach().clone() for k, p in params.items()}]  # the monitor KL and its parameters
        model.train(False)  # dropout off: distillation matches the deterministic model

        def loss(step):
            idx = torch.randint(0, len(blocks), (min(settings.batch_size, len(blocks)),), generator=gen)
            return _kl(run, blocks[idx], teacher[idx], grad=True)

        def tick(step, _):
            if (step + 1) % 25 == 0 or step + 1 == settings.steps:
                current = _kl(run, blocks[monitor], teacher[monitor])
                if current < best[0]:
                    best[:] = current, {k: p.detach().clone() for k, p in params.items()}
                stage.update(0, note=f"monitor KL {current:.4f} (start {kl_start:.4f})")
            stage.update(1)

        with Stage("KL distillation", settings.steps, "steps", progress) as stage:
            cosine_adam(groups, settings.steps, loss, tick)
        with torch.no_grad():
            for k, p in params.items():
                p.copy_(best[1][k])
        return kl_start, best[0]
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


@torch.no_grad()
def teacher_log_probs(
    model: nn.Module,
    blocks: torch.Tensor,
    batch_size: int,
    progress: bool = True,
    desc: str = "running the original model",
) -> torch.Tensor:
    """Float16 next-token log-probabilities ``(n_blocks, seq, vocab)`` of ``model`` on ``blocks``."""
    out, run = [], text_runner(model)
    with Stage(desc, len(blocks), "blocks", progress) as stage:
        for start in range(0, len(blocks), batch_size):
            logits = run(input_ids=blocks[start : start + batch_size].to(_device(model))).logits.float()
            out.append(F.log_softmax(logits, dim=-1).to(torch.float16).cpu())  # the cache lives in host memory
            stage.update(min(batch_size, len(blocks) - start))
    return torch.cat(out)


def polish(
    src,
    family,
    cfg,
    values: dict,
    calib_blocks: torch.Tensor,
    eval_blocks: torch.Tensor,
    settings: CalibrationSettings,
    report: CalibrationReport,
    progress: bool = True,
) -> dict:
    """End-to-end KL distillation from the layer-wise ``values``, on the whole model loaded from ``src`` in float32
    (needs the model, plus its log-probabilities on the calibration text, in memory). Updates ``report`` (KL,
    calibrated perplexity, converted max logits) and returns the polished values."""
    from ...data import perplexity
    from ...modeling.patch import patch_model
    from ..output.shards import load_pretrained

    t0 = time.time()
    model = load_pretrained(src, dtype=torch.float32).to(settings.resolved_device()).eval()
    bs = settings.batch_size
    per_block = calib_blocks.shape[1] * model.config.get_text_config().vocab_size * 2
    n_teacher = max(1, min(len(calib_blocks), settings.teacher_budget_mb * 2**20 // per_block))
    teacher = teacher_log_probs(model, calib_blocks[:n_teacher], bs, progress)
    patch_model(model, cfg)
    params = new_norm_parameters(model)
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(values[name])
    report.kl_start, report.kl_end = distill(model, calib_blocks[:n_teacher], teacher, settings, progress)
    report.steps = settings.steps
    report.ppl_calibrated = perplexity(model, eval_blocks, batch_size=bs)
    report.warnings.clear()
    converted_max_logits(model, family, calib_blocks, report, bs)
    report.seconds += time.time() - t0
    return {k: p.detach().float().cpu().clone() for k, p in params.items()}


SMALL_CPU_MODEL = 20_000_000  # parameters


def idle_cores() -> int | None:
    """CPU cores not kept busy by other processes (the CPU count minus the 1-minute load average), or ``None``
    where the load average is unknown."""
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):
        return None
    return max(1, int((os.cpu_count() or 1) - load + 0.5))


@contextmanager
def calibration_threads(n_params: int, device: torch.device, threads: int | None):
    """Intra-op threads during calibration. ``None``: on CPU, one thread for models under ``SMALL_CPU_MODEL``
    parameters -- their matrices are too small to gain from more -- and otherwise torch's default capped at the
    cores other processes leave idle: a thread that has to share its core with a busy process stalls every
    parallel region of the others (on a 2-core VM with one busy core, SmolLM2-135M calibrated about 4x slower with
    two threads than with one)."""
    before = torch.get_num_threads()
    if threads is None and device.type == "cpu":
        idle = idle_cores()
        threads = 1 if n_params < SMALL_CPU_MODEL else min(before, idle if idle is not None else before)
    if threads is not None:
        torch.set_num_threads(threads)
    logger.debug("calibration threads: %d", torch.get_num_threads())
    try:
        yield
    finally:
        torch.set_num_threads(before)
