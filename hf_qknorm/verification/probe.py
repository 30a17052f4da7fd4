"""The probes of the verifier: run a model as it is configured and record what every attention layer saw and returned.

A *plan* (a JSON-able dict, made by :mod:`.layers` from the reference side) names the modules to watch and the probe
tokens; :func:`run_probes` runs the model through

- ``unpadded``: one forward of an unpadded batch, no cache;
- ``padded``: one forward of a left-padded batch, no cache;
- ``cache-unpadded`` / ``cache-padded``: greedy ``generate`` with the cache on (Evolla's generation settings turn it
  off) and the model's own other generation settings -- so with its configured cache
  (``generation_config.cache_implementation``, e.g. ``"static"``; dynamic otherwise) --
  recording every step's layer inputs and outputs, so the whole sequence's layer input can be reassembled; plus the
  generated logits and those of an uncached forward over the same tokens;
- ``stress`` (layers with a cap): each attention module called again on the ``unpadded`` probe's own inputs, with
  its query scaled by a gain ``alpha`` chosen so that the largest logit bound is a few caps. A model's logits on
  probe text sit far below a cap of 50 (a normalised query and key bound them by ``sqrt(head_dim)`` times the norm
  gains), so without this a backend that drops the cap would look right. The gain is applied by a forward hook on
  the module that produces the final pre-RoPE query (the query norm when there is one, else the projection): the
  same as multiplying that module's gain (and bias) by ``alpha``, which the reference side does to its weights.
  A half-precision module runs this probe in float32 (its weights upcast, then restored bit for bit; same backend,
  same cap): in bfloat16 the rounding of q and k at logits of a few caps moves the output about as much as the cap
  does (measured: relative error 0.02-0.06 against a capped-vs-uncapped difference of 0.01-0.05), so no tolerance
  could tell a dropped cap from rounding.
- ``amplified`` / ``amplified-padded`` (half-precision models, layers whose output hardly differs from position to
  position -- biases dominating the values and the output, or hidden states alike at every token -- so that
  causality, padding and the norms move it by about as much as half precision rounds it): each attention module
  called again, in the model's dtype, on the ``unpadded`` / ``padded`` probe's inputs with every position's
  deviation from its row's mean multiplied by ``s``, doubled until the output spreads :data:`AMPLIFY_SPREAD` of its
  largest entry (logit bound at most :data:`AMPLIFY_LOGITS`: larger logits are rounded more coarsely).

A prefix-LM (PaliGemma: ``use_bidirectional_attention`` with ``token_type_ids``; the plan's ``prefix``) is probed as it
is used: every forward and generation gets ``token_type_ids`` marking each row's first ``prefix`` real tokens as the
prefix (type 0) and the rest as text to predict (type 1; generated tokens too), and each probe records that prefix.
Without them such a model attends both ways on an unpadded batch and causally on a padded one.

Nothing here computes a reference or judges a result: that is done from the formulas on the other side.

This module imports nothing but ``torch`` (and reaches Transformers only through the model): it is also loaded from
its file in a process where ``hf_qknorm`` cannot be imported (``hf-qknorm verify --no-plugin``).
"""

from __future__ import annotations

import math

import torch

# The key/value cache as an attention module receives it: Transformers 5.24's name, the older one, GPT-NeoX's. The
# same names as hf_qknorm.upstream.called_cache, which this module cannot import (tests/test_upstream.py keeps them
# equal).
CALL_CACHE_NAMES = ("cache", "past_key_values", "layer_past")

BATCH = 2
PROBE_LEN = 20  # longer than the tiny test models' sliding window (12)
PAD = 5  # left padding of row 0 in the padded probes
PROMPT_LEN = 8
PREFIX = 6  # a prefix-LM's probes: each row's first 6 real tokens are its prefix (type 0), the rest type 1
NEW_TOKENS = 6
STRESS_TARGET = 3.0  # bound on the largest stressed logit, in caps: c*tanh(3) is 0.995 c, far from 3 c
AMPLIFY_SPREAD = 0.25  # wanted spread of a layer's output over positions, as a fraction of its largest entry
AMPLIFY_MAX = 1024  # the largest factor on the input's deviations from its mean
AMPLIFIED = {"unpadded": "amplified", "padded": "amplified-padded"}  # probe -> its amplified probe
AMPLIFY_LOGITS = 10.0  # the logit bound an amplification may reach (or 1.25 times the layer's own, when larger)


