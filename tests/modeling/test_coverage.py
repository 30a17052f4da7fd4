"""Coverage beyond the first five families: model types patched from their structure, the patch-time self-check
refusing what would be silently wrong (and failing when the model is made to misbehave), the quirks folded right,
and the coverage table. Expected values come from the models' own tensors and plain formulas, never from the code
under test."""

from __future__ import annotations

import json

import pytest
import torch

import hf_qknorm
from hf_qknorm import UnsupportedModelError
from hf_qknorm.verification import coverage as cov
from hf_qknorm.verification.tiny import tiny_model
from tests.modeling.test_export import run_without_plugin

# A representative sample that CI checks with every scheme x norm (the whole table: `hf-qknorm coverage`):
# mixture of experts, 1 + w norms and native caps, native per-head norms (some carried as 1 + w), whole-projection
# norms, partial rotary, parallel blocks, fused projections (GQA, multi-query, per-head interleaved), post-norm
# blocks, layers without RoPE, attention multipliers, attention sinks.
SAMPLE = (
    "mixtral",
    "qwen3_moe",
    "olmoe",
    "gemma",
    "gemma2",
    "gemma3_text",
    "olmo2",
    "phi",
    "phi3",
    "gpt_neox",
    "gpt_bigcode",
    "persimmon",
    "smollm3",
    "granite",
    "cohere",
    "gpt_oss",
    "falcon_h1",  # attention and a state-space mixer side by side in every block; blocks returning tuples
)


@pytest.mark.parametrize("model_type", SAMPLE)
def test_sample_model_types_are_patched_with_every_variant(model_type):
    result = cov.check_model_type(model_type)
    if result.status == cov.UNTESTED and result.reason.startswith("its config cannot be built"):
        pytest.skip(f"{model_type}: {result.reason} in this Transformers")  # 5.4's OLMo 2 / OLMoE configs
    assert result.status == cov.PATCHED, (result.reason, result.variants)
    accepted = [k for k, v in result.variants.items() if v == "ok"]
    assert len(accepted) >= 9 and all(k.startswith("qkv_norm") for k in result.variants if k not in accepted)


@pytest.mark.parametrize(
    "model_type, status, words",
    [
        ("llama4_text", cov.REFUSED, "q rows at the attention backend"),  # an L2 norm after RoPE undoes ours
        ("nanochat", cov.REFUSED, "after RoPE"),  # its own q/k norm sits after RoPE
        ("bloom", cov.REFUSED, "computes attention in its own code"),  # ALiBi, no attention interface
        ("codegen", cov.REFUSED, "model-parallel groups"),
        ("chameleon", cov.REFUSED, "a gain per head"),  # its own q/k norms' weights are (heads, head_dim)
        ("git", cov.REFUSED, "BERT-style"),  # its forward needs images for a loss; refused before that matters
        ("reformer", cov.OUT_OF_SCOPE, "locality-sensitive hashing"),  # no causal LM from its default config
        ("idefics", cov.OUT_OF_SCOPE, "several stacks"),  # its forward needs images; the structure says it first
        ("lfm2_moe", cov.OUT_OF_SCOPE, "hybrid model"),  # refused once its layers are found: out of scope all the same
        ("diffusion_gemma", cov.OUT_OF_SCOPE, "block-diffusion"),  # a multimodal type whose decoder attends both ways
        ("pi0", cov.OUT_OF_SCOPE, "vision-language-action"),  # refused before its (patchable) language model is sought
        ("mamba", cov.OUT_OF_SCOPE, "no softmax self-attention"),
        ("bart", cov.OUT_OF_SCOPE, "encoder-decoder"),
    ],
)
def test_what_cannot_be_patched_exactly_is_refused_with_the_reason(model_type, status, words):
    result = cov.check_model_type(model_type)
    if result.status == cov.UNTESTED and result.reason.startswith(("its config cannot be built", "no tiny model")):
        pytest.skip(f"{model_type}: {result.reason} in this Transformers")  # 5.4's Chameleon, 5.17's Diffusion Gemma
    assert result.status == status and words in result.reason and model_type in result.reason


def test_a_refused_patch_leaves_the_model_as_it_was():
    model = tiny_model("llama4_text")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    config, classes = model.config, [type(m) for m in model.modules()]
    with pytest.raises(UnsupportedModelError, match="llama4_text"):
        hf_qknorm.patch_model(model, "qk_norm_cap")
    assert model.config is config and not hasattr(config, "qknorm")
    assert [type(m) for m in model.modules()] == classes
    after = model.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    assert not any(k.startswith("_qknorm") for m in model.modules() for k in m.__dict__)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_self_check_refuses_a_transform_between_projection_and_backend(monkeypatch, dtype):
    """The check can fail: make Llama's RoPE step add a constant to q (not a rotation, so it does not commute with
    a per-row scale) and the patch is refused, in bf16 too; undone, the same model patches."""
    from transformers.models.llama import modeling_llama

    rotary = modeling_llama.apply_rotary_pos_emb

    def shifted(q, k, cos, sin, *args, **kwargs):
        q, k = rotary(q, k, cos, sin, *args, **kwargs)
        return q + 0.5, k

    monkeypatch.setattr(modeling_llama, "apply_rotary_pos_emb", shifted)
    with pytest.raises(UnsupportedModelError, match="q rows at the attention backend"):
        hf_qknorm.patch_model(tiny_model("llama", dtype=dtype), "qk_norm")
    monkeypatch.setattr(modeling_llama, "apply_rotary_pos_emb", rotary)
    hf_qknorm.patch_model(tiny_model("llama", dtype=dtype), "qk_norm")


