"""The tested Transformers range is enforced, and every reliance on Transformers listed in hf_qknorm/upstream.py
resolves and names a test that exists (the tests that fail when upstream behaviour changes)."""

from __future__ import annotations

import ast
import importlib
import warnings
from pathlib import Path

import pytest
import torch

from hf_qknorm import upstream
from tests._support.tiny_models import tiny_model

TESTS = Path(__file__).resolve().parent


def test_version_gate():
    with pytest.raises(ImportError, match=rf"needs transformers>={upstream.OLDEST_TESTED} .* found 5\.3\.9"):
        upstream.check_transformers_version("5.3.9")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        upstream.check_transformers_version(upstream.OLDEST_TESTED)
        upstream.check_transformers_version(upstream.NEWEST_TESTED)
        upstream.check_transformers_version(upstream.NEWEST_TESTED.rsplit(".", 1)[0] + ".9")  # a patch release
    for newer in ("5.99.0", "6.0.0", "5.99.0.dev0", "5.99.0rc1"):
        with pytest.warns(UserWarning, match=f"tested with transformers .* found {newer}"):
            upstream.check_transformers_version(newer)


def test_installed_version_is_in_the_declared_range():
    import tomllib
    import transformers

    spec = tomllib.loads((TESTS.parent / "pyproject.toml").read_text())["project"]["dependencies"]
    declared = next(d for d in spec if d.startswith("transformers"))
    assert f">={upstream.OLDEST_TESTED.rsplit('.', 1)[0]}" in declared, declared
    version = upstream._version_tuple(transformers.__version__)
    assert upstream._version_tuple(upstream.OLDEST_TESTED) <= version
    assert version[:2] <= upstream._version_tuple(upstream.NEWEST_TESTED)[:2]


def test_ci_lanes_are_the_versions_the_readme_names():
    """.ci/run runs a lane at each end and one in the middle, and the README names exactly those versions."""
    oldest, middle, newest = (
        upstream._version_tuple(v) for v in (upstream.OLDEST_TESTED, upstream.MIDDLE_TESTED, upstream.NEWEST_TESTED)
    )
    assert oldest < middle < newest
    ci = (TESTS.parent / ".ci" / "run").read_text()
    code = "\n".join(line for line in ci.splitlines() if not line.lstrip().startswith("#"))  # run, not mentioned
    assert all(
        f"bash scripts/{lane}" in code for lane in ("test.sh", "test_version.sh oldest", "test_version.sh middle")
    )
    readme = (TESTS.parent / "README.md").read_text()
    named = (
        f"Transformers {upstream.OLDEST_TESTED}, {upstream.MIDDLE_TESTED} and "
        f"{upstream.NEWEST_TESTED.rsplit('.', 1)[0]}.x"
    )
    assert named in readme and "docs/compatibility.md" in readme, named


def _resolve(dotted: str):
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for name in parts[i:]:
            obj = getattr(obj, name)
        return obj
    raise ImportError(dotted)


@pytest.mark.parametrize("reliance", upstream.RELIANCES, ids=lambda r: r.symbol)
def test_every_reliance_resolves_and_names_a_real_test(reliance):
    import transformers
    from packaging.version import Version

    if reliance.since is None or Version(transformers.__version__) >= Version(reliance.since):
        assert _resolve(reliance.symbol) is not None, f"{reliance.symbol} is gone: re-check {reliance.used_by}"
    else:  # a reliance dated too late would leave the versions between unchecked
        with pytest.raises((ImportError, AttributeError)):
            _resolve(reliance.symbol)
    module = reliance.used_by.split(" ")[0]
    assert (TESTS.parent / "hf_qknorm" / module).is_file(), f"used_by names a missing module: {reliance.used_by}"
    path, _, name = reliance.checked_by.partition("::")
    file = TESTS.parent / path
    assert file.is_file(), reliance.checked_by
    if name:
        tree = ast.parse(file.read_text())
        assert any(isinstance(n, ast.FunctionDef) and n.name == name for n in tree.body), reliance.checked_by


def test_backend_is_registered():
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    import hf_qknorm  # noqa: F401  (registers)

    assert "qknorm" in ALL_ATTENTION_FUNCTIONS.valid_keys() and "qknorm" in ALL_MASK_ATTENTION_FUNCTIONS.valid_keys()


