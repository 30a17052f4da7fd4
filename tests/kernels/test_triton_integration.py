"""The Triton kernels wired into whole models, checked on CPU through Triton's interpreter.

``kernel_policy(devices=("cuda", "cpu"))`` sends CPU tensors down the CUDA path (the fused capped attention), so CI
proves the wiring -- masks, packed sequences, GQA, caches, gradients -- against the PyTorch path without a GPU.
"""

from __future__ import annotations

import pytest
import torch

import hf_qknorm
from hf_qknorm.attention import kernel_policy
from tests._support.tiny_models import VOCAB, tiny_model
from tests.kernels.conftest import needs_interpreter

ON_CPU = ("cuda", "cpu")
ENTRY_POINTS = (
    "qknorm_attn_func",
    "qknorm_attn_func_with_max_logits",
    "qknorm_attn_varlen_func",
    "qknorm_attn_varlen_func_with_max_logits",
    "qknorm_attn_with_kvcache",
)

pytestmark = needs_interpreter


@pytest.fixture
def kernel_calls(monkeypatch):
    """Counts calls into the kernels' entry points by name (and in all under "attention"), so a test fails if the
    model silently took the PyTorch path or the wrong entry point."""
    import hf_qknorm.kernels.attn_interface as api

    calls = dict.fromkeys(ENTRY_POINTS + ("attention",), 0)

    def spy(name):
        original = getattr(api, name)

        def wrapped(*args, **kwargs):
            calls[name] += 1
            calls["attention"] += 1
            return original(*args, **kwargs)

        monkeypatch.setattr(api, name, wrapped)

    for name in ENTRY_POINTS:
        spy(name)
    return calls


def _pair(family, scheme, norm, **kw):
    a = tiny_model(family, **kw)
    hf_qknorm.patch_model(a, scheme, norm=norm, p=3.0 if norm == "lp" else None)
    with torch.no_grad():
        for name, prm in a.named_parameters():
            if "_norm." in name:
                prm.add_(0.2 * torch.randn_like(prm))
    return a


@pytest.mark.parametrize(
    "family,scheme,norm",
    [
        ("llama", "qk_norm_cap", "layernorm"),
        ("qwen3", "qk_norm", "rmsnorm"),
        ("mistral", "qk_norm_cap", "lp"),
        ("gpt2", "qkv_norm", "layernorm"),
    ],
)
def test_padded_forward_and_grads_match_torch_path(family, scheme, norm, kernel_calls):
    model = _pair(family, scheme, norm)
    model.set_attn_implementation("qknorm")
    model.config.pad_token_id = 0
    ids = torch.randint(1, VOCAB, (2, 19), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :6] = 0  # left padding in row 1
    labels = ids.masked_fill(mask == 0, -100)
    results = []
    for use_triton in (False, True):
        model.zero_grad()
        with kernel_policy(devices=ON_CPU if use_triton else ()):
            out = model(ids, attention_mask=mask, labels=labels)
        out.loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        results.append((out.logits.detach(), grads))
    (la, ga), (lb, gb) = results
    layers = model.config.num_hidden_layers
    assert kernel_calls["attention"] == kernel_calls["qknorm_attn_func"] == layers
    torch.testing.assert_close(lb[0], la[0], rtol=2e-4, atol=2e-4)
    torch.testing.assert_close(lb[1, 6:], la[1, 6:], rtol=2e-4, atol=2e-4)
    for name in ga:
        torch.testing.assert_close(gb[name], ga[name], rtol=2e-3, atol=2e-4, msg=name)


def test_packed_sequences_through_kernels(kernel_calls):
    from transformers import DataCollatorWithFlattening

    model = _pair("llama", "qk_norm_cap", "layernorm")
    seqs = [torch.randint(1, VOCAB, (n,), generator=torch.Generator().manual_seed(n)) for n in (7, 12, 4)]
    collate = DataCollatorWithFlattening(return_tensors="pt", return_flash_attn_kwargs=True)
    batch = collate([{"input_ids": s.tolist()} for s in seqs])
    kwargs = {k: batch[k] for k in ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")}
    with kernel_policy(devices=ON_CPU):
        packed = model(
            input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False, **kwargs
        ).logits[0]
    assert kernel_calls["attention"] == kernel_calls["qknorm_attn_varlen_func"] == model.config.num_hidden_layers
    start = 0
    for s in seqs:
        torch.testing.assert_close(packed[start : start + len(s)], model(s[None]).logits[0], rtol=2e-4, atol=2e-4)
        start += len(s)


def test_cached_generation_through_kernels(kernel_calls):
    model = _pair("llama", "qk_norm_cap", "rmsnorm")
    model.generation_config.pad_token_id = 0
    prompt = torch.randint(1, VOCAB, (1, 5), generator=torch.Generator().manual_seed(3))
    expected = model.generate(prompt, max_new_tokens=6, do_sample=False)
    assert kernel_calls["attention"] == 0  # CPU tensors, default policy: the PyTorch path
    with kernel_policy(devices=ON_CPU):
        got = model.generate(prompt, max_new_tokens=6, do_sample=False)
    assert torch.equal(got, expected)
    assert kernel_calls["attention"] == kernel_calls["qknorm_attn_func"] == 6 * model.config.num_hidden_layers
