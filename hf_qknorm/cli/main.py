"""``hf-qknorm`` command line: every subcommand is a row of :data:`COMMANDS`, ``(name, add_parser, run)``.

``demo``, ``inspect`` and ``info`` are small and live here; ``verify`` (:mod:`.verify`), ``convert`` and ``push``
(:mod:`.convert`) and ``coverage`` (:mod:`.coverage`) in their own modules, which never import this one.

Every subcommand reports a failure as one line on stderr, ``error: ...``, and an exit status
(:data:`EXIT_CODES`); ``--debug`` (before or after the subcommand) adds the traceback.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from pathlib import Path

from . import convert, coverage, verify
from .errors import EXIT_CODES, OneLineParser, describe


def _add_demo(sub):
    p = sub.add_parser(
        "demo",
        help="patch a tiny Llama built from a config and show what changed",
        description="Build a tiny Llama (no download), patch it with a scheme, and print the new "
        "modules, parameters and attention backend, plus a forward/backward check.",
    )
    from ..portable.schemes import QKNormConfig
    from .fields import add_fields

    add_fields(p, QKNormConfig, exclude=("eps",))
    return p


def _cmd_demo(args) -> int:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    import hf_qknorm

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    model = LlamaForCausalLM(cfg).eval()
    before = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    ids = torch.randint(0, 256, (2, 24))
    logits_before = model(ids).logits
    from .fields import from_args

    cfg = from_args(hf_qknorm.QKNormConfig, args)
    hf_qknorm.patch_model(model, cfg)
    after = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    print(f"patched with {hf_qknorm.qknorm_config(model)}")
    print(
        f"class: {type(model).__name__}, config.model_type: {model.config.model_type}, "
        f"attention backend: {model.config._attn_implementation}"
    )
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
    p = sub.add_parser(
        "inspect",
        help="show the scheme and per-layer norm weight statistics of a saved model folder",
        description="Print a saved folder's model type, architectures and qknorm scheme, and for every "
        "layer the statistics (mean, std, min, max) of its q/k/v norm weights and biases, "
        "read from the safetensors files (no model is built), each checked against the "
        "scheme: a missing, unexpected, misshapen or non-float norm tensor is flagged and "
        "the exit status is 1.",
    )
    p.add_argument("path", type=Path, help="saved model folder (config.json and *.safetensors)")
    return p


def _cmd_inspect(args) -> int:
    from .inspect import folder_summary

    text, flagged = folder_summary(args.path)
    print(text)
    return EXIT_CODES["check"] if flagged else 0


def _add_info(sub):
    return sub.add_parser("info", help="list supported families, schemes and norms, and the kernel status")


def _cmd_info(args) -> int:
    import hf_qknorm
    from hf_qknorm.kernels import tanh_mode

    # the environment switches first: a value one does not know is the command's one-line error, before any output
    tanh, native, fused, tma = tanh_mode(), _native_state(), _fused_norms_state(), _tma_state()
    print(
        "models:   every decoder-only softmax-attention text model type, checked at patch time "
        "(`hf-qknorm coverage` lists them)"
    )
    print("schemes: ", ", ".join(hf_qknorm.SCHEMES))
    print("norms:   ", ", ".join(hf_qknorm.NORMS))
    try:
        from hf_qknorm import kernels

        reason = kernels.unavailable_reason()
        print("triton kernels:", "available" if reason is None else f"unavailable ({reason})")
    except Exception as exc:  # kernels are optional; say why they cannot be used
        print(f"triton kernels: unavailable ({exc})")
    print(f"capped tanh:    {tanh} (tanh.approx.f32 for fp16/bf16 on CUDA; HF_QKNORM_EXACT_TANH=1: exact)")
    print("native CPU op: ", native)
    print("fused norms:   ", fused)
    print("TMA forward:   ", tma)
    from hf_qknorm.attention import delegate

    package, delegation = delegate.describe()
    print(f"flash-attn:     {package}")
    print(f"delegation:     {delegation}")
    from hf_qknorm.upstream import NEWEST_TESTED, OLDEST_TESTED, installed_versions

    v = installed_versions()
    tested = f"tested {OLDEST_TESTED} to {NEWEST_TESTED}"
    print(f"versions:       transformers {v['transformers']} ({tested}), torch {v['torch']}")
    return 0


def _native_state() -> str:
    """Whether the optional native op (attention/_native.c) runs the CPU path's capped float32 calls, and if not why."""
    from hf_qknorm.attention import native

    native.requested()  # a value the switch does not know: its one-line error, not a state
    if native.MODULE is None:
        return "not built (no GCC or Clang at install time): the ATen ops run"
    if native.NATIVE[0] is None:
        return "built, off (HF_QKNORM_NATIVE): the ATen ops run"
    rule = f"capped float32 CPU calls, eager, no gradient, one thread or <= {native.PARALLEL_MAX} logits"
    return f"in use ({rule}; HF_QKNORM_NATIVE=0 turns it off)"


