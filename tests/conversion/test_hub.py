"""Model cards and Hub push, tested up to the network boundary (``HfApi`` is a mock; no token is ever real)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from unittest import mock

import pytest
from huggingface_hub import ModelCard

import hf_qknorm
from hf_qknorm import HubSettings
from hf_qknorm.cli.main import main as cli_main
from hf_qknorm.conversion.output.hub import (
    build_model_card,
    card_for_repo,
    card_metadata,
    check_repo_id,
    push,
    template_path,
    upload_files,
)
from hf_qknorm.modeling.remote import remote_files
from hf_qknorm.portable.schemes import QKNormConfig
from tests._support.convert_support import leftovers, quiet, save_source

LICENSED_README = "---\nlicense: apache-2.0\nlanguage: en\n---\n# a source model\n"


@pytest.fixture
def no_token(monkeypatch, tmp_path):
    """No token anywhere: no HF_TOKEN, an empty HF_HOME (no cached login)."""
    import huggingface_hub.constants as constants

    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.delenv("HUGGING_FACE_HUB_TOKEN", raising=False)
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "no-token"))
    monkeypatch.setattr(constants, "HF_STORED_TOKENS_PATH", str(tmp_path / "no-tokens"))


@pytest.fixture
def converted(tmp_path):
    save_source(tmp_path / "src", "llama")
    (tmp_path / "src" / "README.md").write_text(LICENSED_README)
    (tmp_path / "src" / "LICENSE").write_text("Apache License 2.0\n")
    return hf_qknorm.convert(
        tmp_path / "src",
        tmp_path / "my-model",
        config=QKNormConfig(scheme="qk_norm_cap"),
        calibrate=False,
        progress=False,
        log=quiet,
        verify="plugin",
    )


def test_card_metadata_and_content(converted):
    card = ModelCard.load(converted.path / "README.md")
    data = card.data.to_dict()
    assert data["license"] == "apache-2.0"  # inherited from the source's card
    assert data["library_name"] == "transformers" and data["pipeline_tag"] == "text-generation"
    assert {"hf-qknorm", "qk-norm-cap", "layernorm-qk-norm", "softcap", "custom_code"} <= set(data["tags"])
    assert "base_model" not in data  # a local folder is not a Hub id
    assert "trust_remote_code=True" in card.text and "`qk_norm_cap`" in card.text and "| softcap | 50.0 |" in card.text
    assert "no calibration was run" in card.text
    assert (converted.path / "LICENSE").is_file()


def test_card_with_report_and_hub_base_model(tmp_path):
    from hf_qknorm.conversion.calibration.calibrate import CalibrationReport, LayerStats

    report = CalibrationReport(
        scheme={},
        ppl_original=10.0,
        ppl_identity=30.0,
        ppl_least_squares=12.0,
        ppl_calibrated=10.5,
        calibration_tokens=1000,
        eval_tokens=500,
        steps=50,
        kl_start=0.2,
        kl_end=0.01,
        seconds=1.0,
        layers=[LayerStats(0, [1.0], [1.0], [0.5], 40.0, 30.0)],
        cap=50.0,
        warnings=["layer 0: largest logit 30.00 ..."],
    )
    card = build_model_card(
        base_model="meta-llama/Llama-3.2-1B",
        cfg=QKNormConfig("qk_norm", norm="rmsnorm"),
        export="qwen3",
        report=report,
        model_name="me/llama-qk",
    )
    assert card.data.base_model == "meta-llama/Llama-3.2-1B" and "qwen3" in card.data.tags
    assert "| converted, calibrated init (least squares + KL distillation) | 10.500 |" in card.text
    assert "removes **97.5%**" in card.text and "**Warning:** layer 0" in card.text
    assert 'from_pretrained("me/llama-qk")  # a plain Qwen3ForCausalLM' in card.text


def test_template_is_shipped_with_the_package():
    assert template_path().is_file() and template_path().parent.name == "templates"


def _commit(api) -> dict:
    """What the mocked ``HfApi.create_commit`` was asked to upload: path in repo -> bytes."""
    ops = api.create_commit.call_args.kwargs["operations"]
    out = {}
    for op in ops:
        data = op.path_or_fileobj
        out[op.path_in_repo] = data if isinstance(data, bytes) else Path(data).read_bytes()
    return out


def test_push_uploads_the_folder(converted, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_fake_token")
    api = mock.Mock()
    api.create_commit.return_value = mock.Mock(commit_url="https://huggingface.co/me/m/commit/abc")
    before = {p.name: p.read_bytes() for p in converted.path.iterdir()}
    url = push(converted.path, "me/my-model", private=True, revision="v1", commit_message="first", api=api)
    assert url.endswith("/commit/abc")
    api.create_repo.assert_called_once_with(
        "me/my-model", token="hf_fake_token", private=True, repo_type="model", exist_ok=True
    )
    api.create_branch.assert_called_once_with(
        "me/my-model", branch="v1", token="hf_fake_token", repo_type="model", exist_ok=True
    )
    kwargs = api.create_commit.call_args.kwargs
    assert api.create_commit.call_args.args == ("me/my-model",) and kwargs["revision"] == "v1"
    assert kwargs["commit_message"] == "first" and kwargs["token"] == "hf_fake_token"
    remote = set(remote_files())  # the remote code every patched folder carries
    uploaded = _commit(api)
    assert (
        sorted(uploaded)
        == upload_files(converted.path)
        == sorted(converted.files)
        == sorted(
            [
                "LICENSE",
                "README.md",
                "config.json",
                "generation_config.json",
                "model.safetensors",
                "qknorm_conversion.json",
                *remote,
            ]
        )
    )
    # the card on the Hub loads from the repo, not from the local folder name; the folder is not modified
    card = uploaded["README.md"].decode()
    assert 'from_pretrained("me/my-model", trust_remote_code=True)' in card
    assert '"my-model"' not in card and "\n# me/my-model\n" in card and "\n# my-model\n" not in card
    assert all(uploaded[name] == before[name] for name in uploaded if name != "README.md")
    assert {p.name: p.read_bytes() for p in converted.path.iterdir()} == before
    assert 'from_pretrained("my-model", trust_remote_code=True)' in (converted.path / "README.md").read_text()


def test_push_without_a_token_fails_before_the_network(converted, no_token):
    api = mock.Mock()
    with pytest.raises(ValueError, match="no Hugging Face token.*HF_TOKEN"):
        push(converted.path, "me/my-model", api=api)
    assert not api.method_calls
    with pytest.raises(ValueError, match="invalid Hub repo id"):
        push(converted.path, "not a repo id", token="x", api=api)
    (converted.path.parent / "src" / "README.md").unlink()
    with pytest.raises(ValueError, match="not a converted model folder .missing README.md"):
        push(converted.path.parent / "src", "me/x", token="x", api=api)
    assert not api.method_calls


def test_convert_with_push_and_no_token_writes_nothing(tmp_path, no_token):
    save_source(tmp_path / "src")
    with pytest.raises(ValueError, match="no Hugging Face token"):
        hf_qknorm.convert(
            tmp_path / "src",
            tmp_path / "out",
            hub=HubSettings(repo_id="me/x"),
            calibrate=False,
            progress=False,
            log=quiet,
            verify="plugin",
        )
    assert not (tmp_path / "out").exists() and leftovers(tmp_path) == []


# --------------------------------------------------------------------------------------------------------------------
# command line
# --------------------------------------------------------------------------------------------------------------------
def test_cli_push_dry_run_and_errors(converted, no_token, capsys):
    assert cli_main(["push", str(converted.path), "me/my-model", "--dry-run", "--private"]) == 0
    out = capsys.readouterr().out
    assert "would upload to me/my-model as a private repo" in out and "  model.safetensors" in out
    assert '"license": "apache-2.0"' in out
    assert cli_main(["push", str(converted.path), "me/my-model"]) == 2
    assert "error: no Hugging Face token" in capsys.readouterr().err


def test_cli_convert_help_explains_every_option(capsys):
    with pytest.raises(SystemExit):
        cli_main(["convert", "--help"])
    text = capsys.readouterr().out
    for option in (
        "--scheme",
        "--norm",
        "--softcap",
        "--eps",
        "--p",
        "--calibration-text",
        "--eval-text",
        "--no-calibration",
        "--steps",
        "--export",
        "--overwrite",
        "--push-to-hub",
        "--private",
        "--revision",
        "--commit-message",
        "--token",
        "examples:",
    ):
        assert option in text


@pytest.mark.spawns
def test_cli_convert_errors_and_success(tmp_path, capsys, monkeypatch):
    save_source(tmp_path / "src")
    assert cli_main(["convert", str(tmp_path / "src"), str(tmp_path / "o"), "--softcap", "0"]) == 2
    assert "softcap must be a positive" in capsys.readouterr().err
    assert cli_main(["convert", str(tmp_path / "nowhere"), str(tmp_path / "o")]) == 2
    assert "source folder not found" in capsys.readouterr().err
    monkeypatch.chdir(tmp_path)
    assert (
        cli_main(
            [
                "convert",
                str(tmp_path / "src"),
                "--no-calibration",
                "--quiet",
                "--scheme",
                "qk_norm",
                "--norm",
                "rmsnorm",
            ]
        )
        == 0
    )
    assert "as qwen3" in capsys.readouterr().out
    assert (tmp_path / "converted" / "src-qk_norm-rmsnorm" / "config.json").is_file()
    assert (
        cli_main(
            [
                "convert",
                str(tmp_path / "src"),
                "--no-calibration",
                "--quiet",
                "--scheme",
                "qk_norm",
                "--norm",
                "rmsnorm",
            ]
        )
        == 2
    )
    assert "already exists" in capsys.readouterr().err
    assert os.listdir(tmp_path / "converted") == ["src-qk_norm-rmsnorm"]


def _report(**changes):
    """A calibration report of a one-layer model (perplexities 10 -> 10.2), ``changes`` applied."""
    from hf_qknorm.conversion.calibration.calibrate import CalibrationReport, LayerStats

    fields = dict(
        scheme={"scheme": "soft_cap"},
        ppl_original=10.0,
        ppl_identity=10.2,
        ppl_least_squares=10.2,
        ppl_calibrated=10.2,
        calibration_tokens=100,
        eval_tokens=50,
        steps=0,
        kl_start=None,
        kl_end=None,
        seconds=0.1,
        layers=[LayerStats(0, [1.0], [1.0], [1.0], 30.0, 30.0)],
        cap=50.0,
    )
    return CalibrationReport(**{**fields, **changes})


def test_soft_cap_card_says_there_is_nothing_to_initialise():
    report = _report()
    card = build_model_card(base_model=None, cfg=QKNormConfig("soft_cap"), export="qknorm", report=report)
    assert "adds no weights" in card.text and "10.000" in card.text and "least-squares" not in card.text
    assert "nothing to calibrate" in report.summary() and "identity init" not in report.summary()


def test_convert_push_to_hub_uploads_the_written_folder(tmp_path, monkeypatch):
    import huggingface_hub

    save_source(tmp_path / "src")
    api = mock.Mock()
    api.create_commit.return_value = mock.Mock(commit_url="https://huggingface.co/me/x/commit/1")
    monkeypatch.setattr(huggingface_hub, "HfApi", lambda: api)
    result = hf_qknorm.convert(
        tmp_path / "src",
        tmp_path / "out",
        hub=HubSettings(repo_id="me/x", private=True, token="hf_tok"),
        calibrate=False,
        progress=False,
        log=quiet,
        verify="plugin",
    )
    assert result.pushed_url.endswith("/commit/1")
    assert sorted(_commit(api)) == sorted(result.files)
    assert api.create_repo.call_args.kwargs["private"] is True
    card = (result.path / "README.md").read_text()
    assert 'from_pretrained("me/x", trust_remote_code=True)' in card and _commit(api)["README.md"] == card.encode()


# --------------------------------------------------------------------------------------------------------------------
# names and strings from outside: escaped in Markdown, Python literals in the snippet, only ids in the metadata
# --------------------------------------------------------------------------------------------------------------------
HOSTILE_SOURCE = "<img src=x onerror=alert(1)>"
HOSTILE_DESTINATION = 'out"); import os; os.system("pwned"); ("`<script>alert(2)<b onmouseover=x>\n\n# Injected\u202e'
HOSTILE_README = (
    '---\nlicense: "<script>alert(3)</script>"\nlicense_name: "x\\n---\\ninjected: true"\n'
    'license_link: "javascript:alert(4)"\n---\n# source\n'
)


def _snippet_calls(card_text: str) -> tuple[list, set]:
    """The load snippet parsed as Python: the from_pretrained arguments (as values) and every imported module."""
    import ast

    code = card_text.split("```python\n", 1)[1].split("\n```", 1)[0]
    tree = ast.parse(code)
    calls = [
        ast.literal_eval(node.args[0])
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "from_pretrained"
    ]
    imports = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imports |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    return calls, imports


@pytest.fixture
def hostile(tmp_path):
    src = tmp_path / HOSTILE_SOURCE
    save_source(src, "llama")
    (src / "README.md").write_text(HOSTILE_README)
    return hf_qknorm.convert(
        src,
        tmp_path / HOSTILE_DESTINATION,
        config=QKNormConfig(scheme="qk_norm_cap"),
        calibrate=False,
        progress=False,
        log=quiet,
        verify="plugin",
    )


def test_card_escapes_hostile_names_and_licence(hostile):
    text = (hostile.path / "README.md").read_text()
    body = text.split("\n---\n", 1)[1]
    before, code = body.split("```python\n", 1)
    prose = before + code.split("\n```", 1)[1]  # the snippet holds the name as a Python string: checked below
    for raw in ("<img", "<script", "<b ", "\n# Injected", "\u202e", "javascript:"):
        assert raw not in prose and raw not in text.split("\n---\n", 1)[0], raw
    assert "&lt;img src=x onerror=alert\\(1\\)&gt;" in body and "&lt;script&gt;alert\\(2\\)&lt;b" in body
    assert "\\u202e" in body and "not a Hub licence id" in body
    calls, imports = _snippet_calls(text)
    # the source has no tokenizer, so the snippet loads the model only (two calls; the tokenizer call is left out)
    assert calls == [HOSTILE_DESTINATION] * 2 and imports == {"transformers", "hf_qknorm"}
    data = card_metadata(hostile.path)
    assert not {"license", "license_name", "license_link", "base_model", "injected"} & set(data)
    assert data["library_name"] == "transformers"


def test_card_renders_without_html(hostile):
    """Rendered as CommonMark with raw HTML allowed (what a Hub page may do), the card holds no tag from outside."""
    markdown_it = pytest.importorskip("markdown_it")
    text = (hostile.path / "README.md").read_text()
    rendered = markdown_it.MarkdownIt("commonmark", {"html": True}).render(text.split("\n---\n", 1)[1])
    assert "<img" not in rendered and "<script" not in rendered and "Injected</h1>" not in rendered
    assert rendered.count("<h1>") == 1 and "&lt;img src=x onerror=alert(1)&gt;" in rendered


def test_licence_that_is_an_id_is_inherited(tmp_path):
    save_source(tmp_path / "src", "llama")
    (tmp_path / "src" / "README.md").write_text(
        "---\nlicense: other\nlicense_name: my-licence-1.0\nlicense_link: LICENSE\n---\n"
    )
    result = hf_qknorm.convert(
        tmp_path / "src", tmp_path / "o", calibrate=False, progress=False, log=quiet, verify="plugin"
    )
    data = card_metadata(result.path)
    assert (data["license"], data["license_name"], data["license_link"]) == ("other", "my-licence-1.0", "LICENSE")
    assert "Licence: `other`, inherited" in (result.path / "README.md").read_text()


def test_push_names_the_repo_in_the_card_of_a_hostile_folder(hostile, monkeypatch):
    api = mock.Mock()
    api.create_commit.return_value = mock.Mock(commit_url="https://huggingface.co/me/m/commit/1")
    before = (hostile.path / "README.md").read_bytes()
    push(hostile.path, "me/m", token="hf_x", api=api)
    card = _commit(api)["README.md"].decode()
    calls, _ = _snippet_calls(card)
    assert (
        calls == ["me/m"] * 2 and "\n# me/m\n" in card
    )  # no tokenizer in the source: no tokenizer call and "<script" not in card
    assert (hostile.path / "README.md").read_bytes() == before


def test_push_of_an_older_folder_uses_its_name(converted):
    """Folders written before qknorm_conversion.json recorded the card's name: the folder name is the one used."""
    report = converted.path / "qknorm_conversion.json"
    report.write_text(json.dumps({k: v for k, v in json.loads(report.read_text()).items() if k != "card_model_name"}))
    card = card_for_repo(converted.path, "me/m")
    assert 'from_pretrained("me/m", trust_remote_code=True)' in card and '"my-model"' not in card
    assert card_for_repo(converted.path, "my-model") is None  # already right: uploaded as it is


