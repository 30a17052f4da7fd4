"""Q/K learning-rate control (Anson & Aitchison 2025): the rule, its exactness for AdamW, GPT-2's fused c_attn, the
constant factor through parameter groups, and clear errors."""

from __future__ import annotations

import pytest
import torch

import hf_qknorm
from hf_qknorm.training.qk_lr import QKLearningRate
from tests._support.tiny_models import VOCAB, tiny_model


def _batch(seed, batch=4, seq=16):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (batch, seq), generator=g)


def _loss(model, seed):
    ids = _batch(seed)
    return model(ids, labels=ids).loss


def _llama(**kw):
    model = tiny_model("llama", dtype=torch.float64, **kw)
    hf_qknorm.patch_model(model, "qk_norm")
    model.train()
    return model


def test_factors_follow_the_rule_with_gqa():
    model = _llama()  # 4 query heads, 2 key heads, head_dim 16
    qk = QKLearningRate(model, tau=0.5)
    attn = model.model.layers[0].self_attn
    with torch.no_grad():
        attn.k_proj.weight[:16] *= 2.0  # key head 0: ||W_K|| doubles
        attn.q_proj.weight[16:32] *= 4.0  # query head 1 (reads key head 0): ||W_Q|| x4
    (fq, fk), (fq1, fk1) = qk.factors()
    torch.testing.assert_close(fq, torch.tensor([0.25, 0.25, 0.5, 0.5], dtype=torch.float64))
    # key head 0 is read by query heads 0 and 1: the ratio of their largest norms
    nq0 = torch.tensor(qk.initial_norms["q"][0], dtype=torch.float64)
    expected = 0.5 * nq0[:2].max() / torch.stack([nq0[0], 4 * nq0[1]]).max()
    torch.testing.assert_close(fk, torch.stack([expected, torch.tensor(0.5, dtype=torch.float64)]))
    torch.testing.assert_close(fq1, torch.full((4,), 0.5, dtype=torch.float64))  # layer 1 untouched
    per_layer = QKLearningRate(model, tau=1.0, per_head=False, initial_norms=qk.initial_norms)
    fq_layer = per_layer.factors()[0][0]
    nk0 = torch.tensor(qk.initial_norms["k"][0], dtype=torch.float64)
    torch.testing.assert_close(
        fq_layer, torch.full((4,), float(nk0.norm() / torch.stack([2 * nk0[0], nk0[1]]).norm()), dtype=torch.float64)
    )


def _reference_adamw(model, steps, lr, wd, tau, betas=(0.9, 0.95), eps=1e-8):
    """AdamW written out with a learning rate per output row: Q/K rows get tau * lr * (the rule's ratio)."""
    params = dict(model.named_parameters())
    state = {n: (torch.zeros_like(p), torch.zeros_like(p)) for n, p in params.items()}
    heads, kv, d = 4, 2, 16

    def head_norms(w, h):
        return w.view(h, d, -1).flatten(1).norm(dim=1)

    init = {}
    for i, layer in enumerate(model.model.layers):
        init[i] = (
            head_norms(layer.self_attn.q_proj.weight.detach(), heads),
            head_norms(layer.self_attn.k_proj.weight.detach(), kv),
        )
    for t in range(1, steps + 1):
        model.zero_grad()
        _loss(model, t).backward()
        rates = {n: torch.full((p.shape[0],) + (1,) * (p.dim() - 1), lr, dtype=p.dtype) for n, p in params.items()}
        for i, layer in enumerate(model.model.layers):
            nq = head_norms(layer.self_attn.q_proj.weight.detach(), heads)
            nk = head_norms(layer.self_attn.k_proj.weight.detach(), kv)
            fq = (init[i][1] / nk).repeat_interleave(heads // kv)
            fk = init[i][0].view(kv, -1).amax(1) / nq.view(kv, -1).amax(1)
            rates[f"model.layers.{i}.self_attn.q_proj.weight"] = (tau * lr * fq).repeat_interleave(d)[:, None]
            rates[f"model.layers.{i}.self_attn.k_proj.weight"] = (tau * lr * fk).repeat_interleave(d)[:, None]
        with torch.no_grad():
            for n, p in params.items():
                m, v = state[n]
                m.mul_(betas[0]).add_(p.grad, alpha=1 - betas[0])
                v.mul_(betas[1]).addcmul_(p.grad, p.grad, value=1 - betas[1])
                mhat, vhat = m / (1 - betas[0] ** t), v / (1 - betas[1] ** t)
                p.sub_(rates[n] * (wd * p + mhat / (vhat.sqrt() + eps)))


def test_matches_per_head_adamw_reference():
    """Rescaling each head's AdamW update is exactly AdamW with that head's learning rate (decay included)."""
    lr, wd, tau, steps = 1e-2, 0.1, 0.7, 5
    model, ref = _llama(), _llama()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=wd, betas=(0.9, 0.95), eps=1e-8)
    qk = QKLearningRate(model, tau=tau)
    for t in range(1, steps + 1):
        opt.zero_grad()
        _loss(model, t).backward()
        qk.step(opt)
    _reference_adamw(ref, steps, lr, wd, tau)
    for (name, a), b in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11, msg=name)
    fq, fk = qk.last_factors[0]
    assert not torch.allclose(fq, torch.full_like(fq, tau))  # the norms moved: the rule really acted


