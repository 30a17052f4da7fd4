"""The one reader of the library's on/off environment switches (:func:`hf_qknorm.kernels._env.switch`): its spellings,
the caller's default where unset, and the one-line refusal of anything else. Each switch's own tests check its
meaning (test_kernel_tanh, test_kernel_tma, test_norm_kernels, tests/attention/test_native, tests/cli/test_cli)."""

from __future__ import annotations

import pytest

from hf_qknorm.kernels._env import switch


@pytest.mark.parametrize("value", ["1", "on", "true", "yes", "ON", " True ", "\tYes\n"])
def test_on(value):
    assert switch("HF_QKNORM_X", None, "-", {"HF_QKNORM_X": value}) is True


@pytest.mark.parametrize("value", ["0", "off", "false", "no", "OFF", " False ", "No "])
def test_off(value):
    assert switch("HF_QKNORM_X", None, "-", {"HF_QKNORM_X": value}) is False


@pytest.mark.parametrize("default", [None, True, False])
def test_unset_or_empty_is_the_callers_default(default):
    for environ in ({}, {"HF_QKNORM_X": ""}, {"HF_QKNORM_X": "  "}):
        assert switch("HF_QKNORM_X", default, "-", environ) is default


@pytest.mark.parametrize("value", ["maybe", "2", "y", "onn", "tru e", "-1"])
def test_anything_else_is_refused_in_one_line(value):
    with pytest.raises(ValueError) as err:
        switch("HF_QKNORM_X", False, "what unset means", {"HF_QKNORM_X": value})
    assert str(err.value) == (
        f"HF_QKNORM_X={value!r} is not one of 0, off, false, no, 1, on, true, yes (or unset: what unset means)"
    )


def test_reads_the_process_environment_by_default(monkeypatch):
    monkeypatch.setenv("HF_QKNORM_X", "yes")
    assert switch("HF_QKNORM_X", False, "-") is True
    monkeypatch.delenv("HF_QKNORM_X")
    assert switch("HF_QKNORM_X", False, "-") is False
