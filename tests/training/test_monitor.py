"""The attention-logit monitor: its statistics against a float64 brute force, patched (probe) and unpatched (hooks)
models alike, instance-level attachment, gradient checkpointing, Trainer logging and the warnings."""

from __future__ import annotations

import logging

import pytest
import torch

import hf_qknorm
from hf_qknorm import upstream
from hf_qknorm.training.monitor import QKMonitor, attention_stats
from tests._support.tiny_models import VOCAB, tiny_model


def _brute_force(q, k, allowed, scaling, softcap):
    groups = q.shape[1] // k.shape[1]
    s = scaling * q @ k.repeat_interleave(groups, dim=1).transpose(-1, -2)
    allowed = allowed.expand_as(s)
    best = s[allowed].max()
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    p = torch.softmax(s.masked_fill(~allowed, float("-inf")), -1)
    ent = -(p * torch.log(p.where(allowed, torch.ones_like(p)))).sum(-1)
    rows = allowed.any(-1)
    raw = scaling * q @ k.repeat_interleave(groups, dim=1).transpose(-1, -2)
    per_head = raw.masked_fill(~allowed, float("-inf")).amax(dim=(0, 2, 3))  # each head over batch and pairs
    return torch.cat([torch.stack([best, ent[rows].mean(), q.pow(2).mean().sqrt(), k.pow(2).mean().sqrt()]), per_head])


@pytest.mark.parametrize("mask_kind", ["causal", "bool_padding", "additive_per_head"])
@pytest.mark.parametrize("softcap", [None, 2.0])
def test_stats_match_brute_force(mask_kind, softcap):
    g = torch.Generator().manual_seed(0)
    b, h, hkv, t, d = 2, 6, 2, 17, 8
    q = torch.randn(b, h, t, d, generator=g, dtype=torch.float64) * 3
    k = torch.randn(b, hkv, t, d, generator=g, dtype=torch.float64)
    causal = torch.ones(t, t, dtype=torch.bool).tril()
    if mask_kind == "causal":
        mask, allowed = None, causal[None, None]
    elif mask_kind == "bool_padding":
        keep = torch.ones(b, t, dtype=torch.bool)
        keep[0, :5] = False  # left padding: rows 0-4 of sequence 0 see no key at all
        mask = allowed = causal[None, None] & keep[:, None, None, :]
    else:
        allowed = causal[None, None] & (torch.rand(b, h, t, t, generator=g) > 0.3)
        allowed[..., 0] = True
        mask = torch.zeros(b, h, t, t, dtype=torch.float64).masked_fill(~allowed, torch.finfo(torch.float64).min)
    expected = _brute_force(q, k, allowed, 0.35, softcap)
    for tile in (64, 1 << 21):  # chunked (a few rows at a time) and in one piece
        got = attention_stats(q, k, mask, scaling=0.35, softcap=softcap, tile_elements=tile)
        torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-10)


def _ids(seed=0, batch=2, seq=20):
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("family", ["llama", "qwen3", "gpt2"])
def test_unpatched_hooks_agree_with_patched_probe(family):
    """An unpatched model (hooks) and the same weights patched with a cap too large to bite (probe) give the same
    statistics; the entropy also matches the eager attention weights."""
    ids, mask = _ids(), torch.ones(2, 20, dtype=torch.long)
    mask[0, 15:] = 0  # right padding
    plain = tiny_model(family, dtype=torch.float64, attn_implementation="eager")
    patched = tiny_model(family, dtype=torch.float64)
    hf_qknorm.patch_model(patched, "soft_cap", softcap=1e6)  # the largest cap: bends a logit of 5 by 4e-11
    a, b = QKMonitor(plain), QKMonitor(patched)
    assert not any(s.patched for s in a.sites) and all(s.patched for s in b.sites)
    with a.record() as stats_a:
        out = plain(ids, attention_mask=mask, output_attentions=True)
    with b.record() as stats_b:
        patched(ids, attention_mask=mask)
    assert stats_a.keys() == stats_b.keys() and len(stats_a) == 2 + 4 * 2
    for key in stats_a:
        assert stats_a[key] == pytest.approx(stats_b[key], rel=1e-7, abs=1e-9), key
    for i, w in enumerate(out.attentions):
        entropy = -(w * torch.log(w.clamp_min(1e-300))).sum(-1).mean()
        assert stats_a[f"qk/layer{i}/entropy"] == pytest.approx(entropy.item(), rel=1e-6)
    assert stats_a["qk/max_logit"] == max(stats_a[f"qk/layer{i}/max_logit"] for i in range(2))