def test_self_check_refuses_a_fused_projection_split_the_wrong_way(monkeypatch):
    """GPT-NeoX's fused output is per head [q_h k_h v_h]; split as [q | k | v] the norms land on the wrong parts."""
    from hf_qknorm.portable import families

    monkeypatch.setitem(families.QUIRKS, "gpt_neox", {})
    with pytest.raises(UnsupportedModelError, match="gpt_neox"):
        hf_qknorm.patch_model(tiny_model("gpt_neox"), "qk_norm")


def test_self_check_refuses_a_cap_the_backend_would_not_apply(monkeypatch):
    """A backend rule that let the model's own softcap= win would apply Gemma 2's 50, not the scheme's 5."""
    from hf_qknorm.modeling import selfcheck

    monkeypatch.setattr(selfcheck, "effective_softcap", lambda module, passed: passed)
    with pytest.raises(UnsupportedModelError, match="not the scheme's 5.0"):
        hf_qknorm.patch_model(tiny_model("gemma2"), "qk_norm_cap", softcap=5.0)


def test_what_spells_out_llama_style_attention_refuses_other_types():
    """The q/k telemetry off the "qknorm" backend knows the attention math of five types; another patched type is
    refused, in one line naming it, never computed wrongly -- while verify's float64 reference, derived from the
    structure, checks it (its refusals: tests/verification/test_families.py)."""
    from hf_qknorm.modeling.telemetry import LogitTap

    model = hf_qknorm.patch_model(tiny_model("mixtral"), "qk_norm")  # uncapped: stays on sdpa
    report = hf_qknorm.verify(model, generate=False)
    assert report.ok, str(report)
    with pytest.raises(NotImplementedError, match="for model type 'mixtral' run the model on 'qknorm'"):
        LogitTap(model, lambda *a: None).attach()
    model.set_attn_implementation("qknorm")
    seen = []
    tap = LogitTap(model, lambda index, *a: seen.append(index))
    tap.attach()
    with torch.no_grad():
        model(torch.tensor([[1, 2, 3]]))
    tap.detach()
    assert seen == [0, 1]  # on "qknorm" the backend itself hands over what it attends over


def test_gemma_qkv_norm_folds_one_plus_w():
    """Gemma's RMSNorm multiplies by 1 + w: the fold scales the projections' input channels by 1 + w (not w)."""
    model = tiny_model("gemma")
    block = model.model.layers[0]
    with torch.no_grad():
        block.input_layernorm.weight.copy_(torch.linspace(-0.5, 0.5, block.input_layernorm.weight.numel()))
    w = block.input_layernorm.weight.detach().clone()
    wq = block.self_attn.q_proj.weight.detach().clone()
    hf_qknorm.patch_model(model, "qkv_norm", norm="rmsnorm")
    torch.testing.assert_close(block.self_attn.q_proj.weight, wq * (1 + w)[None, :])
    assert isinstance(block.input_layernorm, torch.nn.Identity)


def test_a_native_one_plus_w_gain_is_carried_as_such():
    """Gemma 3's own q norm computes (1 + w) * n(q): the rmsnorm scheme norm that takes its place starts at 1 + w,
    so the patched layer's queries are the original's."""
    model = tiny_model("gemma3_text")
    attn = model.model.layers[0].self_attn
    with torch.no_grad():
        attn.q_norm.weight.copy_(torch.linspace(-0.3, 0.3, attn.q_norm.weight.numel()))
    w = attn.q_norm.weight.detach().clone()
    hf_qknorm.patch_model(model, "qk_norm", norm="rmsnorm")
    torch.testing.assert_close(attn.q_norm.weight.detach(), 1 + w)


def test_a_native_layernorms_bias_is_carried_and_a_norm_without_one_warns(caplog):
    """Persimmon's own per-head LayerNorms have a bias: the layernorm scheme norm takes gain and bias, so the patched
    model computes the original's logits; rmsnorm has no bias to take it and says it is dropped."""
    import logging

    ids = torch.randint(3, 100, (1, 12), generator=torch.Generator().manual_seed(0))
    gen = torch.Generator().manual_seed(1)
    for norm in ("layernorm", "rmsnorm"):
        model = tiny_model("persimmon")
        with torch.no_grad():
            for name, prm in model.named_parameters():
                if "q_layernorm" in name or "k_layernorm" in name:
                    prm.add_(0.3 * torch.randn(prm.shape, generator=gen))
            before = model(ids).logits
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="hf_qknorm"):
            hf_qknorm.patch_model(model, "qk_norm", norm=norm)
        dropped = [r for r in caplog.records if "q/k norm bias" in r.getMessage()]
        if norm == "layernorm":
            with torch.no_grad():
                torch.testing.assert_close(model(ids).logits, before, rtol=1e-5, atol=1e-5)
            assert not dropped
        else:
            assert dropped and "norm='layernorm'" in dropped[0].getMessage()


