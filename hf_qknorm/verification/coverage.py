"""The coverage table: every causal-LM model type the installed Transformers ships, patched or refused, and why.

For each model type a tiny model is built from its own config class (:mod:`.tiny`) and patched with every scheme x
norm. A variant passes when the patch is accepted -- the patch-time self-check (:mod:`hf_qknorm.modeling.selfcheck`)
found the scheme reaching the attention backend exactly -- and the patched model then runs forward and backward with
finite results, decoding with a cache (dynamic and static) gives the logits of the full forward, a left-padded row
gives its logits unpadded, and two sequences packed in one row (restarting ``position_ids``) give theirs apart. A
check the unpatched tiny model fails itself is not made for that type (the table says which). A model type is

- ``patched`` when every variant passes, or every variant but ``qkv_norm`` passes and ``qkv_norm`` is refused up
  front with its reason (a parallel block, a post-norm block);
- ``refused`` when ``patch_model`` refuses it (the reason is the refusal's one line);
- ``FAIL`` when a variant is accepted and then fails a check: a bug, never expected in a released table;
- ``untested`` when no tiny model of it can be built from its config class (the table cannot say; patching a real
  model of the type still runs the self-check);
- ``out of scope`` when it is not a decoder-only softmax-attention text model (an encoder, an encoder-decoder, a
  recurrent, state-space or hybrid model).

A multimodal (image-text-to-text) type is checked through its language model, which ``patch_model`` patches: a tiny
model of it (tiny text and vision configs) goes through the same variants and text checks, and, where its tiny image
inputs are known, an image forward and backward with the vision tower's features unchanged (:mod:`.multimodal`).

The conversion column (:mod:`hf_qknorm.conversion.orchestration.coverage`, filled in by ``hf-qknorm coverage`` through
``coverage(..., chunk_hook=...)``) says, for every patched type, whether a tiny checkpoint of it converts with
:func:`hf_qknorm.convert` (calibrated, written, checked against the converted model in memory and reloaded without
the plugin): ``converted``, ``refused`` (with the reason), ``FAIL`` or ``untested``.

``hf-qknorm coverage`` prints it; ``--markdown`` writes the table committed in docs/coverage/.
"""

from __future__ import annotations

import json
import logging
import time
import warnings
from dataclasses import asdict, dataclass, field

import torch

from ..portable.families import UnsupportedModelError, out_of_scope, type_out_of_scope
from ..portable.schemes import NORMS, SCHEMES
from ..upstream import cache_kwargs, output_cache

PATCHED, REFUSED, FAIL, OUT_OF_SCOPE, UNTESTED = "patched", "refused", "FAIL", "out of scope", "untested"
CONVERTED = "converted"  # the conversion column's status of a type that converts

# Not decoder-only softmax attention, read off the structure by derive_family's refusals.
_SCOPE_REASONS = (
    "no softmax self-attention",
    "several stacks",
    "hybrid model",
    "encoder",
    "multimodal",
    "not a language model",
)


def variants() -> list[tuple[str, str | None]]:
    """Every scheme x norm: 13 variants, ``qk_norm`` / ``layernorm`` first."""
    out = []
    for scheme in sorted(SCHEMES, key=lambda s: s != "qk_norm"):
        for norm in [None] if scheme == "soft_cap" else NORMS:
            out.append((scheme, norm))
    return out


@dataclass
class TypeResult:
    model_type: str
    status: str
    reason: str = ""
    variants: dict = field(default_factory=dict)  # "scheme/norm" -> "ok" or the refusal / failure
    seconds: float = 0.0
    conversion: str = ""  # the conversion column: converted, refused, FAIL, untested; "" not tried
    conversion_note: str = ""
    conversion_variants: dict = field(default_factory=dict)