def special_ids(config, text_config=None, generation_config=None) -> set[int]:
    """The ids the probes never hold: those a multimodal ``config`` reserves for its images and videos
    (``image_token_id``, ``boi_token_index``, ...: every integer ``*_token_id``/``*_token_index`` but the text ones),
    or the model looks for the images they stand for; and the padding id of any of the configs given, from which
    some models count positions (Kosmos-2.5: a padding token takes no position)."""
    text = {"pad_token_id", "bos_token_id", "eos_token_id", "sep_token_id", "cls_token_id", "unk_token_id"}
    found = set()
    for name, value in config.to_dict().items():
        if (name.endswith("_token_id") or name.endswith("_token_index")) and name not in text:
            found.update(v for v in (value if isinstance(value, list) else [value]) if isinstance(v, int))
    for c in (config, text_config, generation_config):
        pad = getattr(c, "pad_token_id", None)
        found.update(v for v in (pad if isinstance(pad, list) else [pad]) if isinstance(v, int))
    return found


def probe_tokens(vocab_size: int, seed: int = 0, avoid: set[int] = frozenset()) -> dict:
    """The probe batches as lists: ``ids`` ``(BATCH, PROBE_LEN)`` and ``prompt`` ``(BATCH, PROMPT_LEN)``, none of
    them one of ``avoid`` (a multimodal model's image and video tokens: :func:`special_ids`)."""
    gen = torch.Generator().manual_seed(seed)
    # below 32000: the top ids of large vocabularies are often added tokens whose embeddings were never trained
    high = max(2, min(int(vocab_size), 32000))
    allowed = torch.tensor([i for i in range(1, high) if i not in avoid] or [1])

    def draw(shape):
        return allowed[torch.randint(0, len(allowed), shape, generator=gen)].tolist()

    return {
        "ids": draw((BATCH, PROBE_LEN)),
        "prompt": draw((BATCH, PROMPT_LEN)),
        "pad": PAD,
        "new_tokens": NEW_TOKENS,
    }


def left_padding(batch: int, length: int, pad: int) -> torch.Tensor:
    """``(batch, length)`` 0/1 mask: row 0 starts with ``pad`` padding positions, the other rows have none."""
    mask = torch.ones(batch, length, dtype=torch.long)
    mask[0, :pad] = 0
    return mask


def prefix_types(mask: torch.Tensor, prefix: int | None) -> dict:
    """The extra forward arguments of a prefix-LM probe (``prefix`` set): ``token_type_ids`` 0 on each row's padding
    and first ``prefix`` real tokens (the prefix), 1 after them; ``{}`` otherwise."""
    if prefix is None:
        return {}
    return {"token_type_ids": (mask.long().cumsum(-1) > prefix).long()}


def _prefix_of(mask: torch.Tensor, extra: dict) -> dict:
    """The prefix a probe recorded (``prefix``, ``(batch, seq)`` bool: real tokens of type 0), or ``{}``."""
    types = extra.get("token_type_ids")
    return {} if types is None else {"prefix": _cpu((types == 0) & mask.bool())}


def _cpu(t):
    return None if t is None else t.detach().to("cpu")


def _hidden(args, kwargs):
    return args[0] if args else kwargs["hidden_states"]


def _first(output):
    return output[0] if isinstance(output, (tuple, list)) else output


