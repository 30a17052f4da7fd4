"""What patch_model promises beyond the arithmetic: it never changes the caller's config, a refused patch leaves the
model exactly as it was, every head class of a family patches, saves and loads back, the base model keeps its
hidden-state and attention outputs, and the patch survives wrappers (peft replacing a projection, DDP, compile)."""

from __future__ import annotations

import logging

import pytest
import torch

import hf_qknorm
from hf_qknorm import QKNormConfig
from hf_qknorm.portable.norms import HeadRMSNorm
from hf_qknorm.reference import norm_reference
from tests._support.tiny_models import FAMILY_NAMES, VOCAB, tiny_config, tiny_model


def _ids(seed=0, batch=2, seq=11):
    return torch.randint(1, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))


def _state(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


# --------------------------------------------------------------------------------------------------------------------
# the caller's config
# --------------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_patching_never_changes_the_callers_config(family, tmp_path):
    from transformers import AutoModelForCausalLM

    config = tiny_config(family)
    before = config.to_dict()
    first = AutoModelForCausalLM.from_config(config)
    hf_qknorm.patch_model(first, "qk_norm_cap")
    assert config.to_dict() == before and type(config).__name__ == type(config).__name__.removeprefix("QKNorm")
    assert first.config is not config and all(
        m.config is first.config for m in first.modules() if "config" in m.__dict__
    )
    second = AutoModelForCausalLM.from_config(config)  # the same config object, built again
    assert not hf_qknorm.is_patched(second)
    second.save_pretrained(tmp_path)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert not hf_qknorm.is_patched(reloaded) and reloaded.config.model_type == family
    hf_qknorm.patch_model(second, "qk_norm")  # and it can still be patched


# --------------------------------------------------------------------------------------------------------------------
# refusals leave no trace
# --------------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("impl", ["paged|eager", "flash_attention_2", "flex_attention"])
def test_refused_patch_leaves_the_model_untouched(impl):
    model = tiny_model("llama")
    model.config._attn_implementation = impl  # as if loaded with it (flash-attn is not installed here)
    state, cls, modules = _state(model), type(model.model.layers[0].self_attn), dict(model.named_modules())
    with pytest.raises(ValueError, match=f"{impl!r} would drop the softcap"):
        hf_qknorm.patch_model(model, "qk_norm_cap")
    assert not hf_qknorm.is_patched(model) and model.config._attn_implementation == impl
    assert type(model.model.layers[0].self_attn) is cls and dict(model.named_modules()).keys() == modules.keys()
    assert all(not m._forward_hooks for m in model.modules())
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
    model.config._attn_implementation = "sdpa"
    hf_qknorm.patch_model(model, "qk_norm_cap")  # a valid backend: the patch goes through once
    assert hf_qknorm.is_patched(model) and model.config._attn_implementation == "qknorm"


def test_refused_qkv_norm_fold_leaves_the_model_untouched():
    model = tiny_model("gpt2")
    model.transformer.h[1].attn.c_attn.bias = None  # the pre-norm's bias cannot be folded into this block
    state = _state(model)
    with pytest.raises(ValueError, match=r"cannot fold the bias of \.ln_1 \(block 1\) into \.c_attn"):
        hf_qknorm.patch_model(model, "qkv_norm")
    assert not hf_qknorm.is_patched(model) and not isinstance(model.transformer.h[0].ln_1, torch.nn.Identity)
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())


def test_cross_attention_gpt2_is_refused_up_front():
    model = tiny_model("gpt2", add_cross_attention=True)
    with pytest.raises(ValueError, match="cross-attention"):
        hf_qknorm.patch_model(model, "qk_norm")
    assert not hf_qknorm.is_patched(model)


