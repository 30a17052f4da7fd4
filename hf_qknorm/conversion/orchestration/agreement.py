"""Answer agreement: does the converted model still say what the original said?

Perplexity averages over every token of a text; a user notices answers. :func:`answer_agreement` runs a set of
short prompts (facts, arithmetic, code, instructions, chat turns; ``assets/text/agreement_prompts.json``) through
both models and reports:

* **prefix agreement**: the original's greedy continuation (up to ``new_tokens`` tokens, ending early at an end
  token) is the reference; for each prompt, the fraction of it that the converted model's greedy continuation
  reproduces up to the first different token; averaged over prompts;
* **top-1 agreement**: along the reference (teacher forcing: one divergence does not spoil the rest), the fraction
  of positions where the converted model's most likely next token is the reference token, pooled over prompts.

Both come from one forward pass of the converted model over prompt + reference: its greedy continuation agrees
with the reference exactly as long as its argmax along the reference does (until the first miss both are the same
sequence), so the prefix length is the position of the first teacher-forced miss. Prompts marked ``chat`` are
wrapped in the tokenizer's chat template (a user turn and the assistant's header) when it has one, else used as
they are. The reference is generated in left-padded batches with the original model's KV cache; the converted
model reads prompt + reference in right-padded batches.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from importlib import resources

import torch

from ...portable.families import text_runner
from ...upstream import cache_kwargs, output_cache

__all__ = [
    "AgreementReport",
    "Prompt",
    "agreement",
    "answer_agreement",
    "encode_prompt",
    "folder_agreement",
    "load_prompts",
    "reference_continuations",
]

DEFAULT_NEW_TOKENS = 16


@dataclass(frozen=True)
class Prompt:
    text: str
    kind: str = "text"
    chat: bool = False


@dataclass
class AgreementReport:
    """Agreement of a converted model's answers with the original's (module docstring)."""

    prefix: float  # mean fraction of the reference reproduced up to the first different token
    top1: float  # fraction of reference positions where the converted model's argmax is the reference token
    whole: int  # prompts whose whole reference is reproduced
    prompts: int
    new_tokens: int  # the most tokens per reference (fewer where the original ended its answer)
    by_kind: dict = field(default_factory=dict)  # kind -> {"prefix", "top1", "prompts"}

    def to_dict(self) -> dict:
        return asdict(self)


def load_prompts(path=None) -> list[Prompt]:
    """The prompt set: a JSON list of ``{"text", "kind", "chat"?}`` (default: the bundled set of 46)."""
    if path is None:
        raw = resources.files("hf_qknorm").joinpath("assets/text/agreement_prompts.json").read_text("utf-8")
        where = "the bundled agreement prompts"
    else:
        with open(path, encoding="utf-8") as f:
            raw = f.read()
        where = str(path)
    try:
        items = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{where} is not valid JSON ({exc})") from None
    if not isinstance(items, list) or not items:
        raise ValueError(f"{where} must be a non-empty JSON list of {{'text': ..., 'kind': ...}} objects")
    prompts = []
    for j, item in enumerate(items):
        if not isinstance(item, dict) or not isinstance(item.get("text"), str) or not item["text"]:
            raise ValueError(f"{where}: entry {j} has no non-empty 'text' string: {item!r}")
        prompts.append(Prompt(text=item["text"], kind=str(item.get("kind", "text")), chat=bool(item.get("chat"))))
    return prompts


def encode_prompt(tokenizer, prompt: Prompt) -> list[int]:
    """Token ids of ``prompt``: through the chat template (user turn + assistant header) for a chat prompt when the
    tokenizer has one, else the text with the tokenizer's own special tokens (BOS where it adds one)."""
    if prompt.chat and getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt.text}], tokenize=False, add_generation_prompt=True
        )
        ids = tokenizer(text, add_special_tokens=False).input_ids  # the template writes its own special tokens
    else:
        ids = tokenizer(prompt.text).input_ids
    if not ids:
        raise ValueError(f"prompt {prompt.text!r} encodes to no tokens")
    return list(ids)


def _end_tokens(model, tokenizer) -> set[int]:
    ends = set()
    for value in (
        getattr(getattr(model, "generation_config", None), "eos_token_id", None),
        getattr(tokenizer, "eos_token_id", None),
    ):
        if isinstance(value, int):
            ends.add(value)
        elif isinstance(value, (list, tuple)):
            ends.update(int(v) for v in value)
    return ends


def _device(model) -> torch.device:
    return next(model.parameters()).device


@torch.no_grad()
def reference_continuations(
    model, tokenizer, prompts: list[Prompt], new_tokens: int = DEFAULT_NEW_TOKENS, batch_size: int = 16
) -> list[list[int]]:
    """``model``'s greedy continuation of each prompt: ``new_tokens`` tokens, or fewer ending in an end token.

    Prompts go ``batch_size`` at a time, left-padded (masked, positions counted from each prompt's first token),
    with the model's KV cache: a one-token step reads every weight once for the whole batch, where one prompt at a
    time on a CPU costs a full read of the weights per token."""
    if new_tokens < 1:
        raise ValueError(f"new_tokens must be >= 1, got {new_tokens}")
    ends = _end_tokens(model, tokenizer)
    out = []
    for start in range(0, len(prompts), batch_size):
        encoded = [encode_prompt(tokenizer, p) for p in prompts[start : start + batch_size]]
        out += _greedy_batch(model, encoded, new_tokens, ends)
    return out