class _Recorder:
    """Forward hooks on the watched attention modules (and their blocks); one list of calls per layer."""

    def __init__(self, modules: dict, plan: dict):
        self.attns = [_module(modules, layer["attn"]) for layer in plan["layers"]]
        self.blocks = [modules.get(layer["block"]) if layer.get("block") else None for layer in plan["layers"]]
        self.q_scales = [layer.get("q_scale") or [] for layer in plan["layers"]]
        self.unset = [layer.get("unset") or [] for layer in plan["layers"]]  # arguments every call must get as None
        self.calls: list[list[dict]] = []
        self.block_inputs: list[list[torch.Tensor]] = []
        self.loops: list[int] | None = None  # calls per layer in one forward (Dory's recurrent layers: its loops)
        self.keep_call = False
        self._handles = []

    def start(self, keep_call: bool = False):
        self.calls = [[] for _ in self.attns]
        self.block_inputs = [[] for _ in self.attns]
        self.keep_call = keep_call
        for i, attn in enumerate(self.attns):
            self._handles.append(attn.register_forward_hook(self._attn_hook(i), with_kwargs=True))
            if self.blocks[i] is not None:
                self._handles.append(self.blocks[i].register_forward_hook(self._block_hook(i), with_kwargs=True))
        return self

    def stop(self):
        for h in self._handles:
            h.remove()
        self._handles = []

    def _attn_hook(self, i):
        def hook(module, args, kwargs, output):
            rope = kwargs.get("position_embeddings")
            cache = next((kwargs[n] for n in CALL_CACHE_NAMES if kwargs.get(n) is not None), None)
            call = {
                "x": _cpu(_hidden(args, kwargs)),
                "out": _cpu(_first(output)),
                "cos": _cpu(rope[0]) if rope is not None else None,
                "sin": _cpu(rope[1]) if rope is not None else None,
                "cache": None if cache is None else type(cache).__name__,
                "q_scale": _cpu(_product(kwargs.get(n) for n in self.q_scales[i])),
                "given": [n for n in self.unset[i] if kwargs.get(n) is not None],
            }
            if self.keep_call:
                call["call"] = (args, dict(kwargs))
            self.calls[i].append(call)

        return hook

    def _block_hook(self, i):
        def hook(module, args, kwargs, output):
            self.block_inputs[i].append(_cpu(_hidden(args, kwargs)))

        return hook

    def layers(self) -> list[dict]:
        """Per layer: the calls' inputs and outputs joined along the sequence (a cached run's steps in order). A
        layer called ``n`` times in one forward (:attr:`loops`: Dory's recurrent layers, run in ``n`` loops) is
        joined loop by loop -- a forward's calls come in loop order -- its first loop as the record, the others
        under ``loops``."""
        out = []
        for i, calls in enumerate(self.calls):
            n = self.loops[i] if self.loops else 1
            if n > 1 and len(calls) % n == 0:
                out.append({**_join(calls[0::n]), "loops": [_join(calls[k::n]) for k in range(1, n)]})
            else:
                out.append(_join(calls))
        return out


def _product(factors):
    """The product of the tensors among ``factors`` (the arguments that scale a layer's query), or ``None``."""
    out = None
    for f in factors:
        if isinstance(f, torch.Tensor):
            out = f if out is None else out * f
    return out


def _join(calls: list[dict]) -> dict:
    """One layer's calls joined along the sequence: ``x``/``out`` ``(batch, seq, hidden)``, ``cos``/``sin``,
    ``q_scale`` (the query's factor by position, ``(batch, 1 or heads, seq, 1)``) and ``given``: the arguments that
    every call must get as ``None`` (the plan's ``unset``) some call was given."""
    if not calls:
        raise RuntimeError("an attention module was never called")
    join = {
        k: (torch.cat([c[k] for c in calls], dim=1) if calls[0][k] is not None else None)
        for k in ("x", "out", "cos", "sin")
    }
    scales = [c.get("q_scale") for c in calls]
    join["q_scale"] = torch.cat(scales, dim=-2) if all(t is not None for t in scales) else None
    join["steps"] = len(calls)
    join["cache"] = calls[-1]["cache"]
    join["given"] = sorted({n for c in calls for n in c.get("given", ())})
    return join


