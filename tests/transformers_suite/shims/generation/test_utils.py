"""Stand-in for Transformers' ``tests/generation/test_utils.py`` (not in the sdist).

``GenerationTesterMixin`` there holds Transformers' ``generate`` tests. Only the name is needed to import
``test_modeling_common``; no generation test comes from here. The suite's test classes do not inherit this class and
skip ``test_generation_tester_mixin_inheritance`` with that reason; the generation behaviours are tested by
``tests/attention/test_generation_caches.py``.
"""


class GenerationTesterMixin:
    """Empty: Transformers' generation tests are not available from the sdist."""
