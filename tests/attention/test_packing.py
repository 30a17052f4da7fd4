"""Packed sequences never leak into each other on the "qknorm" backend.

``DataCollatorWithFlattening`` packs sequences into one row with restarting ``position_ids``. Transformers builds the
block-diagonal mask itself only when there is no cache; with ``use_cache`` on (a Trainer run's default config
without gradient checkpointing) it passes no mask, and plain sdpa lets the sequences attend to each other. The
backend recognises the restarts, or refuses loudly where it cannot tell (a cache that already holds tokens).
``cu_seq_lens_*`` describe one row of packed sequences: a batch > 1 is refused on every path.
"""

from __future__ import annotations

import pytest
import torch

import hf_qknorm
from hf_qknorm.attention import qknorm_attention_forward
from hf_qknorm.upstream import cache_kwargs
from tests._support.tiny_models import FAMILY_NAMES, VOCAB, tiny_model


def _packed():
    from transformers import DataCollatorWithFlattening

    seqs = [torch.randint(1, VOCAB, (n,), generator=torch.Generator().manual_seed(n)) for n in (9, 5, 11)]
    batch = DataCollatorWithFlattening(return_tensors="pt", return_flash_attn_kwargs=True)(
        [{"input_ids": s.tolist()} for s in seqs]
    )
    return seqs, batch


def _model(family, scheme, dtype=torch.float64):
    model = tiny_model(family, dtype=dtype)
    if scheme is not None:
        hf_qknorm.patch_model(model, scheme)
    model.set_attn_implementation("qknorm")
    return model


@pytest.mark.parametrize("family", FAMILY_NAMES)
@pytest.mark.parametrize("scheme", ["qk_norm_cap", "qk_norm", None])
def test_packed_with_the_cache_on_matches_separate(family, scheme):
    model = _model(family, scheme)
    seqs, batch = _packed()
    packed = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=True).logits[0]
    start = 0
    for s in seqs:
        torch.testing.assert_close(packed[start : start + len(s)], model(s[None]).logits[0], rtol=1e-7, atol=1e-7)
        start += len(s)


def test_packed_through_the_kernels_with_the_cache_on(kernels_on_cpu):
    from hf_qknorm.attention import kernel_policy

    model = _model("llama", "qk_norm_cap", dtype=torch.float32)
    seqs, batch = _packed()
    with kernel_policy(devices=("cuda", "cpu")):
        packed = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=True).logits[0]
    start = 0
    for s in seqs:
        torch.testing.assert_close(packed[start : start + len(s)], model(s[None]).logits[0], rtol=2e-4, atol=2e-4)
        start += len(s)


def test_packed_after_cached_tokens_is_refused():
    """Restarting positions appended to a cache that already holds tokens: which cached keys belong to which packed
    sequence is unknowable, so the forward refuses instead of guessing."""
    from transformers import DynamicCache

    model = _model("llama", "qk_norm_cap")
    cache = DynamicCache(config=model.config)
    model(torch.randint(1, VOCAB, (1, 4)), use_cache=True, **cache_kwargs(model, cache))
    ids = torch.randint(1, VOCAB, (1, 6))
    position_ids = torch.tensor([[4, 5, 6, 0, 1, 2]])
    with pytest.raises(ValueError, match="packed sequences .* appended to a cache that holds 4 earlier tokens"):
        model(ids, position_ids=position_ids, use_cache=True, **cache_kwargs(model, cache))


def test_packed_prefill_into_a_static_cache():
    """Packing into an empty static cache (keys beyond the queries are empty slots): each sequence its own."""
    from transformers import StaticCache

    model = _model("llama", "qk_norm_cap")
    seqs, batch = _packed()
    cache = StaticCache(config=model.config, max_cache_len=40)
    packed = model(
        input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=True, **cache_kwargs(model, cache)
    ).logits[0]
    start = 0
    for s in seqs:
        torch.testing.assert_close(packed[start : start + len(s)], model(s[None]).logits[0], rtol=1e-7, atol=1e-7)
        start += len(s)


