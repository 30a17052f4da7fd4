"""``hf-qknorm`` command line: ``demo``, ``inspect``, ``info`` (and the subcommands other modules add).

Each subcommand lives in a function ``_cmd_<name>`` with its parser built in ``_add_<name>``; modules that own a
feature (conversion, Hub push, benchmarks) register theirs through :data:`EXTRA_COMMANDS`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

# (name, add_parser(subparsers) -> parser, run(args) -> int). Feature modules append here.
EXTRA_COMMANDS: list[tuple[str, object, object]] = []


def _add_demo(sub):
    p = sub.add_parser("demo", help="patch a tiny Llama built from a config and show what changed",
                       description="Build a tiny Llama (no download), patch it with a scheme, and print the new "
                                   "modules, parameters and attention backend, plus a forward/backward check.")
    p.add_argument("--scheme", default="qk_norm_cap", help="qk_norm | soft_cap | qk_norm_cap | qkv_norm")
    p.add_argument("--norm", default=None, help="layernorm (default) | rmsnorm | l2 | lp")
    p.add_argument("--softcap", type=float, default=None, help="cap c in c*tanh(s/c) (default 50 for capped)")
    p.add_argument("--p", type=float, default=None, help="exponent of the lp norm")
    return p


def _cmd_demo(args) -> int:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    import hf_qknorm

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    model = LlamaForCausalLM(cfg).eval()
    before = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    ids = torch.randint(0, 256, (2, 24))
    logits_before = model(ids).logits
    hf_qknorm.patch_model(model, args.scheme, norm=args.norm, softcap=args.softcap, p=args.p)
    after = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    print(f"patched with {hf_qknorm.qknorm_config(model)}")
    print(f"class: {type(model).__name__}, config.model_type: {model.config.model_type}, "
          f"attention backend: {model.config._attn_implementation}")
    print("added parameters:")
    for k in sorted(set(after) - set(before)):
        print(f"  + {k} {after[k]}")
    for k in sorted(set(before) - set(after)):
        print(f"  - {k} {before[k]}")
    loss = model(ids, labels=ids).loss
    loss.backward()
    change = (model(ids).logits - logits_before).abs().max().item()
    print(f"loss {loss.item():.4f} (finite, gradients flow); max |logit change| from patching: {change:.4g}")
    return 0


def _add_inspect(sub):
    p = sub.add_parser("inspect", help="show the scheme and norm statistics of a saved (patched) model folder")
    p.add_argument("path", type=Path)
    return p


def _cmd_inspect(args) -> int:
    cfg_file = args.path / "config.json"
    if not cfg_file.is_file():
        print(f"error: {args.path} has no config.json (not a saved model folder)", file=sys.stderr)
        return 2
    cfg = json.loads(cfg_file.read_text())
    print(f"model_type: {cfg.get('model_type')}")
    print(f"architectures: {cfg.get('architectures')}")
    print(f"qknorm: {json.dumps(cfg.get('qknorm'))}")
    return 0


def _add_info(sub):
    return sub.add_parser("info", help="list supported families, schemes and norms, and the kernel status")


def _cmd_info(args) -> int:
    import hf_qknorm

    print("families:", ", ".join(sorted(hf_qknorm.FAMILIES)))
    print("schemes: ", ", ".join(hf_qknorm.SCHEMES))
    print("norms:   ", ", ".join(hf_qknorm.NORMS))
    try:
        from hf_qknorm import kernels

        reason = kernels.unavailable_reason()
        print("triton kernels:", "available" if reason is None else f"unavailable ({reason})")
    except Exception as exc:  # kernels are optional; say why they cannot be used
        print(f"triton kernels: unavailable ({exc})")
    return 0


def build_parser() -> tuple[argparse.ArgumentParser, dict]:
    parser = argparse.ArgumentParser(prog="hf-qknorm", description="QK-norm, softmax capping and QKV-norm for "
                                     "Hugging Face Transformers models.")
    sub = parser.add_subparsers(dest="command", required=True)
    runners = {}
    from ..verification import command as verify_command

    for name, add, run in [("demo", _add_demo, _cmd_demo), ("inspect", _add_inspect, _cmd_inspect),
                           ("info", _add_info, _cmd_info), (verify_command.NAME, verify_command.add_parser,
                                                            verify_command.run), *_extra_commands()]:
        add(sub)
        runners[name] = run
    return parser, runners


def _extra_commands():
    import importlib

    for module in ("hf_qknorm.cli.convert",):  # feature modules that add subcommands
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as exc:
            if exc.name != module:
                raise
    return EXTRA_COMMANDS


def main(argv: list[str] | None = None) -> int:
    parser, runners = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(runners[args.command](args) or 0)
    except (ValueError, FileNotFoundError, FileExistsError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
