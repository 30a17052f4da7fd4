"""Backend semantics the model types beyond Llama need: whose cap applies (a patched module's scheme cap over the
``softcap=`` a model passes), attention sinks (``s_aux``, gpt-oss), and the keywords the backend honours.

Every expected value comes from a float64 computation written here or from the model's own ``eager`` attention,
never from hf_qknorm."""

from __future__ import annotations

import pytest
import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, eager_mask

import hf_qknorm  # noqa: F401  (registers "qknorm")
from hf_qknorm.attention import KernelFallbackError, kernel_policy
from hf_qknorm.attention.chunked import chunked_attention
from hf_qknorm.attention.interface import HONOURED_KWARGS

VOCAB = 128
REF = "test_reference_f64"
_REF_CAP = {"value": None}  # the cap the reference applies, whatever the model passes


def reference_attention(module, query, key, value, attention_mask, scaling, dropout=0.0, s_aux=None, **kwargs):
    """Float64 attention from the formulas: ``softmax(mask(c*tanh(s/c)) [+ sink]) v`` with the test's cap; the
    mask is Transformers' additive eager mask."""
    groups = query.shape[1] // key.shape[1]
    q = query.double()
    k = key.double().repeat_interleave(groups, 1)
    v = value.double().repeat_interleave(groups, 1)
    s = q @ k.transpose(-1, -2) * scaling
    if _REF_CAP["value"] is not None:
        s = _REF_CAP["value"] * torch.tanh(s / _REF_CAP["value"])
    if attention_mask is not None:
        s = s + attention_mask.double()
    if s_aux is not None:
        sink = s_aux.double().view(1, -1, 1, 1).expand(*s.shape[:-1], 1)
        p = torch.softmax(torch.cat([s, sink], -1), -1)[..., :-1]
    else:
        p = torch.softmax(s, -1)
    return (p @ v).to(query.dtype).transpose(1, 2).contiguous(), None


AttentionInterface.register(REF, reference_attention)
AttentionMaskInterface.register(REF, eager_mask)


def _gemma2(attn, cap=5.0, seed=0):
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
        sliding_window=6,
        attn_logit_softcapping=cap,
        query_pre_attn_scalar=16,
    )
    torch.manual_seed(seed)
    model = Gemma2ForCausalLM._from_config(cfg, attn_implementation=attn).double().eval()
    with torch.no_grad():  # large q/k weights so that a cap of a few units really bites
        for name, prm in model.named_parameters():
            if "q_proj" in name or "k_proj" in name:
                prm.mul_(8)
    return model


def _batch(pad=True):
    """Two rows of 11 tokens, the second left-padded by 3 with ``pad`` (Gemma 2's eager attention turns a padded
    row into NaN in float64, so its tests run unpadded)."""
    torch.manual_seed(1)
    ids = torch.randint(0, VOCAB, (2, 11))
    mask = torch.ones_like(ids)
    if pad:
        mask[1, :3] = 0
    return ids, mask


def _logits(model, ids, mask):
    with torch.no_grad():
        out = model(ids, attention_mask=mask).logits
    return torch.cat([out[0], out[1, 3:]])  # the padded positions' logits mean nothing


@pytest.fixture
def ref_cap():
    yield _REF_CAP
    _REF_CAP["value"] = None


def test_unpatched_gemma2_gets_its_own_cap(ref_cap):
    """An unpatched Gemma 2 on "qknorm": the softcap its forward passes is applied (sdpa would drop it)."""
    ours = _gemma2("qknorm")
    ids, mask = _batch(pad=False)
    ref_cap["value"] = 5.0
    expected = _logits(_gemma2(REF), ids, mask)
    got = _logits(ours, ids, mask)
    torch.testing.assert_close(got, expected, rtol=1e-9, atol=1e-9)
    # Gemma 2's own eager attention agrees to its precision (its softmax runs in float32)
    torch.testing.assert_close(got, _logits(_gemma2("eager"), ids, mask), rtol=1e-5, atol=1e-5)
    ref_cap["value"] = None
    assert (_logits(_gemma2(REF), ids, mask) - expected).abs().max() > 1e-2  # the cap bites in this model


