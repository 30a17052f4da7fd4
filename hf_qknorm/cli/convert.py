"""``hf-qknorm convert`` and ``hf-qknorm push``: listed in :data:`hf_qknorm.cli.main.COMMANDS`."""

from __future__ import annotations

import argparse
import json
import textwrap
from pathlib import Path

from ..conversion.calibration.calibrate import CalibrationSettings
from ..conversion.healing.heal import HealSettings
from ..conversion.output.hub import HubSettings
from ..portable.schemes import QKNormConfig
from .fields import add_fields, from_args, given_fields

_CONVERT_EPILOG = """\
examples:
  hf-qknorm convert                                   # the bundled tiny Llama, qk_norm_cap + layernorm
  hf-qknorm convert path/to/llama out --scheme qk_norm --norm rmsnorm        # written as a plain qwen3 folder
  hf-qknorm convert path/to/llama out --scheme qkv_norm --calibration-text my_corpus.txt
  hf-qknorm convert path/to/llama out --scheme qk_norm --norm rmsnorm --heal    # distil from the original too
  hf-qknorm convert path/to/llama out --push-to-hub me/llama-qknorm --private

under torchrun / accelerate launch (WORLD_SIZE > 1) --heal shares out the heal text and the layer fits; rank 0
alone writes the folder:
  torchrun --nproc_per_node 4 -m hf_qknorm.cli convert path/to/llama out --scheme qk_norm --norm rmsnorm --heal
  accelerate launch --num_processes 4 -m hf_qknorm.cli convert path/to/llama out --heal

The output folder holds the weights (shard by shard like the source), config.json, the tokenizer and generation
config, a model card (README.md) with the perplexity report, and qknorm_conversion.json. Llama/Mistral with
--scheme qk_norm --norm rmsnorm is exactly a Qwen3 model and loads in plain transformers; everything else is
model_type qknorm_<base> and loads with trust_remote_code=True (code shipped in the folder) or after
`import hf_qknorm`.
"""


def add_convert(sub):
    p = sub.add_parser(
        "convert",
        help="convert a pretrained checkpoint (calibrated init, Hub-ready folder)",
        description=textwrap.fill(
            "Add QK-norm / softmax capping / QKV-norm to a pretrained checkpoint for continued pretraining. The new "
            "norm weights are initialised from calibration text so that the converted model stays close to the "
            "original, and the perplexity of the original, identity-initialised and calibrated models on held-out "
            "text is reported. The source is never modified; the output is written to a temporary folder and "
            "renamed into place when complete.",
            100,
        ),
        epilog=_CONVERT_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "src",
        nargs="?",
        default=None,
        help="source model: a local folder with config.json and safetensors weights, or a Hub id when the "
        "Hub is reachable (default: the tiny Llama bundled with hf_qknorm)",
    )
    p.add_argument(
        "dst",
        nargs="?",
        default=None,
        help="output folder (default: converted/<source>-<scheme>-<norm>); refused if it exists unless --overwrite",
    )
    p.add_argument("-o", "--output", default=None, help="output folder, for use without SRC (same as DST)")
    add_fields(p.add_argument_group("scheme (hf_qknorm.QKNormConfig, as for hf_qknorm.patch_model)"), QKNormConfig)
    g = p.add_argument_group(
        "calibration (hf_qknorm.CalibrationSettings; layer by layer, float32: memory for one decoder block)"
    )
    g.add_argument(
        "--calibration-text",
        default=None,
        metavar="FILE",
        help="text run through the original model: a UTF-8 file or a bundled name (tinyshakespeare, "
        "wikitext2); default tinyshakespeare",
    )
    g.add_argument(
        "--eval-text",
        default=None,
        metavar="FILE",
        help="held-out text for the perplexity report, a file or bundled name (default: the last 10%% of "
        "the calibration text, which calibration then does not use)",
    )
    g.add_argument(
        "--no-calibration",
        action="store_true",
        help="keep identity init (weight 1, bias 0); never loads the model, writes shard by shard only",
    )
    add_fields(g, CalibrationSettings)
    g = p.add_argument_group(
        "healing (hf_qknorm.conversion.healing.heal.HealSettings; after calibration, streamed like it: each attention "
        "layer's projections and norms distilled from the original's)"
    )
    g.add_argument(
        "--heal",
        action="store_true",
        help="after calibration, fit each attention layer's q/k/v/o projections and new norms to the original "
        "layer's output (off by default: conversion then is exactly as without it)",
    )
    add_fields(g, HealSettings, prefix="heal_")
    g = p.add_argument_group("output")
    g.add_argument(
        "--export",
        choices=("auto", "qwen3", "native", "qknorm"),
        default="auto",
        help="auto: plain qwen3 when the result is a Qwen3 model (Llama/Mistral + rmsnorm qk_norm), the source's "
        "own model type when its own per-head q/k norms are the scheme's (Qwen3, Gemma 3, ... + qk_norm with their "
        "norm), else qknorm_<base> with trust_remote_code code; qwen3, native: fail if impossible; qknorm: always "
        "the remote-code format (default: auto)",
    )
    g.add_argument("--overwrite", action="store_true", help="replace an existing output folder (atomically)")
    g.add_argument(
        "--verify",
        choices=("full", "plugin", "off"),
        default="full",
        help="check the written model before it is renamed into place (first layers, small probe): its logits "
        "against the converted model in memory, and against the float64 reference where that spells out the "
        "model's attention; full = with hf_qknorm and without it in a subprocess; plugin = with hf_qknorm only; "
        "off = skip (default: full)",
    )
    g.add_argument("--quiet", action="store_true", help="no progress bars or progress log lines")
    g.add_argument("--json", action="store_true", help="also print the result as JSON on the last line")
    _add_hub_options(p, convert=True)
    return p