def check_model_type(model_type: str) -> TypeResult:
    """Patch a tiny model of ``model_type`` with every variant and check it (see the module's docstring)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    from .tiny import is_multimodal, tiny_model

    start = time.perf_counter()
    scope = type_out_of_scope(model_type)
    if scope:  # known from the type alone (a drafter, whose default config does not validate)
        return TypeResult(model_type, OUT_OF_SCOPE, scope)
    try:
        config = CONFIG_MAPPING[model_type]()
    except Exception as exc:
        return TypeResult(model_type, UNTESTED, f"its config cannot be built with defaults ({type(exc).__name__})")
    if is_multimodal(config):  # patch_model patches its language model
        return _check_multimodal(model_type, config, start)
    reason = out_of_scope(config)
    if reason:
        return TypeResult(model_type, OUT_OF_SCOPE, reason)
    said = _structure(model_type, config)
    if said:
        return TypeResult(model_type, *said)
    try:
        base = tiny_model(model_type)
    except Exception as exc:
        return TypeResult(model_type, UNTESTED, f"no tiny model could be built ({type(exc).__name__}: {_line(exc)})")
    baseline = _baseline(base)
    if "train" in baseline:  # the checks cannot tell the patch from the model itself; a refusal still says why
        refused = _refused(model_type, _check_variant(model_type, "qk_norm", "layernorm", exercise=False))
        if refused is not None:
            return refused
        return TypeResult(model_type, UNTESTED, f"the unpatched tiny model fails itself ({baseline['train']})")
    del base
    results = {}
    for scheme, norm in variants():
        key = f"{scheme}/{norm}" if norm else scheme
        results[key] = _check_variant(model_type, scheme, norm, skip=tuple(baseline))
        if key == "qk_norm/layernorm" and results[key].startswith("refused"):
            break  # refused as a model type: the other variants say the same
    result = _summarise(model_type, results)
    if result.status == REFUSED and _refusal(result.reason) == OUT_OF_SCOPE:
        result.status = OUT_OF_SCOPE  # a hybrid model, refused when its layers were found: not what the table covers
    if baseline and result.status == PATCHED:  # checks the unpatched model fails too: say which were not made
        note = f"not checked (the unpatched model fails them too): {', '.join(sorted(baseline))}"
        result.reason = f"{result.reason}; {note}" if result.reason else note
    result.seconds = round(time.perf_counter() - start, 1)
    return result


def _structure(model_type: str, config) -> tuple[str, str] | None:
    """``(status, reason)`` when the structure of the type's default model (a meta-device skeleton) already says:
    out of scope (no softmax self-attention stack, hybrid layers) or refused (attention of another kind)."""
    from ..modeling.derive import get_family

    try:
        get_family(config)
    except UnsupportedModelError as exc:
        text = str(exc)
        if "no causal-LM model can be built" in text:
            return None  # the skeleton cannot say; the tiny model will
        return _refusal(text), text
    return None


def _refused(model_type: str, said: str, multimodal: bool = False) -> TypeResult | None:
    """The result of a type whose unpatched tiny model fails itself, where patching it (``said``: a variant's
    result, unexercised) refuses it for its structure; ``None`` where it does not."""
    if not said.startswith("refused: ") or "probe forward failed" in said:
        return None
    reason = said[len("refused: ") :]
    return TypeResult(model_type, _refusal(reason, multimodal), reason)


def _refusal(text: str, multimodal: bool = False) -> str:
    """The status of a type ``patch_model`` refuses for the reason ``text``: out of scope where the reason says the
    model is not a decoder-only softmax-attention text model (of a ``multimodal`` type: its language model), else
    refused."""
    scope = [r for r in _SCOPE_REASONS if not (multimodal and r == "multimodal")]
    return OUT_OF_SCOPE if any(r in text for r in scope) else REFUSED


def _check_variant(model_type: str, scheme: str, norm: str | None, skip=(), exercise=True) -> str:
    import hf_qknorm

    from .tiny import tiny_model

    model = tiny_model(model_type, dtype=torch.float32)
    settings = {"norm": norm} if norm else {}
    if norm == "lp":
        settings["p"] = 3.0
    try:
        hf_qknorm.patch_model(model, scheme, **settings)
    except UnsupportedModelError as exc:
        return "refused: " + _line(exc)
    except Exception as exc:  # a crash while patching is a bug, not a refusal
        return f"FAIL: patching raised {type(exc).__name__}: {_line(exc)}"
    if not exercise:
        return "ok"
    try:
        return _exercise(model, skip)
    except Exception as exc:
        return f"FAIL: {type(exc).__name__}: {_line(exc)}"


def _check_multimodal(model_type: str, config, start: float) -> TypeResult:
    """An image-text-to-text type, whose language model ``patch_model`` patches: a tiny model of it
    (:func:`.tiny.tiny_multimodal_model`) through every variant and the text checks; where :data:`.tiny.MULTIMODAL`
    builds its image inputs, an image forward and backward and the vision features unchanged too
    (:mod:`.multimodal`)."""
    from ..portable.families import text_model_path
    from .multimodal import image_features
    from .tiny import MULTIMODAL, tiny_multimodal_model

    if getattr(config, "is_encoder_decoder", False):
        return TypeResult(model_type, OUT_OF_SCOPE, f"model type {model_type!r} is an encoder-decoder model")
    try:
        base = tiny_multimodal_model(model_type)
    except Exception as exc:
        return TypeResult(model_type, UNTESTED, f"no tiny model could be built ({type(exc).__name__}: {_line(exc)})")
    try:
        text_model_path(base)
    except UnsupportedModelError as exc:
        return TypeResult(model_type, REFUSED, _line(exc))
    baseline, alone = _baseline(base), None
    if "train" in baseline:  # nothing to compare against; a refusal of the structure still says why
        said = _check_multimodal_variant(model_type, "qk_norm", "layernorm", exercise=False)
        refused = _refused(model_type, said, multimodal=True)
        if refused is not None:
            return refused
        alone = _language_model_alone(base)
        if alone is None:
            return TypeResult(model_type, UNTESTED, f"the unpatched tiny model fails itself ({baseline['train']})")
        whole, baseline = baseline["train"], _baseline(base.get_submodule(alone))
    features, unexercised = None, "no tiny image inputs for this type"
    if MULTIMODAL.get(model_type, (None, None, None))[2] is not None:
        try:
            features = image_features(base)
        except Exception as exc:  # the recipe does not fit this Transformers: say so, check the text path
            unexercised = f"the unpatched model fails the tiny image inputs: {type(exc).__name__}: {_line(exc)}"
    del base
    results = {}
    for scheme, norm in variants():
        key = f"{scheme}/{norm}" if norm else scheme
        results[key] = _check_multimodal_variant(model_type, scheme, norm, tuple(baseline), features, alone=alone)
        if key == "qk_norm/layernorm" and results[key].startswith("refused"):
            break
    result = _summarise(model_type, results)
    if result.status == REFUSED and _refusal(result.reason, multimodal=True) == OUT_OF_SCOPE:
        result.status = OUT_OF_SCOPE  # a hybrid or encoder language model, as the text table says of its type
    notes = [result.reason] if result.reason else []
    if alone is not None and result.status == PATCHED:
        notes.append(f"text checks on its language model .{alone} alone (the whole model without images: {whole})")
    if baseline and result.status == PATCHED:
        notes.append(f"not checked (the unpatched model fails them too): {', '.join(sorted(baseline))}")
    if features is None and result.status == PATCHED:
        notes.append(f"text inputs only ({unexercised})")
    result.reason = "; ".join(notes)
    result.seconds = round(time.perf_counter() - start, 1)
    return result


def _baseline(model) -> dict:
    """The checks the unpatched ``model`` fails (``train`` when its forward or backward does not run), at the strict
    tolerance (:func:`_failures`)."""
    try:
        return _failures(model, strict=True)
    except Exception as exc:
        return {"train": f"{type(exc).__name__}: {_line(exc)}"}


def _language_model_alone(model) -> str | None:
    """The path of a multimodal ``model``'s language model where the text checks can run on it alone: a causal LM
    whose head is the whole model's (:func:`~hf_qknorm.portable.families.text_forward_path`: BLIP-2's OPT, whose
    own forward needs images), passing the forward and backward unpatched. ``None`` otherwise."""
    from ..portable.families import text_forward_path

    path = text_forward_path(model)
    return None if path is None or "train" in _baseline(model.get_submodule(path)) else path


def _check_multimodal_variant(model_type, scheme, norm, skip=(), features=None, exercise=True, alone=None) -> str:
    """One variant of a multimodal type: patched, then the text checks (on the language model at ``alone`` only,
    where the whole model needs images) and, given the unpatched model's vision ``features``, the image checks."""
    import hf_qknorm

    from .multimodal import image_failures
    from .tiny import tiny_multimodal_model

    model = tiny_multimodal_model(model_type)
    settings = {"norm": norm, "p": 3.0 if norm == "lp" else None}
    try:
        hf_qknorm.patch_model(model, scheme, **{k: v for k, v in settings.items() if v is not None})
    except UnsupportedModelError as exc:
        return "refused: " + _line(exc)
    except Exception as exc:  # a crash while patching is a bug, not a refusal
        return f"FAIL: patching raised {type(exc).__name__}: {_line(exc)}"
    if not exercise:
        return "ok"
    try:
        target = model if alone is None else model.get_submodule(alone)
        failed = {k: v for k, v in _failures(target).items() if k not in skip}
        if features is not None:
            failed.update(image_failures(model, features))
    except Exception as exc:
        return f"FAIL: {type(exc).__name__}: {_line(exc)}"
    return "ok" if not failed else "FAIL: " + "; ".join(f"{k}: {v}" for k, v in sorted(failed.items()))


