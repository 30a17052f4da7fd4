"""Everything hf_qknorm takes from Transformers, in one place: the tested version range and every upstream symbol
the package relies on, with what it relies on and the test that re-checks it.

The patch copies no upstream code: a patched model runs Transformers' own attention forward, with the norms applied
by hooks on the projections and the cap read by the ``"qknorm"`` backend. What remains are the reliances listed in
:data:`RELIANCES`; ``tests/test_upstream.py`` checks each of them and names what to re-check when one changes.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

# The Transformers versions CI runs (.ci/run): the whole suite on the newest; the core and training subsets
# (scripts/test_version.sh) on the oldest and on one in the middle of the range. Keep in step with pyproject.toml's
# dependency range, .ci/run, the README's Testing section and docs/compatibility.md (every minor version, measured).
OLDEST_TESTED = "5.4.0"
MIDDLE_TESTED = "5.17.0"
NEWEST_TESTED = "5.24.0"


def _version_tuple(v: str) -> tuple[int, ...]:
    parts = []
    for piece in v.split("+")[0].split("."):
        digits = "".join(c for c in piece if c.isdigit())
        if not digits:
            break
        parts.append(int(digits))
        if digits != piece:  # 5.24.0rc1, 5.24.0.dev0: stop at the pre-release tag
            break
    return tuple(parts)


def _installed_transformers() -> str:
    import transformers

    return transformers.__version__


def untested_version_note(version: str | None = None) -> str | None:
    """One line saying that Transformers ``version`` (the installed one by default) is newer than the newest minor
    series tested, or None."""
    version = _installed_transformers() if version is None else version
    if _version_tuple(version)[:2] <= _version_tuple(NEWEST_TESTED)[:2]:
        return None
    tested = f"{OLDEST_TESTED} to {NEWEST_TESTED}"
    return f"hf_qknorm {_own_version()} was tested with transformers {tested}; found {version}"


def check_transformers_version(version: str | None = None, *, quiet: bool = False) -> None:
    """Refuse a Transformers older than :data:`OLDEST_TESTED`; warn (once) for one newer than
    :data:`NEWEST_TESTED` minor series, which the package was not tested with (``quiet``: not here, the caller
    reports :func:`untested_version_note` itself, as the command line does)."""
    version = _installed_transformers() if version is None else version
    if _version_tuple(version) < _version_tuple(OLDEST_TESTED):
        raise ImportError(
            f"hf_qknorm needs transformers>={OLDEST_TESTED} (tested {OLDEST_TESTED} to "
            f"{NEWEST_TESTED}); found {version}. Upgrade: pip install -U 'transformers>={OLDEST_TESTED}'"
        )
    note = untested_version_note(version)
    if note is not None and not quiet:
        warnings.warn(
            f"{note}. It may work; run `hf-qknorm verify` on your model to check that the scheme is computed exactly.",
            UserWarning,
            stacklevel=3,
        )


def run_as_command_line() -> bool:
    """Whether this process is the ``hf-qknorm`` command (the console script, or ``python -m hf_qknorm.cli``),
    which reports an untested version in its own lines instead of a warning printed at import."""
    import os
    import sys

    if os.path.basename(sys.argv[0] if sys.argv else "").split(".")[0] == "hf-qknorm":
        return True
    argv = list(getattr(sys, "orig_argv", ()))
    return any(a == "-m" and b in ("hf_qknorm.cli", "hf_qknorm") for a, b in zip(argv, argv[1:]))


def _own_version() -> str:
    from ._version import __version__

    return __version__


def installed_versions() -> dict[str, str]:
    """hf_qknorm, Transformers, torch and Python versions, for reports and model cards."""
    import platform

    import torch
    import transformers

    return {
        "hf_qknorm": _own_version(),
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
    }


# ---------------------------------------------------------------------------------------------------------------
# Version shims: API whose name depends on the Transformers version. Each picks by feature (what the installed
# Transformers has), is named for the version where the API changed, and has a RELIANCES entry with its test.
# ---------------------------------------------------------------------------------------------------------------

# Transformers 5.23 renamed gradient checkpointing to activation checkpointing: TrainingArguments'
# ``activation_checkpointing[_kwargs]`` and PreTrainedModel's ``activation_checkpointing_enable`` /
# ``is_activation_checkpointing``. 5.23 keeps the old names as deprecated aliases (warning on use); before 5.23 only
# the old names exist.
ACTIVATION_CHECKPOINTING_SINCE = "5.23.0"


def _has_activation_checkpointing_arguments() -> bool:
    import dataclasses

    from transformers import TrainingArguments

    return any(f.name == "activation_checkpointing" for f in dataclasses.fields(TrainingArguments))


def checkpointing_arguments(enabled: bool = True, **kwargs) -> dict:
    """The ``TrainingArguments`` keywords that turn activation (gradient) checkpointing on or off, with ``kwargs``
    for the checkpoint function (e.g. ``use_reentrant=False``), under the installed version's names."""
    prefix = "activation" if _has_activation_checkpointing_arguments() else "gradient"
    return {f"{prefix}_checkpointing": enabled, f"{prefix}_checkpointing_kwargs": kwargs or None}


