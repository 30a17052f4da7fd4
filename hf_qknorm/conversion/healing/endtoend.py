"""The end-to-end stage of healing (``HealSettings.end_to_end_tokens > 0``): every attention layer trained at once.

The layer-wise stage (:mod:`hf_qknorm.conversion.healing.heal`) fits each layer on the original's activations, so the
small error each layer keeps moves the next layer's inputs and compounds over depth. This stage distils the whole
converted model from the original by the KL divergence of their next-token distributions. It loads both models whole;
with a process group of more than one rank :func:`hf_qknorm.convert` runs it on rank 0 alone and broadcasts the result.
"""

from __future__ import annotations

import math
import time

import torch
from torch.nn import functional as F

from ...portable.families import text_runner
from ..calibration.optim import cosine_adam, scaled_groups
from ..orchestration.progress import Stage
from .heal import HealReport, HealSettings, lr_scales

__all__ = ["end_to_end"]


def end_to_end(
    src,
    family,
    cfg,
    values: dict,
    blocks: torch.Tensor,
    eval_blocks: torch.Tensor,
    settings: HealSettings,
    report: HealReport,
    device: torch.device,
    progress: bool = True,
) -> dict:
    """After the layer-wise stage: every attention layer's parameters (projections and norms) trained at once, by
    Adam on the KL divergence from the original's next-token distribution to the converted model's, one heal block
    per step. The layer-wise stage fits each layer on the original's activations, so the small error each layer
    keeps moves the next layer's inputs and compounds over depth; this stage sees the whole model.

    Loads the original (the teacher, frozen) and the converted model (built from the source, patched, given
    ``values``) whole, in float32 on ``device``; the teacher's log-probabilities are computed as the steps go, never
    cached, so memory is two models and one block's activations. The trained weights are kept only if they lower the
    KL on a fixed batch of heal text. Updates ``report`` (``end_to_end``; ``ppl_after`` and ``top1_after`` become
    the final model's) and returns ``values`` with every attention parameter of every layer."""
    from transformers import AutoModelForCausalLM

    from ...modeling.patch import patch_model
    from ...portable.layout import find_layers

    t0 = time.time()
    teacher = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).to(device).eval()
    student = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).to(device).eval()
    patch_model(student, cfg)
    with torch.no_grad():
        for name, value in values.items():
            student.get_parameter(name).copy_(value)
    for p in list(teacher.parameters()) + list(student.parameters()):
        p.requires_grad_(False)
    params, scales = {}, []  # by state-dict name, as the layer-wise stage and the writer name them
    for i, block in enumerate(find_layers(student, family)):
        prefix = f"{family.layers}.{i}.{family.attention}."
        attn = getattr(block, family.attention)
        named = dict(attn.named_parameters())
        params.update({prefix + k: p for k, p in named.items()})
        scales += lr_scales(attn, named)  # as the layer-wise stage steps them
    missing = [k for k in params if k not in dict(student.named_parameters())]
    if missing:  # a model whose blocks are not at the family's path from the head model
        raise ValueError(f"end-to-end healing: the converted model has no parameter {missing[0]!r}")
    start = {k: p.detach().clone() for k, p in params.items()}
    teacher_run, student_run = text_runner(teacher), text_runner(student)  # BLIP-2: on its language model
    steps = max(1, settings.end_to_end_tokens // blocks.shape[1])
    monitor = blocks[: min(4, len(blocks))]
    before = _kl(teacher_run, student_run, monitor, device)
    for p in params.values():
        p.requires_grad_(True)
    gen = torch.Generator().manual_seed(settings.seed)
    block_len = blocks.shape[1]

    def loss(step):
        ids = blocks[int(torch.randint(0, len(blocks), (1,), generator=gen))][None].to(device)
        with torch.no_grad():
            target = F.log_softmax(teacher_run(input_ids=ids).logits.float(), dim=-1)
        logq = F.log_softmax(student_run(input_ids=ids).logits.float(), dim=-1)
        return F.kl_div(logq, target, log_target=True, reduction="none").sum(-1).mean()

    def tick(step, value):
        stage.update(block_len)
        if (step + 1) % max(1, steps // 8) == 0:
            stage.update(0, note=f"step {step + 1}/{steps}: KL {value.item():.4f} nats/token")

    try:
        with Stage("end-to-end distillation", steps * block_len, "tok", progress) as stage:
            cosine_adam(scaled_groups(list(params.values()), settings.end_to_end_lr, scales), steps, loss, tick)
    finally:
        for p in params.values():
            p.requires_grad_(False)
    after = _kl(teacher_run, student_run, monitor, device)
    kept = after < before
    if not kept:
        with torch.no_grad():
            for k, p in params.items():
                p.copy_(start[k])
    ppl, top1 = _full_score(teacher_run, student_run, eval_blocks, device)
    report.end_to_end = {
        "tokens": steps * block_len,
        "steps": steps,
        "lr": settings.end_to_end_lr,
        "seconds": time.time() - t0,
        "kl_before": before,
        "kl_after": after,
        "kept": kept,
        "ppl_before": report.ppl_after,
        "top1_before": report.top1_after,
    }
    report.ppl_after, report.top1_after = ppl, top1
    report.seconds += time.time() - t0
    out = dict(values)
    out.update({k: p.detach().float().cpu().clone() for k, p in params.items()})
    return out


@torch.no_grad()
def _kl(teacher, student, blocks: torch.Tensor, device) -> float:
    """Mean KL (nats per token) from the teacher's next-token distribution to the student's on ``blocks``."""
    total, count = 0.0, 0
    for row in blocks:
        ids = row[None].to(device)
        p = F.log_softmax(teacher(input_ids=ids).logits.float(), dim=-1)
        q = F.log_softmax(student(input_ids=ids).logits.float(), dim=-1)
        total += F.kl_div(q, p, log_target=True, reduction="sum").item()
        count += ids.shape[1]
    return total / count


@torch.no_grad()
def _full_score(teacher, student, blocks: torch.Tensor, device) -> tuple[float, float]:
    """The student's perplexity on ``blocks`` and its next-token top-1 agreement with the teacher (the layout of
    :func:`hf_qknorm.data.perplexity`: every position but the last predicts the next)."""
    nll, count, same = 0.0, 0, 0
    for row in blocks:
        ids = row[None].to(device)
        s = student(input_ids=ids).logits.float()[0, :-1]
        t = teacher(input_ids=ids).logits.float()[0, :-1]
        nll += F.cross_entropy(s, ids[0, 1:], reduction="sum").item()
        same += (s.argmax(-1) == t.argmax(-1)).sum().item()
        count += ids.shape[1] - 1
    return math.exp(nll / count), same / count
