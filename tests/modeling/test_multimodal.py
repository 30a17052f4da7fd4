"""Multimodal models patched as the user has them: ``patch_model(vlm)`` patches the language model (found from the
structure), exactly as for its text type; the vision tower is untouched; saved folders reload patched. Expected
values come from the models' own tensors and the plain formulas of ``hf_qknorm.reference``, in float64."""

from __future__ import annotations

import copy

import pytest
import torch

import hf_qknorm
from hf_qknorm import UnsupportedModelError
from hf_qknorm.portable.layout import attention_modules
from hf_qknorm.reference import attention_reference, norm_reference, rope_reference
from hf_qknorm.verification.tiny import image_text_inputs, tiny_config, tiny_model, tiny_multimodal_model

# Tiny models of these types build, take image inputs and are patched (their language model: Llama, Mistral,
# Qwen2, Gemma, Gemma 3, Qwen2-VL / Qwen2.5-VL with multimodal RoPE, Qwen3-VL).
SUPPORTED = (
    "llava",
    "llava_next",
    "paligemma",
    "gemma3",
    "mistral3",
    "idefics3",
    "smolvlm",
    "internvl",
    "qwen2_vl",
    "qwen2_5_vl",
    "qwen3_vl",
)
SCHEMES = [("qk_norm_cap", "layernorm"), ("qk_norm", "rmsnorm")]
CAP = 5.0


def _patched(model_type, scheme="qk_norm_cap", norm="layernorm", dtype=torch.float64):
    """``(unpatched, patched)`` tiny models of ``model_type`` (same weights), the norms' gains and biases random."""
    plain = tiny_multimodal_model(model_type, dtype=dtype)
    model = copy.deepcopy(plain)
    hf_qknorm.patch_model(model, scheme, norm=norm, softcap=CAP if "cap" in scheme else None)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, prm in model.named_parameters():
            if "q_norm" in name or "k_norm" in name:
                noise = torch.randn(prm.shape, generator=gen, dtype=prm.dtype)
                prm.copy_((1 + 0.5 * noise) if name.endswith("weight") else 0.5 * noise)
    return plain, model


