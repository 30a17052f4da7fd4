"""Real text, token blocks and perplexity for recipes, tests, the CLI and benchmarks.

The package carries small copies of real text in ``hf_qknorm/assets/text`` (see ``ATTRIBUTION.md`` there) and a
tiny pretrained Llama in ``hf_qknorm/assets/tiny-llama`` (made by ``recipes/pretrain_tiny.py``), so that every
command works from a fresh clone with nothing downloaded. Every command that reads text should accept a user's
own file through :func:`read_text`.

Nothing here imports transformers: the functions take any Hugging Face tokenizer or causal-LM model by duck typing.
"""

from __future__ import annotations

import math
import os
from importlib import resources
from pathlib import Path

import torch
import torch.nn.functional as F

__all__ = [
    "BUNDLED_TEXTS",
    "bundled_text",
    "bundled_model_dir",
    "read_text",
    "split_text",
    "tokenize_stream",
    "TextTooShort",
    "tokenize_blocks",
    "perplexity",
]

# name -> file under hf_qknorm/assets/text
BUNDLED_TEXTS: dict[str, str] = {
    "tinyshakespeare": "tinyshakespeare.txt",  # whole char-rnn corpus, public domain, 1.1 MB
    "wikitext2": "wikitext2_test_slice.txt",  # first 12 articles of wikitext-2-raw-v1 test, CC BY-SA 3.0, 296 KB
}

BUNDLED_MODEL = "tiny-llama"


def _assets():
    return resources.files("hf_qknorm").joinpath("assets")


def bundled_text(name: str = "tinyshakespeare") -> str:
    """Return one of the texts shipped with the package (``"tinyshakespeare"`` or ``"wikitext2"``)."""
    if name not in BUNDLED_TEXTS:
        raise ValueError(f"unknown bundled text {name!r}; choose one of {sorted(BUNDLED_TEXTS)}")
    return _assets().joinpath("text", BUNDLED_TEXTS[name]).read_text(encoding="utf-8")


def bundled_model_dir() -> Path:
    """Directory of the bundled tiny Llama, for ``AutoModelForCausalLM.from_pretrained``.

    A plain (unpatched) ``LlamaForCausalLM`` in float32, pretrained on Tiny Shakespeare by
    ``recipes/pretrain_tiny.py``; its ``TRAINING.md`` records how and the measured perplexity.
    """
    path = Path(str(_assets().joinpath(BUNDLED_MODEL)))
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"bundled model not found at {path}; reinstall hf_qknorm or rebuild it with recipes/pretrain_tiny.py"
        )
    return path


def read_text(path_or_name: str | os.PathLike = "tinyshakespeare") -> str:
    """Read a UTF-8 text file, or a bundled text by name (see :data:`BUNDLED_TEXTS`).

    A bundled name wins only when no file of that name exists, so ``--text tinyshakespeare`` works anywhere and
    ``--text ./tinyshakespeare`` reads the local file. Raises ``FileNotFoundError`` for a missing path and
    ``ValueError`` for an empty (or whitespace-only) file or one that is not UTF-8.
    """
    if isinstance(path_or_name, str) and path_or_name in BUNDLED_TEXTS and not os.path.exists(path_or_name):
        return bundled_text(path_or_name)
    path = Path(path_or_name).expanduser()
    if not path.exists():
        raise FileNotFoundError(
            f"text file not found: {str(path)!r}; give a path to a UTF-8 text file "
            f"or one of the bundled names {sorted(BUNDLED_TEXTS)}"
        )
    if not path.is_file():
        raise ValueError(f"not a regular file: {str(path)!r}; give a path to a UTF-8 text file")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"{str(path)!r} is not UTF-8 text: {err}") from err
    if not text.strip():
        raise ValueError(f"text file is empty: {str(path)!r}")
    return text


def split_text(text: str, val_fraction: float = 0.1) -> tuple[str, str]:
    """Split ``text`` into ``(train, validation)``: the validation part is the last ``val_fraction`` of it.

    Deterministic and contiguous (no shuffling, so no passage leaks from one side to the other), as nanoGPT splits
    Tiny Shakespeare. The cut moves forward to the next line start so no line is broken; ``train + val == text``.
    """
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    cut = int(len(text) * (1.0 - val_fraction))
    newline = text.find("\n", cut - 1)  # cut - 1: a cut already at a line start stays put
    if newline != -1 and newline + 1 < len(text):
        cut = newline + 1
    train, val = text[:cut], text[cut:]
    if not train.strip() or not val.strip():
        raise ValueError(f"text of {len(text)} characters is too short to split with val_fraction={val_fraction}")
    return train, val


