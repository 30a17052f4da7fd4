"""The image checks the coverage table (:mod:`.coverage`) makes of a multimodal (image-text-to-text) type whose tiny
image inputs :data:`.tiny.MULTIMODAL` builds: the vision tower's features after patching bit-identical to the
unpatched model's (``patch_model`` patches the language model only), and an image forward and backward finite."""

from __future__ import annotations

import torch

TEXT_KEYS = ("input_ids", "token_type_ids", "mm_token_type_ids")  # the inputs that are not the images'


def image_features(model) -> list[torch.Tensor]:
    """The vision tower's features (after the projector) for the tiny image inputs, as a list of tensors."""
    from .tiny import image_text_inputs, vision_features

    return vision_features(model, {k: v for k, v in image_text_inputs(model).items() if k not in TEXT_KEYS})


def image_failures(model, want: list[torch.Tensor]) -> dict[str, str]:
    """Check name -> failure: ``vision`` when the features differ from ``want`` (the unpatched model's), ``images``
    when an image forward and backward (labels = the input ids) is not finite."""
    from .tiny import image_text_inputs

    out = {}
    model.eval()
    got = image_features(model)
    if len(got) != len(want) or not all(torch.equal(a, b) for a, b in zip(got, want)):
        out["vision"] = "the vision tower's features changed"
    inputs = image_text_inputs(model)
    model.train()
    try:
        loss = model(**inputs, labels=inputs["input_ids"], use_cache=False).loss
        loss.backward()
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        if not torch.isfinite(loss) or not grads or not all(torch.isfinite(g).all() for g in grads):
            out["images"] = "image forward/backward not finite"
    finally:
        model.eval()
    return out
