"""What :func:`hf_qknorm.convert` checks before it starts and before it renames its output into place.

Before any work (:func:`check_request`): the calibration device and thread count, and for ``push_to_hub`` the repo
id and a token -- a bad value fails in a second, not after an hour of calibration.

Before the rename (nothing reaches the destination unless all of these pass):

- :func:`check_report_finite`: every perplexity, KL and logit of the calibration report is a finite number;
- :func:`check_written`: every tensor the conversion added is in the written shards with exactly the planned value,
  and every tensor it removed is gone (all layers; only the small norm tensors are read);
- :func:`verify_output`: the folder is loaded the way users will load it -- with the plugin in this process, and
  (``"full"``) in a process that cannot import ``hf_qknorm`` (a ``qknorm_<base>`` folder through its shipped remote
  code, a plain export through plain Transformers) -- and its logits must be those of the converted model in memory:
  the source loaded by Transformers, :func:`hf_qknorm.patch_model`-ed (the self-check runs on the source's own
  weights) and given every tensor the conversion computed. Where :func:`hf_qknorm.verify`'s float64 reference does
  not refuse the model type, it must pass too (with and without the plugin). To stay cheap on large models it loads
  only the first :data:`VERIFY_LAYERS` layers, in float32 (:func:`layer_view`: a view of the folder whose
  ``config.json`` has fewer layers and dtype float32; the weights are links to the written ones), and checks that
  the loaded scheme (or plain class) is the one asked for and that no tensor of those layers was missing.
"""

from __future__ import annotations

import json
import math
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path

import torch

from ...verification.tiny import SECTIONS

__all__ = [
    "ConversionCheckError",
    "VERIFY_LAYERS",
    "VERIFY_MODES",
    "check_device",
    "check_report_finite",
    "check_request",
    "check_written",
    "verify_output",
]

VERIFY_LAYERS = 2  # layers loaded for the verification probe: every layer runs the same code
# ... except a KV-shared tail (Gemma 3n, Gemma 4's E sizes): the view then reaches its first layer (checked_layers)

# tensors outside the layers packed layer-major along one dimension (``layers * width`` entries, layer 0's first):
# Gemma 3n's and Gemma 4's per-layer input embeddings and their projection from the hidden states. A view of the
# first ``n`` layers holds their first ``n * width`` entries (tested against the whole model's hidden states).
LAYER_PACKED = {"embed_tokens_per_layer.weight": 1, "per_layer_model_projection.weight": 0}
VERIFY_MODES = ("full", "plugin", "off")


class ConversionCheckError(RuntimeError):
    """The conversion's result failed a check; nothing was renamed into place."""


# --------------------------------------------------------------------------------------------------------------------
# before any work
# --------------------------------------------------------------------------------------------------------------------
def check_device(device: str) -> None:
    """Refuse a calibration device that does not exist here, naming it (``auto`` always works)."""
    if device == "auto":
        return
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"unknown device {device!r} (--device); choose auto, cpu, cuda or cuda:N") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            why = (
                f"this torch {torch.__version__} is built without CUDA"
                if torch.version.cuda is None
                else "no CUDA device is visible"
            )
            raise ValueError(
                f"device {device!r} (--device): CUDA is not available on this machine ({why}); use --device cpu or auto"
            )
        count = torch.cuda.device_count()
        if dev.index is not None and dev.index >= count:
            raise ValueError(
                f"device {device!r} (--device): this machine has {count} CUDA device(s), cuda:0 to cuda:{count - 1}"
            )
    elif dev.type != "cpu":
        backend = getattr(torch, dev.type, None) or getattr(torch.backends, dev.type, None)
        if not (hasattr(backend, "is_available") and backend.is_available()):
            raise ValueError(f"device {device!r} (--device) is not available on this machine; use cpu or cuda")


def check_request(settings, push_to_hub: str | None, token: str | None) -> str | None:
    """The checks that need nothing but the arguments; returns the Hub token to use (``None`` without a push)."""
    check_device(settings.device)
    threads = settings.threads
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
        raise ValueError(f"threads (--threads) must be a positive number of CPU threads, got {threads!r}")
    if not push_to_hub:
        return token
    from ..output.hub import check_repo_id, resolve_token

    check_repo_id(push_to_hub)
    return resolve_token(token)


