"""Per-head max-logit telemetry against a brute-force max over materialised float64 logits, on every path: the
PyTorch tiled attention (capped and uncapped), the ``"qknorm"`` interface with every mask form it resolves, the
Triton kernels under the interpreter, and the projection-hook fallback. The allowed pairs of each case are written
out here from their definition (not taken from hf_qknorm.portable.masks), and the largest logits are planted on
pairs the mask hides, so a masked pair that counted would show."""

from __future__ import annotations

import os

import pytest
import torch

import hf_qknorm.attention.tiles as tiles
from hf_qknorm import upstream
from hf_qknorm.attention import kernel_policy
from hf_qknorm.attention.chunked import chunked_attention, max_logits
from hf_qknorm.attention.interface import qknorm_attention_forward

INF = float("inf")


def _brute(q, k, allowed, scaling):
    """Per query head, the largest ``scaling * q.k`` over the batch and the allowed pairs, in float64."""
    groups = q.shape[1] // k.shape[1]
    s = scaling * q.double() @ k.double().repeat_interleave(groups, 1).transpose(-1, -2)
    return s.masked_fill(~allowed.expand_as(s), -INF).amax(dim=(0, 2, 3))


def _pattern(q_len, kv_len, *, causal=True, window=None, top_left=False):
    """Allowed (q_len, kv_len) pairs: causal bottom-right (or top-left) aligned, optional window."""
    pos = torch.arange(q_len)[:, None] + (0 if top_left else kv_len - q_len)
    key = torch.arange(kv_len)[None, :]
    ok = key <= pos if causal else torch.ones(q_len, kv_len, dtype=torch.bool)
    if window is not None:
        ok = ok & (pos - key < window)
    return ok


def _qkv(b, h, hkv, tq, tk, d=8, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, tq, d, generator=g, dtype=torch.float64)
    k = torch.randn(b, hkv, tk, d, generator=g, dtype=torch.float64)
    v = torch.randn(b, hkv, tk, d, generator=g, dtype=torch.float64)
    return q.to(dtype), k.to(dtype), v.to(dtype)


