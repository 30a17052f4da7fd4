"""Healing: after calibration, the converted model's attention layers are distilled from the original's.

A norm gain cannot give back what a norm erases (each token's query and key length; for ``qkv_norm`` each value's),
so a calibrated conversion still differs from the original (docs/conversion.md). Healing trains more than the gains:
each converted attention layer's q/k/v/o projections and its new norms are fitted by Adam to the original
attention layer's output on the original model's own inputs (layer-wise attention transfer, as LoLCATs' first
stage trains new attention to match the old one's outputs). Like calibration it streams the checkpoint
(:class:`hf_qknorm.conversion.calibration.streaming.StreamedCheckpoint`): one decoder block of the original and of the
converted model in memory at a time, plus the activations of a fixed number of text blocks -- memory is bounded by
the model and ``HealSettings.blocks``, never by the length of the text. The source is only read.

The result is the requested architecture: only existing tensors change value (and the new norms), so a ``qk_norm``
/ ``rmsnorm`` Llama is still exactly a Qwen3 model. Per layer the healed weights are kept only if they lower the
layer's output error on the heal text; the held-out streams (original, calibrated, healed) are moved one block on
beside the fit, so the report gives held-out perplexity and next-token top-1 agreement before and after at no
extra pass. The progress line shows tokens/s and the agreement so far: the share of held-out positions where the
original and the healed model's hidden states after the current layer, read through the final norm and the
output head (a logit lens), pick the same token.

Across processes (``torchrun`` / ``accelerate launch``, an initialised ``torch.distributed`` process group of
``world`` ranks; :mod:`hf_qknorm.conversion.orchestration.ranks`): with ``inputs == "original"`` a layer's fit depends
only on the original model's activations, so layer ``i`` is fitted on rank ``i % world`` alone while every rank streams
the original through every layer (each needs the activations; memory per rank is one process's). The fitted layers are
then gathered on every rank, and rank 0 streams the held-out blocks once more -- original, calibrated and healed,
one block at a time -- to score them, and broadcasts the report: every rank returns the same ``(tensors, report)``,
equal to one process's bit for bit (the report's ``seconds`` aside). ``inputs == "converted"`` fits each layer on
the layers healed before it and is refused with more than one rank. The optional end-to-end stage that follows
(:mod:`hf_qknorm.conversion.healing.endtoend`) trains every layer at once: it runs on rank 0 only (the caller broadcasts
its result).
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Literal

import torch

from ...portable.norms import NORM_CLASSES
from ..calibration.layerwise import attention_call
from ..calibration.localfit import attention_with_weights, fit_output, output_scale, relative_error, store_shared
from ..calibration.streaming import StreamedCheckpoint, rows, run_blocks, run_capturing
from ..orchestration import ranks
from ..orchestration.progress import Stage

__all__ = ["HealReport", "HealSettings", "check_world", "heal_checkpoint", "heal_text", "lr_scales"]


SELF_NEW_TOKENS = 128  # tokens per self-generated answer or continuation (--heal-text self)
SELF_BATCH_SIZE = 32  # answers sampled with one generator
# answers decoded in one forward: several consecutive batches, each drawing from its own generator (faster: a large
# output head costs about as much per step for 128 rows as for 32; the same draws, some answers rounded onto another
# path); fewer where their KV cache would pass the bytes. With more than one rank: group g on rank g % world
SELF_ROWS = 128
SELF_CACHE_BYTES = 2 << 30
LR_FACTORS = (1.0, 0.3, 0.1)  # --heal-lr-search: the step sizes tried per layer, as multiples of --heal-lr
LR_WIDEN = 2  # --heal-lr-search: smaller steps tried beyond those while the smallest tried fits best
TRIAL_SHARE = 16  # --heal-lr-search: each trial takes steps // TRIAL_SHARE steps (of at most the default's steps)
TRIAL_CALLS = 16  # --heal-lr-search: the recorded calls a trial's error is measured on
# --heal-attention-kl left to its default: measured on SmolLM2 and Gemma 3 (docs/conversion.md, healing): the term
# raised greedy-prefix agreement for qk_norm and capped schemes and cost qkv_norm three points of perplexity
ATTENTION_KL_DEFAULT = 1.0
ATTENTION_KL_QKV_NORM = 0.0
# --heal-mix left to its default: with the term, "apart" met every goal on SmolLM2 and on Gemma 3 at cap 10 (three
# seeds), where interleaved left Gemma 3's WikiText on the line. qkv_norm healed better interleaved with answers of
# 256 tokens; with today's 128 apart heals it better too (two seeds, docs/conversion.md)
MIX_DEFAULT = "apart"
# --heal-tokens left to its default: twice the layer-wise steps moved nothing on qk_norm, but took qkv_norm's Tiny
# Shakespeare within its 1.15x goal; 1,500 steps keep it there at two seeds (1.129x) in less time (docs/conversion.md)
TOKENS_DEFAULT = 204_800
TOKENS_QKV_NORM = 384_000
ERROR_CALLS = 64  # a layer's output error before and after its fit: on this many recorded calls, spread
# the original layer's attention probabilities kept for the attention term per layer fit (bytes): Gemma 3 270M's
# 256 heal blocks take 256 MiB, SmolLM2-135M's 576 MiB; a fit draws each block about three times
TEACHER_CACHE_BYTES = 1 << 30


@dataclass(frozen=True)
class HealSettings:
    """How much healing :func:`~hf_qknorm.convert` does after calibration (``heal=HealSettings()``,
    ``hf-qknorm convert --heal``). What the defaults cost and give on real models: docs/conversion.md."""

    # metadata["help"]: the command line's help for each field (`hf-qknorm convert --heal-...`)
    tokens: int | None = field(
        default=None,
        metadata={
            "help": "training tokens per layer: each layer's attention takes tokens // block_len Adam steps of "
            f"one block each. Default: the scheme's, {TOKENS_DEFAULT}, but {TOKENS_QKV_NORM} for qkv_norm, whose "
            "value norm the longer fit heals further (docs/conversion.md) (implies --heal)"
        },
    )
    blocks: int = field(
        default=256,
        metadata={
            "help": "distinct blocks of heal text the steps draw from (at most: a shorter text gives fewer), "
            "held as activations (memory: blocks x block_len x hidden size floats, a few times over) (implies --heal)"
        },
    )
    lr: float = field(
        default=1e-3,
        metadata={
            "help": "Adam step size of the projections and norms, cosine-decayed to 0; a norm weight of RMS above 1 "
            "(an l2/lp logit scale, a large gain) steps by this times its RMS (implies --heal)"
        },
    )
    lr_search: bool = field(
        default=True,
        metadata={
            "help": "per layer, try the step sizes --heal-lr x (1, 0.3, 0.1) on a short fit each (1/16 of the "
            "steps), and up to two smaller ones while the smallest tried fits best (1e-4 -> 3e-5 -> 1e-5); heal with "
            "the one whose output error is lowest: the step size that suits a model's weights differs between "
            "families (implies --heal)"
        },
    )
    seed: int = field(default=0, metadata={"help": "random seed of the order of the blocks (implies --heal)"})
    text: Literal["self", "calibration"] = field(
        default="self",
        metadata={
            "help": "the text the layers are fitted on: self = the calibration text mixed half and half with the "
            "original model's own chat answers and continuations, generated first (questions on topics of the "
            "calibration text, never the agreement prompts; loads the original whole once); calibration = the "
            "calibration text alone (implies --heal)"
        },
    )
    mix: Literal["interleaved", "apart"] | None = field(
        default=None,
        metadata={
            "help": "how --heal-text self's blocks are drawn: interleaved = spread over the calibration text and the "
            "generated text interleaved in 8 slices each (as many characters of each; a block may straddle a join); "
            "apart = half the blocks spread over the whole calibration text, half over the generated text, none "
            f"spanning both. Default: {MIX_DEFAULT}, for every scheme (measured on SmolLM2 and Gemma 3, "
            "docs/conversion.md) (implies --heal)"
        },
    )
    self_tokens: int = field(
        default=32_768,
        metadata={
            "help": "tokens the original model generates for --heal-text self: answers and continuations of "
            f"{SELF_NEW_TOKENS} tokens, three chat answers to one continuation (implies --heal)"
        },
    )
    inputs: Literal["original", "converted"] = field(
        default="original",
        metadata={
            "help": "what each layer is fitted on: original = the original model's activations, matching the "
            "original attention output; converted = the healed model's own activations, matching the original "
            "residual stream after attention (corrects the error earlier layers left) (implies --heal)"
        },
    )
    attention_kl: float | None = field(
        default=None,
        metadata={
            "help": "weight of attention-probability distillation in each layer's fit: every step's loss is the "
            "layer's output error plus this times the KL divergence of the converted layer's attention "
            "probabilities (per head and query) from the original's on the same text; the fit is still kept or "
            "rejected on the output error alone (0: output error only). Default: the scheme's, "
            f"{ATTENTION_KL_DEFAULT:g}, but {ATTENTION_KL_QKV_NORM:g} for qkv_norm, whose value norm the term was "
            "measured to make worse (docs/conversion.md) (implies --heal)"
        },
    )

    end_to_end_tokens: int = field(
        default=0,
        metadata={
            "help": "after the layer-wise stage, tokens of end-to-end distillation: every attention layer trained "
            "at once so that the converted model's next-token distribution matches the original's (KL), one block "
            "per Adam step; loads the original and the converted model whole (0: none) (implies --heal)"
        },
    )
    end_to_end_lr: float = field(
        default=1e-4,
        metadata={"help": "Adam step size of the end-to-end stage, cosine-decayed to 0 (implies --heal)"},
    )

    def __post_init__(self):
        for name, least in (("tokens", 1), ("blocks", 1), ("end_to_end_tokens", 0), ("self_tokens", 1)):
            value = getattr(self, name)
            if value is None and name == "tokens":  # the scheme's, made by for_scheme
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"heal {name.replace('_', ' ')} must be an integer >= {least}, got {value!r}")
        if self.text not in ("self", "calibration"):
            raise ValueError(f"heal text must be 'self' or 'calibration', got {self.text!r}")
        if self.mix is not None and self.mix not in ("interleaved", "apart"):
            raise ValueError(f"heal mix must be 'interleaved' or 'apart', got {self.mix!r}")
        if self.text == "self" and self.mix == "apart" and self.blocks < 2:
            raise ValueError(
                f"heal mix 'apart' draws half the blocks from each text: heal blocks must be >= 2, got "
                f"{self.blocks!r} (heal mix 'interleaved' draws one)"
            )
        if self.inputs not in ("original", "converted"):
            raise ValueError(f"heal inputs must be 'original' or 'converted', got {self.inputs!r}")
        if not isinstance(self.lr_search, bool):
            raise ValueError(f"heal lr search must be True or False, got {self.lr_search!r}")
        kl = self.attention_kl
        if kl is not None and (
            isinstance(kl, bool) or not (isinstance(kl, (int, float)) and math.isfinite(kl) and kl >= 0)
        ):
            raise ValueError(f"heal attention kl must be a finite number >= 0, got {kl!r}")
        for name in ("lr", "end_to_end_lr"):
            value = getattr(self, name)
            if isinstance(value, bool) or not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ValueError(f"heal {name.replace('_', ' ')} must be a positive finite number, got {value!r}")

    def for_scheme(self, scheme: str) -> HealSettings:
        """These settings with ``tokens``, ``attention_kl`` and ``mix`` left to their defaults (``None``) made the
        scheme's: ``tokens`` 384,000 for ``qkv_norm``, 204,800 for every other scheme; ``attention_kl`` 0 for
        ``qkv_norm``, 1 for every other; ``mix`` ``"apart"`` for every scheme. :func:`~hf_qknorm.convert` heals with
        this, and its report records what was used."""
        qkv = scheme == "qkv_norm"
        kl = self.attention_kl
        if kl is None:
            kl = ATTENTION_KL_QKV_NORM if qkv else ATTENTION_KL_DEFAULT
        mix = self.mix or MIX_DEFAULT
        tokens = self.tokens
        if tokens is None:
            tokens = TOKENS_QKV_NORM if qkv else TOKENS_DEFAULT
        if (tokens, kl, mix) == (self.tokens, self.attention_kl, self.mix):
            return self
        return replace(self, tokens=tokens, attention_kl=kl, mix=mix)

    def steps(self, block_len: int) -> int:
        if self.tokens is None:  # left to the scheme's: never guessed here
            raise ValueError("HealSettings.steps(): tokens is None; pass settings.for_scheme(scheme)")
        return max(1, self.tokens // block_len)

    def trial_steps(self, block_len: int) -> int:
        """Steps of each step-size trial per layer (0 without ``lr_search``): ``1 / TRIAL_SHARE`` of the layer's
        steps, of at most the default count's (``TOKENS_DEFAULT``), so a longer heal does not lengthen the trials --
        they rank step sizes, which SmolLM2's ``qkv_norm`` layers did alike at 50 and 100 steps."""
        if not self.lr_search:
            return 0
        return max(1, min(self.steps(block_len), max(1, TOKENS_DEFAULT // block_len)) // TRIAL_SHARE)

    def layer_steps(self, block_len: int) -> int:
        """Adam steps per layer, the first trials included (a widened search takes up to ``LR_WIDEN`` more)."""
        return self.steps(block_len) + len(LR_FACTORS) * self.trial_steps(block_len)


@dataclass
class HealReport:
    """What healing did and measured (held-out text; top-1: the share of held-out positions where the converted
    model's most likely next token is the original's)."""

    settings: dict
    steps_per_layer: int
    tokens_per_layer: int
    text_tokens: int  # distinct tokens of heal text (blocks x block_len)
    seconds: float
    ppl_original: float
    ppl_before: float
    ppl_after: float
    top1_before: float
    top1_after: float
    layers_kept: int
    layer_errors: list = field(default_factory=list)  # per layer: [before, after] (relative MSE, ERROR_CALLS calls)
    layer_lrs: list = field(default_factory=list)  # per layer: the step size the fit used (lr_search picks it)
    # --heal-text self: the tokens the original generated (by its tokenizer) and the seconds that took
    generated_tokens: int = 0
    generation_seconds: float = 0.0
    # the end-to-end stage (None without it): its settings, steps, seconds, the KL on a fixed batch of heal text
    # before and after, whether it was kept, and the held-out perplexity / top-1 after the layer-wise stage alone
    # (``ppl_after`` / ``top1_after`` above are then the final model's)
    end_to_end: dict | None = None

    def to_dict(self) -> dict:
        return asdict(self)


def _fit(
    attn, calls, targets, settings: HealSettings, block_len: int, seed: int, tick, teacher=None
) -> tuple[float, float, dict | None, float]:
    """The layer fit (:func:`~hf_qknorm.conversion.calibration.localfit.fit_output`) on every parameter of ``attn``
    (projections and new norms), its step size picked by :func:`_pick_lr` under ``settings.lr_search``, with
    ``settings.attention_kl`` x the attention-probability KL from ``teacher`` (:func:`_teacher`) in the loss of both;
    returns (error before, error after, the new parameters by name relative to ``attn`` or ``None`` when the fit did
    not lower the error, the step size). The errors are measured on ``ERROR_CALLS`` of the recorded calls spread over
    them (on all 256, the two passes took about a tenth of a ``qkv_norm`` layer's heal in a profile)."""
    params = dict(attn.named_parameters())
    denom = output_scale(targets)
    error_calls, error_targets = _spread(calls, targets, ERROR_CALLS)
    before = relative_error(attn, error_calls, error_targets, denom)
    start = {k: p.detach().clone() for k, p in params.items()}
    steps = settings.steps(block_len)
    for p in params.values():
        p.requires_grad_(True)
    try:
        scales = lr_scales(attn, params)
        lr = settings.lr
        if settings.lr_search:
            lr = _pick_lr(attn, calls, targets, denom, params, start, settings, block_len, seed, tick, scales, teacher)
        distil = dict(teacher=teacher, kl_weight=settings.attention_kl)
        fit_output(
            attn, calls, targets, denom, list(params.values()), lambda: None, steps, lr, seed, tick, scales, **distil
        )
    finally:
        for p in params.values():
            p.requires_grad_(False)
    after = relative_error(attn, error_calls, error_targets, denom)
    if not after < before:
        _restore(params, start)
        return before, before, None, lr
    return before, after, {k: p.detach().float().cpu().clone() for k, p in params.items()}, lr


def _spread(calls: list, targets: list, k: int) -> tuple[list, list]:
    """``k`` of the recorded calls and their targets, evenly spread over them (all of them where there are few)."""
    n = len(calls)
    pick = [j * n // k for j in range(k)] if n > k else range(n)
    return [calls[j] for j in pick], [targets[j] for j in pick]


def _restore(params: dict, start: dict) -> None:
    with torch.no_grad():
        for k, p in params.items():
            p.copy_(start[k])


def lr_scales(attn, params: dict) -> list[float]:
    """Per parameter of ``attn``, the factor on its step size: the weight of a norm the scheme added steps relative
    to its size (its RMS, where above 1), as calibration fits it -- an ``l2``/``lp`` logit scale is a temperature of
    about 10, calibrated q/k gains reach 2-7, and at the projections' step size a whole heal moves them a few per
    cent. Everything else (projections, biases, a model's own norms): 1."""
    gains = {id(m.weight) for m in attn.modules() if isinstance(m, NORM_CLASSES) and m.weight is not None}
    return [max(1.0, float(p.detach().pow(2).mean().sqrt())) if id(p) in gains else 1.0 for p in params.values()]


def _pick_lr(
    attn, calls, targets, denom, params, start, settings, block_len, seed, tick, scales, teacher=None
) -> float:
    """The step size among ``settings.lr * LR_FACTORS`` whose short fit (``settings.trial_steps``, from the layer's
    start each time, the same blocks in the same order) leaves the lowest output error on ``TRIAL_CALLS`` of the
    recorded calls spread over them. While the smallest step tried fits best (or every trial diverged), the next
    smaller one (:func:`_below`) is tried too, at most ``LR_WIDEN`` more trials. Only downwards: a short fit favours
    large steps (it has few steps to make progress in), so a small step that wins one is better still over the whole
    fit, while a large one that wins may not be (on SmolLM2, 3e-3 won five layers' trials and ended worse in three).
    The layer is back at its start afterwards. Ties go to the larger step; ``settings.lr`` where every trial
    diverged."""
    trial = settings.trial_steps(block_len)
    probe_calls, probe_targets = _spread(calls, targets, TRIAL_CALLS)
    errors: dict[float, float] = {}  # step size -> the trial's error (inf: diverged)

    distil = dict(teacher=teacher, kl_weight=settings.attention_kl)

    def run(lr):
        fit_output(
            attn, calls, targets, denom, list(params.values()), lambda: None, trial, lr, seed, tick, scales, **distil
        )
        error = relative_error(attn, probe_calls, probe_targets, denom)
        _restore(params, start)
        errors[lr] = error if math.isfinite(error) else math.inf

    def best():
        return min(errors, key=lambda lr: (errors[lr], -lr))

    for factor in LR_FACTORS:
        run(settings.lr * factor)
    for _ in range(LR_WIDEN):
        lr = best()
        if errors[lr] < math.inf and lr != min(errors):
            break
        run(_below(min(errors)))
    return settings.lr if errors[best()] == math.inf else best()


def _below(lr: float) -> float:
    """The step of the series 1, 3, 10, 30, ... (times a power of ten) next below ``lr``: 1e-4 -> 3e-5 -> 1e-5; from
    a step off the series, the series' next one below."""
    exponent = math.floor(math.log10(lr) + 1e-9)
    mantissa = lr / 10**exponent  # in [1, 10)
    step = (3.0 if mantissa > 3.1 else 1.0 if mantissa > 1.1 else 0.3) * 10**exponent
    return float(f"{step:.3g}")  # 3e-5, not 3.0000000000000004e-05


def check_world(settings: HealSettings, reusing: tuple[int, ...] = ()) -> None:
    """Refuse, with more than one process, fits that depend on the layers healed before them: ``inputs ==
    "converted"`` (each layer is fitted on the healed layers' activations) and a model whose layers ``reusing``
    attend over an earlier layer's keys (fitted on the keys that layer's fit kept)."""
    if ranks.world() == 1:
        return
    if settings.inputs == "converted":
        raise ValueError(
            f"heal inputs 'converted' fits each layer after the ones before it and cannot be split over "
            f"{ranks.world()} processes; use heal inputs 'original' (--heal-inputs original) or one process"
        )
    if reusing:
        raise ValueError(
            f"layer {reusing[0]} attends over an earlier layer's keys and values (num_kv_shared_layers) and is healed "
            f"on the keys that layer's fit kept, so the heal cannot be split over {ranks.world()} processes; heal "
            "in one process"
        )


def _teacher(orig, o_attn, inputs, layer_calls, settings: HealSettings):
    """``j -> `` the original attention layer's probabilities for heal block ``j`` (on the original model's own
    inputs), or ``None`` without ``settings.attention_kl``. Each is computed when first asked and kept while the kept
    ones take at most :data:`TEACHER_CACHE_BYTES` (a fit draws each block several times, its trials the same blocks
    again); beyond that it is computed at each ask. A kept result is what computing it again gives (the same layer on
    the same call): the budget changes the time a fit takes, never its result. The calls are the original stream's: a
    layer reading keys an earlier layer stored (Gemma 3n, Gemma 4) reads the original's, never the fits' (the
    converted layers')."""
    if not settings.attention_kl:
        return None
    with torch.no_grad():
        o_calls = [attention_call(orig, o_attn, h, c, "original") for h, c in zip(inputs, layer_calls)]
    kept: dict[int, torch.Tensor] = {}
    room = [TEACHER_CACHE_BYTES]

    @torch.no_grad()
    def probabilities(j: int) -> torch.Tensor:
        if j in kept:
            return kept[j]
        weights = attention_with_weights(o_attn, o_calls[j])[1]
        size = weights.numel() * weights.element_size()
        if size <= room[0]:
            kept[j], room[0] = weights, room[0] - size
        return weights

    return probabilities


def heal_checkpoint(
    stream: StreamedCheckpoint,
    values: dict,
    heal_blocks: torch.Tensor,
    eval_blocks: torch.Tensor,
    settings: HealSettings,
    batch_size: int,
    progress: bool = True,
) -> tuple[dict, HealReport]:
    """Heal every attention layer of ``stream``'s converted model, whose new norms start at ``values``.

    Returns ``(tensors, report)``: the healed tensors by state-dict name (the new norms and the projections that
    changed; float32 on the CPU) and the :class:`HealReport`. With an initialised process group of more than one
    rank the layers are fitted side by side (module docstring); every rank must call this with the same arguments
    and returns the same result."""
    if settings.attention_kl is None:
        raise ValueError("heal_checkpoint(): settings.attention_kl is None; pass settings.for_scheme(scheme)")
    check_world(settings, stream.reusing)
    t0 = time.time()
    with stream.outer():  # embeddings, final norm and head stay for the logit lens and the scores
        if ranks.world() == 1:
            return _heal(stream, values, heal_blocks, eval_blocks, settings, batch_size, progress, t0)
        return _heal_split(stream, values, heal_blocks, eval_blocks, settings, batch_size, progress, t0)


def _merge(stream, values: dict, results: list) -> tuple[dict, list, int, list]:
    """``values`` updated with the kept fits of ``results`` (per layer: error before, error after, new parameters or
    ``None``, step size), the per-layer errors, the number of layers kept and the per-layer step sizes."""
    out, kept = dict(values), 0
    for i, (_, _, new, _) in enumerate(results):
        if new is not None:
            kept += 1
            attn_prefix = f"{stream.prefix}{i}.{stream.family.attention}."
            out.update({attn_prefix + k: v for k, v in new.items()})
    return out, [[before, after] for before, after, _, _ in results], kept, [lr for *_, lr in results]


def _report(settings, steps, heal_blocks, t0, scores, kept, errors, lrs) -> HealReport:
    return HealReport(
        settings=asdict(settings),
        steps_per_layer=steps,
        tokens_per_layer=steps * heal_blocks.shape[1],
        text_tokens=heal_blocks.numel(),
        seconds=time.time() - t0,
        ppl_original=scores["original"][0],
        ppl_before=scores["before"][0],
        ppl_after=scores["after"][0],
        top1_before=scores["before"][1],
        top1_after=scores["after"][1],
        layers_kept=kept,
        layer_errors=errors,
        layer_lrs=lrs,
    )


def _ticker(stage, i: int, steps: int, block_len: int):
    def tick(step):
        stage.update(block_len)
        if (step + 1) % max(1, steps // 4) == 0:
            stage.update(0, note=f"layer {i}: step {step + 1}/{steps}")

    return tick


def _heal(stream, values, heal_blocks, eval_blocks, settings, batch_size, progress, t0):
    """One process: the layers one after the other, the held-out streams moved on beside the fits."""
    family = stream.family
    block_len = heal_blocks.shape[1]
    steps = settings.steps(block_len)
    inputs, calls = stream.block_inputs(heal_blocks, 1)
    own = [h.clone() for h in inputs] if settings.inputs == "converted" else None  # the healed model's stream
    held, eval_calls = stream.block_inputs(eval_blocks, batch_size)
    streams = {name: [h.clone() for h in held] for name in ("original", "before", "after")}
    results = []
    n_tokens = stream.num_layers * settings.layer_steps(block_len) * block_len
    with Stage("healing layer by layer", n_tokens, "tok", progress) as stage:
        for i, orig, patched in stream.layers(values):
            o_attn, p_attn = getattr(orig, family.attention), getattr(patched, family.attention)
            with torch.no_grad():
                targets, nxt = run_capturing(orig, o_attn, inputs, calls[i], "original")
                fit_inputs = inputs if own is None else own
                attn_calls = [attention_call(patched, p_attn, h, c) for h, c in zip(fit_inputs, calls[i])]
                if own is not None:  # reach the original residual stream after attention: x' + a' = x + a
                    targets = [t + (x - y) for t, x, y in zip(targets, inputs, own)]
                streams["original"] = run_blocks(orig, streams["original"], eval_calls[i], "original")
                streams["before"] = run_blocks(patched, streams["before"], eval_calls[i], "before")
            tick = _ticker(stage, i, steps, block_len)
            teacher = _teacher(orig, o_attn, inputs, calls[i], settings)
            results.append(_fit(p_attn, attn_calls, targets, settings, block_len, settings.seed + i, tick, teacher))
            store_shared(p_attn, attn_calls)  # a later layer reading its keys is fitted on the kept ones
            before, after = results[-1][:2]
            with torch.no_grad():
                streams["after"] = run_blocks(patched, streams["after"], eval_calls[i], "after")
                lens = _agreement(stream, streams["original"][0], streams["after"][0])
            note = f"layer {i}: output error {before:.4f} -> {after:.4f} (lr {results[-1][3]:.0e})"
            stage.update(0, note=f"{note}, agreement {100 * lens:.1f}%")
            if own is not None:
                with torch.no_grad():
                    own = run_blocks(patched, own, calls[i], "own")
            inputs = nxt
    out, errors, kept, lrs = _merge(stream, values, results)
    scores = {k: stream.score(v, eval_blocks, batch_size, streams["original"]) for k, v in streams.items()}
    return out, _report(settings, steps, heal_blocks, t0, scores, kept, errors, lrs)


def _heal_split(stream, values, heal_blocks, eval_blocks, settings, batch_size, progress, t0):
    """More than one rank (``inputs == "original"``): every rank streams the original through every layer and fits
    layers ``rank, rank + world, ...``; the fits are gathered everywhere, and rank 0 scores the held-out blocks
    (:func:`_held_out`) and broadcasts the report."""
    family, world, me = stream.family, ranks.world(), ranks.rank()
    block_len = heal_blocks.shape[1]
    steps = settings.steps(block_len)
    inputs, calls = stream.block_inputs(heal_blocks, 1)
    mine = {}
    n_tokens = len(range(me, stream.num_layers, world)) * settings.layer_steps(block_len) * block_len
    with Stage(f"healing layers {me}, {me + world}, ... (rank {me} of {world})", n_tokens, "tok", progress) as stage:
        for i, orig, patched in stream.layers(values):
            o_attn, p_attn = getattr(orig, family.attention), getattr(patched, family.attention)
            with torch.no_grad():
                targets, nxt = run_capturing(orig, o_attn, inputs, calls[i], "original")
            if i % world == me:
                with torch.no_grad():
                    attn_calls = [attention_call(patched, p_attn, h, c) for h, c in zip(inputs, calls[i])]
                tick = _ticker(stage, i, steps, block_len)
                teacher = _teacher(orig, o_attn, inputs, calls[i], settings)
                mine[i] = _fit(p_attn, attn_calls, targets, settings, block_len, settings.seed + i, tick, teacher)
                stage.update(0, note=f"layer {i}: output error {mine[i][0]:.4f} -> {mine[i][1]:.4f}")
            inputs = nxt
    out, errors, kept, lrs = _merge(stream, values, ranks.all_in_order(mine, stream.num_layers))

    def score():
        scores = _held_out(stream, values, out, eval_blocks, batch_size, progress)
        return _report(settings, steps, heal_blocks, t0, scores, kept, errors, lrs)

    return out, ranks.first(score)


def _held_out(stream, values, healed, eval_blocks, batch_size, progress) -> dict:
    """Perplexity and top-1 of the original, calibrated (``values``) and healed (``healed``) models on the held-out
    blocks, streamed one block at a time as in :func:`_heal`: ``{"original" | "before" | "after": (ppl, top1)}``."""
    held, eval_calls = stream.block_inputs(eval_blocks, batch_size)
    streams = {name: [h.clone() for h in held] for name in ("original", "before", "after")}
    with Stage("scoring the healed model", stream.num_layers, "layers", progress) as stage, torch.no_grad():
        for i, orig, patched in stream.layers(values):
            streams["original"] = run_blocks(orig, streams["original"], eval_calls[i], "original")
            streams["before"] = run_blocks(patched, streams["before"], eval_calls[i], "before")
            stream.set_values(stream.layer_values(healed, i))
            streams["after"] = run_blocks(patched, streams["after"], eval_calls[i], "after")
            lens = _agreement(stream, streams["original"][0], streams["after"][0])
            stage.update(1, note=f"layer {i}: agreement {100 * lens:.1f}%")
    return {k: stream.score(v, eval_blocks, batch_size, streams["original"]) for k, v in streams.items()}


@torch.no_grad()
def _agreement(stream, original: torch.Tensor, converted: torch.Tensor) -> float:
    """Logit-lens top-1 agreement of one held-out batch (the first block of it: a cheap heartbeat)."""
    a = stream.logits(rows(original, 0)).float().argmax(-1)
    b = stream.logits(rows(converted, 0)).float().argmax(-1)
    return (a == b).float().mean().item()


# --------------------------------------------------------------------------------------------------------------------
# the heal text
# --------------------------------------------------------------------------------------------------------------------
def heal_text(src, tokenizer, calibration_text: str, settings: HealSettings, device, progress: bool = True):
    """The texts healing fits the layers on, each with the share of the heal blocks drawn from it: ``(((text,
    share), ...), generated tokens, seconds)``. ``settings.text == "self"``: the calibration text mixed half and half
    (by characters) with the original model's own chat answers and continuations
    (:mod:`hf_qknorm.conversion.healing.selftext`), one text; with ``settings.mix == "apart"`` the two texts, half
    the blocks each. The answers are sampled with ``settings.seed`` -- a converted model is
    used the way the original was, and fitting it on what the original says in that use is what keeps its answers
    (measured: docs/conversion.md). The whole original is loaded once for it, on ``device`` (on every
    rank of a process group, each generating its share of the batches; every rank returns the same text), in
    bfloat16 where that is fast (:func:`~hf_qknorm.conversion.healing.selftext.generation_dtype`)."""
    if settings.text == "calibration":
        return ((calibration_text, 1.0),), 0, 0.0
    if settings.mix is None:
        raise ValueError("heal_text(): settings.mix is None; pass settings.for_scheme(scheme)")
    from ..output.shards import load_pretrained
    from .selftext import decode_rows, generation_dtype, mixed_text, self_generated_text

    t0 = time.time()
    # a multimodal original (LLaVA, Qwen2-VL) through its image-text-to-text class: it generates from text alone
    model = load_pretrained(src, dtype=generation_dtype(device)).to(device).eval()
    docs = max(1, settings.self_tokens // SELF_NEW_TOKENS)
    openings = docs // 4
    with Stage("generating heal text", docs, "answers", progress) as stage:
        generated = self_generated_text(
            model,
            tokenizer,
            calibration_text,
            chats=docs - openings,
            openings=openings,
            new_tokens=SELF_NEW_TOKENS,
            seed=settings.seed,
            batch_size=SELF_BATCH_SIZE,
            rows=decode_rows(model, SELF_NEW_TOKENS, SELF_BATCH_SIZE, SELF_ROWS, SELF_CACHE_BYTES),
            on_batch=stage.update,
        )
    del model
    n_tokens = len(tokenizer(generated).input_ids)
    if settings.mix == "apart":
        texts = ((calibration_text, 0.5), (generated, 0.5))
    else:
        texts = ((mixed_text(calibration_text, generated, 0.5), 1.0),)
    return texts, n_tokens, time.time() - t0
