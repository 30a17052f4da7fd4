"""``hf_qknorm.verify`` and ``hf-qknorm verify``: correct models verify; each way of silently dropping the cap, the
norms or the mask is caught (every catching test runs the same model correct first, then broken).

The expected values come from the float64 formula reference (``hf_qknorm.reference``); the broken models are built
here: a ``"qknorm"`` attention function that drops the cap (plain sdpa) or the padding mask, sdpa forced under a
capped model with the patch's own check bypassed, norm hooks removed, a saved folder whose remote code skips the
norm, a backend that attends to a static cache's empty slots.
"""

from __future__ import annotations

import collections
import contextlib
import re
import shutil

import pytest
import torch

import hf_qknorm
from hf_qknorm import QKNormConfig
from hf_qknorm.cli import main as cli_main
from hf_qknorm.portable import hooks
from hf_qknorm.verification import checks, layers, probe
from hf_qknorm.verification.report import Check, VerifyReport
from tests._support.convert_support import hook_source_skipping_the_norm, quiet, save_source
from tests._support.tiny_models import tiny_model


def _ids(value):
    if isinstance(value, bool):
        return "biases" if value else "plain"
    return str(value).replace("torch.", "") if isinstance(value, torch.dtype) else None


def _patched(family, scheme=None, norm=None, dtype=torch.float32, seed=0, biases=False, **kwargs):
    """A tiny model, patched with ``scheme`` (unpatched when None), its 1-d weights moved away from their init so
    the reference must read them (norm gains and biases, Qwen3's own q/k gains, pre-norms).

    ``biases=True`` moves every 1-d weight, the projections' biases too, as ``save_source`` does for conversion
    tests: with weights at their init scale (std 0.02) the biases then dominate GPT-2's and Qwen2's q, k, v and
    attention output, and the hidden states of the second layer hardly differ from position to position -- a model
    whose attention output hardly depends on what it attends to (the half-precision stress case of the verifier)."""
    model = tiny_model(family, dtype=dtype, seed=seed, **kwargs)
    if scheme is not None:
        hf_qknorm.patch_model(model, scheme, norm=norm, p=3.0 if norm == "lp" else None)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, prm in model.named_parameters():
            if prm.dim() <= 1 and (biases or "norm" in name or name.endswith(("ln_1.weight", "ln_1.bias"))):
                prm.add_((0.3 * torch.randn(prm.shape, generator=gen)).to(prm.dtype))
    return model


@contextlib.contextmanager
def qknorm_function(fn, name="qknorm"):
    """Register ``fn`` as the ``name`` attention function (``"qknorm"``; ``"sdpa"`` for an uncapped patched model)
    for the duration; the real one is restored after."""
    from transformers import AttentionInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    real = ALL_ATTENTION_FUNCTIONS[name]
    AttentionInterface.register(name, fn)
    try:
        yield
    finally:
        AttentionInterface.register(name, real)


def _real_qknorm(name="qknorm"):
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    return ALL_ATTENTION_FUNCTIONS[name]


# --------------------------------------------------------------------------------------------------------------------
# correct models verify
# --------------------------------------------------------------------------------------------------------------------
CORRECT = [  # family, scheme, norm, dtype, extra config
    ("llama", "qk_norm_cap", "layernorm", torch.float32, {}),
    ("mistral", "qk_norm", "rmsnorm", torch.float32, {}),  # window 12 < probe length 20: exercised
    ("qwen2", "qkv_norm", "layernorm", torch.float32, {}),  # pre-norm removed, v normalised
    ("qwen3", "soft_cap", None, torch.float32, {}),  # Qwen3's own q/k norms kept
    ("gpt2", "qk_norm_cap", "l2", torch.float32, {}),  # fused Conv1D c_attn, learnable logit scale
    ("gpt2", "qkv_norm", "rmsnorm", torch.float64, {}),
    ("qwen2", "qk_norm", "lp", torch.float32, {}),
    ("llama", "soft_cap", None, torch.bfloat16, {}),  # stress probe upcast to float32
    ("llama", None, None, torch.float32, {"attn_implementation": "eager"}),  # unpatched: plain attention
    ("qwen3", None, None, torch.float32, {}),  # unpatched Qwen3: its own q/k RMSNorm
]


