"""Every scheme x norm x family equals the float64 reference written from the formulas (forward and gradients)."""

from __future__ import annotations

import pytest
import torch

import hf_qknorm
from hf_qknorm.reference import allowed_reference, attention_layer_reference, norm_reference
from tests._support.tiny_models import FAMILY_NAMES, tiny_model

COMBOS = [("soft_cap", None)] + [
    (s, n) for s in ("qk_norm", "qk_norm_cap", "qkv_norm") for n in ("layernorm", "rmsnorm", "l2", "lp")
]


def _randomise_norms(model, gen):
    """Move every new norm away from identity so the test sees its weights."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if any(f"{n}." in name for n in ("q_norm", "k_norm", "v_norm")):
                if param.numel() == 1:  # lp logit scale
                    param.fill_(2.0 + torch.rand((), generator=gen).item())
                elif name.endswith("bias"):
                    param.copy_(0.2 * torch.randn(param.shape, generator=gen))
                else:
                    param.copy_(1 + 0.3 * torch.randn(param.shape, generator=gen))


def _layer_weights(attn, family):
    """(wq, wk, wv, wo, bq, bk, bv, bo) as (out, in) matrices from either projection layout."""
    f = hf_qknorm.get_family(family)
    if f.fused_qkv:
        w, b = attn.c_attn.weight.T, attn.c_attn.bias
        e = w.shape[1]
        return (
            w[:e],
            w[e : 2 * e],
            w[2 * e :],
            attn.c_proj.weight.T,
            b[:e],
            b[e : 2 * e],
            b[2 * e :],
            attn.c_proj.bias,
        )
    lin = [getattr(attn, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj")]
    return tuple(l.weight for l in lin) + tuple(l.bias for l in lin)


def _norm_params(module):
    if module is None:
        return None
    return {"weight": getattr(module, "weight", None), "bias": getattr(module, "bias", None)}


def _run_layer(model, family, x, backend):
    """Run block 0's attention. Transformers' own sdpa takes the sliding window from the mask only, so it gets an
    explicit boolean mask; "qknorm" gets ``None`` and must apply causality and the window itself."""
    if backend is not None:
        model.set_attn_implementation(backend)
    block = (model.transformer.h if family == "gpt2" else model.model.layers)[0]
    attn = block.attn if family == "gpt2" else block.self_attn
    mask = None
    if backend == "sdpa":
        window = getattr(attn, "sliding_window", getattr(model.config, "sliding_window", None))
        mask = allowed_reference(
            x.shape[1], x.shape[1], causal=True, sliding_window=window if family != "gpt2" else None
        )
    if family == "gpt2":
        return attn, None, attn(x, attention_mask=mask)[0]
    pos = torch.arange(x.shape[1])[None].expand(x.shape[0], -1)
    cos, sin = model.model.rotary_emb(x, pos)
    return attn, (cos, sin), attn(x, position_embeddings=(cos, sin), attention_mask=mask)[0]


def _reference(attn, family, x, rope, cfg, model):
    wq, wk, wv, wo, bq, bk, bv, bo = _layer_weights(attn, family)
    heads = model.config.num_attention_heads
    kv_heads = getattr(model.config, "num_key_value_heads", heads)
    scaling = 1.0 if cfg.norm in ("l2", "lp") else attn.scaling
    window = (
        getattr(attn, "sliding_window", getattr(model.config, "sliding_window", None)) if family != "gpt2" else None
    )
    cos, sin = rope if rope is not None else (None, None)
    return attention_layer_reference(
        x,
        wq=wq,
        wk=wk,
        wv=wv,
        wo=wo,
        bq=bq,
        bk=bk,
        bv=bv,
        bo=bo,
        heads=heads,
        kv_heads=kv_heads,
        head_dim=attn.head_dim,
        scaling=scaling,
        softcap=cfg.softcap,
        norm=cfg.norm or "rmsnorm",
        q_norm=_norm_params(getattr(attn, "q_norm", None)),
        k_norm=_norm_params(getattr(attn, "k_norm", None)),
        v_norm=_norm_params(getattr(attn, "v_norm", None)),
        cos=cos,
        sin=sin,
        causal=True,
        sliding_window=window,
        eps=cfg.eps,
        p=cfg.p or 2.0,
    )


@pytest.mark.parametrize("family", FAMILY_NAMES)
@pytest.mark.parametrize("scheme,norm", COMBOS)
def test_layer_matches_reference(family, scheme, norm):
    gen = torch.Generator().manual_seed(1)
    model = tiny_model(family, dtype=torch.float64)
    kwargs = {"p": 3.0} if norm == "lp" else {}
    hf_qknorm.patch_model(model, scheme, norm=norm, **kwargs)
    _randomise_norms(model, gen)
    cfg = hf_qknorm.qknorm_config(model)
    backends = ["qknorm"] if cfg.caps else ["sdpa", "qknorm"]
    # large inputs so that the cap (set low) really engages
    x = 4 * torch.randn(2, 21, model.config.hidden_size, generator=gen, dtype=torch.float64)
    for backend in backends:
        x_ = x.clone().requires_grad_(True)
        attn, rope, out = _run_layer(model, family, x_, backend)
        ref_x = x.clone().requires_grad_(True)
        ref = _reference(attn, family, ref_x, rope, cfg, model)
        # Qwen3's own q/k RMSNorm (kept by soft_cap) computes in float32 even for float64 inputs
        tol = 1e-4 if (family == "qwen3" and scheme == "soft_cap") else 1e-6
        torch.testing.assert_close(out, ref, rtol=tol, atol=tol)
        # gradients of input and of every parameter of the attention module
        g_out = torch.randn(out.shape, generator=gen, dtype=torch.float64)
        params = [p for p in attn.parameters()]
        grads = torch.autograd.grad(out, [x_] + params, g_out)
        ref_grads = torch.autograd.grad(ref, [ref_x] + params, g_out, allow_unused=True)
        for g, rg in zip(grads, ref_grads):
            torch.testing.assert_close(g, rg if rg is not None else torch.zeros_like(g), rtol=tol, atol=tol)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_cap_engages(family):
    """With a low cap the capped layer must differ from the uncapped one (the cap is applied, not dropped)."""
    x = 4 * torch.randn(1, 9, 64, dtype=torch.float64)
    outs = []
    for scheme, cap in (("qk_norm", None), ("qk_norm_cap", 0.5)):
        model = tiny_model(family, dtype=torch.float64)
        hf_qknorm.patch_model(model, scheme, softcap=cap)
        outs.append(_run_layer(model, family, x, None)[2])
    assert (outs[0] - outs[1]).abs().max() > 1e-3


def test_norms_match_reference():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 4, 24, generator=gen, dtype=torch.float64)
    from hf_qknorm.portable.norms import make_norm

    for kind, p in (("layernorm", None), ("rmsnorm", None), ("l2", None), ("lp", 2.5), ("lp", 4.0)):
        for role in ("q", "k", "v"):
            m = make_norm(kind, role, 24, 1e-6, p, logit_scale=3.0).double()
            with torch.no_grad():
                for prm in m.parameters():
                    prm.add_(0.1 * torch.randn(prm.shape, generator=gen, dtype=torch.float64))
            ref = norm_reference(x, kind, getattr(m, "weight", None), getattr(m, "bias", None), 1e-6, p or 2.0)
            torch.testing.assert_close(m(x), ref, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("weights", ["same", "float32"])
def test_half_precision_norms_match_the_float32_form(dtype, weights):
    """Half-precision norms compute in float32 and round once (the layer norm as one ATen call when its parameters
    share the input's dtype, else around a float32 norm): within one rounding of the float64 reference, the input's
    dtype out -- under autocast too, which would run layer_norm in float32 -- and gradients that match the float32
    form's."""
    from hf_qknorm.portable.norms import make_norm

    gen = torch.Generator().manual_seed(1)
    x64 = 3 * torch.randn(2, 7, 4, 64, generator=gen, dtype=torch.float64)
    for kind in ("layernorm", "rmsnorm"):
        m = make_norm(kind, "q", 64, 1e-5, None).double()
        with torch.no_grad():
            for prm in m.parameters():
                prm.add_(0.2 * torch.randn(prm.shape, generator=gen, dtype=torch.float64))
        ref = norm_reference(x64, kind, m.weight, getattr(m, "bias", None), 1e-5, 2.0)
        half = m.to(dtype if weights == "same" else torch.float32)
        with torch.no_grad():
            want_bits = {p: prm.to(dtype).double() for p, prm in half.named_parameters()}
            for p, prm in half.named_parameters():
                prm.copy_(want_bits[p])  # the same values in every variant: the parameters as the half dtype holds them
        ref = norm_reference(x64.to(dtype).double(), kind, want_bits["weight"], want_bits.get("bias"), 1e-5, 2.0)
        x = x64.to(dtype).requires_grad_()
        y = half(x)
        # the input's dtype; Qwen3's RMSNorm (which rmsnorm is, bit for bit) promotes to its weight's
        out_dtype = torch.promote_types(dtype, half.weight.dtype) if kind == "rmsnorm" else dtype
        assert y.dtype == out_dtype
        # one rounding of the float32 result (the weight product for rmsnorm rounds once more, as Qwen3's does)
        torch.testing.assert_close(y.double(), ref, rtol=2 * torch.finfo(dtype).eps, atol=1e-6)
        with torch.autocast("cpu", dtype=dtype):
            assert half(x).dtype == out_dtype
        if torch.cuda.is_available():  # CUDA's autocast runs layer_norm in float32: the norm casts back
            with torch.no_grad(), torch.autocast("cuda", dtype=dtype):
                assert half.cuda()(x.cuda()).dtype == out_dtype
            half.cpu()
        if kind == "layernorm":  # gradients against the float32 form's (the casts' backward rounds once)
            up = torch.randn(y.shape, generator=gen).to(dtype)
            y.backward(up)
            x32 = x.detach().float().requires_grad_()
            w32, b32 = (half.weight.detach().float().requires_grad_(), half.bias.detach().float().requires_grad_())
            torch.nn.functional.layer_norm(x32, (64,), w32, b32, 1e-5).backward(up.float())
            for got, want in ((x.grad, x32.grad), (half.weight.grad, w32.grad), (half.bias.grad, b32.grad)):
                tol = 4 * torch.finfo(dtype).eps * want.abs().max().item()  # a few roundings of the largest entry
                torch.testing.assert_close(got.float(), want, rtol=0, atol=tol)


@pytest.mark.parametrize("scheme,norm", [("qk_norm_cap", "layernorm"), ("qkv_norm", "rmsnorm"), ("qk_norm", "lp")])
def test_gradcheck_patched_layer(scheme, norm):
    model = tiny_model(
        "llama", dtype=torch.float64, hidden_size=16, num_attention_heads=2, num_key_value_heads=1, intermediate_size=32
    )
    hf_qknorm.patch_model(
        model, scheme, norm=norm, softcap=2.0 if "cap" in scheme else None, p=3.0 if norm == "lp" else None
    )
    attn = model.model.layers[0].self_attn
    x = torch.randn(1, 5, 16, dtype=torch.float64, requires_grad=True)
    pos = torch.arange(5)[None]
    rope = model.model.rotary_emb(x, pos)
    assert torch.autograd.gradcheck(lambda h: attn(h, position_embeddings=rope, attention_mask=None)[0], (x,))


def test_a_prefix_attends_both_ways_over_causality_and_the_window():
    """A prefix-LM's mask (PaliGemma's): causal within the sliding window, or both in the prefix, then the padding.
    Worked by hand for five positions, a window of 2 and a prefix of 3, with the last key padded in row 1."""
    prefix = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 0, 0]], dtype=torch.bool)
    padding = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 1, 0]], dtype=torch.bool)[:, None, None, :]
    got = allowed_reference(5, 5, causal=True, sliding_window=2, mask=padding, prefix=prefix)
    want = torch.tensor(
        [[1, 1, 1, 0, 0], [1, 1, 1, 0, 0], [1, 1, 1, 0, 0], [0, 0, 1, 1, 0], [0, 0, 0, 1, 1]], dtype=torch.bool
    )
    assert torch.equal(got[0, 0], want)
    want[:, 4] = False  # row 1's padded key
    assert torch.equal(got[1, 0], want)
    # one decoding query at position 4, outside the prefix: causal within the window only
    step = allowed_reference(1, 5, causal=True, sliding_window=2, prefix=prefix)
    assert torch.equal(step[0, 0, 0], torch.tensor([0, 0, 0, 1, 1], dtype=torch.bool))