@pytest.mark.parametrize("backend", ["qknorm", "sdpa"])
def test_instance_level_and_gradient_checkpointing(backend):
    """The tap fires in the forward and again in checkpointing's recomputation, on "qknorm" (the backend's probe)
    and on sdpa (projection hooks) alike; only the first is measured."""
    calls_per_layer = 2
    a, b = tiny_model("llama"), tiny_model("llama")
    hf_qknorm.patch_model(a, "qk_norm")
    a.set_attn_implementation(backend)
    monitor = QKMonitor(a)
    upstream.enable_checkpointing(a, use_reentrant=False)
    a.train()
    calls = []
    measure = monitor._measure
    monitor._measure = lambda i, *args: (calls.append(i), measure(i, *args))
    with monitor.record() as stats:
        attn_b = b.model.layers[0].self_attn
        assert not hasattr(attn_b, "_qknorm_probes") and not attn_b._forward_hooks  # the other model is untouched
        b(_ids())
        ids = _ids(1)
        a(ids, labels=ids).loss.backward()  # checkpointing re-runs each layer's forward in backward
    assert len(calls) == 2 * calls_per_layer and len(stats) == 10
    assert all("_qknorm_probes" not in s.module.__dict__ for s in monitor.sites)
    a.eval()
    with torch.no_grad(), monitor.record() as again:
        a(ids)
    for key in stats:
        assert stats[key] == pytest.approx(again[key], rel=1e-5), key
    a(ids)  # not recording: nothing measured, nothing attached
    assert len(calls) == 2 * calls_per_layer + 2
    assert not a.model.layers[0].self_attn.q_proj._forward_hooks  # the patch applies its norms without hooks


def test_warnings_near_the_cap_and_toward_divergence(caplog):
    capped = tiny_model("llama")
    hf_qknorm.patch_model(capped, "soft_cap", softcap=0.05)
    monitor = QKMonitor(capped)
    with caplog.at_level(logging.WARNING, logger="hf_qknorm.training.monitor"):
        for step in range(2):
            with monitor.record(step):
                capped(_ids())
    kinds = [(a["kind"], a["layer"], a["step"]) for a in monitor.alerts]
    assert kinds == [("cap", 0, 0), ("cap", 1, 0)]  # once per layer while the condition holds
    assert "of the cap" in caplog.text

    plain = tiny_model("gpt2")
    monitor = QKMonitor(plain)
    c_attn = plain.transformer.h[0].attn.c_attn
    with torch.no_grad():
        c_attn.weight[:, :128] *= 60.0  # W_Q and W_K of layer 0 grow 60x: logits 3600x
    logits = []
    for step, factor in enumerate((1.0, 5.0, 1.0, 2.0, 1.0)):  # logits grow with the square of the factor
        with torch.no_grad():
            c_attn.weight[:, :128] *= factor
        with monitor.record(step) as stats:
            plain(_ids())
        logits.append(stats["qk/layer0/max_logit"])
        assert stats["qk/layer1/max_logit"] < 10
    assert 1e2 < logits[0] < 1e3 < logits[1] < 1e4 < logits[3]
    assert [(a["kind"], a["layer"], a["step"]) for a in monitor.alerts] == [("growth", 0, 1), ("diverge", 0, 3)]
    assert "Wortsman" in monitor.alerts[-1]["message"]


class _Reporter:
    """Stands in for TensorBoardCallback & co: a callback registered before the monitor that records on_log."""

    def __init__(self):
        self.logs = []

    def __getattr__(self, name):
        if name.startswith("on_"):
            return lambda args, state, control, logs=None, **kw: (
                self.logs.append(dict(logs)) if name == "on_log" else None
            )
        raise AttributeError(name)


def test_trainer_logs_reach_reporters(tmp_path):
    from transformers import Trainer, TrainingArguments

    from tests._support.trainer_runs import CountingText

    model = tiny_model("qwen3")
    hf_qknorm.patch_model(model, "qk_norm_cap")
    reporter = _Reporter()
    args = TrainingArguments(
        output_dir=str(tmp_path),
        max_steps=5,
        per_device_train_batch_size=4,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        disable_tqdm=True,
    )
    trainer = Trainer(model=model, args=args, train_dataset=CountingText(n=24), callbacks=[reporter])
    monitor = hf_qknorm.QKMonitorCallback.attach(trainer, every=2)
    trainer.train()
    assert [h["step"] for h in monitor.history] == [1, 3, 5]  # steps 0, 2, 4 measured, logged at their end
    seen = [log for log in reporter.logs if "qk/max_logit" in log]
    assert len(seen) == 3 and all("qk/layer1/k_rms" in log for log in seen)
    assert sum("qk/max_logit" in r for r in trainer.state.log_history) == 3
    assert [r["step"] for r in trainer.state.log_history if "loss" in r] == [1, 2, 3, 4, 5]  # loss logs kept
    assert all("_qknorm_probes" not in s.module.__dict__ for s in monitor.monitor.sites)

    fallback = hf_qknorm.QKMonitorCallback(every=3)  # added without the trainer: history and log_history only
    trainer2 = Trainer(model=model, args=args, train_dataset=CountingText(n=24), callbacks=[fallback])
    trainer2.train()
    assert [h["step"] for h in fallback.history] == [1, 4]
    assert sum("qk/max_logit" in r for r in trainer2.state.log_history) == 2