def _module(modules: dict, name: str):
    if name not in modules:
        raise KeyError(f"the model has no module {name!r}: its structure differs from the reference model")
    return modules[name]


def _part(output, spans):
    """The channels of ``spans`` (``[start, stop)`` ranges of the last dim: one role of a fused q/k/v projection)
    joined, or the whole output when ``spans`` is ``None``."""
    out = _first(output)
    if spans is None:
        return out
    return torch.cat([out[..., a:b] for a, b in spans], dim=-1)


def _norm_hook(store: list, spans, head_dim: int):
    """Record the largest per-head vector norm of a query (or key) producing module's output."""

    def hook(module, args, output):
        t = _part(output, spans).detach().float()
        store.append(float(t.reshape(-1, head_dim).norm(dim=-1).max()))

    return hook


def _watch_q_k(modules: dict, layer: dict, store: dict) -> list:
    """Hooks recording the largest query and key norms of one layer into ``store["q"]``/``store["k"]``."""
    return [
        _module(modules, layer[r][0]).register_forward_hook(_norm_hook(store[r], layer[r][1], layer["head_dim"]))
        for r in ("q", "k")
    ]


def _gain_hook(alpha: float, spans):
    """Multiply the query channels (``spans``, or the whole output) by ``alpha`` (a new tensor: the module's own
    output is not changed)."""

    def hook(module, args, output):
        out = _first(output)
        if spans is None:
            scaled = out * alpha
        else:
            gain = torch.ones(out.shape[-1], dtype=out.dtype, device=out.device)
            for a, b in spans:
                gain[a:b] = alpha
            scaled = out * gain
        return (scaled, *output[1:]) if isinstance(output, tuple) else scaled

    return hook


_HALF = (torch.float16, torch.bfloat16)


def _upcast_module(module) -> list:
    """Give every half-precision parameter and buffer of ``module`` float32 data; returns what to restore."""
    saved = []
    for m in module.modules():
        for store in (m._parameters, m._buffers):
            for t in store.values():
                if t is not None and t.dtype in _HALF:
                    saved.append((t, t.data))
                    t.data = t.data.float()
    return saved


def _restore(saved: list) -> None:
    for t, data in saved:
        t.data = data


def _upcast(obj):
    """``obj`` (tensors, tuples, lists, dicts of them) with half-precision tensors as float32."""
    if isinstance(obj, torch.Tensor):
        return obj.float() if obj.dtype in _HALF else obj
    if isinstance(obj, (tuple, list)):
        return type(obj)(_upcast(o) for o in obj)
    if isinstance(obj, dict):
        return {k: _upcast(v) for k, v in obj.items()}
    return obj


def _error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}".strip().splitlines()[0][:500]


def run_probes(model, plan: dict) -> dict:
    """Run every probe of ``plan`` through ``model`` (as configured: its backend, its generation settings).

    Returns a dict of CPU tensors in the model's dtype: ``meta``; ``probes[name]`` with ``mask`` ``(batch, seq)``
    (1 = token, 0 = padding) and ``layers`` (per layer ``x``/``out`` ``(batch, seq, hidden)``, ``cos``/``sin``
    ``(batch, seq, rope_dim)`` or ``None``) or ``error``; ``stress[i]`` likewise (``alpha`` added);
    ``amplified[name][i]`` likewise (``scale`` added; only the layers that needed it);
    ``prenorm[i]`` (``block`` and ``attn`` inputs of the unpadded probe); ``logits[name]`` (``cached`` and
    ``uncached``, ``(batch, new_tokens, vocab)``)."""
    modules = dict(model.named_modules())
    recorder = _Recorder(modules, plan)
    device = next(p.device for p in model.parameters())
    ids = torch.tensor(plan["ids"], device=device)
    prompt = torch.tensor(plan["prompt"], device=device)
    pad, new = plan["pad"], plan["new_tokens"]
    result = {
        "meta": _meta(model),
        "probes": {},
        "stress": {},
        "amplified": {},
        "prenorm": {},
        "logits": {},
        "_calls": {},
    }
    was_training = model.training
    model.eval()
    runner = modules[plan["text_forward"]] if plan.get("text_forward") else model  # where text alone runs
    try:
        with torch.no_grad():
            norms = _forward_probes(runner, plan, recorder, modules, ids, pad, result)
            if plan.get("generate", True):
                for name, mask in (
                    ("cache-unpadded", torch.ones_like(prompt)),
                    ("cache-padded", left_padding(*prompt.shape, pad).to(device)),
                ):
                    _cache_probe(runner, plan, recorder, name, prompt, mask, new, result, model, modules)
            if next(model.parameters()).dtype in _HALF:
                _amplify(plan, recorder, modules, norms, result)
            _stress(plan, recorder, modules, norms, result)
    finally:
        result.pop("_calls", None)
        recorder.stop()
        model.train(was_training)
    return result