# --------------------------------------------------------------------------------------------------------------------
# the report
# --------------------------------------------------------------------------------------------------------------------
def check_report_finite(report) -> None:
    """Fail when a number of the calibration report is NaN or infinite (a model that computes NaN must not be
    written as if it worked)."""
    values = {
        "original perplexity": report.ppl_original,
        "identity-init perplexity": report.ppl_identity,
        "least-squares-init perplexity": report.ppl_least_squares,
        "calibrated perplexity": report.ppl_calibrated,
        "KL at the start": report.kl_start,
        "KL at the end": report.kl_end,
    }
    if report.heal:
        values.update({f"healed {k}": report.heal[k] for k in ("ppl_after", "top1_after")})
    for s in report.layers:
        values[f"layer {s.layer} max logit (original)"] = s.max_logit_original
        values[f"layer {s.layer} max logit (converted)"] = s.max_logit_converted
    bad = {k: v for k, v in values.items() if v is not None and not math.isfinite(float(v))}
    if not bad:
        return
    listed = ", ".join(f"{k} {v}" for k, v in list(bad.items())[:4])
    if "original perplexity" in bad:
        why = "the source model itself computes non-finite values on the held-out text (NaN/inf in its weights?)"
    else:
        why = (
            "the converted model computes non-finite values: the scheme cannot be computed for this model with "
            "these settings (an extreme --softcap, --eps or --p?)"
        )
    raise ConversionCheckError(f"the conversion's report is not finite ({listed}): {why}; nothing was written")


# --------------------------------------------------------------------------------------------------------------------
# the written tensors
# --------------------------------------------------------------------------------------------------------------------
def check_written(folder: Path, plan) -> None:
    """Every tensor ``plan`` (a :class:`~hf_qknorm.conversion.output.shards.WeightPlan`) adds is in ``folder``'s shards
    with exactly the planned value, and no tensor it drops is there. Reads only the added tensors."""
    from safetensors import safe_open

    key_file = {}
    for path in sorted(Path(folder).glob("*.safetensors")):
        with safe_open(path, framework="pt") as f:
            key_file.update({k: path for k in f.keys()})
    problems = [f"{k} is missing" for k in plan.new if k not in key_file]
    problems += [f"{k} should have been removed" for k in sorted(plan.drop) if k in key_file]
    for key, value in plan.new.items():
        if key in key_file:
            with safe_open(key_file[key], framework="pt") as f:
                got = f.get_tensor(key)
            if got.dtype != value.dtype or got.shape != value.shape or not torch.equal(got, value):
                problems.append(f"{key} differs from the value the conversion computed")
    if problems:
        more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
        raise ConversionCheckError(
            f"the written weights are not what the conversion computed: "
            f"{'; '.join(problems[:3])}{more}; nothing was written"
        )


