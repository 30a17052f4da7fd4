"""Sharded and wrapped models: what every part of the package that touches weights across processes needs to know.

One place for it (the patch, QK-Clip, the Q/K learning-rate rule and the monitor all ask here):

- :func:`local_part`: the block of a parameter this rank holds -- the whole tensor, or a ``DTensor``'s local shard
  with its offset in the global tensor. FSDP2 (``fully_shard``) and tensor parallelism (``parallelize_module``)
  both store weights as ``DTensor`` with ``Shard``/``Replicate`` placements; a shard is a contiguous block (torch's
  ``chunk`` rule: ``ceil(n / ranks)`` rows per rank, the last ones shorter or empty), so a head's rows may be split
  between two ranks. Placements with another layout (``_StridedShard``: FSDP2 on top of tensor parallelism) are
  refused by name rather than guessed at.
- :func:`all_reduce_sum`: sums per-rank partial reductions (e.g. partial per-head norms) over the process groups
  a tensor is split across.
- :func:`fsdp_owned`: whether FSDP2 owns a module's parameters (so that a plain tensor there means "unsharded for
  a forward", not "whole").
- :func:`refuse_distributed`: ``patch_model`` runs before a model is wrapped or sharded, never after (the norms
  it adds would not be synchronised across ranks: DDP and FSDP only manage the parameters they saw);
  :func:`refuse_engines`: the engines whose weights a per-head edit cannot reach (FSDP1, DeepSpeed).
- Tensor parallelism: :func:`parallelize_attention` shards every attention layer's Q/K/V column-wise and its output
  row-wise (heads split across ranks) and makes the per-head norms' gradients correct (:func:`sync_norm_grads`);
  :func:`check_tensor_parallel` refuses layouts the training controls cannot act on, with what is supported.

``torch.distributed`` is imported only inside functions: ``import hf_qknorm`` stays cheap.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..portable import hooks
from ..portable.layout import attention_sites, num_heads, unwrap
from ..portable.names import NORM_SLOTS

_SYNCED = "_qknorm_grad_sync"  # set on a norm parameter whose gradient is summed over the tensor-parallel group
_TP_MARK = "_qknorm_tensor_parallel"  # set on an attention module by parallelize_attention: its mesh


def is_dtensor(t) -> bool:
    """Whether ``t`` is a ``torch.distributed.tensor.DTensor`` (checked by name: no import of torch.distributed)."""
    return any(c.__name__ == "DTensor" for c in type(t).__mro__)


def world_size() -> int:
    """The number of processes of the default group (1 without ``torch.distributed``)."""
    dist = torch.distributed
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


@dataclass(frozen=True)
class LocalPart:
    """The block of a (possibly sharded) tensor this rank holds.

    ``tensor`` is that block -- a view of the parameter's own storage, so in-place edits change the parameter;
    ``start[d]`` is its offset along dim ``d`` of the global tensor (whose shape is ``shape``); ``groups`` are the
    process groups the tensor is split across (sum a partial reduction over each of them to get the global one)."""

    tensor: torch.Tensor
    start: tuple[int, ...]
    shape: tuple[int, ...]
    groups: tuple

    def indices(self, dim: int) -> torch.Tensor:
        """Global indices, along ``dim``, of this block's entries (``long``, on the tensor's device)."""
        n = self.tensor.shape[dim]
        return torch.arange(self.start[dim], self.start[dim] + n, device=self.tensor.device)


def local_part(t: torch.Tensor, where: str = "tensor") -> LocalPart:
    """This rank's block of ``t``: ``t`` itself, or a ``DTensor``'s local shard (see the module docstring)."""
    if not is_dtensor(t):
        return LocalPart(t, (0,) * t.dim(), tuple(t.shape), ())
    from torch.distributed.tensor import Replicate, Shard

    mesh, shape = t.device_mesh, tuple(t.shape)
    start, size, groups = [0] * t.dim(), list(shape), []
    for mesh_dim, placement in enumerate(t.placements):
        if type(placement) is Replicate:
            continue
        if type(placement) is not Shard:  # _StridedShard (FSDP2 over TP), Partial, custom layouts
            raise NotImplementedError(
                f"{where}: DTensor placement {placement} is not supported by the per-head training controls "
                "(supported: Shard and Replicate on a 1-D or N-D mesh: FSDP2 alone, tensor parallelism alone, "
                "HSDP; not FSDP2 on top of tensor parallelism)"
            )
        d = placement.dim % t.dim()
        ranks, coord = mesh.size(mesh_dim), mesh.get_local_rank(mesh_dim)
        chunk = -(-size[d] // ranks)  # torch.chunk: ceil(n / ranks) per rank, the last ones shorter or empty
        lo = min(coord * chunk, size[d])
        start[d] += lo
        size[d] = min(lo + chunk, size[d]) - lo
        groups.append(mesh.get_group(mesh_dim))
    local = t.to_local()
    if list(local.shape) != size:
        raise RuntimeError(
            f"{where}: local shard of shape {tuple(local.shape)} where the placements "
            f"{t.placements} give {tuple(size)}; this sharding layout is not supported"
        )
    return LocalPart(local, tuple(start), shape, tuple(groups))


def all_reduce_sum(t: torch.Tensor, groups) -> torch.Tensor:
    """Sum ``t`` in place over each process group in ``groups`` (one collective per group); returns ``t``."""
    for group in groups:
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.SUM, group=group)
    return t


def collective_device(model: nn.Module) -> torch.device:
    """Where a collective's tensor must live: the model's device, or the current CUDA device under NCCL."""
    param = next(iter(unwrap(model).parameters()), None)
    device = param.device if param is not None else torch.device("cpu")
    dist = torch.distributed
    if dist.get_backend() == "nccl" and device.type != "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    return device


# --------------------------------------------------------------------------------------------------------------------
# who owns a module's parameters
# --------------------------------------------------------------------------------------------------------------------
def _fsdp_module_type():
    if not torch.distributed.is_available():
        return None
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch < 2.6
        return None
    return FSDPModule


def fsdp_owned(model: nn.Module, modules: list[nn.Module]) -> list[bool]:
    """For each of ``modules``, whether FSDP2 (``fully_shard``) manages its parameters: it or one of its ancestors in
    ``model`` is an ``FSDPModule``. One walk over the model for all of them."""
    fsdp = _fsdp_module_type()
    # the object given, not unwrap(model): fully_shard may sit on a wrapper's root (a peft model)
    named = list(model.named_modules()) if fsdp is not None else []
    owners = [name for name, m in named if isinstance(m, fsdp)] if named else []
    if not owners:
        return [False] * len(modules)
    names = {id(m): name for name, m in named}

    def owned(module):
        name = names.get(id(module))
        return name is not None and any(o == "" or name == o or name.startswith(o + ".") for o in owners)

    return [owned(m) for m in modules]


def refuse_distributed(model: nn.Module) -> None:
    """Refuse a model already wrapped by DDP / FSDP(1) or sharded by FSDP2 / tensor parallelism: ``patch_model`` adds
    parameters those would not synchronise (each rank's norms would train on its own data, silently)."""
    dist = torch.distributed
    if not dist.is_available():
        return
    from torch.nn.parallel import DistributedDataParallel

    fsdp2 = _fsdp_module_type()
    how = None
    inner = model
    for _ in range(16):  # the wrapper chain unwrap() walks
        if isinstance(inner, DistributedDataParallel):
            how = "wrapped by DistributedDataParallel"
        elif type(inner).__name__ == "FullyShardedDataParallel":
            how = "wrapped by FSDP"
        nxt = getattr(inner, "module", None) or getattr(inner, "_orig_mod", None)
        if not isinstance(nxt, nn.Module) or nxt is inner:
            break
        inner = nxt
    if how is None and fsdp2 is not None and any(isinstance(m, fsdp2) for m in model.modules()):
        how = "sharded by FSDP2 (fully_shard)"
    if how is None and any(is_dtensor(p) for p in model.parameters()):
        how = "sharded (DTensor parameters: tensor parallelism?)"
    if how is not None:
        raise ValueError(
            f"patch_model got a model already {how}: the norms it adds would not be synchronised "
            "across ranks. Patch first, then wrap or shard it (DDP, fully_shard, or "
            "hf_qknorm.parallelize_attention for tensor parallelism)"
        )


# --------------------------------------------------------------------------------------------------------------------
# tensor parallelism
# --------------------------------------------------------------------------------------------------------------------
def _norm_params(attn: nn.Module) -> list[tuple[str, nn.Parameter]]:
    out = []
    for slot in attn.__dict__.get("_qknorm_norms", {}).values() or NORM_SLOTS:
        norm = attn._modules.get(slot)
        if isinstance(norm, nn.Module):
            out += [(f"{slot}.{n}", p) for n, p in norm.named_parameters()]
    return out


def sync_norm_grads(model: nn.Module, group=None) -> int:
    """Sum the gradients of every attention layer's q/k/v norm parameters over ``group`` (the tensor-parallel
    group), once per backward. Returns how many parameters got the hook (already-synced ones are skipped).

    Why: a per-head norm's weight is shared by all heads, but under tensor parallelism each rank runs only its own
    heads, so each rank's gradient covers part of them. The hook sits on the gradient *before* it is accumulated into
    ``.grad`` (``Tensor.register_hook``), so gradient accumulation over micro-batches sums each micro-batch once."""
    import torch.distributed as dist

    count = 0
    for site in attention_sites(model):
        for _, param in _norm_params(site.module):
            if not param.requires_grad or getattr(param, _SYNCED, None) is not None:
                continue

            def hook(grad, group=group):
                grad = grad.clone()
                dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=group)
                return grad

            param.register_hook(hook)
            setattr(param, _SYNCED, group if group is not None else "default")
            count += 1
    return count


