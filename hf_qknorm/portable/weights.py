"""A saved ``qknorm_<base>`` folder's weights against its scheme: a norm weight missing, unexpected or of another
shape is an error at load time, never fresh norms run in place of trained ones.

This module imports nothing but ``torch`` and its siblings: it is also copied into exported folders.
"""

from __future__ import annotations

from torch import nn

from .families import family_of_model
from .names import ROLES


class SchemeWeightsError(ValueError):
    """A saved ``qknorm_<base>`` folder's weights do not match its scheme: a norm weight is missing, unexpected or
    of another shape. ``save_pretrained`` and ``hf-qknorm convert`` write exactly the scheme's norm weights, so such a
    folder was edited, truncated or mixed up; loading it anyway would run fresh (identity) norms in place of the
    trained ones -- a model that computes its scheme faithfully on the wrong weights."""


def check_scheme_weights(model: nn.Module, loading_info) -> None:
    """Raise :class:`SchemeWeightsError` when ``loading_info`` (Transformers' ``LoadStateDictInfo`` of a
    ``from_pretrained`` into a ``qknorm_<base>`` class) reports a scheme weight missing, unexpected or of another
    shape (with ``ignore_mismatched_sizes=True``, where Transformers would re-initialise it).

    Scheme weights: the parameters of the ``q_norm``/``k_norm``/``v_norm`` modules of every attention module the
    model has (Qwen3's own norms of ``soft_cap`` included), and for ``qkv_norm`` the pre-attention norm it removes
    (its gain lives folded in the projections; a checkpoint still holding it was not saved from this scheme).
    Checkpoint keys of layers the model does not have (a config cut to fewer layers) are left to Transformers'
    report: a partial load of whole layers is an ordinary thing to do."""
    settings = getattr(model.config, "qknorm", None) or {}
    family = family_of_model(model)
    prenorm = family.prenorm if settings.get("scheme") == "qkv_norm" else None
    slots = {family.norm_slot(role) for role in ROLES}
    missing = [k for k in loading_info.missing_keys if _scheme_key(model, k, prenorm, slots)]
    unexpected = [k for k in loading_info.unexpected_keys if _scheme_key(model, k, prenorm, slots)]
    mismatched = [m for m in loading_info.mismatched_keys if _scheme_key(model, m[0], prenorm, slots)]
    if not (missing or unexpected or mismatched):
        return
    parts = []
    if missing:
        parts.append(f"missing {keys_text(missing)}")
    if unexpected:
        parts.append(f"unexpected {keys_text(unexpected)}")
    if mismatched:
        key, saved, wanted = sorted(mismatched)[0]
        more = f" (and {len(mismatched) - 1} more)" if len(mismatched) > 1 else ""
        parts.append(f"{key} has shape {tuple(saved)} in the checkpoint, {tuple(wanted)} in the model{more}")
    where = getattr(model.config, "_name_or_path", "") or "the checkpoint"
    scheme = settings.get("scheme")
    norm = f" / {settings['norm']}" if settings.get("norm") else ""
    raise SchemeWeightsError(
        f"{where}: the norm weights do not match scheme {scheme}{norm}: {'; '.join(parts)}. A folder written by "
        "save_pretrained or hf-qknorm convert holds exactly its scheme's norm weights, so this one was edited or "
        "mixed up; loading it would run fresh norms in place of trained ones. To start from fresh norms, load the "
        "unpatched model and call hf_qknorm.patch_model"
    )


def _scheme_key(model: nn.Module, key: str, prenorm: str | None, slots: set[str]) -> bool:
    """Whether state-dict ``key`` is a scheme weight of an attention module (or removed pre-norm) ``model`` has."""
    owner, _, _ = key.rpartition(".")
    parent, _, slot = owner.rpartition(".")
    if slot not in slots and slot != prenorm:
        return False
    try:
        model.get_submodule(parent if slot in slots else owner)
    except AttributeError:  # a layer the model does not have
        return False
    return True


def keys_text(keys) -> str:
    """``model.layers.*.self_attn.q_norm.weight (layers 0, 1)``-style summary of state-dict keys, one line."""
    groups: dict[str, list[tuple[int, str]]] = {}
    for key in sorted(keys):
        parts = key.split(".")
        at = next((i for i, part in enumerate(parts[:-1]) if part.isdigit()), None)  # the layer index
        pattern = key if at is None else ".".join(parts[:at] + ["*"] + parts[at + 1 :])
        groups.setdefault(pattern, []).append((-1 if at is None else int(parts[at]), key))
    items = []
    for pattern, members in sorted(groups.items()):
        if len(members) == 1:
            items.append(members[0][1])
            continue
        numbered = sorted(layer for layer, _ in members)
        shown = ", ".join(map(str, numbered[:6])) + (", ..." if len(numbered) > 6 else "")
        items.append(f"{pattern} (layers {shown})")
    more = f" and {len(items) - 4} more" if len(items) > 4 else ""
    return ", ".join(items[:4]) + more