def _record(attns):
    """Each attention module's call (args, kwargs) and output, by layer."""
    calls, handles = {}, []
    for i, attn in enumerate(attns):

        def pre(module, args, kwargs, i=i):
            calls[i] = {"args": args, "kwargs": dict(kwargs)}

        def post(module, args, kwargs, out, i=i):
            calls[i]["out"] = out[0] if isinstance(out, tuple) else out

        handles.append(attn.register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(attn.register_forward_hook(post, with_kwargs=True))
    return calls, handles


def _layer_reference(attn, x, cos, sin, mask, norm, softcap):
    """One patched attention layer from the formulas (projection, per-head norm, RoPE, capped softmax attention,
    output projection), with the projections' own weights and the scheme's norm parameters."""
    b, t, _ = x.shape
    if cos.dim() == 4:  # three position rows, combined in the attention (Transformers 5.4's M-RoPE): each section of
        # the head's frequencies takes its angles from one row (time, height, width, in turn)
        section = list(attn.config.rope_parameters["mrope_section"]) * 2
        cos, sin = (torch.cat([m[i % 3] for i, m in enumerate(c.split(section, dim=-1))], dim=-1) for c in (cos, sin))
    heads = {}
    for role in ("q", "k", "v"):
        proj = getattr(attn, f"{role}_proj")
        heads[role] = torch.nn.functional.linear(x, proj.weight, proj.bias).view(b, t, -1, attn.head_dim)
    for role in ("q", "k"):
        n = getattr(attn, f"{role}_norm")
        heads[role] = norm_reference(heads[role], norm, n.weight, getattr(n, "bias", None), eps=n.eps)
    q, k, v = (heads[r].transpose(1, 2) for r in ("q", "k", "v"))
    q, k = rope_reference(q, cos, sin), rope_reference(k, cos, sin)
    allowed = None if mask is None else (mask if mask.dtype == torch.bool else mask == 0)
    out = attention_reference(
        q,
        k,
        v,
        scaling=attn.scaling,
        softcap=softcap,
        causal=allowed is None,
        mask=allowed,
        sliding_window=getattr(attn, "sliding_window", None) if allowed is None else None,
    )
    return attn.o_proj(out.transpose(1, 2).reshape(b, t, -1))


@pytest.mark.parametrize("scheme,norm", SCHEMES)
@pytest.mark.parametrize("model_type", SUPPORTED)
def test_every_language_model_layer_matches_the_float64_reference_with_images(model_type, scheme, norm):
    """Image and text inputs through the patched model: every attention layer of its language model computes the
    scheme from the formulas, on the mask the unpatched model builds (Gemma 3's and PaliGemma's bidirectional image
    blocks included) and the RoPE angles of the model's own positions (Qwen2-VL's three-row M-RoPE included)."""
    plain, model = _patched(model_type, scheme, norm)
    inputs = image_text_inputs(model)
    softcap = CAP if "cap" in scheme else None
    _, plain_attns = attention_modules(plain)
    family, attns = attention_modules(model)
    assert family.text_model and len(attns) == len(plain_attns) >= 1
    want_calls, h0 = _record(plain_attns)
    got_calls, h1 = _record(attns)
    with torch.no_grad():
        plain(**inputs)
        logits = model(**inputs).logits
    for h in h0 + h1:
        h.remove()
    assert torch.isfinite(logits).all()
    for i, attn in enumerate(attns):
        call = got_calls[i]
        x = call["args"][0] if call["args"] else call["kwargs"]["hidden_states"]
        cos, sin = call["kwargs"]["position_embeddings"]
        with torch.no_grad():
            want = _layer_reference(attn, x, cos, sin, want_calls[i]["kwargs"].get("attention_mask"), norm, softcap)
        torch.testing.assert_close(call["out"], want, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("model_type", ["qwen2_vl", "qwen2_5_vl"])
def test_multimodal_rope_positions_reach_the_patched_layers(model_type):
    """The reference test above is not vacuous for M-RoPE: the image tokens' three position rows differ, so the
    rotation the patched layers receive is not the text-only one."""
    _, model = _patched(model_type)
    rotary = model.get_submodule(attention_modules(model)[0].text_model).rotary_emb
    seen = []
    handle = rotary.register_forward_pre_hook(lambda m, args: seen.append(args[1]))
    with torch.no_grad():
        model(**image_text_inputs(model))
    handle.remove()
    positions = seen[0]
    assert positions.shape[0] == 3 and not torch.equal(positions[1], positions[2])


@pytest.mark.parametrize("model_type", ["llava", "mistral3", "smolvlm", "internvl"])
def test_text_logits_equal_the_text_model_patched_alone(model_type):
    """The language model inside is patched exactly as the text model type is: a ``*ForCausalLM`` of the text
    config with the same weights, patched alone with the same scheme and norms, gives the same text logits."""
    from transformers import AutoModelForCausalLM

    plain, model = _patched(model_type)
    language = model.get_submodule(attention_modules(model)[0].text_model)
    alone = AutoModelForCausalLM.from_config(copy.deepcopy(plain.config.get_text_config()), dtype=torch.float64)
    alone.model.load_state_dict(plain.get_submodule(attention_modules(model)[0].text_model).state_dict())
    alone.lm_head.load_state_dict(plain.lm_head.state_dict())
    hf_qknorm.patch_model(alone.eval(), "qk_norm_cap", softcap=CAP)
    alone.model.load_state_dict(language.state_dict())  # the random norm gains too
    ids = image_text_inputs(model)["input_ids"]
    ids = torch.where(ids >= 200, 7, ids)  # no image placeholders: text only
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, alone(input_ids=ids).logits, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(
    "model_type,path",
    [("llava", "model.language_model"), ("smolvlm", "model.text_model"), ("qwen2_vl", "model.language_model")],
)
def test_the_vision_tower_is_untouched(model_type, path):
    """Patching changes the language model only: the vision tower's features are bit-identical, its modules and
    attention backend as they were, and only the language model's attention modules carry norms."""
    plain, model = _patched(model_type, dtype=torch.float32)
    assert attention_modules(model)[0].text_model == path
    pixels = {k: v for k, v in image_text_inputs(model).items() if k not in ("input_ids", "token_type_ids")}
    pixels.pop("mm_token_type_ids", None)
    with torch.no_grad():
        want, got = plain.get_image_features(**pixels), model.get_image_features(**pixels)
    want, got = (getattr(o, "pooler_output", o) for o in (want, got))
    want, got = ([o] if isinstance(o, torch.Tensor) else list(o) for o in (want, got))
    assert len(want) == len(got) and all(torch.equal(a, b) for a, b in zip(want, got))
    vision = model.config.vision_config
    assert vision._attn_implementation == plain.config.vision_config._attn_implementation != "qknorm"
    assert model.config.get_text_config()._attn_implementation == "qknorm"  # the cap moved the language model only
    normed = {n.rsplit(".", 2)[0] for n, _ in model.named_parameters() if ".q_norm." in n}
    assert normed and all(n.startswith(path + ".") for n in normed)
    plain_state = plain.state_dict()
    assert all(torch.equal(t, plain_state[k]) for k, t in model.state_dict().items() if not k.startswith(path))


def test_a_language_model_refused_refuses_the_multimodal_model_in_one_line():
    """Llama 4's text model is refused by the self-check (its L2 q/k norm after RoPE undoes the scheme): so is the
    multimodal model, naming both types and the language model, and left exactly as it was."""
    model = tiny_multimodal_model("llama4")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    config, classes = model.config, [type(m) for m in model.modules()]
    with pytest.raises(UnsupportedModelError) as info:
        hf_qknorm.patch_model(model, "qk_norm")
    text = str(info.value)
    assert len(text.splitlines()) == 1 and "'llama4'" in text and "'llama4_text'" in text and ".language_model" in text
    assert model.config is config and not hasattr(config, "qknorm") and type(config).__name__ == "Llama4Config"
    assert [type(m) for m in model.modules()] == classes
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items()) and before.keys() == set(
        model.state_dict()
    )


def test_a_multimodal_model_whose_language_model_cannot_be_found_is_refused():
    from transformers import MistralConfig

    model = tiny_multimodal_model("llava")
    model.config.text_config = MistralConfig()  # a text config no submodule holds, of a type none has
    with pytest.raises(UnsupportedModelError, match="'llava' is a multimodal model whose language model") as info:
        hf_qknorm.patch_model(model)
    assert len(str(info.value).splitlines()) == 1


def test_type_level_tools_say_a_multimodal_type_is_patched_through_a_model():
    from hf_qknorm.modeling.derive import get_family

    with pytest.raises(UnsupportedModelError, match=r"patch_model\(model\) patches its language model \('llama'\)"):
        get_family("llava")


def test_patching_a_patched_multimodal_model_again_is_refused():
    _, model = _patched("llava", dtype=torch.float32)
    with pytest.raises(ValueError, match="already patched"):
        hf_qknorm.patch_model(model)
    assert hf_qknorm.is_patched(model) and hf_qknorm.qknorm_config(model).scheme == "qk_norm_cap"


@pytest.mark.parametrize("model_type", ["llava", "qwen2_vl", "smolvlm", "paligemma"])
def test_a_saved_folder_reloads_patched_with_the_same_logits(model_type, tmp_path):
    """``save_pretrained`` of a patched multimodal model writes ``qknorm_<type>``; the Auto class loads it back
    patched (Qwen2-VL's checkpoint conversion, which keys the language model's weights by class, included), the
    language model on "qknorm" and the vision tower on its own backend, with the same logits on images and text."""
    from transformers import AutoModelForImageTextToText

    _, model = _patched(model_type, dtype=torch.float32)
    inputs = image_text_inputs(model)
    with torch.no_grad():
        want = model(**inputs).logits
    model.save_pretrained(tmp_path)
    loaded = AutoModelForImageTextToText.from_pretrained(tmp_path).eval()
    assert loaded.config.model_type == f"qknorm_{model_type}" and hf_qknorm.is_patched(loaded)
    assert loaded.config.get_text_config()._attn_implementation == "qknorm"
    assert loaded.config.vision_config._attn_implementation != "qknorm"
    with torch.no_grad():
        torch.testing.assert_close(loaded(**inputs).logits, want, rtol=0, atol=0)


@pytest.mark.spawns
def test_a_saved_folder_never_loads_as_the_unpatched_model_without_the_plugin(tmp_path):
    """Without the plugin the folder fails loudly without ``trust_remote_code``, and with it loads the folder's own
    ``QKNorm`` classes: it never loads as the plain LLaVA (whose language model would silently lose its norms).
    ``test_multimodal_export.py`` checks the logits of folders loaded so."""
    import subprocess
    import sys

    _, model = _patched("llava", dtype=torch.float32)
    model.save_pretrained(tmp_path / "saved")
    script = (
        "import sys, transformers\n"
        "sys.modules['hf_qknorm'] = None\n"
        "for auto in ('AutoModelForImageTextToText', 'AutoModel'):\n"
        "    for remote in (False, True):\n"
        "        try:\n"
        f"            m = getattr(transformers, auto).from_pretrained({str(tmp_path / 'saved')!r}, "
        "trust_remote_code=remote)\n"
        "        except Exception as exc:\n"
        "            print('refused', auto, remote, type(exc).__name__)\n"
        "        else:\n"
        "            print('LOADED', auto, remote, type(m).__name__, type(m).__module__.split('.')[0])\n"
    )
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=tmp_path, timeout=600)
    assert res.returncode == 0, res.stderr
    lines = res.stdout.strip().splitlines()
    assert lines == [
        "refused AutoModelForImageTextToText False ValueError",
        "LOADED AutoModelForImageTextToText True QKNormLlavaForConditionalGeneration transformers_modules",
        "refused AutoModel False ValueError",
        "LOADED AutoModel True QKNormLlavaModel transformers_modules",
    ], res.stdout