# --------------------------------------------------------------------------------------------------------------------
# the verifier on the written folder
# --------------------------------------------------------------------------------------------------------------------
def verify_output(
    folder: Path, cfg, kind: str, mode: str = "full", log=None, source=None, values: dict | None = None
) -> None:
    """Check the written ``folder`` (see the module docstring); raise :class:`ConversionCheckError` when it fails.
    ``mode``: ``"full"``, ``"plugin"`` (in this process only) or ``"off"``. With ``source`` (the
    :class:`~hf_qknorm.conversion.orchestration.source.Source`) and ``values`` (the new norms' values by state-dict
    name, as the scheme's norms hold them), the written model's logits are compared with the converted model in
    memory."""
    if mode not in VERIFY_MODES:
        raise ValueError(f"unknown verify mode {mode!r}; choose one of {', '.join(VERIFY_MODES)}")
    say = log or (lambda *a: None)
    if mode == "off":
        say("not verified (verify='off')")
        return
    from ...modeling.patch import qknorm_config
    from ...portable.families import UnsupportedModelError
    from ...verification import verify, verify_folder
    from ...verification.loading import quiet_transformers
    from ..output.shards import load_pretrained

    reports, skipped, agreed = [], None, None
    layers = checked_layers(folder)
    with quiet_transformers(), layer_view(folder, layers) as view:
        model, info = load_pretrained(view, output_loading_info=True)
        model.eval()
        if info.get("missing_keys"):
            _fail(f"the written folder lacks {', '.join(sorted(info['missing_keys'])[:3])}")
        got = qknorm_config(model)
        wanted = cfg if kind == "qknorm" else None
        plain = _plain_class(kind, source)
        if got != wanted or (plain is not None and type(model).__name__ != plain):
            _fail(f"the written folder loads as {type(model).__name__} with scheme {got}, not {wanted or plain}")
        try:
            reports.append(verify(model))
        except UnsupportedModelError as exc:  # the float64 reference refuses this model type
            skipped = str(exc).splitlines()[0]
        if mode == "full" and kind == "qknorm" and skipped is None:
            reports.append(verify_folder(view, no_plugin=True))
        for report, how in zip(reports, ("with hf_qknorm", "without hf_qknorm, through its remote code")):
            if not report.ok:
                say(str(report))
                _fail(f"the written model failed verification ({how}): {'; '.join(report.problems()[:3])}")
        if source is not None and values is not None:
            # without the plugin once: through the float64 reference above where it ran on the remote code
            again = mode == "full" and len(reports) < 2
            agreed = _agreement(model, view, source, cfg, kind, values, again)
        del model
    if agreed is not None:
        say(f"verified the written model: {agreed}")
    if reports:
        ways = "with and without the plugin" if len(reports) == 2 else "with the plugin"
        say(
            f"verified the written model ({ways}, first {layers} layers in float32, float64 reference): "
            f"{reports[0].summary()}"
        )
    elif skipped:
        say(f"float64 reference not run: {skipped}")


def _plain_class(kind: str, source) -> str | None:
    """The class a plain export loads as (``None`` for ``qknorm``): a multimodal model's is the source's own class
    whichever its language model's type."""
    archs = (getattr(source.config, "architectures", None) or []) if source is not None else []
    if kind != "qknorm" and source is not None and source.family.text_model:
        return archs[0] if len(archs) == 1 else None
    if kind == "qwen3":
        return "Qwen3ForCausalLM"
    if kind == "native":
        return next((a for a in archs if a.endswith(("ForCausalLM", "LMHeadModel"))), None)
    return None


AGREEMENT_SHAPE, AGREEMENT_PAD = (2, 20), 5  # probe batch (one row left-padded by AGREEMENT_PAD tokens)


def _agreement(model, view: Path, source, cfg, kind: str, values: dict, without_plugin: bool) -> str:
    """Compare the logits of the written model (``model``, loaded from ``view`` with the plugin; and without it, in
    a fresh interpreter, when ``without_plugin``) with the converted model in memory: the source's first
    :func:`checked_layers` layers loaded in its own dtype, :func:`hf_qknorm.patch_model` with ``cfg`` (its self-check
    runs on the source's own weights), every tensor the conversion computed set to its value (the new norms; with
    healing the attention's weights too), then run in float32. Returns what was checked;
    :class:`ConversionCheckError` when they differ."""
    from ...modeling.patch import patch_model
    from ...modeling.saved import auto_class
    from ...portable.families import text_forward_path, text_runner
    from ...verification.plain import logits_without_plugin
    from ..calibration.calibrate import new_norm_parameters
    from ..output.shards import load_pretrained

    vocab = int(model.config.get_text_config().vocab_size)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(min(3, vocab - 1), min(vocab, 512), AGREEMENT_SHAPE, generator=gen)
    mask = torch.ones_like(ids)
    mask[0, :AGREEMENT_PAD] = 0
    dtype = source.weights.dtype
    layers = checked_layers(source.path)
    with layer_view(source.path, layers) as src_view:
        ref = load_pretrained(src_view, dtype=dtype)
    patch_model(ref, cfg)
    missing = sorted(set(new_norm_parameters(ref)) - set(values))
    if missing:
        _fail(f"the conversion computed no value for {missing[0]}")
    params = dict(ref.named_parameters())
    with torch.no_grad():
        for name, value in values.items():  # the new norms, and with healing the attention's own weights
            if name in params:  # the view holds the first layers only
                params[name].copy_(value)
    ref = ref.float().eval()
    with torch.no_grad():
        want = text_runner(ref)(input_ids=ids, attention_mask=mask).logits.float()
        got = {"with the plugin": text_runner(model)(input_ids=ids, attention_mask=mask).logits.float()}
    how = "plain Transformers" if kind != "qknorm" else "its remote code"
    if without_plugin:
        job = {"key": "0", "path": str(view), "remote": kind == "qknorm", "ids": ids.tolist(), "mask": mask.tolist()}
        job["auto"], job["text_forward"] = auto_class(ref.config).__name__, text_forward_path(ref)
        try:
            row = logits_without_plugin([job])["0"]
        except RuntimeError as exc:
            row = {"error": str(exc)}
        if "error" in row:
            _fail(f"the written folder does not load without hf_qknorm ({how}): {row['error']}")
        got[f"without the plugin ({how}, {row['cls']})"] = row["logits"]
    # a plain export in half precision stores a gain as the model's own convention (1 + w as w), rounded anew
    tol = 3e-2 if kind == "native" and dtype in (torch.float16, torch.bfloat16) else 1e-4
    scale = float(want[1].abs().max())
    worst = 0.0
    for where, logits in got.items():
        diff = max(
            float((logits[1] - want[1]).abs().max()),
            float((logits[0, AGREEMENT_PAD:] - want[0, AGREEMENT_PAD:]).abs().max()),
        )
        worst = max(worst, diff / max(scale, 1e-30))
        if not diff <= tol * scale:
            _fail(
                f"the written model's logits {where} differ from the converted model's by {diff:.3g} "
                f"(largest logit {scale:.3g})"
            )
    return (
        f"logits {', '.join(got)} equal the converted model's (patch_model of the source with the new norms, "
        f"first {layers} layers, float32; largest difference {worst:.1e} of the largest logit)"
    )


