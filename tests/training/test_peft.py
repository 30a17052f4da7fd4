"""LoRA on a patched model: targets and trainable norms, the LoRA delta goes through the norm, merge_and_unload gives
a plain patched model that saves and loads."""

from __future__ import annotations

import pytest
import torch

import hf_qknorm
from hf_qknorm.training.lora import lora_target_modules, trainable_norm_modules
from tests._support.tiny_models import VOCAB, tiny_model


def _ids(seed=0, batch=2, seq=12):
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))


def _patched(family, scheme="qk_norm", norm="layernorm", **kw):
    model = tiny_model(family, **kw)
    hf_qknorm.patch_model(model, scheme, norm=norm, p=3.0 if norm == "lp" else None)
    return model


def test_config_targets_attention_and_saves_norms():
    llama = _patched("llama")
    cfg = hf_qknorm.lora_config(llama, r=4)
    assert cfg.modules_to_save == ["q_norm", "k_norm"] and cfg.r == 4
    gpt2 = _patched("gpt2", "qkv_norm")
    cfg = hf_qknorm.lora_config(gpt2)
    assert cfg.fan_in_fan_out and cfg.modules_to_save == ["q_norm", "k_norm", "v_norm"]
    peft_gpt2 = hf_qknorm.prepare_lora(gpt2)
    wrapped = {n.rsplit(".", 1)[0] for n, _ in peft_gpt2.named_parameters() if "lora_A" in n}
    assert wrapped and all(".attn.c_attn" in n or ".attn.c_proj" in n for n in wrapped)  # not mlp.c_proj
    assert trainable_norm_modules(_patched("llama", norm="lp")) == ["q_norm"]  # the lp key norm has no parameter
    assert trainable_norm_modules(tiny_model("qwen2")) == [] and "q_proj" in lora_target_modules(tiny_model("qwen2"))


def test_lora_delta_passes_through_the_norm():
    """A LoRA-adapted query is normalised: q_norm sees base(x) + scale * B A x, and every query head the backend
    receives has unit RMS (rmsnorm, weight 1; RoPE is a rotation) however large the delta."""
    model = hf_qknorm.prepare_lora(_patched("llama", norm="rmsnorm", dtype=torch.float64), r=4, lora_alpha=8)
    model.set_attn_implementation("qknorm")  # the backend that calls the probe below
    attn = model.base_model.model.model.layers[0].self_attn
    with torch.no_grad():
        attn.q_proj.lora_B["default"].weight.normal_(0, 5.0)
    seen = {}
    attn.q_proj.register_forward_pre_hook(lambda m, args: seen.update(x=args[0]))
    attn.q_norm.register_forward_hook(lambda m, args, out: seen.update(norm_in=args[0]))
    attn._qknorm_probes = {"test": lambda a, q, k, **kw: seen.update(q=q)}
    model(_ids())
    base = attn.q_proj.base_layer.weight
    a, b = attn.q_proj.lora_A["default"].weight, attn.q_proj.lora_B["default"].weight
    delta = seen["x"] @ a.T @ b.T * (8 / 4)
    assert delta.abs().max() > 10 * (seen["x"] @ base.T).abs().max()  # the delta dominates...
    y = seen["x"] @ base.T + delta  # ...and base(x) + delta goes into the norm
    torch.testing.assert_close(seen["norm_in"], y.view_as(seen["norm_in"]))
    rms = seen["q"].pow(2).mean(-1).sqrt()  # (B, H, T): after the norm and RoPE
    torch.testing.assert_close(rms, torch.ones_like(rms), rtol=1e-5, atol=1e-5)


def _train_a_little(model, steps=3):
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model.train()
    for t in range(steps):
        ids = _ids(t)
        model(ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    model.eval()


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_norms_train_and_merge_gives_a_plain_patched_model(family, tmp_path):
    from transformers import AutoModelForCausalLM

    model = hf_qknorm.prepare_lora(_patched(family, "qk_norm_cap"), r=4)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n or "_norm.modules_to_save" in n for n in trainable)
    assert any("q_norm.modules_to_save" in n for n in trainable)
    _train_a_little(model)
    norm_w = [p for n, p in model.named_parameters() if "q_norm.modules_to_save" in n and n.endswith("weight")][0]
    assert not torch.allclose(norm_w, torch.ones_like(norm_w))  # the norm weights trained
    adapter = model.state_dict()
    assert any("q_norm" in k for k in adapter)

    ids = _ids(5)
    with torch.no_grad():
        expected = model(ids).logits
    merged = model.merge_and_unload()
    assert hf_qknorm.is_patched(merged) and type(merged.config).__name__.startswith("QKNorm")
    assert not any("lora_" in n or "modules_to_save" in n for n, _ in merged.named_parameters())
    with torch.no_grad():
        torch.testing.assert_close(merged(ids).logits, expected, rtol=1e-5, atol=1e-5)
    merged.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert loaded.config.model_type == f"qknorm_{family}"
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, expected, rtol=1e-5, atol=1e-5)
    key = [k for k in loaded.state_dict() if k.endswith("q_norm.weight")][0]
    torch.testing.assert_close(loaded.state_dict()[key], merged.state_dict()[key])
