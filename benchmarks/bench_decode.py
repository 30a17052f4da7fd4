"""Decoding and training-step speed of patched models against the unpatched model on sdpa, side by side in one run.

Decode table: greedy generation of 128 new tokens, batch 1 and 8, prompts of 32 and 512 tokens, with the dynamic
(default), static and sliding-window caches, for every scheme against the unpatched model on ``sdpa``, on three
shapes: ``tiny`` (4 layers, hidden 64: host-bound, the per-call overhead dominates, as on a GPU), ``bundled`` (the
tiny Llama shipped in hf_qknorm/assets, hidden 128) and ``12x768`` (12 layers, hidden 768, 12 heads: compute-bound).
The sliding-window column runs the same shapes as Mistral (Llama with a window) with a 128-token window and its
default cache, whose layers keep the last 128 keys.

What is timed is decoding: a logits processor stamps every step, and the time from the first generated token to the
last (127 forward passes) gives tokens per second; the prefill is excluded. Providers run interleaved, one
generation of each per round, their order rotated by one place per round (each runs at each place equally often),
and each ratio is the median over rounds of the provider's tokens/s over the
unpatched model's in the same round. Two clocks: the process's CPU time (one thread: the steadier figure on a shared
machine) and wall time.

``--compile``: the same with ``generate``'s own compiled decoding (Transformers compiles the decoding step's forward
with ``torch.compile`` when the cache is static; told to on a CPU too, ``fullgraph``), every provider compiled, the
graphs made before the timed rounds. Rows carry ``"compiled": true``. On the step table ``--compile`` compiles every
model in place (``module.compile``, forward and backward; ``--compile-backend``, inductor by default).

Step table: one training step (forward + backward + AdamW) at T = 512 and 2048, batch 1, of the bundled shape and
the 12x768 shape, interleaved the same way. Besides CPU time (user + system) each row has the ratios of user time
alone (``_user``) and the minor page faults per step (``_faults``): glibc's heap gives memory back to the system at
the end of a step and faults it in again in the next, which is system time, and the count depends on how much a
model allocates per step and in what order -- so the rows also record the allocator's environment (``MALLOC_*``,
``GLIBC_TUNABLES``, ``LD_PRELOAD``).

Rows go to ``benchmarks/results/decode.jsonl`` with the machine, versions and the command.

    python benchmarks/bench_decode.py                                  # everything (CPU: an hour or more)
    python benchmarks/bench_decode.py --shapes tiny --rounds 5         # the host-bound table only
    python benchmarks/bench_decode.py --table step --shapes 12x768 --seq 512
    python benchmarks/bench_decode.py --report after                   # the tables of saved rows labelled "after"
    python benchmarks/bench_decode.py --table decode --caches static --compile --shapes tiny   # compiled decoding
    python benchmarks/bench_decode.py --table step --compile --shapes 12x768 --seq 512        # compiled training step
    python benchmarks/bench_decode.py --table token --shapes tiny bundled --rounds 30

Token table (``--table token``): one decoding forward at a time against a dynamic cache of ``prompt`` tokens
cropped back after each, 20 forwards per round, many rounds, interleaved: the per-token cost without ``generate``
around it. Whole generations on a machine shared with other work vary by +-0.2 per cell; these short rounds by less.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import datetime as dt
import json
import os
import platform
import resource
import statistics
import sys
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).parent / "results" / "decode.jsonl"
ASSET = Path(__file__).resolve().parents[1] / "hf_qknorm" / "assets" / "tiny-llama"
SCHEMES = ("qk_norm", "soft_cap", "qk_norm_cap", "qkv_norm")
# ablations (``--schemes qk_norm_noop ...``), each patched with the scheme it names:
# - ``qk_norm_noop``: every norm the patch added replaced by a module that returns its input -- what the patch costs
#   besides the norms' own arithmetic (the projection's subclass, the per-head views, the module call);
# - ``<scheme>_floor``: the scheme's decoding cut to the least code a patch of this design could run (:func:`_floor`): a
#   normalised projection is ``F.linear``, a view, one ``layer_norm`` and a view back; one query's attention is its math
#   alone (sdpa and a view without a cap; with one the native op where the lean path takes it, else bmm, scale, tanh,
#   cap, softmax, bmm: the lean path's ops); no check, no routing, no cap-backend check. It computes the patched model's
#   logits to the bit (checked before it is timed) and holds only for what the token table runs (CPU, eager, no
#   gradient, one query, no mask, layernorm): between it and the unpatched model is the cost of the ops the scheme adds,
#   not of the code around them;
# - ``<scheme>_aten``: the scheme with the native op (hf_qknorm/attention/native.py) turned off while its model runs
#   (forward and, decided there, backward): the ATen ops beside the native ones, in the same process and rounds.
ABLATIONS = {
    "qk_norm_noop": "qk_norm",
    **{f"{scheme}_floor": scheme for scheme in SCHEMES},
    **{f"{scheme}_aten": scheme for scheme in SCHEMES},
}


class _NoOp(torch.nn.Module):
    def forward(self, x):
        return x


SHAPES = {
    "tiny": dict(num_hidden_layers=4, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=128, vocab_size=2048),
    "bundled": None,  # hf_qknorm/assets/tiny-llama: its config and weights
    "12x768": dict(num_hidden_layers=12, hidden_size=768, num_attention_heads=12, num_key_value_heads=12,
                   intermediate_size=3072, vocab_size=8192),
    # Llama-3.2-1B's layer (hidden 2048, 32 / 8 heads, head_dim 64, MLP 8192), 8 of them: the GPU shape
    "1b": dict(num_hidden_layers=8, hidden_size=2048, num_attention_heads=32, num_key_value_heads=8,
               intermediate_size=8192, vocab_size=32000),
}  # fmt: skip
WINDOW = 128
# where and in what dtype the models run (``--device``, ``--dtype``); on CUDA the ratios are wall-clock (the host waits
# for the GPU), the GPU synchronised before every clock reading
DEVICE, DTYPE = torch.device("cpu"), torch.float32


def _sync():
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()


def _clock_name() -> str:
    return "wall" if DEVICE.type == "cuda" else "cpu"


def _base(shape: str, sliding: bool):
    """The unpatched model of ``shape`` on sdpa (Mistral with a window for the sliding-window cache)."""
    from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    if SHAPES[shape] is None:
        fields = json.loads((ASSET / "config.json").read_text())
        fields = {k: v for k, v in fields.items() if k not in ("architectures", "model_type", "transformers_version")}
    else:
        fields = dict(SHAPES[shape], max_position_embeddings=1024, tie_word_embeddings=False)
    fields["max_position_embeddings"] = 1024
    config = MistralConfig(**fields, sliding_window=WINDOW) if sliding else LlamaConfig(**fields)
    with DEVICE:  # built where it runs: the 1b shape's random init takes seconds on a GPU, a minute on a CPU
        model = (MistralForCausalLM if sliding else LlamaForCausalLM)._from_config(config, attn_implementation="sdpa")
    if SHAPES[shape] is None:
        from safetensors.torch import load_file

        model.load_state_dict(load_file(ASSET / "model.safetensors"), strict=False)  # tied head: one key fewer
    return model.to(DEVICE, DTYPE).eval()


def _providers(shape: str, sliding: bool, schemes) -> dict:
    import hf_qknorm

    base = _base(shape, sliding)
    models = {"sdpa": base}
    for scheme in schemes:
        models[scheme] = hf_qknorm.patch_model(copy.deepcopy(base), ABLATIONS.get(scheme, scheme))
        if scheme.endswith("_floor"):
            _floor(models[scheme], reference=models.get(ABLATIONS[scheme]))
        elif scheme.endswith("_aten"):
            _without_native(models[scheme])
        elif scheme in ABLATIONS:
            for module in models[scheme].modules():
                for slot in module.__dict__.get("_qknorm_norms", {}).values():
                    setattr(module, slot, _NoOp())
    return models


def _without_native(model) -> None:
    """``model`` runs with the native op turned off: its forward (the tiled path's backward follows the forward's
    choice) sets the op's slot to None and restores it after."""
    from hf_qknorm.attention import native

    saved = []

    def off(module, args, kwargs):
        saved.append(native.NATIVE[0])
        native.NATIVE[0] = None

    def restore(module, args, kwargs, output):
        native.NATIVE[0] = saved.pop()

    model.register_forward_pre_hook(off, with_kwargs=True)
    model.register_forward_hook(restore, with_kwargs=True, always_call=True)


