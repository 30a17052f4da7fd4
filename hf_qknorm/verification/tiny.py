"""Tiny models of any model type, built from the type's own config class with small sizes (nothing downloaded).

The coverage table (:mod:`.coverage`) and the tests patch one of these per model type. Sizes are set through the
names Transformers' configs use for them; a config that names them otherwise keeps its own (and may be too big to
build, which the table reports).
"""

from __future__ import annotations

import copy

import torch

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, LAYERS, VOCAB = 64, 4, 2, 16, 2, 256

# config attribute -> tiny value, applied where the config has the attribute.
SIZES = {
    "hidden_size": HIDDEN,
    "n_embd": HIDDEN,
    "d_model": HIDDEN,
    "intermediate_size": 128,
    "n_inner": 128,
    "ffn_hidden_size": 128,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32,
    "expert_intermediate_size": 32,
    "num_hidden_layers": LAYERS,
    "n_layer": LAYERS,
    "num_layers": LAYERS,
    "num_attention_heads": HEADS,
    "n_head": HEADS,
    "num_heads": HEADS,
    "num_key_value_heads": KV_HEADS,
    "head_dim": HEAD_DIM,
    "vocab_size": VOCAB,
    "vocab_size_per_layer_input": VOCAB,  # Gemma 3n / 4: a second embedding, per layer
    "hidden_size_per_layer_input": HEAD_DIM,
    "max_position_embeddings": 128,
    "n_positions": 128,
    "n_ctx": 128,
    "num_local_experts": 4,
    "num_experts": 4,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "moe_topk": 2,
    "top_k": 2,
    "sliding_window": 4,
    "first_k_dense_replace": 0,
    "rotary_dim": 8,
    "kv_channels": HEAD_DIM,
    # multi-head latent attention (DeepSeek V2/V3, Mistral 4) and value heads of their own width (MiMo-V2-Flash):
    # where the config states a head_dim these are scaled by their ratio to it (_HEAD_PARTS), else these values
    "qk_rope_head_dim": HEAD_DIM // 2,
    "qk_nope_head_dim": HEAD_DIM // 2,
    "qk_head_dim": HEAD_DIM,
    "v_head_dim": HEAD_DIM,
    "kv_lora_rank": 32,
    "q_lora_rank": 32,
}
_HEAD_PARTS = ("qk_rope_head_dim", "qk_nope_head_dim", "qk_head_dim", "v_head_dim")  # sizes kept in ratio to head_dim


SECTIONS = ("n_input_layers", "n_recurrent_layers", "n_output_layers")  # layer counts of a model in sections


def tiny_config(model_type: str):
    """A small config of ``model_type`` (its config class with the sizes above, and what :data:`STATED` adds),
    dropout off, one pad token."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    config = CONFIG_MAPPING[model_type]()
    _state(config, model_type)
    return _shrink(config)


def _state(config, model_type) -> None:
    """``config`` given what :data:`STATED` says ``model_type``'s checkpoints state."""
    for name, value in STATED.get(model_type, {}).items():
        owner, _, leaf = name.rpartition(".")
        setattr(getattr(config, owner) if owner else config, leaf, copy.deepcopy(value))


