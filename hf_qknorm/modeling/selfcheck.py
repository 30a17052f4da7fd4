"""The patch-time self-check: one probe forward that refuses a model on which the scheme would not be applied exactly.

A family is read off the model's structure (:mod:`hf_qknorm.portable.families`); what the model's forward does with
its parts between the projections and the attention backend is not. So, after the scheme is installed and before
the patch is kept, :func:`self_check` runs a few tokens through the model with each scheme norm replaced by a probe
norm ``c_role * x / rms(x)`` (``c`` = 1, 2, 3 for q, k, v: a mix-up of roles shows), records every attention layer's
input, and calls each layer twice more through the ``"qknorm"`` backend with a recorder in front of it: once with
the probe norms on, once with them off (identity). It then requires, per layer:

- the layer calls the attention interface exactly once (a model with its own attention code -- ALiBi, relative
  position biases -- is refused);
- every query / key (/ value) row the backend receives with the norms on is the row it receives with them off times
  exactly ``c / rms(x)`` of the probe norm's input row: the norm acts on each head's projection output and the model
  does nothing after it but reshape and rotate (RoPE, partial or interleaved, is a rotation per row). A norm called
  on another width, a fused projection split wrongly, a clamp or a second norm after ours, all break it;
- a role the scheme does not normalise reaches the backend unchanged; a norm taking the place of one the model has
  receives the projection's own output (so it sits before RoPE);
- the cap the backend applies (its rule: :func:`hf_qknorm.portable.eager.effective_softcap`) is the scheme's; the
  ``l2``/``lp`` logit scale reaches it as ``scaling=1``; the mask is boolean or holds only 0 and -inf; no keyword
  the backend does not honour carries a value;
- ``qkv_norm``: the pre-attention norm's output feeds the attention alone (a parallel block, whose MLP reads the same
  norm, would lose it).

A layer whose inputs are not finite (a source model that computes inf) is not judged: nothing there can be
compared. Nor is a row whose norm input is zero (a padding token's, whose embedding row ``nn.Embedding`` zeroes, or a
pruned head's): ``c / rms(x)`` of it is no number, so it proves nothing either way; a layer where no row of a role
can be judged is refused, saying so. The probe's tokens avoid the padding id and zero embedding rows where the
vocabulary has any other. It costs about four short forwards of the model (one of them with a backward, whose
gradient is taken with respect to the new norms and the embeddings' output only: the model's own parameters get
none) and runs on the model's own device and dtype; a model on the ``meta`` device is not checked (there is nothing
to run).
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from ..kernels._env import SwitchError
from ..portable.eager import effective_softcap
from ..portable.families import UnsupportedModelError
from ..portable.names import ATTN_IMPLEMENTATION, ROLES

ROLE_SCALE = {"q": 1.0, "k": 2.0, "v": 3.0}
PROBE_SHAPE = (2, 7)  # batch, tokens
PROBE_VOCAB = 512  # the probe draws its tokens from the first ids
# A row of a norm's input whose rms is below this fraction of the largest row's is zero for the check: its probe
# factor c / rms(x) is no number it could compare (and float32 squares underflow long before 1e-30).
ZERO_ROW = 1e-6

# Keywords the "qknorm" backend honours or knows to be harmless (hf_qknorm.attention.interface), and a few more that
# some decoders pass and no attention function reads.
HARMLESS = frozenset({"layer_idx", "head_mask", "token_type_ids", "past_key_value"})


class _ProbeNorm(nn.Module):
    """``c * x / rms(x)`` over the last dimension while on, the identity while off; records its inputs."""

    def __init__(self, role: str):
        super().__init__()
        self.role, self.on, self.inputs = role, True, []

    def forward(self, x):
        self.inputs.append(x.detach())
        if not self.on:
            return x
        h = x.to(torch.promote_types(x.dtype, torch.float32))
        return (ROLE_SCALE[self.role] * h / h.pow(2).mean(-1, keepdim=True).sqrt().clamp_min(1e-30)).to(x.dtype)


class _Recorder:
    """Stands in front of the ``"qknorm"`` backend and records each call."""

    def __init__(self, backend):
        self.backend, self.calls = backend, []

    def __call__(self, module, query, key, value, attention_mask, **kwargs):
        self.calls.append(
            dict(q=query.detach(), k=key.detach(), v=value.detach(), mask=attention_mask, module=module, **kwargs)
        )
        return self.backend(module, query, key, value, attention_mask, **kwargs)


def self_check(model: nn.Module, plan) -> None:
    """Run the checks above on ``model`` with ``plan``'s scheme installed; raises :class:`UnsupportedModelError`
    naming the model type, the layer and what does not hold."""
    if any(p.is_meta for p in model.parameters()):
        return
    family, cfg = plan.family, plan.cfg
    name = f"model type {family.model_type!r}"
    roles = [r for r in ROLES if (cfg.norms_v if r == "v" else cfg.norms_qk)]
    ids = _probe_ids(model)
    with _probe_mode(model, plan, roles) as (probes, recorder, inputs, feeds):
        _record_forward(model, name, ids)
        whole = list(recorder.calls)  # the forward's backend calls, in order: what a layer reusing keys reads
        if cfg.removes_prenorm and feeds:
            raise UnsupportedModelError(
                f"{name}: qkv_norm removes the pre-attention norm, whose output also feeds "
                f"{', '.join(sorted(feeds))} (a parallel block); it cannot be removed for attention alone"
            )
        for i, attn in enumerate(plan.attentions):
            if i not in inputs:
                raise UnsupportedModelError(f"{name}: attention layer {i} was not called by the model's forward")
            args, kwargs = inputs[i]
            seen = {}
            for on in (True, False):
                for probe in probes[i].values():
                    probe.on, probe.inputs = on, []
                recorder.calls.clear()
                projected = {}
                hooks = [
                    getattr(attn, family.qkv_proj or family.projections[role]).register_forward_hook(
                        lambda m, a, out, role=role, seen=projected: seen.setdefault(role, out.detach())
                    )
                    for role in family.native
                    if role in probes[i]
                ]
                try:
                    with torch.no_grad():
                        attn(*args, **kwargs)
                finally:
                    for hook in hooks:
                        hook.remove()
                if len(recorder.calls) != 1:
                    raise UnsupportedModelError(
                        f"{name}: layer {i} called the attention interface {len(recorder.calls)} times (once "
                        "expected): the model computes attention in its own code, which hf_qknorm cannot reach"
                    )
                seen[on] = (recorder.calls[0], {r: list(p.inputs) for r, p in probes[i].items()}, projected)
            _check_layer(name, i, attn, plan, [r for r in roles if r in probes[i]], seen)
            _check_reused(name, i, attn, [r for r in roles if r not in probes[i]], whole)
    # The real norms, forward and backward, on the backend the patched model will run on.
    config = model.config
    old_impl = config._attn_implementation
    if plan.switch_backend:
        config._attn_implementation_internal = ATTN_IMPLEMENTATION
    try:
        _train_pass(model, name, ids, _norm_parameters(plan))
    finally:
        config._attn_implementation_internal = old_impl


@contextlib.contextmanager
def _probe_mode(model, plan, roles):
    """Probe norms in place of the scheme's, the recorder in front of the backend, the model on ``"qknorm"`` in
    eval mode, layer inputs recorded; everything restored on the way out."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    config = model.config
    old_impl = config._attn_implementation
    had_local = ATTN_IMPLEMENTATION in ALL_ATTENTION_FUNCTIONS._local_mapping
    old_local = ALL_ATTENTION_FUNCTIONS._local_mapping.get(ATTN_IMPLEMENTATION)
    recorder = _Recorder(ALL_ATTENTION_FUNCTIONS[ATTN_IMPLEMENTATION])
    training = model.training
    probes, saved, handles, inputs, feeds = [], [], [], {}, set()
    try:
        for i, attn in enumerate(plan.attentions):
            layer = {}
            for role in (r for r in roles if r in attn.__dict__["_qknorm_norms"]):  # a KV-reusing layer: q alone
                slot = attn.__dict__["_qknorm_norms"][role]
                saved.append((attn, slot, attn._modules[slot]))
                layer[role] = attn._modules[slot] = _ProbeNorm(role)
            probes.append(layer)

            def record(module, args, kwargs, i=i):
                inputs.setdefault(i, (args, dict(kwargs)))

            handles.append(attn.register_forward_pre_hook(record, with_kwargs=True))
        if plan.cfg.removes_prenorm and plan.family.prenorm is not None:
            handles += _watch_prenorm(plan.blocks[0], plan.family, feeds)
        ALL_ATTENTION_FUNCTIONS._local_mapping[ATTN_IMPLEMENTATION] = recorder
        config._attn_implementation_internal = ATTN_IMPLEMENTATION
        model.eval()
        yield probes, recorder, inputs, feeds
    finally:
        for handle in handles:
            handle.remove()
        for attn, slot, module in saved:
            attn._modules[slot] = module
        if had_local:
            ALL_ATTENTION_FUNCTIONS._local_mapping[ATTN_IMPLEMENTATION] = old_local
        else:
            ALL_ATTENTION_FUNCTIONS._local_mapping.pop(ATTN_IMPLEMENTATION, None)
        config._attn_implementation_internal = old_impl
        model.train(training)


