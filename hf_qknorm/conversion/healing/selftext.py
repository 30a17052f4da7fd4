"""Calibration text the model itself wrote: chat turns through its chat template and continuations of plain text.

A user keeps using a converted model the way it was used before: answering chat turns, continuing code and prose.
Calibrating only on WikiText fits the new norms to one register. :func:`self_generated_text` samples the original
model's own answers to questions about topics taken from the calibration text (section titles of WikiText, or the
first words of lines), wrapped in the tokenizer's chat template when it has one, plus continuations of code and
prose openings, and returns them as one text that can be mixed with the calibration text (:func:`mixed_text`). The
prompts are built from the calibration text, never from the answer-agreement prompts.

Each batch of prompts is sampled with its own generator, seeded from ``(seed, batch index)`` (:func:`batch_seed`).
Several consecutive batches may be decoded in one forward (``rows``; the heal decodes 128 answers at a time, as a
262k-row output head costs much the same per step for 128 rows as for 32): each still draws from its own generator,
so the draws are those of one batch per forward, but rows padded to a wider common width compute their logits with
other rounding, and where that moves a cumulative probability across a draw the answer goes on differently from
there (measured: on Gemma 3 and SmolLM2 most answers came out the same, some not; on the bundled tiny model all,
tested). With a ``torch.distributed`` process group of ``world`` processes the groups of batches decoded together
are shared out -- group ``g`` on rank ``g % world``, the same groups for any ``world`` -- and the documents gathered
in batch order (:func:`hf_qknorm.conversion.orchestration.ranks.all_in_order`), so every rank returns the same text,
identical to one process's (with more ranks than groups, the others wait).
"""

from __future__ import annotations

import hashlib
import inspect
import re

import torch

from ...portable.families import head_dim_of, heads_of, text_config_of, text_runner
from ...upstream import cache_kwargs, output_cache
from ..orchestration import ranks

__all__ = ["batch_seed", "decode_rows", "draw", "generation_dtype", "mixed_text", "self_generated_text", "topics"]

_QUESTIONS = (
    "Tell me about {}.",
    "What do you know about {}?",
    "Write a short paragraph about {}.",
    "Explain {} in simple terms.",
)
_OPENINGS = ("def ", "import ", "class ", "# ", "for ", "The ", "In ", "A ", "It ", "When ")


