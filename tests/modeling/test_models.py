"""Whole-model behaviour: equivalences with other architectures, masks, generation, dtypes, peft."""

from __future__ import annotations

import pytest
import torch

import hf_qknorm
from hf_qknorm.upstream import cache_kwargs, output_cache
from tests._support.tiny_models import FAMILY_NAMES, VOCAB, tiny_model


def test_llama_rmsnorm_qk_norm_is_qwen3():
    """Llama + rmsnorm qk_norm is the Qwen3 architecture: same weights, same logits."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    llama = tiny_model("llama", head_dim=16)
    hf_qknorm.patch_model(llama, "qk_norm", norm="rmsnorm")
    with torch.no_grad():  # non-trivial norm gains
        for name, prm in llama.named_parameters():
            if "_norm" in name:
                prm.copy_(1 + 0.5 * torch.randn_like(prm))
    c = llama.config
    qcfg = Qwen3Config(
        vocab_size=c.vocab_size,
        hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_hidden_layers,
        num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads,
        head_dim=16,
        max_position_embeddings=128,
        rms_norm_eps=c.rms_norm_eps,
        rope_parameters=c.rope_parameters,
        tie_word_embeddings=False,
        attention_bias=False,
    )
    qwen = Qwen3ForCausalLM(qcfg).eval()
    qwen.load_state_dict(llama.state_dict(), strict=True)  # every key, both ways
    ids = torch.randint(0, VOCAB, (2, 19))
    torch.testing.assert_close(llama(ids).logits, qwen(ids).logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("scheme", ["qk_norm", "qkv_norm"])
def test_a_gemma2_on_sdpa_keeps_its_own_cap_when_patched(scheme):
    """sdpa cannot apply Gemma 2's own logit cap (``attn_logit_softcapping``): Transformers before 5.24 dropped it
    without a word, later ones raise. A scheme without a cap of its own patched onto a Gemma 2 on sdpa moves it to
    the "qknorm" backend, which applies the model's cap: the patched model computes what the same model patched on
    eager computes (Gemma 2's own attention), and verify's float64 reference finds the cap applied. (Before, on 5.4
    to 5.23, the patched model kept sdpa and dropped the cap: verify reported it, the self-check did not.)"""
    from transformers import Gemma2ForCausalLM

    eager = Gemma2ForCausalLM._from_config(_gemma2_config(2.0), attn_implementation="eager").eval()
    with torch.no_grad():  # q/k weights large enough that the cap of 2 bites
        for name, prm in eager.named_parameters():
            if "q_proj" in name or "k_proj" in name:
                prm.mul_(8)
    try:
        sdpa = Gemma2ForCausalLM._from_config(_gemma2_config(2.0), attn_implementation="sdpa").eval()
    except ValueError as exc:  # Transformers 5.24 and later refuse sdpa for Gemma 2 outright
        pytest.skip(f"this Transformers builds no Gemma 2 on sdpa ({str(exc)[:60]})")
    sdpa.load_state_dict(eager.state_dict())
    hf_qknorm.patch_model(eager, scheme)
    hf_qknorm.patch_model(sdpa, scheme)
    assert sdpa.config._attn_implementation == "qknorm"
    ids = torch.randint(0, VOCAB, (2, 20))
    with torch.no_grad():
        torch.testing.assert_close(sdpa(ids).logits, eager(ids).logits, rtol=1e-4, atol=1e-4)
    report = hf_qknorm.verify(sdpa)
    assert report.ok, str(report)


def _gemma2_config(cap: float):
    from transformers import Gemma2Config

    return Gemma2Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=128,
        sliding_window=8,
        attn_logit_softcapping=cap,
        query_pre_attn_scalar=16,
    )


def test_qknorm_attention_on_gemma2_matches_eager():
    """The "qknorm" backend applies Gemma 2's own softcap exactly like Gemma 2's eager attention."""
    from transformers import Gemma2ForCausalLM

    cfg = _gemma2_config(5.0)
    torch.manual_seed(0)
    eager = Gemma2ForCausalLM._from_config(cfg, attn_implementation="eager").eval()
    with torch.no_grad():  # large q/k weights so that the cap of 5 really bites
        for name, prm in eager.named_parameters():
            if "q_proj" in name or "k_proj" in name:
                prm.mul_(8)
    ours = Gemma2ForCausalLM._from_config(cfg, attn_implementation="qknorm").eval()
    ours.load_state_dict(eager.state_dict())
    ids = torch.randint(0, VOCAB, (2, 20))
    mask = torch.ones_like(ids)
    mask[1, :5] = 0  # left padding
    a = eager(ids, attention_mask=mask).logits
    b = ours(ids, attention_mask=mask).logits
    torch.testing.assert_close(b[0], a[0], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(b[1, 5:], a[1, 5:], rtol=1e-4, atol=1e-4)
    # and the cap matters here: without it the logits differ
    ours.config.attn_logit_softcapping = None
    for layer in ours.model.layers:
        layer.self_attn.attn_logit_softcapping = None
    assert (ours(ids, attention_mask=mask).logits[0] - a[0]).abs().max() > 1e-3


SCHEMES_FOR_MASKS = [("qk_norm_cap", "layernorm"), ("qkv_norm", "rmsnorm"), ("qk_norm", "lp")]


def _patched(family, scheme, norm, dtype=torch.float64):
    model = tiny_model(family, dtype=dtype)
    hf_qknorm.patch_model(model, scheme, norm=norm, p=3.0 if norm == "lp" else None)
    return model


@pytest.mark.parametrize("family", FAMILY_NAMES)
@pytest.mark.parametrize("scheme,norm", SCHEMES_FOR_MASKS)
@pytest.mark.parametrize("side", ["left", "right"])
def test_padded_batch_matches_unbatched(family, scheme, norm, side):
    model = _patched(family, scheme, norm)
    model.config.pad_token_id = 0
    torch.manual_seed(3)
    seqs = [torch.randint(1, VOCAB, (n,)) for n in (13, 7)]
    width = max(len(s) for s in seqs)
    ids = torch.zeros(2, width, dtype=torch.long)
    mask = torch.zeros(2, width, dtype=torch.long)
    for i, s in enumerate(seqs):
        sl = slice(width - len(s), width) if side == "left" else slice(0, len(s))
        ids[i, sl], mask[i, sl] = s, 1
    kwargs = {}
    if side == "left" and family != "gpt2":
        kwargs["position_ids"] = (mask.cumsum(-1) - 1).clamp_min(0)
    if side == "left" and family == "gpt2":
        kwargs["position_ids"] = (mask.cumsum(-1) - 1).clamp_min(0)
    batched = model(ids, attention_mask=mask, **kwargs).logits
    assert torch.isfinite(batched).all()
    for i, s in enumerate(seqs):
        single = model(s[None]).logits[0]
        sl = slice(width - len(s), width) if side == "left" else slice(0, len(s))
        torch.testing.assert_close(batched[i, sl], single, rtol=1e-7, atol=1e-7)


@pytest.mark.parametrize("family", FAMILY_NAMES)
@pytest.mark.parametrize("scheme,norm", SCHEMES_FOR_MASKS)
def test_packed_sequences_match_separate(family, scheme, norm):
    """Packing with restarting position_ids (DataCollatorWithFlattening) gives each sequence's own logits."""
    from transformers import DataCollatorWithFlattening

    model = _patched(family, scheme, norm)
    torch.manual_seed(4)
    seqs = [torch.randint(1, VOCAB, (n,)) for n in (9, 5, 11)]
    batch = DataCollatorWithFlattening(return_tensors="pt")([{"input_ids": s.tolist()} for s in seqs])
    packed = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits[0]
    start = 0
    for s in seqs:
        single = model(s[None]).logits[0]
        torch.testing.assert_close(packed[start : start + len(s)], single, rtol=1e-7, atol=1e-7)
        start += len(s)


@pytest.mark.parametrize("family", FAMILY_NAMES)
@pytest.mark.parametrize("scheme,norm", SCHEMES_FOR_MASKS + [("soft_cap", None)])
def test_generate_with_cache_matches_uncached(family, scheme, norm):
    model = _patched(family, scheme, norm, dtype=torch.float32)
    model.generation_config.pad_token_id = 0
    prompt = torch.randint(1, VOCAB, (1, 6), generator=torch.Generator().manual_seed(5))
    cached = model.generate(prompt, max_new_tokens=8, do_sample=False, use_cache=True)
    ids = prompt
    for _ in range(8):  # uncached greedy decoding, one full forward per token
        nxt = model(ids, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)
        ids = torch.cat([ids, nxt], dim=1)
    assert torch.equal(cached, ids)
    # and the cached logits equal the full-sequence logits
    out = model(cached[:, :-1], use_cache=False).logits
    step = model(cached[:, :-2], use_cache=True)
    last = model(cached[:, -2:-1], use_cache=True, **cache_kwargs(model, output_cache(step))).logits
    torch.testing.assert_close(last[:, -1], out[:, -1], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_bf16_model(family):
    model = tiny_model(family, dtype=torch.bfloat16)
    hf_qknorm.patch_model(model, "qk_norm_cap")
    for name, prm in model.named_parameters():
        assert prm.dtype == torch.bfloat16, name
    ids = torch.randint(0, VOCAB, (2, 16))
    loss = model(ids, labels=ids).loss
    loss.backward()
    assert torch.isfinite(loss)
    ref = tiny_model(family, dtype=torch.float32)
    hf_qknorm.patch_model(ref, "qk_norm_cap")
    ref.load_state_dict({k: v.float() for k, v in model.state_dict().items()})
    torch.testing.assert_close(model(ids).logits.float(), ref(ids).logits, rtol=0.1, atol=0.1)


def test_peft_wrapped_model():
    from peft import LoraConfig, get_peft_model

    model = tiny_model("llama")
    peft_model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "k_proj", "v_proj"], lora_dropout=0.0))
    out = hf_qknorm.patch_model(peft_model, "qk_norm_cap")
    assert out is peft_model
    attn = peft_model.get_base_model().model.layers[0].self_attn
    assert hasattr(attn, "q_norm") and hasattr(attn, "k_norm")
    ids = torch.randint(0, VOCAB, (2, 10))
    peft_model(ids, labels=ids).loss.backward()


