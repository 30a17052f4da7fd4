"""Per-head views of the query and key projection weights: what Q/K learning rates and QK-Clip act on.

All heads of a layer share one projection weight, ``nn.Linear`` ``(out, in)`` or -- GPT-2's fused ``c_attn`` --
``transformers.Conv1D`` ``(in, out)`` whose Q, K and V are consecutive blocks of ``out``. Head ``h``'s rows are the
output channels ``[offset + h * head_dim, offset + (h + 1) * head_dim)``. GQA: key head ``g`` is read by query heads
``h`` with ``h // (heads // kv_heads) == g`` (Transformers' ``repeat_kv`` layout).

Sharded weights (FSDP2, tensor parallelism: ``DTensor``): every operation works on this rank's block
(:func:`hf_qknorm.modeling.sharding.local_part`) and maps each local output channel to its global head, so a head
whose rows are split between ranks is handled on both sides -- a ``Shard(0)`` of ``q_proj.weight`` splits rows, one
of GPT-2's ``Conv1D`` weight splits the input dimension (every rank then holds part of every head), and the bias is
split along its own length. Per-head norms are partial sums per rank, summed over the shard groups. The parameters
are looked up at each use, never cached: ``fully_shard`` and ``peft`` replace them after a controller is created.
"""

from __future__ import annotations

import torch
from torch import nn

from ..modeling.sharding import all_reduce_sum, is_dtensor, local_part
from .sites import num_heads


class HeadRows:
    """The output channels ``[offset, offset + heads * head_dim)`` of a projection, viewed per head.

    ``proj`` may be a ``peft`` LoRA layer: :attr:`weight`/:attr:`bias` are its base layer's, and the matching rows of
    each adapter's ``B`` (the delta ``B A x`` of head ``h`` lives in those rows) scale with them."""

    def __init__(self, proj: nn.Module, offset: int, heads: int, head_dim: int, conv1d: bool, where: str):
        self.proj = proj
        self.offset, self.heads, self.head_dim, self.conv1d, self.where = offset, heads, head_dim, conv1d, where
        self.dim = 1 if conv1d else 0  # the weight's output-channel dimension
        out_dim = self.weight.shape[self.dim]  # a DTensor's shape is the global one
        if out_dim < offset + heads * head_dim:
            raise NotImplementedError(
                f"{where}: the weight has {out_dim} output channels where {heads} heads of "
                f"{head_dim} need {offset + heads * head_dim} (sharded without DTensor?); "
                "per-head control needs whole weights or DTensor shards (FSDP2, "
                "tensor parallelism)"
            )

    @property
    def weight(self) -> torch.Tensor:
        return getattr(self.proj, "base_layer", self.proj).weight

    @property
    def bias(self) -> torch.Tensor | None:
        return getattr(getattr(self.proj, "base_layer", self.proj), "bias", None)

    def tensors(self, lora: bool = True) -> list[tuple[torch.Tensor, int, str]]:
        """``(tensor, output-channel dim, name)`` of the weight, the bias and (``lora``) every LoRA adapter's ``B``."""
        out = [(self.weight, self.dim, "weight")]
        if self.bias is not None:
            out.append((self.bias, 0, "bias"))
        if lora:
            out += [(b.weight, 0, f"lora_B.{name}") for name, b in getattr(self.proj, "lora_B", {}).items()]
        return out

    def _parts(self, lora: bool = True):
        """Per tensor: its local block, the channel dim, each local channel's head (clamped) and whether the channel
        belongs to one of these heads at all (GPT-2's fused ``c_attn`` holds the other roles' channels too)."""
        for tensor, dim, name in self.tensors(lora):
            part = local_part(tensor, f"{self.where} {name}")
            idx = part.indices(dim) - self.offset
            head = torch.div(idx, self.head_dim, rounding_mode="floor")
            valid = (idx >= 0) & (head < self.heads)
            yield part, dim, head.clamp(0, self.heads - 1), valid

    def check_at_rest(self, fsdp_owned: bool) -> None:
        """Refuse to edit a weight FSDP2 has gathered for a forward: the edit would be lost at the next reshard."""
        if fsdp_owned and not is_dtensor(self.weight):
            raise RuntimeError(
                f"{self.where}: FSDP2 holds this weight unsharded (between a forward and its "
                "backward?); call the training control after optimizer.step(), when parameters are "
                "sharded again"
            )

    # -- norms -------------------------------------------------------------------------------------------------------
    @torch.no_grad()
    def partial_sq_norms(self) -> tuple[torch.Tensor, tuple]:
        """This rank's share of each head's squared Frobenius norm (float64 ``(heads,)``) and the process groups to
        sum it over (none for a whole weight)."""
        part, dim, head, valid = next(self._parts(lora=False))
        local = part.tensor
        other = [d for d in range(local.dim()) if d != dim]
        sq = local.to(torch.float64).square().sum(dim=other) if other else local.to(torch.float64).square()
        out = torch.zeros(self.heads, dtype=torch.float64, device=local.device)
        return out.index_add_(0, head[valid], sq[valid]), part.groups

    def norms(self) -> torch.Tensor:
        """Per-head Frobenius norms of the weight, float64 ``(heads,)`` (one collective when sharded; use
        :func:`head_norms` for many layers at once)."""
        return head_norms([self])[0]

    # -- edits -------------------------------------------------------------------------------------------------------
    @torch.no_grad()
    def scale(self, factor: torch.Tensor) -> None:
        """Multiply each head's rows -- weight, bias and LoRA ``B`` -- by ``factor`` ``(heads,)``, in place: the
        head's output (its query or key) is then exactly ``factor_h`` times what it was. Channels of other heads or
        roles are multiplied by exactly 1."""
        for part, dim, head, valid in self._parts():
            t = part.tensor
            if t.numel() == 0:
                continue
            acc = torch.promote_types(t.dtype, torch.float32)
            f = torch.where(
                valid, factor.to(device=t.device, dtype=acc)[head], torch.ones((), dtype=acc, device=t.device)
            )
            t.copy_(t.to(acc) * f.view(_along(t, dim)))

    @torch.no_grad()
    def snapshot(self) -> list[torch.Tensor]:
        """Copies of this rank's weight and bias blocks (for :meth:`rescale_update`)."""
        return [part.tensor.clone() for part, *_ in self._parts(lora=False)]

    @torch.no_grad()
    def rescale_update(self, old: list[torch.Tensor], factor: torch.Tensor) -> None:
        """``W <- W_old + factor_h * (W - W_old)`` on each head's rows of the weight and bias; other channels are left
        exactly as they are."""
        for (part, dim, head, valid), before in zip(self._parts(lora=False), old):
            now = part.tensor
            if now.numel() == 0:
                continue
            acc = torch.promote_types(now.dtype, torch.float32)
            shape = _along(now, dim)
            f = factor.to(device=now.device, dtype=acc)[head].view(shape)
            new = before.to(acc) + (now.to(acc) - before.to(acc)) * f
            now.copy_(torch.where(valid.view(shape), new, now.to(acc)))

    def local_heads(self, seen: int) -> int:
        """The global index of the first of ``seen`` heads a forward ran on this rank: 0 when it ran all of them;
        under tensor parallelism, where this rank's rows of the weight start (they must be whole heads)."""
        if seen == self.heads:
            return 0
        part = local_part(self.weight, f"{self.where} weight")
        start, rows = part.start[self.dim] - self.offset, part.tensor.shape[self.dim]
        if start % self.head_dim or rows != seen * self.head_dim:
            raise RuntimeError(
                f"{self.where}: a forward ran {seen} of {self.heads} heads, but this rank's rows "
                f"[{start}, {start + rows}) of the weight are not those heads"
            )
        return start // self.head_dim


