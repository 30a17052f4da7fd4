"""Model types whose default configs the tiny builder had to learn to read (Transformers 5.2x): heterogeneous
per-layer sizes (Gemma 4), settings a checkpoint states and the default config leaves unset (DBRX, dots1, Cohere
Compass), a text model mapped to the image-text-to-text class alone (Mistral 4); and the reasons given where a model
cannot be patched (KV-shared layers, attention nested below the block). Each is classified from a tiny model of its
own classes; expected logits come from the unpatched model itself."""

from __future__ import annotations

import pytest
import torch

import hf_qknorm
from hf_qknorm import UnsupportedModelError
from hf_qknorm.verification import coverage as cov
from hf_qknorm.verification.tiny import tiny_config, tiny_model


def _known(model_type: str) -> bool:
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    return model_type in CONFIG_MAPPING


def _skip_unless_known(model_type: str) -> None:
    if not _known(model_type):
        pytest.skip(f"model type {model_type!r} is not in this Transformers")


@pytest.mark.parametrize(
    "model_type, status, words",
    [
        ("gemma4_text", cov.PATCHED, ""),  # per-layer head sizes
        ("dots1", cov.PATCHED, ""),  # its experts' count stated
        ("cohere_compass_text", cov.PATCHED, ""),  # its RoPE per layer kind stated
        ("mistral4", cov.REFUSED, "multi-head latent attention"),  # mapped to the image-text-to-text class alone
        ("dbrx", cov.REFUSED, "norm_attn_norm.attn"),  # attention below another module of the block
        ("gemma3n_text", cov.PATCHED, "normalises v itself"),  # KV-shared layers (qkv_norm refused)
        ("mimo_v2_flash", cov.REFUSED, "value heads as wide as the query and key heads"),  # v_head_dim of its own
        ("qwen4_exp_text", cov.OUT_OF_SCOPE, "a hybrid model"),  # its sparse attention's indexer sizes stated
        ("lfm2_moe", cov.OUT_OF_SCOPE, "hybrid"),  # which blocks are convolutions stated
        ("deepseek_vl_hybrid", cov.PATCHED, "text inputs only"),  # its second vision tower (SAM) shrunk too
        ("qwen2_5_omni_thinker", cov.PATCHED, "text inputs only"),  # its audio encoder shrunk, its id stated
        ("minimax_m3_vl", cov.PATCHED, "text inputs only"),  # its projector's width shrunk
        ("evolla", cov.PATCHED, ""),  # built by its own class: the Auto classes cannot resolve its config
        ("inkling_mm_model", cov.REFUSED, "position_bias"),  # its vision layers follow its patch's prime factors
        ("gemma4_assistant", cov.OUT_OF_SCOPE, "draft model"),  # its default config does not validate
        ("gemma4_unified_assistant", cov.OUT_OF_SCOPE, "draft model"),
    ],
)
def test_newer_types_are_built_and_classified(model_type, status, words):
    """The classification of docs/coverage/transformers-5.24.md; older releases' configs of these types differ
    (DBRX's and Gemma 3n's defaults on 5.4, Cohere Compass's on 5.17), and their own tables say what they give."""
    import transformers
    from packaging.version import Version

    from hf_qknorm.upstream import NEWEST_TESTED

    if Version(transformers.__version__) < Version(NEWEST_TESTED):
        pytest.skip(f"the classification checked is Transformers {NEWEST_TESTED}'s")
    _skip_unless_known(model_type)
    result = cov.check_model_type(model_type)
    assert result.status == status, (result.reason, result.variants)
    assert words in result.reason
    if status == cov.PATCHED:
        others = [v for k, v in result.variants.items() if not k.startswith("qkv_norm")]
        assert len(others) >= 9 and set(others) == {"ok"}, result.variants