# What a type's checkpoints state and its default config leaves unset, so that no model can be built from the
# default (attribute, with a dot for a sub-config's -> value).
STATED = {
    # the attention config states no RoPE base; the experts' sizes live in a sub-config (the model's width too)
    "dbrx": {
        "attn_config.rope_theta": 10000.0,
        "attn_config.clip_qkv": 8.0,  # None clamps with neither bound, which torch refuses
        "ffn_config.hidden_size": HIDDEN,
        "ffn_config.ffn_hidden_size": 32,
    },
    "dots1": {"n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1},
    "step3p5": {"sliding_window": 4},  # Step 3.7's language model: its mask builder needs one
    "cohere_compass_text": {"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 10000.0}}},
    "lfm2_moe": {"layer_types": ["conv", "full_attention"]},  # which blocks are convolutions: left to a checkpoint
    # the state-space mixer beside each attention: its own sizes (1024 channels, 128 heads, state 256 by default)
    "falcon_h1": {
        "mamba_d_ssm": 64,
        "mamba_n_heads": 8,
        "mamba_d_head": 8,
        "mamba_d_state": 16,
        "mamba_chunk_size": 16,
    },
    # its protein encoder (ESM-sized by default: 650M parameters) and the resampler after it, sized otherwise
    "evolla": {
        "protein_encoder_config.hidden_size": 32,
        "protein_encoder_config.num_hidden_layers": 1,
        "protein_encoder_config.intermediate_size": 64,
        "protein_encoder_config.num_attention_heads": 2,
        "resampler_depth": 1,
        "resampler_heads": 2,
        "resampler_dim_head": 16,
        "resampler_num_latents": 8,
    },
    # its tokenizer's map of the image tokens, which the model reads when it is built (no default)
    "chameleon": {"vocabulary_map": {"<image>": VOCAB - 1}},
    "muse_spark_text": {"moe_hidden_size": 32},  # its experts' width, named otherwise
    # which layers' MLPs are experts, and how many experts a token takes: left to a checkpoint
    "deepseek_ocr2_text": {"mlp_layer_types": ["dense", "sparse"], "num_experts_per_tok": 2},
    "diffusion_gemma_text": {"num_experts": 4, "moe_intermediate_size": 32, "top_k_experts": 2},
    # its sparse attention's token indexer (QSA), which the attention builds whether or not the config enables it
    "qwen4_exp_text": {
        "indexer_n_heads": 2,
        "indexer_kv_heads": 1,
        "indexer_head_dim": HEAD_DIM,
        "indexer_budget": 8,
        "indexer_compress_ratio": 4,
    },
}


def _shrink(config):
    """``config`` with the sizes above where it has them, one layer of each kind it names, dropout off. A
    heterogeneous config (``per_layer_config``: Gemma 4's wider heads on its full-attention layers) keeps the
    overrides of the layers kept, their sizes scaled as the global ones are (:func:`_per_layer_overrides`)."""
    overrides, globals_ = _per_layer_overrides(config)
    head = getattr(config, "head_dim", None)
    parts = {n: getattr(config, n) for n in _HEAD_PARTS if _is_size(getattr(config, n, None))}
    for name, value in SIZES.items():
        if isinstance(getattr(config, name, None), int) and not isinstance(getattr(config, name), bool):
            try:
                setattr(config, name, value)
            except AttributeError:  # a property derived from other sizes (Falcon's head_dim)
                pass
    if _is_size(head):  # a value head 128 wide beside 192-wide q/k heads stays two thirds as wide
        for name, value in parts.items():
            setattr(config, name, max(1, round(HEAD_DIM * value / head)))
    stated = config.to_dict()
    for name, value in (("head_dim", HEAD_DIM), ("num_key_value_heads", KV_HEADS)):
        if name in stated and stated[name] is None:  # a config that derives it later states it
            try:
                setattr(config, name, value)
            except AttributeError:
                pass
    kinds = getattr(config, "layer_types", None) or ()
    if "sliding_attention" in kinds and "sliding_window" in stated and stated["sliding_window"] is None:
        config.sliding_window = SIZES["sliding_window"]  # a checkpoint with sliding layers states their window
    if getattr(config, "multi_query", False):
        config.num_key_value_heads = 1 if hasattr(config, "num_key_value_heads") else None
    # A per-layer list keeps one layer of each kind it names (sliding and full attention, a hybrid's recurrent layers),
    # so the tiny model has every kind of layer the real one has.
    kinds = getattr(config, "layer_types", None)
    listed = isinstance(kinds, (list, tuple)) and bool(kinds)
    # A model in sections (Dory: input layers, recurrent layers run in loops, output layers) keeps one layer in each.
    sections = all(isinstance(getattr(config, name, None), int) for name in SECTIONS)
    layers = max(LAYERS, len(SECTIONS)) if sections else LAYERS
    keep = list(range(layers))
    if listed:
        first = {}
        for i, kind in enumerate(kinds):
            first.setdefault(kind, i)
        keep = sorted(first.values())
        keep += [i for i in range(len(kinds)) if i not in keep][: max(0, layers - len(keep))]
        keep.sort()
    shared = getattr(config, "num_kv_shared_layers", None)
    if listed and isinstance(shared, int) and not isinstance(shared, bool) and 0 < shared < len(kinds):
        # layers that reuse an earlier layer's keys and values (Gemma 3n, Gemma 4's E sizes): each kind kept twice,
        # once storing its keys and values and once, in the shared tail, reusing them
        config.num_kv_shared_layers = len(keep)
        keep = keep + keep
    if sections:
        for name, count in zip(SECTIONS, (1, len(keep) - 2, 1)):
            setattr(config, name, count)
    if (listed or sections) and hasattr(config, "num_hidden_layers"):
        try:
            config.num_hidden_layers = len(keep)
        except AttributeError:
            pass
    for name in ("layer_types", "attention_layer_types"):
        value = getattr(config, name, None)
        if isinstance(value, (list, tuple)) and value:
            try:
                setattr(config, name, [value[min(i, len(value) - 1)] for i in keep])
            except AttributeError:  # derived from the layer count (Falcon-H1's)
                pass
    for name in ("activation_sparsity_pattern", "intermediate_size"):  # a value per layer (Gemma 3n's)
        value = getattr(config, name, None)
        if isinstance(value, (list, tuple)) and value and getattr(config, "num_hidden_layers", None) == len(keep):
            setattr(config, name, [SIZES.get(name, value[min(i, len(value) - 1)]) for i in keep])
    value = getattr(config, "mlp_layer_types", None)
    if isinstance(value, (list, tuple)) and value:
        config.mlp_layer_types = list(value[: len(keep)]) + [value[-1]] * max(0, len(keep) - len(value))
    if overrides:
        kept = {j: overrides[i] for j, i in enumerate(keep) if i in overrides}
        config.per_layer_config = {
            j: {k: _tiny_override(k, v, globals_.get(k)) for k, v in layer.items()} for j, layer in kept.items()
        }
    for name in dir(config):
        if "dropout" in name or name.endswith("_pdrop"):
            value = getattr(config, name, None)
            if isinstance(value, float):
                setattr(config, name, 0.0)
    if getattr(config, "pad_token_id", None) is not None and config.pad_token_id >= VOCAB:
        config.pad_token_id = 0
    for name in ("bos_token_id", "eos_token_id"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value >= VOCAB:
            setattr(config, name, 1)
        elif isinstance(value, list):
            setattr(config, name, [v if v < VOCAB else 1 for v in value])
    return config


def _is_size(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _per_layer_overrides(config) -> tuple[dict, dict]:
    """The per-layer overrides of a heterogeneous ``config`` (``{layer: {attribute: value}}``) and the global values
    of the attributes they set, both as read before shrinking; the overrides are taken off ``config`` (its global
    sizes can then be read and set). ``({}, {})`` for an ordinary config."""
    spec = config.__dict__.get("_heterogeneity_spec")
    if spec is None:
        return {}, {}
    overrides = copy.deepcopy(dict(spec.per_layer_overrides))
    names = {k for layer in overrides.values() for k in layer}
    globals_ = {k: config._getattr_without_heterogeneous_validation(k, None) for k in names}
    config.per_layer_config = None
    return overrides, globals_


def _tiny_override(name: str, value, global_value):
    """A per-layer override's tiny value: a size of :data:`SIZES` scaled by its ratio to the global value (Gemma 4's
    512-wide heads over 256 become twice the tiny head), anything else as it is."""
    tiny = SIZES.get(name)
    if tiny is None or isinstance(value, bool) or not isinstance(value, int):
        return value
    if isinstance(global_value, int) and global_value > 0:
        return max(1, round(tiny * value / global_value))
    return tiny


def tiny_model(model_type: str, dtype=torch.float32, seed: int = 0):
    """A randomly initialised tiny causal LM of ``model_type`` on the CPU, in eval mode, experts run eagerly."""
    from ..modeling.saved import auto_class

    torch.manual_seed(seed)
    config = tiny_config(model_type)
    # AutoModelForCausalLM, or where Transformers maps a text model's class (Mistral 4)
    cls = builder(config, auto_class(config))
    kwargs = {}
    if hasattr(config, "_experts_implementation"):
        kwargs["experts_implementation"] = "eager"
    try:
        model = cls.from_config(config, dtype=dtype, **kwargs)
    except TypeError:
        model = cls.from_config(config, dtype=dtype)
    return model.eval()


# --------------------------------------------------------------------------------------------------------------------
# multimodal (image-text-to-text) models: the text config shrunk as above, the vision config to VISION
# --------------------------------------------------------------------------------------------------------------------
IMAGE, PATCH = 32, 8  # a tiny image's side and patch side: 4 x 4 patches
VISION_WIDTH, VISION_MLP = 32, 64
VISION = {
    "hidden_size": VISION_WIDTH,
    "embed_dim": VISION_WIDTH,
    "intermediate_size": VISION_MLP,
    "num_hidden_layers": 2,
    "depth": 2,
    "num_attention_heads": 2,
    "num_heads": 2,
    "head_dim": 16,
    "image_size": IMAGE,
    "patch_size": PATCH,
    "projection_dim": HIDDEN,  # PaliGemma's projector writes the vision config's projection_dim
    "out_hidden_size": HIDDEN,  # Qwen-VL's merger writes the text model's width
    "num_position_embeddings": (IMAGE // PATCH) ** 2,
    "projection_hidden_dim": VISION_MLP,  # Inkling 2's merger: its hidden width, then the text model's
    "text_hidden_size": HIDDEN,
}
# A multimodal config's own sizes of the parts between its towers, where it has them.
PROJECTOR = {
    "projector_hidden_size": VISION_MLP,
    "out_hidden_size": HIDDEN,  # the text model's width, where a projector writes it
    "vision_hidden_size": VISION_WIDTH,
}
# The ids a multimodal config gives its special tokens, set to the top of the tiny vocabulary (in this order).
SPECIAL_IDS = (
    ("image_token_id", "image_token_index"),
    ("video_token_id", "video_token_index"),
    ("vision_start_token_id",),
    ("vision_end_token_id",),
    ("boi_token_index", "boi_token_id"),
    ("eoi_token_index", "eoi_token_id"),
)
# A vision tower of a SAM encoder and a transformer encoder, sub-configs of its vision config (DeepSeek-OCR 2's).
SAM = {
    "vision_config.encoder_config.hidden_size": VISION_WIDTH,
    "vision_config.encoder_config.intermediate_size": VISION_MLP,
    "vision_config.encoder_config.num_hidden_layers": 1,
    "vision_config.encoder_config.num_attention_heads": 2,
    "vision_config.sam_config.hidden_size": VISION_WIDTH,
    "vision_config.sam_config.mlp_dim": VISION_MLP,
    "vision_config.sam_config.num_hidden_layers": 1,
    "vision_config.sam_config.num_attention_heads": 2,
}
# An image tokenizer's (VQ-VAE's) convolution widths: 32 channels (its group norms take groups of 32), one block each.
VQ = {"base_channels": 32, "num_res_blocks": 1}
# What the generic sizes do not say, per type: (vision config, top-level config) settings, and the form of the
# pixel input (``square``: (batch, 3, side, side); ``tiles``: one tile per image with a pixel mask, Idefics3;
# ``anyres``: base image plus tiles with image_sizes, LLaVA-NeXT; ``sized``: with image_sizes, Pixtral; ``crops``:
# (batch, crops, 3, side, side), one crop per image, PerceptionLM;
# ``patches``: flattened patches with image_grid_thw, Qwen-VL; ``None``: no image inputs, the sizes only).
MULTIMODAL = {
    "llava": ({}, {}, "square"),
    "llava_next": ({}, {"image_grid_pinpoints": [[IMAGE, IMAGE]]}, "anyres"),
    "paligemma": ({}, {"projection_dim": HIDDEN}, "square"),
    "gemma3": ({}, {"mm_tokens_per_image": 4}, "square"),
    "mistral3": ({}, {"spatial_merge_size": 2}, "sized"),
    "idefics3": ({}, {"scale_factor": 2}, "tiles"),
    "smolvlm": ({}, {"scale_factor": 2}, "tiles"),
    "internvl": ({"image_size": [IMAGE, IMAGE], "patch_size": [PATCH, PATCH]}, {"image_seq_length": 4}, "square"),
    "qwen2_vl": ({"hidden_size": HIDDEN}, {}, "patches"),
    "qwen2_5_vl": ({"window_size": 2 * PATCH * 2, "fullatt_block_indexes": [1]}, {}, "patches"),
    "qwen3_vl": ({"deepstack_visual_indexes": [1]}, {}, "patches"),
    "llama4": ({"vision_output_dim": 32, "projector_input_dim": HIDDEN, "projector_output_dim": HIDDEN}, {}, None),
    # the vision MLP's width is derived from mlp_ratio when a config is built (a saved one too): keep them one size
    "step3p7": ({"mlp_ratio": VISION_MLP / VISION_WIDTH}, {}, None),
    # the thinker's positions read the id its checkpoints state (its class has no default)
    "qwen2_5_omni_thinker": ({}, {"vision_start_token_id": 0}, None),
    # its vision encoder's layers follow the patch's prime factors (each layer a fold; fewer layers than folds
    # needs scipy's assignment), widening to the text model's width
    "inkling_mm_model": (
        {"patch_size": 2, "temporal_patch_size": 2, "num_channels": 1, "text_hidden_size": HIDDEN},
        {"vision_config.num_hidden_layers": 3},  # a setting its config's dict does not list
        None,
    ),
    # its tokenizer's map of the image tokens, which the model reads when it is built (no default)
    "emu3": (
        {},
        {
            "vocabulary_map": {"<image>": VOCAB - 1, "<|extra_200|>": VOCAB - 2},
            **{f"vq_config.{k}": v for k, v in VQ.items()},
            "vq_config.codebook_size": 64,
            "vq_config.hidden_size": 32,
        },
        None,
    ),
    # sizes its parts name otherwise: a visual vocabulary and its embedding width (Ovis 2), the audio tower's output
    # (Muse Spark), the image generation head and codebook (Janus)
    "ovis2": ({"vocab_size": 64}, {"hidden_size": HIDDEN}, None),
    # its vision config takes the sides as a pair; its adapter reads two of the vision layers (of 2, here)
    "molmo2": ({"image_size": [IMAGE, IMAGE]}, {"adapter_config.vision_feature_layer": [-1, -2]}, None),
    # its vision tower: a SAM encoder feeding a Qwen2-like encoder, each a sub-config of the vision config
    "deepseek_ocr2": (
        {},
        {
            **SAM,
            "vision_config.encoder_config.layer_types": ["full_attention"],
            "vision_config.encoder_config.num_key_value_heads": 2,
        },
        None,
    ),
    # the same two encoders (a CLIP-like one after SAM); its reference sliding window (the prompt and the last decoded
    # tokens) wider than verify's cached probes decode, which it would cut (not modelled: refused)
    "unlimited_ocr": (
        {},
        {
            **SAM,
            "text_config.sliding_window": 8,
            "vision_config.sam_config.global_attn_indexes": [0],
            "vision_config.sam_config.downsample_channels": [32, 64],
        },
        None,
    ),
    # its vision config is an image tokenizer (a VQ-VAE); the image and audio codebooks' token ranges, one after the
    # other, end inside the tiny vocabulary (below its special tokens)
    "apertus1p5": (
        {**VQ, "codebook_size": 32, "embed_dim": 32, "latent_channels": 32},
        {
            "audio_config.codebook_size": 32,
            "audio_config.codebook_dim": VISION_WIDTH,  # its quantizer works at the audio width
            "image_token_offset": VOCAB - 80,
            "audio_token_offset": VOCAB - 48,
        },
        None,
    ),
    # the adapters from its vision and audio towers into the text model, and the audio tower's convolution stem
    "dots3_note": (
        {"adapter_in_dim": VISION_WIDTH, "adapter_out_dim": HIDDEN, "mlp_layer_types": ["dense", "dense"]},
        {
            "audio_config.adapter_input_size": VISION_WIDTH,
            "audio_config.adapter_out_dim": HIDDEN,
            "audio_config.downsample_hidden_size": 32,
            "audio_config.conv_output_size": 32 * 16,
        },
        None,
    ),
    "muse_spark": ({}, {"audio_config.out_hidden_size": HIDDEN}, None),
    "janus": (
        {},
        {
            **{f"vq_config.{k}": v for k, v in VQ.items()},
            "vq_config.num_embeddings": 64,
            "vq_config.latent_channels": 32,
            "vq_config.projection_dim": HIDDEN,
            "vq_config.image_token_embed_dim": 32,
        },
        None,
    ),
    "qwen3_omni_moe_thinker": ({}, {"vision_start_token_id": 0}, None),
    # vision towers built by timm (importable only where timm and torchvision are): a timm model's sizes are its
    # constructor's arguments (``model_args``), and the width the projector reads is what that model gives
    "fast_vlm": (
        {
            "model_args": {
                "inference_mode": True,
                "layers": [1, 1, 1, 1, 1],
                "embed_dims": [16, 16, 32, 32, 32],  # its attention stages take heads of 32 channels
                "mlp_ratios": [1, 1, 1, 1, 1],
                "downsamples": [False, False, False, False, True],  # a 32-pixel image: 2 x 2 features
            },
            "hidden_size": 64,  # its last convolution doubles the last stage's width
        },
        {},
        "square",
    ),
    # MobileNet-V5 (Gemma 3n): its blocks' widths scaled down; its multi-scale fusion writes 2,048 channels always
    "gemma3n": ({"model_args": {"channel_multiplier": 0.05}, "hidden_size": 2048}, {}, "square"),
    "perception_lm": (
        {
            "architecture": "vit_pe_core_tiny_patch16_384",
            "model_args": {"embed_dim": VISION_WIDTH, "depth": 1, "num_heads": 2, "img_size": [IMAGE, IMAGE]},
        },
        {},
        "crops",
    ),
    # its Q-Former takes one head per 64 channels of the vision width; its checkpoints state which vision layers
    # feed which language-model layers (no default): the last vision layer into the first layer
    "granite4_vision": (
        {"hidden_size": 64},
        {
            "deepstack_layer_map": [[-1, 0]],
            "spatial_target_layers": [0, 1, 0, 1],
            "downsample_rate": "1/2",
            "image_grid_pinpoints": [[IMAGE, IMAGE]],
        },
        None,
    ),
}


# M-RoPE sections of types whose default config leaves them to a checkpoint (Transformers 5.4 reads them in the
# attention, with no class default): HEAD_DIM // 2 frequencies over the time, height and width rows.
# HunYuan-VL's rotary module reads its checkpoints' four sections (position, width, height, image index) always.
MROPE_SECTIONS = {
    "qwen2_vl": [2, 3, 3],
    "qwen2_5_vl": [2, 3, 3],
    "hunyuan_vl": [2, 2, 2, 2],
    "ernie4_5_vl_moe": [3, 3, 2],  # height, width, time: its default sections (22, 22, 20) fit 128-wide heads only
}


def is_multimodal(config) -> bool:
    """Whether ``config`` is a multimodal model's (its text config is another config)."""
    from ..portable.families import text_config_of

    return text_config_of(config) is not config


def tiny_multimodal_config(model_type: str):
    """A small config of an image-text-to-text ``model_type``: its text config shrunk as :func:`tiny_config` does,
    its vision config to :data:`VISION` (and the type's :data:`MULTIMODAL` settings), its special tokens' ids at the
    top of the tiny vocabulary."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    config = CONFIG_MAPPING[model_type]()
    vision, top, _ = MULTIMODAL.get(model_type, ({}, {}, None))
    text = config.get_text_config()
    _state(text, getattr(text, "model_type", None))
    text = _shrink(text)
    rope = getattr(text, "rope_parameters", None)
    if model_type in MROPE_SECTIONS and isinstance(rope, dict):
        rope.setdefault("mrope_section", list(MROPE_SECTIONS[model_type]))
    if isinstance(getattr(text, "cross_attention_layers", None), list):  # Mllama: keep a cross-attention layer
        text.cross_attention_layers = [LAYERS - 1]
    sub = getattr(config, "vision_config", None)
    if sub is not None:
        for name, value in {**VISION, **vision}.items():
            if name in sub.to_dict():
                setattr(sub, name, value)
        _shrink_dropout(sub)
    _shrink_other_parts(config, text)
    for name, value in PROJECTOR.items():
        if _is_size(getattr(config, name, None)):
            setattr(config, name, value)
    for name, value in top.items():  # a dotted name sets a sub-config's attribute (or a sub-config's sub-config's)
        *owners, leaf = name.split(".")
        target = config
        for owner in owners:
            target = getattr(target, owner)
        setattr(target, leaf, value)
    special_ids_on_top(config, VOCAB)
    if "image_seq_length" in config.to_dict() and "image_seq_length" not in top:
        config.image_seq_length = (IMAGE // PATCH) ** 2
    return _as_loaded(config)


def _as_loaded(config):
    """``config`` as its own save and load gives it back: a config that derives a part's sizes from another part's
    when it is built (Idefics2's perceiver takes the text model's width, MiniMax-M3-VL's merger its own) would
    otherwise describe a model whose saved checkpoint does not load into the model its saved config describes. A
    config that its own class does not accept yet (Cosmos 3 Edge's RoPE sections, fitted to the tiny heads once the
    model is built: ``fit_mrope``) is returned as built; where it is saved, its load is checked there
    (``conversion.orchestration.coverage.tiny_source``)."""
    import json

    from huggingface_hub.errors import StrictDataclassError

    try:
        return type(config).from_dict(json.loads(config.to_json_string(use_diff=False)))
    except StrictDataclassError:
        return config


# The sizes of a multimodal config's other parts (an audio encoder, a Q-Former, a perceiver resampler, ...), where
# they have these attributes: none of them is patched, so they are only made small.
OTHER_PARTS = {
    "hidden_size": VISION_WIDTH,
    "embed_dim": VISION_WIDTH,
    "d_model": VISION_WIDTH,
    "intermediate_size": VISION_MLP,
    "encoder_ffn_dim": VISION_MLP,
    "decoder_ffn_dim": VISION_MLP,
    "num_hidden_layers": 1,
    "num_layers": 1,
    "encoder_layers": 1,
    "decoder_layers": 1,
    "depth": 1,
    "num_attention_heads": 2,
    "num_heads": 2,
    "encoder_attention_heads": 2,
    "decoder_attention_heads": 2,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": VOCAB,
    "output_dim": VISION_WIDTH,
}


def _shrink_other_parts(config, text) -> None:
    """Every sub-config of ``config`` but its text and vision configs (and, below them, theirs) given the sizes of
    :data:`OTHER_PARTS` where it has those attributes, its dropout off."""
    from transformers import PretrainedConfig

    for name in list(config.to_dict()):
        sub = getattr(config, name, None)
        if not isinstance(sub, PretrainedConfig) or sub is text or name in ("vision_config", "text_config"):
            continue
        for key, value in OTHER_PARTS.items():
            if _is_size(getattr(sub, key, None)):
                try:
                    setattr(sub, key, value)
                except AttributeError:  # a property derived from other sizes
                    pass
        _shrink_dropout(sub)
        _shrink_other_parts(sub, text)


def _shrink_dropout(config) -> None:
    for name in dir(config):
        if "dropout" in name or name.endswith("_pdrop"):
            value = getattr(config, name, None)
            if isinstance(value, float):
                setattr(config, name, 0.0)


MAX_TINY_PARAMETERS = 20_000_000  # a config whose sizes go by other names stays big: refused, not built


def tiny_multimodal_model(model_type: str, dtype=torch.float32, seed: int = 0):
    """A randomly initialised tiny image-text-to-text model of ``model_type`` on the CPU, in eval mode. A config
    the sizes above do not shrink (its sub-models name their sizes otherwise) is measured on the ``meta`` device
    first and refused with ``ValueError`` rather than built. A type Transformers maps to no image-text-to-text class
    (an audio model: MOSS Transcribe-Diarize) is built with the class its checkpoints load with
    (:func:`hf_qknorm.modeling.saved.auto_class`)."""
    from transformers import AutoModelForImageTextToText
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    from ..modeling.saved import auto_class

    config = tiny_multimodal_config(model_type)
    image_text = model_type in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES
    cls = builder(config, AutoModelForImageTextToText if image_text else auto_class(config))
    with torch.device("meta"):
        skeleton = cls.from_config(copy.deepcopy(config))
    if fit_mrope(skeleton, config):
        with torch.device("meta"):
            skeleton = cls.from_config(copy.deepcopy(config))
    count = sum(p.numel() for p in skeleton.parameters())
    if count > MAX_TINY_PARAMETERS:
        raise ValueError(f"the shrunk config still has {count / 1e6:.0f}M parameters (sizes named otherwise)")
    torch.manual_seed(seed)
    return cls.from_config(config, dtype=dtype).eval()


class _FromConfig:
    """A model class with the Auto classes' ``from_config`` (``_from_config``: the class's own)."""

    def __init__(self, cls):
        self.cls = cls

    def from_config(self, config, **kwargs):
        return self.cls._from_config(config, **kwargs)


def builder(config, cls):
    """``cls`` (an Auto class), or where it cannot build ``config``'s model (Evolla:
    :func:`hf_qknorm.modeling.saved.unbuildable_reason`) the model's own class, with the same ``from_config``."""
    from ..modeling.saved import own_class, unbuildable_reason

    return _FromConfig(own_class(config)) if unbuildable_reason(config) is not None else cls


def special_ids_on_top(config, vocab: int):
    """``config`` with its special tokens' ids (image, video, ... : one id per group of :data:`SPECIAL_IDS`) at the
    top of a ``vocab``-token vocabulary, above any id a tokenizer gives text."""
    taken = vocab - 1
    for names in SPECIAL_IDS:
        for name in names:
            if isinstance(getattr(config, name, None), int):
                setattr(config, name, taken)
        taken -= 1
    return config


def fit_mrope(skeleton, config) -> bool:
    """Multimodal RoPE (Qwen2-VL, GLM-4V, ...) splits a head's rotary frequencies into three position rows by a
    ``mrope_section`` its config may leave to the class default (sized for the real head width): scale the split to
    the tiny model's frequencies, in the default's proportions. Returns whether the config changed."""
    text = config.get_text_config()
    rope = getattr(text, "rope_parameters", None)
    for module in skeleton.modules():
        section, freqs = getattr(module, "mrope_section", None), getattr(module, "inv_freq", None)
        if not isinstance(section, (list, tuple)) or not isinstance(freqs, torch.Tensor) or not isinstance(rope, dict):
            continue
        need, have = freqs.shape[-1], sum(section)
        if need == have or not have:
            return False
        shares = [need * part / have for part in section]
        fitted = [int(x) for x in shares]
        for i in sorted(range(len(shares)), key=lambda i: fitted[i] - shares[i])[: need - sum(fitted)]:
            fitted[i] += 1  # largest remainders first
        rope["mrope_section"] = fitted
        return True
    return False


def image_text_inputs(model, batch: int = 2, text: int = 5, seed: int = 0) -> dict:
    """Inputs of one image per row and ``text`` tokens around it, for a tiny model of a :data:`MULTIMODAL` type:
    ``input_ids`` (with the model's image placeholder tokens, as many as its vision tower gives features, inside
    the vision start/end tokens where the type has them), ``pixel_values`` in the type's form, and what the type
    needs besides (``image_grid_thw``, ``image_sizes``, ``pixel_attention_mask``, ``token_type_ids``)."""
    config = model.config
    kind = MULTIMODAL[base_type(config.model_type)][2]
    gen = torch.Generator().manual_seed(seed)
    dtype = next(model.parameters()).dtype
    pixels = _pixel_inputs(kind, config, batch, gen, dtype)
    count = _image_tokens(model, pixels, batch)
    image = _first_int(config, SPECIAL_IDS[0])
    start, end = _first_int(config, SPECIAL_IDS[2]), _first_int(config, SPECIAL_IDS[3])
    rows, types = [], []
    for _ in range(batch):
        words = torch.randint(3, VOCAB - len(SPECIAL_IDS), (text,), generator=gen)
        pieces = [words[:2]]
        if start is not None:
            pieces.append(torch.tensor([start]))
        pieces.append(torch.full((count,), image))
        if end is not None:
            pieces.append(torch.tensor([end]))
        pieces.append(words[2:])
        row = torch.cat(pieces)
        rows.append(row)
        types.append((row == image).long())
    out = {"input_ids": torch.stack(rows), **pixels}
    for name in ("token_type_ids", "mm_token_type_ids"):  # image tokens 1 (Gemma 3's and Qwen-VL's M-RoPE's rule)
        if name in _forward_parameters(model):
            out[name] = torch.stack(types)
    return out


def base_type(model_type: str) -> str:
    return model_type[len("qknorm_") :] if model_type.startswith("qknorm_") else model_type


def _first_int(config, names):
    return next((getattr(config, n) for n in names if isinstance(getattr(config, n, None), int)), None)


def _forward_parameters(model) -> set:
    import inspect

    return set(inspect.signature(model.forward).parameters)


def _pixel_inputs(kind: str, config, batch: int, gen, dtype) -> dict:
    side = IMAGE

    def pixels(*shape):
        return torch.randn(*shape, generator=gen).to(dtype)

    if kind == "square":
        return {"pixel_values": pixels(batch, 3, side, side)}
    if kind == "sized":
        return {"pixel_values": pixels(batch, 3, side, side), "image_sizes": torch.tensor([[side, side]] * batch)}
    if kind == "anyres":
        return {"pixel_values": pixels(batch, 2, 3, side, side), "image_sizes": torch.tensor([[side, side]] * batch)}
    if kind == "crops":
        return {"pixel_values": pixels(batch, 1, 3, side, side)}
    if kind == "tiles":
        return {
            "pixel_values": pixels(batch, 1, 3, side, side),
            "pixel_attention_mask": torch.ones(batch, 1, side, side, dtype=torch.bool),
        }
    if kind == "patches":
        vision = config.vision_config
        grid = side // PATCH
        width = vision.in_channels * vision.temporal_patch_size * PATCH * PATCH
        return {
            "pixel_values": pixels(batch * grid * grid, width),
            "image_grid_thw": torch.tensor([[1, grid, grid]] * batch),
        }
    raise ValueError(f"no pixel input of kind {kind!r}")


def _image_tokens(model, pixels: dict, batch: int) -> int:
    """How many placeholder tokens one image takes: the rows of features the model's vision tower gives it."""
    rows = sum(p.reshape(-1, p.shape[-1]).shape[0] for p in vision_features(model, pixels))
    return rows // batch


def vision_features(model, pixels: dict) -> list[torch.Tensor]:
    """The features (after the projector) ``model``'s vision tower gives for ``pixels``, as a list of tensors:
    ``get_image_features`` of the model, or of its inner model where only that has it (PerceptionLM)."""
    owner = model if hasattr(model, "get_image_features") else model.model
    with torch.no_grad():
        out = owner.get_image_features(**pixels)
    feats = out if isinstance(out, (torch.Tensor, list, tuple)) else getattr(out, "pooler_output", None)
    if feats is None:
        feats = out[0]
    return [feats] if isinstance(feats, torch.Tensor) else list(feats)
