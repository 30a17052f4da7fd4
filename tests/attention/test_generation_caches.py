"""Generation with every cache kind gives the uncached forward's logits, on the "qknorm" backend.

For each step of a greedy ``generate`` the logits must equal those of one uncached forward over the final sequence
(same attention mask), for dynamic, static, sliding-window and hybrid caches, padded (left) and unpadded batches,
every family -- patched with a capped scheme, with ``soft_cap``, with ``qk_norm`` on sdpa -- and Gemma 2 with its own
cap. A prefill into an empty static cache is the case Transformers sends without a mask, expecting top-left causal
alignment (hf_qknorm.portable.masks)."""

from __future__ import annotations

import pytest
import torch

import hf_qknorm
from hf_qknorm.upstream import cache_kwargs, output_cache
from tests._support.tiny_models import FAMILY_NAMES, VOCAB, tiny_model

NEW_TOKENS = 5


def _gemma2(**overrides):
    from transformers import Gemma2Config, Gemma2ForCausalLM

    cfg = Gemma2Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=128,
        sliding_window=8,
        attn_logit_softcapping=3.0,
        query_pre_attn_scalar=16,
        **overrides,
    )
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
    out = model.generate(
        ids,
        attention_mask=mask,
        max_new_tokens=NEW_TOKENS,
        do_sample=False,
        min_new_tokens=NEW_TOKENS,
        return_dict_in_generate=True,
        output_logits=True,
        **kwargs,
    )
    seq = out.sequences
    full_mask = torch.cat([mask, torch.ones(2, seq.shape[1] - ids.shape[1], dtype=mask.dtype)], dim=1)
    # the positions generate gives a left-padded row (GPT-2's absolute embeddings see them; RoPE is relative)
    positions = (full_mask.long().cumsum(-1) - 1).masked_fill(full_mask == 0, 1)
    with torch.no_grad():
        ref = model(seq, attention_mask=full_mask, position_ids=positions, use_cache=False).logits
    for step, logits in enumerate(out.logits):
        pos = ids.shape[1] - 1 + step
        torch.testing.assert_close(
            logits,
            ref[:, pos],
            rtol=rtol,
            atol=atol,
            msg=lambda m: f"step {step} ({cache_implementation}, padded={padded}): {m}",  # noqa: B023 (called within the iteration)
        )


CASES = [(f, "qk_norm_cap", "qknorm") for f in FAMILY_NAMES] + [
    ("llama", "soft_cap", "qknorm"),
    ("qwen3", "soft_cap", "qknorm"),
    ("mistral", "qk_norm", "qknorm"),
    ("qwen2", "qk_norm", "sdpa"),
    ("llama", None, "qknorm"),
    ("gpt2", None, "qknorm"),
]


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


def test_static_cache_through_the_kernels(kernels_on_cpu):
    from hf_qknorm.attention import kernel_policy

    model = _patched("llama", "qk_norm_cap", "qknorm")
    with kernel_policy(devices=("cuda", "cpu")):
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
    assisted = target.generate(
        ids,
        max_new_tokens=6,
        do_sample=False,
        assistant_model=assistant,
        output_attentions=True,
        return_dict_in_generate=True,
    )
    assert torch.equal(assisted.sequences, plain) and assisted.attentions is not None


# --- what Transformers' GenerationTesterMixin checks (its module is not in the sdist; see docs/transformers_suite.md),
# --- on capped models of every family: each against the uncached forward or the uncached generate
def _uncached(model, seq, full_mask, **kwargs):
    positions = (full_mask.long().cumsum(-1) - 1).masked_fill(full_mask == 0, 1)
    with torch.no_grad():
        return model(seq, attention_mask=full_mask, position_ids=positions, use_cache=False, **kwargs)


