"""The PyTorch attention path (any device without the Triton kernels): memory linear in sequence length.

``sdpa`` cannot cap logits, and eager attention with a cap materialises several ``(batch, heads, q_len, kv_len)``
tensors and keeps them for backward (2 GiB at B=4, H=8, T=2048). :class:`ChunkedCappedAttention` instead walks the
queries in chunks, keeps only the output and the row log-sum-exp, and recomputes each chunk's probabilities in
backward -- FlashAttention's recomputation idea (Dao et al. 2022) at the granularity of PyTorch matmuls.
"""

from __future__ import annotations

import torch

# Elements of one (batch, heads, chunk, kv_len) logits tile: 2**21 fp32 elements = 8 MiB per live tile.
TILE_ELEMENTS = 1 << 21


def _chunk_rows(batch: int, heads: int, q_len: int, kv_len: int) -> int:
    rows = TILE_ELEMENTS // max(1, batch * heads * kv_len)
    return int(min(q_len, max(16, rows)))


def _key_range(start, end, q_len, kv_len, causal, sliding_window):
    """Keys that rows [start, end) can see at all: causal rows never see keys past their diagonal, windowed rows
    never see keys more than ``sliding_window`` behind -- the rest of the tile is skipped, not masked."""
    shift = kv_len - q_len
    lo, hi = 0, kv_len
    if causal:
        hi = max(0, min(kv_len, end + shift))
    if sliding_window is not None:
        lo = max(0, min(hi, start + shift - sliding_window + 1))
    return lo, hi


def chunk_allowed(mask, start, end, q_len, kv_len, causal, sliding_window, device, lo=0, hi=None):
    """Boolean (.., end-start, hi-lo) tile of allowed pairs for query rows [start, end) and keys [lo, hi), or
    ``None`` (all allowed).

    ``mask`` is a boolean ``(B|1, 1|H, q_len, kv_len)`` tensor (True = attend) or ``None``. Causality and the
    window are bottom-right aligned: row ``i`` is at absolute position ``i + kv_len - q_len``."""
    hi = kv_len if hi is None else hi
    ok = None
    if causal or sliding_window is not None:
        qi = torch.arange(start, end, device=device)[:, None] + (kv_len - q_len)
        kj = torch.arange(lo, hi, device=device)[None, :]
        if causal:
            ok = kj <= qi
        if sliding_window is not None:
            win = (qi - kj) < sliding_window
            ok = win if ok is None else ok & win
    if mask is not None:
        m = mask[..., start:end, lo:hi]
        ok = m if ok is None else ok & m
    return ok


def _capped_scores(qc, k, scaling, softcap):
    """``scaling * q k^T`` (capped in place when ``softcap``); also returns tanh(s/c) for backward's chain rule."""
    s = torch.matmul(qc, k.transpose(-1, -2)).mul_(scaling)
    if softcap is None:
        return s, None
    t = s.div_(softcap).tanh_()
    return t * softcap, t


