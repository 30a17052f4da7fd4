"""Muon (torch.optim.Muon through hf_qknorm.training.muon.MuonAdamW): the split, a step against a hand-written Muon
update, the Q/K learning-rate rule as an exact per-head learning rate, MuonClip, and Trainer."""

from __future__ import annotations

import math

import pytest
import torch

import hf_qknorm
from hf_qknorm.training.muon import MuonAdamW, muon_split
from tests._support.tiny_models import VOCAB, tiny_model


def _ids(seed=0, batch=4, seq=24):
    return torch.randint(1, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))


def _newton_schulz(g: torch.Tensor, steps: int = 5, eps: float = 1e-7) -> torch.Tensor:
    """Muon's quintic Newton-Schulz orthogonalisation, written from Jordan et al. 2024 (coefficients
    3.4445, -4.7750, 2.0315), in bfloat16 as torch's Muon computes it."""
    a, b, c = 3.4445, -4.7750, 2.0315
    x = g.bfloat16()
    transpose = g.shape[0] > g.shape[1]
    if transpose:
        x = x.T
    x = x / (x.norm() + eps)
    for _ in range(steps):
        m = x @ x.T
        x = a * x + (b * m + c * m @ m) @ x
    return (x.T if transpose else x).to(g.dtype)


def test_split_leaves_embeddings_head_and_vectors_to_adamw():
    model = tiny_model("llama")
    matrices, rest = muon_split(model)
    names = {id(p): n for n, p in model.named_parameters()}
    assert all(p.dim() == 2 for p in matrices)
    assert {names[id(p)] for p in rest} >= {"model.embed_tokens.weight", "lm_head.weight"}
    assert any("q_proj" in names[id(p)] for p in matrices) and all("norm" not in names[id(p)] for p in matrices)


def test_first_step_matches_a_hand_written_muon_update():
    lr, wd, momentum = 0.02, 0.1, 0.95
    model = tiny_model("llama").train()
    opt = MuonAdamW(model, lr=lr, weight_decay=wd)
    w = model.model.layers[0].self_attn.q_proj.weight
    before = w.detach().clone()
    ids = _ids()
    model(ids, labels=ids).loss.backward()
    grad = w.grad.detach().clone()
    opt.step()
    buf = (1 - momentum) * grad  # momentum buffer from zero
    update = grad + momentum * (buf - grad)  # Nesterov
    adjusted = lr * math.sqrt(max(1.0, w.shape[0] / w.shape[1]))
    expected = before * (1 - lr * wd) - adjusted * _newton_schulz(update)
    # bf16 orthogonalisation: the two Newton-Schulz implementations round differently, so compare the whole update
    # (relative Frobenius error) rather than element by element
    step = expected - before
    error = torch.linalg.vector_norm(w.detach() - expected) / torch.linalg.vector_norm(step)
    assert float(error) < 0.05, float(error)  # 3.4% measured; a 10% error in the step size gives 9-12%


def test_qk_learning_rate_is_an_exact_per_head_rate_with_muon():
    """Two identical models, one step each with the same gradients: with the Q/K rule (constant factor 0.5) the
    W_Q / W_K update is exactly half of plain Muon's, everything else identical."""

    def one_step(rule):
        model = tiny_model("llama", dtype=torch.float64).train()
        opt = MuonAdamW(model, lr=0.02, weight_decay=0.1)
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        ids = _ids()
        model(ids, labels=ids).loss.backward()
        if rule:
            hf_qknorm.QKLearningRate(model, tau=0.5, rule="constant").step(opt)
        else:
            opt.step()
        return {n: p.detach() - before[n] for n, p in model.named_parameters()}

    plain, ruled = one_step(False), one_step(True)
    for name in plain:
        factor = 0.5 if ("q_proj" in name or "k_proj" in name) else 1.0
        torch.testing.assert_close(ruled[name], factor * plain[name], rtol=1e-9, atol=1e-15, msg=name)


def test_muonclip_bounds_the_logits():
    """Muon at a learning rate where the plain model's largest logit passes 20 x tau: with QK-Clip as the
    optimizer's post-step hook every forward stays within tau plus one step's growth (under 3 x tau here)."""

    def run(clip_on):
        torch.manual_seed(0)
        model = tiny_model("llama", num_key_value_heads=4).train()
        opt = MuonAdamW(model, lr=0.2)
        clip = hf_qknorm.QKClip(model, tau=20.0) if clip_on else None
        if clip is not None:
            clip.attach(opt)  # MuonClip: the clip runs as the optimizer's post-step hook
        monitor = hf_qknorm.QKMonitor(model, warn_logit=float("inf"), diverge_logit=float("inf"))
        seen = []
        for step in range(60):
            ids = _ids(step)
            with monitor.record() as stats:
                loss = model(ids, labels=ids).loss
            seen.append(stats["qk/max_logit"])
            opt.zero_grad()
            loss.backward()
            opt.step()
        return seen, clip

    plain, _ = run(False)
    clipped, clip = run(True)
    assert max(plain) > 20 * 20.0, plain
    assert clip.steps == 60 and clip.clipped_steps > 0
    assert max(clipped) < 3 * 20.0, clipped


def test_trainer_with_muon(tmp_path):
    from transformers import Trainer

    from tests._support.trainer_runs import CountingText, training_args

    model = tiny_model("llama", seed=3)
    hf_qknorm.patch_model(model, "qk_norm_cap", softcap=20.0)
    opt = MuonAdamW(model, lr=0.02)
    trainer = Trainer(
        model=model,
        args=training_args(tmp_path, max_steps=4, save_strategy="no"),
        train_dataset=CountingText(),
        optimizers=(opt, None),
        callbacks=[hf_qknorm.QKLearningRateCallback(tau=0.5)],
    )
    out = trainer.train()
    assert math.isfinite(out.training_loss)


def test_no_matrices_is_refused():
    model = tiny_model("llama")
    for param in model.parameters():
        param.requires_grad_(param.dim() < 2)
    with pytest.raises(ValueError, match="no trainable hidden weight matrices"):
        MuonAdamW(model)
