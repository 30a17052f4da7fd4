"""Per-head views of the query and key projection weights: what Q/K learning rates and QK-Clip act on.

All heads of a layer share one projection weight, ``nn.Linear`` ``(out, in)`` or -- GPT-2's fused ``c_attn`` --
``transformers.Conv1D`` ``(in, out)`` whose Q, K and V are consecutive blocks of ``out``. Head ``h``'s rows are the
output channels ``[offset + h * head_dim, offset + (h + 1) * head_dim)``. GQA: key head ``g`` is read by query heads
``h`` with ``h // (heads // kv_heads) == g`` (Transformers' ``repeat_kv`` layout).
"""

from __future__ import annotations

import torch
from torch import nn

from .sites import num_heads


class HeadRows:
    """The output channels ``[offset, offset + heads * head_dim)`` of a projection, viewed per head.

    ``proj`` may be a ``peft`` LoRA layer: :attr:`weight`/:attr:`bias` are its base layer's, and
    :meth:`lora_b_views` gives the matching rows of each adapter's ``B`` (the delta ``B A x`` of head ``h`` lives in
    those rows)."""

    def __init__(self, proj: nn.Module, offset: int, heads: int, head_dim: int, conv1d: bool, where: str):
        self.proj = proj
        base = getattr(proj, "base_layer", proj)
        self.weight, self.bias = base.weight, getattr(base, "bias", None)
        self.offset, self.heads, self.head_dim, self.conv1d, self.where = offset, heads, head_dim, conv1d, where
        out_dim = self.weight.shape[1] if conv1d else self.weight.shape[0]
        if type(self.weight).__name__ == "DTensor" or out_dim < offset + heads * head_dim:
            raise NotImplementedError(f"{where}: sharded weights (FSDP) hold only part of each head's rows, so "
                                      "per-head control cannot act on them; use DDP")

    def w(self, t: torch.Tensor | None = None) -> torch.Tensor:
        """``(heads, head_dim, in)`` view of the weight (or of a tensor shaped like it)."""
        t = self.weight if t is None else t
        end = self.offset + self.heads * self.head_dim
        if self.conv1d:
            return t[:, self.offset:end].unflatten(1, (self.heads, self.head_dim)).permute(1, 2, 0)
        return t[self.offset:end].unflatten(0, (self.heads, self.head_dim))

    def b(self) -> torch.Tensor | None:
        """``(heads, head_dim)`` view of the bias, or ``None``."""
        if self.bias is None:
            return None
        return self.bias[self.offset:self.offset + self.heads * self.head_dim].view(self.heads, self.head_dim)

    def lora_b_views(self) -> list[torch.Tensor]:
        """``(heads, head_dim, r)`` views of every LoRA adapter's ``B`` weight (empty without adapters)."""
        views = []
        for lora_b in getattr(self.proj, "lora_B", {}).values():
            end = self.offset + self.heads * self.head_dim
            views.append(lora_b.weight[self.offset:end].unflatten(0, (self.heads, self.head_dim)))
        return views

    @torch.no_grad()
    def norms(self) -> torch.Tensor:
        """Per-head Frobenius norms of the weight, float64 ``(heads,)``."""
        return torch.linalg.vector_norm(self.w(), dim=(1, 2), dtype=torch.float64)

    @torch.no_grad()
    def scale(self, factor: torch.Tensor) -> None:
        """Multiply each head's rows -- weight, bias and LoRA ``B`` -- by ``factor`` ``(heads,)``, in place: the
        head's output (its query or key) is then exactly ``factor_h`` times what it was."""
        for view, shape in ((self.w(), (-1, 1, 1)), (self.b(), (-1, 1)),
                            *((v, (-1, 1, 1)) for v in self.lora_b_views())):
            if view is not None:
                acc = torch.promote_types(view.dtype, torch.float32)
                view.copy_(view.to(acc) * factor.to(device=view.device, dtype=acc).view(shape))


def layer_rows(site, config) -> tuple[HeadRows, HeadRows]:
    """``(W_Q rows, W_K rows)`` of one attention site."""
    attn, fam = site.module, site.family
    heads, kv_heads = num_heads(attn, config)
    d = attn.head_dim
    where = f"layer {site.index}"
    if fam.fused_qkv:
        proj = getattr(attn, fam.qkv_proj)
        return (HeadRows(proj, 0, heads, d, fam.conv1d, where + " W_Q"),
                HeadRows(proj, heads * d, kv_heads, d, fam.conv1d, where + " W_K"))
    return (HeadRows(getattr(attn, fam.q_proj), 0, heads, d, fam.conv1d, where + " W_Q"),
            HeadRows(getattr(attn, fam.k_proj), 0, kv_heads, d, fam.conv1d, where + " W_K"))