def enable_checkpointing(model, **kwargs) -> None:
    """Turn on activation (gradient) checkpointing of ``model`` (a PreTrainedModel, or a wrapper that forwards
    attributes to one, as peft's does), ``kwargs`` going to the checkpoint function."""
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs or None)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs or None)


def is_checkpointing(model) -> bool:
    """Whether activation (gradient) checkpointing is on for ``model``."""
    if hasattr(type(model), "is_activation_checkpointing") or hasattr(model, "activation_checkpointing_enable"):
        return bool(model.is_activation_checkpointing)
    return bool(model.is_gradient_checkpointing)


# Transformers 5.24 renamed the key/value cache from ``past_key_values`` to ``cache``: the models' and attention
# modules' forward arguments, the mask builders' and the outputs' field. The old name lives on (a ``deprecate_kwarg``
# wrapper and output properties, both warning) until 5.40. Every call and read of the plugin goes through these
# helpers, which pick the name by what the callee declares, never by the version alone.
CACHE_RENAMED_IN = "5.24.0"
CACHE_NAMES = ("cache", "past_key_values")  # the new name first
CALL_CACHE_NAMES = (*CACHE_NAMES, "layer_past")  # as an attention module receives it (GPT-NeoX: layer_past)
_CACHE_ARGUMENT: dict = {}


def cache_argument(model) -> str:
    """The name under which ``model``'s forward (a module, or its class) takes the key/value cache: ``"cache"``
    where it declares that parameter, else ``"past_key_values"``."""
    import inspect

    cls = model if isinstance(model, type) else type(model)
    name = _CACHE_ARGUMENT.get(cls)
    if name is None:
        try:
            params = inspect.signature(cls.forward).parameters
        except (TypeError, ValueError):  # no signature to read: the installed version's name
            params = {}
        name = next((n for n in CACHE_NAMES if n in params), None)
        if name is None:
            import transformers

            new = _version_tuple(transformers.__version__) >= _version_tuple(CACHE_RENAMED_IN)
            name = CACHE_NAMES[0] if new else CACHE_NAMES[1]
        _CACHE_ARGUMENT[cls] = name  # the same value from every thread: a plain store
    return name


def cache_kwargs(model, cache) -> dict:
    """``{name: cache}`` for a call of ``model``, under the name its forward takes."""
    return {cache_argument(model): cache}


def output_cache(output):
    """The key/value cache a model's output carries (``output.cache``, or ``output.past_key_values`` before 5.24),
    without touching the other name's deprecated property."""
    keys = output.keys() if hasattr(output, "keys") else ()
    for name in CACHE_NAMES:
        if name in keys:
            return output[name]
    fields = getattr(type(output), "__dataclass_fields__", {})
    name = next((n for n in CACHE_NAMES if n in fields), None)
    return None if name is None else getattr(output, name)


