"""hf_qknorm.data and the bundled assets: text, splits, token blocks, and the tiny pretrained Llama. No network."""

import hashlib
import math

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM, PreTrainedTokenizerFast

from hf_qknorm import data
from hf_qknorm.data import (
    BUNDLED_TEXTS,
    bundled_model_dir,
    bundled_text,
    perplexity,
    read_text,
    split_text,
    tokenize_blocks,
    tokenize_stream,
)

SHAKESPEARE_SHA256 = "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed"

# Held-out perplexity of the bundled model on the first EVAL_BLOCKS validation blocks, measured when the asset was
# made (see hf_qknorm/assets/tiny-llama/TRAINING.md); the test allows 10% on top for platform differences.
EVAL_BLOCKS, EVAL_LEN = 32, 256
MEASURED_PPL = 35.248  # the step-1100 row of TRAINING.md (first 32 held-out blocks)


# ---------------------------------------------------------------- bundled text


def test_bundled_shakespeare_is_the_whole_corpus():
    text = bundled_text("tinyshakespeare")
    assert text.startswith("First Citizen:\nBefore we proceed any further, hear me speak.")
    assert hashlib.sha256(text.encode("utf-8")).hexdigest() == SHAKESPEARE_SHA256


def test_bundled_wikitext_slice_is_small_and_attributed():
    text = bundled_text("wikitext2")
    assert text.startswith(" = Robert Boulter = \n")
    assert "\r" not in text
    assert len(text.encode("utf-8")) <= 300_000
    attribution = data._assets().joinpath("text", "ATTRIBUTION.md").read_text(encoding="utf-8")
    assert "CC BY-SA 3.0" in attribution and "wikitext-2-raw-v1" in attribution


@pytest.mark.parametrize("name", sorted(BUNDLED_TEXTS))
def test_every_bundled_text_reads_by_name(name):
    text = bundled_text(name)
    assert len(text) > 100_000
    assert read_text(name) == text


def test_bundled_text_unknown_name():
    with pytest.raises(ValueError, match="tinyshakespeare"):
        bundled_text("penn-treebank")


# ---------------------------------------------------------------- read_text


def test_read_text_user_path(tmp_path):
    path = tmp_path / "mine.txt"
    path.write_text("To be, or not to be.\n", encoding="utf-8")
    assert read_text(path) == "To be, or not to be.\n"
    assert read_text(str(path)) == "To be, or not to be.\n"


def test_read_text_prefers_an_existing_file_over_a_bundled_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tinyshakespeare").write_text("local copy\n", encoding="utf-8")
    assert read_text("tinyshakespeare") == "local copy\n"


def test_read_text_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="not found.*bundled names"):
        read_text(tmp_path / "missing.txt")
    (tmp_path / "empty.txt").write_text(" \n\n", encoding="utf-8")
    with pytest.raises(ValueError, match="empty"):
        read_text(tmp_path / "empty.txt")
    with pytest.raises(ValueError, match="not a regular file"):
        read_text(tmp_path)
    (tmp_path / "latin1.txt").write_bytes("caf\xe9\n".encode("latin-1"))
    with pytest.raises(ValueError, match="not UTF-8"):
        read_text(tmp_path / "latin1.txt")


# ---------------------------------------------------------------- split_text


def test_split_text_is_contiguous_deterministic_and_line_aligned():
    text = bundled_text("tinyshakespeare")
    train, val = split_text(text, 0.1)
    assert train + val == text
    assert (train, val) == split_text(text, 0.1)
    assert train.endswith("\n")
    assert abs(len(val) / len(text) - 0.1) < 0.001


def test_split_text_short_and_invalid():
    assert split_text("a\nb\nc\nd\n", 0.5) == ("a\nb\n", "c\nd\n")
    assert split_text("no newline at all", 0.5) == ("no newli", "ne at all")
    for bad in (0.0, 1.0, -0.1):
        with pytest.raises(ValueError, match="val_fraction"):
            split_text("a\nb\n", bad)
    with pytest.raises(ValueError, match="too short"):
        split_text("abc\n", 0.1)


# ---------------------------------------------------------------- token blocks


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(bundled_model_dir())


