"""The texts of a conversion: calibration and held-out text from a path, a bundled name or the text itself, and
their token blocks (:func:`hf_qknorm.data.tokenize_blocks`, spread over the text)."""

from __future__ import annotations

import os
from typing import NamedTuple

import torch

from ...data import TextTooShort, tokenize_blocks

__all__ = ["Texts", "heal_text_blocks", "load_text", "read_texts", "text_blocks"]


class Texts(NamedTuple):
    """The calibration text, the held-out text, and how errors name each."""

    calibration: str
    held_out: str
    calibration_label: str
    held_out_label: str


_TEXT_SUFFIXES = (".txt", ".md", ".raw", ".text")


def load_text(value, what: str) -> str | None:
    """``value`` is a path, a bundled text name (``"tinyshakespeare"``, ``"wikitext2"``) or the text itself."""
    from ...data import read_text

    if value is None:
        return None
    if not isinstance(value, (str, os.PathLike)):
        raise TypeError(f"{what} must be a str or a path, got {type(value).__name__}")
    if _names_a_file(value):
        try:
            return read_text(value)
        except (OSError, ValueError) as exc:  # say which of the texts it was
            raise type(exc)(f"{what}: {exc}") from None
    if not value.strip():
        raise ValueError(f"{what} is empty; give text (or a file of text) to run through the model")
    return value


def _names_a_file(value) -> bool:
    """Whether :func:`load_text` reads ``value`` as a file (or bundled text) name rather than as the text itself."""
    from ...data import BUNDLED_TEXTS

    return (
        isinstance(value, os.PathLike)
        or "\n" not in value
        and len(value) < 4096
        and (value in BUNDLED_TEXTS or os.path.exists(value) or value.lower().endswith(_TEXT_SUFFIXES))
    )


def _text_label(value, what: str) -> str:
    """How errors name a text the user gave: the file (or bundled) name, or the string given as text."""
    if _names_a_file(value):
        return f"{what} {str(value)!r}"
    if "\n" in value or len(value) >= 4096:
        return f"{what} (the {len(value):,}-character string given)"
    return f"{what} {value!r} (read as the text itself: no file of that name exists)"


def read_texts(calibration_text, eval_text) -> Texts:
    """The calibration and held-out texts of :func:`~hf_qknorm.convert`'s arguments, and how errors name each."""
    from ...data import split_text

    value = calibration_text if calibration_text is not None else "tinyshakespeare"
    calib = load_text(value, "calibration text")
    if not calib.strip():
        raise ValueError("calibration text is empty; give text (or a file of text) to run through the model")
    held = load_text(eval_text, "eval text")
    labels = [_text_label(value, "calibration text")]
    if held is None:
        calib, held = split_text(calib, 0.1)
        labels.append(f"the held-out last 10% of the {labels[0]} (no eval text was given)")
    else:
        labels.append(_text_label(eval_text, "eval text"))
    return Texts(calib, held, *labels)


def text_blocks(text: str, tokenizer, block_len: int, max_blocks: int, what: str) -> torch.Tensor:
    """Up to ``max_blocks`` blocks of ``block_len`` tokens spread evenly over ``text``, each led by BOS when the
    tokenizer has one (:func:`hf_qknorm.data.tokenize_blocks` with ``spread=True``, the layout the held-out
    perplexities in ``TRAINING.md`` use); a text too short for one block is an error naming ``what``."""
    try:
        return tokenize_blocks(text, tokenizer, block_len, max_blocks=max_blocks, spread=True)
    except TextTooShort as exc:
        bos = " + BOS" if block_len > exc.n_text else ""
        raise ValueError(
            f"{what} is too short: {exc.n_tokens:,} tokens, and one block of {block_len} tokens "
            f"({exc.n_text} of text{bos}) is needed; give more text or a smaller block length (--block-len)"
        ) from None


def heal_text_blocks(parts, tokenizer, block_len: int, max_blocks: int, calibration_label: str) -> torch.Tensor:
    """The heal blocks: up to ``max_blocks`` in all, each ``(text, share)`` of ``parts``
    (:func:`hf_qknorm.conversion.healing.heal.heal_text`: the calibration text, alone or mixed with the original's
    answers; or the calibration text and the answers apart) giving its share of them spread over that text alone
    (:func:`text_blocks`), so that no block spans two parts."""
    blocks, first = [], 0
    for i, (text, share) in enumerate(parts):
        last = max_blocks if i == len(parts) - 1 else first + max(1, round(share * max_blocks))
        label = calibration_label if i == 0 else "the original's own answers (heal text)"
        blocks.append(text_blocks(text, tokenizer, block_len, last - first, label))
        first = last
    return torch.cat(blocks)
