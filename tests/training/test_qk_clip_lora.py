"""QK-Clip on a peft LoRA model changes only what training changes and the adapter saves.

The fault this guards (issue 27): a clip that rescales the frozen base weights (``q_proj.base_layer.weight``, the
``original_module`` copies of the norms) edits what the saved adapter does not hold, so base + adapter differs from
the trained model, and the adapter-disabled model -- the reference model of DPO, KTO, GRPO -- drifts from the base.
Under LoRA the clip scales only the trained ``modules_to_save`` copies of the q/k norm gains, and refuses a model
whose logits only frozen weights set.
"""

from __future__ import annotations

import pytest
import torch

import hf_qknorm
from tests._support.tiny_models import VOCAB, tiny_model

TAU = 1.0  # below the tiny model's largest logits (about 2): every step clips


def _patched(seed=0):
    return hf_qknorm.patch_model(tiny_model("llama", dtype=torch.float64, seed=seed), "qk_norm_cap")


def _ids(seed, batch=2, seq=16):
    return torch.randint(1, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))


def _logits(model, ids):
    model.eval()
    with torch.no_grad():
        return model(ids).logits


def test_saved_adapter_reloads_to_the_trained_model_and_the_disabled_adapter_is_the_base(tmp_path):
    from peft import PeftModel

    model = hf_qknorm.prepare_lora(_patched(), r=4)
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    assert any("base_layer" in n for n in frozen) and any("original_module" in n for n in frozen)
    clip = hf_qknorm.QKClip(model, tau=TAU)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    for step in range(3):
        model.train()
        ids = _ids(step)
        model(ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
        assert clip.step(), f"step {step} clipped nothing: raise the logits or lower TAU"
    for name, p in model.named_parameters():
        if name in frozen:
            assert torch.equal(p, frozen[name]), f"QK-Clip edited the frozen {name}"

    ids = _ids(9)
    model.save_pretrained(tmp_path / "adapter")
    reloaded = PeftModel.from_pretrained(_patched(), tmp_path / "adapter")
    torch.testing.assert_close(_logits(reloaded, ids), _logits(model, ids), rtol=0, atol=1e-12)
    with model.disable_adapter():
        disabled = _logits(model, ids)
    torch.testing.assert_close(disabled, _logits(_patched(), ids), rtol=0, atol=1e-12)


def test_shared_gains_bound_every_head_and_the_worst_one_exactly():
    """The trained norm gains are shared by a layer's heads, so every head's logits scale by the worst head's
    factor ``tau / S_max``: each head ends at ``S_h * tau / S_max`` -- the worst at ``tau`` as in Kimi's per-head
    rule, the others at ``max(S_h, tau) / S_max`` of Kimi's ``min(S_h, tau)``. Measured on layer 0 (its input does
    not change with the clip) by the monitor, not by the clip's own record."""
    model = hf_qknorm.prepare_lora(_patched(), r=4).train()
    clip = hf_qknorm.QKClip(model, tau=TAU)
    monitor = hf_qknorm.QKMonitor(model)
    ids = _ids(0)
    with monitor.record():
        model(ids)
    before = torch.tensor(monitor.head_max_logits[0], dtype=torch.float64)
    assert clip.step() and float(before.max()) > TAU
    with monitor.record():
        model(ids)
    after = torch.tensor(monitor.head_max_logits[0], dtype=torch.float64)
    torch.testing.assert_close(after, before * TAU / before.max(), rtol=1e-9, atol=0)
    kimi = torch.clamp(before, max=TAU)
    torch.testing.assert_close(after / kimi, torch.clamp(before, min=TAU) / before.max(), rtol=1e-9, atol=0)
    clip.close()


def test_a_lora_model_whose_logits_only_frozen_weights_set_is_refused():
    from peft import LoraConfig, get_peft_model

    unpatched = get_peft_model(tiny_model("llama"), LoraConfig(target_modules=["q_proj", "k_proj"], r=4))
    with pytest.raises(ValueError, match=r"layer 0 W_Q is frozen \(a LoRA base weight\?\).*patch the model with a"):
        hf_qknorm.QKClip(unpatched, tau=TAU)
    frozen_norms = hf_qknorm.prepare_lora(_patched(), r=4, train_norms=False)
    with pytest.raises(ValueError, match=r"layer 0's q_norm is frozen \(under LoRA: not in modules_to_save\)"):
        hf_qknorm.QKClip(frozen_norms, tau=TAU)