def test_tokenize_blocks_layout(tokenizer):
    text = bundled_text("wikitext2")[:20_000]
    stream = tokenize_stream(text, tokenizer)
    blocks = tokenize_blocks(text, tokenizer, 64)
    assert blocks.dtype == torch.long and blocks.shape == (len(stream) // 63, 64)
    assert (blocks[:, 0] == tokenizer.bos_token_id).all()
    assert torch.equal(blocks[:, 1:].reshape(-1), stream[: blocks.shape[0] * 63])  # back to back, tail dropped

    plain = tokenize_blocks(text, tokenizer, 64, add_bos=False, max_blocks=3)
    assert torch.equal(plain, stream[: 3 * 64].view(3, 64))
    overlapping = tokenize_blocks(text, tokenizer, 64, add_bos=False, stride=16)
    assert torch.equal(overlapping[1], stream[16:80])
    assert overlapping.shape[0] == (len(stream) - 64) // 16 + 1


def test_tokenize_blocks_spread_samples_the_whole_text():
    vocab = {"[UNK]": 0, **{f"w{i}": i + 1 for i in range(20)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]")
    text = " ".join(f"w{i}" for i in range(20))  # token ids 1..20
    # 3 blocks of 4 from 20 tokens: starts 0, 8, 16 (stride (20 - 4) // 2), so the last block ends the text
    spread = tokenize_blocks(text, tok, 4, max_blocks=3, spread=True)
    assert spread.tolist() == [[1, 2, 3, 4], [9, 10, 11, 12], [17, 18, 19, 20]]
    # as many blocks as fit, or one: back to back, as without spread
    assert tokenize_blocks(text, tok, 4, max_blocks=5, spread=True).tolist()[-1] == [17, 18, 19, 20]
    assert tokenize_blocks(text, tok, 4, max_blocks=1, spread=True).tolist() == [[1, 2, 3, 4]]
    with pytest.raises(ValueError, match="not both"):
        tokenize_blocks(text, tok, 4, max_blocks=3, spread=True, stride=2)


def test_tokenize_blocks_without_bos_token_and_errors(tokenizer):
    vocab = {"[UNK]": 0, "to": 1, "be": 2, "or": 3, "not": 4}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    no_bos = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]")
    blocks = tokenize_blocks("to be or not to be", no_bos, 3)  # add_bos defaults to False without a BOS token
    assert blocks.tolist() == [[1, 2, 3], [4, 1, 2]]
    with pytest.raises(ValueError, match="no bos_token_id"):
        tokenize_blocks("to be or not to be", no_bos, 3, add_bos=True)
    with pytest.raises(ValueError, match="fewer than one block"):
        tokenize_blocks("Hello.", tokenizer, 64)
    with pytest.raises(ValueError, match="no room"):
        tokenize_blocks("Hello.", tokenizer, 1)


# ---------------------------------------------------------------- the bundled tiny Llama


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """A 1.2M-parameter model runs fastest on one thread; more threads only fight a busy machine (5x slower)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def tiny_llama():
    return AutoModelForCausalLM.from_pretrained(bundled_model_dir())


def test_bundled_model_is_a_small_plain_float32_llama(tiny_llama, tokenizer):
    folder = bundled_model_dir()
    size = sum(f.stat().st_size for f in folder.iterdir())
    assert size <= 8 * 2**20
    assert (folder / "TRAINING.md").is_file() and (folder / "generation_config.json").is_file()
    assert type(tiny_llama) is LlamaForCausalLM
    assert tiny_llama.dtype == torch.float32
    cfg = tiny_llama.config
    assert cfg.model_type == "llama"
    assert (cfg.num_attention_heads, cfg.num_key_value_heads) == (4, 2)  # GQA
    assert cfg.vocab_size == len(tokenizer)
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id) == (
        cfg.bos_token_id,
        cfg.eos_token_id,
        cfg.pad_token_id,
    )
    assert tokenizer("ROMEO:").input_ids[0] == tokenizer.bos_token_id


def test_bundled_model_generates(tiny_llama, tokenizer):
    ids = tokenizer("ROMEO:\n", return_tensors="pt").input_ids
    out = tiny_llama.generate(ids, max_new_tokens=20, do_sample=False)
    assert out.shape == (1, ids.shape[1] + 20)
    assert torch.equal(out[0, : ids.shape[1]], ids[0])
    new_text = tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
    assert sum(c.isalpha() for c in new_text) >= 10


def test_bundled_model_held_out_perplexity(tiny_llama, tokenizer):
    _, val = split_text(bundled_text("tinyshakespeare"), 0.1)
    blocks = tokenize_blocks(val, tokenizer, EVAL_LEN, max_blocks=EVAL_BLOCKS)
    assert blocks.shape == (EVAL_BLOCKS, EVAL_LEN)
    ppl = perplexity(tiny_llama, blocks, batch_size=8)
    assert math.isfinite(ppl)
    assert ppl < 1.1 * MEASURED_PPL, f"held-out perplexity {ppl:.2f}, measured {MEASURED_PPL:.2f} when made"
