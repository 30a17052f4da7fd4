"""Stand-in for Transformers' ``tests/exporters/test_export.py`` (not in the sdist).

``ModelTesterMixin`` inherits ``ExportTesterMixin``, whose ``torch.export`` tests therefore do not run here.
"""


class ExportTesterMixin:
    """Empty: Transformers' export tests are not available from the sdist."""