def _fail(message: str):
    raise ConversionCheckError(f"{message}; nothing was written")


def _layers_key(raw: dict) -> str:
    """The key a config.json names its layer count by: its config class's own name for ``num_hidden_layers``
    (GPT-2's ``n_layer``)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    from ...portable.families import base_model_type

    model_type = base_model_type(raw.get("model_type", ""))
    config_class = CONFIG_MAPPING[model_type] if model_type in CONFIG_MAPPING else None
    return getattr(config_class, "attribute_map", {}).get("num_hidden_layers", "num_hidden_layers")


def _text_config(raw: dict) -> dict:
    """The part of a config.json that counts the layers: a multimodal model's text config, else the whole."""
    return raw["text_config"] if isinstance(raw.get("text_config"), dict) else raw


def checked_layers(folder: Path) -> int:
    """The layers the written model's checks load: :data:`VERIFY_LAYERS`, or up to the first layer of a KV-shared
    tail (``num_kv_shared_layers``: those layers attend over keys an earlier layer stored, through code the layers
    before them never run)."""
    text = _text_config(json.loads((Path(folder) / "config.json").read_text()))
    total = int(text.get(_layers_key(text), 0))
    shared = text.get("num_kv_shared_layers")
    if isinstance(shared, int) and 0 < shared < total:
        return min(total, max(VERIFY_LAYERS, total - shared + 1))
    return VERIFY_LAYERS