@pytest.mark.parametrize("family", FAMILY_NAMES)
@pytest.mark.parametrize("cache", [None, "static"])
def test_generate_returns_each_steps_attentions_and_hidden_states(family, cache):
    """``output_attentions``/``output_hidden_states`` in ``generate``: per step and layer, the prefill's square
    weights and each decoding step's row equal the uncached forward's at that position (a static cache's unused
    slots get weight 0)."""
    model = _patched(family, "qk_norm_cap", "qknorm")
    model.generation_config.pad_token_id = 0
    ids, mask = _prompt(padded=True, length=9)
    kwargs = {} if cache is None else {"cache_implementation": cache}
    out = model.generate(
        ids,
        attention_mask=mask,
        max_new_tokens=3,
        min_new_tokens=3,
        do_sample=False,
        output_attentions=True,
        output_hidden_states=True,
        return_dict_in_generate=True,
        **kwargs,
    )
    seq, t = out.sequences, ids.shape[1]
    full_mask = torch.cat([mask, torch.ones(2, seq.shape[1] - t, dtype=mask.dtype)], dim=1)
    ref = _uncached(model, seq, full_mask, output_attentions=True, output_hidden_states=True)
    assert len(out.attentions) == 3 and len(out.hidden_states) == 3
    for step, (attns, hiddens) in enumerate(zip(out.attentions, out.hidden_states)):
        rows = slice(0, t) if step == 0 else slice(t - 1 + step, t + step)
        keys = t + step
        assert len(attns) == model.config.num_hidden_layers
        for got, want in zip(attns, ref.attentions):
            assert torch.all(got[..., keys:] == 0)  # a static cache's unused slots
            torch.testing.assert_close(
                got[..., :keys],
                want[:, :, rows, :keys],
                rtol=2e-5,
                atol=2e-6,
                msg=lambda m: f"step {step}: {m}",  # noqa: B023 (called within the iteration)
            )
        real = full_mask[:, rows].bool()  # padding positions' states mean nothing (GPT-2 embeds them anyhow)
        for got, want in zip(hiddens, ref.hidden_states):
            torch.testing.assert_close(got[real], want[:, rows][real], rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
@pytest.mark.parametrize("mode", ["assistant", "prompt_lookup"])
def test_assisted_decoding_logits_match_the_uncached_forward(family, mode):
    """Candidate verification runs several new tokens against a cache: each accepted token's logits (asked
    together with the attention weights) equal the uncached forward's, and the text equals plain greedy decoding."""
    model = _patched(family, "qk_norm_cap", "qknorm")
    model.generation_config.pad_token_id = 0
    ids = torch.randint(1, VOCAB, (1, 10), generator=torch.Generator().manual_seed(3))
    ids[0, 5:8] = ids[0, :3]  # something for prompt lookup to find
    extra = (
        {"assistant_model": _patched(family, "qk_norm_cap", "qknorm")}
        if mode == "assistant"
        else {"prompt_lookup_num_tokens": 3}
    )
    plain = model.generate(ids, max_new_tokens=6, min_new_tokens=6, do_sample=False)
    out = model.generate(
        ids,
        max_new_tokens=6,
        min_new_tokens=6,
        do_sample=False,
        output_logits=True,
        output_attentions=True,
        return_dict_in_generate=True,
        **extra,
    )
    assert torch.equal(out.sequences, plain) and out.attentions is not None
    ref = _uncached(model, out.sequences, torch.ones_like(out.sequences)).logits
    for step, logits in enumerate(out.logits):
        torch.testing.assert_close(logits, ref[:, ids.shape[1] - 1 + step], rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_beam_search_with_a_cache_matches_beam_search_without(family):
    """Beam search reorders the cache between steps: with it, beams and scores equal those of beam search that
    recomputes every step without a cache."""
    model = _patched(family, "qk_norm_cap", "qknorm")
    model.generation_config.pad_token_id = 0
    ids, mask = _prompt(padded=True, length=8)
    runs = [
        model.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=4,
            min_new_tokens=4,
            num_beams=3,
            num_return_sequences=2,
            do_sample=False,
            output_scores=True,
            return_dict_in_generate=True,
            use_cache=use_cache,
        )
        for use_cache in (True, False)
    ]
    assert torch.equal(runs[0].sequences, runs[1].sequences)
    torch.testing.assert_close(runs[0].sequences_scores, runs[1].sequences_scores, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_generate_from_embeddings_and_continue_from_a_cache(family):
    """``inputs_embeds`` instead of ids gives the same tokens; generating 3 tokens and then 3 more from the returned
    cache gives the same tokens and logits as generating 6 at once."""
    model = _patched(family, "qk_norm_cap", "qknorm")
    model.generation_config.pad_token_id = 0
    ids = torch.randint(1, VOCAB, (2, 7), generator=torch.Generator().manual_seed(5))
    mask = torch.ones_like(ids)
    once = model.generate(
        ids,
        attention_mask=mask,
        max_new_tokens=6,
        min_new_tokens=6,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
    )
    embeds = model.get_input_embeddings()(ids)
    from_embeds = model.generate(
        inputs_embeds=embeds, attention_mask=mask, max_new_tokens=6, min_new_tokens=6, do_sample=False
    )
    assert torch.equal(from_embeds, once.sequences[:, ids.shape[1] :])
    first = model.generate(
        ids, attention_mask=mask, max_new_tokens=3, min_new_tokens=3, do_sample=False, return_dict_in_generate=True
    )
    more = model.generate(
        first.sequences,
        attention_mask=torch.ones_like(first.sequences),
        **cache_kwargs(model, output_cache(first)),
        max_new_tokens=3,
        min_new_tokens=3,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
    )
    assert torch.equal(more.sequences, once.sequences)
    for got, want in zip(more.logits, once.logits[3:]):
        torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)
