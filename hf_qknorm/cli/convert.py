"""``hf-qknorm convert`` and ``hf-qknorm push``: registered with :data:`hf_qknorm.cli.EXTRA_COMMANDS`."""

from __future__ import annotations

import argparse
import json
import textwrap
from pathlib import Path

from .main import EXTRA_COMMANDS

_CONVERT_EPILOG = """\
examples:
  hf-qknorm convert                                   # the bundled tiny Llama, qk_norm_cap + layernorm
  hf-qknorm convert path/to/llama out --scheme qk_norm --norm rmsnorm        # written as a plain qwen3 folder
  hf-qknorm convert path/to/llama out --scheme qkv_norm --calibration-text my_corpus.txt
  hf-qknorm convert path/to/llama out --push-to-hub me/llama-qknorm --private

The output folder holds the weights (shard by shard like the source), config.json, the tokenizer and generation
config, a model card (README.md) with the perplexity report, and qknorm_conversion.json. Llama/Mistral with
--scheme qk_norm --norm rmsnorm is exactly a Qwen3 model and loads in plain transformers; everything else is
model_type qknorm_<base> and loads with trust_remote_code=True (code shipped in the folder) or after
`import hf_qknorm`.
"""


def _add_convert(sub):
    p = sub.add_parser(
        "convert", help="convert a pretrained checkpoint (calibrated init, Hub-ready folder)",
        description=textwrap.fill(
            "Add QK-norm / softmax capping / QKV-norm to a pretrained checkpoint for continued pretraining. The new "
            "norm weights are initialised from calibration text so that the converted model stays close to the "
            "original, and the perplexity of the original, identity-initialised and calibrated models on held-out "
            "text is reported. The source is never modified; the output is written to a temporary folder and "
            "renamed into place when complete.", 100),
        epilog=_CONVERT_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("src", nargs="?", default=None,
                   help="source model: a local folder with config.json and safetensors weights, or a Hub id when the "
                        "Hub is reachable (default: the tiny Llama bundled with hf_qknorm)")
    p.add_argument("dst", nargs="?", default=None,
                   help="output folder (default: converted/<source>-<scheme>-<norm>); refused if it exists "
                        "unless --overwrite")
    p.add_argument("-o", "--output", default=None, help="output folder, for use without SRC (same as DST)")
    g = p.add_argument_group("scheme (as for hf_qknorm.patch_model)")
    g.add_argument("--scheme", default="qk_norm_cap", help="qk_norm | soft_cap | qk_norm_cap | qkv_norm "
                                                           "(default: qk_norm_cap)")
    g.add_argument("--norm", default=None, help="layernorm (default) | rmsnorm | l2 | lp; not for soft_cap")
    g.add_argument("--softcap", type=float, default=None,
                   help="cap c in c*tanh(s/c), > 0 (default 50 for the capped schemes; an error for the others)")
    g.add_argument("--eps", type=float, default=None, help="epsilon of the new norms (default: the model's own)")
    g.add_argument("--p", type=float, default=None, help="exponent of the lp norm (p >= 1)")
    g = p.add_argument_group("calibration (layer by layer, float32: memory for one decoder block)")
    g.add_argument("--calibration-text", default=None, metavar="FILE",
                   help="text run through the original model: a UTF-8 file or a bundled name (tinyshakespeare, "
                        "wikitext2); default tinyshakespeare")
    g.add_argument("--eval-text", default=None, metavar="FILE",
                   help="held-out text for the perplexity report, a file or bundled name (default: the last 10%% of "
                        "the calibration text, which calibration then does not use)")
    g.add_argument("--no-calibration", action="store_true",
                   help="keep identity init (weight 1, bias 0); never loads the model, writes shard by shard only")
    g.add_argument("--block-len", type=int, default=256, help="tokens per calibration block (default 256, capped "
                                                              "at the model's context length)")
    g.add_argument("--calibration-blocks", type=int, default=16, help="calibration blocks (default 16)")
    g.add_argument("--eval-blocks", type=int, default=16, help="held-out blocks for the report (default 16)")
    g.add_argument("--local-steps", type=int, default=100,
                   help="Adam steps per layer fitting the new norms to the original attention layer's output, one "
                        "calibration block per step; 0 keeps the least-squares fit (default 100)")
    g.add_argument("--local-lr", type=float, default=0.1,
                   help="layer-wise step size: relative change of a gain per step (default 0.1)")
    g.add_argument("--agreement-tokens", type=int, default=16,
                   help="after writing, compare the greedy answers of the written model with the original's on the "
                        "bundled prompts (facts, arithmetic, code, instructions, chat turns) over this many new "
                        "tokens; loads each whole model in float32 in turn; 0 skips it (default 16)")
    g.add_argument("--steps", type=int, default=0,
                   help="Adam steps of end-to-end KL distillation of the new norm parameters after the layer-wise "
                        "fit; loads the whole model (default 0: none)")
    g.add_argument("--batch-size", type=int, default=4, help="blocks per step and per forward pass (default 4)")
    g.add_argument("--lr", type=float, default=0.3,
                   help="distillation step size, relative to each tensor's initial RMS (default 0.3)")
    g.add_argument("--seed", type=int, default=0, help="random seed of the distillation batches (default 0)")
    g.add_argument("--device", default="auto",
                   help="where calibration runs: auto (CUDA when available, else CPU), cpu, cuda, cuda:1, ...")
    g.add_argument("--threads", type=int, default=None,
                   help="CPU threads for calibration (default: 1 for models under 20M parameters, whose matrices "
                        "gain nothing from more; torch's default otherwise)")
    g = p.add_argument_group("output")
    g.add_argument("--export", choices=("auto", "qwen3", "qknorm"), default="auto",
                   help="auto: plain qwen3 when the result is a Qwen3 model (Llama/Mistral + rmsnorm qk_norm), else "
                        "qknorm_<base> with trust_remote_code code; qwen3: fail if impossible; qknorm: always the "
                        "remote-code format (default: auto)")
    g.add_argument("--overwrite", action="store_true", help="replace an existing output folder (atomically)")
    g.add_argument("--verify", choices=("full", "plugin", "off"), default="full",
                   help="check the written model against the float64 reference before it is renamed into place "
                        "(first layers, small probe): full = with hf_qknorm and, for remote-code folders, without it "
                        "in a subprocess; plugin = with hf_qknorm only; off = skip (default: full)")
    g.add_argument("--quiet", action="store_true", help="no progress bars or progress log lines")
    g.add_argument("--json", action="store_true", help="also print the result as JSON on the last line")
    _add_hub_options(p, convert=True)
    return p


def _add_hub_options(p, convert: bool):
    g = p.add_argument_group("Hugging Face Hub")
    if convert:
        g.add_argument("--push-to-hub", metavar="REPO_ID", default=None,
                       help="upload the folder to this repo once written (created if missing)")
    g.add_argument("--private", action="store_true", default=None, help="create the repo as private")
    g.add_argument("--revision", default=None, help="branch to upload to (created if missing; default main)")
    g.add_argument("--commit-message", default=None, help="commit message of the upload")
    g.add_argument("--token", default=None,
                   help="Hub token (default: the HF_TOKEN environment variable, else the `hf auth login` cache)")


def _cmd_convert(args) -> int:
    from ..conversion.calibrate import CalibrationSettings
    from ..conversion.converter import convert

    if args.output is not None and args.dst is not None:
        raise ValueError("give the output folder once: as DST or as --output, not both")
    from ..conversion.progress import show_progress_logs

    show_progress_logs(not args.quiet)
    settings = CalibrationSettings(block_len=args.block_len, calibration_blocks=args.calibration_blocks,
                                   eval_blocks=args.eval_blocks, steps=args.steps, batch_size=args.batch_size,
                                   lr=args.lr, seed=args.seed, device=args.device,
                                   threads=args.threads, local_steps=args.local_steps, local_lr=args.local_lr,
                                   agreement_tokens=args.agreement_tokens)
    result = convert(args.src, args.dst or args.output, scheme=args.scheme, norm=args.norm, softcap=args.softcap,
                     eps=args.eps, p=args.p, calibration_text=_text_file(args.calibration_text),
                     eval_text=_text_file(args.eval_text), verify=args.verify,
                     calibrate=not args.no_calibration, settings=settings, export=args.export,
                     overwrite=args.overwrite, push_to_hub=args.push_to_hub, private=args.private,
                     revision=args.revision, commit_message=args.commit_message, token=args.token,
                     progress=not args.quiet)
    if args.json:
        print(json.dumps({"path": str(result.path), "export": result.export, "files": result.files,
                          "report": None if result.report is None else result.report.to_dict(),
                          "pushed_url": result.pushed_url}))
    return 0


def _text_file(value):
    """On the command line a text option names a file (or a bundled text), never the text itself."""
    import os

    from ..data import BUNDLED_TEXTS

    if value is None or value in BUNDLED_TEXTS and not os.path.exists(value):
        return value
    return Path(value)


def _add_push(sub):
    p = sub.add_parser(
        "push", help="upload a converted folder to the Hugging Face Hub",
        description="Create the Hub repo REPO_ID if needed and upload DIR (a folder written by `hf-qknorm convert`) "
                    "with huggingface_hub, in one commit. Hidden files are not uploaded. The uploaded model card "
                    "(README.md) names REPO_ID in its load snippet and title; the card in DIR is not changed. "
                    "Without a token (--token, HF_TOKEN or `hf auth login`) nothing is contacted and the command "
                    "fails.")
    p.add_argument("dir", type=Path, help="folder written by `hf-qknorm convert`")
    p.add_argument("repo_id", help="Hub repo id, e.g. your-name/llama-qknorm")
    _add_hub_options(p, convert=False)
    p.add_argument("--dry-run", action="store_true",
                   help="print the files and card metadata that would be uploaded; contact nothing")
    return p


def _cmd_push(args) -> int:
    from ..conversion.hub import card_for_repo, card_metadata, check_folder, check_repo_id, push, upload_files

    if args.dry_run:
        check_folder(args.dir)
        check_repo_id(args.repo_id)
        print(f"would upload to {args.repo_id}" + (f" (branch {args.revision})" if args.revision else "")
              + (" as a private repo" if args.private else ""))
        for name in upload_files(args.dir):
            print(f"  {name}")
        print("card metadata: " + json.dumps(card_metadata(args.dir), sort_keys=True))
        if card_for_repo(args.dir, args.repo_id) is not None:
            print(f"the uploaded README.md names {args.repo_id} in its load snippet and title "
                  f"({args.dir / 'README.md'} is not changed)")
        return 0
    url = push(args.dir, args.repo_id, private=args.private, revision=args.revision,
               commit_message=args.commit_message, token=args.token)
    print(f"uploaded {args.dir} to {url}")
    return 0


EXTRA_COMMANDS.append(("convert", _add_convert, _cmd_convert))
EXTRA_COMMANDS.append(("push", _add_push, _cmd_push))