def test_whole_projection_norms_are_kept_and_the_scheme_norm_follows():
    """OLMo 2 normalises the whole q projection: that norm stays, and the scheme's per-head norm goes after it."""
    try:
        model = tiny_model("olmo2")
    except Exception as exc:  # Transformers 5.4's Olmo2Config cannot be built with its own defaults
        pytest.skip(f"no OLMo 2 model in this Transformers ({type(exc).__name__})")
    attn = model.model.layers[0].self_attn
    native = attn.q_norm
    hf_qknorm.patch_model(model, "qk_norm", norm="rmsnorm")
    assert attn.q_norm is native and isinstance(attn.qknorm_q_norm, hf_qknorm.portable.norms.HeadRMSNorm)
    x = torch.randn(1, 3, model.config.hidden_size)
    q = attn.q_proj(x)  # the hooks sit on the kept norm, so q_proj's output is untouched
    heads = attn.q_norm(q).view(1, 3, -1, attn.head_dim)
    expected = heads * torch.rsqrt(heads.pow(2).mean(-1, keepdim=True) + attn.qknorm_q_norm.eps)
    torch.testing.assert_close(attn.q_norm(q).view_as(expected), expected)


@pytest.mark.spawns
def test_a_new_model_type_saves_and_loads_with_and_without_the_plugin(tmp_path):
    """InternLM3 shares Llama's class names: the saved folder names its own base model type."""
    from transformers import AutoModelForCausalLM
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    for model_type in [t for t in ("internlm3", "mixtral") if t in CONFIG_MAPPING_NAMES]:  # internlm3: 5.23's
        model = hf_qknorm.patch_model(tiny_model(model_type), "qk_norm_cap")
        folder = tmp_path / model_type
        model.save_pretrained(folder)
        ids = torch.tensor([[1, 5, 9, 2, 7]])
        with torch.no_grad():
            want = model(ids).logits
        loaded = AutoModelForCausalLM.from_pretrained(folder).eval()
        with torch.no_grad():
            torch.testing.assert_close(loaded(ids).logits, want)
        (tmp_path / f"{model_type}_remote").mkdir()
        out = run_without_plugin(
            tmp_path / f"{model_type}_remote",
            [{"name": model_type, "path": str(folder), "remote": True, "ids": ids.tolist(), "mask": [[1] * 5]}],
        )
        torch.testing.assert_close(out[model_type]["logits"], want, rtol=1e-4, atol=1e-5)


@pytest.mark.spawns
def test_coverage_command_prints_the_table_and_refuses_unknown_types(tmp_path, capsys):
    from hf_qknorm.cli.main import main

    assert main(["coverage", "llama", "mamba", "--json", str(tmp_path / "c.json")]) == 0
    out = capsys.readouterr().out
    assert "llama" in out and "patched" in out and "out of scope" in out
    rows = {r["model_type"]: r for r in json.loads((tmp_path / "c.json").read_text())}
    assert rows["llama"]["status"] == "patched" and len(rows["llama"]["variants"]) == 13
    assert main(["coverage", "not_a_model"]) == 2
    assert "not_a_model" in capsys.readouterr().err


def test_coverage_command_takes_a_comma_separated_list(tmp_path, capsys):
    """``mamba,rwkv bert`` names three types, as ``mamba rwkv bert`` does (types refused before any model is built:
    the test above builds one); an empty list is refused in one line."""
    from hf_qknorm.cli.main import main

    assert main(["coverage", "mamba,rwkv", "bert", "--json", str(tmp_path / "c.json")]) == 0
    rows = {r["model_type"]: r["status"] for r in json.loads((tmp_path / "c.json").read_text())}
    assert rows == {"mamba": "out of scope", "rwkv": "out of scope", "bert": "out of scope"}
    capsys.readouterr()
    assert main(["coverage", ","]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no model type in ','" in err[0]


def test_a_reason_keeps_what_a_first_line_ending_in_a_colon_announces():
    """A missing package's error ("... You can install it with pip:" then the command) is reported with the command;
    any other message by its first line, at most 300 characters."""
    missing = ImportError("X requires the timm library. You can install it with pip:\n`pip install timm`.\nMore.")
    assert cov._line(missing) == "X requires the timm library. You can install it with pip: `pip install timm`."
    assert cov._line(ValueError("first\nsecond")) == "first"
    assert cov._line(ValueError("x" * 400)) == "x" * 300
    assert cov._line(ValueError("")) == "ValueError"
