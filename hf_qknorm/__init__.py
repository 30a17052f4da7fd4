"""hf_qknorm: QK-norm, softmax capping and QKV-norm for Hugging Face Transformers.

Importing the package checks the Transformers version, registers the ``"qknorm"`` attention implementation
(attention and mask functions) and the ``qknorm_<base>`` model types with the Auto classes. Everything else is
imported on first use (module-level ``__getattr__``), so ``import hf_qknorm`` stays cheap.

Layout: :mod:`hf_qknorm.portable` (schemes, norms, families, the model surgery: the code saved folders carry),
:mod:`hf_qknorm.kernels` (Triton), :mod:`hf_qknorm.attention` (the backend) and :mod:`hf_qknorm.modeling` (patching,
the ``qknorm_<base>`` classes, telemetry, sharding) are the runtime;
:mod:`hf_qknorm.conversion` (checkpoint conversion) and :mod:`hf_qknorm.training` (monitor, Q/K learning rates,
QK-Clip, LoRA) build on it; :mod:`hf_qknorm.cli` on everything.
"""

from __future__ import annotations

import importlib

from ._version import __version__
from .upstream import check_transformers_version, run_as_command_line

# public name -> module that defines it (imported on first access)
_LAZY = {
    "ATTN_IMPLEMENTATION": "portable.names",
    "qknorm_attention_forward": "attention.interface",
    "kernel_policy": "attention.dispatch",
    "KernelFallbackError": "attention.dispatch",
    "DEFAULT_SOFTCAP": "portable.schemes",
    "NORMS": "portable.schemes",
    "SCHEMES": "portable.schemes",
    "QKNormConfig": "portable.schemes",
    "Scheme": "portable.schemes",
    "Norm": "portable.schemes",
    "Family": "portable.families",
    "UnsupportedModelError": "portable.families",
    "get_family": "modeling.derive",
    "patch_model": "modeling.patch",
    "is_patched": "modeling.patch",
    "qknorm_config": "modeling.patch",
    "unwrap": "portable.layout",
    "parallelize_attention": "modeling.sharding",
    "add_remote_code": "modeling.remote",
    "verify": "verification.api",
    "VerifyReport": "verification.report",
    "convert": "conversion.orchestration.converter",
    "ConversionResult": "conversion.orchestration.converter",
    "CalibrationSettings": "conversion.calibration.calibrate",
    "HealSettings": "conversion.healing.heal",
    "HubSettings": "conversion.output.hub",
    "CalibrationReport": "conversion.calibration.stats",
    "QKMonitor": "training.monitor",
    "QKMonitorCallback": "training.monitor",
    "attention_stats": "training.monitor",
    "QKLearningRate": "training.qk_lr",
    "QKLearningRateCallback": "training.qk_lr",
    "qk_param_groups": "training.qk_lr",
    "QKClip": "training.qk_clip",
    "QKClipCallback": "training.qk_clip",
    "lora_config": "training.lora",
    "prepare_lora": "training.lora",
}

__all__ = sorted(_LAZY) + ["__version__"]


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__():
    return sorted(set(globals()) | set(_LAZY))


def _register() -> None:
    from .attention.interface import register
    from .modeling.classes import register_auto_classes

    register()
    register_auto_classes()


check_transformers_version(quiet=run_as_command_line())
_register()