def _verified(model, family, window):
    """Verify a correct model: ok, and every mechanism reported as its scheme has it (``window``: the states a
    sliding window may be reported in)."""
    report = hf_qknorm.verify(model)
    assert report.ok, str(report)
    cfg = hf_qknorm.qknorm_config(model)
    assert report.mechanism("padding") == "applied" and report.mechanism("causal") == "applied"
    normed = (cfg is not None and cfg.norms_qk) or family == "qwen3"
    assert report.mechanism("norms") == ("applied" if normed else "n/a")
    assert report.mechanism("cap") == ("applied" if cfg is not None and cfg.caps else "n/a")
    assert report.mechanism("window") in (window if family == "mistral" else ("n/a",))
    return report, cfg


@pytest.mark.parametrize(
    "family,scheme,norm,dtype,extra", CORRECT, ids=[f"{c[0]}-{c[1]}-{c[2]}-{str(c[3])[6:]}" for c in CORRECT]
)
def test_correct_models_verify(family, scheme, norm, dtype, extra):
    model = _patched(family, scheme, norm, dtype, **extra)
    report, cfg = _verified(model, family, window=("applied",))
    assert report.mechanism("prenorm") == ("removed" if cfg is not None and cfg.removes_prenorm else "applied")
    probes = {c.probe for c in report.checks}
    assert {
        "unpadded",
        "padded",
        "cache-unpadded",
        "cache-padded",
        "logits cache-unpadded",
        "logits cache-padded",
    } <= probes
    assert ("stress" in probes) == (cfg is not None and cfg.caps)
    assert str(report).rstrip().endswith("OK")


# Every family and scheme in half precision, with every 1-d weight moved (``biases=True``): GPT-2's and Qwen2's
# attention output is then dominated by biases, and causality and padding change it by about as much as bfloat16
# rounds it (~3e-3 of max|out|) -- below the tolerance, so the plain probes cannot tell.
HALF = [
    (family, scheme, norm, dtype)
    for dtype in (torch.bfloat16, torch.float16)
    for family in ("llama", "mistral", "qwen2", "qwen3", "gpt2")
    for scheme, norm in (
        ("qk_norm", "rmsnorm"),
        ("qk_norm_cap", "layernorm"),
        ("qkv_norm", "rmsnorm"),
        ("soft_cap", None),
        (None, None),
    )
]
HALF += [("gpt2", "qk_norm", norm, dtype) for norm in ("l2", "lp") for dtype in (torch.bfloat16, torch.float16)]
HALF += [("qwen2", "qkv_norm", "layernorm", torch.bfloat16)]


@pytest.mark.parametrize("family,scheme,norm,dtype", HALF, ids=[f"{c[0]}-{c[1]}-{c[2]}-{str(c[3])[6:]}" for c in HALF])
def test_correct_half_precision_models_verify(family, scheme, norm, dtype):
    model = _patched(family, scheme, norm, dtype, biases=True)
    report, _ = _verified(model, family, window=("applied", "not exercised"))
    assert all(c.error <= c.tolerance for c in report.checks)


@pytest.mark.parametrize(
    "family,norm,seed",
    [("qwen2", "lp", 0), ("llama", "lp", 0), ("llama", "lp", 2), ("llama", "l2", 3), ("gpt2", "lp", 1)],
)
def test_half_precision_tolerance_grows_with_the_logits(family, norm, seed):
    """``lp``/``l2`` carry a learned logit scale of ``log2(L^2 - L)`` (30 for a 32k context): logits reach 40-50,
    and bfloat16's rounding of q and k moves such a logit by ~0.1 -- errors of 2-4e-2 on a correct model, over the
    flat bfloat16 tolerance. The tolerance of a half-precision check grows with the layer's largest logit."""
    model = _patched(family, "qk_norm", norm, torch.bfloat16, seed=seed, max_position_embeddings=32768)
    report = hf_qknorm.verify(model, generate=False)
    assert report.ok, str(report)
    wide = [c for c in report.checks if c.tolerance > checks.tolerance_for(torch.bfloat16)]
    assert wide and all(c.probe != "stress" for c in wide)
    # ... and the wider tolerance still catches a backend that attends to padding
    real = _real_qknorm(model.config._attn_implementation)

    def no_padding(module, query, key, value, attention_mask, **kwargs):
        return real(module, query, key, value, None, **kwargs)

    with qknorm_function(no_padding, model.config._attn_implementation):
        bad = hf_qknorm.verify(model, generate=False)
    assert not bad.ok and bad.mechanism("padding") == "DROPPED", str(bad)