def topics(text: str, n: int) -> list[str]:
    """Up to ``n`` distinct topics: WikiText titles and section titles (``= Title =``, ``= = Section = =``), then the
    first words of lines where there are too few."""
    found = [t.strip() for t in re.findall(r"^ ?(?:= )+([^=\n]{3,60}?) (?:= ?)+$", text, flags=re.M)]
    if len(found) < n:
        found += [" ".join(line.split()[:4]) for line in text.splitlines() if len(line.split()) >= 4]
    out = list(dict.fromkeys(t for t in found if t))
    step = max(1, len(out) // max(1, n))
    return out[::step][:n]


def batch_seed(seed: int, index: int) -> int:
    """The seed of batch ``index``'s generator: 64 bits of sha256 of ``"seed:index"`` (batches draw independent
    streams; no batch's samples depend on how many draws another made)."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{index}".encode()).digest()[:8], "little")


def generation_dtype(device) -> torch.dtype:
    """bfloat16 where matrix products in it are fast (a CUDA device with bfloat16, a CPU that oneDNN runs it on:
    about 3x float32's speed at a 262k vocabulary), else float32. The text only has to be what the model says; its
    logits in bfloat16 are how most people run it."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float32
    if device.type == "cpu":
        probe = getattr(getattr(torch.ops, "mkldnn", None), "_is_mkldnn_bf16_supported", None)
        try:
            return torch.bfloat16 if probe is not None and bool(probe()) else torch.float32
        except RuntimeError:
            return torch.float32
    return torch.float32


def draw(logits: torch.Tensor, temperature: float, gen: torch.Generator) -> list[int]:
    """One token per row of ``logits`` (rows x vocabulary), sampled from ``softmax(logits / temperature)`` with
    ``gen``: the inverse of the cumulative distribution at a uniform draw (a token of probability 0 is never drawn).
    Several times faster than ``torch.multinomial`` at a large vocabulary."""
    probs = torch.softmax(logits.float().cpu() / temperature, dim=-1)
    cdf = probs.cumsum(-1)
    total = cdf[:, -1:]
    u = torch.minimum(torch.rand(total.shape, generator=gen) * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, u, right=True)[:, 0].clamp(max=logits.shape[-1] - 1).tolist()


PROMPT_ALLOWANCE = 128  # tokens of prompt :func:`decode_rows` allows for beside each answer


def decode_rows(model, new_tokens: int, batch_size: int, most: int, budget: int) -> int:
    """Answers to decode per forward: whole batches of ``batch_size``, at most ``most``, whose KV cache over a
    prompt of :data:`PROMPT_ALLOWANCE` tokens and an answer of ``new_tokens`` stays within ``budget`` bytes (from the
    text config's layers, key/value heads and head size in the model's dtype); one batch where the config does not
    say them."""
    try:  # the project's readings of a config (aliases, multi-query), with no attention module to ask
        kv, head_dim = heads_of(None, model.config)[1], head_dim_of(None, model.config)
        per_row = int(text_config_of(model.config).num_hidden_layers) * kv * head_dim * 2
    except (AttributeError, TypeError, ValueError, ZeroDivisionError):
        return batch_size
    per_row *= new_tokens + PROMPT_ALLOWANCE
    per_row *= next(model.parameters()).element_size()
    return max(batch_size, min(most, budget // max(1, per_row)) // batch_size * batch_size)


def _keeps_last_logits(runner) -> bool:
    """Whether ``runner``'s forward takes ``logits_to_keep`` (so a prefill computes one position's logits per row)."""
    return "logits_to_keep" in inspect.signature(runner.forward).parameters


@torch.no_grad()
def _sample(
    model,
    tokenizer,
    prompts: list[list[int]],
    new_tokens: int,
    gens: list[tuple[torch.Generator, int]],
    temperature: float,
) -> list[list[int]]:
    """Sampled continuations, left-padded batch with the KV cache (as the agreement reference is generated); only
    the last position's logits are computed where the model's forward takes ``logits_to_keep``. ``gens``: the
    generators and how many consecutive rows each draws for (their counts sum to the rows)."""
    device, width = next(model.parameters()).device, max(len(p) for p in prompts)
    model = text_runner(model)  # BLIP-2's language model: its own forward needs images
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    last = {"logits_to_keep": 1} if _keeps_last_logits(model) else {}
    out, past = [[] for _ in prompts], None
    for _ in range(new_tokens):
        cache = cache_kwargs(model, past)
        step = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True, **cache, **last)
        past = output_cache(step)
        logits, tokens, start = step.logits[:, -1], [], 0
        for gen, n in gens:
            tokens += draw(logits[start : start + n], temperature, gen)
            start += n
        for row, t in enumerate(tokens):
            out[row].append(t)
        ids = torch.tensor([[t] for t in tokens], device=device)
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
        positions = positions[:, -1:] + 1
    return out


def self_generated_text(
    model,
    tokenizer,
    source_text: str,
    *,
    chats: int = 32,
    openings: int = 16,
    new_tokens: int = 128,
    temperature: float = 0.8,
    seed: int = 0,
    batch_size: int = 16,
    rows: int | None = None,
    on_batch=None,
) -> str:
    """The original model's own answers and continuations (module docstring), as one text of documents separated by
    blank lines. Costs ``(chats + openings) / batch_size`` batched generations of ``new_tokens`` steps, split over
    the ranks of an initialised process group (every rank returns the whole text), decoded ``rows // batch_size``
    consecutive batches per forward (``None``: one; a model whose forward computes every position's logits, without
    ``logits_to_keep``, always one). ``on_batch(n)`` is called after each forward this process ran with ``n``, the
    documents of that round of forwards on every rank (one process: the forward's own)."""
    if rows is not None and (not isinstance(rows, int) or isinstance(rows, bool) or rows < 1):
        raise ValueError(f"rows must be a positive int (answers decoded per forward), got {rows!r}")
    subjects = topics(source_text, chats)
    texts = []
    if getattr(tokenizer, "chat_template", None):
        texts += [
            tokenizer.apply_chat_template(
                [{"role": "user", "content": _QUESTIONS[j % len(_QUESTIONS)].format(s)}],
                tokenize=False,
                add_generation_prompt=True,
            )
            for j, s in enumerate(subjects)
        ]
    else:
        texts += [_QUESTIONS[j % len(_QUESTIONS)].format(s) + "\n" for j, s in enumerate(subjects)]
    texts += [_OPENINGS[j % len(_OPENINGS)] for j in range(openings)]
    batches = [texts[start : start + batch_size] for start in range(0, len(texts), batch_size)]
    n_ranks, me = ranks.world(), ranks.rank()
    per_pass = max(1, (rows or batch_size) // batch_size) if _keeps_last_logits(text_runner(model)) else 1
    # consecutive batches decoded together, the groups shared out: the same forwards for any number of processes
    groups = [range(start, min(start + per_pass, len(batches))) for start in range(0, len(batches), per_pass)]
    mine = {}
    for g in range(me, len(groups), n_ranks):
        group = groups[g]
        encoded = [tokenizer(t, add_special_tokens="<|" not in t).input_ids for i in group for t in batches[i]]
        gens = [(torch.Generator().manual_seed(batch_seed(seed, i)), len(batches[i])) for i in group]
        conts = iter(_sample(model, tokenizer, encoded, new_tokens, gens, temperature))
        for index in group:
            mine[index] = [
                prompt + tokenizer.decode(next(conts), skip_special_tokens=False) for prompt in batches[index]
            ]
        if on_batch is not None:
            first = g - me
            on_batch(sum(len(batches[i]) for grp in groups[first : first + n_ranks] for i in grp))
    return "\n\n".join(doc for docs in ranks.all_in_order(mine, len(batches)) for doc in docs)


def mixed_text(calibration_text: str, generated: str, share: float = 0.5) -> str:
    """``calibration_text`` and ``generated`` interleaved in 8 slices each, ``share`` of the characters from
    ``generated`` (spread blocks then cover both kinds)."""
    n_gen = len(generated)
    n_cal = int(n_gen * (1 - share) / max(share, 1e-9))
    cal = calibration_text[:n_cal]
    parts = []
    for j in range(8):
        parts.append(cal[j * len(cal) // 8 : (j + 1) * len(cal) // 8])
        parts.append(generated[j * n_gen // 8 : (j + 1) * n_gen // 8])
    return "\n\n".join(p for p in parts if p)