# --------------------------------------------------------------------------------------------------------------------
# every head class, and the base model's outputs
# --------------------------------------------------------------------------------------------------------------------
def _head_classes(family):
    from transformers.models.auto import modeling_auto
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    from hf_qknorm.portable.autoclasses import AUTO_HEADS

    base = CONFIG_MAPPING[family]
    return [(auto, getattr(modeling_auto, m)[base]) for auto, m in AUTO_HEADS if base in getattr(modeling_auto, m)]


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_every_head_class_round_trips(family, tmp_path):
    import transformers

    heads = _head_classes(family)
    assert len(heads) == 5, heads  # base, causal LM, sequence / token classification, question answering
    ids = _ids()
    for auto, cls in heads:
        torch.manual_seed(0)
        config = tiny_config(family, num_labels=3, pad_token_id=0)
        model = cls(config).eval()
        hf_qknorm.patch_model(model, "qk_norm_cap", softcap=2.0)
        with torch.no_grad():
            for name, prm in model.named_parameters():
                if "_norm." in name:
                    prm.add_(0.3 * torch.randn_like(prm))
            expected = model(ids)
        folder = tmp_path / f"{family}-{cls.__name__}"
        model.save_pretrained(folder)
        loaded = getattr(transformers, auto).from_pretrained(folder).eval()
        assert type(loaded).__name__ == f"QKNorm{cls.__name__}" and hf_qknorm.is_patched(loaded)
        with torch.no_grad():
            got = loaded(ids)
        for key in expected.keys():
            if torch.is_tensor(expected[key]):
                torch.testing.assert_close(got[key], expected[key], rtol=1e-5, atol=1e-5, msg=f"{cls.__name__} {key}")


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_base_model_keeps_hidden_states_and_attention_outputs(family):
    from transformers.models.auto import modeling_auto
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    torch.manual_seed(0)
    config = tiny_config(family)
    model = modeling_auto.MODEL_MAPPING[CONFIG_MAPPING[family]](config).eval()
    hf_qknorm.patch_model(model, "qk_norm")
    model.set_attn_implementation("eager")  # an uncapped scheme may return weights through eager attention
    out = model(_ids(), output_hidden_states=True, output_attentions=True)
    assert out.hidden_states is not None and len(out.hidden_states) == config.num_hidden_layers + 1
    assert out.attentions is not None and len(out.attentions) == config.num_hidden_layers


# --------------------------------------------------------------------------------------------------------------------
# API
# --------------------------------------------------------------------------------------------------------------------
def test_config_object_in_keyword_arguments_out():
    cfg = hf_qknorm.QKNormConfig("qk_norm_cap", norm="rmsnorm", softcap=30.0)
    a, b = tiny_model("llama"), tiny_model("llama")
    hf_qknorm.patch_model(a, cfg)
    hf_qknorm.patch_model(b, "qk_norm_cap", norm="rmsnorm", softcap=30.0)
    assert hf_qknorm.qknorm_config(a) == hf_qknorm.qknorm_config(b)
    torch.testing.assert_close(a(_ids()).logits, b(_ids()).logits)
    with pytest.raises(ValueError, match=r"got a QKNormConfig and also \['softcap'\]"):
        hf_qknorm.patch_model(tiny_model("llama"), cfg, softcap=10.0)


def test_rmsnorm_eps_is_settable():
    norm = HeadRMSNorm(8, eps=1e-6)
    norm.eps = 1e-2  # Transformers' common tests (and users) set it
    x = 1e-2 * torch.randn(3, 8, dtype=torch.float64)
    norm = norm.double()
    torch.testing.assert_close(norm(x), norm_reference(x, "rmsnorm", norm.weight, eps=1e-2))


