"""Where a conversion writes: the default folder name, and the checks on a destination before any work starts."""

from __future__ import annotations

from pathlib import Path

from ...portable.schemes import QKNormConfig

__all__ = ["check_destination", "default_destination"]


def default_destination(source_name: str, cfg: QKNormConfig) -> Path:
    """``converted/<source>-<scheme>[-<norm>]`` under the current folder."""
    stem = source_name.split(" ")[0].rstrip("/").split("/")[-1]
    suffix = cfg.scheme + (f"-{cfg.norm}" if cfg.norms_qk else "")
    return Path("converted") / f"{stem}-{suffix}"


def check_destination(dst: Path, src: Path, overwrite: bool) -> Path:
    dst = Path(dst).expanduser().resolve()
    if dst == src or src in dst.parents or dst in src.parents:
        raise ValueError(f"destination {dst} overlaps the source {src}; the source is never modified")
    if dst.exists() and not overwrite:
        raise FileExistsError(f"destination {dst} already exists; pass overwrite=True (--overwrite) to replace it")
    if dst.exists() and not dst.is_dir():
        raise FileExistsError(f"destination {dst} exists and is not a folder")
    return dst
