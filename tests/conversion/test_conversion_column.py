"""The coverage table's conversion column: each patched type's tiny checkpoint converted and reloaded without the
plugin, a scheme patching refuses refused with patching's reason, and a folder that computes something else without
the plugin a FAIL."""

from __future__ import annotations

import pytest

from hf_qknorm.conversion.orchestration import coverage as conversions
from hf_qknorm.verification import coverage as cov
from hf_qknorm.verification import plain


@pytest.mark.spawns
def test_the_conversion_column_says_what_converts_and_what_is_refused():
    phi, bloom = cov.coverage(["phi", "bloom"], chunk_hook=conversions.add_conversions)
    assert phi.status == cov.PATCHED and phi.conversion == conversions.CONVERTED
    assert set(phi.conversion_variants) == {conversions.variant_key(s, n) for s, n in conversions.VARIANTS}
    assert phi.conversion_variants["qkv_norm/layernorm"] == "refused: " + phi.variants["qkv_norm/layernorm"][9:]
    assert "parallel block" in phi.conversion_note and "remote code" in phi.conversion_note
    assert all(v.startswith("ok (remote code") for k, v in phi.conversion_variants.items() if k != "qkv_norm/layernorm")
    assert bloom.status == cov.REFUSED and bloom.conversion == ""  # patching refuses it: nothing to convert
    table = cov.markdown([phi, bloom], "Transformers x")
    assert "| `phi` | patched |" in table and "| converted |" in table and "| `bloom` | refused |" in table
    assert cov.failing([phi, bloom]) == 0 and "Conversion: 1 of 1 patched types converted" in cov.summary([phi, bloom])


@pytest.mark.spawns
def test_a_folder_that_computes_otherwise_without_the_plugin_fails_the_column(monkeypatch):
    real = plain.logits_without_plugin

    def shifted(jobs, **kwargs):
        out = real(jobs, **kwargs)
        for row in out.values():
            row["logits"] = row["logits"] + 1e-2 * row["logits"].abs().max()
        return out

    monkeypatch.setattr(plain, "logits_without_plugin", shifted)
    got = conversions.check_conversions(["llama"], variants=(("qk_norm", "rmsnorm"), ("qk_norm_cap", "layernorm")))
    result = got["llama"]
    assert result.status == conversions.FAIL and "without the plugin, logits differ" in result.reason
    assert result.variants["qk_norm/rmsnorm"].startswith("FAIL") and result.variants[
        "qk_norm_cap/layernorm"
    ].startswith("FAIL")


@pytest.mark.spawns
def test_a_model_in_sections_keeps_a_layer_in_each_and_converts():
    """Dory runs input layers, then recurrent layers in loops, then output layers: its tiny model keeps one layer in
    each section (so the loops run), and the conversion's probe of the source's first layers cuts the sections with
    the layer count (Dory's config refuses counts that do not add up)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    from hf_qknorm.verification.tiny import tiny_config

    if "dory" not in CONFIG_MAPPING:
        pytest.skip("no Dory in this Transformers")
    config = tiny_config("dory")
    assert (config.n_input_layers, config.n_recurrent_layers, config.n_output_layers) == (1, 1, 1)
    assert config.num_hidden_layers == 3 and len(set(config.layer_types)) == 2  # sliding and full attention
    config.validate_architecture()
    got = conversions.check_conversions(["dory"], variants=(("qk_norm", "rmsnorm"), ("qk_norm_cap", "layernorm")))
    assert got["dory"].status == conversions.CONVERTED, got["dory"].reason
