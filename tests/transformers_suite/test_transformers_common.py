"""Transformers' own common model tests (``ModelTesterMixin``, ``ConfigTester``) on patched models.

One ``unittest.TestCase`` per family and variant (``variants.py``): ``Test_<family>_<variant>``. Baselines come
first, so a patched test's outcome can be compared with the baseline's in the same session (``conftest.py``).
CI runs :data:`variants.CI_VARIANTS`; ``HF_QKNORM_FULL_SUITE=1`` runs every variant. Transformers' test code comes
from the sdist of the installed version (``upstream_tests.py``); if the package index cannot be reached to fetch it,
every class here is skipped with that reason (and the session summary says so loudly).
"""

from __future__ import annotations

import contextlib
import functools
import unittest
import zlib

import pytest
import transformers

import hf_qknorm  # noqa: F401  (registers the backend and the qknorm_<base> model types, as a user's import does)
from tests.transformers_suite import upstream_tests
from tests.transformers_suite.testers import make_tester
from tests.transformers_suite.variants import refused_up_front, selected_families, selected_variants

UPSTREAM = upstream_tests.load()

# Every head class a family has in Transformers' Auto mappings, plus GPT-2's double-heads model (which
# patch_model accepts too).
HEADS = {
    "llama": (
        "LlamaModel",
        "LlamaForCausalLM",
        "LlamaForSequenceClassification",
        "LlamaForQuestionAnswering",
        "LlamaForTokenClassification",
    ),
    "mistral": (
        "MistralModel",
        "MistralForCausalLM",
        "MistralForSequenceClassification",
        "MistralForQuestionAnswering",
        "MistralForTokenClassification",
    ),
    "qwen2": (
        "Qwen2Model",
        "Qwen2ForCausalLM",
        "Qwen2ForSequenceClassification",
        "Qwen2ForQuestionAnswering",
        "Qwen2ForTokenClassification",
    ),
    "qwen3": (
        "Qwen3Model",
        "Qwen3ForCausalLM",
        "Qwen3ForSequenceClassification",
        "Qwen3ForQuestionAnswering",
        "Qwen3ForTokenClassification",
    ),
    "gpt2": (
        "GPT2Model",
        "GPT2LMHeadModel",
        "GPT2DoubleHeadsModel",
        "GPT2ForSequenceClassification",
        "GPT2ForQuestionAnswering",
        "GPT2ForTokenClassification",
    ),
}


def _heads_of(model_type: str) -> tuple[str, ...]:
    """Every head class ``model_type`` has in the Auto mappings patching supports (hf_qknorm's AUTO_HEADS)."""
    from transformers.models.auto import modeling_auto

    from hf_qknorm.portable.autoclasses import AUTO_HEADS

    names = [getattr(modeling_auto, m + "_NAMES").get(model_type) for _, m in AUTO_HEADS]
    return tuple(n for n in names if isinstance(n, str) and hasattr(transformers, n))


# Non-default sizes ConfigTester checks round trips of (Transformers' testers pass such values too).
CONFIG_TESTER_KWARGS = {"gpt2": {"n_embd": 64, "n_head": 4}}  # the others: DEFAULT_CONFIG_TESTER_KWARGS
DEFAULT_CONFIG_TESTER_KWARGS = {"hidden_size": 64, "num_attention_heads": 4}
NO_GENERATION_MIXIN = (
    "Transformers' GenerationTesterMixin (tests/generation/test_utils.py) is not in the sdist; "
    "generation is tested by tests/attention/test_generation_caches.py"
)


class _SubTestsUntilFailure:
    """Replaces ``unittest``'s ``subTest``: a failure inside a sub-test fails the whole test (one outcome per test,
    which is what the comparison with the baseline needs); a skip inside one skips only that sub-test, as in
    ``unittest``; a test whose sub-tests were all skipped is reported as skipped."""

    @contextlib.contextmanager
    def subTest(self, msg=None, **params):  # noqa: N802 (unittest's name)
        self._subtests[0] += 1
        try:
            yield
        except unittest.SkipTest as exc:
            self._subtests[1] += 1
            self._skip_reasons.append(str(exc))


def _counting_subtests(test):
    @functools.wraps(test)
    def run(self, *args, **kwargs):
        self._subtests, self._skip_reasons = [0, 0], []
        test(self, *args, **kwargs)
        entered, skipped = self._subtests
        if entered and entered == skipped:
            raise unittest.SkipTest("; ".join(dict.fromkeys(self._skip_reasons)))

    return run