class ChunkedCappedAttention(torch.autograd.Function):
    """``softmax(mask(c*tanh(scaling * q k^T / c))) v`` in query chunks, with recomputation in backward.

    Inputs: ``q`` ``(B, H, Tq, D)``; ``k``, ``v`` ``(B, H, Tk, D)`` (GQA heads already expanded by the caller);
    ``mask`` boolean broadcastable to ``(B, H, Tq, Tk)`` or ``None``; ``softcap`` a float or ``None``. Accumulates in
    float32 for half-precision inputs (float64 stays float64). Rows with no allowed key give zeros. Live memory is
    a few ``(B, H, chunk, Tk)`` tiles of ``TILE_ELEMENTS`` elements, whatever the sequence length.
    """

    @staticmethod
    def forward(ctx, q, k, v, mask, scaling, softcap, causal, sliding_window, dropout_p, seed):
        acc = torch.float64 if q.dtype == torch.float64 else torch.float32
        b, h, tq, _ = q.shape
        tk = k.shape[2]
        kf, vf = k.to(acc), v.to(acc)
        out = torch.zeros(q.shape, dtype=acc, device=q.device)
        lse = torch.full((b, h, tq), float("-inf"), dtype=acc, device=q.device)
        rows = _chunk_rows(b, h, tq, tk)
        for start in range(0, tq, rows):
            end = min(start + rows, tq)
            lo, hi = _key_range(start, end, tq, tk, causal, sliding_window)
            if hi <= lo:
                continue
            s, _ = _capped_scores(q[:, :, start:end].to(acc), kf[:, :, lo:hi], scaling, softcap)
            ok = chunk_allowed(mask, start, end, tq, tk, causal, sliding_window, q.device, lo, hi)
            if ok is not None:
                s.masked_fill_(~ok, float("-inf"))
            m = s.amax(-1, keepdim=True)
            m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
            p = s.sub_(m).exp_()
            l = p.sum(-1, keepdim=True)
            p.div_(l.clamp_min(torch.finfo(acc).tiny))
            lse[:, :, start:end] = (m + torch.log(l)).squeeze(-1)
            if dropout_p > 0:
                p.mul_(_keep(p.shape, dropout_p, seed, start, p.device, acc))
            out[:, :, start:end] = torch.matmul(p, vf[:, :, lo:hi])
        ctx.save_for_backward(q, k, v, out, lse, mask)
        ctx.args = (scaling, softcap, causal, sliding_window, dropout_p, seed, rows)
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, mask = ctx.saved_tensors
        scaling, softcap, causal, sliding_window, dropout_p, seed, rows = ctx.args
        acc = out.dtype
        tq, tk = q.shape[2], k.shape[2]
        kf, vf, do = k.to(acc), v.to(acc), dout.to(acc)
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        dk = torch.zeros(k.shape, dtype=acc, device=q.device)
        dv = torch.zeros(v.shape, dtype=acc, device=q.device)
        delta = (do * out).sum(-1, keepdim=True)  # rowsum(P o dP) = rowsum(dO o O), dropout included
        for start in range(0, tq, rows):
            end = min(start + rows, tq)
            lo, hi = _key_range(start, end, tq, tk, causal, sliding_window)
            if hi <= lo:
                continue
            qc, doc, kc, vc = q[:, :, start:end].to(acc), do[:, :, start:end], kf[:, :, lo:hi], vf[:, :, lo:hi]
            s, t = _capped_scores(qc, kc, scaling, softcap)
            lse_c = lse[:, :, start:end, None]
            p = s.sub_(torch.where(torch.isfinite(lse_c), lse_c, torch.zeros_like(lse_c))).exp_()
            ok = chunk_allowed(mask, start, end, tq, tk, causal, sliding_window, q.device, lo, hi)
            if ok is not None:
                p.masked_fill_(~ok, 0.0)
            dp = torch.matmul(doc, vc.transpose(-1, -2))
            if dropout_p > 0:
                keep = _keep(p.shape, dropout_p, seed, start, p.device, acc)
                dv[:, :, lo:hi] += torch.matmul((p * keep).transpose(-1, -2), doc)
                dp.mul_(keep)
            else:
                dv[:, :, lo:hi] += torch.matmul(p.transpose(-1, -2), doc)
            ds = dp.sub_(delta[:, :, start:end]).mul_(p)
            if t is not None:
                ds.mul_(t.mul_(t).neg_().add_(1))  # d/ds of c*tanh(s/c) = 1 - tanh^2
            dq[:, :, start:end] = torch.matmul(ds, kc).mul_(scaling)
            dk[:, :, lo:hi] += torch.matmul(ds.transpose(-1, -2), qc).mul_(scaling)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, None, None, None


def _keep(shape, dropout_p, seed, start, device, dtype):
    """The scaled dropout keep-mask of one chunk, regenerated identically in backward from ``(seed, start)``."""
    gen = torch.Generator(device=device)
    gen.manual_seed(int(seed) * 1_000_003 + start)
    keep = torch.rand(shape, generator=gen, device=device) >= dropout_p
    return keep.to(dtype) / (1.0 - dropout_p)


def chunked_attention(q, k, v, *, scaling, softcap=None, mask=None, causal=True, sliding_window=None,
                      dropout_p=0.0):
    """Attention with an optional cap whose memory grows linearly with sequence length.

    ``q`` ``(B, H, Tq, D)``; ``k``, ``v`` ``(B, Hkv, Tk, D)``; returns ``(B, H, Tq, D)``."""
    groups = q.shape[1] // k.shape[1]
    if groups > 1:  # expand (a view) then reshape: autograd sums dk/dv over each group
        k = k[:, :, None].expand(-1, -1, groups, -1, -1).reshape(k.shape[0], -1, *k.shape[2:])
        v = v[:, :, None].expand(-1, -1, groups, -1, -1).reshape(v.shape[0], -1, *v.shape[2:])
    seed = int(torch.randint(0, 2**31 - 1, ()).item()) if dropout_p > 0 else 0
    return ChunkedCappedAttention.apply(q, k, v, mask, float(scaling), softcap, bool(causal), sliding_window,
                                        float(dropout_p), seed)
