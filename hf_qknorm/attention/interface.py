"""The ``"qknorm"`` attention implementation for Transformers' ``AttentionInterface``.

Usable by any model: ``AutoModelForCausalLM.from_pretrained(..., attn_implementation="qknorm")`` or
``model.set_attn_implementation("qknorm")`` once ``hf_qknorm`` is imported. It honours the interface's ``scaling``,
``dropout``, ``softcap`` (a patched module's scheme cap overrides it; without one the model's own cap applies
exactly), ``sliding_window``, ``is_causal``, packed sequences (``cu_seq_lens_*``, or ``position_ids`` that restart --
also with ``use_cache`` on, where Transformers builds no packing mask), ``output_attentions`` and ``s_aux``
(attention sinks); :data:`HONOURED_KWARGS` lists them. The mask rule is :mod:`hf_qknorm.portable.masks`.

Dispatch (:mod:`.dispatch`, a scoped policy): CUDA tensors go to the fused Triton kernels (``hf_qknorm.kernels``),
through the entry point of the call's shape -- except eager decoding calls, which the lean path runs for less host
time while the policy allows the PyTorch path (:func:`_lean_before_kernels`); everything else takes the PyTorch
path -- for a few queries that need no gradient (decoding), the lean path (:mod:`.lean`: plain tensor math, or sdpa
without a cap or sink); otherwise ``sdpa`` when there is no cap or sink, and
:func:`~hf_qknorm.attention.chunked.chunked_attention` (memory linear in sequence length) when there is one, or when a
probe asks for the per-head largest logit of ``TILED_MAX_MIN_LEN`` (256) queries or more. A module's scaling,
dropout, window and cap are validated at its first call and remembered; after that, decoding's commonest call (one
query, no mask, CPU, eager) is decided in one frame (:func:`_one_query`), to the same answer.
``kernel_policy(devices=..., use_fallback=...)`` changes which devices go to the kernels and whether a call they
cannot run may fall back.

Probes. ``module._qknorm_probes`` (set by :class:`hf_qknorm.modeling.telemetry.LogitTap`) maps keys to callables
``probe(module, query, key, attention_mask=, scaling=, softcap=, max_logits=)``, called after the attention with the
``query``/``key``/mask the call received. When any probe's ``wants_max_logits`` (a bool, or a function of the
module) is true, ``max_logits`` is the largest pre-cap logit ``scaling * q.k`` of each query head over the batch and
the allowed pairs, ``(heads,)`` float32 (float64 for float64 inputs), else ``None``. It comes out of the attention's
own pass -- the Triton kernels' row maxima, the tiled path's -- except for uncapped calls of fewer than
``TILED_MAX_MIN_LEN`` queries on the PyTorch path, where sdpa plus a max-only pass is faster.
"""

from __future__ import annotations

import contextlib
import contextvars

import torch
from torch.nn import functional as F

from ..portable.eager import capped_eager_attention, check_sink, effective_softcap
from ..portable.masks import (
    bool_mask,
    check_mask,
    check_scalars,
    packed_sequence_mask,
    resolve_mask,
)
from ..portable.names import ATTN_IMPLEMENTATION
from ..portable.schemes import check_softcap
from . import delegate, lean
from .chunked import chunked_attention, max_logits
from .dispatch import _POLICY, KernelFallbackError, current_kernel_policy, fallback_message, route
from .native import grad_recorded
from .tiles import chunk_allowed

try:  # the outputs Transformers' output capture is collecting in this forward (hf_qknorm/upstream.py)
    from transformers.utils.output_capturing import _active_collector
except ImportError:  # pragma: no cover - every supported Transformers has it
    _active_collector = None