def test_lp_norm_with_a_large_exponent_stays_finite_and_exact():
    """||x||_p overflows float32 for large p (|x|^64 > 3.4e38 once |x| > 4): the norm rescales by max|x| first."""
    from hf_qknorm.portable.norms import HeadLpNorm

    norm = HeadLpNorm(16, p=64.0, eps=1e-6, scale="channel")
    x = (20 * torch.randn(2, 5, 4, 16, generator=torch.Generator().manual_seed(0))).requires_grad_(True)
    y = norm(x)
    y.sum().backward()
    assert torch.isfinite(y).all() and torch.isfinite(x.grad).all()
    x64 = x.detach().double().requires_grad_(True)
    ref = norm_reference(x64, "lp", norm.weight.double(), p=64.0, eps=1e-6)  # float64 does not overflow here
    torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-6)
    ref.sum().backward()
    torch.testing.assert_close(x.grad.double(), x64.grad, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("norm", ["l2", "lp"])
def test_half_precision_models_keep_their_dtype_through_every_norm(norm, dtype):
    """Each norm returns its input's dtype (it computes in float32): a bf16 lp model runs and trains."""
    model = tiny_model("llama", dtype=dtype)
    hf_qknorm.patch_model(model, "qk_norm_cap", norm=norm, p=3.0 if norm == "lp" else None)
    ids = _ids()
    out = model(ids, labels=ids)
    assert out.logits.dtype == dtype and torch.isfinite(out.loss)
    out.loss.backward()


# --------------------------------------------------------------------------------------------------------------------
# one rule for the qkv_norm fold: patch and conversion write the same bits
# --------------------------------------------------------------------------------------------------------------------
@pytest.mark.spawns
@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_qkv_norm_fold_patch_and_conversion_agree_in_bf16(family, tmp_path):
    from safetensors.torch import load_file

    from tests._support.convert_support import quiet, save_source

    source = save_source(tmp_path / "src", family, dtype=torch.bfloat16)
    with torch.no_grad():  # non-trivial pre-norm gains (and GPT-2 biases), saved again
        for name, prm in source.named_parameters():
            if "input_layernorm" in name or "ln_1" in name:
                prm.copy_(1 + 0.3 * torch.randn_like(prm) if name.endswith("weight") else 0.3 * torch.randn_like(prm))
    source.save_pretrained(tmp_path / "src")
    result = hf_qknorm.convert(
        tmp_path / "src",
        tmp_path / "out",
        config=QKNormConfig(scheme="qkv_norm", norm="rmsnorm"),
        calibrate=False,
        progress=False,
        log=quiet,
    )
    converted = load_file(result.path / "model.safetensors")
    hf_qknorm.patch_model(source, "qkv_norm", norm="rmsnorm")
    patched = source.state_dict()
    prefix = "transformer." if family == "gpt2" else ""
    folded = [k for k in patched if any(p in k for p in ("q_proj", "k_proj", "v_proj", "c_attn"))]
    assert folded
    for key in folded:
        assert torch.equal(converted[key[len(prefix) :] if key[len(prefix) :] in converted else key], patched[key]), key


# --------------------------------------------------------------------------------------------------------------------
# wrappers
# --------------------------------------------------------------------------------------------------------------------
def test_peft_replacing_a_projection_moves_the_norm():
    """get_peft_model after patching: the norm must see base(x) + LoRA delta, and merge_and_unload moves it back."""
    from peft import LoraConfig, get_peft_model

    model = tiny_model("llama", dtype=torch.float64)
    hf_qknorm.patch_model(model, "qk_norm", norm="rmsnorm")
    peft_model = get_peft_model(model, LoraConfig(target_modules=["q_proj"], r=4, init_lora_weights=False))
    attn = peft_model.get_base_model().model.layers[0].self_attn
    seen = {}
    attn.q_norm.register_forward_hook(lambda m, args, out: seen.update(norm_in=args[0]))
    attn.q_proj.register_forward_pre_hook(lambda m, args: seen.update(x=args[0]))
    ids = _ids()
    expected = peft_model(ids).logits
    lora = attn.q_proj  # base(x) + B(A(x)) * scaling, from peft's own parts
    with torch.no_grad():
        delta = lora.lora_B["default"](lora.lora_A["default"](seen["x"])) * lora.scaling["default"]
        lora_out = lora.base_layer(seen["x"]) + delta
    torch.testing.assert_close(seen["norm_in"], lora_out.view_as(seen["norm_in"]))
    base = attn.q_proj.base_layer
    assert type(base) is torch.nn.Linear and not base._forward_hooks  # moved, not duplicated
    merged = peft_model.merge_and_unload()
    torch.testing.assert_close(merged(ids).logits, expected)
    q_proj = merged.model.layers[0].self_attn.q_proj
    assert isinstance(q_proj, torch.nn.Linear) and type(q_proj) is not torch.nn.Linear  # the norm applies again


def test_is_patched_and_patch_through_wrappers():
    model = tiny_model("llama")
    compiled = torch.compile(model, backend="eager")
    hf_qknorm.patch_model(compiled, "qk_norm")  # patches the model inside
    assert hf_qknorm.is_patched(model) and hf_qknorm.is_patched(compiled)
    ddp_like = torch.nn.DataParallel(model)
    assert hf_qknorm.is_patched(ddp_like) and hf_qknorm.qknorm_config(ddp_like).scheme == "qk_norm"
    with pytest.raises(TypeError, match="expected a Transformers model"):
        hf_qknorm.is_patched(torch.nn.Linear(2, 2))


def test_qwen3_gains_dropped_by_lp_are_announced(caplog):
    model = tiny_model("qwen3")
    with torch.no_grad():
        model.model.layers[0].self_attn.q_norm.weight.mul_(1.5)
    with caplog.at_level(logging.WARNING, logger="hf_qknorm"):
        hf_qknorm.patch_model(model, "qk_norm", norm="l2")
    assert any("per-channel q/k norm gains" in r.message for r in caplog.records)


# --------------------------------------------------------------------------------------------------------------------
# how a projection applies the norms (hf_qknorm/portable/hooks.py): its class, or a forward hook
# --------------------------------------------------------------------------------------------------------------------
def _patched_pair(family, scheme="qk_norm_cap"):
    """The same tiny model twice in float64: one patched as it is, one to be altered before or after patching."""
    model = tiny_model(family, dtype=torch.float64)
    other = tiny_model(family, dtype=torch.float64)
    other.load_state_dict(model.state_dict())
    return hf_qknorm.patch_model(model, scheme), other


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_projections_with_an_instance_forward_take_a_forward_hook(family):
    """accelerate's offload hooks replace ``forward`` on the instance and call the class's own forward themselves:
    a class swap would be bypassed (the norm silently lost), so such a projection gets a forward hook instead."""
    from accelerate.hooks import ModelHook, add_hook_to_module

    patched, other = _patched_pair(family)
    projections = [m for n, m in other.named_modules() if n.endswith(("q_proj", "k_proj", "v_proj", "c_attn"))]
    for module in projections:
        add_hook_to_module(module, ModelHook())
    hf_qknorm.patch_model(other, "qk_norm_cap")
    _, attns = hf_qknorm.portable.layout.attention_modules(other)
    sites = [site for attn in attns for site in attn.__dict__["_qknorm_handles"].values()]
    assert sites and all(handle is not None for _, handle in sites)
    ids = _ids()
    torch.testing.assert_close(other(ids).logits, patched(ids).logits, rtol=0, atol=0)
    bare = tiny_model(family, dtype=torch.float64)
    bare.load_state_dict(other.state_dict(), strict=False)
    assert not torch.allclose(bare(ids).logits, patched(ids).logits)  # the norms matter here


def test_hooks_added_after_patching_keep_the_norms():
    """accelerate hooks added to a patched model's projections (dispatch after patching) wrap the patched forward."""
    from accelerate.hooks import ModelHook, add_hook_to_module

    patched, other = _patched_pair("llama")
    hf_qknorm.patch_model(other, "qk_norm_cap")
    for name, module in other.named_modules():
        if name.endswith(("q_proj", "k_proj")):
            add_hook_to_module(module, ModelHook())
    ids = _ids()
    torch.testing.assert_close(other(ids).logits, patched(ids).logits, rtol=0, atol=0)


@pytest.mark.parametrize("scheme", ["qk_norm", "qk_norm_cap"])  # the attention class without and with the cap check
def test_copies_and_pickles_of_a_patched_model_compute_the_same(scheme):
    """A deep copy's projections apply the copy's norms (not the original's); a pickled model loads back whole."""
    import copy
    import pickle

    model, _ = _patched_pair("llama", scheme)
    ids = _ids()
    expected = model(ids).logits
    clone = copy.deepcopy(model)
    torch.testing.assert_close(clone(ids).logits, expected, rtol=0, atol=0)
    with torch.no_grad():
        for layer in clone.model.layers:
            layer.self_attn.q_norm.weight.mul_(3.0)
    assert not torch.allclose(clone(ids).logits, expected)
    torch.testing.assert_close(model(ids).logits, expected, rtol=0, atol=0)  # the original is untouched
    restored = pickle.loads(pickle.dumps(model))
    torch.testing.assert_close(restored(ids).logits, expected, rtol=0, atol=0)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("scheme", ["qk_norm", "qkv_norm", "soft_cap", "qk_norm_cap"])
def test_only_a_capped_modules_class_checks_the_backend_at_every_call(scheme, family):
    """A patched attention module's class relocates norms on reassignment. Only a capped module's class has a
    ``forward`` of its own (the check that the backend applies its cap) -- an uncapped one runs the upstream forward
    with no frame around it. Either class is undone by ``uninstall`` (a patch refused after installation)."""
    from hf_qknorm.portable import hooks

    model = hf_qknorm.patch_model(tiny_model(family), scheme)
    attn = model.model.layers[0].self_attn
    base = attn.__dict__["_qknorm_base_class"]
    capped = "cap" in scheme
    assert isinstance(attn, base) and type(attn).__setattr__ is hooks._setattr
    assert ("forward" in type(attn).__dict__) is capped
    assert type(attn).forward is (type(attn).__dict__["forward"] if capped else base.forward)
    assert type(attn).__name__ == ("QKNormCapped" if capped else "QKNorm") + base.__name__
    if capped:
        model.config._attn_implementation = "sdpa"  # as if set behind the patch's back
        for grad in (True, False):
            with torch.set_grad_enabled(grad), pytest.raises(ValueError, match="cannot apply the softcap"):
                model(_ids())
    hooks.uninstall(attn)
    assert type(attn) is base


def test_a_users_forward_hook_on_a_projection_sees_the_normalised_output():
    model, _ = _patched_pair("llama", "qk_norm")
    attn = model.model.layers[0].self_attn
    seen = {}
    attn.k_proj.register_forward_hook(lambda m, args, out: seen.update(out=out))
    attn.k_norm.register_forward_hook(lambda m, args, out: seen.update(normed=out))
    model(_ids())
    torch.testing.assert_close(seen["out"], seen["normed"].reshape(seen["out"].shape), rtol=0, atol=0)


# --------------------------------------------------------------------------------------------------------------------
# the norms at the projections: the flat-rows call
# --------------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("norm", ["layernorm", "rmsnorm", "l2", "lp"])
def test_the_norms_on_flat_rows_give_the_per_head_values_bit_for_bit(norm, dtype):
    """Decoding calls an unhooked norm of this package on the projection's output as ``(-1, head_dim)`` rows instead
    of the ``(batch, seq, heads, head_dim)`` view: every value must be the per-head call's, to the bit, contiguous or
    not (a strided output takes the per-head view)."""
    from hf_qknorm.portable import hooks

    config = QKNormConfig(scheme="qkv_norm", norm=norm, p=3.0 if norm == "lp" else None)
    model = hf_qknorm.patch_model(tiny_model("llama", dtype=dtype), config)
    attn = model.model.layers[0].self_attn
    head_dim = attn.__dict__["_qknorm_shape"][0]
    for slot, (role,) in attn.__dict__["_qknorm_slots"].items():
        projection, module = attn._modules[slot], attn._modules[attn.__dict__["_qknorm_norms"][role]]
        assert module.rowwise
        with torch.no_grad():
            for p in module.parameters():  # parameters away from their identity init
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(1)).abs() + 0.5)
        width = projection.out_features
        dense = torch.randn(3, 5, width, generator=torch.Generator().manual_seed(2), dtype=torch.float64).to(dtype) * 7
        strided = dense.transpose(0, 1).contiguous().transpose(0, 1)
        assert not strided.is_contiguous()
        for out in (dense, strided):
            expected = module(out.unflatten(-1, (-1, head_dim))).flatten(-2)
            got = hooks._normed(projection, out)
            assert got.shape == out.shape and got.dtype == expected.dtype
            torch.testing.assert_close(got, expected, rtol=0, atol=0)