def _meta(model) -> dict:
    config = model.config
    gen = getattr(model, "generation_config", None)
    param = next(model.parameters())
    return {
        "class": type(model).__name__,
        "module": type(model).__module__,
        "backend": getattr(config, "_attn_implementation", None),
        "dtype": str(param.dtype).replace("torch.", ""),
        "device": str(param.device),
        "cache_implementation": getattr(gen, "cache_implementation", None),
    }


def _forward_probes(model, plan, recorder, modules, ids, pad, result) -> dict:
    """The two uncached forwards; returns the largest query and key norms per layer (for the stress gain)."""
    norms = {}
    for name, mask in (("unpadded", torch.ones_like(ids)), ("padded", left_padding(*ids.shape, pad).to(ids.device))):
        hooks = []
        for i, layer in enumerate(plan["layers"] if name == "unpadded" else ()):
            norms[i] = {"q": [], "k": []}
            hooks += _watch_q_k(modules, layer, norms[i])
        recorder.start(keep_call=True)
        try:
            extra = prefix_types(mask, plan.get("prefix"))
            model(input_ids=ids, attention_mask=mask, use_cache=False, **extra)
            if name == "unpadded":  # one forward: how many times each layer is called in one
                recorder.loops = [max(1, len(calls)) for calls in recorder.calls]
            result["probes"][name] = {"mask": _cpu(mask), "layers": recorder.layers(), **_prefix_of(mask, extra)}
            result["_calls"][name] = ([c[0]["call"] for c in recorder.calls], mask)
            if name == "unpadded":
                result["prenorm"] = {
                    i: {"block": b[0], "attn": c[0]["x"]}
                    for i, (b, c) in enumerate(zip(recorder.block_inputs, recorder.calls))
                    if b
                }
        except Exception as exc:  # a model that cannot run the probe fails verification; say why
            result["probes"][name] = {"error": _error(exc)}
        finally:
            recorder.stop()
            for h in hooks:
                h.remove()
    return norms