def _watch_prenorm(block, family, feeds: set) -> list:
    """Hooks noting which of the block's children (besides the attention) receive the pre-norm's output."""
    out = {}

    def keep(module, args, output):
        out["y"] = output

    def check(child_name):
        def hook(module, args, kwargs):
            values = list(args) + list(kwargs.values())
            if "y" in out and any(v is out["y"] for v in values):
                feeds.add(child_name)

        return hook

    handles = [getattr(block, family.prenorm).register_forward_hook(keep)]
    for child_name, child in block.named_children():
        if child_name not in (family.attention, family.prenorm):
            handles.append(child.register_forward_pre_hook(check(child_name), with_kwargs=True))
    return handles


def _probe_ids(model) -> torch.Tensor:
    """The probe's token ids, ``PROBE_SHAPE``, drawn (seeded) from the first ``PROBE_VOCAB`` ids -- not the padding
    id nor an id whose embedding row is zero (such a token's hidden state is zero, and a zero row proves nothing),
    unless every id is one of those."""
    config = model.config
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    n = max(1, min(int(getattr(text, "vocab_size", 0) or 2), PROBE_VOCAB))
    ids = torch.arange(n)
    pad = getattr(text, "pad_token_id", None)
    pads = [t for t in (pad if isinstance(pad, (list, tuple)) else [pad]) if isinstance(t, int)]
    keep = ~torch.isin(ids, torch.tensor(pads, dtype=torch.long))
    rows = _embedding_rows(model, n)
    if rows is not None:
        keep &= rows.ne(0).any(-1).cpu()
    candidates = ids[keep] if bool(keep.any()) else ids
    pick = torch.randint(0, len(candidates), PROBE_SHAPE, generator=torch.Generator().manual_seed(0))
    return candidates[pick].to(next(model.parameters()).device)