def _greedy_batch(model, encoded: list[list[int]], new_tokens: int, ends: set[int]) -> list[list[int]]:
    device, width = _device(model), max(len(e) for e in encoded)
    ids = torch.tensor([[0] * (width - len(e)) + e for e in encoded], device=device)
    mask = torch.tensor([[0] * (width - len(e)) + [1] * len(e) for e in encoded], device=device)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    conts: list[list[int]] = [[] for _ in encoded]
    done = [False] * len(encoded)
    past, model = None, text_runner(model)
    for _ in range(new_tokens):
        cache = cache_kwargs(model, past)
        step = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True, **cache)
        past, tokens = output_cache(step), step.logits[:, -1].float().argmax(-1).tolist()
        for row, token in enumerate(tokens):
            if not done[row]:
                conts[row].append(token)
                done[row] = token in ends
        if all(done):
            break
        ids = torch.tensor([[t] for t in tokens], device=device)
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
        positions = positions[:, -1:] + 1
    return conts


@torch.no_grad()
def agreement(
    model, tokenizer, prompts: list[Prompt], reference: list[list[int]], batch_size: int = 16
) -> AgreementReport:
    """Agreement of ``model``'s answers with ``reference`` (the original's :func:`reference_continuations`).

    Prompt + reference go ``batch_size`` at a time, right-padded and without a mask: attention is causal, so no
    real position sees the padding after it."""
    if len(prompts) != len(reference) or not prompts:
        raise ValueError(f"{len(prompts)} prompts and {len(reference)} reference continuations: need one per prompt")
    if any(not c for c in reference):
        raise ValueError("a reference continuation is empty")
    rows, run = [], text_runner(model)
    for start in range(0, len(prompts), batch_size):
        encoded = [encode_prompt(tokenizer, p) for p in prompts[start : start + batch_size]]
        conts = reference[start : start + batch_size]
        width = max(len(e) + len(c) for e, c in zip(encoded, conts))
        x = torch.tensor(
            [e + c + [0] * (width - len(e) - len(c)) for e, c in zip(encoded, conts)], device=_device(model)
        )
        argmax = run(input_ids=x, use_cache=False).logits.float().argmax(-1).tolist()
        for prompt, e, cont, row in zip(prompts[start : start + batch_size], encoded, conts, argmax):
            hits = [int(p == r) for p, r in zip(row[len(e) - 1 : len(e) - 1 + len(cont)], cont)]
            first_miss = hits.index(0) if 0 in hits else len(hits)
            rows.append((prompt.kind, first_miss / len(cont), sum(hits), len(cont)))
    by_kind = {}
    for kind in dict.fromkeys(r[0] for r in rows):
        mine = [r for r in rows if r[0] == kind]
        by_kind[kind] = {
            "prefix": sum(r[1] for r in mine) / len(mine),
            "top1": sum(r[2] for r in mine) / sum(r[3] for r in mine),
            "prompts": len(mine),
        }
    return AgreementReport(
        prefix=sum(r[1] for r in rows) / len(rows),
        top1=sum(r[2] for r in rows) / sum(r[3] for r in rows),
        whole=sum(r[1] == 1.0 for r in rows),
        prompts=len(rows),
        new_tokens=max(len(c) for c in reference),
        by_kind=by_kind,
    )


def answer_agreement(
    original, converted, tokenizer, prompts: list[Prompt] | None = None, new_tokens: int = DEFAULT_NEW_TOKENS
) -> AgreementReport:
    """Greedy prefix agreement and teacher-forced top-1 agreement of ``converted`` with ``original`` over
    ``prompts`` (default: :func:`load_prompts`), on the first ``new_tokens`` new tokens."""
    prompts = load_prompts() if prompts is None else list(prompts)
    report = agreement(converted, tokenizer, prompts, reference_continuations(original, tokenizer, prompts, new_tokens))
    report.new_tokens = new_tokens
    return report


def folder_agreement(
    original_dir, converted_dir, *, new_tokens: int = DEFAULT_NEW_TOKENS, prompts=None, device="cpu"
) -> AgreementReport:
    """:func:`answer_agreement` of two model folders in float32, loading one model at a time (the original for the
    reference, then the converted one): memory for one whole model, unlike the layer-by-layer calibration."""
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    from ..output.shards import load_pretrained

    prompts = load_prompts() if prompts is None else list(prompts)
    tokenizer = AutoTokenizer.from_pretrained(original_dir)
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # the conversion's own log says what runs; no loading bars inside it
    try:
        model = load_pretrained(original_dir, dtype=torch.float32).to(device).eval()
        reference = reference_continuations(model, tokenizer, prompts, new_tokens)
        del model
        model = load_pretrained(converted_dir, dtype=torch.float32).to(device).eval()
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    report = agreement(model, tokenizer, prompts, reference)
    report.new_tokens = new_tokens
    return report