# Every keyword the "qknorm" backend honours, or knows to be harmless, as Transformers' decoder models pass them
# (their ``attention_interface(...)`` call sites and the ``TransformersKwargs`` that reach it through ``**kwargs``).
# The patch-time self-check refuses a model whose forward passes any other keyword with a non-None value: the backend
# itself accepts and ignores unknown keywords, as Transformers' own sdpa does.
HONOURED_KWARGS = frozenset(
    {
        # the interface's own arguments
        "scaling",  # logit scale
        "dropout",  # attention dropout (PyTorch path; the kernels fall back or refuse)
        "softcap",  # the model's own cap (Gemma 2); a patched module's scheme cap overrides it
        "sliding_window",  # applied when no mask holds it already
        "is_causal",  # False: bidirectional
        # packed sequences and weights
        "position_ids",  # packing recognised where they restart
        "cu_seq_lens_q",
        "cu_seq_lens_k",
        "max_length_q",
        "max_length_k",
        "output_attentions",  # weights materialised on request
        "s_aux",  # per-head attention-sink logits (gpt-oss): one more logit in each row's softmax denominator
        # harmless: options of the model's forward that reach the attention through **kwargs and change nothing in it
        "use_cache",
        "cache_position",
        "cache",  # the key/value cache (Transformers 5.24's name; upstream.CACHE_NAMES)
        "past_key_values",  # its name before 5.24
        "output_hidden_states",
        "output_router_logits",
        "num_items_in_batch",
        "return_dict",
    }
)

# Without a cap, per-head max logits come from the tiled path's own pass from this many queries up; below it, sdpa
# plus a max-only pass is faster (the tiled path's fixed costs dominate). Measured on CPU, forward+backward, one
# thread, time relative to sdpa alone: (B, H, T, D) = (16, 4, 128, 32): tiled 1.49x, sdpa + max pass 1.25x;
# (16, 4, 256, 32): 1.15x vs 1.17x; (8, 4, 256, 64): 1.09x vs 1.15x; (8, 4, 512, 32): 0.88x vs 1.13x.
TILED_MAX_MIN_LEN = 256


# True inside ``returning_weights()``: every call returns its attention weights
_WEIGHTS_ASKED: contextvars.ContextVar[bool] = contextvars.ContextVar("qknorm_weights_asked", default=False)


@contextlib.contextmanager
def returning_weights():
    """Every eager call of the backend inside returns its attention weights, as with ``output_attentions=True``,
    also through an attention module whose forward takes that argument for itself and does not pass it on (GPT-2's):
    how conversion's healing reads a layer's attention probabilities (``--heal-attention-kl``). Not seen inside a
    graph ``torch.compile`` traces."""
    token = _WEIGHTS_ASKED.set(True)
    try:
        yield
    finally:
        _WEIGHTS_ASKED.reset(token)


def weights_requested(module: torch.nn.Module, kwargs: dict) -> bool:
    """Whether the caller wants attention weights: inside :func:`returning_weights`, yes; else the forward's
    ``output_attentions`` where it reaches the backend; else whether Transformers' output capture is collecting
    attentions (asked by ``output_attentions=True`` or by ``config.output_attentions``; GPT-2 does not pass the
    argument on to its attention); else the module's config."""
    if not torch.compiler.is_compiling() and _WEIGHTS_ASKED.get():  # Dynamo cannot trace ContextVar.get
        return True
    if "output_attentions" in kwargs:
        return bool(kwargs["output_attentions"])
    collecting = _active_collector.get() if _active_collector is not None else None
    if collecting is not None:
        return "attentions" in collecting
    return bool(getattr(getattr(module, "config", None), "output_attentions", False))