def _along(t: torch.Tensor, dim: int) -> list[int]:
    """A view shape that broadcasts a per-channel vector along ``dim`` of ``t``."""
    shape = [1] * t.dim()
    shape[dim] = -1
    return shape


def head_norms(rows: list[HeadRows]) -> list[torch.Tensor]:
    """Per-head Frobenius norms (float64 ``(heads,)``, on the CPU) of many :class:`HeadRows` at once: the partial
    sums of every sharded weight travel in one collective per group (not one per layer)."""
    partials = [r.partial_sq_norms() for r in rows]
    buckets: dict[tuple, list[int]] = {}
    for i, (_, groups) in enumerate(partials):
        buckets.setdefault(tuple(groups), []).append(i)
    out: list[torch.Tensor | None] = [None] * len(rows)
    for groups, members in buckets.items():
        flat = torch.cat([partials[i][0] for i in members])
        all_reduce_sum(flat, groups)
        for i, piece in zip(members, flat.cpu().split([rows[i].heads for i in members])):
            out[i] = piece.sqrt()
    return out


def layer_rows(site, config) -> tuple[HeadRows, HeadRows | None]:
    """``(W_Q rows, W_K rows)`` of one attention site; ``W_K rows`` is ``None`` for a layer that reuses an earlier
    layer's keys (Gemma 3n's and Gemma 4's KV-shared layers: no key projection of its own)."""
    attn, fam = site.module, site.family
    heads, kv_heads = num_heads(attn, config)
    d = attn.head_dim
    where = f"layer {site.index}"
    if fam.fused_layout == "per_head":
        raise NotImplementedError(
            f"{fam.model_type}'s fused {fam.qkv_proj} interleaves q, k and v per head; per-head Q/K rows of such a "
            "projection (QK-Clip on the projections, Q/K learning rates) are not supported"
        )
    if fam.fused_qkv:
        proj = getattr(attn, fam.qkv_proj)
        return (
            HeadRows(proj, 0, heads, d, fam.conv1d, where + " W_Q"),
            HeadRows(proj, heads * d, kv_heads, d, fam.conv1d, where + " W_K"),
        )
    return (
        HeadRows(getattr(attn, fam.q_proj), 0, heads, d, fam.conv1d, where + " W_Q"),
        None
        if getattr(attn, fam.k_proj, None) is None
        else HeadRows(getattr(attn, fam.k_proj), 0, kv_heads, d, fam.conv1d, where + " W_K"),
    )
