"""Short training runs: every scheme learns, and the fast path trains like the float reference path."""

from __future__ import annotations

import pytest
import torch

import hf_qknorm
from hf_qknorm.reference import attention_reference
from tests._support.tiny_models import VOCAB, tiny_model


def _batches(steps, batch=8, seq=32, seed=0):
    """Learnable synthetic text: each row counts upward from a random start with a random stride of 1 or 2."""
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        start = torch.randint(0, VOCAB, (batch, 1), generator=g)
        stride = torch.randint(1, 3, (batch, 1), generator=g)
        yield (start + stride * torch.arange(seq)[None]) % VOCAB


def _train(model, steps=30, lr=3e-3):
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95))
    losses = []
    for ids in _batches(steps):
        loss = model(ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("family", ["llama", "gpt2"])
@pytest.mark.parametrize(
    "scheme,norm",
    [
        ("qk_norm", "layernorm"),
        ("soft_cap", None),
        ("qk_norm_cap", "rmsnorm"),
        ("qkv_norm", "layernorm"),
        ("qk_norm", "lp"),
    ],
)
def test_loss_falls(family, scheme, norm):
    model = tiny_model(family)
    hf_qknorm.patch_model(model, scheme, norm=norm, p=4.0 if norm == "lp" else None)
    losses = _train(model)
    assert all(torch.isfinite(torch.tensor(losses)))
    first, last = sum(losses[:3]) / 3, sum(losses[-3:]) / 3
    assert last < 0.8 * first, losses


def _reference_attention(module, q, k, v, mask, scaling=None, dropout=0.0, softcap=None, sliding_window=None, **kwargs):
    softcap = softcap if softcap is not None else module._qknorm_softcap  # a patched module carries its cap
    out = attention_reference(
        q, k, v, scaling=scaling, softcap=softcap, causal=mask is None, mask=mask, sliding_window=sliding_window
    )
    return out.transpose(1, 2), None


def test_fast_path_trains_like_reference(monkeypatch):
    """30 steps with the "qknorm" backend (chunked capped attention) vs the plain formula: same losses, same
    final parameters (Liger-Kernel's convergence-test idea)."""
    from transformers import AttentionInterface

    import hf_qknorm.portable.hooks as hooks

    AttentionInterface.register("qknorm_test_reference", _reference_attention)
    monkeypatch.setattr(hooks, "CAP_READING_BACKENDS", hooks.CAP_READING_BACKENDS + ("qknorm_test_reference",))
    runs = []
    for backend in ("qknorm", "qknorm_test_reference"):
        model = tiny_model("llama", dtype=torch.float64)
        hf_qknorm.patch_model(model, "qk_norm_cap", softcap=2.0)  # low cap: it bites during training
        model.set_attn_implementation(backend)
        runs.append((_train(model, lr=1e-2), model.state_dict()))
    (la, sa), (lb, sb) = runs
    torch.testing.assert_close(torch.tensor(la), torch.tensor(lb), rtol=1e-7, atol=1e-7)
    for key in sa:
        torch.testing.assert_close(sa[key], sb[key], rtol=1e-6, atol=1e-8)
