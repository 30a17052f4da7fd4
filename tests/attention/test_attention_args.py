"""Arguments an attention function is handed that it could only compute wrongly are refused in one line, naming the
value and what is expected (masks.check_attention_args, run by the "qknorm" backend and by the shipped eager
attention); everything Transformers passes is still taken, and the check touches no tensor data (no device sync)."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from hf_qknorm.attention.interface import qknorm_attention_forward
from hf_qknorm.portable.eager import capped_eager_attention
from hf_qknorm.portable.masks import check_attention_args
from hf_qknorm.reference import attention_reference

B, H, HKV, TQ, TK, D = 2, 4, 2, 5, 7, 8


class _Mod(torch.nn.Module):
    is_causal = True


def _qkv(tq=TQ, tk=TK, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(B, H, tq, D, generator=g, dtype=torch.float64),
        torch.randn(B, HKV, tk, D, generator=g, dtype=torch.float64),
        torch.randn(B, HKV, tk, D, generator=g, dtype=torch.float64),
    )


FUNCTIONS = {"qknorm": qknorm_attention_forward, "eager": capped_eager_attention}

BAD_MASKS = {  # shape -> why it cannot be right for query (2, 4, 5, 8) and key (2, 2, 7, 8)
    "longer-than-the-keys": (B, 1, TQ, TK + 3),  # slicing it would silently pick columns; every path must refuse
    "shorter-than-the-keys": (B, 1, TQ, TK - 1),
    "another-batch": (3, 1, TQ, TK),
    "another-head-count": (B, 3, TQ, TK),
    "another-query-length": (B, 1, TQ + 1, TK),
    "three-dimensional": (B, TQ, TK),
}


@pytest.mark.parametrize("fn", list(FUNCTIONS))
@pytest.mark.parametrize("case", list(BAD_MASKS))
def test_a_mask_that_does_not_fit_is_refused(fn, case):
    q, k, v = _qkv()
    mask = torch.ones(BAD_MASKS[case], dtype=torch.bool)
    with pytest.raises(ValueError) as err:
        FUNCTIONS[fn](_Mod(), q, k, v, mask, scaling=0.3, softcap=5.0)
    message = str(err.value)
    assert "\n" not in message and str(tuple(mask.shape)) in message
    assert f"({B}|1, 1|{H}, {TQ}|1, {TK})" in message, message


@pytest.mark.parametrize("fn", list(FUNCTIONS))
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.uint8])
def test_an_integer_mask_is_refused(fn, dtype):
    """A 0/1 integer mask is ambiguous (attend = 1, or additive 0 = attend?): named, not guessed."""
    q, k, v = _qkv()
    mask = torch.ones(B, 1, TQ, TK, dtype=dtype)
    with pytest.raises(ValueError, match=rf"mask of dtype {dtype}: expected torch.bool .* or an additive"):
        FUNCTIONS[fn](_Mod(), q, k, v, mask, scaling=0.3)


@pytest.mark.parametrize("fn", list(FUNCTIONS))
@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"scaling": float("nan")}, r"scaling must be a finite number, got nan"),
        ({"scaling": float("inf")}, r"scaling must be a finite number, got inf"),
        ({"scaling": "0.25"}, r"scaling must be a finite number, got '0.25'"),
        ({"scaling": True}, r"scaling must be a finite number, got True"),
        ({"dropout": -0.1}, r"dropout must be a probability in \[0, 1\), got -0.1"),
        ({"dropout": 1.0}, r"dropout must be a probability in \[0, 1\), got 1.0"),
        ({"dropout": float("nan")}, r"dropout must be a probability in \[0, 1\), got nan"),
    ],
)
def test_scalar_arguments_are_checked(fn, kwargs, match):
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=match):
        FUNCTIONS[fn](_Mod(), q, k, v, None, **{"scaling": 0.3, **kwargs})


@pytest.mark.parametrize("window", [0, -4, 2.5, True])
def test_a_sliding_window_below_one_position_is_refused(window):
    """A window of 0 leaves no key at all (every row zeros); a fractional one has no meaning."""
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=rf"sliding_window must be a positive number of positions .* got {window!r}"):
        qknorm_attention_forward(_Mod(), q, k, v, None, scaling=0.3, sliding_window=window)


@pytest.mark.parametrize("fn", list(FUNCTIONS))
@pytest.mark.parametrize("shape", [(B, 1, TQ, TK), (1, 1, TQ, TK), (B, H, TQ, TK), (B, 1, 1, TK)])
def test_every_broadcastable_mask_is_taken_and_exact(fn, shape):
    """The shapes sdpa accepts (Transformers passes (batch, 1, q_len, kv_len)) keep working, against float64."""
    q, k, v = _qkv()
    g = torch.Generator().manual_seed(3)
    mask = torch.rand(shape, generator=g) > 0.3
    mask[..., 0] = True  # no empty row
    out = FUNCTIONS[fn](_Mod(), q, k, v, mask, scaling=0.3, softcap=2.0, dropout=0.0)[0]
    ref = attention_reference(q, k, v, scaling=0.3, softcap=2.0, causal=False, mask=mask)
    torch.testing.assert_close(out, ref.transpose(1, 2), rtol=1e-10, atol=1e-10)
    additive = torch.zeros(shape, dtype=torch.float64).masked_fill(~mask, float("-inf"))
    out = FUNCTIONS[fn](_Mod(), q, k, v, additive, scaling=1, softcap=2.0)[0]  # an int scaling is a number too
    ref = attention_reference(q, k, v, scaling=1.0, softcap=2.0, causal=False, mask=mask)
    torch.testing.assert_close(out, ref.transpose(1, 2), rtol=1e-10, atol=1e-10)


def test_the_check_touches_no_tensor_data():
    """It runs per layer per forward: metadata only (shape, dtype), so no kernel and no device sync."""
    q, k, _ = _qkv()
    mask = torch.ones(B, 1, TQ, TK, dtype=torch.bool)

    class Ops(TorchDispatchMode):
        seen: list = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.seen.append(func)
            return func(*args, **(kwargs or {}))

    with Ops() as ops:
        check_attention_args(q, k, mask, 0.3, 0.0, 4)
        check_attention_args(q, k, None, 0.3, 0.1, None)
    assert ops.seen == []