def test_per_layer_sizes_are_kept_scaled_and_patched_exactly():
    """Gemma 4's full-attention layers have heads twice as wide as its sliding ones: the tiny model keeps that
    (one layer of each kind), and a ``qk_norm`` / rmsnorm patch, which takes over its own per-head norms, computes
    the unpatched logits bit for bit in both."""
    _skip_unless_known("gemma4_text")
    model = tiny_model("gemma4_text")
    kinds = model.config.layer_types
    widths = [layer.self_attn.head_dim for layer in model.model.layers]
    assert sorted(kinds) == ["full_attention", "sliding_attention"]
    assert widths[kinds.index("full_attention")] == 2 * widths[kinds.index("sliding_attention")]
    ids = torch.randint(0, model.config.vocab_size, (2, 11), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before = model(ids).logits
    hf_qknorm.patch_model(model, scheme="qk_norm", norm="rmsnorm")
    with torch.no_grad():
        after = model(ids).logits
    assert torch.equal(before, after)


def test_qkv_norm_is_refused_where_the_model_normalises_v_itself():
    """Gemma 4 normalises each value head with a norm of its own (``v_norm``, no gain): ``qkv_norm`` is refused in
    one line before anything changes, while the q/k schemes patch it."""
    _skip_unless_known("gemma4_text")
    model = tiny_model("gemma4_text")
    with pytest.raises(UnsupportedModelError, match=r"normalises v itself \(Gemma4TextAttention\.v_norm\)"):
        hf_qknorm.patch_model(model, scheme="qkv_norm")
    assert not hf_qknorm.is_patched(model)
    assert type(model.model.layers[0].self_attn.v_norm).__name__ == "Gemma4RMSNorm"


@pytest.mark.parametrize("model_type", ["mimo_v2_flash", "mistral4", "deepseek_v3"])
def test_head_parts_keep_their_ratio_to_the_head(model_type):
    """Value heads of their own width (MiMo-V2-Flash: 128 beside 192-wide q/k heads) and MLA's rotary and plain parts
    shrink in proportion to the head: a tiny model with equal widths would hide what a real one has."""
    _skip_unless_known(model_type)
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    full, tiny = CONFIG_MAPPING[model_type](), tiny_config(model_type)
    for name in ("v_head_dim", "qk_rope_head_dim", "qk_nope_head_dim"):
        if getattr(full, name, None) is not None:
            assert getattr(tiny, name) * full.head_dim == pytest.approx(getattr(full, name) * tiny.head_dim, rel=0.1)
    if getattr(full, "qk_rope_head_dim", None) is not None:
        assert tiny.qk_head_dim == tiny.qk_rope_head_dim + tiny.qk_nope_head_dim


def test_the_backend_names_value_heads_of_another_width():
    """A call whose value heads are narrower than its query and key heads (MiMo-V2-Flash's ``v_head_dim``) is an
    error naming both widths, never a reshape deep in the kernel path."""
    from types import SimpleNamespace

    from hf_qknorm.attention.interface import qknorm_attention_forward

    q, k = torch.randn(1, 2, 5, 16), torch.randn(1, 2, 5, 16)
    v = torch.randn(1, 2, 5, 12)
    with pytest.raises(ValueError, match="value heads as wide as the query and key heads; this call's are 12 and 16"):
        qknorm_attention_forward(SimpleNamespace(is_causal=True), q, k, v, None)


def test_a_model_the_auto_classes_cannot_build_is_patched_verified_and_its_conversion_refused(tmp_path):
    """Evolla's config class maps back to another model type (``EvollaModel``) than the one Transformers' Auto
    classes hold it under, so ``AutoModelForImageTextToText`` neither builds nor loads it: the tiny builder uses its
    own class, ``verify`` passes on it patched (its generation settings turn the cache off; the cached probes turn it
    on, where they recorded every step's whole sequence and failed), and a conversion -- whose folder could not be
    loaded -- is refused in one line before any work, naming why."""
    import transformers
    from packaging.version import Version

    from hf_qknorm.conversion.orchestration.source import inspect_source
    from hf_qknorm.upstream import NEWEST_TESTED

    if Version(transformers.__version__) < Version(NEWEST_TESTED):  # Evolla's config and classes differ before
        pytest.skip(f"Evolla as Transformers {NEWEST_TESTED} ships it")
    from hf_qknorm.modeling.saved import unbuildable_reason

    model = tiny_model("evolla")
    assert unbuildable_reason(model.config) is not None
    assert model.generation_config.use_cache is False
    hf_qknorm.patch_model(model, "qk_norm_cap", softcap=2.0)
    report = hf_qknorm.verify(model)
    assert report.ok, str(report)
    assert any(c.probe.startswith("cache") for c in report.checks)
    source = tmp_path / "plain"
    tiny_model("evolla").save_pretrained(source)
    with pytest.raises(UnsupportedModelError, match="does not load through the Auto classes"):
        inspect_source(source)


def test_a_drafter_that_reads_its_target_models_keys_is_refused_when_patched():
    """Gemma 4's assistant (a draft model for speculative decoding) attends over the keys and values its target
    model computed: ``patch_model`` on one (its config made valid: no per-layer inputs, every layer shared) refuses
    it in one line, leaving it as it was."""
    _skip_unless_known("gemma4_assistant")
    from transformers import Gemma4AssistantConfig, Gemma4AssistantForCausalLM

    text = tiny_config("gemma4_text")
    text.hidden_size_per_layer_input = text.vocab_size_per_layer_input = 0
    text.enable_moe_block = text.use_double_wide_mlp = False
    config = Gemma4AssistantConfig(
        text_config=text.to_dict(), backbone_hidden_size=64, num_centroids=8, centroid_intermediate_top_k=2
    )
    model = Gemma4AssistantForCausalLM(config)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(UnsupportedModelError, match="draft model for Gemma 4's speculative decoding"):
        hf_qknorm.patch_model(model, "qk_norm")
    assert model.state_dict().keys() == before.keys() and getattr(model.config, "qknorm", None) is None
