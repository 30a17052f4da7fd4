"""The mask / logit rule has one home, :func:`hf_qknorm.portable.masks.resolve_mask`: the backend, the telemetry and
calibration's statistics all follow it, over the attention's own tiles. Expected values are written from the rule
(top-left causal without a mask, a mask complete) in float64 here."""

from __future__ import annotations

import pytest
import torch

from hf_qknorm.attention import tiles
from hf_qknorm.conversion.calibration import stats
from hf_qknorm.modeling import telemetry
from hf_qknorm.portable.masks import allowed_pairs, resolve_mask


def _reference_max(q, k, allowed):
    groups = q.shape[1] // k.shape[1]
    s = q.double() @ k.double().repeat_interleave(groups, 1).transpose(-1, -2)
    return s.masked_fill(~allowed, float("-inf")).amax(dim=(0, 2, 3))


@pytest.mark.parametrize(
    "has_mask,q_len,kv_len,causal,expected",
    [
        (False, 5, 5, True, (True, 5)),  # plain causal
        (False, 5, 9, True, (True, 5)),  # prefill into an empty static cache: the empty slots are never seen
        (False, 1, 9, True, (False, 9)),  # one query sees every key
        (False, 5, 5, False, (False, 5)),  # is_causal=False
        (True, 5, 9, True, (False, 9)),  # a mask is complete
    ],
)
def test_resolve_mask(has_mask, q_len, kv_len, causal, expected):
    mask = torch.ones(1, 1, q_len, kv_len, dtype=torch.bool) if has_mask else None
    got_mask, got_causal, keys = resolve_mask(mask, q_len, kv_len, causal)
    assert (got_causal, keys) == expected
    assert (got_mask is not None) == has_mask
    pairs = allowed_pairs(mask, q_len, kv_len, causal)
    if got_causal:  # the implicit pattern: key j <= query i, top-left
        want = torch.arange(kv_len)[None, :] <= torch.arange(q_len)[:, None]
        assert torch.equal(pairs[0, 0], want)


def test_an_additive_mask_is_read_as_its_allowed_pairs():
    additive = torch.zeros(1, 1, 2, 3)
    additive[..., 0, 2] = float("-inf")
    mask, causal, keys = resolve_mask(additive, 2, 3, True)
    assert not causal and keys == 3
    assert mask.tolist() == [[[[True, True, False], [True, True, True]]]]


def test_telemetry_uses_the_attention_tiles():
    """One tile size: the telemetry's chunks are the attention's tiles (it had its own, four times larger)."""
    assert telemetry.TILE_ELEMENTS == tiles.TILE_ELEMENTS


@pytest.mark.parametrize("kv_len", [7, 11])
def test_telemetry_and_calibration_follow_the_rule(kv_len):
    """No mask, causal: top-left -- the keys past the last query (a static cache's empty slots) never count."""
    torch.manual_seed(0)
    q = torch.randn(2, 4, 7, 8, dtype=torch.float64)
    k = torch.randn(2, 2, kv_len, 8, dtype=torch.float64)
    k[:, :, 7:] = 100.0  # would dominate every maximum if the empty slots were counted
    allowed = torch.arange(kv_len)[None, :] <= torch.arange(7)[:, None]
    want = _reference_max(q, k, allowed) * 0.5
    got = telemetry.head_max_logits(q, k, None, scaling=0.5, causal=True)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    maxima = [s.amax(dim=(0, 3, 4)).reshape(-1) for s, _ in telemetry.logit_tiles(q, k, None, scaling=0.5, causal=True)]
    torch.testing.assert_close(torch.stack(maxima).amax(0), want, rtol=1e-12, atol=1e-12)


def test_calibration_max_logit_is_signed_like_the_converted_one():
    """``max_logit_original`` is the largest signed logit, as ``max_logit_converted`` (which the telemetry gives) and
    the cap warning compares them: a strongly negative logit is not a large one."""
    torch.manual_seed(1)
    q = torch.randn(1, 2, 6, 4, dtype=torch.float64)
    k = torch.randn(1, 2, 6, 4, dtype=torch.float64)
    q[..., 3, :] = -50 * k[..., 0, :]  # one pair with a logit of about -50 * |k|^2
    allowed = torch.arange(6)[None, :] <= torch.arange(6)[:, None]
    want = float(_reference_max(q, k, allowed).max()) * 0.25
    assert stats.max_logit(q, k, 0.25) == pytest.approx(want, rel=1e-6)
    s = (q @ k.transpose(-1, -2) * 0.25).masked_fill(~allowed, 0.0)
    assert s.abs().max() > 2 * want  # |s| would have reported the negative pair