def test_qkv_norm_folds_prenorm_gain():
    """qkv_norm removes input_layernorm and folds its gain into q/k/v; with scale-invariant norms the
    attention output equals the original block's with its pre-norm (bias-free Llama)."""
    model = tiny_model("llama", dtype=torch.float64)
    block = model.model.layers[0]
    with torch.no_grad():
        block.input_layernorm.weight.copy_(1 + 0.5 * torch.randn(64, dtype=torch.float64))
    gain = block.input_layernorm.weight.detach().clone()
    w_before = block.self_attn.q_proj.weight.detach().clone()
    x = torch.randn(1, 7, 64, dtype=torch.float64)
    pos = torch.arange(7)[None]
    rope = model.model.rotary_emb(x, pos)
    normed = block.input_layernorm(x)
    hf_qknorm.patch_model(model, "qkv_norm", norm="rmsnorm", eps=1e-30)
    assert isinstance(block.input_layernorm, torch.nn.Identity)
    torch.testing.assert_close(block.self_attn.q_proj.weight, w_before * gain[None, :])
    out = block.self_attn(x, position_embeddings=rope, attention_mask=None)[0]
    # the same layer fed the original pre-normed input, with the gain divided back out
    for name in ("q_proj", "k_proj", "v_proj"):
        getattr(block.self_attn, name).weight.data.div_(gain[None, :])
    ref = block.self_attn(normed, position_embeddings=rope, attention_mask=None)[0]
    # LlamaRMSNorm (the original pre-norm) computes in float32, hence 1e-6 rather than float64 precision
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)