def test_convert_with_an_invalid_repo_id_fails_before_any_work(tmp_path, monkeypatch):
    import hf_qknorm.conversion.orchestration.converter as converter

    monkeypatch.setattr(converter, "inspect_source", lambda *a: pytest.fail("the source was read"))
    for repo in ("not a repo", "a/b/c", "me/x--y", "-me/x"):
        with pytest.raises(ValueError, match=f"invalid Hub repo id {repo!r}"):
            hf_qknorm.convert(None, tmp_path / "o", hub=HubSettings(repo_id=repo), log=quiet)
    with pytest.raises(ValueError, match="invalid Hub repo id ''"):
        check_repo_id("")
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("identity, says", [(12.0, "removes 50.0%"), (9.5, "no increase to remove")])
def test_the_verdict_and_card_say_what_calibration_removed_or_that_there_was_nothing(identity, says):
    """Where the new norms at identity do not raise perplexity (a model whose own norms they start from) there is
    no increase to remove: said in words, never as ``nan%``, in the verdict and the model card alike."""
    report = _report(
        scheme={"scheme": "qk_norm", "norm": "rmsnorm"},
        ppl_identity=identity,
        ppl_calibrated=11.0 if identity > 10 else 9.9,
        cap=None,
    )
    assert says in report.verdict() and "nan" not in report.verdict()
    import json

    json.dumps(report.to_dict(), allow_nan=False)  # qknorm_conversion.json stays strict JSON
    card = str(
        build_model_card(base_model=None, cfg=QKNormConfig("qk_norm", norm="rmsnorm"), export="qknorm", report=report)
    )
    assert says.replace("50.0%", "**50.0%**") in card and "nan%" not in card