def _fused_norms_state() -> str:
    """Whether the fused per-head norm kernels (attention/fused_norms.py) run the norms of eager training calls."""
    from hf_qknorm.attention import fused_norms
    from hf_qknorm.portable import hooks

    asked = fused_norms.requested()
    if hooks.FUSED_NORM is fused_norms.fused_head_norm:
        return "on, for eager training calls on the kernels' devices (HF_QKNORM_FUSED_NORMS=0 turns them off)"
    if asked:
        return "asked for (HF_QKNORM_FUSED_NORMS), but no CUDA device: the ATen norms run"
    return "off: the ATen norms run (HF_QKNORM_FUSED_NORMS=1 turns them on, on CUDA)"


def _tma_state() -> str:
    """Who decides whether the Triton forward loads through tensor descriptors (Hopper or later)."""
    from hf_qknorm.kernels import tma_requested

    asked = tma_requested()
    if asked is None:
        return "as the tile table says (HF_QKNORM_TMA unset)"
    return f"{'on wherever it applies' if asked else 'off'} (HF_QKNORM_TMA)"


# The subcommands, in the order --help lists them: (name, add_parser(subparsers) -> parser, run(args) -> exit status).
COMMANDS = (
    ("demo", _add_demo, _cmd_demo),
    ("inspect", _add_inspect, _cmd_inspect),
    ("info", _add_info, _cmd_info),
    (verify.NAME, verify.add_parser, verify.run),
    ("convert", convert.add_convert, convert.run_convert),
    ("push", convert.add_push, convert.run_push),
    ("coverage", coverage.add_parser, coverage.run),
)
_DEBUG_HELP = "on an error, print the traceback as well as the one-line message"


def build_parser() -> tuple[argparse.ArgumentParser, dict]:
    parser = OneLineParser(
        prog="hf-qknorm",
        description="QK-norm, softmax capping and QKV-norm for Hugging Face Transformers models.",
        epilog="exit status: 0 done; 1 a check failed (a model that does "
        "not verify, a conversion whose result failed its checks); 2 an error in the input or the "
        "environment (one line on stderr); 3 an unexpected internal error (rerun with --debug and "
        "report it); 130 interrupted; 143 terminated (SIGTERM)",
    )
    parser.add_argument("--debug", action="store_true", help=_DEBUG_HELP)
    sub = parser.add_subparsers(dest="command", required=True)
    runners = {}
    for name, add, run in COMMANDS:
        p = add(sub)
        # also after the subcommand; SUPPRESS keeps the global flag when it is not given here
        p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=_DEBUG_HELP)
        runners[name] = run
    return parser, runners


def main(argv: list[str] | None = None) -> int:
    """Run ``hf-qknorm`` with ``argv``; returns the exit status. Never raises (but ``SystemExit`` from ``--help``)."""
    from ..conversion.orchestration.tempdirs import stop_signals_raise
    from ..upstream import untested_version_note

    parser, runners = build_parser()
    args = parser.parse_args(argv)
    note = untested_version_note()  # an untested Transformers: said in the error's line, or in one line after
    try:
        with stop_signals_raise():  # SIGTERM as an exception, so cleanups run and the message below is printed
            status = int(runners[args.command](args) or 0)
        if note is not None and status != 2:
            print(f"warning: {note}; `hf-qknorm verify` checks a model against its scheme", file=sys.stderr)
        return status
    except BrokenPipeError:  # `hf-qknorm ... | head`: the reader left; nothing more to say
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except BaseException as exc:  # one line for every failure; the traceback only with --debug
        kind, message = describe(exc)
        if kind is None:
            raise  # SystemExit of --help and the like
        if args.debug:
            traceback.print_exc()
        suffix = f" ({note})" if note is not None else ""
        print(f"error: {message}{suffix}", file=sys.stderr, flush=True)
        return EXIT_CODES[kind]


def entry() -> None:
    """The console script and ``python -m hf_qknorm.cli``: :func:`main`'s status as the process's exit status.

    Under a launcher (``WORLD_SIZE > 1``: torchrun, accelerate launch) the process leaves with ``os._exit`` once
    the output is flushed: by then the conversion has written, checked and closed everything, and gloo's threads
    can abort the interpreter's teardown on a loaded machine ("terminate called without an active exception",
    signal 6), which would turn a finished conversion into a failed rank."""
    from ..conversion.orchestration.ranks import launched_world

    status = main()
    try:
        launched = launched_world() > 1
    except ValueError:  # a malformed WORLD_SIZE: convert said so already; other commands do not use it
        launched = False
    if launched:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
    sys.exit(status)


if __name__ == "__main__":
    entry()
