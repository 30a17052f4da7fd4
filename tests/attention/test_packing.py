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