def _plant(q, k, hidden):
    """Plant the largest logit of every head on a hidden pair ``(i, j)`` (of batch 0, head 0): ``q_i = u`` and
    ``k_j = 40 u`` in every head, so a hidden pair that counted would dominate. The pair is the one a plausible
    mistake would let through: hidden although causal (padding, window, packing), else the nearest one past the
    diagonal (a misaligned causal pattern). Modifies ``q`` and ``k``."""
    idx = hidden.nonzero()
    if len(idx):
        lower = idx[idx[:, 1] <= idx[:, 0]]
        i, j = (lower[len(lower) // 2] if len(lower) else idx[(idx[:, 1] - idx[:, 0]).argmin()]).tolist()
        u = torch.randn(q.shape[-1], generator=torch.Generator().manual_seed(5), dtype=q.dtype)
        q[:, :, i] = u
        k[:, :, j] = 40 * u


def _close(got, want, dtype):
    assert got.shape == want.shape
    finite = torch.isfinite(want)
    assert torch.equal(torch.isfinite(got), finite), (got, want)
    rtol = 1e-12 if dtype == torch.float64 else 2e-6
    torch.testing.assert_close(got.double()[finite], want[finite], rtol=rtol, atol=rtol)


# ---------------------------------------------------------------------------------------------------------------------
# the tiled PyTorch path itself
# ---------------------------------------------------------------------------------------------------------------------
CASES = {  # name: (b, h, hkv, tq, tk, causal, window, mask kind)
    "causal_gqa": (2, 6, 2, 37, 37, True, None, None),
    "bottom_right": (2, 4, 2, 9, 40, True, None, None),
    "window": (1, 4, 1, 50, 50, True, 7, None),
    "padding": (3, 4, 2, 30, 30, True, None, "padding"),
    "per_head": (2, 4, 4, 21, 21, False, None, "per_head"),
    "empty_head": (1, 2, 1, 5, 5, False, None, "empty_head"),
}


def _case_mask(kind, b, h, tq, tk, seed=3):
    g = torch.Generator().manual_seed(seed)
    if kind == "padding":
        keep = torch.ones(b, tk, dtype=torch.bool)
        keep[0, :7] = False  # left padding
        keep[1, -5:] = False  # right padding
        return keep[:, None, None, :].expand(b, 1, tq, tk)
    if kind == "per_head":
        return torch.rand(b, h, tq, tk, generator=g) > 0.4
    if kind == "empty_head":
        m = torch.ones(b, h, tq, tk, dtype=torch.bool)
        m[:, 1] = False  # head 1 sees nothing: -inf
        return m
    return None


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("softcap", [None, 2.0, 50.0])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_tiled_path_max_logits(case, softcap, dtype, monkeypatch):
    monkeypatch.setattr(tiles, "TILE_ELEMENTS", 600)  # many tiles: row ranges, query blocks, edge columns
    monkeypatch.setattr(tiles, "QUERY_ROWS", 8)
    b, h, hkv, tq, tk, causal, window, kind = CASES[case]
    q, k, v = _qkv(b, h, hkv, tq, tk, dtype=torch.float64)
    mask = _case_mask(kind, b, h, tq, tk)
    allowed = _pattern(tq, tk, causal=causal, window=window)[None, None]
    if mask is not None:
        allowed = allowed & mask
    _plant(q, k, ~allowed[0, 0])
    want = _brute(q, k, allowed, 0.3)
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    out, top = chunked_attention(
        q, k, v, scaling=0.3, softcap=softcap, mask=mask, causal=causal, sliding_window=window, return_max_logits=True
    )
    _close(top, want, dtype)
    plain = chunked_attention(q, k, v, scaling=0.3, softcap=softcap, mask=mask, causal=causal, sliding_window=window)
    torch.testing.assert_close(out, plain, rtol=1e-12 if dtype == torch.float64 else 1e-5, atol=1e-6)


@pytest.mark.parametrize("kind", ["causal", "padding", "additive_per_head", "cache_wider_mask", "single_query"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_side_computation_max_logits(kind, dtype, monkeypatch):
    """``head_max_logits``, what the projection hooks use on other backends."""
    from hf_qknorm.modeling.telemetry import head_max_logits

    monkeypatch.setattr(tiles, "TILE_ELEMENTS", 500)
    b, h, hkv, t = 2, 6, 2, 29
    q, k, _ = _qkv(b, h, hkv, t, t)
    mask, allowed = None, _pattern(t, t)[None, None]
    if kind == "padding":
        keep = torch.ones(b, t, dtype=torch.bool)
        keep[0, :6] = False
        mask = allowed = allowed & keep[:, None, None, :]
    elif kind == "additive_per_head":
        allowed = allowed & (torch.rand(b, h, t, t, generator=torch.Generator().manual_seed(2)) > 0.3)
        mask = torch.zeros(b, h, t, t, dtype=torch.float64).masked_fill(~allowed, torch.finfo(torch.float64).min)
    elif kind == "cache_wider_mask":  # a mask over 7 cached keys + the current ones, of which only the latter are seen
        mask = torch.cat([torch.ones(b, 1, t, 7, dtype=torch.bool), allowed.expand(b, 1, t, t)], -1)
    elif kind == "single_query":
        q, allowed = q[:, :, -1:], torch.ones(1, 1, 1, t, dtype=torch.bool)
    _plant(q, k, ~allowed.expand(b, h, q.shape[2], t)[0, 0])
    want = _brute(q, k, allowed, 0.4)
    got = head_max_logits(
        q.to(dtype), k.to(dtype), mask if mask is None or mask.dtype == torch.bool else mask.to(dtype), scaling=0.4
    )
    _close(got, want, dtype)


# ---------------------------------------------------------------------------------------------------------------------
# the "qknorm" interface: every mask form it resolves, every path it dispatches to
# ---------------------------------------------------------------------------------------------------------------------
class _Mod(torch.nn.Module):
    is_causal = True


class _Probe:
    wants_max_logits = True

    def __init__(self):
        self.seen = []

    def __call__(self, module, q, k, attention_mask=None, scaling=1.0, softcap=None, max_logits=None):
        self.seen.append(max_logits)


def _interface_case(name, dtype):
    """(q, k, v, attention_mask, kwargs, allowed) for one of the mask forms Transformers hands the backend."""
    b, h, hkv, t, d = 2, 4, 2, 40, 8  # q_len * groups > 64: the kernels' general forward, not the decoding one
    q, k, v = _qkv(b, h, hkv, t, t, d)
    kwargs, mask = {}, None
    allowed = _pattern(t, t)[None, None]
    if name == "static_prefill":  # no mask and more keys than queries: top-left causal, empty slots never seen
        q = q[:, :, :33]
        allowed = _pattern(33, t, top_left=True)[None, None]
    elif name == "padding":
        keep = torch.ones(b, t, dtype=torch.bool)
        keep[0, :5] = False
        mask = allowed & keep[:, None, None, :]
        allowed = mask
    elif name == "additive":
        keep = torch.ones(b, t, dtype=torch.bool)
        keep[1, -4:] = False
        allowed = allowed & keep[:, None, None, :]
        mask = torch.zeros(b, 1, t, t, dtype=torch.float64).masked_fill(~allowed, torch.finfo(torch.float64).min)
    elif name == "sliding_window":
        kwargs["sliding_window"] = 5
        allowed = _pattern(t, t, window=5)[None, None]
    elif name == "packed_position_ids":  # sequences of 6 and 34 in each row
        kwargs["position_ids"] = torch.cat([torch.arange(6), torch.arange(34)])[None].expand(b, t)
        seq = torch.tensor([0] * 6 + [1] * 34)
        allowed = allowed & (seq[:, None] == seq[None, :])
    elif name == "cu_seq_lens":
        q, k, v = q[:1], k[:1], v[:1]
        cu = torch.tensor([0, 4, 11, 40], dtype=torch.int32)
        kwargs.update(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=29, max_length_k=29)
        seq = torch.repeat_interleave(torch.arange(3), torch.tensor([4, 7, 29]))
        allowed = allowed & (seq[:, None] == seq[None, :])
    elif name == "decode":  # one query against a cache: sees every key
        q = q[:, :, -1:]
        allowed = torch.ones(1, 1, 1, t, dtype=torch.bool)
    elif name == "output_attentions":
        kwargs["output_attentions"] = True
    _plant(q, k, ~allowed.expand(q.shape[0], 1, q.shape[2], k.shape[2])[0, 0])
    want = _brute(q, k, allowed, 0.35)
    return q.to(dtype), k.to(dtype), v.to(dtype), mask, kwargs, want


INTERFACE_CASES = [
    "causal",
    "static_prefill",
    "padding",
    "additive",
    "sliding_window",
    "packed_position_ids",
    "cu_seq_lens",
    "decode",
    "output_attentions",
]


def _call_with_probe(q, k, v, mask, kwargs, softcap, training=False, dropout=0.0):
    module = _Mod().train(training)
    probe = _Probe()
    module.__dict__["_qknorm_probes"] = {"t": probe}
    out, _ = qknorm_attention_forward(module, q, k, v, mask, scaling=0.35, softcap=softcap, dropout=dropout, **kwargs)
    assert len(probe.seen) == 1
    return out, probe.seen[0]


@pytest.mark.parametrize("name", INTERFACE_CASES)
@pytest.mark.parametrize("softcap", [None, 3.0])
@pytest.mark.parametrize("tiled_from", [1, 10**6])  # the uncapped dispatch: tiled attention, or sdpa + max-only pass
def test_interface_max_logits(name, softcap, tiled_from, monkeypatch):
    import hf_qknorm.attention.interface as interface
    import hf_qknorm.modeling.telemetry as telemetry

    if softcap is not None and tiled_from != 1:
        pytest.skip("the threshold only concerns uncapped calls")
    monkeypatch.setattr(interface, "TILED_MAX_MIN_LEN", tiled_from)
    side = []
    monkeypatch.setattr(interface, "max_logits", lambda *a, **kw: side.append(1) or max_logits(*a, **kw))
    q, k, v, mask, kwargs, want = _interface_case(name, torch.float64)
    monkeypatch.setattr(telemetry, "head_max_logits", lambda *a, **kw: pytest.fail("the projection-hook path"))
    out, top = _call_with_probe(q, k, v, mask, kwargs, softcap)
    _close(top, want, torch.float64)
    # a max-only pass on the side: on the materialising path (it is for inspection), and for short uncapped calls
    assert len(side) == (name == "output_attentions" or (softcap is None and tiled_from > 1))
    plain, _ = qknorm_attention_forward(
        _Mod().eval(),
        q,
        k,
        v,
        mask,
        scaling=0.35,
        softcap=softcap,
        **{key: val for key, val in kwargs.items() if key != "output_attentions"},
    )
    torch.testing.assert_close(out, plain, rtol=1e-10, atol=1e-10)  # telemetry changes nothing in the output


def test_interface_dropout_path_max_logits():
    q, k, v, mask, kwargs, want = _interface_case("padding", torch.float64)
    _, top = _call_with_probe(q, k, v, mask, kwargs, 3.0, training=True, dropout=0.3)
    _close(top, want, torch.float64)


def test_no_probe_wanting_max_logits_gets_none():
    q, k, v, mask, kwargs, _ = _interface_case("causal", torch.float64)
    module = _Mod()
    seen = []
    module.__dict__["_qknorm_probes"] = {"t": lambda m, q, k, **kw: seen.append(kw["max_logits"])}
    qknorm_attention_forward(module, q, k, v, mask, scaling=0.35, softcap=None)
    assert seen == [None]


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs Triton's interpreter")
@pytest.mark.parametrize(
    "name", ["causal", "static_prefill", "padding", "sliding_window", "packed_position_ids", "cu_seq_lens", "decode"]
)
@pytest.mark.parametrize("softcap", [None, 3.0])
def test_triton_kernels_max_logits(name, softcap, monkeypatch, kernels_on_cpu):
    import hf_qknorm.modeling.telemetry as telemetry

    calls = _spy_entry_points(monkeypatch)
    monkeypatch.setattr(telemetry, "head_max_logits", lambda *a, **kw: pytest.fail("an extra pass"))
    q, k, v, mask, kwargs, want = _interface_case(name, torch.float32)
    with kernel_policy(devices=("cuda", "cpu")):
        _, top = _call_with_probe(q, k, v, mask, kwargs, softcap)
    assert calls and all(c.endswith("_with_max_logits") for c in calls)
    _close(top, want, torch.float32)


def _spy_entry_points(monkeypatch) -> list:
    """The names of the kernels' entry points called, in order."""
    import hf_qknorm.kernels.attn_interface as api

    calls = []
    for name in (
        "qknorm_attn_func",
        "qknorm_attn_func_with_max_logits",
        "qknorm_attn_varlen_func",
        "qknorm_attn_varlen_func_with_max_logits",
        "qknorm_attn_with_kvcache",
    ):
        original = getattr(api, name)
        monkeypatch.setattr(api, name, lambda *a, _name=name, _f=original, **kw: calls.append(_name) or _f(*a, **kw))
    return calls


# ---------------------------------------------------------------------------------------------------------------------
# whole models: QK-Clip's record against a capturing backend that materialises the float64 logits
# ---------------------------------------------------------------------------------------------------------------------
CAPTURE = "telemetry_test_capture"
SEEN: dict = {}


def _capture(module, q, k, v, mask, scaling=None, dropout=0.0, softcap=None, **kwargs):
    """Plain attention (Transformers' sdpa mask, packing read from restarting position_ids) that records each
    layer's per-head max of the materialised pre-cap logits, and attends as the patched model does."""
    from hf_qknorm.reference import attention_reference

    scaling = q.shape[-1] ** -0.5 if scaling is None else scaling
    softcap = softcap if softcap is not None else getattr(module, "_qknorm_softcap", None)
    tq, tk = q.shape[2], k.shape[2]
    if mask is None:
        allowed = torch.ones(tq, tk, dtype=torch.bool).tril() if tq > 1 else torch.ones(1, tk, dtype=torch.bool)
        allowed = allowed[None, None]
    else:
        allowed = mask if mask.dtype == torch.bool else mask > torch.finfo(mask.dtype).min / 2
    pos = kwargs.get("position_ids")
    if pos is not None and tq == tk and bool((pos[:, 1:] != pos[:, :-1] + 1).any()):
        seq = torch.cat([torch.zeros_like(pos[:, :1]), (pos[:, 1:] != pos[:, :-1] + 1).long()], 1).cumsum(1)
        allowed = allowed & (seq[:, None, :, None] == seq[:, None, None, :])
    layer = module.layer_idx
    per_head = _brute(q, k, allowed, scaling)
    SEEN[layer] = torch.maximum(SEEN[layer], per_head) if layer in SEEN else per_head
    out = attention_reference(q, k, v, scaling=scaling, softcap=softcap, causal=False, mask=allowed)
    return out.transpose(1, 2).to(q.dtype), None


@pytest.fixture
def capture_backend():
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    from hf_qknorm.portable import hooks

    AttentionInterface.register(CAPTURE, _capture)
    AttentionMaskInterface.register(CAPTURE, sdpa_mask)
    saved = hooks.CAP_READING_BACKENDS
    hooks.CAP_READING_BACKENDS = saved + (CAPTURE,)
    SEEN.clear()
    yield
    hooks.CAP_READING_BACKENDS = saved


def _truth(model, batches):
    """Per layer, the per-head max logits of ``batches`` (forward kwargs), measured by the capturing backend."""
    backend, training = model.config._attn_implementation, model.training
    model.set_attn_implementation(CAPTURE)
    model.eval()  # QK-Clip records training forwards only
    SEEN.clear()
    with torch.no_grad():
        for batch in batches:
            model(**batch)
    model.set_attn_implementation(backend)
    model.train(training)
    return [SEEN[i].clone() for i in sorted(SEEN)]


def _batch(kind, seed=0, batch=2, seq=20):
    from tests._support.tiny_models import VOCAB

    ids = torch.randint(1, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))
    out = {"input_ids": ids, "use_cache": False}
    if kind == "padding":
        mask = torch.ones_like(ids)
        mask[0, : 4 + seed] = 0
        mask[1, -3:] = 0
        out["attention_mask"] = mask
    elif kind == "packed":
        out["position_ids"] = torch.cat([torch.arange(7), torch.arange(seq - 7)])[None].expand(batch, seq)
    return out


def _model(family, scheme, backend, dtype=torch.float64, **overrides):
    import hf_qknorm
    from tests._support.tiny_models import tiny_model

    model = tiny_model(family, dtype=dtype, **overrides)
    if scheme is not None:
        hf_qknorm.patch_model(model, scheme, softcap=3.0 if "cap" in scheme else None)
    model.set_attn_implementation(backend)
    with torch.no_grad():  # logits well past the cap, so a capped path that confused pre- and post-cap would show
        for name, prm in model.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight", "c_attn.weight", "_norm.weight")):
                prm.mul_(4.0)
    return model.train()


MODEL_CASES = [  # family, scheme, backend, batch kind
    ("llama", None, "sdpa", "padding"),  # projection hooks on another backend
    ("mistral", None, "sdpa", "causal"),  # hooks, sliding window 12 < 20 tokens
    ("gpt2", None, "eager", "padding"),  # hooks, fused c_attn
    ("llama", None, "qknorm", "padding"),  # uncapped "qknorm": the tiled path runs to produce them
    ("llama", "qk_norm_cap", "qknorm", "padding"),  # capped tiled path
    ("llama", "qk_norm_cap", "qknorm", "packed"),  # packing recognised from restarting position_ids
    ("mistral", "soft_cap", "qknorm", "padding"),  # sliding window in the mask
    ("qwen2", "qk_norm", "qknorm", "causal"),
]


@pytest.mark.parametrize("family,scheme,backend,kind", MODEL_CASES)
def test_qk_clip_record_matches_brute_force(family, scheme, backend, kind, capture_backend, monkeypatch):
    """Over two gradient-accumulation micro-batches: the running max of both."""
    import hf_qknorm
    import hf_qknorm.modeling.telemetry as telemetry

    model = _model(family, scheme, backend)
    batches = [_batch(kind, 0), _batch(kind, 1)]
    truth = _truth(model, batches)
    if backend == "qknorm":  # the backend's own pass: no recomputation on the side
        monkeypatch.setattr(telemetry, "head_max_logits", lambda *a, **kw: pytest.fail("an extra pass"))
    clip = hf_qknorm.QKClip(model, tau=1e9)
    for batch in batches:
        model(**batch, labels=batch["input_ids"]).loss.backward()
    assert len(clip.maxima) == len(truth)
    for recorded, expected in zip(clip.maxima, truth):
        torch.testing.assert_close(recorded.double(), expected, rtol=1e-10, atol=1e-10)
    clip.close()


@pytest.mark.parametrize("backend,scheme", [("qknorm", "qk_norm_cap"), ("qknorm", None), ("sdpa", None)])
def test_checkpoint_recomputation_and_eval_forwards(backend, scheme, capture_backend):
    """Activation checkpointing re-runs each layer's forward in backward: recorded again, the max unchanged. Eval
    forwards are not recorded, and on "qknorm" the probe asks for nothing then."""
    import hf_qknorm

    model = _model("llama", scheme, backend)
    batch = _batch("padding", 2)
    truth = _truth(model, [batch])
    clip = hf_qknorm.QKClip(model, tau=1e9)
    calls = []
    record = clip._record
    clip._tap.consumer = lambda i, *args: (calls.append(i), record(i, *args))
    upstream.enable_checkpointing(model, use_reentrant=False)
    model(**batch, labels=batch["input_ids"]).loss.backward()
    assert sorted(calls) == [0, 0, 1, 1]
    for recorded, expected in zip(clip.maxima, truth):
        torch.testing.assert_close(recorded.double(), expected, rtol=1e-10, atol=1e-10)
    model.eval()
    with torch.no_grad():
        model(**_batch("padding", 3))
    assert len(calls) == 4
    for recorded, expected in zip(clip.maxima, truth):
        torch.testing.assert_close(recorded.double(), expected, rtol=1e-10, atol=1e-10)


def test_qk_clip_record_through_the_triton_kernels(capture_backend, monkeypatch, kernels_on_cpu):
    import hf_qknorm

    model = _model("llama", "qk_norm_cap", "qknorm", dtype=torch.float32)
    batches = [_batch("padding", 0, seq=40), _batch("causal", 1, seq=40)]
    truth = _truth(model, batches)
    calls = _spy_entry_points(monkeypatch)
    clip = hf_qknorm.QKClip(model, tau=1e9)
    with kernel_policy(devices=("cuda", "cpu")):
        for batch in batches:
            model(**batch, labels=batch["input_ids"]).loss.backward()
    assert calls == ["qknorm_attn_func_with_max_logits"] * 4
    for recorded, expected in zip(clip.maxima, truth):
        torch.testing.assert_close(recorded.double(), expected, rtol=2e-6, atol=2e-6)


def test_qk_clip_record_under_compile(capture_backend):
    """``torch.compile(fullgraph=True)``: the probe and its per-head maxima are traced in."""
    import hf_qknorm

    model = _model("llama", "qk_norm_cap", "qknorm")
    batch = _batch("padding", 4)
    truth = _truth(model, [batch])
    clip = hf_qknorm.QKClip(model, tau=1e9)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    compiled(**batch, labels=batch["input_ids"]).loss.backward()
    for recorded, expected in zip(clip.maxima, truth):
        torch.testing.assert_close(recorded.double(), expected, rtol=1e-10, atol=1e-10)