CHECKS = ("train", "dynamic-cache", "static-cache", "padding", "packing")


def _exercise(model, skip=()) -> str:
    """Forward and backward finite; cached decoding (dynamic and static cache) matches the full forward; a
    left-padded row matches it unpadded; two sequences packed in one row (restarting ``position_ids``) match them
    apart. ``skip``: checks the unpatched model itself does not pass (nothing to compare against)."""
    failed = _failures(model)
    bad = {k: v for k, v in failed.items() if k not in skip}
    return "ok" if not bad else "FAIL: " + "; ".join(f"{k}: {v}" for k, v in sorted(bad.items()))


def _failures(model, strict: bool = False) -> dict:
    """Check name -> failure for :data:`CHECKS` on ``model``. ``strict``: for the unpatched model, whose failures
    say which checks are not made -- a check it passes only within the patched model's tolerance (Falcon-H1's packed
    rows: its state-space mixer carries state from one sequence into the next, 1e-4 apart) cannot tell a patch's
    error from the model's own, so it must hold to float rounding (:data:`STRICT`)."""
    out = {}
    tol = STRICT if strict else TOLERANCE
    vocab = int(model.config.get_text_config().vocab_size)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(3, min(vocab, 200), (2, 9), generator=gen)
    model.train()
    try:  # text tokens marked as text where the forward takes their kinds (Molmo 2's requires them in training)
        kinds = {"mm_token_type_ids": torch.zeros_like(ids)} if "mm_token_type_ids" in _parameters(model) else {}
        loss = model(input_ids=ids, labels=ids, use_cache=False, **kinds, **_text_types(model, ids)).loss
        loss.backward()
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        if not torch.isfinite(loss) or not grads or not all(torch.isfinite(g).all() for g in grads):
            out["train"] = "forward/backward not finite"
    except Exception as exc:
        out["train"] = f"{type(exc).__name__}: {_line(exc)}"
    model.eval()

    def last(**kwargs):
        return model(use_cache=False, **kwargs, **_text_types(model, kwargs["input_ids"])).logits[:, -1]

    with torch.no_grad():
        full = last(input_ids=ids)
        for kind in ("dynamic", "static"):
            try:
                cache = _cache(model, kind, ids.shape)
                if cache is False:
                    continue
                kwargs = {} if cache is None else cache_kwargs(model, cache)
                first = model(input_ids=ids[:, :-1], use_cache=True, **kwargs, **_text_types(model, ids[:, :-1]))
                given = {**cache_kwargs(model, output_cache(first)), **_text_types(model, ids[:, -1:])}
                step = model(input_ids=ids[:, -1:], use_cache=True, **given)
                _close(out, f"{kind}-cache", step.logits[:, -1], full, tol)
            except Exception as exc:
                out[f"{kind}-cache"] = f"{type(exc).__name__}: {_line(exc)}"
        try:
            mask = torch.ones_like(ids)
            mask[0, :3] = 0
            padded = last(input_ids=ids, attention_mask=mask)[0]
            _close(out, "padding", padded, last(input_ids=ids[:1, 3:])[0], tol)
        except Exception as exc:
            out["padding"] = f"{type(exc).__name__}: {_line(exc)}"
        try:
            packed = torch.cat([ids[0, :4], ids[1, :5]])[None]
            positions = torch.cat([torch.arange(4), torch.arange(5)])[None]
            got, want = last(input_ids=packed, position_ids=positions)[0], last(input_ids=ids[1:, :5])[0]
            _close(out, "packing", got, want, tol)
        except Exception as exc:
            out["packing"] = f"{type(exc).__name__}: {_line(exc)}"
    return out