def parallelize_attention(model: nn.Module, mesh) -> nn.Module:
    """Tensor-parallel attention: every layer's Q, K, V projections column-wise and its output projection row-wise
    on the 1-D device mesh ``mesh`` (torch's ``parallelize_module``), so each rank runs ``heads / ranks`` query heads
    and ``kv_heads / ranks`` key/value heads; the per-head norms (patched, or Qwen3's own) stay whole on every rank
    and their gradients are summed over the mesh (:func:`sync_norm_grads`). Patch the model first. Returns ``model``.

    Refused, with the reason: a fused Q/K/V projection (GPT-2's ``Conv1D`` ``c_attn``: column-wise sharding would
    hand one rank the queries and another the keys), heads or key/value heads not divisible by the mesh size, a
    ``peft``-wrapped projection, a mesh of more than one dimension. Parallelise the MLP yourself as usual
    (``parallelize_module``); it does not interact with the attention."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    if mesh.ndim != 1:
        raise ValueError(
            f"parallelize_attention takes a 1-D tensor-parallel mesh, got {mesh.ndim} dimensions "
            "(pass mesh['tp'] of a 2-D mesh)"
        )
    sites = attention_sites(model)
    fam, config, ranks = sites[0].family, unwrap(model).config, mesh.size()
    if fam.fused_qkv:
        raise NotImplementedError(
            f"tensor parallelism of {fam.model_type}'s fused {fam.qkv_proj} is not supported "
            "(column-wise sharding of a fused Q/K/V projection would give one rank the queries "
            "and another the keys); use FSDP2 or DDP for this family"
        )
    counts = ((site, *num_heads(site.module, config)) for site in sites)  # a layer may have its own (Laguna's)
    bad = next(((site, h, kv) for site, h, kv in counts if h % ranks or kv % ranks), None)
    if bad is not None:
        site, heads, kv_heads = bad
        where = f"layer {site.index} of this model has" if len(sites) > 1 else "this model has"
        raise ValueError(
            f"tensor parallelism over {ranks} ranks needs heads and key/value heads divisible by "
            f"{ranks}; {where} {heads} heads and {kv_heads} key/value heads"
        )
    plan = {
        fam.q_proj: ColwiseParallel(),
        fam.k_proj: ColwiseParallel(),
        fam.v_proj: ColwiseParallel(),
        fam.out_proj: RowwiseParallel(),
    }
    for site in sites:
        attn = site.module
        # the projections the layer has: a KV-shared layer (Gemma 3n, Gemma 4) reads its store layer's keys and
        # values, whose heads that layer's sharding splits as its own queries' are; a k_eq_v layer has no v_proj
        own = {name: style for name, style in plan.items() if isinstance(getattr(attn, name, None), nn.Module)}
        if any(hasattr(getattr(attn, name), "base_layer") for name in own):
            raise NotImplementedError(
                f"layer {site.index}: a peft-wrapped projection cannot be tensor-parallelised "
                "here; apply LoRA under FSDP2 or DDP instead"
            )
        parallelize_module(attn, mesh, own)
        hooks.use_forward_hooks(attn)  # the norms must see the local tensor TP's output hooks make of the DTensor
        attn.__dict__[_TP_MARK] = mesh
    sync_norm_grads(model, mesh.get_group())
    return model


def _tensor_parallel(site, owned_by_fsdp: bool) -> bool:
    """Whether ``site``'s projections are tensor-parallel: their weights are ``DTensor`` while no FSDP2 module
    manages them (FSDP2 gathers whole weights for the forward; tensor parallelism never does)."""
    fam, attn = site.family, site.module
    proj = getattr(attn, fam.qkv_proj if fam.fused_qkv else fam.q_proj)
    weight = getattr(getattr(proj, "base_layer", proj), "weight", None)
    return is_dtensor(weight) and not owned_by_fsdp


def refuse_engines(model: nn.Module, what: str, training_args=None) -> None:
    """Refuse the engines whose weights a per-head weight edit (QK-Clip, the Q/K rule) cannot reach correctly:

    - FSDP version 1 (``FullyShardedDataParallel``): its flat parameters leave the modules' weights as views of freed
      storage between forwards (reading them crashed the process in our test); use FSDP2 (``fully_shard``);
    - DeepSpeed: ZeRO keeps its own fp32 master weights in the optimizer (ZeRO-3 also partitions the parameters), so
      an edit of the model's weights is overwritten at the next step -- the failure Megatron-LM's QK-Clip had under
      its distributed optimizer (PR #7382). DeepSpeed is not installed where this package is tested.

    ``training_args``: a ``TrainingArguments`` (a Trainer hands its callbacks the bare model, not the engine)."""
    chain, inner = [], model
    for _ in range(16):
        chain.append(type(inner).__name__)
        nxt = getattr(inner, "module", None) or getattr(inner, "_orig_mod", None)
        if not isinstance(nxt, nn.Module) or nxt is inner:
            break
        inner = nxt
    names = set(chain) | {type(m).__name__ for m in unwrap(model).modules()}
    if "FullyShardedDataParallel" in names:
        raise NotImplementedError(
            f"{what} does not support FSDP version 1 (FullyShardedDataParallel: flat "
            "parameters hide each head's rows); shard with FSDP2 (torch.distributed.fsdp."
            "fully_shard) instead"
        )
    deepspeed = training_args is not None and bool(getattr(training_args, "deepspeed", None))
    if deepspeed or "DeepSpeedEngine" in names or any(hasattr(p, "ds_id") for p in unwrap(model).parameters()):
        raise NotImplementedError(
            f"{what} does not support DeepSpeed: ZeRO keeps its own fp32 master copy of the "
            "weights (ZeRO-3 also partitions them), which a rescale of the model's weights "
            "would not reach; use DDP, FSDP2 or tensor parallelism"
        )


def check_tensor_parallel(model: nn.Module) -> list[bool]:
    """Per attention site, whether it is tensor-parallel; refuses the tensor-parallel layouts the training controls
    cannot act on: a fused Q/K/V projection, and per-head norms whose gradients are not summed over the group (each
    rank would train them on its own heads only)."""
    out = []
    sites = attention_sites(model)
    for site, owned in zip(sites, fsdp_owned(model, [s.module for s in sites])):
        tp = _tensor_parallel(site, owned)
        out.append(tp)
        if not tp:
            continue
        if site.family.fused_qkv:
            raise NotImplementedError(
                f"layer {site.index}: tensor parallelism of a fused Q/K/V projection "
                f"({site.family.qkv_proj}) is not supported; use FSDP2 or DDP"
            )
        unsynced = [n for n, p in _norm_params(site.module) if p.requires_grad and getattr(p, _SYNCED, None) is None]
        if unsynced:
            raise ValueError(
                f"layer {site.index} is tensor-parallel but the gradients of {', '.join(unsynced)} are "
                "not summed across ranks (each rank would train them on its own heads): shard with "
                "hf_qknorm.parallelize_attention(model, mesh), or call "
                "hf_qknorm.modeling.sharding.sync_norm_grads(model, group) after parallelize_module"
            )
    return out
