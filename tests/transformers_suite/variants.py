"""The scheme variants the common tests run on, and which of them run in CI.

``baseline`` is the unpatched model (with ``hf_qknorm`` imported, as a user's process would have it); every other
variant builds ``QKNorm<Head>`` classes from a config carrying ``qknorm``. A test's outcome on a variant is compared
with its outcome on ``baseline`` for the same family (see ``expected_differences.toml``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

FULL_SUITE_ENV = "HF_QKNORM_FULL_SUITE"
# comma-separated model types: fewer families (scripts/test_version.sh), or any model type `hf-qknorm coverage`
# lists as patched ("all": every one of them)
FAMILIES_ENV = "HF_QKNORM_SUITE_FAMILIES"


@dataclass(frozen=True)
class Variant:
    """``route="config"``: the ``QKNorm<Head>`` classes built from a config carrying ``qknorm`` (what loading a saved
    folder does). ``route="patch_model"``: the base classes, each model patched by :func:`hf_qknorm.patch_model`
    right after it is built from the plain config (what a user does to a loaded model)."""

    name: str
    settings: dict = field(default_factory=dict)  # QKNormConfig arguments; empty for the baseline
    route: str = "config"

    @property
    def patched(self) -> bool:
        return bool(self.settings)

    def qknorm_dict(self, base_config, model_type: str) -> dict | None:
        """The ``config.qknorm`` entry the tester's config carries (eps from the model's own norm, as
        ``patch_model`` resolves it), or ``None`` for the baseline and the ``patch_model`` route."""
        if not self.patched or self.route == "patch_model":
            return None
        from hf_qknorm import QKNormConfig, get_family

        eps = float(get_family(model_type).norm_eps(base_config))
        return QKNormConfig(**{"eps": eps, **self.settings}).to_dict()

    def config_class(self, model_type: str, base_config_class: type) -> type:
        if not self.patched or self.route == "patch_model":
            return base_config_class
        from hf_qknorm.modeling.classes import config_class

        return config_class(model_type)

    def model_class(self, base_cls: type, model_type: str) -> type:
        if not self.patched:
            return base_cls
        from hf_qknorm.modeling.classes import model_class

        if self.route == "patch_model":
            return _patched_after_init(base_cls, self.settings)
        return model_class(base_cls, model_type)


def _patched_after_init(base_cls: type, settings: dict) -> type:
    """``base_cls`` whose models are patched by ``patch_model`` once built from a plain config. A config carrying a
    saved scheme (``from_pretrained`` of a folder such a model saved) is rebuilt as the ``QKNorm<Head>`` class
    would rebuild it."""
    from hf_qknorm import QKNormConfig, patch_model
    from hf_qknorm.modeling.classes import mark_patched
    from hf_qknorm.portable.structure import patch_on_init

    def __init__(self, config, *args, **kwargs):
        base_cls.__init__(self, config, *args, **kwargs)
        saved = getattr(self.config, "qknorm", None)
        if saved is None:
            patch_model(self, QKNormConfig(**settings))
        else:
            mark_patched(self.config, QKNormConfig.from_dict(saved))
            patch_on_init(self)

    def is_custom_code(cls) -> bool:
        return base_cls.is_custom_code()  # what the plain Transformers class a user patches answers

    body = {"__init__": __init__, "__module__": __name__, "__qualname__": base_cls.__name__}
    if hasattr(base_cls, "is_custom_code"):
        body["is_custom_code"] = classmethod(is_custom_code)
    return type(base_cls.__name__, (base_cls,), body)


BASELINE = Variant("baseline")
VARIANTS: tuple[Variant, ...] = (
    BASELINE,
    Variant("qk_norm-layernorm", {"scheme": "qk_norm", "norm": "layernorm"}),
    Variant("qk_norm_cap-50", {"scheme": "qk_norm_cap", "norm": "layernorm", "softcap": 50.0}),
    # A cap of 2 bends every logit of these models (theirs are O(1)): the cap really acts.
    Variant("qk_norm_cap-2", {"scheme": "qk_norm_cap", "norm": "layernorm", "softcap": 2.0}),
    Variant("qkv_norm-rmsnorm", {"scheme": "qkv_norm", "norm": "rmsnorm"}),
    Variant("soft_cap-2", {"scheme": "soft_cap", "softcap": 2.0}),
    Variant("qk_norm-lp3", {"scheme": "qk_norm", "norm": "lp", "p": 3.0}),
    Variant(
        "patch_model-qk_norm_cap-2", {"scheme": "qk_norm_cap", "norm": "layernorm", "softcap": 2.0}, route="patch_model"
    ),
)
# CI runs every family on these (the baseline plus the variant that changes most: norms and a cap that bites).
CI_VARIANTS = ("baseline", "qk_norm_cap-2")
FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gpt2")


# The CI subset also leaves out 22 of the 25 eager-vs-sdpa cases (kept: fp32 left and right padding, and the
# output_attentions case): on the baseline they cost half of the subset's time, and on a capped model they all stop
# at the same refusal of eager attention. HF_QKNORM_FULL_SUITE=1 runs them all.
CI_EAGER_SDPA_KEPT = (
    "test_eager_matches_sdpa_inference_09_fp32_pad_left",
    "test_eager_matches_sdpa_inference_13_fp32_pad_right",
    "test_eager_matches_sdpa_inference_24_fp32_pad_left_output_attentions",
)


def deselected(test: str) -> bool:
    """Whether the CI subset leaves ``test`` out (never in the full suite)."""
    return not full_suite() and test.startswith("test_eager_matches_sdpa_inference_") and test not in CI_EAGER_SDPA_KEPT


def full_suite() -> bool:
    return os.environ.get(FULL_SUITE_ENV, "") not in ("", "0")


def selected_variants() -> tuple[Variant, ...]:
    return VARIANTS if full_suite() else tuple(v for v in VARIANTS if v.name in CI_VARIANTS)


def selected_families() -> tuple[str, ...]:
    wanted = [f.strip() for f in os.environ.get(FAMILIES_ENV, "").split(",") if f.strip()]
    if wanted == ["all"]:
        return FAMILIES + tuple(t for t in covered_types() if t not in FAMILIES)
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    unknown = sorted(f for f in wanted if f not in CONFIG_MAPPING_NAMES)
    if unknown:
        raise ValueError(f"{FAMILIES_ENV} names unknown model types {unknown}; valid: a model type, or 'all'")
    return tuple(wanted) if wanted else FAMILIES


def covered_types() -> tuple[str, ...]:
    """The model types the committed coverage table of this Transformers lists as patched."""
    return tuple(r["model_type"] for r in _coverage_records() if r["status"] == "patched")


def _coverage_records() -> list[dict]:
    import json
    from pathlib import Path

    import transformers

    major_minor = ".".join(transformers.__version__.split(".")[:2])
    table = (
        Path(__file__).resolve().parents[2] / "benchmarks" / "runs" / "coverage" / f"transformers-{major_minor}.json"
    )
    if not table.is_file():
        raise ValueError(f"{FAMILIES_ENV}=all needs {table} (hf-qknorm coverage --json {table})")
    return json.loads(table.read_text())


def refused_up_front(model_type: str, variant: Variant) -> bool:
    """Whether the committed coverage table says ``patch_model`` refuses ``variant``'s scheme for ``model_type``
    (``qkv_norm`` on a post-norm or parallel block): such a pair has no patched model to test."""
    if not variant.patched or model_type in FAMILIES:
        return False
    try:
        records = {r["model_type"]: r for r in _coverage_records()}
    except ValueError:
        return False
    scheme, norm = variant.settings.get("scheme"), variant.settings.get("norm")
    key = scheme if scheme == "soft_cap" else f"{scheme}/{norm or 'layernorm'}"
    return str(records.get(model_type, {}).get("variants", {}).get(key, "")).startswith("refused")
