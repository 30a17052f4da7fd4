"""The decoding forward of the Llama-shaped families' patched attention classes (hf_qknorm/attention/fast.py).

Each check compares a patched model run through the fast forward with the same model whose attention modules run
the upstream forward (and the capped class's backend check), and asks for the same logits to the bit: every scheme,
cache kind and padding, the windowed variants, and everything that must keep a projection's module call (hooks of
every kind, an instance ``forward``, a replaced ``nn.Linear.forward``, peft's LoRA layers)."""

from __future__ import annotations

import contextlib
import copy
import pickle
import types

import pytest
import torch
from torch import nn

import hf_qknorm
from hf_qknorm.attention import fast
from hf_qknorm.portable import hooks
from hf_qknorm.verification.tiny import tiny_model

SCHEMES = ("qk_norm", "soft_cap", "qk_norm_cap", "qkv_norm")


def _attention_modules(model):
    return [m for m in model.modules() if hooks.is_installed(m)]


def _upstream(attn):
    """The forward ``attn`` ran before this module existed: the capped class's check, then the upstream forward."""
    base = attn.__dict__["_qknorm_base_class"]

    def forward(self, *args, **kwargs):
        if self.__dict__.get("_qknorm_softcap") is not None:
            hooks.check_cap_backend(hooks._attn_implementation(self.config))
        return base.forward(self, *args, **kwargs)

    return types.MethodType(forward, attn)


@contextlib.contextmanager
def upstream_forward(model):
    modules = _attention_modules(model)
    for attn in modules:
        attn.forward = _upstream(attn)
    try:
        yield
    finally:
        for attn in modules:
            del attn.forward


def _generate(model, ids, mask=None, cache="dynamic", new=6):
    options = dict(max_new_tokens=new, do_sample=False, output_logits=True, return_dict_in_generate=True)
    options["pad_token_id"] = 0
    if cache != "dynamic":
        options["cache_implementation"] = cache
    with torch.no_grad():
        return model.generate(ids, attention_mask=mask, **options).logits


def _same_as_upstream(model, ids, mask=None, cache="dynamic", new=6):
    fast_logits = _generate(model, ids, mask, cache, new)
    with upstream_forward(model):
        upstream_logits = _generate(model, ids, mask, cache, new)
    assert len(fast_logits) == len(upstream_logits) == new
    for step, (a, b) in enumerate(zip(fast_logits, upstream_logits)):
        assert torch.equal(a, b), f"decoding step {step}: the fast forward's logits differ from the upstream forward's"
    return fast_logits


