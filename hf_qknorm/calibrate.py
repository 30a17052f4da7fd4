"""Calibrated initialisation of the norms that a conversion adds, and the statistics behind it.

A freshly initialised norm makes a pretrained model forget what it knew: an identity LayerNorm hands attention
unit-variance queries and keys, so the logits shrink and attention goes nearly uniform. :func:`calibrate` runs
calibration text through the original model, records per-layer and per-head statistics of q, k and v **before
RoPE** (the point where the norms sit), patches the model and initialises the new norm parameters in two steps:

1. Closed form. The norm maps its input ``x`` (the projection output) to ``w * n(x) + b``, where ``n`` is the
   parameter-free part (centre and scale for ``layernorm``, scale for ``rmsnorm``, divide by ``||x||_p`` for
   ``lp``). Per channel, pooled over heads and tokens because the parameters are shared by all heads, ``w`` and ``b``
   are the least-squares fit of the original activations ``y`` on ``n(x)``. For ``l2``/``lp`` the query norm's logit
   scale ``g`` starts at ``scaling * E||q||_p * E||k||_p``, so that ``g * q_hat . k_hat`` matches ``scaling * q . k``
   on average.
2. Distillation. Only the new norm parameters (and the logit scale) are trained, with Adam, to minimise the KL
   divergence between the original and the converted model's next-token distributions on the calibration text --
   a few thousand parameters, so a few hundred small steps are cheap. This fixes what a per-channel fit cannot see:
   the per-token norms that the norm removes and the interaction between layers.

Perplexities on held-out text (never used for calibration) are reported for the original model, for identity init,
for the closed-form fit alone and for the final calibrated init. For capped schemes the largest logit of each layer
on the calibration text is recorded, with a warning when it reaches half the cap (where ``c * tanh(s / c)`` starts to
bend ``s`` noticeably: by 8% at ``s = c / 2``).
"""

from __future__ import annotations

import math
import sys
import time
from dataclasses import asdict, dataclass, field

import torch
from torch import nn
from torch.nn import functional as F

from .families import Family
from .norms import NORM_CLASSES, HeadLayerNorm, HeadLpNorm, HeadRMSNorm, make_norm
from .patch import _find_layers, patch_model
from .schemes import QKNormConfig

CAP_WARN_FRACTION = 0.5


@dataclass
class CalibrationSettings:
    """How much text and how many steps calibration uses (the defaults suit models up to a few billion
    parameters on one GPU, and the bundled tiny model in about a minute on a CPU)."""

    block_len: int = 256          # tokens per block (BOS included)
    calibration_blocks: int = 64  # blocks of calibration text read (statistics and distillation)
    eval_blocks: int = 256        # held-out blocks for the perplexity report (all of the bundled held-out text)
    steps: int = 200              # Adam steps of distillation; 0 keeps the closed-form fit
    batch_size: int = 4           # blocks per distillation step (and per forward pass when measuring)
    lr: float = 0.3               # relative step size: each tensor moves by about lr * its initial RMS per step
    teacher_budget_mb: int = 1024  # memory for the cached teacher log-probs (float16); fewer blocks if exceeded
    seed: int = 0

    def __post_init__(self):
        for name in ("block_len", "calibration_blocks", "eval_blocks", "batch_size"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)!r}")
        if self.block_len < 2:
            raise ValueError(f"block_len must be >= 2, got {self.block_len}")
        if self.steps < 0:
            raise ValueError(f"steps must be >= 0, got {self.steps}")
        if not self.lr > 0:
            raise ValueError(f"lr must be positive, got {self.lr}")


@dataclass
class LayerStats:
    """Statistics of one attention layer on the calibration text (per head: RMS over tokens and channels)."""

    layer: int
    q_rms: list[float]
    k_rms: list[float]
    v_rms: list[float]
    max_logit_original: float           # largest |scaling * q.k| over causal pairs, original model
    max_logit_converted: float | None = None  # the same in the converted model (before any cap)