def _input_embeddings(model) -> nn.Module | None:
    try:
        embeddings = model.get_input_embeddings()
    except (AttributeError, NotImplementedError):
        return None
    return embeddings if isinstance(embeddings, nn.Module) else None


def _embedding_rows(model, n: int) -> torch.Tensor | None:
    """The first ``n`` rows of the model's input embedding matrix, or ``None`` where it has none to read."""
    weight = getattr(_input_embeddings(model), "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or weight.shape[0] < n:
        return None
    return weight.detach()[:n]


def _norm_parameters(plan) -> list[torch.Tensor]:
    """The parameters of the scheme's norms (gains, biases, logit scales) that require grad."""
    return [
        p
        for attn in plan.attentions
        for slot in attn.__dict__.get("_qknorm_norms", {}).values()
        for p in attn._modules[slot].parameters()
        if p.requires_grad
    ]


def _record_forward(model, name: str, ids: torch.Tensor) -> None:
    """The probe tokens through the model, without gradients."""
    with _probe_errors(name), torch.no_grad():
        model(input_ids=ids, use_cache=False)


def _train_pass(model, name: str, ids: torch.Tensor, norm_params: list) -> None:
    """The probe tokens through the model in training mode, forward and backward, the mode restored. The gradient is
    taken (``torch.autograd.grad``, nothing accumulated) with respect to the new norms' parameters and the embeddings'
    output only: no gradient of the model's own parameters is computed, and the backward still runs through every
    layer's backend where the model is frozen or the scheme adds no parameter."""
    leaves = []

    def leaf(module, args, output):
        if isinstance(output, torch.Tensor) and output.is_floating_point():
            leaves.append(output.detach().requires_grad_())
            return leaves[-1].clone()  # the model may write into its embeddings' output; a leaf takes no in-place op

    embeddings = _input_embeddings(model)
    handle = embeddings.register_forward_hook(leaf) if embeddings is not None else None
    training = model.training
    try:
        with _probe_errors(name):
            model.train()
            out = model(input_ids=ids, use_cache=False)
            inputs = leaves + list(norm_params)
            if inputs:  # else nothing here has a gradient to take (no embedding module, no new parameter)
                logits = out.logits if getattr(out, "logits", None) is not None else out[0]
                torch.autograd.grad(logits.float().sum(), inputs, allow_unused=True)
    finally:
        if handle is not None:
            handle.remove()
        model.train(training)


@contextlib.contextmanager
def _probe_errors(name: str):
    """An error of the probe forward (or backward) as a refusal naming the model type."""
    try:
        yield
    except (UnsupportedModelError, SwitchError):  # a misspelt environment switch: the user's setting, not the model's
        raise
    except Exception as exc:
        first = str(exc).splitlines()[0] if str(exc) else ""
        raise UnsupportedModelError(
            f"{name}: the patched model's probe forward failed ({type(exc).__name__}: {first})"
        ) from exc


def _tolerance(t: torch.Tensor) -> float:
    return 2e-2 if t.dtype in (torch.float16, torch.bfloat16) else 1e-4


def _check_layer(name, i, attn, plan, roles, seen) -> None:
    cfg, family = plan.cfg, plan.family
    (on, inputs_on, projected), (off, _, _) = seen[True], seen[False]
    where = f"{name}: layer {i}"
    from ..attention.interface import HONOURED_KWARGS

    known = HONOURED_KWARGS | HARMLESS | {"q", "k", "v", "mask", "module"}
    extra = sorted(k for k, v in on.items() if k not in known and v is not None)
    if extra:
        raise UnsupportedModelError(
            f"{where} passes {', '.join(extra)} to the attention backend, which the {ATTN_IMPLEMENTATION!r} backend "
            "does not apply (it would be dropped)"
        )
    _check_mask(where, on["mask"])
    cap = effective_softcap(attn, on.get("softcap"))
    if cfg.caps and (cap is None or float(cap) != float(cfg.softcap)):
        raise UnsupportedModelError(f"{where}: the backend would apply cap {cap}, not the scheme's {cfg.softcap}")
    if cfg.learned_logit_scale and on.get("scaling") is not None and float(on["scaling"]) != 1.0:
        raise UnsupportedModelError(
            f"{where} passes scaling={on['scaling']} to the backend: the model computes its own logit scale, so "
            f"norm {cfg.norm!r}'s learnable logit scale would not be the only one"
        )
    if not all(bool(torch.isfinite(t).all()) for t in (on["q"], on["k"], on["v"], off["q"], off["k"], off["v"])):
        return  # a layer fed non-finite values (a broken source model) cannot be judged; its own checks say so
    for role in ROLES:
        a, b = on[role], off[role]
        if a.shape != b.shape:
            raise UnsupportedModelError(f"{where}: the {role} tensor at the backend changed shape under the norms")
        if role not in roles:
            if not torch.allclose(a, b, rtol=_tolerance(a), atol=_tolerance(a) * float(b.abs().max().clamp_min(1))):
                raise UnsupportedModelError(
                    f"{where}: {role}, which scheme {cfg.scheme!r} does not normalise, changes at the backend when "
                    "the q/k norms are applied (a fused projection split wrongly?)"
                )
            continue
        probe_in = inputs_on.get(role) or []
        if len(probe_in) != 1:
            raise UnsupportedModelError(
                f"{where}: the {role} norm was called {len(probe_in)} times in one forward (once expected)"
            )
        x = probe_in[0]
        width = a.shape[-1]
        if x.shape[-1] != width:
            raise UnsupportedModelError(
                f"{where}: the {role} norm is called on width {x.shape[-1]}, the backend's heads have {width}"
            )
        _check_rows(where, role, a, b, x)
        if role in family.native:
            _check_native_place(where, role, x, projected.get(role))


def _check_reused(name, i, attn, roles, calls) -> None:
    """A layer without a norm of its own for ``roles`` (a layer that reuses an earlier layer's keys, Gemma 4's KV-shared
    layers) hands the backend, in the probe forward, exactly the tensor an earlier layer that normalises them handed
    it: what that layer's checks proved normalised."""
    mine = [n for n, call in enumerate(calls) if call["module"] is attn]
    if not roles or len(mine) != 1:
        return  # no reused role, or a layer called other than once (its own check refuses that)
    earlier = [c for c in calls[: mine[0]] if all(r in c["module"].__dict__.get("_qknorm_norms", {}) for r in roles)]
    for role in roles:
        if not any(torch.equal(calls[mine[0]][role], c[role]) for c in earlier):
            raise UnsupportedModelError(
                f"{name}: layer {i} has no {role} norm of its own, and the {role} it hands the attention backend is "
                f"not the one an earlier layer normalised (it would reach the backend unnormalised)"
            )


def _check_rows(where, role, a, b, x) -> None:
    """``a`` (norms on) is ``b`` (norms off) times ``c / rms(x_row)``, row by row, as a multiset over the rows.

    Rows whose norm input ``x`` is zero (``ZERO_ROW``) are left out of the multiset, as are the backend's rows that
    are zero with the norms off: in an exact model those are the same rows (RoPE keeps a row's norm), and a row
    that is zero off and not on still fails the residual."""
    acc = torch.float64
    a2, b2 = a.to(acc).reshape(-1, a.shape[-1]), b.to(acc).reshape(-1, b.shape[-1])
    tol = _tolerance(a)
    bb = (b2 * b2).sum(-1)
    factor = (a2 * b2).sum(-1) / bb.clamp_min(1e-300)
    resid = (a2 - factor[:, None] * b2).norm(dim=-1) / a2.norm(dim=-1).clamp_min(1e-30)
    x2 = x.to(acc).reshape(-1, x.shape[-1])
    x_rms, b_rms = x2.pow(2).mean(-1).sqrt(), (bb / b2.shape[-1]).sqrt()
    floor = ZERO_ROW * float(x_rms.max()) if x_rms.numel() else 0.0
    if not bool((x_rms > floor).any()):
        raise UnsupportedModelError(
            f"{where}: no {role} row could be judged: the {role} norm's input is zero in every probe row (the "
            "probe's tokens have zero embedding rows?), so nothing shows whether the scheme reaches the backend"
        )
    expected = ROLE_SCALE[role] / x_rms[x_rms > floor]
    ok = bool((resid <= tol * 10).all())
    if ok:
        got = torch.sort(factor[b_rms > floor]).values
        want = torch.sort(expected).values
        if got.numel() != want.numel() and got.numel() % max(want.numel(), 1) == 0:
            want = torch.sort(want.repeat_interleave(got.numel() // want.numel())).values
        ok = got.numel() == want.numel() and bool(torch.allclose(got, want, rtol=tol * 10, atol=0))
    if not ok:
        raise UnsupportedModelError(
            f"{where}: the {role} rows at the attention backend are not the scheme's per-head norm of the "
            f"projection (the model transforms {role} between the projection and the backend in a way the norm "
            "does not commute with, or normalises it again)"
        )


def _check_native_place(where, role, x, projected) -> None:
    """The norm that replaced the model's own receives the projection's output itself, i.e. sits before RoPE:
    every value it receives is one of the projection's output values (reshapes and splits copy; RoPE does not)."""
    if projected is None or not bool(torch.isin(x.flatten(), projected.flatten()).all()):
        raise UnsupportedModelError(
            f"{where}: the model's own {role} norm, whose place the scheme's takes, is called on something other "
            "than the projection's output (after RoPE?): the scheme's norm would not sit before RoPE"
        )


def _check_mask(where, mask) -> None:
    if mask is None or mask.dtype == torch.bool:
        return
    finite = mask[torch.isfinite(mask)]
    if finite.numel() and not bool((finite == 0).all() | (finite <= torch.finfo(mask.dtype).min / 2).all()):
        bad = finite[(finite != 0) & (finite > torch.finfo(mask.dtype).min / 2)]
        if bad.numel():
            raise UnsupportedModelError(
                f"{where} passes a float mask with values other than 0 and -inf (e.g. {float(bad.flatten()[0]):.3g}): "
                "an additive bias the backend's mask rule does not apply"
            )