@pytest.mark.parametrize("norm_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_layer_norm_on_flat_rows_is_the_norms_own_call_in_any_dtype_pair(monkeypatch, dtype, norm_dtype):
    """``HeadLayerNorm`` declares ``rowwise = "layer_norm"``: ``_normed`` makes its ``torch.layer_norm`` call itself.
    Whatever the projection's and the norm's dtypes (norms kept in float32 beside a bfloat16 model take the norm's
    own casting path), under CPU autocast, and under an autocast that runs ``layer_norm`` in float32 (CUDA's;
    simulated here by a ``torch.layer_norm`` that returns float32), the result must be the per-head call's to the
    bit, in the projection output's dtype, gradients included."""
    from hf_qknorm.portable import hooks

    model = hf_qknorm.patch_model(tiny_model("llama", dtype=dtype), "qk_norm")
    attn = model.model.layers[0].self_attn
    norm, head_dim = attn.k_norm.to(norm_dtype), attn.head_dim
    assert type(norm).rowwise == "layer_norm"
    with torch.no_grad():
        for p in norm.parameters():
            p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(1)).to(norm_dtype) + 1)
    out = torch.randn(2, 5, attn.k_proj.out_features, generator=torch.Generator().manual_seed(2)).to(dtype) * 5
    layer_norm = torch.layer_norm
    for autocast in (False, True, "float32"):
        if autocast == "float32":
            monkeypatch.setattr(torch, "layer_norm", lambda *args: layer_norm(*args).float())
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast is True):
            got_in, ref_in = out.clone().requires_grad_(), out.clone().requires_grad_()
            got = hooks._normed(attn.k_proj, got_in)
            expected = norm(ref_in.unflatten(-1, (-1, head_dim))).flatten(-2)
        assert got.dtype == expected.dtype == dtype, (got.dtype, expected.dtype)
        torch.testing.assert_close(got, expected, rtol=0, atol=0)
        grad = torch.randn(got.shape, generator=torch.Generator().manual_seed(3)).to(dtype)
        (got_grad,) = torch.autograd.grad(got, got_in, grad)
        (ref_grad,) = torch.autograd.grad(expected, ref_in, grad)
        torch.testing.assert_close(got_grad, ref_grad, rtol=0, atol=0)


