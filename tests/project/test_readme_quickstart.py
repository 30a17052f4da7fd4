"""The README's quick start runs as pasted: its Python blocks, in order, in one namespace, in an empty folder."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

README = Path(__file__).resolve().parents[2] / "README.md"


def _quick_start_code() -> str:
    text = README.read_text()
    section = text[text.index("## Quick start") : text.index("Convert a pretrained checkpoint")]
    blocks = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    assert len(blocks) >= 2, "the quick start lost its Python blocks"
    return "\n".join(blocks)


@pytest.mark.slow
def test_the_quick_start_runs_as_pasted(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    scope: dict = {}
    exec(compile(_quick_start_code(), str(README), "exec"), scope)
    out = capsys.readouterr().out
    assert out.rstrip().splitlines()[0].startswith("hf_qknorm verify:") and "\nOK" in out
    import hf_qknorm

    model = scope["model"]  # reloaded from "out": the patched, trained model
    assert hf_qknorm.qknorm_config(model).scheme == "qk_norm_cap" and (tmp_path / "out" / "config.json").is_file()
    assert scope["trainer"].state.global_step == 4
    ids = torch.tensor([[1, 2, 3, 4]])
    torch.testing.assert_close(model(ids).logits, scope["trainer"].model.eval()(ids).logits, rtol=0, atol=0)