def test_consecutive_positions_keep_the_fast_path():
    """No restart: no mask is built (plain causal), and a row of positions offset from 0 is not mistaken for packing."""
    from hf_qknorm.attention.interface import packed_sequence_mask

    assert packed_sequence_mask(torch.arange(7)[None] + 3, 7, 7) is None
    mask = packed_sequence_mask(torch.tensor([[0, 1, 2, 0, 1]]), 5, 5)
    expected = torch.tensor(
        [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0], [0, 0, 0, 1, 0], [0, 0, 0, 1, 1]], dtype=torch.bool
    )
    assert torch.equal(mask[0, 0], expected)


@pytest.mark.parametrize("softcap", [None, 3.0])
def test_cu_seq_lens_with_a_batch_is_refused(softcap):
    q = torch.randn(2, 2, 6, 8)
    cu = torch.tensor([0, 2, 6], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"one row of concatenated sequences, batch 1; got a batch of 2"):
        qknorm_attention_forward(
            torch.nn.Module(),
            q,
            q,
            q,
            None,
            softcap=softcap,
            cu_seq_lens_q=cu,
            cu_seq_lens_k=cu,
            max_length_q=4,
            max_length_k=4,
        )


def test_multimodal_rope_positions_are_not_read_as_packing():
    """Multimodal RoPE hands the attention ``(rows, batch, seq)`` positions (GLM-4V-MoE: temporal, height, width),
    which restart where a left-padded row's real tokens begin; Transformers reads packing from 2-d text positions
    only, so the backend reads none from them (it crashed on their shape in a padded generation)."""
    from hf_qknorm.portable.masks import packed_sequence_mask

    rows = torch.tensor([[1, 1, 0, 1, 2, 3], [0, 1, 2, 3, 4, 5]])  # row 0 left-padded by two
    assert packed_sequence_mask(rows[None].expand(3, -1, -1), 6, 6) is None
    assert packed_sequence_mask(rows, 6, 6) is not None  # the same positions as a (batch, seq) packing


def _each_sequence(q, k, v, cu_q, cu_k, scaling, softcap, window):
    """float64, one sequence at a time: bottom-right causal (query ``i`` of a sequence sits at key position ``i +
    k_len - q_len``), the window counted back from there, the cap before the mask."""
    outs, weights = [], torch.zeros(q.shape[1], q.shape[2], k.shape[2], dtype=torch.float64)
    for b in range(len(cu_q) - 1):
        q0, q1, k0, k1 = int(cu_q[b]), int(cu_q[b + 1]), int(cu_k[b]), int(cu_k[b + 1])
        s = q[0, :, q0:q1].double() @ k[0, :, k0:k1].double().transpose(-1, -2) * scaling
        if softcap is not None:
            s = softcap * torch.tanh(s / softcap)
        at = torch.arange(q1 - q0)[:, None] + (k1 - k0) - (q1 - q0)
        key = torch.arange(k1 - k0)[None, :]
        ok = key <= at
        if window is not None:
            ok = ok & (at - key < window)
        p = s.masked_fill(~ok, float("-inf")).softmax(-1)
        weights[:, q0:q1, k0:k1] = p
        outs.append(p @ v[0, :, k0:k1].double())
    return torch.cat(outs, 1).transpose(0, 1), weights