class _ImageRows(torch.utils.data.Dataset):
    def __init__(self, inputs):
        self.inputs = inputs

    def __len__(self):
        return len(self.inputs["input_ids"])

    def __getitem__(self, i):
        row = {k: v[i] for k, v in self.inputs.items()}
        return {**row, "labels": row["input_ids"]}


def test_a_trainer_step_on_images_and_text_trains_the_norms(tmp_path):
    """``transformers.Trainer`` on a patched LLaVA with image and text inputs: finite loss, and the scheme's norms
    (in the language model) move."""
    from transformers import Trainer

    from tests._support.trainer_runs import training_args

    _, model = _patched("llava", dtype=torch.float32)
    model.train()
    before = {n: p.detach().clone() for n, p in model.named_parameters() if "_norm." in n and "self_attn" in n}
    data = _ImageRows(image_text_inputs(model, batch=4))
    args = training_args(tmp_path, max_steps=2, save_strategy="no", per_device_train_batch_size=2, warmup_steps=0)
    trainer = Trainer(model=model, args=args, train_dataset=data)
    result = trainer.train()
    assert torch.isfinite(torch.tensor(result.training_loss))
    after = dict(model.named_parameters())
    assert before and all(not torch.equal(before[n], after[n]) for n in before)


def test_a_plain_training_step_with_multimodal_rope_trains_the_norms():
    _, model = _patched("qwen2_vl", scheme="qk_norm", norm="rmsnorm", dtype=torch.float32)
    model.train()
    inputs = image_text_inputs(model)
    norms = [p for n, p in model.named_parameters() if ".q_norm." in n or ".k_norm." in n]
    before = [p.detach().clone() for p in norms]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loss = model(**inputs, labels=inputs["input_ids"]).loss
    loss.backward()
    opt.step()
    assert torch.isfinite(loss) and all(not torch.equal(a, p) for a, p in zip(before, norms))


