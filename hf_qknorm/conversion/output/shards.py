"""Safetensors checkpoints read and written shard by shard, for :mod:`hf_qknorm.convert`.

:func:`read_source_weights` checks every header up front (so a corrupt or truncated file fails before any work);
:func:`plan_weights` says what changes (new norm tensors, the ``qkv_norm`` fold of the removed pre-norm into the
projections, the dropped pre-norm tensors); :func:`write_weights` applies the plan one shard at a time -- read a
shard, transform and add its tensors, write it, record its keys in the index -- so peak memory is about one shard.
Tensor names follow the source (``transformer.h.0...`` or ``h.0...`` alike); dtypes are kept.
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ...modeling.saved import auto_class
from ...portable.families import Family
from ...portable.fold import bias_shift, fold_gain, shifted_bias
from ...portable.schemes import QKNormConfig
from .keys import KeyMap, fuse, key_map, row_pieces

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_DTYPES = {
    "F64": (torch.float64, 8),
    "F32": (torch.float32, 4),
    "F16": (torch.float16, 2),
    "BF16": (torch.bfloat16, 2),
    "I64": (torch.int64, 8),
    "I32": (torch.int32, 4),
    "I16": (torch.int16, 2),
    "I8": (torch.int8, 1),
    "U8": (torch.uint8, 1),
    "BOOL": (torch.bool, 1),
    "F8_E4M3": (None, 1),
    "F8_E5M2": (None, 1),
}
_MAX_HEADER = 100 * 2**20


@dataclass
class SourceWeights:
    """The safetensors files of a source folder (validated), where each tensor lives, and how each parameter of the
    model is read from them (:mod:`.keys`: Transformers' own renaming and fusing rules)."""

    folder: Path
    files: list[str]
    key_file: dict[str, str]
    shapes: dict[str, list[int]]
    index: dict | None
    dtype: torch.dtype
    strip: str = ""  # base-model prefix that the source's tensor names lack (e.g. "transformer." for GPT-2)
    names: KeyMap = field(default_factory=KeyMap)
    param_shapes: dict[str, list[int]] = field(default_factory=dict)  # model parameter name -> shape
    model: object = None  # the model's skeleton (meta device): the shapes a split reads

    def source_key(self, canonical: str) -> str:
        """The source's name of the tensor a model parameter ``canonical`` loads from (a parameter split off the rows
        of a fused tensor: that tensor; a new tensor: the name it is written under, in the source's convention)."""
        key = self.names.direct.get(canonical) or self.names.rows.get(canonical)
        if key is not None:
            return key
        return canonical[len(self.strip) :] if self.strip and canonical.startswith(self.strip) else canonical

    def has(self, canonical: str) -> bool:
        """Whether the checkpoint holds the model parameter ``canonical`` (as one tensor or fused from several)."""
        return canonical in self.names

    def read_param(self, canonical: str, transform=None) -> torch.Tensor:
        """The model parameter ``canonical`` as the model loads it (a fused parameter made from its tensors), each
        checkpoint tensor first passed through ``transform(key, tensor)`` where given (the ``qkv_norm`` fold, which
        is planned on the checkpoint's tensors)."""

        def read(key):
            tensor = self.read(key)
            return tensor if transform is None else transform(key, tensor)

        fused = self.names.fused.get(canonical)
        if fused is None:
            key = self.names.direct.get(canonical, self.source_key(canonical))
            if key not in self.key_file:
                raise ValueError(f"{self.folder}: the checkpoint has no tensor {key!r}")
            return read(key)
        return fuse(canonical, fused, read, self.param_shapes[canonical], self.model)

    def read(self, key: str) -> torch.Tensor:
        from safetensors import safe_open

        with safe_open(self.folder / self.key_file[key], framework="pt") as f:
            return check_finite(f.get_tensor(key), key, self.key_file[key])


def check_finite(tensor: torch.Tensor, key: str, file: str) -> torch.Tensor:
    """``tensor``, or a ``ValueError`` naming it when it holds NaN or infinite values: a converted model computed from
    them is NaN, and with verification off (or a fold that spreads one value over a row) it would be written as such.
    One pass over a tensor being read anyway; checked where the source is read, so nothing is written first."""
    if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
        nan, inf = int(torch.isnan(tensor).sum()), int(torch.isinf(tensor).sum())
        raise ValueError(
            f"source tensor {key} in {file} has {nan} NaN and {inf} infinite value(s) of "
            f"{tensor.numel()}: a checkpoint with non-finite weights cannot be converted (repair or "
            "re-download it)"
        )
    return tensor


def check_safetensors(path: Path) -> dict:
    """The header of a safetensors file, after checking that it is whole: a readable header whose tensors all lie
    inside the file with the byte size their dtype and shape need. Raises ``ValueError`` naming the file."""
    path = Path(path)
    size = path.stat().st_size
    bad = f"{path} is not a valid safetensors file"
    if size < 8:
        raise ValueError(f"{bad}: truncated ({size} bytes, shorter than the 8-byte header length)")
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        if n == 0 or n > _MAX_HEADER or 8 + n > size:
            raise ValueError(f"{bad}: corrupt or truncated (header length {n} for a file of {size} bytes)")
        try:
            header = json.loads(f.read(n).decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ValueError(f"{bad}: corrupt header ({exc})") from None
    if not isinstance(header, dict):
        raise ValueError(f"{bad}: corrupt header (not a JSON object)")
    data = size - 8 - n
    spans = []
    for key, info in header.items():
        if key == "__metadata__":
            continue
        try:
            begin, end = (int(x) for x in info["data_offsets"])
            dtype, shape = info["dtype"], [int(d) for d in info["shape"]]
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"{bad}: corrupt entry for tensor {key!r}") from None
        if end > data:
            raise ValueError(f"{bad}: truncated (tensor {key!r} ends at byte {end} of a {data}-byte data section)")
        width = _DTYPES.get(dtype, (None, None))[1]
        if not 0 <= begin <= end or (width is not None and end - begin != width * math.prod(shape)):
            raise ValueError(f"{bad}: corrupt entry for tensor {key!r} (offsets {begin}..{end}, {dtype} {shape})")
        spans.append((begin, end, key))
    spans.sort()
    for (_, end_a, a), (begin_b, end_b, b) in zip(spans, spans[1:]):
        if begin_b < end_a and begin_b < end_b:  # two tensors sharing bytes: writing one would change the other
            raise ValueError(f"{bad}: tensors {a!r} and {b!r} overlap (bytes {begin_b}..{min(end_a, end_b)})")
    return header


def read_source_weights(folder: Path, family: Family, config, model=None) -> SourceWeights:
    """Find and validate the safetensors weights of ``folder`` (single file or sharded with an index), and how each
    parameter of ``config``'s model (``model``: a skeleton of it, made when not given) is read from them."""
    folder = Path(folder)
    index = None
    if (folder / INDEX_FILE).is_file():
        try:
            index = json.loads((folder / INDEX_FILE).read_text())
            weight_map = dict(index["weight_map"])
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise ValueError(f"{folder / INDEX_FILE} is not a valid safetensors index ({exc})") from None
        files = sorted(set(weight_map.values()))
    elif (folder / SINGLE_FILE).is_file():
        files, weight_map = [SINGLE_FILE], None
    elif any(folder.glob("*.bin")) or any(folder.glob("*.pt")) or any(folder.glob("*.pth")):
        raise ValueError(
            f"{folder} holds PyTorch pickle weights only; hf_qknorm converts safetensors checkpoints. "
            "Re-save it with model.save_pretrained(folder, safe_serialization=True)"
        )
    else:
        raise FileNotFoundError(f"{folder} has no model weights ({SINGLE_FILE} or {INDEX_FILE})")
    key_file, shapes, dtypes = {}, {}, {}
    for name in files:
        path = folder / name
        if not path.is_file():
            raise FileNotFoundError(f"{folder / INDEX_FILE} lists {name}, which is missing")
        header = check_safetensors(path)
        for key, info in header.items():
            if key != "__metadata__":
                key_file[key], shapes[key], dtypes[key] = name, info["shape"], info["dtype"]
    if weight_map is not None:
        for key, name in weight_map.items():
            if key_file.get(key) != name:
                raise ValueError(f"{folder / INDEX_FILE} maps {key!r} to {name}, which does not contain it")
    model = skeleton(config, folder) if model is None else model
    weights = SourceWeights(folder, files, key_file, shapes, index, torch.float32)
    weights.names = key_map(model, key_file, reads=_read_by_conversion(family))
    weights.param_shapes = {n: list(t.shape) for n, t in model.state_dict().items()}
    weights.model = model
    anchor = _proj_key(family, 0, family.qkv_proj or family.q_proj, "weight")
    if anchor not in weights.names:
        raise ValueError(
            f"{folder}: unexpected tensor names for a {family.model_type} checkpoint "
            f"(no {anchor!r}); is it a {family.model_type} causal LM?"
        )
    key = weights.source_key(anchor)
    if key not in key_file:  # made from several tensors: any of them says the dtype
        key = next(k for keys in weights.names.fused[anchor].sources.values() for k in keys)
    weights.strip = anchor[: len(anchor) - len(key)] if anchor.endswith("." + key) else ""
    weights.dtype = _DTYPES.get(dtypes[key], (torch.float32,))[0] or torch.float32
    return weights


def _read_by_conversion(family: Family):
    """Model name -> whether a conversion reads that parameter: all of a text model's; of a multimodal model's, its
    language model's and the output head (``lm_head``) -- never the vision tower's or the projector's, which are
    written as stored. ``None`` for a text model (every parameter)."""
    if family.text_model is None:
        return None
    prefix = family.text_model + "."
    return lambda name: name.startswith(prefix) or name.split(".")[0] == "lm_head"


def load_pretrained(folder: Path, **kwargs):
    """The model saved in ``folder``, loaded through its :func:`~hf_qknorm.modeling.saved.auto_class`
    (``kwargs``: ``from_pretrained``'s)."""
    from transformers import AutoConfig

    return auto_class(AutoConfig.from_pretrained(folder)).from_pretrained(folder, **kwargs)


def skeleton(config, folder: Path | None = None):
    """``config``'s model (:func:`~hf_qknorm.modeling.saved.auto_class`) on the meta device (no memory, no
    initialisation); a ``ValueError`` naming the config when it describes no model Transformers can build (e.g. heads
    that do not divide the width)."""
    try:
        with torch.device("meta"):
            return auto_class(config).from_config(config)
    except Exception as exc:
        where = f"{Path(folder) / 'config.json'}" if folder is not None else "the config"
        raise ValueError(f"{where} describes no model Transformers can build ({type(exc).__name__}: {exc})") from None


def check_matches_config(weights: SourceWeights, config) -> None:
    """Every tensor the model ``config`` describes is in ``weights`` with that shape (tied weights: one of them; a
    fused parameter: its tensors, whose fused shape is checked when it is read); else a ``ValueError`` naming the
    first disagreement -- before any work, where Transformers would only refuse at the end, pointing at a report the
    command line does not show (or, for a missing pre-norm gain, a ``qkv_norm`` fold would go on without it)."""
    model = skeleton(config, weights.folder)
    mismatched, missing, seen = [], [], {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        seen.setdefault(id(tensor), []).append((name, list(tensor.shape)))
    for names in seen.values():  # one entry per tensor: tied weights share it, and one copy on disk is enough
        if any(n in weights.names.opaque for n, _ in names):
            continue  # made on loading by Transformers alone (outside the language model): checked when reloaded
        present = [(n, shape) for n, shape in names if weights.has(n)]
        if not present:
            missing.append(weights.source_key(names[0][0]))
        for name, want in present:
            key = weights.names.direct.get(name)
            if key is not None and list(weights.shapes[key]) != want:
                mismatched.append((key, weights.shapes[key], want))
    if mismatched:  # the first in the model's order (the embedding, when the width is off)
        key, saved, want = mismatched[0]
        more = f" (and {len(mismatched) - 1} more)" if len(mismatched) > 1 else ""
        raise ValueError(
            f"{weights.folder / 'config.json'} disagrees with the weights: {key} is {tuple(saved)} in "
            f"{weights.key_file[key]}, {tuple(want)} by config.json{more}; fix the sizes in config.json"
        )
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ValueError(
            f"{weights.folder} lacks {missing[0]}{more}, which its config.json's model has; "
            "convert a complete checkpoint"
        )


def _proj_key(family: Family, layer: int, proj: str, param: str) -> str:
    return f"{family.layers}.{layer}.{family.attention}.{proj}.{param}"


@dataclass
class WeightPlan:
    """What changes, by source tensor name: tensors to add or replace (``new``, with the file each goes to),
    tensors to drop, per-projection gains to fold (``folds``) and bias shifts to add (``shifts``)."""

    new: dict[str, torch.Tensor] = field(default_factory=dict)
    new_file: dict[str, str] = field(default_factory=dict)
    drop: set[str] = field(default_factory=set)
    folds: dict[str, torch.Tensor] = field(default_factory=dict)
    shifts: dict[str, torch.Tensor] = field(default_factory=dict)
    conv1d: bool = False


def plan_weights(
    weights: SourceWeights,
    family: Family,
    cfg: QKNormConfig,
    new_values: dict[str, torch.Tensor],
    prenorm_forms: list | None = None,
) -> WeightPlan:
    """Plan the new tensors ``new_values`` (state-dict names; a native norm the scheme's takes the place of is
    replaced) and, for ``qkv_norm``, the pre-norm fold of every layer: ``prenorm_forms`` holds each block's
    pre-attention norm as ``(gain, bias)`` (:func:`hf_qknorm.conversion.output.forms.prenorm_forms`)."""
    plan = WeightPlan(conv1d=family.conv1d)
    anchor_proj = family.qkv_proj or family.q_proj
    for canonical, value in new_values.items():
        if canonical in weights.names.rows:  # written below, into the tensor it is split off
            continue
        if canonical in weights.names.fused:
            raise ValueError(
                f"{canonical} is made on loading from {sum(map(len, weights.names.fused[canonical].sources.values()))}"
                " checkpoint tensor(s) by an operation other than a split of rows; a new value for it cannot be written"
            )
        key = weights.source_key(canonical)
        plan.new[key] = value.detach().to(weights.dtype).contiguous()
        anchor = weights.source_key(f"{canonical.rsplit('.', 2)[0]}.{anchor_proj}.weight")
        plan.new_file[key] = weights.key_file.get(key) or weights.key_file.get(anchor) or weights.files[-1]
    if cfg.norms_qk and family.native:  # a native norm's tensors the scheme's norm in its place lacks (lp's k)
        slots = "|".join(re.escape(name) for name in family.native.values())
        own = re.compile(rf"^{re.escape(family.layers)}\.\d+\.{re.escape(family.attention)}\.({slots})\.\w+$")
        plan.drop.update(k for n, k in weights.names.direct.items() if own.match(n) and k not in plan.new)
    if cfg.removes_prenorm:
        if prenorm_forms is None:
            raise ValueError("qkv_norm needs the pre-attention norms' forms to fold them")
        for layer, form in enumerate(prenorm_forms):
            _plan_fold(plan, weights, family, layer, form)
    _plan_rows(plan, weights, new_values)
    return plan


def _plan_rows(plan: WeightPlan, weights: SourceWeights, new_values: dict) -> None:
    """A checkpoint tensor Transformers splits by its rows into several parameters (Sarvam's ``query_key_value``,
    Molmo 2's ``att_proj``) of which ``new_values`` holds some (healed projections): written as its parameters
    joined again in the order it holds them, each one not in ``new_values`` read as the converted checkpoint holds
    it (the planned fold applied)."""
    keys = dict.fromkeys(weights.names.rows[n] for n in new_values if n in weights.names.rows)
    for key in keys:
        pieces = []
        for name in row_pieces(weights.names, key):
            value = new_values.get(name)
            if value is None:
                value = weights.read_param(name, lambda k, t: transform_tensor(k, t, plan))
            pieces.append(value.detach().to(weights.dtype))
        plan.new[key] = torch.cat(pieces, dim=0).contiguous()
        plan.new_file[key] = weights.key_file[key]
        if list(plan.new[key].shape) != list(weights.shapes[key]):
            raise ValueError(f"{key}: its pieces join into {tuple(plan.new[key].shape)}, stored {weights.shapes[key]}")


def _plan_fold(plan: WeightPlan, weights: SourceWeights, family: Family, layer: int, form: tuple) -> None:
    """The ``qkv_norm`` fold of one layer's removed pre-norm ``form`` = ``(gain, bias)``
    (:mod:`hf_qknorm.portable.fold`, the rule :func:`hf_qknorm.patch_model` applies too): its gain scales the
    projections' input channels and its bias shifts their biases, computed here from the unfolded weights, one
    projection weight in memory at a time."""
    gain, bias = form
    norm = f"{family.layers}.{layer}.{family.prenorm}"
    plan.drop.update(
        k for k in (weights.source_key(f"{norm}.{p}") for p in ("weight", "bias")) if k in weights.key_file
    )
    for proj in [family.qkv_proj] if family.fused_qkv else [family.q_proj, family.k_proj, family.v_proj]:
        w_key = weights.source_key(_proj_key(family, layer, proj, "weight"))
        b_key = weights.source_key(_proj_key(family, layer, proj, "bias"))
        if w_key not in weights.key_file:
            raise ValueError(f"{weights.folder}: cannot fold {norm} into {w_key}: the checkpoint stores it otherwise")
        if gain is not None:
            plan.folds[w_key] = gain.detach().cpu()
        if bias is not None:
            if b_key not in weights.key_file:
                raise ValueError(f"cannot fold the bias of {norm} into {w_key}: the projection has no bias")
            plan.shifts[b_key] = bias_shift(weights.read(w_key), bias.detach().cpu(), family.conv1d)


def transform_tensor(key: str, tensor: torch.Tensor, plan: WeightPlan) -> torch.Tensor:
    """``tensor`` (the source's ``key``) as the converted checkpoint holds it: the planned gain folded into it and the
    planned bias shift applied (the ``qkv_norm`` fold of the removed pre-norm); other tensors unchanged."""
    if key in plan.folds:
        tensor = fold_gain(tensor, plan.folds[key], plan.conv1d)
    if key in plan.shifts:
        tensor = shifted_bias(tensor, plan.shifts[key])
    return tensor


def write_weights(weights: SourceWeights, plan: WeightPlan, out: Path, progress: bool = True) -> list[str]:
    """Write the planned checkpoint into ``out`` shard by shard; returns the written file names."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    weight_map, total = {}, 0
    files = weights.files
    if progress and len(files) > 1:
        from tqdm.auto import tqdm

        files = tqdm(files, desc="writing shards", unit="shard", leave=False, file=sys.stderr, disable=None)
    for name in files:
        tensors = {}
        with safe_open(weights.folder / name, framework="pt") as f:
            metadata = dict(f.metadata() or {})
            for key in f.keys():
                if key in plan.drop:
                    continue
                tensors[key] = (
                    plan.new[key]
                    if key in plan.new
                    else transform_tensor(key, check_finite(f.get_tensor(key), key, name), plan)
                )
        tensors.update({k: v for k, v in plan.new.items() if plan.new_file[k] == name and k not in tensors})
        metadata.setdefault("format", "pt")
        _save(save_file, tensors, Path(out) / name, metadata)
        for key, t in tensors.items():
            weight_map[key] = name
            total += t.numel() * t.element_size()
        del tensors
    if weights.index is None:
        return list(weights.files)
    index = {
        **weights.index,
        "metadata": {**weights.index.get("metadata", {}), "total_size": total},
        "weight_map": dict(sorted(weight_map.items())),
    }
    (Path(out) / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    return [*weights.files, INDEX_FILE]


_OS_ERROR = re.compile(r"os error (\d+)")


def _save(save_file, tensors: dict, path: Path, metadata: dict) -> None:
    """``save_file`` with the file system's errors (a full disk, a read-only folder) as ``OSError`` naming ``path``:
    safetensors reports them as its own ``SafetensorError`` with the errno in the text."""
    try:
        save_file(tensors, str(path), metadata=metadata)
    except Exception as exc:
        if isinstance(exc, OSError):
            raise
        m = _OS_ERROR.search(str(exc))
        if m is None:
            raise
        code = int(m.group(1))
        raise OSError(code, os.strerror(code), str(path)) from exc