def test_a_projection_output_of_no_whole_heads_is_refused_not_regrouped():
    """An output whose width is not a whole number of heads (a misconfigured or oddly sharded projection) must fail
    loudly, never be cut into ``head_dim`` rows across its batch and sequence positions."""
    from hf_qknorm.portable import hooks

    model = hf_qknorm.patch_model(tiny_model("llama"), "qk_norm")
    attn = model.model.layers[0].self_attn
    head_dim = attn.__dict__["_qknorm_shape"][0]
    odd = torch.randn(head_dim, 3, head_dim + 1)  # numel a multiple of head_dim, width not
    with pytest.raises(RuntimeError):
        hooks._normed(attn.q_proj, odd)


def test_a_hook_on_a_norm_sees_the_heads():
    """With a hook on a norm the norm is called through ``nn.Module`` on the per-head view, as documented: the hook
    sees ``(batch, seq, heads, head_dim)``, and what it returns is what the attention gets."""
    model, _ = _patched_pair("llama", "qk_norm")
    attn = model.model.layers[0].self_attn
    seen = {}
    attn.q_norm.register_forward_hook(lambda m, args, out: seen.update(shape=tuple(args[0].shape)))
    ids = _ids(batch=2, seq=7)
    expected = model(ids).logits
    assert seen["shape"] == (2, 7, model.config.num_attention_heads, attn.head_dim)
    attn.k_norm.register_forward_hook(lambda m, args, out: out * 2)  # a hook that changes the output
    assert not torch.allclose(model(ids).logits, expected)


