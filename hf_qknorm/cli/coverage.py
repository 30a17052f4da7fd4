"""``hf-qknorm coverage``: the coverage table of the installed Transformers (:mod:`hf_qknorm.verification.coverage`)."""

from __future__ import annotations

import os
import sys
from pathlib import Path


def add_parser(sub):
    p = sub.add_parser(
        "coverage",
        help="patch a tiny model of every causal-LM model type with every scheme and print which are patched",
        description="For every model type with a causal-LM class in the installed Transformers (or those given), "
        "build a tiny model from its config class, patch it with every scheme x norm and check it (the patch-time "
        "self-check, forward and backward, cached decoding against the full forward); print one line per model "
        "type: patched, refused (with the reason), FAIL, or out of scope; and for each patched type whether a tiny "
        "checkpoint of it converts (hf_qknorm.convert with six variants, the written folder checked and reloaded "
        "without the plugin). Exit status 1 if any model type FAILs either.",
    )
    p.add_argument("model_types", nargs="*", help="model types to check, separated by spaces or commas (default: all)")
    p.add_argument("--markdown", type=Path, help="also write the table as Markdown to this file")
    p.add_argument("--json", type=Path, help="also write every variant's result as JSON to this file")
    p.add_argument(
        "--no-conversion",
        action="store_true",
        help="skip the conversion column (each patched type converted with six variants and reloaded without the "
        "plugin)",
    )
    p.add_argument(
        "--conversion-variants",
        choices=("main", "all"),
        default="main",
        help="the conversion column's variants: main (six: qk_norm_cap, qk_norm and qkv_norm with layernorm, qk_norm "
        "with rmsnorm and lp, soft_cap) or all (every scheme x norm, 13) (default: main)",
    )
    return p


def run(args) -> int:
    import transformers

    from ..verification import coverage as cov

    known = set(cov.causal_model_types())
    wanted = [t.strip() for arg in args.model_types for t in arg.split(",") if t.strip()]
    if args.model_types and not wanted:
        raise ValueError(f"no model type in {' '.join(args.model_types)!r}: name one or more, e.g. llama,qwen3")
    unknown = sorted(set(wanted) - known)
    if unknown:
        raise ValueError(
            f"unknown model type(s) {', '.join(map(repr, unknown))}: not a causal-LM model type of Transformers "
            f"{transformers.__version__} (`hf-qknorm coverage` with no argument checks them all)"
        )

    def show(result):
        note = f"  {result.reason}" if result.reason else ""
        print(f"{result.model_type:28} {result.status:13}{note}", flush=True)
        if result.conversion:
            print(f"{'':28} {'conversion':13}{result.conversion}: {result.conversion_note}", flush=True)

    import functools

    from ..conversion.orchestration.coverage import VARIANTS, add_conversions

    variants = cov.variants() if args.conversion_variants == "all" else VARIANTS
    hook = None if args.no_conversion else functools.partial(add_conversions, variants=variants)
    results = cov.coverage(list(dict.fromkeys(wanted)) or None, progress=show, chunk_hook=hook)
    print(cov.summary(results))
    versions = f"Transformers {transformers.__version__}"
    for path, text in ((args.markdown, cov.markdown(results, versions)), (args.json, cov.to_json(results))):
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            partial = path.with_name(f".{path.name}.partial")  # a stop mid-write leaves the old table whole
            try:
                partial.write_text(text)
                os.replace(partial, path)
            finally:
                partial.unlink(missing_ok=True)
            print(f"wrote {path}", file=sys.stderr)
    return 1 if cov.failing(results) else 0
