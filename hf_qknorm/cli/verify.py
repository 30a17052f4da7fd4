"""``hf-qknorm verify DIR [DIR ...] [--no-plugin]``: :func:`hf_qknorm.verification.verify_folders` on the command line.

Prints each folder's report (a table of layer, probe, error, tolerance, ok) and exits 0 when every folder verifies,
1 when one does not (its report says FAILED), 2 on an error that stopped verification (one line on stderr).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

NAME = "verify"
HELP = "check that a saved model computes its scheme (cap, norms, mask) against the float64 reference"


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Add the ``verify`` subcommand to an ``argparse`` subparsers object; returns its parser."""
    p = subparsers.add_parser(
        NAME,
        help=HELP,
        description=(
            "Run a small probe batch (unpadded and left-padded, without a cache and with the folder's configured "
            "generation cache, plus a stress probe whose logits exceed the cap) through a saved model, and compare "
            "every attention layer with the float64 formula reference of its scheme. Exit status 1 when a layer is "
            "off or a cap, norm or mask is not applied."
        ),
    )
    p.add_argument("paths", nargs="+", type=Path, metavar="DIR", help="saved model folder(s)")
    p.add_argument(
        "--no-plugin",
        action="store_true",
        help="load the folder without hf_qknorm, as a user without the package would (remote code with "
        "trust_remote_code=True for qknorm_<base> folders, plain Transformers otherwise), in a "
        "subprocess that cannot import hf_qknorm",
    )
    p.add_argument("--device", default="cpu", help="device to run the model on (default: cpu)")
    p.add_argument(
        "--tolerance",
        type=_tolerance,
        default=None,
        help="relative error tolerance (default: by dtype; float32 1e-4, bfloat16 3e-2)",
    )
    p.add_argument("--no-generate", dest="generate", action="store_false", help="skip the cached-generation probes")
    return p


def _tolerance(text: str) -> float:
    """``--tolerance``: a number strictly between 0 and 1 (:func:`.checks.check_tolerance`), as a usage error."""
    from ..verification.checks import check_tolerance

    try:
        return check_tolerance(float(text))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"must be a number between 0 and 1 (exclusive), a relative error such as 1e-4; got {text!r}"
        ) from None


def run(args) -> int:
    """Verify every folder of ``args.paths``; print the reports. 0 = all OK, 1 = a report FAILED, 2 = error."""
    from ..verification.api import verify_folders

    if args.device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            print(f"error: --device {args.device}: CUDA is not available on this machine", file=sys.stderr)
            return 2
    status = 0
    for res in verify_folders(
        args.paths, no_plugin=args.no_plugin, device=args.device, tolerance=args.tolerance, generate=args.generate
    ):
        if res.report is None:
            if getattr(args, "debug", False) and res.traceback:
                print(res.traceback.rstrip(), file=sys.stderr)
            print(f"error: {res.path}: {res.error}", file=sys.stderr)
            status = max(status, 2)
            continue
        print(res.report)
        print()
        if not res.report.ok:
            status = max(status, 1)
    return status