def test_gpt2_fused_c_attn_rescales_q_and_k_columns_only():
    model = tiny_model("gpt2", dtype=torch.float64)
    plain = tiny_model("gpt2", dtype=torch.float64)
    for m in (model, plain):
        hf_qknorm.patch_model(m, "qk_norm_cap")
        m.train()
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1) for m in (model, plain)]
    qk = QKLearningRate(model, tau=1.0, rule="constant")
    qk.tau = 0.25  # a constant factor: Q and K columns move a quarter as far, V columns and the rest as plain
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    for m in (model, plain):
        _loss(m, 0).backward()
    qk.step(opts[0])
    opts[1].step()
    e = 64
    for (name, a), b in zip(model.named_parameters(), plain.parameters()):
        if name.endswith("attn.c_attn.weight") or name.endswith("attn.c_attn.bias"):
            old = before[name]
            expected = b.detach().clone()
            expected[..., : 2 * e] = old[..., : 2 * e] + 0.25 * (b[..., : 2 * e] - old[..., : 2 * e])
            torch.testing.assert_close(a, expected, rtol=1e-12, atol=1e-14, msg=name)
        else:
            torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)
    with pytest.raises(ValueError, match="fuses Q, K and V"):
        hf_qknorm.qk_param_groups(model, 1e-3)


def test_constant_factor_param_groups_equal_the_controller():
    lr, factor = 3e-3, 0.5
    a, b = _llama(), _llama()
    opt_a = torch.optim.AdamW(hf_qknorm.qk_param_groups(a, lr, weight_decay=0.1, qk_lr_factor=factor), lr=lr)
    groups = opt_a.param_groups
    assert [g["weight_decay"] for g in groups] == [0.1, 0.0, 0.1] and groups[2]["lr"] == lr * factor
    assert len(groups[2]["params"]) == 4  # q_proj, k_proj weights of 2 layers
    opt_b = torch.optim.AdamW(hf_qknorm.qk_param_groups(b, lr, weight_decay=0.1), lr=lr)
    qk = QKLearningRate(b, tau=factor, rule="constant")
    for t in range(3):
        for m, opt in ((a, opt_a), (b, opt_b)):
            opt.zero_grad()
            _loss(m, t).backward()
        opt_a.step()
        qk.step(opt_b)
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-10, atol=1e-12, msg=name)


def test_state_dict_round_trip_and_errors():
    model = _llama()
    qk = QKLearningRate(model, tau=2.0)
    other = QKLearningRate(model, tau=1.0, initial_norms={"q": [[1.0] * 4] * 2, "k": [[1.0] * 2] * 2})
    other.load_state_dict(qk.state_dict())
    assert other.state_dict() == qk.state_dict()
    with pytest.raises(RuntimeError, match="pre_step"):
        QKLearningRate(model).post_step()
    with pytest.raises(ValueError, match="unknown rule"):
        QKLearningRate(model, rule="spectral")
    lora = hf_qknorm.prepare_lora(tiny_model("llama"), r=2)
    with pytest.raises(ValueError, match="frozen"):
        QKLearningRate(lora)