def _varlen_mask(
    cu_q: torch.Tensor,
    cu_k: torch.Tensor,
    q_len: int,
    kv_len: int,
    causal: bool,
    mask: torch.Tensor | None,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Block-diagonal boolean ``(1, 1, q_len, kv_len)`` mask of packed sequences given their cumulative lengths
    (sequence ``b``: queries ``cu_q[b]:cu_q[b + 1]``, keys ``cu_k[b]:cu_k[b + 1]``; rows past the last boundary
    belong to the last sequence), causal within each sequence when ``causal`` -- bottom-right aligned per sequence,
    as the kernels' varlen mode and FlashAttention's: a sequence's query ``i`` sits at its key position ``i +
    k_len - q_len`` -- each query seeing only the ``sliding_window`` keys up to its position when one is given,
    intersected with ``mask``."""

    def where(cu, n):  # per row position: its sequence, its place in it, and the sequence's length
        cu = cu.long()
        pos = torch.arange(n, device=cu.device)
        seq = torch.searchsorted(cu[1:], pos, right=True).clamp_(max=cu.numel() - 2)  # empty sequences skipped
        return seq, pos - cu[seq], (cu[1:] - cu[:-1])[seq]

    q_seq, q_at, q_lens = where(cu_q, q_len)
    k_seq, k_at, _ = where(cu_k, kv_len)
    k_lens = (cu_k[1:] - cu_k[:-1]).to(torch.long)[q_seq]  # the keys of each query's own sequence
    ok = q_seq[:, None] == k_seq[None, :]
    at = (q_at + k_lens - q_lens)[:, None]  # each query's key position in its sequence
    if causal:
        ok = ok & (k_at[None, :] <= at)
    if sliding_window is not None:
        ok = ok & (at - k_at[None, :] < sliding_window)
    ok = ok[None, None]
    return ok if mask is None else ok & mask


def qknorm_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    softcap: float | None = None,
    sliding_window: int | None = None,
    is_causal: bool | None = None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Attention with an optional logit cap, in the ``AttentionInterface`` calling convention: ``query`` ``(batch,
    heads, q_len, head_dim)``, ``key``/``value`` ``(batch, kv_heads, kv_len, head_dim)``; returns ``(batch, q_len,
    heads, head_dim)`` and the attention weights ``(batch, heads, q_len, kv_len)`` when ``output_attentions`` is set,
    else ``None``.

    ``attention_mask`` is complete (boolean, True = attend, or additive 0/-inf) or ``None``, which means what it
    means for sdpa (:mod:`.masks`); a patched module's scheme cap overrides ``softcap``
    (:func:`~hf_qknorm.portable.eager.effective_softcap`); :data:`HONOURED_KWARGS` lists every keyword honoured or
    known to be harmless, others are ignored as sdpa ignores them. The rest: docs/patching.md (the backend)."""
    if value.shape[-1] != query.shape[-1]:
        raise ValueError(
            f"the {ATTN_IMPLEMENTATION!r} attention backend takes value heads as wide as the query and key heads; this "
            f"call's are {value.shape[-1]} and {query.shape[-1]} wide (a value head width of the model's own, "
            "v_head_dim: MiMo-V2-Flash's); such a model runs on 'sdpa' or 'eager', unpatched"
        )
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    if (
        query.shape[2] == 1
        and query.is_cpu
        and (attention_mask is None or attention_mask.dtype is torch.bool)
        and not torch.compiler.is_compiling()
    ):
        out = _one_query(module, query, key, value, attention_mask, scaling, dropout, softcap, sliding_window, kwargs)
        if out is not None:
            return out, None
    softcap = _checked_args(module, scaling, dropout, softcap, sliding_window)
    check_mask(query, key, attention_mask)
    # hf_qknorm.modeling.telemetry.LogitTap; under torch.compile through getattr, which Dynamo guards on
    compiling = torch.compiler.is_compiling()
    probes = getattr(module, "_qknorm_probes", None) if compiling else module.__dict__.get("_qknorm_probes")
    if not probes:
        args = (attention_mask, scaling, dropout, softcap, sliding_window, is_causal, kwargs)
        out = _lean(module, query, key, value, *args)
        if out is not None:
            return out, None
    probes = tuple(probes.values()) if probes else ()
    want_max = bool(probes) and any(_wants_max(probe, module) for probe in probes)
    out, weights, top = _attention(
        module,
        query,
        key,
        value,
        attention_mask,
        scaling,
        dropout,
        softcap,
        sliding_window,
        is_causal,
        want_max,
        kwargs,
    )
    for probe in probes:
        probe(module, query, key, attention_mask=attention_mask, scaling=scaling, softcap=softcap, max_logits=top)
    return out, weights


def _checked_args(module, scaling, dropout, softcap, sliding_window) -> float | None:
    """The call's per-module arguments validated (:func:`~hf_qknorm.portable.masks.check_scalars`,
    :func:`~hf_qknorm.portable.schemes.check_softcap`) and the cap in force (:func:`effective_softcap`). They are the
    same at every call of a module, so a module remembers the last set it validated and its cap: the checks run
    once per module, not once per layer per token (under ``torch.compile``, once per trace)."""
    compiling = torch.compiler.is_compiling()  # then the checks run at trace time, once per graph
    if not compiling:
        args = (scaling, dropout, softcap, sliding_window, module.__dict__.get("_qknorm_softcap"))
        seen = module.__dict__.get("_qknorm_checked")
        if seen is not None and seen[0] == args:
            return seen[1]
    check_scalars(scaling, dropout, sliding_window)
    cap = effective_softcap(module, softcap)  # the scheme's cap, else the one the model passed
    if cap is not None:
        cap = check_softcap(cap)
    if not compiling and all(isinstance(a, (int, float, type(None))) for a in args):
        module.__dict__["_qknorm_checked"] = (args, cap)
    return cap


def _one_query(module, query, key, value, attention_mask, scaling, dropout, softcap, sliding_window, kwargs):
    """Decoding's commonest calls -- one query, on the CPU, eager, with no mask (nothing padded) or a boolean one
    over the keys (padding, a static cache's empty slots, a window) -- in one frame: what :func:`_checked_args`,
    :func:`~hf_qknorm.portable.masks.check_mask` and :func:`_lean` decide for them, decided here with fewer calls
    (each costs a microsecond or two of host time per layer per token when decoding). A boolean mask is complete
    (:mod:`hf_qknorm.portable.masks`: then no window or causality applies beside it, and one query packs nothing).
    ``None`` sends the call down the general route, which validates, remembers and decides as always: a module's
    first call, a changed argument, a probe, a sink, packing, dropout, a gradient, attention weights, a mask of
    another shape, a window the keys exceed without a mask, a call too large for the lean path, a policy that sends
    CPU tensors to the kernels."""
    state = module.__dict__
    seen = state.get("_qknorm_checked")  # (arguments, cap) that _checked_args validated for this module
    if (
        seen is None
        or seen[0] != (scaling, dropout, softcap, sliding_window, state.get("_qknorm_softcap"))
        or state.get("_qknorm_probes")
        or kwargs.get("s_aux") is not None
        or kwargs.get("cu_seq_lens_q") is not None
        or (dropout and module.training)
        or _WEIGHTS_ASKED.get()
        or grad_recorded(query, key, value)  # the native op's rule (.native.eligible) says the same
        or "cpu" in _POLICY.get().devices  # route() could send CPU tensors to the kernels: it decides
    ):
        return None
    # weights_requested(), whose commonest answer -- an output capture running that collects no attentions -- is read
    # here without its frame; every other case asks it
    collecting = _active_collector.get() if _active_collector is not None else None
    if ("output_attentions" in kwargs or collecting is None or "attentions" in collecting) and weights_requested(
        module, kwargs
    ):
        return None
    batch, heads = query.shape[0], query.shape[1]
    kv_heads, kv_len = key.shape[1], key.shape[2]
    if attention_mask is None:
        if sliding_window is not None and kv_len > sliding_window:
            return None
    else:  # the shapes check_mask accepts for one query, (batch | 1, 1 | heads, 1, kv_len), on the query's device
        shape = attention_mask.shape
        if (
            len(shape) != 4
            or shape[2] != 1
            or shape[3] != kv_len
            or shape[0] not in (1, batch)
            or shape[1] not in (1, heads)
            or not attention_mask.is_cpu
        ):
            return None
    if not lean.fits(batch, heads, kv_heads, 1, kv_len):
        return None
    cap = seen[1]
    if cap is None and batch * heads * kv_len < lean.MATH_MIN:  # (batch, 1, heads, head_dim): one view, no copy
        return _sdpa(module, query, key, value, attention_mask, scaling, 0.0, False, None).view(batch, 1, heads, -1)
    return lean.lean_attention(
        query, key, value, scaling=scaling, softcap=cap, mask=attention_mask, causal=False, sliding_window=None
    )


def _lean(module, query, key, value, attention_mask, scaling, dropout, softcap, sliding_window, is_causal, kwargs):
    """The call through the lean path (:mod:`.lean`; sdpa without a cap or sink), or ``None`` when it is not the
    lean path's: it needs few queries whose logits fit one tile, no gradient, no dropout, no attention weights, no
    packed ``cu_seq_lens``, and a call the kernels do not take."""
    batch, heads, q_len = query.shape[:3]
    if not lean.fits(batch, heads, key.shape[1], q_len, key.shape[2]):
        return None
    sink = kwargs.get("s_aux")
    if torch.is_grad_enabled() and (
        query.requires_grad or key.requires_grad or value.requires_grad or (sink is not None and sink.requires_grad)
    ):
        return None
    if (dropout and module.training) or kwargs.get("cu_seq_lens_q") is not None or weights_requested(module, kwargs):
        return None
    sink = check_sink(sink, heads)
    on_cpu = query.is_cpu  # a property: ``query.device.type`` makes a device object, half a microsecond per call
    use, refusal = route("cpu" if on_cpu else query.device.type, query.dtype, 0.0, False, sink is not None)
    if refusal is not None or (use and not _lean_before_kernels(query)):
        return None
    # decoding without padding: the one query sees every key (the rule of _resolve_mask, without its calls)
    if attention_mask is None and q_len == 1:
        mask, causal = None, False
    else:
        causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
        key, value, mask, causal, sliding_window = _resolve_mask(
            query, key, value, attention_mask, causal, sliding_window, kwargs
        )
    # without a cap or sink: sdpa, except one CPU query against many keys (lean.MATH_MIN; a GPU's sdpa is one launch)
    if softcap is None and sink is None and (q_len > 1 or not on_cpu or batch * heads * key.shape[2] < lean.MATH_MIN):
        return _sdpa(module, query, key, value, mask, scaling, 0.0, causal, sliding_window).transpose(1, 2).contiguous()
    out = lean.lean_attention(
        query,
        key,
        value,
        scaling=scaling,
        softcap=softcap,
        mask=mask,
        causal=causal,
        sliding_window=sliding_window,
        sink=sink,
    )
    return out if q_len == 1 else out.contiguous()  # one query's output is contiguous already


def _lean_before_kernels(query: torch.Tensor) -> bool:
    """Whether a decoding call the kernels would take runs the lean path instead: on CUDA, eager, with the PyTorch
    path allowed (``kernel_policy(use_fallback=True)``, the default). Decoding there is bound by the host: the lean
    path's few ATen launches cost it less than the Triton kernels' launches (benchmarks/results/tuning.md).
    Compiled graphs keep the kernels (CUDA graphs remove the launch cost; measured at parity with the unpatched
    model), as does ``use_fallback=False``, which asks for the kernels, and a CUDA-graph capture in eager mode (the
    lean path reads a mask's rows on the host, which a capture forbids)."""
    if not query.is_cuda or torch.compiler.is_compiling():
        return False
    return current_kernel_policy().use_fallback and not torch.cuda.is_current_stream_capturing()


def _wants_max(probe, module) -> bool:
    """A probe's ``wants_max_logits``: a bool, or a function of the module (e.g. only in training mode)."""
    wants = getattr(probe, "wants_max_logits", False)
    return bool(wants(module) if callable(wants) else wants)


def _attention(
    module, query, key, value, attention_mask, scaling, dropout, softcap, sliding_window, is_causal, want_max, kwargs
):
    """The attention proper: ``(output, weights or None, per-head max logits or None)``."""
    if not module.training:
        dropout = 0.0
    causal = declared_causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
    key, value, mask, causal, sliding_window = _resolve_mask(
        query, key, value, attention_mask, causal, sliding_window, kwargs
    )
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    sink = check_sink(kwargs.get("s_aux"), query.shape[1])
    if weights_requested(module, kwargs):
        _use_kernels(query, dropout, weights=True, sink=sink is not None)  # raises if the policy forbids it
        args = (mask, cu_q, cu_k, scaling, dropout, softcap, causal, sliding_window, want_max, sink)
        return _with_weights(module, query, key, value, *args)

    if _use_kernels(query, dropout, weights=False, sink=sink is not None):
        if cu_q is not None:  # the packing is the mask: causal within each sequence as the module declares
            mask, causal = None, declared_causal
        args = (query, key, value, mask, cu_q, cu_k, scaling, softcap, causal, sliding_window, want_max, kwargs)
        delegated = delegate.try_delegate(*args)  # FlashAttention where it fits and is measured faster
        if delegated is not None:
            return delegated, None, None
        out, top = _kernel_attention(*args)
        return out.transpose(1, 2).contiguous(), None, top

    if cu_q is not None:  # packed sequences in one row, described by their cumulative lengths
        q_len, kv_len = query.shape[2], key.shape[2]
        mask = _varlen_mask(cu_q, cu_k if cu_k is not None else cu_q, q_len, kv_len, causal, mask, sliding_window)
        causal, sliding_window = False, None  # the mask holds them now
    top = None
    if softcap is None and sink is None and (not want_max or query.shape[2] < TILED_MAX_MIN_LEN):
        out = _sdpa(module, query, key, value, mask, scaling, dropout, causal, sliding_window)
        if want_max:  # short sequences: sdpa plus a max-only pass beats the tiled attention (measured)
            top = max_logits(
                query.detach(), key.detach(), scaling=scaling, mask=mask, causal=causal, sliding_window=sliding_window
            )
    else:  # the tiled path: caps, and yields the per-head max logits from its own pass
        out = chunked_attention(
            query,
            key,
            value,
            scaling=scaling,
            softcap=softcap,
            mask=mask,
            causal=causal,
            sliding_window=sliding_window,
            dropout_p=dropout,
            return_max_logits=want_max,
            sink=sink,
        )
        out, top = out if want_max else (out, None)
    return out.transpose(1, 2).contiguous(), None, top


def _use_kernels(query, dropout, weights: bool, sink: bool = False) -> bool:
    """Whether this call runs the Triton kernels under the policy in force (:func:`.dispatch.route`); raises
    :class:`~.dispatch.KernelFallbackError` where the kernels cannot run it and the policy forbids the fallback."""
    use, refusal = route(query.device.type, query.dtype, dropout, weights, sink)
    if refusal is not None:
        raise KernelFallbackError(fallback_message(query.device.type, refusal))
    return use


def _kernel_attention(query, key, value, mask, cu_q, cu_k, scaling, softcap, causal, sliding_window, want_max, kwargs):
    """The Triton kernels through the entry point of the call's shape: ``(output (batch, heads, q_len, head_dim),
    per-head max logits or None)``."""
    from ..kernels import attn_interface as kernels  # the dispatch policy checked that they can run

    key, value = key.to(query.dtype).contiguous(), value.to(query.dtype).contiguous()
    common = dict(scaling=scaling, softcap=softcap, sliding_window=sliding_window)
    if cu_q is not None:
        packed = (
            query,
            key,
            value,
            cu_q,
            cu_k if cu_k is not None else cu_q,
            kwargs.get("max_length_q"),
            kwargs.get("max_length_k"),
        )
        if want_max:
            return kernels.qknorm_attn_varlen_func_with_max_logits(*packed, causal=causal, **common)
        return kernels.qknorm_attn_varlen_func(*packed, causal=causal, **common), None
    if want_max:
        return kernels.qknorm_attn_func_with_max_logits(query, key, value, causal=causal, attn_mask=mask, **common)
    return kernels.qknorm_attn_func(query, key, value, causal=causal, attn_mask=mask, **common), None


def _resolve_mask(query, key, value, attention_mask, causal, sliding_window, kwargs):
    """The mask rule (:func:`~hf_qknorm.portable.masks.resolve_mask`) applied: ``(key, value, mask, causal,
    sliding_window)`` where ``mask`` is boolean and complete (then ``causal`` is False and there is no window), or
    ``None`` with ``causal`` meaning square causal (keys a top-left causal pattern never sees are dropped), or causal
    within each ``cu_seq_lens`` sequence."""
    q_len, kv_len = query.shape[2], key.shape[2]
    if kwargs.get("cu_seq_lens_q") is not None:
        if query.shape[0] != 1:
            raise ValueError(
                f"packed sequences (cu_seq_lens_q) must come as one row of concatenated sequences, batch 1; "
                f"got a batch of {query.shape[0]} (query {tuple(query.shape)})"
            )
        mask = bool_mask(attention_mask)  # without a mask, `causal` means: causal within each packed sequence
        return (key, value, mask, False, None) if mask is not None else (key, value, None, causal, sliding_window)
    mask, square, keys = resolve_mask(attention_mask, q_len, kv_len, causal)
    packed = packed_sequence_mask(kwargs.get("position_ids"), q_len, kv_len, mask) if causal else None
    if mask is not None:  # complete...
        if packed is not None:  # ...except for packing with the cache on: Transformers leaves it out then
            combined = mask & packed
            mask = torch.where(combined.any(-1, keepdim=True), combined, mask)  # never empty a row it left open
        return key, value, mask, False, None
    if keys < kv_len:  # an empty static cache's slots, never seen
        key, value = key[:, :, :keys], value[:, :, :keys]
    if square and packed is not None:  # causal within each packed sequence
        return key, value, packed[..., :keys], False, None
    return key, value, None, square, sliding_window


def _with_weights(
    module, query, key, value, mask, cu_q, cu_k, scaling, dropout, softcap, causal, sliding_window, want_max, sink
):
    """The call that asked for attention weights: the materialising path, which returns them (and, on request, the
    per-head max logits, computed on the side: this path is for inspection, not speed). ``sliding_window`` is the one
    :func:`_resolve_mask` left standing (no mask holds it)."""
    q_len, kv_len = query.shape[2], key.shape[2]
    if cu_q is not None:
        mask = _varlen_mask(cu_q, cu_k if cu_k is not None else cu_q, q_len, kv_len, causal, mask, sliding_window)
        causal = False
    elif mask is None and (causal or sliding_window is not None):
        mask = chunk_allowed(None, 0, q_len, q_len, kv_len, causal, sliding_window, query.device)[None, None]
    out, weights = capped_eager_attention(
        module, query, key, value, mask, scaling=scaling, dropout=dropout, softcap=softcap, is_causal=False, s_aux=sink
    )
    top = None
    if want_max:  # the mask is boolean and complete here
        top = max_logits(query.detach(), key.detach(), scaling=scaling, mask=mask, causal=False)
    return out, weights, top


def _sdpa(module, query, key, value, mask, scaling, dropout, causal, sliding_window):
    """sdpa without a cap. ``causal`` (no mask) is square here: the caller dropped the keys a top-left causal
    pattern never sees."""
    q_len, kv_len = query.shape[2], key.shape[2]
    if sliding_window is not None and mask is None and kv_len > sliding_window:
        mask = chunk_allowed(None, 0, q_len, q_len, kv_len, causal, sliding_window, query.device)[None, None]
        causal = False
    groups = query.shape[1] // key.shape[1]
    return F.scaled_dot_product_attention(
        query, key, value, attn_mask=mask, dropout_p=dropout, is_causal=causal, scale=scaling, enable_gqa=groups > 1
    )


def register() -> None:
    """Register ``"qknorm"`` with Transformers' attention and attention-mask interfaces (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTN_IMPLEMENTATION, qknorm_attention_forward)
    # Without a mask function Transformers passes no mask at all; the boolean sdpa mask (None when purely causal)
    # is what both paths consume.
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, sdpa_mask)
