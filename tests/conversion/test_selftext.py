"""Calibration text written by the model itself (hf_qknorm.conversion.healing.selftext)."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from hf_qknorm.conversion.healing.selftext import draw, generation_dtype, mixed_text, self_generated_text, topics
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
