"""Calibration text written by the model itself (hf_qknorm.conversion.healing.selftext)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

from hf_qknorm.conversion.healing.selftext import (
    decode_rows,
    draw,
    generation_dtype,
    mixed_text,
    self_generated_text,
    topics,
)
from hf_qknorm.data import bundled_model_dir


def test_topics_are_wikitext_titles_then_line_openings():
    text = " = Robert Boulter = \n\n Robert Boulter is an English actor .\n = = Career = = \n\n = = = 2000 = = = \n"
    assert topics(text, 3) == ["Robert Boulter", "Career", "2000"]
    assert topics("one two three four five\nsix seven eight nine\n", 5) == [
        "one two three four",
        "six seven eight nine",
    ]


def test_mixed_text_share_and_interleaving():
    cal, gen = "c" * 3000, "g" * 1000
    mixed = mixed_text(cal, gen, share=0.5)
    assert mixed.count("g") == 1000 and mixed.count("c") == 1000
    first = mixed.index("g")
    assert 0 < first < len(mixed) // 4  # generated slices are spread, not appended at the end


def test_self_generated_text_is_the_models_own_and_seeded():
    tok = AutoTokenizer.from_pretrained(bundled_model_dir())
    model = AutoModelForCausalLM.from_pretrained(bundled_model_dir(), dtype=torch.float32).eval()
    source = "First Citizen:\nBefore we proceed any further, hear me speak.\nAll:\nSpeak, speak.\n"
    a = self_generated_text(model, tok, source, chats=2, openings=2, new_tokens=8, seed=3)
    b = self_generated_text(model, tok, source, chats=2, openings=2, new_tokens=8, seed=3)
    # one line of 4+ words: one topic, so one question (no chat template: plain text) and the two openings
    assert a == b and a.startswith("Tell me about Before we proceed any.\n") and "\n\ndef " in a
    assert a != self_generated_text(model, tok, source, chats=2, openings=2, new_tokens=8, seed=4)


def test_self_generated_text_does_not_depend_on_which_process_generates_which_batch(monkeypatch):
    """Each batch has its own generator: two simulated ranks (batches 0, 2, ... and 1, 3, ...), each generating
    only its share, produce exactly the documents of one process's run (the real two-process gather is in
    test_heal_distributed.py)."""
    import hf_qknorm.conversion.healing.selftext as selftext

    tok = AutoTokenizer.from_pretrained(bundled_model_dir())
    model = AutoModelForCausalLM.from_pretrained(bundled_model_dir(), dtype=torch.float32).eval()
    source = "one two three four five\nsix seven eight nine\nten eleven twelve thirteen\n"
    kwargs = dict(chats=3, openings=3, new_tokens=6, seed=5, batch_size=2)
    whole = self_generated_text(model, tok, source, **kwargs)
    shares, seen = {}, []
    for r in (0, 1):
        monkeypatch.setattr(selftext.ranks, "world", lambda: 2)
        monkeypatch.setattr(selftext.ranks, "rank", lambda r=r: r)
        monkeypatch.setattr(selftext.ranks, "all_in_order", lambda mine, n, r=r: shares.update({r: (mine, n)}) or [])
        selftext.self_generated_text(model, tok, source, on_batch=seen.append, **kwargs)
    assert sorted(shares[0][0]) == [0, 2] and sorted(shares[1][0]) == [1] and shares[0][1] == shares[1][1] == 3
    merged = {**shares[0][0], **shares[1][0]}
    assert "\n\n".join(doc for i in range(3) for doc in merged[i]) == whole
    assert seen == [4, 2, 4]  # rank 0: rounds (0, 1) and (2,); rank 1: round (0, 1)


def test_draw_samples_the_tempered_softmax_and_never_a_token_of_probability_zero():
    """The inverse-CDF sampler against the distribution it must follow: 100k rows of one 6-token distribution,
    tempered, whose first and last tokens have probability 0 (the last is where rounding at the top of the CDF
    would land)."""
    logits = torch.tensor([float("-inf"), 0.0, 1.0, 2.0, -1.0, float("-inf")])
    rows = 100_000
    drawn = torch.tensor(draw(logits.expand(rows, -1), 0.5, torch.Generator().manual_seed(0)))
    counts = torch.bincount(drawn, minlength=6).double()
    expected = torch.softmax(logits.double() / 0.5, -1) * rows
    assert counts[0] == 0 and counts[5] == 0
    # each count within 5 standard deviations of its binomial expectation
    sd = (expected * (1 - expected / rows)).sqrt()
    assert ((counts[1:5] - expected[1:5]).abs() <= 5 * sd[1:5] + 1).all(), (counts, expected)
    # seeded: the same generator state gives the same tokens; a one-hot row always gives its token
    assert draw(logits.expand(8, -1), 0.5, torch.Generator().manual_seed(1)) == draw(
        logits.expand(8, -1), 0.5, torch.Generator().manual_seed(1)
    )
    one_hot = torch.full((3, 262_144), float("-inf"))
    one_hot[:, -1] = 0.0
    assert draw(one_hot, 0.8, torch.Generator().manual_seed(2)) == [262_143] * 3


def test_generation_dtype_is_bfloat16_only_where_it_is_fast():
    probe = torch.ops.mkldnn._is_mkldnn_bf16_supported  # listed in hf_qknorm.upstream.RELIANCES
    assert generation_dtype("cpu") == (torch.bfloat16 if probe() else torch.float32)
    assert generation_dtype("meta") == torch.float32


def test_several_batches_decoded_in_one_forward_give_the_same_text(monkeypatch):
    """``rows``: batches decoded side by side, each drawing from its own generator, write the text one batch per
    forward writes -- prompts of different lengths padded to the group's width -- also split over two simulated
    ranks; a forward without ``logits_to_keep`` (every position's logits) is never grouped."""
    import hf_qknorm.conversion.healing.selftext as selftext

    tok = AutoTokenizer.from_pretrained(bundled_model_dir())
    model = AutoModelForCausalLM.from_pretrained(bundled_model_dir(), dtype=torch.float32).eval()
    source = "one two three four five\nsix seven eight nine ten\nten\ntwelve thirteen fourteen fifteen\nA B C D\n"
    kwargs = dict(chats=4, openings=4, new_tokens=6, seed=7, batch_size=2)
    one = self_generated_text(model, tok, source, **kwargs)
    widths = []
    real = selftext._sample
    monkeypatch.setattr(selftext, "_sample", lambda m, t, p, *a: widths.append(len(p)) or real(m, t, p, *a))
    assert self_generated_text(model, tok, source, rows=6, **kwargs) == one
    assert widths == [6, 2]  # four batches of two: three in the first forward, one in the second
    widths.clear()
    assert self_generated_text(model, tok, source, rows=5, **kwargs) == one  # whole batches: two per forward
    assert widths == [4, 4]
    shares, seen = {}, []
    widths.clear()
    for r in (0, 1):  # groups of two consecutive batches shared out: (0, 1) on rank 0, (2, 3) on rank 1
        monkeypatch.setattr(selftext.ranks, "world", lambda: 2)
        monkeypatch.setattr(selftext.ranks, "rank", lambda r=r: r)
        monkeypatch.setattr(selftext.ranks, "all_in_order", lambda mine, n, r=r: shares.update({r: mine}) or [])
        selftext.self_generated_text(model, tok, source, rows=4, on_batch=seen.append, **kwargs)
    assert sorted(shares[0]) == [0, 1] and sorted(shares[1]) == [2, 3] and widths == [4, 4] and seen == [8, 8]
    merged = {**shares[0], **shares[1]}
    assert "\n\n".join(doc for i in range(4) for doc in merged[i]) == one
    widths.clear()
    monkeypatch.setattr(selftext, "_keeps_last_logits", lambda runner: False)
    monkeypatch.setattr(selftext.ranks, "world", lambda: 1)
    monkeypatch.setattr(selftext.ranks, "rank", lambda: 0)
    monkeypatch.setattr(selftext.ranks, "all_in_order", lambda mine, n: [mine[i] for i in range(n)])
    self_generated_text(model, tok, source, rows=8, **kwargs)
    assert widths == [2, 2, 2, 2]
    with pytest.raises(ValueError, match="rows must be a positive int.*got 0"):
        self_generated_text(model, tok, source, rows=0, **kwargs)


def test_decode_rows_keeps_the_kv_cache_within_the_budget():
    """Rows per forward from the config, computed by hand: 3 layers x 2 key/value heads x head size 8 x (keys and
    values) x (128 prompt + 16 answer tokens) x 4 bytes = 27,648 bytes per row."""
    config = LlamaConfig(
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, hidden_size=32, head_dim=8, vocab_size=64
    )
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    per_row = 3 * 2 * 8 * 2 * (128 + 16) * 4
    assert decode_rows(model, 16, 2, 128, 10 * per_row) == 10
    assert decode_rows(model, 16, 4, 128, 10 * per_row) == 8  # whole batches
    assert decode_rows(model, 16, 2, 6, 10 * per_row) == 6  # at most ``most``
    assert decode_rows(model, 16, 4, 128, per_row) == 4  # never less than one batch
    assert decode_rows(model.to(torch.bfloat16), 16, 2, 128, 10 * per_row) == 20  # half the bytes per value