@contextmanager
def layer_view(folder: Path, layers: int):
    """A folder that loads as ``folder`` with at most ``layers`` layers: its own ``config.json`` (layer count and
    per-layer lists cut), links to the weights and copies of the small files a model load reads."""
    raw = json.loads((Path(folder) / "config.json").read_text())
    text = _text_config(raw)  # a multimodal model's layers are its language model's
    key = _layers_key(text)
    total = int(text.get(key, 0))
    with tempfile.TemporaryDirectory(prefix="hf_qknorm_verify_") as tmp:
        view = Path(tmp) / "model"
        view.mkdir()
        for path in Path(folder).iterdir():
            if path.suffix == ".safetensors":
                (view / path.name).symlink_to(path.resolve())
            elif path.suffix in (".py", ".json") and path.name != "config.json" and path.is_file():
                shutil.copyfile(path, view / path.name)
        # float32: what is checked here is the written weights and code, which are the same in any dtype; float32
        # keeps the check's tolerance at 1e-4 (half precision needs 3e-2 and amplified probes) and its cost low
        raw["dtype"] = "float32"
        raw.pop("torch_dtype", None)
        if 0 < layers < total:
            text[key] = layers
            for name, value in list(text.items()):
                if isinstance(value, list) and len(value) == total:
                    text[name] = value[:layers]  # layer_types and the like
            shared = text.get("num_kv_shared_layers")
            if isinstance(shared, int) and shared > 0:  # the last layers reuse keys and values: those of them kept
                text["num_kv_shared_layers"] = max(0, shared - (total - layers))
            if isinstance(text.get("per_layer_config"), dict):  # a heterogeneous config's overrides, by layer index
                text["per_layer_config"] = {k: v for k, v in text["per_layer_config"].items() if int(k) < layers}
            if all(isinstance(text.get(name), int) for name in SECTIONS):  # Dory: input, recurrent, output layers
                left = layers
                for name in SECTIONS:
                    text[name] = min(text[name], left) if name != SECTIONS[-1] else left
                    left -= text[name]
        (view / "config.json").write_text(json.dumps(raw, indent=2))
        if 0 < layers < total:
            _cut_layer_count_tensors(folder, view, layers)
        yield view


def _cut_layer_count_tensors(folder: Path, view: Path, layers: int) -> None:
    """Give the view of the first ``layers`` layers the tensors outside the layers whose size depends on the layer
    count: those of :data:`LAYER_PACKED` cut to their first entries, written into the view in place of the links to
    the shards that hold them (with the other tensors of those shards the view's model loads); any other such
    tensor is refused in one line. Read off two skeletons on the ``meta`` device (the source's and the view's
    configs)."""
    from transformers import AutoConfig

    from ...portable.families import UnsupportedModelError
    from ..output.keys import loaded_names
    from ..output.shards import skeleton

    full_model = skeleton(AutoConfig.from_pretrained(folder), folder)
    full = full_model.state_dict()
    cut = skeleton(AutoConfig.from_pretrained(view), view).state_dict()
    grown = {k: tuple(t.shape) for k, t in cut.items() if k in full and tuple(full[k].shape) != tuple(t.shape)}
    for name, shape in grown.items():
        dim = next((d for suffix, d in LAYER_PACKED.items() if name.endswith(suffix)), None)
        if dim is None or [i for i, (a, b) in enumerate(zip(full[name].shape, shape)) if a != b] != [dim]:
            raise UnsupportedModelError(
                f"{folder}: {name} has a size that depends on the number of layers in a way hf_qknorm does not "
                f"know; the conversion's checks load the first {layers} layers of the source, which such a tensor "
                "does not allow: converting this model is not supported"
            )
    if grown:
        _write_cut_shards(view, grown, cut, loaded_names(full_model))


def _write_cut_shards(view: Path, grown: dict, wanted: dict, name_of) -> None:
    """Rewrite, in ``view``, each linked shard holding a tensor of ``grown`` (model name -> the view's shape): the
    tensors of it the view's model loads (``wanted``: its state dict; ``name_of``: checkpoint key -> model name),
    those of ``grown`` cut to their first entries; the weight index, where there is one, follows."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    changed: dict[str, list[str]] = {}
    for link in sorted(view.glob("*.safetensors")):
        with safe_open(str(link), framework="pt") as f:
            keys = list(f.keys())
            if not any(name_of(k) in grown for k in keys):
                continue
            tensors = {}
            for key in keys:
                name = name_of(key)
                if name not in wanted:
                    continue
                tensor = f.get_tensor(key)
                if name in grown:
                    tensor = tensor[tuple(slice(0, n) for n in grown[name])].contiguous()
                tensors[key] = tensor
            metadata = f.metadata() or {"format": "pt"}
        link.unlink()
        save_file(tensors, str(link), metadata=metadata)
        changed[link.name] = list(tensors)
    for index in view.glob("*.safetensors.index.json"):
        data = json.loads(index.resolve().read_text())
        data["weight_map"] = {
            k: f for k, f in data.get("weight_map", {}).items() if f not in changed or k in changed[f]
        }
        index.unlink(missing_ok=True)
        index.write_text(json.dumps(data, indent=2))