def _ids(model, batch=2, length=9, seed=3):
    vocab = model.config.vocab_size
    return torch.randint(3, vocab, (batch, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("model_type", ["llama", "mistral", "qwen2", "mixtral", "gemma", "granite", "qwen2_moe"])
@pytest.mark.parametrize("scheme", SCHEMES)
def test_the_fast_forward_gives_the_upstream_forwards_logits(model_type, scheme):
    model = hf_qknorm.patch_model(tiny_model(model_type), scheme)
    attn = _attention_modules(model)[0]
    assert type(attn).forward is fast.fast_forward(attn.__dict__["_qknorm_base_class"]) is not None
    _same_as_upstream(model, _ids(model))


@pytest.mark.parametrize("norm", ["rmsnorm", "l2", "lp"])
def test_other_norms(norm):
    """Norms other than the layer norm are applied by the projection's own route (``_normed``), on the rows."""
    extra = {"p": 4.0} if norm == "lp" else {}
    model = hf_qknorm.patch_model(tiny_model("llama"), "qk_norm_cap", norm=norm, **extra)
    _same_as_upstream(model, _ids(model))


@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("scheme", ["qk_norm", "qk_norm_cap"])
def test_every_cache_kind_and_padding(cache, scheme):
    model = hf_qknorm.patch_model(tiny_model("llama"), scheme)
    ids = _ids(model, batch=3)
    mask = torch.ones_like(ids)
    mask[0, :4] = 0  # left padding: the backend gets a mask, not the one-query route
    _same_as_upstream(model, ids, mask, cache=cache)
    _same_as_upstream(model, ids, cache=cache)


def test_the_window_reaches_the_backend():
    """Mistral passes ``sliding_window``: decoding past a 4-token window differs from decoding without one, and the
    fast forward gives the upstream forward's logits."""
    model = hf_qknorm.patch_model(tiny_model("mistral"), "qk_norm_cap")
    model.config.sliding_window = 4
    ids = _ids(model, batch=1, length=12)
    windowed = _same_as_upstream(model, ids, new=4)
    model.config.sliding_window = None
    unwindowed = _same_as_upstream(model, ids, new=4)
    assert not torch.equal(windowed[-1], unwindowed[-1])
    # called without a mask, the window reaches the backend as the argument alone
    model.config.sliding_window = 4
    attn = _attention_modules(model)[0]
    hidden = torch.randn(1, 7, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    cos, sin = model.model.rotary_emb(hidden, torch.arange(7)[None])
    with torch.no_grad():
        got, want = (forward(hidden, (cos, sin), None, None)[0] for forward in (attn.forward, _upstream(attn)))
        model.config.sliding_window = None
        without = attn.forward(hidden, (cos, sin), None, None)[0]
    assert torch.equal(got, want) and not torch.equal(got, without)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64])
def test_other_dtypes(dtype):
    model = hf_qknorm.patch_model(tiny_model("qwen2", dtype=dtype), "qk_norm_cap")
    _same_as_upstream(model, _ids(model))


def _hook_kinds():
    def double_output(module, args, output):
        return output * 2

    def shift_input(module, args):
        return (args[0] + 0.5,)

    yield "forward hook on q_proj", lambda m: m.model.layers[0].self_attn.q_proj.register_forward_hook(double_output)
    yield "pre-hook on o_proj", lambda m: m.model.layers[1].self_attn.o_proj.register_forward_pre_hook(shift_input)
    yield "forward hook on v_proj", lambda m: m.model.layers[0].self_attn.v_proj.register_forward_hook(double_output)
    yield (
        "process-wide forward hook",
        lambda m: nn.modules.module.register_module_forward_hook(
            lambda module, args, output: output * 2 if module is m.model.layers[0].self_attn.k_proj else None
        ),
    )
    yield "a forward hook on a norm", lambda m: m.model.layers[0].self_attn.q_norm.register_forward_hook(double_output)


@pytest.mark.parametrize("kind", [name for name, _ in _hook_kinds()])
def test_hooks_on_the_projections_are_honoured(kind):
    model = hf_qknorm.patch_model(tiny_model("llama"), "qk_norm_cap")
    ids = _ids(model)
    plain = _generate(model, ids)
    handle = dict(_hook_kinds())[kind](model)
    try:
        hooked = _same_as_upstream(model, ids)
    finally:
        handle.remove()
    assert not all(torch.equal(a, b) for a, b in zip(plain, hooked)), f"the {kind} changed nothing"


def test_an_instance_forward_and_a_replaced_linear_forward_are_honoured(monkeypatch):
    model = hf_qknorm.patch_model(tiny_model("llama"), "qk_norm")
    ids = _ids(model)
    plain = _generate(model, ids)
    k_proj = model.model.layers[0].self_attn.k_proj
    k_proj.forward = lambda x, own=k_proj.forward: own(x) * 3  # what accelerate's hooks do: a forward on the instance
    instance = _same_as_upstream(model, ids)
    del k_proj.forward
    original = nn.Linear.forward
    monkeypatch.setattr(nn.Linear, "forward", lambda self, x: original(self, x) + 0.25)
    replaced = _same_as_upstream(model, ids)
    for changed in (instance, replaced):
        assert not torch.equal(plain[0], changed[0])


def test_peft_lora_layers_are_called_as_modules():
    peft = pytest.importorskip("peft")
    model = hf_qknorm.patch_model(tiny_model("llama"), "qk_norm_cap")
    config = peft.LoraConfig(r=4, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"], init_lora_weights=False)
    model = peft.get_peft_model(model, config).eval()
    _same_as_upstream(model, _ids(model))


def test_rope_replaced_in_the_familys_module_is_honoured(monkeypatch):
    """A library that swaps ``apply_rotary_pos_emb`` in the family's module after patching (as kernel libraries do)
    is called by the fast forward, as by the upstream one."""
    from transformers.models.llama import modeling_llama

    model = hf_qknorm.patch_model(tiny_model("llama"), "qk_norm")
    ids = _ids(model)
    plain = _generate(model, ids)
    original = modeling_llama.apply_rotary_pos_emb
    calls = []

    def rope(q, k, cos, sin, *args, **kwargs):
        calls.append(1)
        q, k = original(q, k, cos, sin, *args, **kwargs)
        return q * 1.5, k

    monkeypatch.setattr(modeling_llama, "apply_rotary_pos_emb", rope)
    replaced = _same_as_upstream(model, ids)
    assert calls and not torch.equal(plain[0], replaced[0])


def test_with_a_gradient_or_compiling_the_upstream_forward_runs(monkeypatch):
    model = hf_qknorm.patch_model(tiny_model("llama"), "qk_norm_cap")
    ids = _ids(model)
    used = []
    monkeypatch.setattr(fast, "_project", lambda *a: used.append(1) or pytest.fail("the fast forward ran"))
    model(ids).logits.sum().backward()  # a training forward: the upstream forward, with the gradient
    assert model.model.layers[0].self_attn.q_norm.weight.grad is not None
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    with torch.no_grad():
        model(ids)
    assert not used


def test_a_capped_module_still_refuses_a_backend_that_drops_its_cap():
    model = hf_qknorm.patch_model(tiny_model("llama"), "qk_norm_cap")
    model.config._attn_implementation = "sdpa"  # behind the patch's back
    with torch.no_grad(), pytest.raises(ValueError, match="cannot apply the softcap"):
        model(_ids(model))
    with pytest.raises(ValueError, match="cannot apply the softcap"):
        model(_ids(model))


def test_uncapped_modules_follow_the_backend_they_are_given():
    """``qk_norm`` on sdpa or eager: the fast forward asks the registry for the implementation set, as upstream."""
    model = hf_qknorm.patch_model(tiny_model("llama"), "qk_norm")
    for implementation in ("sdpa", "eager"):
        model.set_attn_implementation(implementation)
        _same_as_upstream(model, _ids(model))


def test_a_sliding_window_passed_twice_is_upstreams_error():
    model = hf_qknorm.patch_model(tiny_model("mistral"), "qk_norm")
    attn = _attention_modules(model)[0]
    hidden = torch.randn(1, 3, model.config.hidden_size)
    cos, sin = model.model.rotary_emb(hidden, torch.arange(3)[None])
    from transformers import DynamicCache

    lengths = []
    with torch.no_grad():
        for forward in (attn.forward, _upstream(attn)):
            cache = DynamicCache(config=model.config)
            with pytest.raises(TypeError, match="sliding_window"):
                forward(hidden, (cos, sin), None, cache, sliding_window=2)
            lengths.append(cache.get_seq_length(attn.layer_idx))
    assert lengths[0] == lengths[1] == 3  # the cache updated once, as upstream does before its error


def test_only_a_transcribed_forward_gets_the_fast_one():
    from transformers.models.llama.modeling_llama import LlamaAttention
    from transformers.models.mistral.modeling_mistral import MistralAttention
    from transformers.models.qwen3.modeling_qwen3 import Qwen3Attention

    assert fast._window(LlamaAttention) is False and callable(fast._window(MistralAttention))
    assert fast._window(Qwen3Attention) is None  # its own q/k norms: another text

    class Changed(LlamaAttention):
        def forward(self, hidden_states, position_embeddings=None, attention_mask=None, past_key_values=None, **kw):
            input_shape = hidden_states.shape[:-1]
            return self.o_proj(hidden_states.new_zeros(*input_shape, self.o_proj.in_features)), None

    class Wrapped(LlamaAttention):
        forward = staticmethod(lambda *a, **k: None)

    class Inherited(LlamaAttention):  # no forward of its own: its parent's is not read through it
        pass

    for cls in (Changed, Wrapped, Inherited):
        assert fast.fast_forward(cls) is None, cls


def test_copies_and_pickles_keep_the_fast_forward():
    model = hf_qknorm.patch_model(tiny_model("llama"), "qk_norm_cap")
    ids = _ids(model)
    want = _generate(model, ids)
    for clone in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        assert type(_attention_modules(clone)[0]).forward is type(_attention_modules(model)[0]).forward
        assert all(torch.equal(a, b) for a, b in zip(_generate(clone, ids), want))


# --- the rotary embedding of one position in place (native.rotary_in_place) ---


def _counting_rotary(monkeypatch):
    """Counts the fast forward's in-place rotations that were taken."""
    taken = []
    original = fast.rotary_in_place

    def rotary(*args):
        done = original(*args)
        taken.append(done)
        return done

    monkeypatch.setattr(fast, "rotary_in_place", rotary)
    return taken


@pytest.mark.parametrize("scheme", SCHEMES)
def test_decoding_rotates_in_place_with_upstreams_logits(monkeypatch, scheme):
    """Every decoding step of every layer rotates its fresh query and key in place (prefill, several positions, does
    not), and the logits are the upstream forward's to the bit -- with padding too (cos / sin a row per batch
    entry)."""
    from hf_qknorm.attention import native

    if native.NATIVE[0] is None:
        pytest.skip("the native op is off or not built")
    model = hf_qknorm.patch_model(tiny_model("llama"), scheme)
    taken = _counting_rotary(monkeypatch)
    ids = _ids(model, batch=3)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    _same_as_upstream(model, ids, mask, new=5)
    layers = model.config.num_hidden_layers
    assert taken.count(True) == 4 * layers and taken.count(False) == layers  # 4 decoding steps; the prefill declined


@pytest.mark.parametrize(
    "model_type,llamas", [("llama", True), ("mistral", True), ("qwen2", True), ("gemma", True), ("cohere", False)]
)
def test_only_llamas_rotary_function_is_rotated_in_place(model_type, llamas):
    """The in-place rotation stands for Llama's ``apply_rotary_pos_emb`` and ``rotate_half`` (the same code in a
    family's own module counts); Cohere's, which rotates interleaved pairs, does not."""
    import importlib

    family = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
    assert fast._llama_rope(family.apply_rotary_pos_emb) is llamas


def test_a_changed_wrapped_or_marked_rotary_function_is_not_llamas():
    import functools

    from transformers.models.llama import modeling_llama

    original = modeling_llama.apply_rotary_pos_emb

    @functools.wraps(original)
    def wrapped(*args, **kwargs):
        return original(*args, **kwargs)

    def changed(q, k, cos, sin, unsqueeze_dim=1):
        cos = cos.unsqueeze(unsqueeze_dim)
        sin = sin.unsqueeze(unsqueeze_dim)
        q_embed = (q * cos) - (modeling_llama.rotate_half(q) * sin)
        k_embed = (k * cos) + (modeling_llama.rotate_half(k) * sin)
        return q_embed, k_embed

    def marked(q, k, cos, sin, unsqueeze_dim=1):
        cos = cos.unsqueeze(unsqueeze_dim)
        sin = sin.unsqueeze(unsqueeze_dim)
        q_embed = (q * cos) + (rotate_half(q) * sin)  # noqa: F821 - never called
        k_embed = (k * cos) + (rotate_half(k) * sin)  # noqa: F821
        return q_embed, k_embed

    marked.kernel_layer_name = "rotary_pos_emb"
    assert fast._llama_rope(original)
    for function in (wrapped, changed, marked, lambda q, k, cos, sin: (q, k)):
        assert not fast._llama_rope(function), function


def test_rotate_half_replaced_in_the_familys_module_is_honoured(monkeypatch):
    from transformers.models.llama import modeling_llama

    model = hf_qknorm.patch_model(tiny_model("llama"), "qk_norm")
    ids = _ids(model)
    plain = _generate(model, ids)
    original = modeling_llama.rotate_half
    monkeypatch.setattr(modeling_llama, "rotate_half", lambda x: original(x) * 0.5)
    replaced = _same_as_upstream(model, ids)
    assert not torch.equal(plain[-1], replaced[-1])


@pytest.mark.parametrize("where", ["q_proj", "q_norm", "k_proj", "k_norm"])
def test_a_hook_that_keeps_an_output_finds_it_unchanged(where):
    """A hook on a projection or on its norm that keeps the tensor it saw (a monitor, an activation cache) still holds
    those values after the forward: only tensors no module call has handed out are rotated in place."""
    model = hf_qknorm.patch_model(tiny_model("llama"), "qk_norm")
    kept = []
    module = getattr(model.model.layers[1].self_attn, where)
    handle = module.register_forward_hook(lambda m, args, output: kept.append((output, output.clone())))
    try:
        _same_as_upstream(model, _ids(model), new=3)
    finally:
        handle.remove()
    assert len(kept) == 6
    for output, seen in kept:
        assert torch.equal(output, seen)