def _floor_projection(projection, norm, head_dim: int):
    """A normalised projection's forward with nothing around its arithmetic: ``F.linear``, then the rows and one
    ``layer_norm``."""
    weight, bias = projection._parameters["weight"], projection._parameters["bias"]
    gain, shift, eps = norm._parameters["weight"], norm._parameters["bias"], norm.eps
    linear, layer_norm = torch.nn.functional.linear, torch.layer_norm

    def forward(x):
        out = linear(x, weight, bias)
        return layer_norm(out.view(-1, head_dim), (head_dim,), gain, shift, eps).view_as(out)

    return forward


def _floor_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, softcap=None, **kwargs):
    """One query's attention as its math alone (the lean path's ops, in its order); any other call: the backend."""
    from hf_qknorm.attention import lean
    from hf_qknorm.attention.interface import qknorm_attention_forward
    from hf_qknorm.attention.lean import EXPM1_TANH_MIN, _constant
    from hf_qknorm.attention.tiles import tanh_doubled_

    batch, heads, q_len, head_dim = query.shape
    if attention_mask is not None or q_len != 1 or torch.is_grad_enabled():
        return qknorm_attention_forward(module, query, key, value, attention_mask, scaling, dropout, softcap, **kwargs)
    cap = module.__dict__["_qknorm_softcap"]
    if cap is None:
        out = torch.nn.functional.scaled_dot_product_attention(query, key, value, scale=scaling, enable_gqa=True)
        return out.view(batch, 1, heads, head_dim), None
    out = lean._native_capped(query, key, value, scaling, cap, None, None) if lean.NATIVE[0] is not None else None
    if out is not None:  # the native op: one call
        return out, None
    kv_heads, kv_len = key.shape[1], key.shape[2]
    n = batch * kv_heads
    s = torch.bmm(query.reshape(n, heads // kv_heads, head_dim), key.reshape(n, kv_len, head_dim).mT)
    if batch * heads * kv_len >= EXPM1_TANH_MIN:
        s = tanh_doubled_(s.mul_(_constant(2 * scaling / cap, s.dtype)), torch.empty_like(s))
    else:
        s = s.mul_(_constant(scaling / cap, s.dtype)).tanh_()
    p = torch.softmax(s.mul_(_constant(cap, s.dtype)), dim=-1)
    return torch.bmm(p, value.reshape(n, kv_len, head_dim)).view(batch, 1, heads, head_dim), None


def _floor(model, reference=None) -> None:
    """``model`` (patched, layernorm, float32, on the CPU) cut to the floor of :data:`ABLATIONS`; checked against
    ``reference`` (the model patched alike, or a copy made here) on a short decode: the same logits to the bit."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    reference = reference if reference is not None else copy.deepcopy(model)
    AttentionInterface.register("qknorm_floor", _floor_attention)
    AttentionMaskInterface.register("qknorm_floor", sdpa_mask)
    for attn in model.modules():
        state = attn.__dict__
        if "_qknorm_slots" not in state:
            continue
        for slot, (role,) in state["_qknorm_slots"].items():
            projection, norm = attn._modules[slot], attn._modules[state["_qknorm_norms"][role]]
            projection.forward = _floor_projection(projection, norm, state["_qknorm_shape"][0])
        attn.__class__ = state["_qknorm_base_class"]  # no cap-backend check
    model.config._attn_implementation = "qknorm_floor"
    ids = torch.randint(3, model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(3)).to(DEVICE)
    options = dict(max_new_tokens=4, do_sample=False, output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    with torch.no_grad():
        got, expected = (m.generate(ids, **options).logits for m in (model, reference))
    for step, (a, b) in enumerate(zip(got, expected)):
        if not torch.equal(a, b):
            raise AssertionError(f"the floor model's logits differ from the patched model's at decoding step {step}")


class _Clock:
    """A logits processor that stamps every generation step (CPU time, wall time)."""

    def __init__(self):
        self.stamps = []

    def __call__(self, input_ids, scores):
        _sync()
        self.stamps.append((time.process_time(), time.perf_counter()))
        return scores


_CLOCKS = {"cpu": 0, "wall": 1}


def _compile_config():
    """Transformers' own compiled decoding (``generate`` compiles the decoding step's forward with a static cache),
    on any device, whole (``fullgraph``: a graph break is an error, not a silent eager fallback). Without
    ``--compile`` the decode table is eager on every device (``disable_compile``)."""
    from transformers.generation.configuration_utils import CompileConfig

    # CUDA: Transformers' own default mode, CUDA graphs ("reduce-overhead"); a CPU has none
    config = CompileConfig(fullgraph=True, mode="reduce-overhead" if DEVICE.type == "cuda" else "default")
    config._compile_all_devices = True  # Transformers compiles only on accelerators unless told
    return config


def _decode(model, ids, cache: str, new_tokens: int, compiled: bool = False) -> tuple[float, float]:
    """Seconds (CPU, wall) for the decoding steps of one greedy generation: first generated token to last."""
    from transformers import LogitsProcessorList

    clock = _Clock()
    kwargs = {"cache_implementation": "static"} if cache == "static" else {}  # sliding: the window model's default
    if compiled:
        kwargs["compile_config"] = _compile_config()
    else:  # eager: on an accelerator generate would compile a static cache's decoding step by itself
        kwargs["disable_compile"] = True
    with torch.no_grad():
        model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=0,
            logits_processor=LogitsProcessorList([clock]),
            **kwargs,
        )
    (c0, w0), (c1, w1) = clock.stamps[0], clock.stamps[-1]
    return c1 - c0, w1 - w0


def _rotated(items: dict, round_index: int) -> list:
    """The providers' (name, value) pairs in round ``round_index``'s order: the order of ``items`` rotated by one
    place per round, so that each provider runs at each place in the round equally often: a provider run right after
    another pays for what that one left behind (freed memory, cold caches), and a fixed order would charge it to the
    same provider every round."""
    pairs = list(items.items())
    shift = round_index % len(pairs)
    return pairs[shift:] + pairs[:shift]


def decode_cell(shape, cache, batch, prompt, new_tokens, rounds, schemes, compiled=False) -> dict:
    models = _providers(shape, cache == "sliding_window", schemes)
    vocab = models["sdpa"].config.vocab_size
    ids = torch.randint(3, vocab, (batch, prompt), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    tokens = batch * (new_tokens - 1)
    if compiled:  # every provider's graphs made here, at the timed shapes; none left from another cell
        torch._dynamo.reset()
        torch._dynamo.config.recompile_limit = 64  # one code object, a graph per provider
    # warm-up (allocator, lazy inits; compiled: the graphs, twice to settle). At the timed shapes where it matters:
    # compiled graphs, and CUDA, whose first call at a shape picks kernels and workspaces (an H100 run warmed up on a
    # short prompt timed the unpatched model's first round at a fifth of its speed)
    full = compiled or DEVICE.type == "cuda"
    for model in models.values():
        for _ in range(2 if compiled else 1):
            _decode(model, ids if full else ids[:, : min(prompt, 16)], cache, new_tokens if full else 4, compiled)
    times = {name: [] for name in models}
    for r in range(rounds):
        for name, model in _rotated(models, r):
            times[name].append(_decode(model, ids, cache, new_tokens, compiled))
    row = {"table": "decode", "shape": shape, "cache": cache, "batch": batch, "prompt": prompt, "new": new_tokens}
    if compiled:
        row["compiled"] = True
    row["sdpa_tok_s"] = round(tokens / statistics.median(t[_CLOCKS[_clock_name()]] for t in times["sdpa"]), 1)
    for name in schemes:
        for clock, label in ((0, "cpu"), (1, "wall")):
            ratios = [b[clock] / t[clock] for t, b in zip(times[name], times["sdpa"])]  # tokens/s over sdpa's
            row[f"{name}_{label}"] = round(statistics.median(ratios), 3)
    return row


def token_steps(shape: str, batch: int, prompt: int, schemes, warm_up: int) -> dict:
    """Every provider's decoding step of the token table, warmed up: one forward of one new token per row against a
    dynamic cache holding ``prompt`` tokens, cropped back after it. Call them under ``torch.no_grad()`` (the models
    are patched outside it: the patch's self-check runs a backward pass)."""
    from transformers import DynamicCache

    from hf_qknorm.upstream import cache_kwargs

    models = _providers(shape, False, schemes)
    vocab = models["sdpa"].config.vocab_size
    ids = torch.randint(3, vocab, (batch, prompt), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    nxt = torch.randint(3, vocab, (batch, 1), generator=torch.Generator().manual_seed(2)).to(DEVICE)
    steps = {}
    for name, model in models.items():
        kv = DynamicCache(config=model.config)

        def step(model=model, kv=kv):
            model(nxt, use_cache=True, **cache_kwargs(model, kv))
            kv.crop(-1)

        steps[name] = step
        with torch.no_grad():
            model(ids, use_cache=True, **cache_kwargs(model, kv))
            for _ in range(warm_up):  # first calls validate and cache
                step()
    return steps


def token_cell(shape: str, batch: int, prompt: int, rounds: int, schemes) -> dict:
    """One decoding forward (one new token per row) against a dynamic cache holding ``prompt`` tokens, cropped back
    to ``prompt`` after each, 20 forwards per round, many short interleaved rounds: the per-token cost of the model's
    forward without ``generate`` around it, steadier than whole generations where other work shares the machine. The
    ratio is the median over rounds of the unpatched model's CPU time over the provider's (above 1: faster);
    ``sdpa_us`` the unpatched model's median microseconds per forward, the crop included."""
    clock = time.perf_counter if DEVICE.type == "cuda" else time.process_time
    reps = 20
    steps = token_steps(shape, batch, prompt, schemes, warm_up=reps)
    with torch.no_grad():
        times = {name: [] for name in steps}
        for r in range(rounds):
            for name, step in _rotated(steps, r):
                _sync()
                c = clock()
                for _ in range(reps):
                    step()
                _sync()
                times[name].append((clock() - c) / reps)
    row = {"table": "token", "shape": shape, "cache": "dynamic", "batch": batch, "prompt": prompt}
    row["sdpa_us"] = round(statistics.median(times["sdpa"]) * 1e6, 1)
    for name in schemes:
        ratios = [b / t for t, b in zip(times[name], times["sdpa"])]
        row[f"{name}_{_clock_name()}"] = round(statistics.median(ratios), 3)
    return row


def _step_fn(model, seq: int):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=DEVICE.type == "cuda")
    ids = torch.randint(3, model.config.vocab_size, (1, seq), generator=torch.Generator().manual_seed(2)).to(DEVICE)

    def step():
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def step_cell(shape, seq, rounds, schemes, compiled=False, backend="inductor") -> dict:
    models = _providers(shape, False, schemes)
    steps = {}
    if compiled:  # each provider's forward and backward graphs made in the warm-up, none left from another cell
        torch._dynamo.reset()
        torch._dynamo.config.recompile_limit = 64
    for name, model in models.items():
        if compiled:
            model.compile(backend=backend)  # in place: the module's __call__ runs the compiled forward
        steps[name] = _step_fn(model.train(), seq)
        for _ in range(2 if compiled else 1):  # warm-up (compiled: the graphs, then a settled step)
            steps[name]()
    times = {name: [] for name in models}
    for r in range(rounds):
        for name, step in _rotated(steps, r):
            _sync()
            c, w, u = time.process_time(), time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
            step()
            _sync()
            v = resource.getrusage(resource.RUSAGE_SELF)
            user, faults = v.ru_utime - u.ru_utime, v.ru_minflt - u.ru_minflt
            times[name].append((time.process_time() - c, time.perf_counter() - w, user, faults))
    row = {"table": "step", "shape": shape, "seq": seq, "batch": 1}
    if compiled:
        row.update(compiled=True, compile_backend=backend)
    row["sdpa_s"] = round(statistics.median(t[_CLOCKS[_clock_name()]] for t in times["sdpa"]), 3)
    row["sdpa_faults"] = int(statistics.median(t[3] for t in times["sdpa"]))
    for name in schemes:
        # cpu: user + system time (the page faults of the heap's growth are system time); user: without them
        for clock, label in ((0, "cpu"), (1, "wall"), (2, "user")):
            ratios = [t[clock] / b[clock] for t, b in zip(times[name], times["sdpa"]) if b[clock] > 0]  # over sdpa's
            row[f"{name}_{label}"] = round(statistics.median(ratios), 3) if ratios else float("nan")
        row[f"{name}_faults"] = int(statistics.median(t[3] for t in times[name]))  # minor page faults per step
    return row


def _version(package: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return "-"


def _environment() -> dict:
    import transformers
    from bench_cpu import _cpu_model  # this folder's, beside the script

    import hf_qknorm

    return {
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": platform.machine(),  # not platform.processor(): on Linux it starts `uname -p`
        "cpus": torch.get_num_threads(),
        "cpu_model": _cpu_model(),
        "device": str(DEVICE) if DEVICE.type == "cpu" else f"cuda: {torch.cuda.get_device_name(DEVICE)}",
        "dtype": str(DTYPE).removeprefix("torch."),
        "triton": _version("triton"),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "hf_qknorm": getattr(hf_qknorm, "__version__", "?"),
        "hf_qknorm_path": str(Path(hf_qknorm.__file__).parent),
        "command": "python " + " ".join(sys.argv),
        # the heap's settings change how many page faults a step takes (glibc trims and regrows its heap)
        "allocator": {k: v for k, v in os.environ.items() if k.startswith(("MALLOC_", "GLIBC_TUNABLES", "LD_PRELOAD"))},
        # the package's switches (HF_QKNORM_FUSED_NORMS, ...): a row measured with one set says so
        "settings": {k: v for k, v in os.environ.items() if k.startswith("HF_QKNORM_")},
    }


def _ratio(row: dict, scheme: str) -> float:
    """A row's ratio for ``scheme``: CPU time on a CPU, wall time on CUDA (rows without ``device``: CPU)."""
    return row[f"{scheme}_{'wall' if row.get('device', 'cpu').startswith('cuda') else 'cpu'}"]


def markdown(rows: list[dict]) -> str:
    """The decode, token and step tables of ``rows`` (ratios to the unpatched model on sdpa: CPU time on a CPU, wall
    time on CUDA) in Markdown."""
    out = []
    decode = [r for r in rows if r["table"] == "decode"]
    if decode:
        schemes = [s for s in (*SCHEMES, *ABLATIONS) if f"{s}_cpu" in decode[0] or f"{s}_wall" in decode[0]]
        out += ["| shape | cache | batch | prompt | sdpa tokens/s | " + " | ".join(f"`{s}`" for s in schemes) + " |"]
        out += ["|---" * (5 + len(schemes)) + "|"]
        for r in decode:
            cache = r["cache"] + (", compiled" if r.get("compiled") else "")
            cells = [r["shape"], cache, r["batch"], r["prompt"], r["sdpa_tok_s"]]
            out += ["| " + " | ".join(map(str, cells + [f"{_ratio(r, s):.2f}x" for s in schemes])) + " |"]
    tokens = [r for r in rows if r["table"] == "token"]
    if tokens:
        schemes = [s for s in (*SCHEMES, *ABLATIONS) if f"{s}_cpu" in tokens[0] or f"{s}_wall" in tokens[0]]
        out += [
            "",
            "| shape | cache | batch | prompt | sdpa us/forward | " + " | ".join(f"`{s}`" for s in schemes) + " |",
        ]
        out += ["|---" * (5 + len(schemes)) + "|"]
        for r in tokens:
            cells = [r["shape"], r["cache"], r["batch"], r["prompt"], r["sdpa_us"]]
            out += ["| " + " | ".join(map(str, cells + [f"{_ratio(r, s):.2f}x" for s in schemes])) + " |"]
    counted = [r for r in rows if r["table"] == "instructions"]  # count_decode.py's rows
    if counted:
        schemes = [s for s in (*SCHEMES, *ABLATIONS) if f"{s}_instr" in counted[0]]
        out += ["", "| shape | batch | prompt | sdpa instructions/forward | " + " | ".join(f"`{s}`" for s in schemes)]
        out[-1] += " |"
        out += ["|---" * (4 + len(schemes)) + "|"]
        for r in counted:
            cells = [r["shape"], r["batch"], r["prompt"], r["sdpa_instructions"]]
            out += ["| " + " | ".join(map(str, cells + [f"{r[f'{s}_instr']:.3f}x" for s in schemes])) + " |"]
    steps = [r for r in rows if r["table"] == "step"]
    if steps:
        schemes = [s for s in (*SCHEMES, *ABLATIONS) if f"{s}_cpu" in steps[0] or f"{s}_wall" in steps[0]]
        out += ["", "| shape | T | sdpa step (s) | " + " | ".join(f"`{s}`" for s in schemes) + " |"]
        out += ["|---" * (3 + len(schemes)) + "|"]
        for r in steps:
            seq = f"{r['seq']}, compiled" if r.get("compiled") else r["seq"]
            cells = [r["shape"], seq, r["sdpa_s"]] + [f"{_ratio(r, s):.3f}x" for s in schemes]
            out += ["| " + " | ".join(map(str, cells)) + " |"]
        if "sdpa_faults" in steps[0]:  # user time alone, and minor page faults per step (the unpatched model's first)
            names = " | ".join(f"`{s}`" for s in schemes)
            out += ["", f"| shape | T | user time: {names} | page faults per step |"]
            out += ["|---" * (3 + len(schemes)) + "|"]
            for r in steps:
                faults = " / ".join(str(r.get(f"{s}_faults", "?")) for s in ("sdpa", *schemes))
                seq = f"{r['seq']}, compiled" if r.get("compiled") else r["seq"]
                cells = [r["shape"], seq] + [f"{r.get(f'{s}_user', float('nan')):.3f}x" for s in schemes]
                out += ["| " + " | ".join(map(str, cells + [faults])) + " |"]
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--table",
        choices=("decode", "step", "token", "both"),
        default="both",
        help="both: decode and step; token: one decoding forward at a time (dynamic cache)",
    )
    parser.add_argument("--shapes", nargs="+", choices=tuple(SHAPES),
                        help="default: every shape (the step table then skips tiny)")  # fmt: skip
    parser.add_argument("--caches", nargs="+", choices=("dynamic", "static", "sliding_window"),
                        help="default: all three (decode); the token table times the dynamic cache only")  # fmt: skip
    parser.add_argument("--batch", nargs="+", type=int, default=[1, 8])
    parser.add_argument("--prompt", nargs="+", type=int, default=[32, 512])
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--seq", nargs="+", type=int, default=[512, 2048], help="training-step lengths")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--schemes", nargs="+", choices=(*SCHEMES, *ABLATIONS), default=list(SCHEMES))
    parser.add_argument(
        "--compile",
        action="store_true",
        help="decode through generate's compiled forward (static cache only); step: every model compiled "
        "(torch.compile, forward and backward)",
    )
    parser.add_argument("--compile-backend", default="inductor",
                        help="the step table's torch.compile backend (aot_eager: traces only; dry runs)")  # fmt: skip
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default=None,
                        help="default: float32 on the CPU, bfloat16 on CUDA")  # fmt: skip
    parser.add_argument("--route", choices=("kernels", "pytorch"), default="kernels",
                        help="pytorch: the patched models' attention takes the PyTorch path on CUDA too "
                        "(kernel_policy(devices=()))")  # fmt: skip
    parser.add_argument("--label", default="", help="a note stored with the rows (e.g. 'before')")
    parser.add_argument("--no-save", action="store_true")
    parser.add_argument(
        "--report", metavar="LABEL", help="print the tables of the saved rows with this label; run nothing"
    )
    args = parser.parse_args()
    if args.report is not None:
        saved = [json.loads(line) for line in RESULTS.read_text().splitlines()] if RESULTS.exists() else []
        print(markdown([r for r in saved if r.get("label") == args.report]))
        return
    if args.table == "token" and args.caches not in (None, ["dynamic"]):
        parser.error(f"--table token times the dynamic cache only, got --caches {' '.join(args.caches)}")
    args.caches = args.caches or ["dynamic", "static", "sliding_window"]
    step_shapes = args.shapes or [s for s in SHAPES if s != "tiny"]  # tiny's step times only when asked for
    args.shapes = args.shapes or list(SHAPES)
    if args.compile and args.table != "step" and (args.table != "decode" or args.caches != ["static"]):
        parser.error(
            f"--compile times the training step (--table step) or decoding with the static cache (--table decode "
            f"--caches static); got --table {args.table} --caches {' '.join(args.caches)}"
        )
    if args.new_tokens < 2 or args.rounds < 1:
        parser.error(f"--new-tokens must be at least 2 and --rounds at least 1, got {args.new_tokens}, {args.rounds}")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device here")
    global DEVICE, DTYPE
    DEVICE = torch.device(args.device)
    DTYPE = getattr(torch, args.dtype or ("bfloat16" if args.device == "cuda" else "float32"))
    torch.set_num_threads(1)
    env = _environment()
    rows = []
    cells = []
    if args.table in ("decode", "both"):
        for shape in args.shapes:
            for cache in args.caches:
                for batch in args.batch:
                    for prompt in args.prompt:
                        cells.append(("decode", shape, cache, batch, prompt))
    if args.table in ("step", "both"):
        cells += [("step", shape, seq) for shape in step_shapes for seq in args.seq]
    if args.table == "token":
        cells += [("token", s, b, p) for s in args.shapes for b in args.batch for p in args.prompt]
    from hf_qknorm.attention import kernel_policy

    env["route"] = args.route
    for cell in cells:
        with kernel_policy(devices=()) if args.route == "pytorch" else contextlib.nullcontext():
            row = _run(cell, args)
        row.update(env, label=args.label, rounds=args.rounds)
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k not in env}), flush=True)
        if not args.no_save:
            RESULTS.parent.mkdir(parents=True, exist_ok=True)
            with RESULTS.open("a") as f:
                f.write(json.dumps(row) + "\n")
    print(markdown(rows))


def _run(cell, args) -> dict:
    if cell[0] == "decode":
        return decode_cell(*cell[1:], args.new_tokens, args.rounds, args.schemes, args.compile)
    if cell[0] == "token":
        return token_cell(*cell[1:], args.rounds, args.schemes)
    return step_cell(*cell[1:], args.rounds, args.schemes, args.compile, args.compile_backend)


if __name__ == "__main__":
    main()