def test_verify_leaves_the_model_as_it_was():
    """Training mode, weights (bit for bit, after the bfloat16 stress upcast) and hooks are restored."""
    model = _patched("llama", "qk_norm_cap", "layernorm", torch.bfloat16).train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    n_hooks = sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())
    assert hf_qknorm.verify(model, generate=False).ok
    assert model.training
    after = model.state_dict()
    assert all(after[k].dtype == v.dtype and torch.equal(after[k], v) for k, v in before.items())
    assert sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules()) == n_hooks


def test_verify_is_the_function_whatever_was_imported_first():
    """The subpackage is ``hf_qknorm.verification``, so importing it never hides the function ``hf_qknorm.verify``."""
    import hf_qknorm.cli.verify  # noqa: F401

    assert callable(hf_qknorm.verify) and hf_qknorm.verify(tiny_model("llama"), generate=False).ok


# --------------------------------------------------------------------------------------------------------------------
# the cap
# --------------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "family,scheme,dtype,biases",
    [
        ("llama", "qk_norm_cap", torch.float32, False),
        ("llama", "soft_cap", torch.float32, False),
        ("gpt2", "soft_cap", torch.float32, False),
        ("qwen3", "soft_cap", torch.float32, False),
        ("llama", "qk_norm_cap", torch.bfloat16, False),
        ("gpt2", "qk_norm_cap", torch.bfloat16, True),
        ("qwen2", "soft_cap", torch.float16, True),
    ],
    ids=_ids,
)
def test_catches_a_backend_that_drops_the_cap(family, scheme, dtype, biases):
    """The default cap of 50 never bites on probe text (a normalised q.k/sqrt(d) is at most sqrt(d) times the
    gains): only the stress probe sees it. A "qknorm" function that is plain sdpa must be caught."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    model = _patched(family, scheme, "layernorm" if scheme != "soft_cap" else None, dtype, biases=biases)
    assert hf_qknorm.qknorm_config(model).softcap == 50.0
    good = hf_qknorm.verify(model, generate=False)
    assert good.ok and good.mechanism("cap") == "applied", str(good)
    with qknorm_function(sdpa_attention_forward):
        bad = hf_qknorm.verify(model, generate=False)
    assert not bad.ok and bad.mechanism("cap") == "DROPPED", str(bad)
    assert "FAILED" in str(bad) and "cap DROPPED" in str(bad)
    stress = [c for c in bad.checks if c.probe == "stress"]
    assert stress and all(not c.ok and c.mechanisms["cap"] == "DROPPED" for c in stress)


@pytest.mark.parametrize(
    "family,dtype,biases",
    [("llama", torch.float32, False), ("llama", torch.bfloat16, False), ("gpt2", torch.bfloat16, True)],
    ids=_ids,
)
def test_catches_sdpa_forced_under_a_capped_model(monkeypatch, family, dtype, biases):
    model = _patched(family, "qk_norm_cap", "layernorm", dtype, biases=biases)
    assert hf_qknorm.verify(model, generate=False).ok
    model.config._attn_implementation = "sdpa"
    refused = hf_qknorm.verify(model, generate=False)  # the patch's own check refuses to run: reported, not raised
    assert not refused.ok and "unpadded: the probe failed: ValueError" in str(refused)
    monkeypatch.setattr(hooks, "check_cap_backend", lambda impl: None)  # ... and with that check bypassed
    bad = hf_qknorm.verify(model, generate=False)
    assert bad.backend == "sdpa" and not bad.ok and bad.mechanism("cap") == "DROPPED", str(bad)


# --------------------------------------------------------------------------------------------------------------------
# the norms and the mask
# --------------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "family,scheme,dtype,biases",
    [
        ("llama", "qk_norm", torch.float32, False),
        ("gpt2", "qk_norm", torch.float32, False),
        ("llama", "qk_norm", torch.bfloat16, False),
        ("gpt2", "qk_norm", torch.bfloat16, True),
        ("gpt2", "qkv_norm", torch.bfloat16, True),
        ("qwen2", "qk_norm", torch.float16, True),
    ],
    ids=_ids,
)
@pytest.mark.parametrize("mechanism", ["class", "forward hooks"])
def test_catches_norms_removed(family, scheme, dtype, biases, mechanism):
    """The projections stop applying the norms (their class restored, or their forward hooks removed)."""
    model = _patched(family, scheme, "layernorm", dtype, biases=biases)
    _, attns = hf_qknorm.portable.layout.attention_modules(model)
    if mechanism == "forward hooks":
        for attn in attns:
            hooks.use_forward_hooks(attn)
    good = hf_qknorm.verify(model, generate=False)
    assert good.ok and good.mechanism("norms") == "applied"
    for attn in attns:
        for slot, (_module, handle) in list(attn.__dict__["_qknorm_handles"].items()):
            assert (handle is not None) == (mechanism == "forward hooks")
            hooks._detach(attn, slot)
    bad = hf_qknorm.verify(model, generate=False)
    assert not bad.ok and bad.mechanism("norms") == "DROPPED", str(bad)


@pytest.mark.parametrize(
    "family,scheme,dtype,biases",
    [
        ("llama", "qk_norm_cap", torch.float32, False),
        ("llama", "qk_norm_cap", torch.bfloat16, False),
        ("gpt2", "qkv_norm", torch.bfloat16, True),
        ("gpt2", "qk_norm", torch.float16, True),
    ],
    ids=_ids,
)
def test_catches_a_backend_that_ignores_padding(family, scheme, dtype, biases):
    """In half precision on a model whose output hardly depends on what it attends to (``biases=True``), the padded
    probe's error stays within tolerance; the amplified padded probe must catch it."""
    model = _patched(family, scheme, "layernorm", dtype, biases=biases)
    backend = model.config._attn_implementation  # "qknorm" when capped, else "sdpa"
    real = _real_qknorm(backend)

    def no_padding(module, query, key, value, attention_mask, **kwargs):
        return real(module, query, key, value, None, **kwargs)  # causal only: padded keys are attended

    good = hf_qknorm.verify(model)
    assert good.ok and good.mechanism("padding") == "applied", str(good)
    with qknorm_function(no_padding, backend):
        bad = hf_qknorm.verify(model)
    assert not bad.ok and bad.mechanism("padding") == "DROPPED", str(bad)
    failed = {c.probe for c in bad.checks if not c.ok}
    assert failed and not failed & {"unpadded", "cache-unpadded", "stress"}
    if not biases:
        assert {"padded", "cache-padded"} <= failed