@pytest.mark.parametrize(
    "kind",
    [
        "forward",
        "forward_pre",
        "full_backward",
        "full_backward_pre",
        "global_forward",
        "global_forward_pre",
        "global_full_backward",
        "global_full_backward_pre",
    ],
)
@pytest.mark.parametrize("norm", ["layernorm", "rmsnorm"])
def test_every_kind_of_hook_on_a_norm_is_called(kind, norm):
    """The flat-rows call skips ``nn.Module.__call__``: it must not while any hook could run -- on the norm or
    process-wide, forward or backward (the projection checks them inline, without ``_hooked``'s frame). The hook is
    called, on the per-head view, and the values are the flat call's."""
    from torch.nn.modules import module as torch_module

    from hf_qknorm.portable import hooks

    model = hf_qknorm.patch_model(tiny_model("llama"), QKNormConfig("qk_norm", norm=norm))
    attn = model.model.layers[0].self_attn
    out = torch.randn(2, 5, attn.q_proj.out_features, generator=torch.Generator().manual_seed(2))
    expected = hooks._normed(attn.q_proj, out)  # no hook: the flat call
    calls = []
    if kind.endswith("backward"):  # a backward hook gets (module, grad_input, grad_output)
        hook = lambda module, grad_in, grad_out: calls.append(grad_out[0].shape)  # noqa: E731
    elif kind.endswith("backward_pre"):
        hook = lambda module, grad_out: calls.append(grad_out[0].shape)  # noqa: E731
    elif kind.endswith("pre"):
        hook = lambda module, args: calls.append(args[0].shape)  # noqa: E731
    else:
        hook = lambda module, args, output: calls.append(args[0].shape)  # noqa: E731
    if kind.startswith("global_"):
        handle = getattr(torch_module, f"register_module_{kind.removeprefix('global_')}_hook")(hook)
    else:
        handle = getattr(attn.q_norm, f"register_{kind}_hook")(hook)
    try:
        source = out.clone().requires_grad_()
        got = hooks._normed(attn.q_proj, source)
        got.sum().backward()
    finally:
        handle.remove()
    heads = (2, 5, model.config.num_attention_heads, attn.head_dim)
    assert calls and all(tuple(shape) == heads for shape in calls[:1]), (kind, calls)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_a_subclass_of_a_norm_gets_the_heads():
    """``rowwise`` is read from the norm's own class, not inherited: a user's subclass that overrides ``forward`` (and
    may look at the heads) is called on the per-head view."""
    from hf_qknorm.portable.norms import HeadLayerNorm

    class PerHead(HeadLayerNorm):
        def forward(self, x):
            shapes.append(tuple(x.shape))
            return super().forward(x)

    shapes = []
    model, _ = _patched_pair("llama", "qk_norm")
    attn = model.model.layers[0].self_attn
    norm = PerHead(attn.head_dim, attn.q_norm.eps).to(torch.float64)
    norm.load_state_dict(attn.q_norm.state_dict())
    attn.q_norm = norm
    model(_ids(batch=2, seq=7))
    assert shapes == [(2, 7, model.config.num_attention_heads, attn.head_dim)]


