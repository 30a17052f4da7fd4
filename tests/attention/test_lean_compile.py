"""torch.compile keeps every scheme whole, training and decoding: no graph break (``torch._dynamo.explain``) in a
training step or in a decoding step (the lean path) with a static or dynamic cache, and a compiled decoding loop
with a static cache (``fullgraph=True``) gives eager's logits. Compiled with ``aot_eager`` (Dynamo and AOTAutograd
decide graph breaks; Inductor's code generation takes minutes on a CPU)."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache, StaticCache

import hf_qknorm
from hf_qknorm.upstream import cache_kwargs
from tests._support.tiny_models import VOCAB, tiny_model

SCHEMES = ("qk_norm", "soft_cap", "qk_norm_cap", "qkv_norm")


def _patched(scheme, family="llama"):
    model = tiny_model(family)
    hf_qknorm.patch_model(model, scheme, softcap=2.0 if "cap" in scheme else None)
    return model.eval()


def _prompt():
    return torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("scheme", SCHEMES)
def test_training_step_compiles_without_graph_breaks(scheme):
    model = _patched(scheme).train()
    ids = _prompt()
    torch._dynamo.reset()
    explanation = torch._dynamo.explain(model)(ids, labels=ids)
    assert explanation.graph_break_count == 0, [r.reason for r in explanation.break_reasons]


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("cache_kind", ["static", "dynamic"])
def test_decoding_step_compiles_without_graph_breaks(scheme, cache_kind, monkeypatch):
    from hf_qknorm.attention import lean

    calls = []
    real = lean.lean_attention
    monkeypatch.setattr(lean, "lean_attention", lambda *a, **k: calls.append(1) or real(*a, **k))
    model = _patched(scheme)
    ids = _prompt()
    cache = (
        StaticCache(config=model.config, max_cache_len=32)
        if cache_kind == "static"
        else DynamicCache(config=model.config)
    )
    with torch.no_grad():
        out = model(ids, use_cache=True, **cache_kwargs(model, cache))
        nxt = out.logits[:, -1:].argmax(-1)
        torch._dynamo.reset()
        explanation = torch._dynamo.explain(model)(
            nxt, use_cache=True, **cache_kwargs(model, cache), cache_position=torch.tensor([ids.shape[1]])
        )
    in_attention = [
        r
        for r in explanation.break_reasons
        if any("hf_qknorm" in frame.filename or "Attention" in frame.name for frame in r.user_stack)
    ]
    assert in_attention == [], [r.reason for r in in_attention]
    if "cap" in scheme:  # the capped decoding step was traced through the lean path
        assert calls
    if cache_kind == "static":
        assert explanation.graph_break_count == 0, [r.reason for r in explanation.break_reasons]


@pytest.mark.parametrize("scheme", ["qk_norm_cap", "soft_cap"])
def test_compiled_static_cache_decoding_matches_eager(scheme):
    """A decoding loop through ``torch.compile(fullgraph=True)`` with a static cache runs and gives eager's logits."""
    eager = _patched(scheme)
    compiled_model = _patched(scheme)
    torch._dynamo.reset()
    compiled = torch.compile(compiled_model, backend="aot_eager", fullgraph=True)
    ids = _prompt()
    caches = [StaticCache(config=eager.config, max_cache_len=24) for _ in range(2)]
    with torch.no_grad():
        logits = [
            m(ids, use_cache=True, **cache_kwargs(m, c)).logits[:, -1:] for m, c in zip((eager, compiled_model), caches)
        ]
        torch.testing.assert_close(logits[1], logits[0])
        nxt = logits[0].argmax(-1)
        for step in range(4):
            pos = torch.tensor([ids.shape[1] + step])
            a = eager(nxt, use_cache=True, **cache_kwargs(eager, caches[0]), cache_position=pos).logits
            b = compiled(nxt, use_cache=True, **cache_kwargs(eager, caches[1]), cache_position=pos).logits
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
            nxt = a.argmax(-1)


@pytest.mark.parametrize("softcap", [2.0, None])
def test_lean_attention_compiles_whole_on_large_decoding_calls(softcap):
    """From ``lean.EXPM1_TANH_MIN`` logits the cap's tanh goes through expm1 (scratch, ``out=``, in-place ops), and an
    uncapped query takes the path's math from ``lean.MATH_MIN``: both trace into one graph and give eager's output."""
    from hf_qknorm.attention import lean

    g = torch.Generator().manual_seed(3)
    q = torch.randn(8, 4, 1, 16, generator=g) * 3
    k, v = torch.randn(8, 2, 600, 16, generator=g), torch.randn(8, 2, 600, 16, generator=g)
    assert 8 * 4 * 600 >= max(lean.EXPM1_TANH_MIN, lean.MATH_MIN)
    kwargs = dict(scaling=0.25, softcap=softcap, mask=None, causal=False, sliding_window=None)
    torch._dynamo.reset()
    compiled = torch.compile(lean.lean_attention, backend="aot_eager", fullgraph=True)
    with torch.no_grad():
        torch.testing.assert_close(compiled(q, k, v, **kwargs), lean.lean_attention(q, k, v, **kwargs))


@pytest.mark.parametrize("scheme", ["qk_norm_cap", "qk_norm"])
def test_generate_with_its_compile_config_gives_eager_tokens(scheme):
    """The compiled decoding docs/patching.md describes: ``generate`` with a static cache and a ``CompileConfig``
    (told to compile on a CPU) compiles the decoding step whole and generates eager's greedy tokens."""
    from transformers.generation.configuration_utils import CompileConfig

    model = _patched(scheme)
    config = CompileConfig(fullgraph=True, backend="aot_eager", mode="default")
    config._compile_all_devices = True
    ids = _prompt()
    kwargs = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False, pad_token_id=0, cache_implementation="static")
    torch._dynamo.reset()
    with torch.no_grad():
        eager = model.generate(ids, disable_compile=True, **kwargs)
        compiled = model.generate(ids, compile_config=config, **kwargs)
    assert getattr(model, "_compiled_call", None) is not None  # generate did compile the decoding step
    assert torch.equal(compiled, eager)