# --------------------------------------------------------------------------------------------------------------------
# the cache
# --------------------------------------------------------------------------------------------------------------------
def _empty_slots_backend(name="qknorm"):
    """A backend that attends to every key of a prefill with more keys than queries: what a prefill into an empty
    static cache then reads is the cache's unused (zero) slots. Newer Transformers hands such a prefill no mask (the
    backend must infer the alignment), older ones a dense mask, which this backend drops, so the adversary bites on
    every supported version."""
    real = _real_qknorm(name)

    def attends_empty_slots(module, query, key, value, attention_mask, **kwargs):
        if key.shape[2] > query.shape[2] > 1:
            attention_mask, kwargs["is_causal"] = None, False
        return real(module, query, key, value, attention_mask, **kwargs)

    return attends_empty_slots


@pytest.mark.parametrize(
    "family,scheme,dtype,biases",
    [
        ("llama", "qk_norm_cap", torch.float32, False),
        ("llama", "qk_norm_cap", torch.bfloat16, False),
        ("gpt2", "qkv_norm", torch.bfloat16, True),
        ("mistral", "qk_norm_cap", torch.float32, False),
        ("mistral", "qk_norm", torch.float32, False),
    ],
    ids=_ids,
)
def test_catches_a_prefill_that_reads_empty_static_cache_slots(family, scheme, dtype, biases):
    # Mistral: a window longer than the probe's 14 tokens (a real model's is 4096); with a shorter one Transformers
    # builds a mask for the prefill and the backend never has to infer the alignment
    window = {"sliding_window": 64} if family == "mistral" else {}
    model = _patched(family, scheme, "layernorm", dtype, biases=biases, **window)
    backend = model.config._attn_implementation
    with qknorm_function(_empty_slots_backend(backend), backend):
        assert hf_qknorm.verify(model).ok  # dynamic cache: a prefill never has more keys than queries
        model.generation_config.cache_implementation = "static"
        bad = hf_qknorm.verify(model)
    assert "StaticCache" in bad.cache and not bad.ok
    failed = {c.probe for c in bad.checks if not c.ok}
    assert {"cache-unpadded", "logits cache-unpadded"} <= failed
    assert not failed & {"unpadded", "padded", "stress", "amplified", "amplified-padded"}


