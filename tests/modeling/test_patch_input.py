"""``patch_model`` given something that is not a loaded model says so in one line, naming what to do."""

from __future__ import annotations

from pathlib import Path

import pytest

import hf_qknorm


@pytest.mark.parametrize("given", ["HuggingFaceTB/SmolLM2-135M", Path("path/to/llama"), b"gpt2"])
def test_a_name_or_path_is_refused_with_the_loading_line(given):
    with pytest.raises(TypeError) as info:
        hf_qknorm.patch_model(given, scheme="qk_norm")
    message = str(info.value)
    assert "\n" not in message and "from_pretrained(" in message and "not the name or path" in message
    assert str(given) in message


@pytest.mark.parametrize("given", [None, 3, {"model": 1}])
def test_anything_else_is_refused_naming_its_type(given):
    with pytest.raises(
        TypeError, match=rf"^patch_model takes a loaded Transformers model .*not a {type(given).__name__}$"
    ):
        hf_qknorm.patch_model(given)