@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("softcap", [None, 4.0])
@pytest.mark.parametrize("lengths", [((3, 1, 5), (5, 4, 5)), ((4, 6), (4, 6))], ids=["fewer-queries", "square"])
@pytest.mark.parametrize("weights", [False, True], ids=["out", "weights"])
def test_cu_seq_lens_each_sequence_its_own(lengths, softcap, window, weights):
    """Packed sequences described by ``cu_seq_lens_*`` on the PyTorch path, against each sequence alone in float64:
    causal per sequence, bottom-right aligned where a sequence has fewer queries than keys (a continuation with its
    cached prefix, as FlashAttention's varlen mode and the kernels align it), a sliding window counted in the
    sequence, the attention weights when asked -- each once computed over the whole row or the row's start."""
    q_lens, k_lens = lengths
    cu_q = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    cu_k = torch.tensor([0, *torch.tensor(k_lens).cumsum(0).tolist()], dtype=torch.int32)
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, sum(q_lens), 8, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(1, 2, sum(k_lens), 8, generator=gen, dtype=torch.float64) for _ in range(2))
    q = q * 3  # logits the cap bends
    module = torch.nn.Module()
    module.is_causal = True
    out, w = qknorm_attention_forward(
        module,
        q,
        k,
        v,
        None,
        scaling=0.35,
        softcap=softcap,
        sliding_window=window,
        output_attentions=weights,
        cu_seq_lens_q=cu_q,
        cu_seq_lens_k=cu_k,
        max_length_q=max(q_lens),
        max_length_k=max(k_lens),
    )
    kv = lambda t: t.repeat_interleave(2, 1)  # noqa: E731 - GQA 2:1 for the reference
    expected, expected_w = _each_sequence(q, kv(k), kv(v), cu_q, cu_k, 0.35, softcap, window)
    torch.testing.assert_close(out[0], expected, rtol=1e-10, atol=1e-10)
    if weights:
        torch.testing.assert_close(w[0], expected_w, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("softcap", [None, 4.0])
def test_weights_keep_the_window_without_a_mask(softcap):
    """A call with no mask and a sliding window the keys exceed: the attention weights, when asked, are the
    windowed ones the output was computed with (not the whole causal row)."""
    gen = torch.Generator().manual_seed(1)
    q, k, v = (3 * torch.randn(1, 2, 12, 8, generator=gen, dtype=torch.float64) for _ in range(3))
    module = torch.nn.Module()
    module.is_causal = True
    cu = torch.tensor([0, 12])
    plain, _ = qknorm_attention_forward(module, q, k, v, None, scaling=0.35, softcap=softcap, sliding_window=4)
    out, w = qknorm_attention_forward(
        module, q, k, v, None, scaling=0.35, softcap=softcap, sliding_window=4, output_attentions=True
    )
    expected, expected_w = _each_sequence(q, k, v, cu, cu, 0.35, softcap, 4)
    torch.testing.assert_close(plain[0], expected, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(out[0], expected, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(w[0], expected_w, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("softcap", [None, 4.0])
def test_cu_seq_lens_through_the_kernels_each_sequence_its_own(kernels_on_cpu, softcap, window):
    """The kernels' varlen mode on the same packing (fewer queries than keys in two sequences of three): what the
    PyTorch path computes, each sequence alone."""
    from hf_qknorm.attention import kernel_policy

    cu_q, cu_k = torch.tensor([0, 3, 4, 9], dtype=torch.int32), torch.tensor([0, 5, 9, 14], dtype=torch.int32)
    gen = torch.Generator().manual_seed(2)
    q = 3 * torch.randn(1, 4, 9, 16, generator=gen)
    k, v = (torch.randn(1, 2, 14, 16, generator=gen) for _ in range(2))
    module = torch.nn.Module()
    module.is_causal = True
    with kernel_policy(devices=("cuda", "cpu"), use_fallback=False):
        out, _ = qknorm_attention_forward(
            module,
            q,
            k,
            v,
            None,
            scaling=0.25,
            softcap=softcap,
            sliding_window=window,
            cu_seq_lens_q=cu_q,
            cu_seq_lens_k=cu_k,
            max_length_q=5,
            max_length_k=5,
        )
    kv = lambda t: t.repeat_interleave(2, 1)  # noqa: E731
    expected, _ = _each_sequence(q, kv(k), kv(v), cu_q, cu_k, 0.25, softcap, window)
    torch.testing.assert_close(out[0].double(), expected, rtol=2e-4, atol=2e-4)