def test_capped_model_with_a_static_cache_verifies():
    model = _patched("llama", "qk_norm_cap", "layernorm")
    model.generation_config.cache_implementation = "static"
    report = hf_qknorm.verify(model)
    assert "StaticCache" in report.cache
    assert report.ok, str(report)


# --------------------------------------------------------------------------------------------------------------------
# weights: peft LoRA (separate and fused Conv1D projections), norms in modules_to_save
# --------------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_lora_weights_are_base_plus_delta(family, monkeypatch):
    model = _patched(family, "qk_norm_cap", "layernorm")
    peft_model = hf_qknorm.prepare_lora(model, r=4)
    with torch.no_grad():  # LoRA B starts at zero; the trained norm copies start equal to the originals
        for name, prm in peft_model.named_parameters():
            if "lora_B" in name or "modules_to_save" in name:
                prm.add_(0.2 * torch.randn_like(prm))
    report = hf_qknorm.verify(peft_model, generate=False)
    assert report.ok, str(report)
    # the check can fail: a reference without the LoRA deltas is off
    real = layers._effective
    monkeypatch.setattr(
        layers, "_effective", lambda module, conv1d: real(getattr(module, "base_layer", module), conv1d)
    )
    assert not hf_qknorm.verify(peft_model, generate=False).ok


# --------------------------------------------------------------------------------------------------------------------
# the report
# --------------------------------------------------------------------------------------------------------------------
def test_report_fails_when_a_required_mechanism_is_never_exercised():
    check = Check(0, "unpadded", 1e-7, 1e-4, {"cap": "not exercised", "norms": "applied", "causal": "applied"})
    report = VerifyReport(
        "M",
        "qk_norm_cap",
        "qknorm",
        "dynamic",
        "float32",
        [check],
        expected=("cap", "causal", "norms"),
        required=("cap", "causal", "norms"),
    )
    assert check.ok and not report.ok
    assert report.problems() == ["cap not exercised: no probe exercised it"]
    assert checks.mechanism_status(e=1e-7, e_m=0.5, d_m=0.5, tol=1e-4) == "applied"
    assert checks.mechanism_status(e=0.5, e_m=1e-7, d_m=0.5, tol=1e-4) == "DROPPED"
    assert checks.mechanism_status(e=0.5, e_m=0.4, d_m=0.5, tol=1e-4) == "?"
    # below 3 tolerances the measured errors decide: a third of d_m or less
    assert checks.mechanism_status(e=1e-4, e_m=1.5e-4, d_m=2e-4, tol=1e-4) == "not exercised"
    assert checks.mechanism_status(e=3e-3, e_m=1.2e-2, d_m=1e-2, tol=3e-2) == "applied"  # bfloat16
    assert checks.mechanism_status(e=1.2e-2, e_m=3e-3, d_m=1e-2, tol=3e-2) == "DROPPED"
    assert checks.mechanism_status(e=4e-3, e_m=7e-3, d_m=1e-2, tol=3e-2) == "not exercised"  # 3 e > d_m
    assert checks.mechanism_status(e=0.5, e_m=0.4, d_m=2e-4, tol=1e-4) == "not exercised"