def test_gpt2_qkv_norm_folds_layernorm_bias():
    model = tiny_model("gpt2", dtype=torch.float64)
    block = model.transformer.h[0]
    with torch.no_grad():
        block.ln_1.weight.copy_(1 + 0.3 * torch.randn(64, dtype=torch.float64))
        block.ln_1.bias.copy_(0.3 * torch.randn(64, dtype=torch.float64))
    x = torch.randn(1, 5, 64, dtype=torch.float64)
    expected = block.attn.c_attn(block.ln_1(x))  # projections of the original pre-normed input
    n = torch.nn.functional.layer_norm(x, (64,), eps=block.ln_1.eps)
    hf_qknorm.patch_model(model, "qkv_norm")
    assert isinstance(block.ln_1, torch.nn.Identity)
    # the folded Conv1D weights on the normalised input (calling c_attn itself would also apply the new norms)
    c_attn = block.attn.c_attn
    torch.testing.assert_close(n @ c_attn.weight + c_attn.bias, expected, rtol=1e-10, atol=1e-10)


def test_two_models_in_one_process():
    a, b = tiny_model("llama"), tiny_model("llama")
    ids = torch.randint(0, VOCAB, (1, 12))
    before = b(ids).logits
    hf_qknorm.patch_model(a, "qk_norm_cap")
    assert type(b).__name__ == "LlamaForCausalLM" and not hasattr(b.model.layers[0].self_attn, "q_norm")
    torch.testing.assert_close(b(ids).logits, before)