def test_a_local_attention_entry_is_what_the_models_call(monkeypatch):
    """An entry in ALL_ATTENTION_FUNCTIONS._local_mapping is what every attention layer of a model on that
    implementation calls, ahead of the registered function, looked up at each call; removed, the registered one is
    called again (the self-check's recorder relies on both)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    import hf_qknorm  # noqa: F401  (registers)

    monkeypatch.delitem(ALL_ATTENTION_FUNCTIONS._local_mapping, "qknorm", raising=False)  # the registered one
    registered = ALL_ATTENTION_FUNCTIONS["qknorm"]
    model = tiny_model("llama", attn_implementation="qknorm")
    ids = torch.randint(0, 64, (1, 5), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = model(ids).logits
    calls = []

    def recorder(module, *args, **kwargs):
        calls.append(module)
        return registered(module, *args, **kwargs)

    ALL_ATTENTION_FUNCTIONS._local_mapping["qknorm"] = recorder
    try:
        assert ALL_ATTENTION_FUNCTIONS.get_interface("qknorm", None) is recorder
        with torch.no_grad():
            got = model(ids).logits
    finally:
        del ALL_ATTENTION_FUNCTIONS._local_mapping["qknorm"]
    assert calls == [layer.self_attn for layer in model.model.layers]
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    with torch.no_grad():
        model(ids)
    assert len(calls) == len(model.model.layers) and ALL_ATTENTION_FUNCTIONS["qknorm"] is registered


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3"])
def test_rotary_function_is_the_forwards_rotation(family):
    """The function the monitor and calibration use to rebuild post-RoPE q and k is the half-split rotation the
    family's forward applies (the formula in hf_qknorm.reference)."""
    from hf_qknorm.portable.layout import rotary_function
    from hf_qknorm.reference import rope_reference

    model = tiny_model(family, dtype=torch.float64)
    attn = model.model.layers[0].self_attn
    q = torch.randn(2, 4, 9, attn.head_dim, dtype=torch.float64)
    k = torch.randn(2, 2, 9, attn.head_dim, dtype=torch.float64)
    cos, sin = model.model.rotary_emb(q, torch.arange(9)[None].expand(2, -1))
    q_rot, k_rot = rotary_function(attn)(q, k, cos, sin)
    torch.testing.assert_close(q_rot, rope_reference(q, cos, sin))
    torch.testing.assert_close(k_rot, rope_reference(k, cos, sin))


def test_checkpointing_shim_follows_the_installed_version():
    """Activation checkpointing is reached under the installed version's names (renamed in
    upstream.ACTIVATION_CHECKPOINTING_SINCE; the old names warn from then on, the new ones are unknown before): no
    deprecation warning, and the model really recomputes (the gradients are those of the plain backward)."""
    import transformers
    from transformers import TrainingArguments

    renamed = upstream._version_tuple(transformers.__version__) >= upstream._version_tuple(
        upstream.ACTIVATION_CHECKPOINTING_SINCE
    )
    name = "activation" if renamed else "gradient"
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        warnings.simplefilter("error", DeprecationWarning)
        kw = upstream.checkpointing_arguments(True, use_reentrant=False)
        assert set(kw) == {f"{name}_checkpointing", f"{name}_checkpointing_kwargs"}
        args = TrainingArguments("unused", use_cpu=True, report_to="none", **kw)
        assert args.gradient_checkpointing and args.to_dict()[f"{name}_checkpointing_kwargs"] == {
            "use_reentrant": False
        }
        model = tiny_model("llama")
        ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(0))
        model.train()
        model(ids, labels=ids).loss.backward()
        plain = [p.grad.clone() for p in model.parameters()]
        model.zero_grad()
        assert not upstream.is_checkpointing(model)
        upstream.enable_checkpointing(model, use_reentrant=False)
        assert upstream.is_checkpointing(model)
        calls = []
        attention = model.model.layers[0].self_attn  # inside the checkpointed layer on every version
        attention.register_forward_pre_hook(lambda *a: calls.append(1))
        model(ids, labels=ids).loss.backward()
        assert len(calls) == 2  # forward, then the recomputation in backward
        for p, g in zip(model.parameters(), plain):
            torch.testing.assert_close(p.grad, g)
    if renamed:  # the old names are deprecated aliases: the shim must not pick them here
        with pytest.warns(FutureWarning, match="gradient_checkpointing"):
            TrainingArguments("unused", use_cpu=True, report_to="none", gradient_checkpointing=True)
    else:  # the new names do not exist yet
        with pytest.raises(TypeError, match="activation_checkpointing"):
            TrainingArguments("unused", use_cpu=True, report_to="none", activation_checkpointing=True)