def _carry_scheme_cap(model, cap):
    """What patching leaves on each attention module: its scheme's cap (hf_qknorm.portable.hooks.install)."""
    for layer in model.model.layers:
        layer.self_attn.__dict__["_qknorm_softcap"] = cap


def test_scheme_cap_overrides_the_cap_the_model_passes(ref_cap):
    """A module carrying a scheme cap: the scheme's cap applies, not the ``softcap=`` Gemma 2's forward passes."""
    ours = _gemma2("qknorm", cap=5.0)
    _carry_scheme_cap(ours, 2.0)
    ref_cap["value"] = 2.0
    ref = _gemma2(REF, cap=5.0)
    ids, mask = _batch(pad=False)
    expected = _logits(ref, ids, mask)
    torch.testing.assert_close(_logits(ours, ids, mask), expected, rtol=1e-9, atol=1e-9)
    assert (_logits(_gemma2("eager", cap=5.0), ids, mask) - expected).abs().max() > 1e-2  # 2 and 5 differ here


def test_cap_rule_on_the_materialising_path(ref_cap):
    """``output_attentions`` takes the path that materialises the weights: the same rule."""
    ours = _gemma2("qknorm", cap=5.0)
    _carry_scheme_cap(ours, 2.0)
    ref_cap["value"] = 2.0
    ids, mask = _batch(pad=False)
    with torch.no_grad():
        out = ours(ids, attention_mask=mask, output_attentions=True)
    got = torch.cat([out.logits[0], out.logits[1, 3:]])
    torch.testing.assert_close(got, _logits(_gemma2(REF, cap=5.0), ids, mask), rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("scheme_cap", [None, 2.0])
def test_cap_rule_on_the_kernels(kernels_on_cpu, ref_cap, scheme_cap):
    """The Triton kernels (through the interpreter) follow the same rule."""
    ours = _gemma2("qknorm", cap=5.0).float()
    if scheme_cap is not None:
        _carry_scheme_cap(ours, scheme_cap)
    ref_cap["value"] = 5.0 if scheme_cap is None else scheme_cap
    ids, mask = _batch(pad=False)
    expected = _logits(_gemma2(REF, cap=5.0), ids, mask)
    with kernel_policy(devices=("cuda", "cpu"), use_fallback=False):
        got = _logits(ours, ids, mask)
    torch.testing.assert_close(got.double(), expected, rtol=2e-4, atol=2e-4)


# ---- attention sinks ----


def _gpt_oss(attn, seed=0):
    from transformers import GptOssConfig, GptOssForCausalLM

    cfg = GptOssConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=6,
        max_position_embeddings=128,
    )
    torch.manual_seed(seed)
    model = GptOssForCausalLM._from_config(cfg, attn_implementation=attn, experts_implementation="eager")
    model = model.double().eval()
    with torch.no_grad():  # sinks large enough to take a real share of each row's softmax, both signs
        for layer in model.model.layers:
            layer.self_attn.sinks.copy_(torch.tensor([2.0, -1.0, 0.5, 3.0]))
            layer.self_attn.q_proj.weight.mul_(4)
    return model


