"""The self-check of a patched vision encoder (``patch_model(vlm, ..., vision=...)``): one probe call per attention
module that refuses an encoder on which the norms would not reach the attention backend exactly.

Each attention module is called on a few random rows with a recorder in front of the backend. It must call the
attention interface exactly once, with the query and key the backend receives equal to the scheme's norm of each head
of ``q_proj``/``k_proj``'s output (nothing between them but the split into heads: no rotation, no scaling, no second
norm), the value ``v_proj``'s own heads, no mask and ``is_causal`` false (bidirectional), the module's own scaling,
and no cap but the one the vision settings name. The attention is then run forward and backward on the backend it
will run on. A model on the ``meta`` device is not checked (there is nothing to run).
"""

from __future__ import annotations

import contextlib

import torch

from ..portable.families import UnsupportedModelError
from ..portable.names import ATTN_IMPLEMENTATION
from ..portable.vision import VisionPlan

PROBE_SHAPE = (2, 5)  # batch, tokens


class _Recorder:
    def __init__(self):
        self.calls = []

    def __call__(self, module, query, key, value, attention_mask, **kwargs):
        self.calls.append((query, key, value, attention_mask, kwargs))
        out = torch.nn.functional.scaled_dot_product_attention(query, key, value, scale=kwargs.get("scaling"))
        return out.transpose(1, 2).contiguous(), None


@contextlib.contextmanager
def _backend(config, impl):
    old_impl = config._attn_implementation
    config._attn_implementation_internal = impl
    try:
        yield
    finally:
        config._attn_implementation_internal = old_impl


@contextlib.contextmanager
def _probe_backend(config, recorder):
    """The recorder in the place of ``"qknorm"`` (a capped module runs only there), the encoder on it."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    local = ALL_ATTENTION_FUNCTIONS._local_mapping
    had, old = ATTN_IMPLEMENTATION in local, local.get(ATTN_IMPLEMENTATION)
    local[ATTN_IMPLEMENTATION] = recorder
    try:
        with _backend(config, ATTN_IMPLEMENTATION):
            yield
    finally:
        if had:
            local[ATTN_IMPLEMENTATION] = old
        else:
            local.pop(ATTN_IMPLEMENTATION, None)


def check_vision(model, plan: VisionPlan) -> None:
    """Raise :class:`UnsupportedModelError` when the vision scheme of ``plan`` does not reach the backend exactly."""
    if any(a.q_proj.weight.is_meta for a in plan.attentions):
        return  # a skeleton on the meta device has nothing to run, as for the language model's check
    tower = model.get_submodule(plan.path)
    where = f"model type {getattr(model.config, 'model_type', '?')!r}, vision encoder .{plan.path}"
    gen = torch.Generator().manual_seed(0)
    training = tower.training
    tower.eval()
    try:
        for i, attn in enumerate(plan.attentions):
            ref = attn.q_proj.weight
            x = torch.randn(*PROBE_SHAPE, attn.q_proj.in_features, generator=gen).to(ref.device, ref.dtype)
            recorder = _Recorder()
            with torch.no_grad(), _probe_backend(attn.config, recorder):
                attn(hidden_states=x)
                _check_call(where, i, attn, plan, x, recorder.calls)
            x.requires_grad_(True)
            with _backend(attn.config, ATTN_IMPLEMENTATION if plan.cfg.caps else attn.config._attn_implementation):
                out = attn(hidden_states=x)[0]  # the backend it will run on (a capped module checks it can cap)
            out.float().square().sum().backward(inputs=[x, *attn.q_norm.parameters(), *attn.k_norm.parameters()])
            if not torch.isfinite(out).all() or not torch.isfinite(x.grad).all():
                raise UnsupportedModelError(f"{where}: layer {i}'s patched attention is not finite")
    finally:
        tower.train(training)
        for attn in plan.attentions:
            for prm in (*attn.q_norm.parameters(), *attn.k_norm.parameters()):
                prm.grad = None


def _check_call(where, i, attn, plan, x, calls) -> None:
    name = type(attn).__name__
    if len(calls) != 1:
        raise UnsupportedModelError(
            f"{where}: layer {i} ({name}) called the attention interface {len(calls)} times (once expected)"
        )
    query, key, value, mask, kwargs = calls[0]
    b, t = PROBE_SHAPE
    want = {}
    for role, proj in (("q", attn.q_proj), ("k", attn.k_proj), ("v", attn.v_proj)):
        heads = proj.__class__.__mro__[1].forward(proj, x) if role != "v" else proj(x)
        heads = heads.view(b, t, -1, query.shape[-1])
        norm = {"q": attn.q_norm, "k": attn.k_norm}.get(role)
        want[role] = (norm(heads) if norm is not None else heads).transpose(1, 2)
    for role, got in (("q", query), ("k", key), ("v", value)):
        if got.shape != want[role].shape or not torch.allclose(got, want[role], rtol=1e-5, atol=1e-6):
            raise UnsupportedModelError(
                f"{where}: layer {i} ({name}): the {role} the backend receives is not the scheme's norm of each head "
                "of the projection (the model changes it between the projection and the backend)"
            )
    if mask is not None and not bool((mask == 0).all() if mask.dtype != torch.bool else mask.all()):
        raise UnsupportedModelError(
            f"{where}: layer {i} ({name}) masks its attention; a vision encoder's is bidirectional"
        )
    causal = kwargs.get("is_causal", getattr(attn, "is_causal", False))
    if causal:
        raise UnsupportedModelError(f"{where}: layer {i} ({name}) attends causally, not bidirectionally")
    if kwargs.get("softcap") is not None or attn.__dict__.get("_qknorm_softcap") != plan.cfg.softcap:
        raise UnsupportedModelError(f"{where}: layer {i} ({name}) passes a cap of its own")


def switch_vision_backend(model, plan: VisionPlan) -> None:
    """A capped vision scheme: the encoder moves to the ``"qknorm"`` backend (sdpa and eager cannot cap)."""
    if plan.cfg.caps:
        model.get_submodule(plan.path).set_attn_implementation(ATTN_IMPLEMENTATION)
