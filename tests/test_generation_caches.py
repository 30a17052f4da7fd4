"""Generation with every cache kind gives the uncached forward's logits, on the "qknorm" backend.

For each step of a greedy ``generate`` the logits must equal those of one uncached forward over the final sequence
(same attention mask), for dynamic, static, sliding-window and hybrid caches, padded (left) and unpadded batches,
every family -- patched with a capped scheme, with ``soft_cap``, with ``qk_norm`` on sdpa -- and Gemma 2 with its own
cap. A prefill into an empty static cache is the case Transformers sends without a mask, expecting top-left causal
alignment (hf_qknorm.attention.masks)."""

from __future__ import annotations

import pytest
import torch

import hf_qknorm
from tiny_models import FAMILY_NAMES, VOCAB, tiny_model

NEW_TOKENS = 5


def _gemma2(**overrides):
    from transformers import Gemma2Config, Gemma2ForCausalLM

    cfg = Gemma2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=128,
                       sliding_window=8, attn_logit_softcapping=3.0, query_pre_attn_scalar=16, **overrides)
    torch.manual_seed(0)
    model = Gemma2ForCausalLM._from_config(cfg, attn_implementation="qknorm").eval()
    with torch.no_grad():  # large q/k weights so that the cap of 3 bites
        for name, prm in model.named_parameters():
            if "q_proj" in name or "k_proj" in name:
                prm.mul_(6)
    return model


def _patched(family, scheme, backend=None):
    model = tiny_model(family)
    if scheme is not None:
        hf_qknorm.patch_model(model, scheme, softcap=3.0 if scheme in ("qk_norm_cap", "soft_cap") else None)
        with torch.no_grad():
            for name, prm in model.named_parameters():
                if "_norm." in name:
                    prm.add_(0.3 * torch.randn_like(prm))
                if scheme == "soft_cap" and ("q_proj" in name or "k_proj" in name or "c_attn" in name):
                    prm.mul_(4)  # logits large enough for the cap to bend them
    if backend is not None:
        model.set_attn_implementation(backend)
    return model


def _prompt(padded: bool, length: int = 14):
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(1, VOCAB, (2, length), generator=g)
    mask = torch.ones_like(ids)
    if padded:
        mask[0, :5] = 0  # left padding
        ids[0, :5] = 0
    return ids, mask


def check_generation(model, cache_implementation, padded, rtol=2e-5, atol=2e-5):
    """Each generated step's logits against the uncached forward of the whole final sequence."""
    model.generation_config.pad_token_id = 0
    ids, mask = _prompt(padded)
    kwargs = {} if cache_implementation is None else {"cache_implementation": cache_implementation}
    out = model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False, min_new_tokens=NEW_TOKENS,
                         return_dict_in_generate=True, output_logits=True, **kwargs)
    seq = out.sequences
    full_mask = torch.cat([mask, torch.ones(2, seq.shape[1] - ids.shape[1], dtype=mask.dtype)], dim=1)
    # the positions generate gives a left-padded row (GPT-2's absolute embeddings see them; RoPE is relative)
    positions = (full_mask.long().cumsum(-1) - 1).masked_fill(full_mask == 0, 1)
    with torch.no_grad():
        ref = model(seq, attention_mask=full_mask, position_ids=positions, use_cache=False).logits
    for step, logits in enumerate(out.logits):
        pos = ids.shape[1] - 1 + step
        torch.testing.assert_close(logits, ref[:, pos], rtol=rtol, atol=atol,
                                   msg=lambda m: f"step {step} ({cache_implementation}, padded={padded}): {m}")


CASES = [(f, "qk_norm_cap", "qknorm") for f in FAMILY_NAMES] + [
    ("llama", "soft_cap", "qknorm"), ("qwen3", "soft_cap", "qknorm"), ("mistral", "qk_norm", "qknorm"),
    ("qwen2", "qk_norm", "sdpa"), ("llama", None, "qknorm"), ("gpt2", None, "qknorm")]


@pytest.mark.parametrize("family,scheme,backend", CASES)
@pytest.mark.parametrize("cache", [None, "static"])
@pytest.mark.parametrize("padded", [False, True])
def test_cached_generation_matches_uncached(family, scheme, backend, cache, padded):
    check_generation(_patched(family, scheme, backend), cache, padded)


@pytest.mark.parametrize("cache", [None, "static", "sliding_window"])
@pytest.mark.parametrize("padded", [False, True])
def test_mistral_sliding_window_caches(cache, padded):
    """Mistral's window (12) is shorter than prompt + generation (19): the window must bite, in every cache."""
    check_generation(_patched("mistral", "qk_norm_cap", "qknorm"), cache, padded)


@pytest.mark.parametrize("cache", [None, "static", "hybrid"])
@pytest.mark.parametrize("padded", [False, True])
def test_gemma2_own_cap_and_hybrid_cache(cache, padded):
    check_generation(_gemma2(), cache, padded, rtol=1e-4, atol=1e-4)


def test_static_cache_through_the_kernels():
    from hf_qknorm import kernels
    from hf_qknorm.attention import triton_on_cpu

    if kernels.unavailable_reason() is not None:
        pytest.skip(kernels.unavailable_reason())
    model = _patched("llama", "qk_norm_cap", "qknorm")
    with triton_on_cpu():
        check_generation(model, "static", padded=False, rtol=2e-4, atol=2e-4)
        check_generation(model, "static", padded=True, rtol=2e-4, atol=2e-4)


def test_output_attentions_on_a_capped_model():
    """A capped model returns its attention weights when asked: the probabilities after cap, mask and softmax."""
    from hf_qknorm.reference import attention_reference

    model = _patched("llama", "qk_norm_cap", "qknorm").double()
    ids, mask = _prompt(padded=True)
    out = model(ids, attention_mask=mask, output_attentions=True)
    assert out.attentions is not None and len(out.attentions) == model.config.num_hidden_layers
    weights = out.attentions[0]
    assert weights.shape == (2, 4, ids.shape[1], ids.shape[1])
    torch.testing.assert_close(weights[1].sum(-1), torch.ones(4, ids.shape[1], dtype=weights.dtype))
    assert torch.all(weights[0, :, :, :5] == 0)  # padding never attended
    assert torch.all(weights[1].triu(1) == 0)  # causal
    torch.testing.assert_close(model(ids, attention_mask=mask).logits, out.logits)  # same forward otherwise
    del attention_reference


def test_assisted_generation_with_output_attentions():
    target = _patched("llama", "qk_norm_cap", "qknorm")
    assistant = _patched("llama", "qk_norm_cap", "qknorm")
    target.generation_config.pad_token_id = assistant.generation_config.pad_token_id = 0
    ids = torch.randint(1, VOCAB, (1, 9), generator=torch.Generator().manual_seed(1))
    plain = target.generate(ids, max_new_tokens=6, do_sample=False)
    assisted = target.generate(ids, max_new_tokens=6, do_sample=False, assistant_model=assistant,
                               output_attentions=True, return_dict_in_generate=True)
    assert torch.equal(assisted.sequences, plain) and assisted.attentions is not None