def _cache_probe(model, plan, recorder, name, prompt, mask, new, result, outer=None, modules=None):
    """Greedy generation with the model's configured cache; then the same tokens through an uncached forward.
    ``outer``: the model whose generation settings hold where ``model`` is its language model (BLIP-2's OPT runs
    the text; the cache a user configured is the whole model's). The positions generate hands the model are read
    on the plan's ``positions`` module (``modules``: the model's, by name): the model itself under a wrapper
    (``peft``'s, whose generate calls it, not the wrapper's forward), else ``model``."""
    gen = getattr(outer if outer is not None else model, "generation_config", None)
    kind = getattr(gen, "cache_implementation", None) if outer is not model else None
    settings = {"cache_implementation": kind} if kind is not None else {}
    pad_id = plan.get("pad_token_id")
    if pad_id is None:
        pad_id = getattr(gen, "pad_token_id", None)
        pad_id = getattr(gen, "eos_token_id", None) if pad_id is None else pad_id
        pad_id = (pad_id[0] if isinstance(pad_id, (list, tuple)) else pad_id) or 0
    given = []  # the position ids generate handed the model at each step (Kosmos-2.5 gets none: it counts its own)
    called = (modules or {}).get(plan.get("positions"), model)  # a wrapper's generate calls the model inside it
    watch = called.register_forward_pre_hook(
        lambda m, args, kwargs: given.append(kwargs.get("position_ids")), with_kwargs=True
    )
    extra = prefix_types(mask, plan.get("prefix"))  # a prefix-LM's: the generated tokens are type 1
    recorder.start()
    try:
        out = model.generate(
            input_ids=prompt,
            attention_mask=mask,
            **extra,
            max_new_tokens=new,
            min_new_tokens=new,
            do_sample=False,
            use_cache=True,  # a cached probe: whatever the model's generation settings say (Evolla's: no cache)
            output_logits=True,
            return_dict_in_generate=True,
            pad_token_id=pad_id,
            **settings,
        )
        layers = recorder.layers()
    except Exception as exc:
        result["probes"][name] = {"error": _error(exc)}
        return
    finally:
        recorder.stop()
        watch.remove()
    seq = out.sequences
    steps = seq.shape[1] - prompt.shape[1]
    full = torch.cat([mask, torch.ones(mask.shape[0], steps, dtype=mask.dtype, device=mask.device)], dim=1)
    fed = seq.shape[1] - 1  # the last generated token is never fed back
    extra = {k: torch.cat([v, torch.ones_like(full[:, v.shape[1] :])], dim=1)[:, :fed] for k, v in extra.items()}
    result["probes"][name] = {
        "mask": _cpu(full[:, :fed]),
        "layers": layers,
        "tokens": _cpu(seq),
        **_prefix_of(full[:, :fed], extra),
    }
    try:
        placed = {**_placed(given, full[:, :fed]), **extra}
        logits = model(input_ids=seq[:, :fed], attention_mask=full[:, :fed], use_cache=False, **placed).logits
        result["logits"][name] = {
            "cached": _cpu(torch.stack(list(out.logits), dim=1)),
            "uncached": _cpu(logits[:, prompt.shape[1] - 1 :]),
        }
    except Exception as exc:
        result["logits"][name] = {"error": _error(exc)}


def _placed(given: list, mask: torch.Tensor) -> dict:
    """The ``position_ids`` argument of the uncached forward over the ``mask.shape[1]`` tokens generation fed: none
    where generate gave the model none (it placed the tokens itself, as it will again), the very positions it gave
    step by step where they cover those tokens, else those of a left-padded row (count of real tokens so far, minus
    one)."""
    if all(p is None for p in given):
        return {}
    if all(torch.is_tensor(p) for p in given):
        joined = torch.cat(given, dim=-1)
        if joined.shape[-1] == mask.shape[1]:
            return {"position_ids": joined}
    return {"position_ids": (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 0)}


def _stress(plan, recorder, modules, norms, result):
    """Call each capped attention module again on the unpadded probe's inputs -- amplified when the layer needed it
    (:func:`_amplify`) -- with its query scaled by ``alpha``."""
    calls, mask = result["_calls"].get("unpadded", (None, None))
    amplified = result["amplified"].get("amplified", {}).get("layers", {})
    for i, layer in enumerate(plan["layers"]):
        cap = layer.get("cap")
        if cap is None:
            continue
        if calls is None:
            result["stress"][i] = {"error": "the unpadded probe did not run"}
            continue
        amp = amplified.get(i, {})
        scale = amp.get("scale", 1.0)
        q, k = (
            (amp["q"], amp["k"])
            if "scale" in amp
            else (max(norms[i]["q"], default=0.0), max(norms[i]["k"], default=0.0))
        )
        bound = layer["scaling"] * q * k
        alpha = STRESS_TARGET * cap / bound if bound > 0 and math.isfinite(bound) else 1.0
        mod, spans = layer["q"]
        handle = _module(modules, mod).register_forward_hook(_gain_hook(alpha, spans))
        attn = recorder.attns[i]
        saved = _upcast_module(attn)
        recorder.start()
        try:
            args, kwargs = _amplified(calls[i], mask, scale)
            attn(*_upcast(args), **_upcast(kwargs))
            result["stress"][i] = {"alpha": alpha, "upcast": bool(saved), "scale": scale, **_join(recorder.calls[i])}
        except Exception as exc:
            result["stress"][i] = {"error": _error(exc)}
        finally:
            recorder.stop()
            handle.remove()
            _restore(saved)