def tokenize_stream(text: str, tokenizer) -> torch.Tensor:
    """Token ids of ``text`` as one LongTensor ``(n_tokens,)``, without special tokens."""
    # verbose=False: a whole corpus is longer than model_max_length by design; it is cut into blocks afterwards.
    ids = tokenizer(text, add_special_tokens=False, return_attention_mask=False, verbose=False)["input_ids"]
    return torch.tensor(ids, dtype=torch.long)


class TextTooShort(ValueError):
    """A text with fewer tokens than one block holds: ``n_tokens`` of the ``n_text`` text tokens a block needs."""

    def __init__(self, n_tokens: int, n_text: int):
        super().__init__(f"text has {n_tokens} tokens, fewer than one block of {n_text} text tokens; give more text")
        self.n_tokens, self.n_text = n_tokens, n_text


def tokenize_blocks(
    text: str,
    tokenizer,
    block_len: int,
    *,
    add_bos: bool | None = None,
    stride: int | None = None,
    max_blocks: int | None = None,
    spread: bool = False,
) -> torch.Tensor:
    """Tokenize ``text`` into fixed-length blocks: LongTensor ``(n_blocks, block_len)``.

    Each block is ``[bos] + block_len - 1`` consecutive text tokens when ``add_bos`` (default: when the tokenizer
    has a BOS token), else ``block_len`` text tokens. Blocks start every ``stride`` text tokens (default: back to
    back, no overlap); the tail that does not fill a block is dropped. ``max_blocks`` keeps only the first blocks, or
    with ``spread`` (and no ``stride``) ``max_blocks`` blocks spread evenly over the whole text, from its first
    token to its last (a sample of a corpus rather than its opening).
    Use the blocks both as ``input_ids`` and as ``labels`` (the model shifts them); no padding is involved.
    """
    if add_bos is None:
        add_bos = getattr(tokenizer, "bos_token_id", None) is not None
    if add_bos and getattr(tokenizer, "bos_token_id", None) is None:
        raise ValueError("add_bos=True but the tokenizer has no bos_token_id")
    n_text = block_len - int(add_bos)
    if n_text < 1:
        raise ValueError(f"block_len={block_len} leaves no room for text tokens")
    if spread and stride is not None:
        raise ValueError("give stride or spread=True, not both")
    stride = n_text if stride is None else stride
    if stride < 1:
        raise ValueError(f"stride must be >= 1, got {stride}")
    stream = tokenize_stream(text, tokenizer)  # tokenised once: a whole corpus can take seconds
    if len(stream) < n_text:
        raise TextTooShort(len(stream), n_text)
    available = len(stream) // n_text
    if spread and max_blocks is not None and 1 < max_blocks < available:
        stride = max(n_text, (len(stream) - n_text) // (max_blocks - 1))
    blocks = stream.unfold(0, n_text, stride)  # (n_blocks, n_text), a view
    if max_blocks is not None:
        blocks = blocks[:max_blocks]
    if add_bos:
        bos = torch.full((blocks.shape[0], 1), tokenizer.bos_token_id, dtype=torch.long)
        blocks = torch.cat([bos, blocks], dim=1)
    return blocks.contiguous()


@torch.no_grad()
def perplexity(model, blocks: torch.Tensor, *, batch_size: int = 8) -> float:
    """Token-level perplexity of a causal LM on ``blocks`` ``(n_blocks, block_len)``.

    ``exp`` of the mean next-token negative log-likelihood over every predicted position (all but the first of
    each block, so a leading BOS is context, never a target). Runs on the model's device, in eval mode.
    """
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    total_nll, total_tokens = 0.0, 0
    try:
        for start in range(0, blocks.shape[0], batch_size):
            ids = blocks[start : start + batch_size].to(device)
            logits = model(input_ids=ids).logits[:, :-1].float()
            targets = ids[:, 1:]
            nll = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="sum")
            total_nll += nll.item()
            total_tokens += targets.numel()
    finally:
        model.train(was_training)
    return math.exp(total_nll / total_tokens)