TOLERANCE = (1e-3, 1e-4)  # (rtol, atol) of a check on a patched model
STRICT = (1e-5, 1e-5)  # of the same check on the unpatched model: float32 rounding, two orders under TOLERANCE


def _text_types(model, ids) -> dict:
    """A prefix-LM's ``token_type_ids`` (PaliGemma's: ``use_bidirectional_attention`` and a forward that takes them)
    marking every token of ``ids`` as text to predict (type 1), so that it attends causally; ``{}`` for any other
    model. Without them such a model attends both ways on an unpadded batch and causally on a padded one, which the
    unpatched model fails the padding, packing and cache checks by (the prefix itself is what verify checks)."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    if getattr(config, "use_bidirectional_attention", None) is True and "token_type_ids" in _parameters(model):
        return {"token_type_ids": torch.ones_like(ids)}
    return {}


def _parameters(model) -> set:
    import inspect

    return set(inspect.signature(model.forward).parameters)


def _close(out: dict, name: str, got, want, tol=TOLERANCE) -> None:
    if not torch.allclose(got, want, rtol=tol[0], atol=tol[1]):
        out[name] = f"differs by {float((got - want).abs().max()):.2e}"


def _cache(model, kind: str, shape):
    if kind == "dynamic":
        return None
    try:
        from transformers import StaticCache

        return StaticCache(config=model.config, max_cache_len=shape[1] + 2)
    except Exception:
        return False  # a model whose cache is its own (recorded as not exercised)


def _summarise(model_type: str, results: dict) -> TypeResult:
    fails = {k: v for k, v in results.items() if v.startswith("FAIL")}
    refused = {k: v for k, v in results.items() if v.startswith("refused")}
    if fails:
        key = sorted(fails)[0]
        return TypeResult(model_type, FAIL, f"{key}: {fails[key][6:]}", results)
    if not refused:
        return TypeResult(model_type, PATCHED, "", results)
    only_qkv = all(k.startswith("qkv_norm") for k in refused)
    first = refused[sorted(refused)[0]][len("refused: ") :]
    if only_qkv:
        return TypeResult(model_type, PATCHED, f"qkv_norm refused: {first}", results)
    return TypeResult(model_type, REFUSED, first, results)


def _line(exc) -> str:
    """``exc``'s first line (with the next where the first ends in a colon: "... install it with pip:")."""
    text = [t.strip() for t in str(exc).strip().splitlines() if t.strip()]
    if not text:
        return type(exc).__name__
    line = f"{text[0]} {text[1]}" if text[0].endswith(":") and len(text) > 1 else text[0]
    return line[:300]