def test_sinks_match_gpt_oss_eager_forward_and_gradients():
    """gpt-oss on "qknorm" equals its own eager attention (sinks in the softmax denominator), loss gradients
    included -- the sinks' own among them."""
    ours, eager = _gpt_oss("qknorm"), _gpt_oss("eager")
    ids, mask = _batch()
    for model in (ours, eager):
        model.train()  # attention dropout is 0 in the config
        model(ids, attention_mask=mask, labels=ids).loss.backward()
    torch.testing.assert_close(_logits(ours.eval(), ids, mask), _logits(eager.eval(), ids, mask), rtol=1e-9, atol=1e-9)
    grads = dict(eager.named_parameters())
    for name, prm in ours.named_parameters():
        if "self_attn" in name:
            torch.testing.assert_close(prm.grad, grads[name].grad, rtol=1e-8, atol=1e-10, msg=name)
    assert ours.model.layers[0].self_attn.sinks.grad.abs().min() > 1e-6  # the sinks' gradient is really there


def test_sinks_matter_in_this_model(ref_cap):
    ids, mask = _batch()
    ours = _gpt_oss("qknorm")
    with torch.no_grad():
        for layer in ours.model.layers:
            layer.self_attn.sinks.fill_(-1e4)  # a sink that takes no share: plain softmax
    assert (_logits(ours, ids, mask) - _logits(_gpt_oss("eager"), ids, mask)).abs().max() > 1e-2


def test_sinks_with_a_scheme_cap(ref_cap):
    """With a cap, the cap applies to the q.k logits and not to the sink, which joins the denominator as it is
    (gpt-oss's eager attention adds the sink to logits it never caps)."""
    ours = _gpt_oss("qknorm")
    _carry_scheme_cap(ours, 1.5)
    ref_cap["value"] = 1.5
    ids, mask = _batch()
    torch.testing.assert_close(_logits(ours, ids, mask), _logits(_gpt_oss(REF), ids, mask), rtol=1e-9, atol=1e-9)


def test_sinks_in_cached_generation():
    """Greedy decoding with the dynamic cache: each step's logits equal gpt-oss eager's."""
    ids, mask = _batch()
    runs = []
    for attn in ("qknorm", "eager"):
        out = _gpt_oss(attn).generate(
            ids,
            attention_mask=mask,
            max_new_tokens=6,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
            pad_token_id=0,
        )
        runs.append(torch.stack(out.logits))
    torch.testing.assert_close(runs[0], runs[1], rtol=1e-9, atol=1e-9)


def _sink_reference(q, k, v, sink, scaling, softcap, causal):
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    s = q @ k.transpose(-1, -2) * scaling
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    if causal:
        tq, tk = s.shape[-2:]
        allowed = torch.arange(tk)[None, :] <= torch.arange(tq)[:, None] + (tk - tq)
        s = s.masked_fill(~allowed, float("-inf"))
    full = torch.cat([s, sink.view(1, -1, 1, 1).expand(*s.shape[:-1], 1)], -1)
    return torch.softmax(full, -1)[..., :-1] @ v


@pytest.mark.parametrize("softcap", [None, 3.0])
@pytest.mark.parametrize("shape", [(2, 4, 7, 7), (1, 4, 1, 9), (2, 2, 5, 12)])
def test_tiled_attention_with_sinks_float64(softcap, shape):
    """The tiled path's sink: output and every gradient (q, k, v, sink) against autograd through the formula."""
    b, h, tq, tk = shape
    torch.manual_seed(2)
    q = (torch.randn(b, h, tq, 8, dtype=torch.float64) * 2).requires_grad_()
    k = torch.randn(b, 2 if h == 4 else h, tk, 8, dtype=torch.float64).requires_grad_()
    v = torch.randn_like(k).requires_grad_()
    sink = (torch.randn(h, dtype=torch.float64) * 2).requires_grad_()
    got = chunked_attention(q, k, v, scaling=0.5, softcap=softcap, causal=True, sink=sink)
    want = _sink_reference(q, k, v, sink, 0.5, softcap, True)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    cot = torch.randn_like(want)
    g_got = torch.autograd.grad(got, (q, k, v, sink), cot)
    g_want = torch.autograd.grad(want, (q, k, v, sink), cot)
    for name, a, e in zip("qkv", g_got, g_want):
        torch.testing.assert_close(a, e, rtol=1e-9, atol=1e-11, msg=name)
    torch.testing.assert_close(g_got[3], g_want[3], rtol=1e-9, atol=1e-11, msg="sink")