@dataclass
class CalibrationReport:
    """What calibration measured. Perplexities are on held-out text; ``recovered`` is the fraction of identity
    init's perplexity increase that calibrated init removes."""

    scheme: dict
    ppl_original: float
    ppl_identity: float
    ppl_least_squares: float
    ppl_calibrated: float
    calibration_tokens: int
    eval_tokens: int
    steps: int
    kl_start: float | None
    kl_end: float | None
    seconds: float
    layers: list[LayerStats] = field(default_factory=list)
    cap: float | None = None
    warnings: list[str] = field(default_factory=list)

    @property
    def recovered(self) -> float:
        gap = self.ppl_identity - self.ppl_original
        return float("nan") if gap <= 0 else (self.ppl_identity - self.ppl_calibrated) / gap

    def to_dict(self) -> dict:
        d = asdict(self)
        d["recovered"] = self.recovered
        return d

    def perplexity_table(self) -> str:
        """Markdown table of the four perplexities."""
        rows = [("original model", self.ppl_original), ("converted, identity init", self.ppl_identity),
                ("converted, per-channel least-squares init", self.ppl_least_squares),
                ("converted, calibrated init (least squares + KL distillation)", self.ppl_calibrated)]
        lines = ["| model | held-out perplexity |", "|---|---|"]
        lines += [f"| {name} | {value:.3f} |" for name, value in rows]
        return "\n".join(lines)

    def layer_table(self) -> str:
        """Markdown table of per-layer statistics (RMS averaged over heads, largest logit)."""
        lines = ["| layer | q RMS | k RMS | v RMS | max logit (original) | max logit (converted) |",
                 "|---|---|---|---|---|---|"]
        for s in self.layers:
            conv = "-" if s.max_logit_converted is None else f"{s.max_logit_converted:.2f}"
            lines.append(f"| {s.layer} | {_mean(s.q_rms):.3f} | {_mean(s.k_rms):.3f} | {_mean(s.v_rms):.3f} | "
                         f"{s.max_logit_original:.2f} | {conv} |")
        return "\n".join(lines)

    def summary(self) -> str:
        """The report printed by ``hf-qknorm convert``."""
        out = [f"perplexity on {self.eval_tokens:,} held-out tokens (calibration used {self.calibration_tokens:,} "
               f"other tokens, {self.steps} distillation steps, {self.seconds:.0f} s):", self.perplexity_table(),
               f"calibrated init removes {100 * self.recovered:.1f}% of identity init's perplexity increase "
               f"(KL to the original: {_fmt(self.kl_start)} -> {_fmt(self.kl_end)} nats/token)", "",
               "per-layer statistics on the calibration text (per-head RMS before RoPE, averaged over heads):",
               self.layer_table()]
        if self.cap is not None:
            out.append(f"cap c = {self.cap:g}: largest converted logit "
                       f"{max((s.max_logit_converted or 0.0) for s in self.layers):.2f}")
        out += [f"WARNING: {w}" for w in self.warnings]
        return "\n".join(out)


def _mean(values) -> float:
    return sum(values) / max(1, len(values))


def _fmt(x) -> str:
    return "-" if x is None else f"{x:.4f}"