def _add_hub_options(p, convert: bool):
    add_fields(
        p.add_argument_group("Hugging Face Hub (hf_qknorm.conversion.output.hub.HubSettings)"),
        HubSettings,
        exclude=() if convert else ("repo_id",),
    )


def run_convert(args) -> int:
    from ..conversion.orchestration.ranks import launched_rank

    if args.output is not None and args.dst is not None:
        raise ValueError("give the output folder once: as DST or as --output, not both")
    from ..conversion.orchestration.progress import progress_logs

    first = launched_rank() == 0  # under torchrun / accelerate launch rank 0 alone speaks
    with progress_logs(not args.quiet and first):
        return _run_convert(args, first)


def _run_convert(args, first: bool) -> int:
    from ..conversion.orchestration.converter import convert
    from ..conversion.orchestration.ranks import FirstRankFailed

    if not first:  # nor Transformers' loading bars and warnings, once per rank
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
    try:
        result = convert(
            args.src,
            args.dst or args.output,
            from_args(QKNormConfig, args),
            from_args(CalibrationSettings, args),
            from_args(HubSettings, args),
            heal=_heal(args),
            calibration_text=_text_file(args.calibration_text),
            eval_text=_text_file(args.eval_text),
            verify=args.verify,
            calibrate=not args.no_calibration,
            export=args.export,
            overwrite=args.overwrite,
            progress=not args.quiet,
            log=print,
        )
    except FirstRankFailed as exc:  # rank 0 printed the error; leave with its exit status, silently
        from .errors import EXIT_CODES, describe

        return EXIT_CODES[describe(exc.original)[0] or "internal"]
    if args.json and first:
        print(
            json.dumps(
                {
                    "path": str(result.path),
                    "export": result.export,
                    "files": result.files,
                    "report": None if result.report is None else result.report.to_dict(),
                    "pushed_url": result.pushed_url,
                }
            )
        )
    return 0


def _heal(args):
    """``HealSettings`` when ``--heal`` or any ``--heal-...`` setting was given, else ``None``."""
    given = given_fields(HealSettings, args, prefix="heal_")
    return HealSettings(**given) if args.heal or given else None


def _text_file(value):
    """On the command line a text option names a file (or a bundled text), never the text itself."""
    import os

    from ..data import BUNDLED_TEXTS

    if value is None or value in BUNDLED_TEXTS and not os.path.exists(value):
        return value
    return Path(value)


def add_push(sub):
    p = sub.add_parser(
        "push",
        help="upload a converted folder to the Hugging Face Hub",
        description="Create the Hub repo REPO_ID if needed and upload DIR (a folder written by `hf-qknorm convert`) "
        "with huggingface_hub, in one commit. Hidden files are not uploaded. The uploaded model card "
        "(README.md) names REPO_ID in its load snippet and title; the card in DIR is not changed. "
        "Without a token (--token, HF_TOKEN or `hf auth login`) nothing is contacted and the command "
        "fails.",
    )
    p.add_argument("dir", type=Path, help="folder written by `hf-qknorm convert`")
    p.add_argument("repo_id", help="Hub repo id, e.g. your-name/llama-qknorm")
    _add_hub_options(p, convert=False)
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="print the files and card metadata that would be uploaded; contact nothing",
    )
    return p


def run_push(args) -> int:
    from ..conversion.output.hub import card_for_repo, card_metadata, check_folder, check_repo_id, push, upload_files

    if args.dry_run:
        check_folder(args.dir)
        check_repo_id(args.repo_id)
        hub = {k: v for k, v in given_fields(HubSettings, args).items() if k != "repo_id"}
        print(
            f"would upload to {args.repo_id}"
            + (f" (branch {hub['revision']})" if hub.get("revision") else "")
            + (" as a private repo" if hub.get("private") else "")
        )
        for name in upload_files(args.dir):
            print(f"  {name}")
        print("card metadata: " + json.dumps(card_metadata(args.dir), sort_keys=True))
        if card_for_repo(args.dir, args.repo_id) is not None:
            print(
                f"the uploaded README.md names {args.repo_id} in its load snippet and title "
                f"({args.dir / 'README.md'} is not changed)"
            )
        return 0
    hub = {k: v for k, v in given_fields(HubSettings, args).items() if k != "repo_id"}  # repo_id: the positional
    url = push(args.dir, args.repo_id, **hub)
    print(f"uploaded {args.dir} to {url}")
    return 0