def test_a_row_with_no_key_and_a_sink_gives_zeros():
    q = torch.randn(1, 2, 3, 4, dtype=torch.float64)
    k = torch.randn(1, 2, 3, 4, dtype=torch.float64)
    mask = torch.ones(1, 1, 3, 3, dtype=torch.bool)
    mask[..., 1, :] = False
    out = chunked_attention(q, k, k, scaling=1.0, mask=mask, causal=False, sink=torch.zeros(2, dtype=torch.float64))
    assert torch.equal(out[:, :, 1], torch.zeros_like(out[:, :, 1]))
    assert out[:, :, 0].abs().sum() > 0


def test_sinks_refused_by_the_kernels_without_fallback(kernels_on_cpu):
    """The kernels have no sink: under use_fallback=False such a call is refused, naming the reason; with the
    fallback it takes the PyTorch path and gives gpt-oss eager's logits."""
    ids, mask = _batch()
    ours = _gpt_oss("qknorm").float()
    with kernel_policy(devices=("cuda", "cpu"), use_fallback=False):
        with pytest.raises(KernelFallbackError, match="attention sinks"):
            ours(ids, attention_mask=mask)
    with kernel_policy(devices=("cuda", "cpu")):
        got = _logits(ours, ids, mask)
    torch.testing.assert_close(got.double(), _logits(_gpt_oss("eager"), ids, mask), rtol=1e-4, atol=1e-4)


def test_sink_of_the_wrong_shape_is_refused():
    from hf_qknorm.attention.interface import qknorm_attention_forward

    module = torch.nn.Module()
    q = torch.randn(1, 4, 3, 8)
    with pytest.raises(ValueError, match=r"s_aux .*\(4,\), got \(2,\)"):
        qknorm_attention_forward(module, q, q[:, :2], q[:, :2], None, s_aux=torch.zeros(2))


# ---- the keywords the backend honours ----


def test_honoured_kwargs_cover_what_decoder_models_pass():
    """Every keyword these decoder models' forwards pass to the attention function with a value (recorded from real
    calls: training with labels, generation, packed position_ids) is in HONOURED_KWARGS; keywords that would change
    the attention and that the backend does not apply are not."""
    from transformers import AutoModelForCausalLM
    from transformers.masking_utils import sdpa_mask

    from hf_qknorm.attention.interface import qknorm_attention_forward
    from tests._support.tiny_models import tiny_config

    seen: set[str] = set()

    def record(module, q, k, v, mask, **kwargs):
        seen.update(name for name, value in kwargs.items() if value is not None)
        return qknorm_attention_forward(module, q, k, v, mask, **kwargs)

    AttentionInterface.register("test_record", record)
    AttentionMaskInterface.register("test_record", sdpa_mask)
    configs = [tiny_config(f) for f in ("llama", "mistral", "qwen3", "gpt2")]
    configs += [_gemma2("eager").config, _gpt_oss("eager").config]
    for cfg in configs:
        extra = {"experts_implementation": "eager"} if cfg.model_type == "gpt_oss" else {}
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation="test_record", **extra)
        ids = torch.randint(0, VOCAB, (2, 9))
        model.train()
        model(ids, labels=ids)
        model.eval()
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=2, do_sample=False, pad_token_id=0)
        model(ids[:1], position_ids=torch.tensor([[0, 1, 2, 0, 1, 2, 3, 0, 1]]))
    assert {"s_aux", "softcap", "sliding_window", "position_ids", "scaling", "dropout"} <= seen
    assert seen <= HONOURED_KWARGS, sorted(seen - HONOURED_KWARGS)
    assert not {"position_bias", "indices", "block_indices", "seq_idx", "sinks"} & HONOURED_KWARGS