# --------------------------------------------------------------------------------------------------------------------
# statistics of the original model
# --------------------------------------------------------------------------------------------------------------------
class _Moments:
    """Per-channel sums for the least-squares fit ``y ~ w * n + b`` (pooled over tokens and heads), per-head
    sums of squares of ``y`` for the report, and the mean ``||y||_p`` for the ``lp`` logit scale."""

    def __init__(self):
        self.count = 0
        self.sn = self.sy = self.snn = self.sny = self.head_sq = None
        self.norm_p_sum = 0.0

    def add(self, n: torch.Tensor, y: torch.Tensor, p: float | None) -> None:
        n2, y2 = n.reshape(-1, n.shape[-1]).double(), y.reshape(-1, y.shape[-1]).double()
        sums = (n2.sum(0), y2.sum(0), (n2 * n2).sum(0), (n2 * y2).sum(0))
        head_sq = y.double().pow(2).mean(-1).reshape(-1, y.shape[-2]).sum(0)  # (heads,)
        if self.sn is None:
            self.sn, self.sy, self.snn, self.sny, self.head_sq = (*sums, head_sq)
        else:
            for name, value in zip(("sn", "sy", "snn", "sny"), sums):
                setattr(self, name, getattr(self, name) + value)
            self.head_sq = self.head_sq + head_sq
        if p is not None:
            self.norm_p_sum += torch.linalg.vector_norm(y2, ord=p, dim=-1).sum().item()
        self.count += n2.shape[0]

    def head_rms(self) -> list[float]:
        tokens = self.count // self.head_sq.numel()
        return [math.sqrt(v / max(1, tokens)) for v in self.head_sq.tolist()]

    def fit(self, intercept: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Least-squares ``w`` (and ``b``) per channel."""
        c = self.count
        if not intercept:
            return self.sny / self.snn.clamp_min(1e-12), None
        mean_n, mean_y = self.sn / c, self.sy / c
        var_n = (self.snn / c - mean_n**2).clamp_min(1e-12)
        w = (self.sny / c - mean_n * mean_y) / var_n
        return w, mean_y - w * mean_n


def _parameter_free(cfg: QKNormConfig, head_dim: int) -> nn.Module:
    """``n(x)``: the new norm without its parameters (identity-initialised layernorm/rmsnorm, plain ``x/||x||_p``)."""
    if cfg.learned_logit_scale:
        return HeadLpNorm(head_dim, cfg.p, cfg.eps, None)
    return make_norm(cfg.norm, "q", head_dim, cfg.eps).double()


def _heads(attn, family: Family, hidden: torch.Tensor):
    """Projections ``x`` (what the new norms will read) and targets ``y`` (what the original model feeds RoPE)
    of one attention module, each ``(batch, seq, heads, head_dim)``."""
    if family.fused_qkv:
        q, k, v = getattr(attn, family.qkv_proj)(hidden).split(attn.split_size, dim=2)
    else:
        q, k, v = (getattr(attn, name)(hidden) for name in (family.q_proj, family.k_proj, family.v_proj))
    xq, xk, xv = (t.view(*t.shape[:-1], -1, attn.head_dim) for t in (q, k, v))
    yq, yk = xq, xk
    if family.native_qk_norm:  # Qwen3: the original model normalises q and k itself
        yq, yk = attn.q_norm(xq), attn.k_norm(xk)
    return (xq, xk, xv), (yq, yk, xv)


def _max_logit(q: torch.Tensor, k: torch.Tensor, scaling: float) -> float:
    """Largest ``|scaling * q.k|`` over causal pairs; ``q`` ``(b, h, s, d)``, ``k`` ``(b, kv_heads, s, d)``."""
    q, k = q.float(), k.float()
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    s = torch.matmul(q, k.transpose(-1, -2)).mul_(scaling).abs_()
    t = s.shape[-1]
    causal = torch.ones(t, t, dtype=torch.bool, device=s.device).tril_()
    return s.masked_fill_(~causal, 0.0).amax().item()


class _Recorder:
    """Forward pre-hooks on every attention module of the original model, accumulating :class:`_Moments` for q, k
    and v and the largest logit per layer."""

    def __init__(self, model: nn.Module, family: Family, cfg: QKNormConfig):
        self.family, self.cfg = family, cfg
        self.attns = [getattr(block, family.attention) for block in _find_layers(model, family)]
        self.moments = [{r: _Moments() for r in "qkv"} for _ in self.attns]
        self.max_logit = [0.0 for _ in self.attns]
        self.norm = _parameter_free(cfg, self.attns[0].head_dim) if cfg.norms_qk else None
        self._handles = []

    def __enter__(self):
        for i, attn in enumerate(self.attns):
            self._handles.append(attn.register_forward_pre_hook(self._hook(i), with_kwargs=True))
        return self

    def __exit__(self, *exc):
        for h in self._handles:
            h.remove()

    def _hook(self, i):
        def hook(attn, args, kwargs):
            hidden = args[0] if args else kwargs["hidden_states"]
            with torch.no_grad():
                xs, ys = _heads(attn, self.family, hidden)
                if self.norm is not None:
                    p = self.cfg.p if self.cfg.learned_logit_scale else None
                    for role, x, y in zip("qkv", xs, ys):
                        self.moments[i][role].add(self.norm(x.double()), y, p)
                q, k = (t.transpose(1, 2) for t in ys[:2])
                if self.family.rope:
                    rope = getattr(sys.modules[type(attn).__module__], "apply_rotary_pos_emb")
                    q, k = rope(q, k, *kwargs["position_embeddings"])
                self.max_logit[i] = max(self.max_logit[i], _max_logit(q, k, float(attn.scaling)))
        return hook

    def layer_stats(self) -> list[LayerStats]:
        out = []
        for i, m in enumerate(self.moments):
            rms = {r: (m[r].head_rms() if m[r].count else []) for r in "qkv"}
            out.append(LayerStats(i, rms["q"], rms["k"], rms["v"], self.max_logit[i]))
        return out


# --------------------------------------------------------------------------------------------------------------------
# closed-form init and distillation of the patched model
# --------------------------------------------------------------------------------------------------------------------
def closed_form_init(model: nn.Module, family: Family, cfg: QKNormConfig, recorder: _Recorder) -> None:
    """Set every new norm of the patched ``model`` from the recorded least-squares statistics."""
    with torch.no_grad():
        for attn, moments in zip((getattr(b, family.attention) for b in _find_layers(model, family)),
                                 recorder.moments):
            for role in "qkv":
                norm = getattr(attn, f"{role}_norm", None)
                if norm is None or not moments[role].count:
                    continue
                _init_norm(norm, role, moments, float(attn.scaling))


def _init_norm(norm: nn.Module, role: str, moments: dict, scaling: float) -> None:
    if isinstance(norm, HeadLayerNorm):
        w, b = moments[role].fit(intercept=True)
        norm.weight.copy_(w)
        norm.bias.copy_(b)
    elif isinstance(norm, HeadRMSNorm):
        norm.weight.copy_(moments[role].fit(intercept=False)[0])
    elif isinstance(norm, HeadLpNorm) and norm.scale == "channel":
        norm.weight.copy_(moments[role].fit(intercept=False)[0])
    elif isinstance(norm, HeadLpNorm) and norm.scale == "logit":
        mq, mk = moments["q"], moments["k"]
        norm.weight.fill_(scaling * (mq.norm_p_sum / mq.count) * (mk.norm_p_sum / mk.count))


def new_norm_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    """The parameters of the norms a patch added (``...q_norm.weight`` etc.), by state-dict name."""
    out = {}
    for name, module in model.named_modules():
        if isinstance(module, NORM_CLASSES) and name.rsplit(".", 1)[-1] in ("q_norm", "k_norm", "v_norm"):
            out.update({f"{name}.{k}": prm for k, prm in module.named_parameters()})
    return out


def distill(model: nn.Module, blocks: torch.Tensor, teacher: torch.Tensor, settings: CalibrationSettings,
            progress: bool = True) -> tuple[float, float]:
    """Train only the new norm parameters to match ``teacher`` (float16 log-probs ``(n_blocks, seq, vocab)``).

    Returns the mean KL (nats per token) on a fixed monitor batch before and after. Adam on tensors of very
    different scales: each parameter group's learning rate is ``settings.lr`` times the RMS of its initial value,
    and the rate decays with a cosine. The best parameters seen on the monitor batch are kept."""
    params = new_norm_parameters(model)
    frozen = [p for p in model.parameters() if p.requires_grad and all(p is not q for q in params.values())]
    for p in frozen:
        p.requires_grad_(False)
    gen = torch.Generator().manual_seed(settings.seed)
    monitor = torch.arange(min(len(blocks), settings.batch_size))
    try:
        groups = [{"params": [p], "lr": settings.lr * max(p.detach().pow(2).mean().sqrt().item(), 1e-2)}
                  for p in params.values()]
        for g in groups:
            g["base_lr"] = g["lr"]
        opt = torch.optim.Adam(groups, betas=(0.9, 0.99))
        kl_start = best = _kl(model, blocks[monitor], teacher[monitor])
        best_state = {k: p.detach().clone() for k, p in params.items()}
        model.train(False)  # dropout off: distillation matches the deterministic model
        bar = _progress(range(settings.steps), "calibrating (KL distillation)", progress)
        for step in bar:
            for g in opt.param_groups:
                g["lr"] = g["base_lr"] * 0.5 * (1 + math.cos(math.pi * step / max(1, settings.steps)))
            idx = torch.randint(0, len(blocks), (min(settings.batch_size, len(blocks)),), generator=gen)
            loss = _kl(model, blocks[idx], teacher[idx], grad=True)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            if (step + 1) % 25 == 0 or step + 1 == settings.steps:
                current = _kl(model, blocks[monitor], teacher[monitor])
                if current < best:
                    best, best_state = current, {k: p.detach().clone() for k, p in params.items()}
                if hasattr(bar, "set_postfix"):
                    bar.set_postfix(kl=f"{current:.4f}")
        with torch.no_grad():
            for k, p in params.items():
                p.copy_(best_state[k])
        return kl_start, best
    finally:
        for p in frozen:
            p.requires_grad_(True)


def _kl(model, ids, teacher, grad: bool = False):
    with torch.set_grad_enabled(grad):
        logq = F.log_softmax(model(input_ids=ids).logits.float(), dim=-1)
        logp = teacher.float()
        kl = (logp.exp() * (logp - logq)).sum(-1).mean()
    return kl if grad else kl.item()


def _progress(iterable, desc: str, enabled: bool):
    if not enabled:
        return iterable
    from tqdm.auto import tqdm

    return tqdm(iterable, desc=desc, leave=False, file=sys.stderr, disable=None)  # None: off when not a TTY


@torch.no_grad()
def teacher_log_probs(model: nn.Module, blocks: torch.Tensor, batch_size: int, progress: bool = True,
                      desc: str = "running the original model") -> torch.Tensor:
    """Float16 next-token log-probabilities ``(n_blocks, seq, vocab)`` of ``model`` on ``blocks``."""
    out = []
    for start in _progress(range(0, len(blocks), batch_size), desc, progress):
        logits = model(input_ids=blocks[start:start + batch_size]).logits.float()
        out.append(F.log_softmax(logits, dim=-1).to(torch.float16))
    return torch.cat(out)


@torch.no_grad()
def perplexity(model: nn.Module, blocks: torch.Tensor, batch_size: int = 8) -> float:
    """Token perplexity on ``blocks`` (every position but the first of each block is a target)."""
    from .data import perplexity as _ppl

    return _ppl(model, blocks, batch_size=batch_size)


# --------------------------------------------------------------------------------------------------------------------
# the whole procedure
# --------------------------------------------------------------------------------------------------------------------
def calibrate(model: nn.Module, family: Family, cfg: QKNormConfig, calib_blocks: torch.Tensor,
              eval_blocks: torch.Tensor, settings: CalibrationSettings | None = None,
              progress: bool = True) -> CalibrationReport:
    """Patch the unpatched ``model`` in place with ``cfg`` and initialise its new norms from ``calib_blocks``.

    ``calib_blocks`` and ``eval_blocks`` are ``(n_blocks, block_len)`` token ids; the perplexity report is on
    ``eval_blocks`` only. Returns the :class:`CalibrationReport`.
    """
    settings = settings or CalibrationSettings()
    t0 = time.time()
    model.eval()
    bs = settings.batch_size
    per_block = calib_blocks.shape[1] * model.config.get_text_config().vocab_size * 2
    n_teacher = max(1, min(len(calib_blocks), settings.teacher_budget_mb * 2**20 // per_block))
    ppl_original = perplexity(model, eval_blocks, bs)
    recorder = _Recorder(model, family, cfg)
    with recorder:
        teacher = teacher_log_probs(model, calib_blocks[:n_teacher], bs, progress)
        if n_teacher < len(calib_blocks):  # statistics see every block, the cached teacher only the first ones
            teacher_log_probs(model, calib_blocks[n_teacher:], bs, progress, "collecting statistics")
    layers = recorder.layer_stats()
    patch_model(model, cfg.scheme, norm=cfg.norm if cfg.norms_qk else None, softcap=cfg.softcap, eps=cfg.eps,
                p=cfg.p)
    ppl_identity = perplexity(model, eval_blocks, bs)
    kl_start = kl_end = None
    if cfg.norms_qk:
        closed_form_init(model, family, cfg, recorder)
    ppl_ls = perplexity(model, eval_blocks, bs) if cfg.norms_qk else ppl_identity
    if cfg.norms_qk and settings.steps > 0:
        kl_start, kl_end = distill(model, calib_blocks[:n_teacher], teacher, settings, progress)
    ppl_cal = perplexity(model, eval_blocks, bs) if kl_end is not None else ppl_ls
    report = CalibrationReport(
        scheme=cfg.to_dict(), ppl_original=ppl_original, ppl_identity=ppl_identity, ppl_least_squares=ppl_ls,
        ppl_calibrated=ppl_cal, calibration_tokens=calib_blocks.numel(), eval_tokens=eval_blocks[:, 1:].numel(),
        steps=settings.steps if cfg.norms_qk else 0, kl_start=kl_start, kl_end=kl_end, seconds=0.0,
        layers=layers, cap=cfg.softcap)
    _converted_max_logits(model, family, calib_blocks, report, bs)
    report.seconds = time.time() - t0
    return report


@torch.no_grad()
def _converted_max_logits(model, family, blocks, report: CalibrationReport, batch_size: int) -> None:
    """Largest pre-cap logit of every layer of the patched model (through the patch's probe hook); with a cap,
    a warning for each layer where it reaches ``CAP_WARN_FRACTION`` of the cap."""
    attns = [getattr(b, family.attention) for b in _find_layers(model, family)]
    seen = [0.0] * len(attns)

    def probe_for(i):
        def probe(attn, q, k, attention_mask=None, scaling=1.0, softcap=None):
            seen[i] = max(seen[i], _max_logit(q, k, scaling))
        return probe

    for i, attn in enumerate(attns):
        attn._qknorm_probe = probe_for(i)
    try:
        for start in range(0, len(blocks), batch_size):
            model(input_ids=blocks[start:start + batch_size])
    finally:
        for attn in attns:
            del attn._qknorm_probe
    for stats, value in zip(report.layers, seen):
        stats.max_logit_converted = value
        if report.cap is not None and value >= CAP_WARN_FRACTION * report.cap:
            report.warnings.append(
                f"layer {stats.layer}: largest logit {value:.2f} on the calibration text is "
                f">= {CAP_WARN_FRACTION:g} x cap {report.cap:g}; the cap bends these logits "
                f"(c*tanh(s/c) = {report.cap * math.tanh(value / report.cap):.2f} for s = {value:.2f}), so the "
                f"converted model departs from the original there")