def _layer_pairs(model):
    """For each layer, plain probe and mechanism it judges: ``(ref, ref_m, rows, tol)`` from a real probe run."""
    ref_model = layers.ReferenceModel(model)
    captured = probe.run_probes(model, ref_model.plan(generate=False))
    tol = checks.tolerance_for(next(model.parameters()).dtype)
    for i in range(len(ref_model)):
        spec = ref_model.spec(i)
        for name in ("unpadded", "padded"):
            rec, rows = captured["probes"][name]["layers"][i], captured["probes"][name]["mask"].bool()
            args = (rec["x"].double(), *(None if t is None else t.double() for t in (rec["cos"], rec["sin"])), rows)
            ref = checks.layer_reference(spec, *args)
            for m in checks.PROBE_MECHANISMS[name]:
                if m in checks.applicable(spec, rows):
                    yield ref, checks.layer_reference(spec, *args, drop=(m,)), rows, tol


@pytest.mark.parametrize(
    "family,scheme,dtype", [("gpt2", "qkv_norm", torch.bfloat16), ("qwen2", "qk_norm", torch.float16)], ids=_ids
)
def test_rounding_noise_fakes_no_verdict(family, scheme, dtype):
    """Outputs built from a real layer's references (plain probes of a model whose d_m is often near the rounding):
    the reference without m plus noise -- its rounding to the model's dtype, or random noise up to 3 times m's
    effect -- is never judged *applied*; the reference plus the same noise is never *DROPPED*. Only "noise" that
    undoes m's effect entry by entry could fake a verdict (shown last)."""
    model = _patched(family, scheme, "rmsnorm", dtype, biases=True)
    gen = torch.Generator().manual_seed(0)
    seen = collections.Counter()
    for ref, ref_m, rows, tol in _layer_pairs(model):
        d_m, top = checks.relative_error(ref_m, ref, rows), float(ref[rows].abs().max())
        noises = [None] + [
            size * d_m * top * (2 * kind(ref.shape, generator=gen, dtype=torch.float64) - 1)
            for size in (0.1, 0.5, 1.0, 3.0)
            for kind in (torch.rand, torch.randn)
        ]
        for noise in noises:
            for target, forbidden in ((ref_m, "applied"), (ref, "DROPPED")):
                out = target.to(dtype).double() if noise is None else target + noise
                e, e_m = (checks.relative_error(out, r, rows, ref) for r in (ref, ref_m))
                status = checks.mechanism_status(e, e_m, d_m, tol)
                assert status != forbidden, (d_m, e, e_m)
                seen[forbidden, status] += 1
    assert seen["applied", "DROPPED"] and seen["DROPPED", "applied"]  # small enough noise is judged both ways
    assert seen["applied", "not exercised"] and seen["DROPPED", "not exercised"]  # large noise: no verdict
    ref, ref_m, rows, tol = next(_layer_pairs(model))
    mimic = ref_m + 0.99 * (ref - ref_m)  # a model without m whose "noise" undoes 99% of m's effect everywhere
    e, e_m = (checks.relative_error(mimic, r, rows, ref) for r in (ref, ref_m))
    assert checks.mechanism_status(e, e_m, checks.relative_error(ref_m, ref, rows), tol) == "applied"


# --------------------------------------------------------------------------------------------------------------------
# the command: saved folders, with and without the plugin
# --------------------------------------------------------------------------------------------------------------------
def _reports(text: str) -> list[str]:
    return [part for part in re.split(r"(?=^hf_qknorm verify: )", text, flags=re.M) if part.strip()]