def test_coverage_patches_or_refuses_multimodal_types(monkeypatch):
    """``hf-qknorm coverage`` lists the image-text-to-text types: LLaVA and Qwen2-VL patched (text checks, an image
    forward and backward, the vision tower unchanged), Llama 4 refused with its language model's reason."""
    from hf_qknorm.verification import coverage as cov

    assert {"llava", "qwen2_vl", "smolvlm", "llama"} <= set(cov.causal_model_types())
    monkeypatch.setattr(cov, "variants", lambda: [("qk_norm", "layernorm"), ("qk_norm_cap", "rmsnorm")])
    results = {r.model_type: r for r in cov.coverage(["llava", "qwen2_vl", "llama4"])}
    assert results["llava"].status == cov.PATCHED and set(results["llava"].variants.values()) == {"ok"}
    assert results["qwen2_vl"].status == cov.PATCHED, results["qwen2_vl"].variants
    assert results["llama4"].status == cov.REFUSED and "llama4_text" in results["llama4"].reason


def test_coverage_checks_the_language_model_alone_where_the_whole_model_needs_images(monkeypatch):
    """BLIP-2's forward takes no text alone (pixel values are required): its text checks run on its OPT, a causal LM
    whose head is the whole model's, and they are made there -- a patch that left that language model's output head
    NaN fails the table."""
    from hf_qknorm.verification import coverage as cov

    monkeypatch.setattr(cov, "variants", lambda: [("qk_norm", "layernorm"), ("qk_norm_cap", "rmsnorm")])
    result = cov.check_model_type("blip-2")
    assert result.status == cov.PATCHED and set(result.variants.values()) == {"ok"}, result
    assert "its language model .language_model alone" in result.reason and "pixel_values" in result.reason
    real = hf_qknorm.patch_model

    def broken(model, *args, **kwargs):
        out = real(model, *args, **kwargs)
        with torch.no_grad():
            model.language_model.get_output_embeddings().weight.fill_(float("nan"))
        return out

    monkeypatch.setattr(hf_qknorm, "patch_model", broken)
    bad = cov.check_model_type("blip-2")
    assert bad.status == cov.FAIL and "not finite" in bad.reason, bad


@pytest.mark.parametrize("model_type", ["ovis2", "janus", "emu3", "apertus1p5", "deepseek_ocr2"])
def test_types_whose_parts_name_their_sizes_otherwise_build_tiny_and_verify(model_type):
    """Ovis 2's visual vocabulary, Janus's and Emu3's image tokenizers (VQ-VAEs) and generation head, DeepSeek-OCR
    2's encoders inside its vision config are shrunk through their sub-configs' own names (``tiny.MULTIMODAL``,
    dotted): the tiny model is small, and patched it verifies against the float64 reference."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    from hf_qknorm.verification.tiny import MAX_TINY_PARAMETERS

    if model_type not in CONFIG_MAPPING:
        pytest.skip(f"{model_type} is not in this Transformers")  # Apertus 1.5, DeepSeek-OCR 2: newer than 5.17
    model = tiny_multimodal_model(model_type)
    assert sum(p.numel() for p in model.parameters()) <= MAX_TINY_PARAMETERS
    hf_qknorm.patch_model(model, "qk_norm_cap", softcap=CAP)
    report = hf_qknorm.verify(model, generate=False)
    assert report.ok and report.mechanism("cap") == "applied", str(report)


def test_unlimited_ocr_verifies_and_a_reference_window_its_cached_probes_would_cut_is_refused():
    """Unlimited-OCR's text layers are reference sliding-window layers: the cache keeps the prompt and the last
    ``sliding_window`` decoded tokens. Its eager attention fails under GQA, so the rotation check reads the query and
    key its attention function is handed (no backend runs). With a window wider than the probes decode it verifies
    with generation, unpatched and capped, and a dropped cap is caught; a window the probes would cut is refused in
    one line (checked uncached)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    from hf_qknorm.verification.probe import NEW_TOKENS
    from tests.verification.test_verify import qknorm_function

    if "unlimited_ocr" not in CONFIG_MAPPING:
        pytest.skip("Unlimited-OCR is not in this Transformers")
    plain, model = _patched("unlimited_ocr", dtype=torch.float32)
    assert plain.config.get_text_config().sliding_window >= NEW_TOKENS
    for m in (plain, model):
        report = hf_qknorm.verify(m)
        assert report.ok, str(report)
    assert report.mechanism("cap") == "applied"
    with qknorm_function(sdpa_attention_forward):
        bad = hf_qknorm.verify(model, generate=False)
    assert not bad.ok and bad.mechanism("cap") == "DROPPED", str(bad)

    model.config.get_text_config().sliding_window = NEW_TOKENS - 2
    with pytest.raises(UnsupportedModelError, match="keep the prompt and the last 4 decoded tokens") as err:
        hf_qknorm.verify(model)
    assert "\n" not in str(err.value)
    assert hf_qknorm.verify(model, generate=False).ok