@pytest.mark.parametrize("norm", ["layernorm", "rmsnorm", "l2"])
def test_a_forward_replaced_on_a_norm_instance_is_called_on_the_heads(norm):
    """accelerate's hooks replace ``forward`` on the instance (``add_hook_to_module``): like a subclass's, that
    ``forward`` is called, on the per-head view, and its output is what the attention gets -- the flat-rows call,
    and ``HeadLayerNorm``'s ``torch.layer_norm`` made without the norm's frame, must not skip it."""
    from accelerate.hooks import ModelHook, add_hook_to_module

    from hf_qknorm.portable import hooks

    class Doubled(ModelHook):
        def pre_forward(self, module, *args, **kwargs):
            shapes.append(tuple(args[0].shape))
            return args, kwargs

        def post_forward(self, module, output):
            return output * 2

    shapes = []
    model = hf_qknorm.patch_model(tiny_model("llama"), QKNormConfig("qk_norm", norm=norm))
    attn = model.model.layers[0].self_attn
    out = torch.randn(2, 5, attn.k_proj.out_features, generator=torch.Generator().manual_seed(2))
    plain = hooks._normed(attn.k_proj, out)
    add_hook_to_module(attn.k_norm, Doubled())
    got = hooks._normed(attn.k_proj, out)
    assert shapes == [(2, 5, model.config.num_key_value_heads, attn.head_dim)]
    torch.testing.assert_close(got, plain * 2, rtol=0, atol=0)