def _deviation(t: torch.Tensor, mask: torch.Tensor):
    """``t`` ``(batch, seq, hidden)`` in float32 minus its mean over each row's real positions (``mask`` 1), that
    mean, and the real positions as a float ``(batch, seq, 1)``."""
    real = mask.to(device=t.device, dtype=torch.float32)[..., None]
    mean = (t.float() * real).sum(1, keepdim=True) / real.sum(1, keepdim=True).clamp_min(1)
    return t.float() - mean, mean, real


def _spread(out: torch.Tensor, mask: torch.Tensor) -> float:
    """``max|out - row mean| / max|out|`` over the real positions of ``out``."""
    dev, _, real = _deviation(out, mask)
    top = float((out.float() * real).abs().max())
    return float((dev * real).abs().max()) / top if top > 0 else 0.0


def _amplified(call, mask, scale: float):
    """The recorded ``(args, kwargs)`` of a call with every position's input deviation from its row's mean over the
    real positions multiplied by ``scale`` (the call itself when ``scale`` is 1)."""
    args, kwargs = call
    if scale == 1.0:
        return args, kwargs
    x = _hidden(args, kwargs)
    dev, mean, _ = _deviation(x, mask)
    x = (mean + scale * dev).to(x.dtype)
    return ((x, *args[1:]), kwargs) if args else (args, {**kwargs, "hidden_states": x})


def _amplify_layer(attn, call, mask, layer, modules, recorder, i, limit):
    """Double the amplification until the output spreads :data:`AMPLIFY_SPREAD` (or the logit bound would pass
    ``limit``, or the output is not finite); the last acceptable call's record, or ``None``."""
    best, scale = None, 1.0
    while scale < AMPLIFY_MAX:
        scale *= 2
        norms = {"q": [], "k": []}
        handles = _watch_q_k(modules, layer, norms)
        args, kwargs = _amplified(call, mask, scale)
        recorder.start()
        try:
            attn(*args, **kwargs)
        finally:
            recorder.stop()
            for h in handles:
                h.remove()
        rec, q, k = _join(recorder.calls[i]), max(norms["q"], default=0.0), max(norms["k"], default=0.0)
        if layer["scaling"] * q * k > limit or not bool(torch.isfinite(rec["out"]).all()):
            break
        best = {"scale": scale, "q": q, "k": k, **rec}
        if _spread(rec["out"], mask) >= AMPLIFY_SPREAD:
            break
    return best


def _amplify(plan, recorder, modules, norms, result):
    """The amplified probes (half-precision models): each layer whose output on the ``unpadded`` / ``padded``
    probe spreads less than :data:`AMPLIFY_SPREAD` over positions is called again on amplified inputs."""
    for name, (calls, mask) in result["_calls"].items():
        kept = {}
        for i, layer in enumerate(plan["layers"]):
            if _spread(result["probes"][name]["layers"][i]["out"], mask) >= AMPLIFY_SPREAD:
                continue
            own = layer["scaling"] * max(norms[i]["q"], default=0.0) * max(norms[i]["k"], default=0.0)
            try:  # 1.25: the bound of a normed layer is the same at any amplification, up to rounding
                rec = _amplify_layer(
                    recorder.attns[i], calls[i], mask, layer, modules, recorder, i, max(AMPLIFY_LOGITS, 1.25 * own)
                )
            except Exception as exc:  # the module ran on the probe; failing on an amplified input is a finding
                rec = {"error": _error(exc)}
            if rec is not None:
                kept[i] = rec
        prefix = {k: v for k, v in result["probes"][name].items() if k == "prefix"}
        result["amplified"][AMPLIFIED[name]] = {"mask": _cpu(mask), "layers": kept, **prefix}