class _SuiteCase(_SubTestsUntilFailure):
    """What every generated class adds to ``ModelTesterMixin``: the tester, ``ConfigTester``, seeding."""

    family: str
    variant = None
    _tester_class = None

    def setUp(self):
        # The same seed for the same test on every variant: baseline and patched models see the same inputs.
        seed = zlib.crc32(f"{self.family}:{self._testMethodName}".encode())
        transformers.set_seed(seed)
        UPSTREAM.modeling.global_rng.seed(seed)
        self.model_tester = self._tester_class(self, self.variant)
        qknorm = getattr(self.model_tester.get_config(), "qknorm", None)
        extra = {} if qknorm is None else {"qknorm": qknorm}
        self.config_tester = UPSTREAM.configuration.ConfigTester(
            self,
            config_class=self.model_tester.config_class(),
            **CONFIG_TESTER_KWARGS.get(self.family, DEFAULT_CONFIG_TESTER_KWARGS),
            **extra,
        )

    def test_config(self):
        self.config_tester.run_common_tests()

    def test_generation_tester_mixin_inheritance(self):
        self.skipTest(NO_GENERATION_MIXIN)

    def _prepare_for_class(self, inputs_dict, model_class, return_labels=False):
        inputs = super()._prepare_for_class(inputs_dict, model_class, return_labels=return_labels)
        if return_labels and model_class.__name__.endswith("GPT2DoubleHeadsModel"):
            # Its multiple-choice head: inputs of shape (batch, choices, seq), one label per row.
            import torch

            t = self.model_tester
            ids = inputs["input_ids"].unsqueeze(1).expand(-1, t.num_choices, -1).contiguous()
            inputs.update(
                input_ids=ids,
                labels=ids,
                attention_mask=None,
                mc_token_ids=torch.zeros(t.batch_size, t.num_choices, dtype=torch.long),
                mc_labels=torch.zeros(t.batch_size, dtype=torch.long),
            )
        return inputs


def _under_base_name(cls: type, base: type) -> type:
    """``cls`` (a ``QKNorm<Head>``) as a subclass that only carries ``base``'s name. ``ModelTesterMixin`` picks
    labels and skips heads by class name (``model_class.__name__ in MODEL_FOR_..._MAPPING_NAMES``), as Transformers'
    mappings are keyed by name; under its own name a patched head would get no labels and a base model would be
    trained. Nothing else is changed (checked by ``test_suite_harness.py``)."""
    if cls.__name__ == base.__name__:
        return cls
    return type(base.__name__, (cls,), {"__module__": cls.__module__, "__qualname__": base.__name__})


def _make_case(family: str, variant) -> type:
    name = f"Test_{family}_{variant.name.replace('-', '_').replace('.', '_')}"
    tester = make_tester(family)
    bases = [getattr(transformers, head) for head in HEADS.get(family) or _heads_of(family)]
    classes = tuple(_under_base_name(variant.model_class(base, family), base) for base in bases)
    attrs = {
        "family": family,
        "variant": variant,
        "_tester_class": tester,
        "all_model_classes": classes,
        "__module__": __name__,
        "__qualname__": name,
    }
    # test_can_init_all_missing_weights runs only for models whose config file carries a copyright year >= 2023
    # (or with this flag): a QKNorm config is defined in hf_qknorm, so without the flag it would be skipped there
    # while the baseline runs it. With the flag it runs on every family and variant.
    attrs["test_can_init_all_missing_weights_before_2023"] = True
    if family == "gpt2":
        # GPT2DoubleHeadsModel's `.loss` is its LM loss; the multiple-choice head learns from `mc_loss`, so it gets
        # no gradient in the gradient-checkpointing tests (unpatched too).
        attrs["test_all_params_have_gradient"] = False
    cls = type(name, (_SuiteCase, UPSTREAM.modeling.ModelTesterMixin, unittest.TestCase), attrs)
    for attr in dir(cls):
        if attr.startswith("test_") and callable(getattr(cls, attr)):
            setattr(cls, attr, _counting_subtests(getattr(cls, attr)))
    return cls


if UPSTREAM.unavailable is None:
    for _variant in selected_variants():  # baselines first
        for _family in selected_families():
            if refused_up_front(_family, _variant):
                continue  # patch_model refuses this scheme for this model type, with the reason (coverage table)
            _case = _make_case(_family, _variant)
            globals()[_case.__name__] = _case
    del _case, _variant, _family
else:

    @pytest.mark.skip(reason=f"Transformers {UPSTREAM.version}'s common tests are unavailable: {UPSTREAM.unavailable}")
    def test_transformers_common_tests_unavailable():
        """Stands for the whole suite when its sources could not be fetched (the summary prints a banner)."""