# Llama, GPT-2 (a fused projection, no RoPE) and Qwen3 (native q/k norms) beside the coverage sample's families
_ARGUMENT_FAMILIES = ("llama", "gpt2", "qwen3", "mistral", "mixtral", "gemma3_text", "phi3", "gpt_neox", "gpt_oss")


@pytest.mark.parametrize("model_type", _ARGUMENT_FAMILIES)
def test_every_argument_the_plugin_reads_is_declared(model_type):
    """Each name the plugin passes to a model's forward or reads from a call or an output is the installed
    Transformers' own: the cache under :func:`upstream.cache_argument`'s name (declared by the forward, not a
    fallback), the output's cache field, the cache and the rotary embedding as the attention module receives them.
    A release that renames one of them fails here instead of leaving the plugin reading ``None`` -- and no call of
    the plugin's helpers meets a deprecated name."""
    import inspect

    from hf_qknorm.portable.layout import attention_modules
    from hf_qknorm.verification.tiny import tiny_model as tiny

    model = tiny(model_type)
    declared = inspect.signature(type(model).forward).parameters
    name = upstream.cache_argument(model)
    assert name in declared, (name, list(declared))
    assert {"input_ids", "attention_mask", "position_ids", "use_cache"} <= set(declared)
    _, attns = attention_modules(model)
    seen = []
    attns[0].register_forward_hook(lambda m, args, kwargs, out: seen.append(kwargs), with_kwargs=True)
    ids = torch.randint(3, model.config.vocab_size, (1, 6), generator=torch.Generator().manual_seed(0))
    with warnings.catch_warnings(), torch.no_grad():
        warnings.filterwarnings("error", message=".*past_key_values.*")
        warnings.filterwarnings("error", message=".*`cache`.*")
        first = model(input_ids=ids[:, :-1], use_cache=True)
        cache = upstream.output_cache(first)
        assert cache is not None
        model(input_ids=ids[:, -1:], use_cache=True, **upstream.cache_kwargs(model, cache))
    assert upstream.called_cache(seen[-1]) is cache  # the attention module got the cache under a name we read
    if getattr(model.config, "rope_parameters", None) is not None or "rope_theta" in model.config.to_dict():
        assert seen[-1].get("position_embeddings") is not None


def test_an_untested_version_never_breaks_a_command_lines_one_line_error(monkeypatch, capsys):
    """On a Transformers newer than the newest tested, the command line still fails in one line (the version note
    inside it) and says it in one ``warning:`` line after a command that ran; the import-time warning is left to
    library users (the command says it itself)."""
    import sys

    from hf_qknorm.cli.main import main

    monkeypatch.setattr(upstream, "NEWEST_TESTED", upstream.OLDEST_TESTED)
    monkeypatch.setattr("transformers.__version__", "5.99.0")
    assert main(["coverage", "not_a_model"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "found 5.99.0" in err[0], err
    assert main(["info"]) == 0
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("warning: ") and "found 5.99.0" in err[-1], err
    for argv, orig, cli in (
        (["/usr/bin/hf-qknorm"], ["python", "/usr/bin/hf-qknorm"], True),
        (["-m"], ["python", "-m", "hf_qknorm.cli", "info"], True),
        (["train.py"], ["python", "train.py"], False),
        (["-m"], ["python", "-m", "pytest"], False),
    ):
        monkeypatch.setattr(sys, "argv", argv)
        monkeypatch.setattr(sys, "orig_argv", orig)
        assert upstream.run_as_command_line() is cli, argv


def test_the_verifiers_probe_reads_the_cache_under_the_same_names():
    """verification/probe.py runs where hf_qknorm cannot be imported, so it keeps its own copy of the names."""
    from hf_qknorm.verification import probe

    assert probe.CALL_CACHE_NAMES == upstream.CALL_CACHE_NAMES