def test_flat_rows_or_not_the_model_computes_the_same(monkeypatch):
    """The whole model, float32 and bfloat16, training: the flat-rows call (the default) and the per-head call give
    the same logits and the same gradients to the bit."""
    from hf_qknorm.portable import norms

    def run(model, ids):
        model.zero_grad(set_to_none=True)
        out = model(ids, labels=ids)
        out.loss.backward()
        return out.logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    for dtype in (torch.float32, torch.bfloat16):
        model = hf_qknorm.patch_model(tiny_model("llama", dtype=dtype), "qk_norm_cap").train()
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "_norm" in name:
                    p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(3)).to(dtype) * 0.3)
        ids = _ids()
        flat, flat_grads = run(model, ids)
        monkeypatch.setattr(norms.HeadLayerNorm, "rowwise", False)
        per_head, per_head_grads = run(model, ids)
        monkeypatch.undo()
        torch.testing.assert_close(flat, per_head, rtol=0, atol=0)
        assert flat_grads.keys() == per_head_grads.keys() and any("q_norm" in n for n in flat_grads)
        for name, grad in flat_grads.items():
            torch.testing.assert_close(grad, per_head_grads[name], rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("family", ["llama", "qwen2"])  # no bias on q_proj / a bias on it
def test_a_linear_projection_computes_what_nn_linear_would(monkeypatch, family):
    """A normalised ``nn.Linear`` projection reads its parameters from ``_parameters`` (one frame, no
    ``__getattr__``): its output must be the norm of exactly what ``nn.Linear.forward`` gives -- with and without a
    bias, with a parametrization on the weight or on the bias (then the parameter is not in ``_parameters``), and
    with ``F.linear`` or ``nn.Linear.forward`` replaced process-wide (the replacement is honoured)."""
    from torch.nn.utils import parametrize

    model = hf_qknorm.patch_model(tiny_model(family, dtype=torch.float64), "qk_norm")
    attn = model.model.layers[0].self_attn
    projection, norm, head_dim = attn.q_proj, attn.q_norm, attn.head_dim
    assert (projection.bias is not None) == (family == "qwen2")
    with torch.no_grad():  # away from the identity init (and the zero bias init): a dropped term must show
        for p in [*norm.parameters(), *projection.parameters()]:
            p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(1), dtype=p.dtype) + 1)
    x = torch.randn(2, 3, projection.in_features, generator=torch.Generator().manual_seed(2), dtype=torch.float64)

    def expected(linear_out):
        return norm.forward(linear_out.unflatten(-1, (-1, head_dim))).flatten(-2)

    def linear(weight, bias):
        return x @ weight.T + (0 if bias is None else bias)

    weight, bias = projection.weight.detach().clone(), None if projection.bias is None else projection.bias.detach()
    torch.testing.assert_close(projection(x), expected(linear(weight, bias)), rtol=1e-14, atol=1e-14)

    class Doubled(torch.nn.Module):
        def forward(self, t):
            return 2 * t

    if bias is not None:
        parametrize.register_parametrization(projection, "bias", Doubled())
        torch.testing.assert_close(projection(x), expected(linear(weight, 2 * bias)), rtol=1e-14, atol=1e-14)
        parametrize.remove_parametrizations(projection, "bias", leave_parametrized=False)
    parametrize.register_parametrization(projection, "weight", Doubled())
    torch.testing.assert_close(projection(x), expected(linear(2 * weight, bias)), rtol=1e-14, atol=1e-14)
    parametrize.remove_parametrizations(projection, "weight", leave_parametrized=False)

    ramp = torch.linspace(0.0, 1.0, projection.out_features, dtype=torch.float64)  # not a shift the norm removes
    real_linear = torch.nn.functional.linear
    with monkeypatch.context() as m:  # a replaced F.linear, as nn.Linear.forward would call it
        m.setattr(torch.nn.functional, "linear", lambda i, w, b=None: real_linear(i, w, b) + ramp)
        torch.testing.assert_close(projection(x), expected(linear(weight, bias) + ramp), rtol=1e-14, atol=1e-14)
    real = torch.nn.Linear.forward
    monkeypatch.setattr(torch.nn.Linear, "forward", lambda self, input: real(self, input) + ramp)
    torch.testing.assert_close(projection(x), expected(linear(weight, bias) + ramp), rtol=1e-14, atol=1e-14)