def causal_model_types() -> list[str]:
    """Every model type with a causal-LM class in the installed Transformers, and every multimodal one with an
    image-text-to-text class (whose language model ``patch_model`` patches)."""
    from transformers.models.auto import modeling_auto

    image_text = getattr(modeling_auto, "MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES", {})
    return sorted({*modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, *image_text})


CHUNK = 8  # model types checked before ``chunk_hook`` runs (the conversion column reloads a chunk's folders at once)


def coverage(types=None, progress=None, chunk_hook=None) -> list[TypeResult]:
    """:func:`check_model_type` over ``types`` (default: every causal-LM model type), quietly. ``chunk_hook(results)``
    is called on every :data:`CHUNK` results before they are reported (the command line fills in the conversion
    column: :func:`hf_qknorm.conversion.orchestration.coverage.add_conversions`); ``progress(result)`` is called for
    each type after that."""
    results = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        previous = logging.root.manager.disable
        logging.disable(logging.WARNING)
        try:
            todo = list(types or causal_model_types())
            for start in range(0, len(todo), CHUNK):
                chunk = [_checked(model_type) for model_type in todo[start : start + CHUNK]]
                if chunk_hook is not None:
                    chunk_hook(chunk)
                for result in chunk:
                    results.append(result)
                    if progress is not None:
                        progress(result)
        finally:
            logging.disable(previous)
    return results


