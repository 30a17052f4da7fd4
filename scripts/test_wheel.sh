#!/usr/bin/env bash
# Build the wheel and sdist, install the wheel (not editable) into a fresh virtual environment and run the main job
# and a smoke test from it: proves the package data (bundled model and text, card template, remote code) and the
# native decoding op (setup.py) ship.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/_venv.sh  # PY: the project's environment (scripts/setup.sh)
$PY -m pip install -q --disable-pip-version-check build
rm -rf dist
$PY -m build -q --outdir dist . >/dev/null
ls dist
WHEEL=$(ls dist/hf_qknorm-*.whl)
WENV=$(mktemp -d)/venv
# torch and the other dependencies come from the project's environment; hf_qknorm itself from the wheel, installed
# into the new venv (whose own site-packages come first on sys.path)
lane_env "$WENV"
"$WENV/bin/python" -m pip install -q --disable-pip-version-check --no-deps "$WHEEL"
WORK=$(mktemp -d)
cd "$WORK"
"$WENV/bin/python" - "$WENV" <<'PY'
import sys
from pathlib import Path

import hf_qknorm

venv = Path(sys.argv[1]).resolve()
assert venv in Path(hf_qknorm.__file__).resolve().parents, f"imported {hf_qknorm.__file__}, not the wheel"
from hf_qknorm.data import bundled_model_dir, bundled_text
from hf_qknorm.conversion.output.hub import template_path
from hf_qknorm.modeling.remote import remote_files

assert (bundled_model_dir() / "model.safetensors").is_file() and bundled_text("tinyshakespeare")
assert template_path().is_file() and len(remote_files()) >= 10
from hf_qknorm.attention import native  # the optional native op: built where a C compiler is (CI has one)

assert native.MODULE is not None and Path(native.MODULE.__file__).resolve().is_relative_to(venv)
import torch
from transformers import LlamaConfig, LlamaForCausalLM

model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                     num_attention_heads=2, num_key_value_heads=1)).eval()
hf_qknorm.patch_model(model, "qk_norm_cap")
model.save_pretrained("saved")
from transformers import AutoModelForCausalLM

loaded = AutoModelForCausalLM.from_pretrained("saved").eval()
ids = torch.randint(0, 64, (1, 9))
torch.testing.assert_close(loaded(ids).logits, model(ids).logits)
print(f"wheel smoke test passed: hf_qknorm {hf_qknorm.__version__} from {Path(hf_qknorm.__file__).parent}")
PY
"$WENV/bin/hf-qknorm" convert --overwrite  # the main job's default: the bundled tiny Llama
test -f converted/tiny-llama-qk_norm_cap-layernorm/config.json
echo "main job from the wheel passed"