def test_coverage_trains_a_model_that_requires_the_kinds_of_its_tokens(monkeypatch):
    """Molmo 2's forward refuses to train without ``mm_token_type_ids``: the table's training check marks every token
    as text (zeros) where the forward takes their kinds, so it is checked, not left untested."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    from hf_qknorm.verification import coverage as cov

    if "molmo2" not in CONFIG_MAPPING:
        pytest.skip("Molmo 2 is not in this Transformers")
    monkeypatch.setattr(cov, "variants", lambda: [("qk_norm", "layernorm"), ("qk_norm_cap", "rmsnorm")])
    result = cov.check_model_type("molmo2")
    assert result.status == cov.PATCHED and set(result.variants.values()) == {"ok"}, result


def test_verify_generates_with_the_cache_the_whole_model_is_configured_with():
    """BLIP-2's text runs on its OPT, but the cache a user configures is the whole model's: set to static there, the
    cached probes run a static cache (they ran the OPT's own default, a dynamic one, while the report said static)."""
    _, model = _patched("blip-2", dtype=torch.float32)
    model.generation_config.cache_implementation = "static"
    report = hf_qknorm.verify(model)
    assert report.ok and report.cache == "static (StaticCache)", str(report)


def test_text_runs_on_the_language_model_only_where_the_whole_models_head_is_its_own():
    """Where a forward on text alone runs: BLIP-2's and Kosmos-2's language models (causal LMs whose heads are the
    whole models'); LLaVA's language model has no head of its own, so LLaVA runs text itself."""
    from hf_qknorm.portable.families import text_forward_path

    assert text_forward_path(tiny_multimodal_model("blip-2")) == "language_model"
    assert text_forward_path(tiny_multimodal_model("kosmos-2")) == "text_model"
    assert text_forward_path(tiny_multimodal_model("llava")) is None
    assert text_forward_path(tiny_model("llama")) is None


def test_patching_keeps_the_callers_config_and_the_language_models_link_to_its_own():
    """The model gets its own copy of the config, sub-configs included: the caller's text config keeps its backend,
    and the language model and vision tower hold the copy's sub-configs (so the saved config is what they run)."""
    from transformers import AutoModelForImageTextToText

    from hf_qknorm.verification.tiny import tiny_multimodal_config

    config = tiny_multimodal_config("llava")
    model = AutoModelForImageTextToText.from_config(config).eval()
    theirs = model.config
    hf_qknorm.patch_model(model, "qk_norm_cap")
    assert model.config is not theirs and not hasattr(theirs, "qknorm")
    assert theirs.text_config._attn_implementation != "qknorm"
    assert model.model.language_model.config is model.config.text_config
    assert model.model.vision_tower.config is model.config.vision_config


@pytest.mark.parametrize("model_type", ["llava", "gemma3", "qwen2_vl", "mistral3", "glm4v_moe", "kosmos-2.5"])
def test_verify_checks_a_multimodal_models_language_model(model_type):
    """verify runs its probes through the whole model on text (no image or video token id, no padding id) and
    checks every layer of its language model against the float64 reference, unpatched and patched (it refused
    multimodal models; then GLM-4V-MoE's padded generation crashed on the "qknorm" backend, which read its (3, batch,
    seq) multimodal RoPE positions as a packed batch's, and Kosmos-2.5, which places its tokens itself, was handed
    generate's positions by the probe's uncached forward and failed unpatched)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    if model_type not in CONFIG_MAPPING_NAMES:
        pytest.skip(f"{model_type} is not in this Transformers")
    import transformers
    from packaging.version import Version

    plain, model = _patched(model_type, dtype=torch.float32)
    layers = len(attention_modules(model))
    for candidate, scheme in ((plain, "none"), (model, "qk_norm_cap")):
        try:
            report = hf_qknorm.verify(candidate)
        except UnsupportedModelError as exc:  # older releases: Qwen2-VL's modelling file has no rotary function
            assert Version(transformers.__version__) < Version("5.24") and "\n" not in str(exc), str(exc)
            assert "rotary layout" in str(exc)
            continue
        assert report.ok, str(report)
        assert f"scheme {scheme}" in str(report)
        assert {c.layer for c in report.checks if c.probe == "unpadded"} == set(range(layers))
        assert report.mechanism("padding") == "applied" and report.mechanism("causal") == "applied"
        if scheme != "none":
            assert report.mechanism("cap") == "applied" and report.mechanism("norms") == "applied", str(report)


@pytest.mark.spawns
def test_verify_folder_checks_a_saved_multimodal_model_with_and_without_the_plugin(tmp_path):
    """A saved patched LLaVA loads through its image-text-to-text class (with the plugin, and in a fresh interpreter
    through the folder's remote code) and verifies; its weights are checked as a whole model's."""
    from hf_qknorm.verification import verify_folder

    _, model = _patched("llava", dtype=torch.float32)
    model.save_pretrained(tmp_path / "saved")
    for no_plugin in (False, True):
        report = verify_folder(tmp_path / "saved", no_plugin=no_plugin)
        assert report.ok and report.mechanism("cap") == "applied", str(report)
        assert ("without hf_qknorm" in report.source) == no_plugin


@pytest.mark.parametrize(
    "model_type", ["llava", "blip-2", "kosmos-2"]
)  # BLIP-2: probed on its OPT (its forward needs images)
def test_verify_catches_a_multimodal_model_whose_backend_drops_the_cap(model_type):
    """The same model, its "qknorm" attention function swapped for plain sdpa: the cap is caught dropped."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from tests.verification.test_verify import qknorm_function

    _, model = _patched(model_type, dtype=torch.float32)
    assert hf_qknorm.verify(model, generate=False).ok
    with qknorm_function(sdpa_attention_forward):
        bad = hf_qknorm.verify(model, generate=False)
    assert not bad.ok and bad.mechanism("cap") == "DROPPED", str(bad)


def test_verify_checks_a_prefix_lm_with_its_prefix_marked(monkeypatch):
    """PaliGemma's Gemma is built with ``use_bidirectional_attention``: its attention modules are non-causal and
    Transformers' masks causal, so on text alone an unpadded batch on sdpa attends both ways and a padded one
    causally. Given ``token_type_ids`` (as its processor marks image and prompt) it is a prefix-LM: the prefix attends
    both ways among itself, the rest causally. The probes mark a prefix and the float64 reference models that rule:
    a correct patched model verifies with the prefix and causality both applied; a model that drops the prefix is
    caught (prefix DROPPED), and so is the both-ways attention of unmarked text (causal DROPPED)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    from hf_qknorm.verification import probe

    if "paligemma" not in CONFIG_MAPPING_NAMES:
        pytest.skip("PaliGemma is not in this Transformers")
    _, model = _patched("paligemma", dtype=torch.float32)
    assert model.config.text_config.use_bidirectional_attention
    report = hf_qknorm.verify(model)
    assert report.ok, str(report)
    for mechanism in ("prefix", "causal", "padding", "cap", "norms"):
        assert report.mechanism(mechanism) == "applied", (mechanism, str(report))
    assert "prefix applied" in report.summary()

    marked = probe.prefix_types
    with monkeypatch.context() as m:  # the model is handed no prefix while the probes record one: plain causal
        m.setattr(probe, "prefix_types", lambda mask, n: {k: torch.ones_like(v) for k, v in marked(mask, n).items()})
        m.setattr(
            probe,
            "_prefix_of",
            lambda mask, extra: {"prefix": (marked(mask, probe.PREFIX)["token_type_ids"] == 0) & mask.bool()},
        )
        dropped = hf_qknorm.verify(model)
    assert not dropped.ok and dropped.mechanism("prefix") == "DROPPED", str(dropped)

    with monkeypatch.context() as m:  # the probes do not mark the prefix: an unpadded batch attends both ways
        m.setattr(probe, "prefix_types", lambda mask, prefix: {})
        unmarked = hf_qknorm.verify(model)
    assert not unmarked.ok and unmarked.mechanism("causal") == "DROPPED", str(unmarked)


def test_coverage_checks_a_prefix_lm_on_text_marked_as_text():
    """The coverage table's padding, packing and cache checks compare a patched model with itself; PaliGemma's
    unpatched model failed them on bare text (both ways unpadded, causally padded), so they were not made. Given
    ``token_type_ids`` marking every token as text to predict, it attends causally with every mask built, and every
    check is made on every variant."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    from hf_qknorm.verification import coverage as cov

    if "paligemma" not in CONFIG_MAPPING_NAMES:
        pytest.skip("PaliGemma is not in this Transformers")
    result = cov.check_model_type("paligemma")
    assert result.status == cov.PATCHED and "not checked" not in result.reason, result
    assert set(result.variants.values()) == {"ok"}, result.variants


def test_verify_refuses_a_model_built_both_ways_that_cannot_be_given_a_prefix_in_one_line():
    """A causal LM whose config says ``use_bidirectional_attention`` but whose forward takes no ``token_type_ids``
    (a Gemma built that way) attends both ways or causally depending on padding, with nothing to mark a prefix:
    verify refuses it in one line rather than failing a correct model or passing a wrong one."""
    from transformers import AutoModelForCausalLM

    config = tiny_config("gemma")
    config.use_bidirectional_attention = True
    model = AutoModelForCausalLM.from_config(config).eval()
    hf_qknorm.patch_model(model, "qk_norm_cap", softcap=CAP)
    with pytest.raises(UnsupportedModelError, match=r"use_bidirectional_attention=True without token_type_ids") as info:
        hf_qknorm.verify(model)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("model_type", ["musicgen", "musicgen_melody"])
def test_a_config_with_several_text_configs_is_out_of_scope_not_a_crash(model_type):
    """MusicGen holds a text encoder and a decoder: Transformers' get_text_config refuses to pick one, and the
    coverage check crashed on it; it is an encoder-decoder model, out of scope. Releases whose config cannot be built
    with defaults (5.4's strict dataclass validation) report it untested with that reason instead."""
    from transformers import AutoConfig

    from hf_qknorm.verification import coverage as cov

    try:
        AutoConfig.for_model(model_type)
    except Exception:  # the release's own config refuses its defaults
        buildable = False
    else:
        buildable = True
    result = cov.check_model_type(model_type)
    if buildable:
        assert result.status == cov.OUT_OF_SCOPE and "encoder-decoder" in result.reason
    else:
        assert result.status == cov.UNTESTED and "cannot be built with defaults" in result.reason


# --------------------------------------------------------------------------------------------------------------------
# the vision encoder, on request (vision=...)
# --------------------------------------------------------------------------------------------------------------------
VISION_TYPES = ("llava", "paligemma", "smolvlm")  # CLIP, SigLIP, SmolVLM's vision transformer


def _vision_attentions(model):
    from hf_qknorm.portable.vision import plan_vision

    return plan_vision(model, hf_qknorm.QKNormConfig("qk_norm"), loading=True).attentions


def _vision_reference(attn, x, norm, softcap):
    """One patched vision attention layer from the formulas: projections, the scheme's norm on each head of q and k,
    bidirectional softmax attention (no mask, no RoPE) with the module's scaling and the cap if any, the output
    projection."""
    b, t, _ = x.shape
    heads = {}
    for role in ("q", "k", "v"):
        proj = getattr(attn, f"{role}_proj")
        heads[role] = torch.nn.functional.linear(x, proj.weight, proj.bias).view(b, t, -1, attn.head_dim)
    for role in ("q", "k"):
        n = getattr(attn, f"{role}_norm")
        heads[role] = norm_reference(heads[role], norm, n.weight, getattr(n, "bias", None), eps=n.eps)
    q, k, v = (heads[r].transpose(1, 2) for r in ("q", "k", "v"))
    out = attention_reference(q, k, v, scaling=attn.scale, softcap=softcap, causal=False, mask=None)
    return attn.out_proj(out.transpose(1, 2).reshape(b, t, -1))


def _vision_pixels(model):
    drop = ("input_ids", "token_type_ids", "mm_token_type_ids")
    return {k: v for k, v in image_text_inputs(model).items() if k not in drop}


@pytest.mark.parametrize(
    "vision,norm,softcap",
    [(True, "layernorm", None), (True, "rmsnorm", None), ("capped", "rmsnorm", 2.0)],
)
@pytest.mark.parametrize("model_type", VISION_TYPES)
def test_the_vision_encoder_on_request_matches_the_float64_reference(model_type, vision, norm, softcap):
    """``vision=True`` (the scheme's norm kind, no cap) or a QKNormConfig with a cap: every attention layer of the
    vision encoder computes the norms and bidirectional attention from the formulas, with random gains; identity
    norms are not a no-op (they normalise), so the encoder's features differ from the unpatched model's."""
    plain = tiny_multimodal_model(model_type, dtype=torch.float64)
    model = copy.deepcopy(plain)
    setting = hf_qknorm.QKNormConfig("qk_norm_cap", norm=norm, softcap=softcap) if vision == "capped" else True
    hf_qknorm.patch_model(model, "qk_norm", norm=norm, vision=setting)
    pixels = _vision_pixels(model)
    with torch.no_grad():
        want, got = plain.get_image_features(**pixels), model.get_image_features(**pixels)
    want, got = (getattr(o, "pooler_output", o) for o in (want, got))
    want, got = ([o] if isinstance(o, torch.Tensor) else list(o) for o in (want, got))
    assert not all(torch.allclose(a, b) for a, b in zip(want, got))  # identity norms still normalise
    attns = _vision_attentions(model)
    assert len(attns) >= 1 and all("_qknorm_slots" in a.__dict__ for a in attns)
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for attn in attns:
            for name, prm in (*attn.q_norm.named_parameters(), *attn.k_norm.named_parameters()):
                noise = torch.randn(prm.shape, generator=gen, dtype=prm.dtype)
                prm.copy_((1 + 0.5 * noise) if name == "weight" else 0.5 * noise)
    calls, handles = _record(attns)
    with torch.no_grad():
        model.get_image_features(**pixels)
    for h in handles:
        h.remove()
    assert model.config.vision_config._attn_implementation == ("qknorm" if softcap else "sdpa")
    for i, attn in enumerate(attns):
        x = calls[i]["args"][0] if calls[i]["args"] else calls[i]["kwargs"]["hidden_states"]
        assert calls[i]["kwargs"].get("attention_mask") is None
        with torch.no_grad():
            ref = _vision_reference(attn, x, norm, softcap)
        torch.testing.assert_close(calls[i]["out"], ref, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize(
    "model_type,reason",
    [
        ("qwen2_vl", "no separate q_proj/k_proj/v_proj"),
        ("mistral3", "takes position_embeddings"),
        ("internvl", "has q/k norms of its own"),
    ],
)
def test_a_vision_encoder_that_cannot_be_patched_exactly_is_refused_in_one_line(model_type, reason):
    """The whole patch is refused (the language model too) and the model left exactly as it was."""
    model = tiny_multimodal_model(model_type)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    config = model.config
    with pytest.raises(UnsupportedModelError, match=reason) as info:
        hf_qknorm.patch_model(model, "qk_norm", vision=True)
    assert len(str(info.value).splitlines()) == 1 and f"'{model_type}'" in str(info.value)
    assert model.config is config and not hasattr(config, "qknorm") and not hasattr(config, "qknorm_vision")
    assert before.keys() == set(model.state_dict()) and all(
        torch.equal(before[k], v) for k, v in model.state_dict().items()
    )


def test_the_vision_argument_is_checked_in_one_line():
    model = tiny_multimodal_model("llava")
    with pytest.raises(ValueError, match="scheme 'soft_cap' has none"):
        hf_qknorm.patch_model(model, "soft_cap", vision=True)
    with pytest.raises(TypeError, match="vision must be True, False or a QKNormConfig, got 'yes'"):
        hf_qknorm.patch_model(model, "qk_norm", vision="yes")
    with pytest.raises(ValueError, match="norm 'l2' is not supported on a vision encoder"):
        hf_qknorm.patch_model(model, "qk_norm", norm="l2", vision=True)
    with pytest.raises(UnsupportedModelError, match="it has no vision_config"):
        hf_qknorm.patch_model(tiny_multimodal_model("llava").model.language_model, "qk_norm", vision=True)
    assert not hf_qknorm.is_patched(model)


def test_a_patched_vision_encoder_saves_and_reloads_with_the_plugin(tmp_path):
    from transformers import AutoModelForImageTextToText

    model = tiny_multimodal_model("llava", dtype=torch.float32)
    hf_qknorm.patch_model(model, "qk_norm_cap", vision=hf_qknorm.QKNormConfig("qk_norm_cap", softcap=3.0))
    with torch.no_grad():
        for name, prm in model.named_parameters():
            if "q_norm" in name or "k_norm" in name:
                prm.add_(0.3 * torch.randn_like(prm))
    inputs = image_text_inputs(model)
    with torch.no_grad():
        want = model(**inputs).logits
    model.save_pretrained(tmp_path)
    loaded = AutoModelForImageTextToText.from_pretrained(tmp_path).eval()
    assert loaded.config.qknorm_vision == model.config.qknorm_vision
    assert loaded.config.vision_config._attn_implementation == "qknorm"
    assert {n for n, _ in loaded.named_parameters()} == {n for n, _ in model.named_parameters()}
    with torch.no_grad():
        torch.testing.assert_close(loaded(**inputs).logits, want, rtol=0, atol=0)


def test_vision_true_takes_the_norm_kind_and_the_encoders_own_epsilon():
    """``vision=True``: ``qk_norm`` with the scheme's norm kind, no cap (the language model's cap stays there), the
    vision config's ``layer_norm_eps`` (not the language model's) unless ``eps`` is given."""
    model = tiny_multimodal_model("llava")
    vision_eps, text_eps = model.config.vision_config.layer_norm_eps, model.config.text_config.rms_norm_eps
    assert vision_eps != text_eps
    hf_qknorm.patch_model(model, "qk_norm_cap", norm="rmsnorm", vision=True)
    assert model.config.qknorm_vision == {
        "scheme": "qk_norm", "norm": "rmsnorm", "softcap": None, "eps": vision_eps, "p": None
    }  # fmt: skip
    assert model.config.qknorm["eps"] == text_eps and model.config.qknorm["softcap"] == 50.0
    assert all(a.q_norm.eps == vision_eps for a in _vision_attentions(model))
    given = tiny_multimodal_model("llava")
    hf_qknorm.patch_model(given, "qk_norm", eps=1e-3, vision=True)
    assert given.config.qknorm_vision["eps"] == 1e-3


def test_a_saved_folder_missing_a_vision_norm_weight_is_refused_on_loading(tmp_path):
    """A vision norm weight is a scheme weight like the language model's: a folder without one does not load with
    fresh norms in place of the trained ones."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForImageTextToText

    model = tiny_multimodal_model("llava", dtype=torch.float32)
    hf_qknorm.patch_model(model, "qk_norm", vision=True)
    model.save_pretrained(tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    dropped = [k for k in weights if "vision_tower" in k and k.endswith("q_norm.weight")]
    assert dropped
    save_file({k: v for k, v in weights.items() if k != dropped[0]}, tmp_path / "model.safetensors",
              metadata={"format": "pt"})  # fmt: skip
    with pytest.raises(ValueError, match="norm weights do not match"):
        AutoModelForImageTextToText.from_pretrained(tmp_path)


def test_a_training_step_on_images_trains_the_vision_norms():
    """The vision encoder's norms are ordinary parameters: an image forward and backward gives every one of them a
    finite, non-zero gradient."""
    model = tiny_multimodal_model("paligemma", dtype=torch.float32)
    hf_qknorm.patch_model(model, "qk_norm", norm="rmsnorm", vision=True)
    model.train()
    inputs = image_text_inputs(model)
    model(**inputs, labels=inputs["input_ids"]).loss.backward()
    vision = {n: p for n, p in model.named_parameters() if "vision_tower" in n and ("q_norm" in n or "k_norm" in n)}
    assert vision and all(p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0
                          for p in vision.values())  # fmt: skip