def _checked(model_type: str) -> TypeResult:
    try:
        return check_model_type(model_type)
    except Exception as exc:  # a model type whose tiny model breaks in a way not foreseen
        return TypeResult(model_type, FAIL, f"the check crashed: {type(exc).__name__}: {_line(exc)}")


def counts(results) -> dict[str, int]:
    out = {PATCHED: 0, REFUSED: 0, FAIL: 0, UNTESTED: 0, OUT_OF_SCOPE: 0}
    for r in results:
        out[r.status] += 1
    return out


def conversion_counts(results) -> dict[str, int]:
    out = {CONVERTED: 0, REFUSED: 0, FAIL: 0, UNTESTED: 0}
    for r in results:
        if r.conversion:
            out[r.conversion] += 1
    return out


def failing(results) -> int:
    """Model types failing a check: patching, or the conversion of a patched type."""
    return counts(results)[FAIL] + conversion_counts(results)[FAIL]


def summary(results) -> str:
    c = counts(results)
    scope = c[PATCHED] + c[REFUSED] + c[FAIL] + c[UNTESTED]
    text = (
        f"{c[PATCHED]} of {scope} decoder-only softmax-attention text model types patched exactly, {c[REFUSED]} "
        f"refused with the reason, {c[UNTESTED]} untested (no working tiny model), {c[FAIL]} failing; "
        f"{c[OUT_OF_SCOPE]} other causal-LM types out of scope"
    )
    if any(r.conversion for r in results):
        v = conversion_counts(results)
        tried = sum(v.values())
        text += (
            f". Conversion: {v['converted']} of {tried} patched types converted and reloaded without the plugin, "
            f"{v[REFUSED]} refused with the reason, {v[UNTESTED]} untested, {v[FAIL]} failing"
        )
    return text


def markdown(results, versions: str) -> str:
    lines = [
        f"# Model coverage on {versions}",
        "",
        "Generated by `hf-qknorm coverage --markdown` (hf_qknorm/verification/coverage.py): every model type with a "
        "causal-LM class, a tiny model of it patched with every scheme x norm (13 variants), each accepted variant "
        "run forward and backward and decoded with dynamic and static caches against the full forward. Conversion "
        "(hf_qknorm/conversion/orchestration/coverage.py): a tiny checkpoint of each patched type converted by "
        f"`hf_qknorm.convert` with {_conversion_variants(results)}, each written folder's logits checked against the "
        "converted model in memory (and the float64 reference of `verify`, for every type it does not refuse) and "
        "against the folder reloaded without the plugin (remote code, or plain Transformers for a plain export).",
        "",
        f"**{summary(results)}.**",
        "",
        "| model type | status | reason / note | conversion | conversion note |",
        "|---|---|---|---|---|",
    ]
    for r in results:
        reason, note = (text.replace("|", "\\|") for text in (r.reason, r.conversion_note))
        lines.append(f"| `{r.model_type}` | {r.status} | {reason} | {r.conversion or '-'} | {note} |")
    return "\n".join(lines) + "\n"


def _conversion_variants(results) -> str:
    n = max((len(r.conversion_variants) for r in results), default=0)
    if n == len(variants()):
        return f"every scheme x norm ({n} variants)"
    return "six variants (qk_norm_cap, qk_norm and qkv_norm with layernorm, qk_norm with rmsnorm and lp, soft_cap)"


def to_json(results) -> str:
    return json.dumps([asdict(r) for r in results], indent=1) + "\n"