def test_command_with_the_plugin(tmp_path, capsys):
    _patched("qwen2", "qkv_norm", "rmsnorm").save_pretrained(tmp_path / "ok")
    assert cli_main(["verify", str(tmp_path / "ok")]) == 0
    out = capsys.readouterr().out
    assert "loaded with hf_qknorm" in out and out.rstrip().endswith("OK") and "prenorm removed" in out
    assert cli_main(["verify", str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: {tmp_path / 'missing'}: folder not found"]
    (tmp_path / "empty").mkdir()
    assert cli_main(["verify", str(tmp_path / "empty")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "has no config.json" in err[0]


def _skip_the_norm(folder):
    """Edit a saved folder's shipped hook so that it returns the projection unnormalised."""
    hook_file = folder / "qknorm_hooks.py"
    edited = hook_source_skipping_the_norm(hook_file.read_text())
    hook_file.write_text(edited)


@pytest.mark.spawns
def test_command_without_the_plugin(tmp_path, capsys):
    """One subprocess that cannot import hf_qknorm loads five folders: a capped Llama through its remote code, the
    same folder with its shipped hook edited to skip the norm, a plain qwen3 export, and a bfloat16 GPT-2 whose
    output hardly depends on what it attends to (``biases=True``), as saved and with the same edit."""
    model = _patched("llama", "qk_norm_cap", "layernorm")
    model.save_pretrained(tmp_path / "capped")
    shutil.copytree(tmp_path / "capped", tmp_path / "edited")
    _skip_the_norm(tmp_path / "edited")
    _patched("gpt2", "qk_norm", "rmsnorm", torch.bfloat16, biases=True).save_pretrained(tmp_path / "bf16")
    shutil.copytree(tmp_path / "bf16", tmp_path / "bf16-edited")
    _skip_the_norm(tmp_path / "bf16-edited")
    save_source(tmp_path / "src", "llama")
    result = hf_qknorm.convert(
        tmp_path / "src",
        tmp_path / "qwen3",
        config=QKNormConfig(scheme="qk_norm", norm="rmsnorm"),
        calibrate=False,
        progress=False,
        log=quiet,
    )
    assert result.export == "qwen3"

    folders = ("capped", "edited", "qwen3", "bf16", "bf16-edited")
    status = cli_main(["verify"] + [str(tmp_path / name) for name in folders] + ["--no-plugin"])
    capped, edited_report, qwen3, bf16, bf16_edited = _reports(capsys.readouterr().out)
    assert status == 1
    assert "QKNormLlamaForCausalLM" in capped and "trust_remote_code=True" in capped
    assert capped.rstrip().endswith("OK") and "cap applied" in capped
    assert "FAILED" in edited_report and "norms DROPPED" in edited_report
    assert "Qwen3ForCausalLM" in qwen3 and "plain Transformers" in qwen3 and qwen3.rstrip().endswith("OK")
    assert "norms applied" in qwen3
    assert "dtype bfloat16" in bf16 and "trust_remote_code=True" in bf16 and bf16.rstrip().endswith("OK")
    assert "dtype bfloat16" in bf16_edited and "FAILED" in bf16_edited and "norms DROPPED" in bf16_edited


# --------------------------------------------------------------------------------------------------------------------
# the command cannot be fooled by a folder's weights (issue 22)
# --------------------------------------------------------------------------------------------------------------------
def _edit_weights(folder, edit) -> None:
    from safetensors.torch import load_file, save_file

    path = folder / "model.safetensors"
    save_file(edit(load_file(path)), path, metadata={"format": "pt"})


def _last_line(text: str) -> str:
    return text.rstrip().splitlines()[-1]


@pytest.mark.spawns
@pytest.mark.parametrize("no_plugin", [False, True], ids=["plugin", "no-plugin"])
def test_command_fails_a_folder_whose_weights_were_edited(tmp_path, capsys, no_plugin):
    """Every q_norm tensor deleted from a saved folder, a projection deleted from a plain qwen3 export, a norm gain
    stored as integers: each loads (with fresh or cast weights) and computes its scheme faithfully on them, so only
    the weights' own check can fail it: one line naming the tensors, exit 1."""
    _patched("llama", "qk_norm_cap", "layernorm").save_pretrained(tmp_path / "no-q-norm")
    _edit_weights(tmp_path / "no-q-norm", lambda sd: {k: v for k, v in sd.items() if "q_norm" not in k})
    save_source(tmp_path / "src", "llama")
    hf_qknorm.convert(
        tmp_path / "src",
        tmp_path / "qwen3",
        QKNormConfig("qk_norm", norm="rmsnorm"),
        calibrate=False,
        progress=False,
        log=quiet,
    )
    _edit_weights(tmp_path / "qwen3", lambda sd: {k: v for k, v in sd.items() if "layers.1.self_attn.q_proj" not in k})
    _patched("qwen2", "qk_norm", "rmsnorm").save_pretrained(tmp_path / "int-gain")
    _edit_weights(
        tmp_path / "int-gain", lambda sd: {k: v.round().to(torch.int64) if "k_norm" in k else v for k, v in sd.items()}
    )
    folders = ("no-q-norm", "qwen3", "int-gain")
    status = cli_main(["verify"] + [str(tmp_path / f) for f in folders] + (["--no-plugin"] if no_plugin else []))
    no_q_norm, qwen3, int_gain = _reports(capsys.readouterr().out)
    assert status == 1
    assert _last_line(no_q_norm).startswith("FAILED: weights: ")
    assert (
        "missing model.layers.*.self_attn.q_norm.bias (layers 0, 1), model.layers.*.self_attn.q_norm.weight "
        "(layers 0, 1)" in _last_line(no_q_norm)
    )
    assert _last_line(qwen3).startswith("FAILED: weights: ")
    assert "missing model.layers.1.self_attn.q_proj.weight" in _last_line(qwen3)
    assert _last_line(int_gain).startswith("FAILED: weights: ")
    assert "k_norm.weight (layers 0, 1) stored as I64" in _last_line(int_gain)


def test_command_names_a_config_that_disagrees_with_the_weights(tmp_path, capsys):
    """config.json's hidden_size edited: one line naming a tensor and both shapes, exit 2 (not Transformers' "look
    at the above report", which the command never shows)."""
    import json

    _patched("llama", "qk_norm", "layernorm").save_pretrained(tmp_path / "m")
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    cfg["hidden_size"] = 128
    (tmp_path / "m" / "config.json").write_text(json.dumps(cfg))
    capsys.readouterr()
    assert cli_main(["verify", str(tmp_path / "m")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "config.json disagrees with the weights" in err[0], err
    assert re.search(r"\S+ is \(\d+(, \d+)*\) in the checkpoint, \(\d+(, \d+)*\) by config\.json", err[0])


@pytest.mark.parametrize("value", ["-1", "0", "nan", "inf", "1.5", "abc"])
def test_tolerance_is_validated(tmp_path, capsys, value):
    from hf_qknorm.cli.main import main as cli_main

    try:
        status = cli_main(["verify", str(tmp_path), "--tolerance", value])
    except SystemExit as exc:  # a usage error: argparse exits, one line (cli.errors.OneLineParser)
        status = exc.code
    assert status == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--tolerance" in err[0] and value in err[0] and "between 0 and 1" in err[0], err
    if value != "abc":
        with pytest.raises(ValueError, match="tolerance must be a number between 0 and 1"):
            hf_qknorm.verify(_patched("llama", "qk_norm"), tolerance=float(value))


def test_debug_shows_the_traceback_of_a_folder_that_cannot_be_verified(tmp_path, capsys):
    from hf_qknorm.cli.main import main as cli_main

    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text('{"model_type": "llama", "hidden_size": "wide"}')
    assert cli_main(["verify", str(tmp_path / "m")]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert cli_main(["verify", str(tmp_path / "m"), "--debug"]) == 2
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err and err.strip().splitlines()[-1].startswith("error: ")