def called_cache(kwargs: dict):
    """The cache in the keyword arguments of an attention module's call (a forward hook's ``kwargs``), under either
    name, or ``layer_past`` (GPT-NeoX's and its relatives' attention modules)."""
    for name in CALL_CACHE_NAMES:
        if kwargs.get(name) is not None:
            return kwargs[name]
    return None


@dataclass(frozen=True)
class Reliance:
    """One thing hf_qknorm relies on in Transformers (or, where it reads private state, in torch)."""

    symbol: str  # dotted path, importable
    used_by: str  # our module that relies on it
    what: str  # the behaviour relied on
    checked_by: str  # the test that fails when it changes
    since: str | None = None  # the first Transformers that has it; on older ones ``used_by`` does not reach it


RELIANCES: tuple[Reliance, ...] = (
    Reliance(
        "transformers.integrations.heterogeneity.configuration_utils._HeterogeneitySpec",
        "verification/tiny.py",
        "a heterogeneous config (per_layer_config, Transformers 5.14+) keeps its per-layer overrides as "
        "config._heterogeneity_spec.per_layer_overrides ({layer: {attribute: value}}); setting "
        "config.per_layer_config = None takes them off; absent on an ordinary config",
        "tests/modeling/test_newer_types.py::test_per_layer_sizes_are_kept_scaled_and_patched_exactly",
        since="5.14.0",
    ),
    Reliance(
        "transformers.integrations.heterogeneity.HeterogeneousConfigMixin._getattr_without_heterogeneous_validation",
        "verification/tiny.py",
        "config._getattr_without_heterogeneous_validation(name, default) reads an attribute's global value on a "
        "config with per-layer overrides of it (plain attribute access raises there)",
        "tests/modeling/test_newer_types.py::test_per_layer_sizes_are_kept_scaled_and_patched_exactly",
        since="5.14.0",
    ),
    Reliance(
        "transformers.models.llama.modeling_llama.LlamaAttention.forward",
        "portable/hooks.py",
        "calls self.q_proj/k_proj/v_proj(hidden_states) and views the result as (..., heads, head_dim) before "
        "RoPE; passes scaling=self.scaling and **kwargs to the attention interface with the module first "
        "(same for Mistral, Qwen2)",
        "tests/verification/test_reference.py::test_layer_matches_reference",
    ),
    Reliance(
        "transformers.models.qwen3.modeling_qwen3.Qwen3Attention.forward",
        "portable/hooks.py",
        "calls self.q_norm / self.k_norm on the (..., heads, head_dim) projections before RoPE",
        "tests/verification/test_reference.py::test_layer_matches_reference",
    ),
    Reliance(
        "transformers.models.gpt2.modeling_gpt2.GPT2Attention.forward",
        "portable/hooks.py",
        "calls self.c_attn(hidden_states) whose output is [q | k | v] (split_size each) viewed as "
        "(..., heads, head_dim); passes scaling=self.scaling to the attention interface",
        "tests/verification/test_reference.py::test_layer_matches_reference",
    ),
    Reliance(
        "transformers.AttentionInterface.register",
        "attention/interface.py",
        "registers 'qknorm' so that set_attn_implementation('qknorm') dispatches to it",
        "tests/test_upstream.py::test_backend_is_registered",
    ),
    Reliance(
        "transformers.masking_utils.AttentionMaskInterface.register",
        "attention/interface.py",
        "registers sdpa_mask for 'qknorm': boolean masks, None only where top-left causal is exact",
        "tests/modeling/test_models.py::test_generate_with_cache_matches_uncached",
    ),
    Reliance(
        "transformers.masking_utils.sdpa_mask",
        "portable/masks.py",
        "the mask convention the backend follows (see portable/masks.py)",
        "tests/modeling/test_models.py::test_padded_batch_matches_unbatched",
    ),
    Reliance(
        "transformers.modeling_utils.ALL_ATTENTION_FUNCTIONS.valid_keys",
        "portable/entry/modeling_qknorm.py",
        "lists registered attention implementations (the remote code registers 'qknorm' only if missing)",
        "tests/modeling/test_export.py::test_saved_folders_load_without_the_plugin",
    ),
    Reliance(
        "transformers.modeling_utils.ALL_ATTENTION_FUNCTIONS._local_mapping",
        "modeling/selfcheck.py",
        "a dict of the instance's own entries that its lookups (get_interface, []) consult before the registered "
        "functions, on every attention call; the self-check puts its recorder in front of 'qknorm' there for the "
        "probe and restores the dict as it was",
        "tests/test_upstream.py::test_a_local_attention_entry_is_what_the_models_call",
    ),
    Reliance(
        "transformers.modeling_utils.ALL_ATTENTION_FUNCTIONS._local_mapping",
        "modeling/vision.py",
        "the vision encoder's patch-time probe puts its recorder in front of 'qknorm' there (as the self-check does) "
        "and restores the dict as it was",
        "tests/modeling/test_multimodal.py::test_the_vision_encoder_on_request_matches_the_float64_reference",
    ),
    Reliance(
        "transformers.PretrainedConfig._attn_implementation",
        "modeling/vision.py",
        "the attention implementation a config dispatches on is its `_attn_implementation_internal` field: the "
        "vision probe sets the encoder's config there for the probe forward and puts the old value back",
        "tests/modeling/test_multimodal.py::test_the_vision_encoder_on_request_matches_the_float64_reference",
    ),
    Reliance(
        "transformers.models.auto.modeling_auto.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING",
        "portable/autoclasses.py (MULTIMODAL_HEADS); modeling/saved.py (auto_class: the Auto class of a multimodal "
        "model with no image-text-to-text head, MOSS Transcribe-Diarize's, read from the multimodal-LM mapping)",
        "config class -> image-text-to-text head class (and MODEL_FOR_MULTIMODAL_LM_MAPPING where the release has "
        "it): the Auto classes a saved multimodal folder's auto_map names, so it loads without the plugin",
        "tests/modeling/test_multimodal_export.py::test_saved_multimodal_folders_load_without_the_plugin_with_the_same_logits",
    ),
    Reliance(
        "triton.runtime._allocation._allocator",
        "kernels/attention.py",
        "Triton keeps the scratch allocator that in-kernel tensor descriptors use at launch in this ContextVar; the "
        "opt-in TMA forward sets it for one launch and resets the token after (where it is missing or no "
        "ContextVar, the TMA forward is never taken)",
        "tests/kernels/test_kernel_tma.py::test_descriptor_scratch_puts_the_callers_allocator_back",
    ),
    Reliance(
        "torch.ops.mkldnn._is_mkldnn_bf16_supported",
        "conversion/healing/selftext.py",
        "true where oneDNN runs bfloat16 matrix products on this CPU; the heal text is then generated in bfloat16 "
        "(where the op is missing or raises, float32)",
        "tests/conversion/test_selftext.py::test_generation_dtype_is_bfloat16_only_where_it_is_fast",
    ),
    Reliance(
        "torch.utils._foreach_utils._get_fused_kernels_supported_devices",
        "conversion/calibration/optim.py",
        "the device types torch's fused optimizers run on (a list of names, 'cpu' among them where torch fuses Adam "
        "on the CPU); the conversion's fits use fused Adam only on CPU or CUDA when listed (where the helper is "
        "missing, on CUDA alone)",
        "tests/conversion/test_optim.py::test_fused_where_torch_takes_the_parameters",
    ),
    Reliance(
        "torch.nn.modules.module._global_forward_hooks",
        "portable/hooks.py",
        "torch keeps its process-wide module hooks in four module-level dicts (_global_forward_pre_hooks, "
        "_global_forward_hooks, _global_backward_pre_hooks, _global_backward_hooks) and a module's own in "
        "_forward_hooks, _forward_pre_hooks, _backward_hooks, _backward_pre_hooks; all empty means "
        "nn.Module.__call__ would only call forward, so the per-head norms' call skips it (where the dicts are "
        "missing, every call goes through __call__)",
        "tests/modeling/test_patching.py::test_every_kind_of_hook_on_a_norm_is_called",
    ),
    Reliance(
        "transformers.models.auto.modeling_auto.MODEL_MAPPING",
        "portable/structure.py (AUTO_HEADS)",
        "config class -> head class mappings (MODEL_FOR_CAUSAL_LM_MAPPING and the classification / QA ones)",
        "tests/modeling/test_patching.py::test_every_head_class_round_trips",
    ),
    Reliance(
        "transformers.PreTrainedModel.set_attn_implementation",
        "modeling/patch.py",
        "switches a model (and its sub-configs) to a registered attention implementation",
        "tests/cli/test_errors.py::test_cap_is_never_dropped",
    ),
    Reliance(
        "transformers.models.llama.modeling_llama.apply_rotary_pos_emb",
        "portable/layout.py (rotary_function)",
        "each RoPE family's modelling file has apply_rotary_pos_emb(q, k, cos, sin) -> (q, k), the rotation its "
        "forward applies (the monitor and calibration statistics rebuild the backend's q and k with it)",
        "tests/test_upstream.py::test_rotary_function_is_the_forwards_rotation",
    ),
    Reliance(
        "transformers.PretrainedConfig.to_dict",
        "portable/structure.py (PatchedConfigMixin)",
        "the dict save_pretrained writes as config.json (architectures and auto_map rewritten)",
        "tests/modeling/test_save_load.py::test_round_trip",
    ),
    Reliance(
        "transformers.utils.output_capturing._active_collector",
        "attention/interface.py (weights_requested)",
        "while a model's output capture runs, .get() is the dict of outputs it collects, with an 'attentions' "
        "key when attention weights were asked for (output_attentions=True or config.output_attentions)",
        "tests/modeling/test_transformers_conventions.py::test_output_attentions_returns_weights_on_every_family",
    ),
    Reliance(
        "transformers.PretrainedConfig.output_attentions",
        "portable/structure.py (PatchedConfigMixin)",
        "a property whose setter refuses True unless the attention implementation is eager; a patched config "
        "accepts 'qknorm' too and otherwise defers to it",
        "tests/modeling/test_transformers_conventions.py::test_config_output_attentions_returns_weights_on_a_capped_model",
    ),
    Reliance(
        "transformers.PreTrainedModel._initialize_missing_keys",
        "portable/structure.py (make_model_class)",
        "from_pretrained calls it once the checkpoint is loaded; loaded tensors carry _is_hf_initialized, the "
        "rest is initialised by the family's _init_weights (the norms a checkpoint lacks get their initial "
        "values after it, before the load is refused)",
        "tests/modeling/test_transformers_conventions.py::test_patched_gpt2_is_initialised_like_gpt2",
    ),
    Reliance(
        "transformers.PreTrainedModel._adjust_missing_and_unexpected_keys",
        "portable/structure.py (make_model_class: check_scheme_weights)",
        "from_pretrained calls it with the LoadStateDictInfo (missing_keys, unexpected_keys, mismatched_keys as "
        "(key, checkpoint shape, model shape)) after its own ignore rules, before its report; an exception "
        "raised there leaves from_pretrained",
        "tests/modeling/test_save_load.py::test_a_folder_whose_norm_weights_do_not_match_its_scheme_never_loads",
    ),
    Reliance(
        "transformers.PreTrainedModel.initialize_weights",
        "portable/structure.py (make_model_class)",
        "skips _init_weights on modules without parameters of their own for custom code: is_custom_code() (5.23; "
        "true for classes outside Transformers' package, so QKNorm classes answer as their base class) or "
        "is_remote_code() (5.4)",
        "tests/modeling/test_transformers_conventions.py::test_patched_gpt2_is_initialised_like_gpt2",
    ),
    Reliance(
        "transformers.Trainer.compute_loss",
        "portable/structure.py (make_model_class: _get_name)",
        "label smoothing shifts the labels when model._get_name() is in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES",
        "tests/modeling/test_transformers_conventions.py::"
        "test_trainer_label_smoothing_shifts_the_labels_of_a_loaded_patched_model",
    ),
    Reliance(
        "transformers.TrainingArguments",
        "upstream.py (checkpointing_arguments), recipes/_common.py",
        f"has activation_checkpointing[_kwargs] fields from {ACTIVATION_CHECKPOINTING_SINCE} on, "
        "gradient_checkpointing[_kwargs] (deprecated from then on) before; Trainer then enables checkpointing "
        "on the model",
        "tests/test_upstream.py::test_checkpointing_shim_follows_the_installed_version",
    ),
    Reliance(
        "transformers.conversion_mapping.get_model_conversion_mapping",
        "conversion/output/keys.py",
        "the renamings (WeightRenaming) and converters (WeightConverter: fused MoE experts, split q/k/v) "
        "from_pretrained applies to a model's checkpoint keys; convert reads a source's tensors by the same rules",
        "tests/conversion/test_convert_every_type.py::test_every_sample_type_converts_and_reloads_without_the_plugin",
    ),
    Reliance(
        "transformers.core_model_loading.ConversionOps",
        "conversion/output/keys.py (fuse)",
        "an operation's convert(input_dict, source_patterns, target_patterns, full_layer_name=, model=, config=, "
        "missing_keys=) makes a parameter from checkpoint tensors as the loader calls it (Chunk, Split, "
        "ErnieFuseAndSplitTextVisionExperts); a Chunk or Split along dim 0 gives the targets' rows in their order",
        "tests/conversion/test_convert_every_type.py::"
        "test_a_healed_projection_split_off_a_stored_tensor_is_written_back_into_it",
    ),
    Reliance(
        "transformers.models.auto.auto_factory._LazyAutoMapping",
        "modeling/saved.py (unbuildable_reason, own_class)",
        "an Auto class's _model_mapping: `config class in mapping` says whether it builds the config (through the "
        "model type the config class maps back to; 5.4 raises KeyError instead of saying no), and its own "
        "_model_mapping maps model type -> model class name",
        "tests/modeling/test_newer_types.py::"
        "test_a_model_the_auto_classes_cannot_build_is_patched_verified_and_its_conversion_refused",
    ),
    Reliance(
        "transformers.core_model_loading.rename_source_key",
        "conversion/output/keys.py",
        "(key, renamings, converters, prefix, meta state dict) -> (the model name a checkpoint key loads under, the "
        "converter pattern it matched); the prefix argument is positional (renamed between 5.4 and later)",
        "tests/conversion/test_convert_every_type.py::test_a_checkpoint_whose_qkv_transformers_splits_on_loading_converts",
    ),
    Reliance(
        "transformers.PreTrainedModel.gradient_checkpointing_enable",
        "upstream.py (enable_checkpointing, is_checkpointing)",
        f"activation_checkpointing_enable(activation_checkpointing_kwargs=...) and is_activation_checkpointing "
        f"from {ACTIVATION_CHECKPOINTING_SINCE} on; gradient_checkpointing_enable(gradient_checkpointing_kwargs="
        "...) and is_gradient_checkpointing (deprecated from then on) before",
        "tests/test_upstream.py::test_checkpointing_shim_follows_the_installed_version",
    ),
    Reliance(
        "transformers.models.llama.modeling_llama.LlamaForCausalLM.forward",
        "upstream.py (cache_argument, cache_kwargs, output_cache, called_cache)",
        f"the models' forwards, attention modules' calls and outputs name the key/value cache 'cache' from "
        f"{CACHE_RENAMED_IN} on and 'past_key_values' before; every model the plugin calls or hooks takes one of "
        "the two",
        "tests/test_upstream.py::test_every_argument_the_plugin_reads_is_declared",
    ),
)
