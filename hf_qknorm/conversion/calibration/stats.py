"""What calibration measures: activation statistics of the original model and the report of a calibration.

:class:`ActivationRecorder` records, while the original model runs, what the new norms will read and what the
original model hands on there, per layer: the least-squares sums that
:func:`hf_qknorm.conversion.calibration.localfit.closed_form` needs (per channel, pooled over heads and tokens), the
per-head RMS of q, k and v before RoPE, and the largest logit. :class:`CalibrationReport` holds the perplexities and
per-layer statistics and formats them for the command line and the model card.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import torch
from torch import nn

from ...modeling.telemetry import LogitTap, head_max_logits
from ...portable.families import Family, head_dim_of, heads_of, own_roles, text_runner
from ...portable.hooks import hook_slots, install
from ...portable.layout import find_layers
from ...portable.norms import HeadLpNorm, make_norm
from ...portable.schemes import QKNormConfig
from ...portable.structure import restore_attention

CAP_WARN_FRACTION = 0.5


@dataclass
class LayerStats:
    """Statistics of one attention layer on the calibration text (per head: RMS over tokens and channels)."""

    layer: int
    q_rms: list[float]
    k_rms: list[float]
    v_rms: list[float]
    max_logit_original: float  # largest scaling * q.k over causal pairs (0 at least), original model
    max_logit_converted: float | None = None  # the same in the converted model (before any cap)
    # relative squared error of the converted attention layer's output against the original's on the calibration
    # text (the layer-wise objective), with the closed-form init and with the calibrated init
    fit_error_closed_form: float | None = None
    fit_error: float | None = None


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
    local_steps: int = 0  # Adam steps of the layer-wise fit per layer (0: closed form only)
    # answer agreement of the written model with the original
    # (hf_qknorm.conversion.orchestration.agreement.AgreementReport as a dict); None when not measured
    agreement: dict | None = None
    # what healing did and measured (hf_qknorm.conversion.healing.heal.HealReport as a dict); None without healing. The
    # perplexities above are the calibrated model's before healing; the healed model's are in here
    heal: dict | None = None

    @property
    def recovered(self) -> float:
        gap = self.ppl_identity - self.ppl_original
        return float("nan") if gap <= 0 else (self.ppl_identity - self.ppl_calibrated) / gap

    def to_dict(self) -> dict:
        d = asdict(self)
        # strict JSON has no NaN: none where there was no increase to remove
        d["recovered"] = self.recovered if self.ppl_identity > self.ppl_original else None
        return d

    def perplexity_table(self) -> str:
        """Markdown table of the perplexities (original, identity, least-squares and calibrated init)."""
        how = (
            ["least squares"]
            + (["layer-wise fit"] if self.local_steps else [])
            + (["KL distillation"] if self.steps else [])
        )
        rows = [
            ("original model", self.ppl_original),
            ("converted, identity init", self.ppl_identity),
            ("converted, per-channel least-squares init", self.ppl_least_squares),
            (f"converted, calibrated init ({' + '.join(how)})", self.ppl_calibrated),
        ]
        if not self.adds_weights:
            rows = [rows[0], ("converted (capped; no weights to initialise)", self.ppl_calibrated)]
        lines = ["| model | held-out perplexity |", "|---|---|"]
        lines += [f"| {name} | {value:.3f} |" for name, value in rows]
        return "\n".join(lines)

    def layer_table(self) -> str:
        """Markdown table of per-layer statistics (RMS averaged over heads, largest logit)."""
        lines = [
            "| layer | q RMS | k RMS | v RMS | max logit (original) | max logit (converted) | "
            "output error (least squares) | output error (calibrated) |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for s in self.layers:
            conv = "-" if s.max_logit_converted is None else f"{s.max_logit_converted:.2f}"
            lines.append(
                f"| {s.layer} | {_rms(s.q_rms)} | {_rms(s.k_rms)} | {_rms(s.v_rms)} | "
                f"{s.max_logit_original:.2f} | {conv} | {_fmt(s.fit_error_closed_form)} | "
                f"{_fmt(s.fit_error)} |"
            )
        return "\n".join(lines)

    @property
    def adds_weights(self) -> bool:
        return self.scheme.get("scheme") != "soft_cap"

    def verdict(self) -> str:
        """One sentence on what calibration achieved."""
        if not self.adds_weights:
            return (
                f"soft_cap adds no weights, so there is nothing to calibrate: the cap alone moves held-out "
                f"perplexity from {self.ppl_original:.3f} to {self.ppl_calibrated:.3f}"
            )
        kl = (
            f" (KL to the original: {_fmt(self.kl_start)} -> {_fmt(self.kl_end)} nats/token)"
            if self.kl_start is not None
            else ""
        )
        return f"{self.recovery()}{kl}"

    def recovery(self, bold: bool = False) -> str:
        """What calibration removed of identity init's perplexity increase, or that there was none to remove (the
        model's own norms are kept, or new norms at identity change little: ``recovered`` is then NaN)."""
        if not self.ppl_identity > self.ppl_original:
            return (
                f"identity init does not raise held-out perplexity ({self.ppl_original:.3f} original, "
                f"{self.ppl_identity:.3f} identity, {self.ppl_calibrated:.3f} calibrated): no increase to remove"
            )
        mark = "**" if bold else ""
        return f"calibrated init removes {mark}{100 * self.recovered:.1f}%{mark} of identity init's perplexity increase"

    def agreement_lines(self) -> list[str]:
        """The answer-agreement line beside the perplexities (none when it was not measured)."""
        a = self.agreement
        if not a:
            return []
        return [
            f"answer agreement with the original on {a['prompts']} prompts (greedy, first {a['new_tokens']} new "
            f"tokens): prefix {100 * a['prefix']:.1f}% ({a['whole']}/{a['prompts']} answers identical), "
            f"next-token top-1 {100 * a['top1']:.1f}%"
        ]

    def heal_lines(self) -> list[str]:
        """The healing line (none without healing)."""
        h = self.heal
        if not h:
            return []
        return [
            f"healed: {h['steps_per_layer']} steps per layer ({h['tokens_per_layer']:,} tokens each, from "
            f"{h['text_tokens']:,} tokens of text"
            + (
                f", the calibration text mixed with {h['generated_tokens']:,} tokens the original generated in "
                f"{h['generation_seconds']:.0f} s"
                if h.get("generated_tokens")
                else ""
            )
            + ")"
            + self._attention_kl_text(h.get("settings", {}).get("attention_kl"))
            + f", {h['seconds']:.0f} s; held-out perplexity "
            f"{h['ppl_before']:.3f} -> {h['ppl_after']:.3f} (original {h['ppl_original']:.3f}, "
            f"{h['ppl_after'] / h['ppl_original']:.3f}x), next-token top-1 agreement "
            f"{100 * h['top1_before']:.1f}% -> {100 * h['top1_after']:.1f}%; {h['layers_kept']}/"
            f"{len(h['layer_errors'])} layers kept the healed weights"
        ] + self._end_to_end_lines()

    @staticmethod
    def _attention_kl_text(kl) -> str:
        """What the layer fits' loss held besides the output error (nothing said for a report from before the
        option)."""
        if kl is None:
            return ""
        if not kl:
            return ", output error alone (no attention term)"
        return f", attention probabilities distilled (weight {kl:g})"

    def _end_to_end_lines(self) -> list[str]:
        e = (self.heal or {}).get("end_to_end")
        if not e:
            return []
        return [
            f"end-to-end: {e['steps']} steps ({e['tokens']:,} tokens), {e['seconds']:.0f} s; KL {e['kl_before']:.4f} "
            f"-> {e['kl_after']:.4f} nats/token{'' if e['kept'] else ' (not kept: the KL did not fall)'}; held-out "
            f"perplexity after the layer-wise stage {e['ppl_before']:.3f}, top-1 {100 * e['top1_before']:.1f}%"
        ]

    def summary(self) -> str:
        """The report printed by ``hf-qknorm convert``."""
        out = [
            f"perplexity on {self.eval_tokens:,} held-out tokens, in float32 (calibration used "
            f"{self.calibration_tokens:,} other tokens, {self.local_steps} layer-wise steps per layer, "
            f"{self.steps} distillation steps, {self.seconds:.0f} s):",
            self.perplexity_table(),
            self.verdict(),
            *self.heal_lines(),
            *self.agreement_lines(),
            "",
            "per-layer statistics on the calibration text (per-head RMS before RoPE, averaged over heads; output "
            "error: squared error of the attention layer's output relative to its mean square):",
            self.layer_table(),
        ]
        if self.cap is not None:
            out.append(
                f"cap c = {self.cap:g}: largest converted logit "
                f"{max((s.max_logit_converted or 0.0) for s in self.layers):.2f}"
            )
        out += [f"WARNING: {w}" for w in self.warnings]
        return "\n".join(out)


def _mean(values) -> float:
    return sum(values) / max(1, len(values))


def _rms(values) -> str:
    """The mean of per-head RMS values, or ``-`` for a role the layer does not project (a KV-shared layer's k, v)."""
    return f"{_mean(values):.3f}" if values else "-"


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


def max_logit(q: torch.Tensor, k: torch.Tensor, scaling: float) -> float:
    """Largest pre-cap logit ``scaling * q.k`` over causal pairs, signed as the converted model's and the telemetry's
    (:func:`~hf_qknorm.modeling.telemetry.head_max_logits`: the backend's mask rule and tiles); ``q`` ``(b, h, s,
    d)``, ``k`` ``(b, kv_heads, s, d)``."""
    return float(head_max_logits(q.float(), k.float(), None, scaling=scaling, causal=True).max())


class _Tap(nn.Module):
    """Stands where the scheme's norm of one role will sit, in the original model: hands each call's input ``x``
    and output ``y`` to ``sink`` and returns ``y`` -- its input unchanged, or the model's own per-head norm of it
    (``inner``), so the original model computes exactly what it did."""

    def __init__(self, role: str, inner: nn.Module | None, sink):
        super().__init__()
        self.role, self.inner, self.sink = role, inner, sink

    def forward(self, x):
        y = x if self.inner is None else self.inner(x)
        self.sink(self.role, x, y)
        return y


class ActivationRecorder:
    """Records, while the original model runs, what the scheme's norms will read in each of the layers ``indices``
    of ``model`` (an unpatched model): per role the per-head input ``x`` of the new norm and the value ``y`` the
    original model hands on at that point (``x`` itself, or its own per-head norm's output), accumulated as
    :class:`_Moments`; and the largest logit the attention backend sees (with the scaling it is passed).

    Where the new norm reads is found as patching finds it: the scheme's hooks (:mod:`hf_qknorm.portable.hooks`)
    are installed on the original attention modules with a recording identity in place of each norm (in place of
    the model's own per-head norm, which it then calls), so fused projections, per-head layouts and norms the model
    keeps over the whole projection are split exactly as in the patched model. The hooks are removed on exit. The
    logits come from the ``"qknorm"`` backend (:class:`~hf_qknorm.modeling.telemetry.LogitTap`), which the model
    must run on."""

    def __init__(self, model: nn.Module, family: Family, cfg: QKNormConfig, device: torch.device, indices: list[int]):
        self.model, self.family, self.cfg = model, family, cfg
        blocks = find_layers(model, family)
        self.indices = list(indices)
        self.attns = [getattr(blocks[i], family.attention) for i in self.indices]
        self.moments = [{r: _Moments() for r in "qkv"} for _ in self.attns]
        self.max_logit = [0.0 for _ in self.attns]
        self.scaling: list[float | None] = [None for _ in self.attns]
        config = model.config
        self.shapes = [(head_dim_of(a, config), *heads_of(a, config)) for a in self.attns]
        # per layer: a model's layers may have heads of their own width (Gemma 4's full-attention layers)
        self.norms = [_parameter_free(cfg, shape[0]).to(device) if cfg.norms_qk else None for shape in self.shapes]
        self._undo = []
        self._tap = None

    def __enter__(self):
        self._tap = LogitTap(self.model, self._logits)  # first: it reads the family off the unpatched structure
        self._tap.attach()
        for j, attn in enumerate(self.attns):
            self._undo.append(self._install(j, attn))
        return self

    def __exit__(self, *exc):
        if self._tap is not None:
            self._tap.detach()
        for attn, old in zip(self.attns, self._undo):
            restore_attention(attn, old)
        self._undo = []

    def _install(self, j: int, attn: nn.Module) -> dict:
        family = self.family
        head_dim, heads, kv_heads = self.shapes[j]
        old, norms = {}, {}
        for role in own_roles(attn, family):  # a layer reusing another's keys and values records its queries alone
            name = family.norm_slot(role)
            if role not in family.native and isinstance(attn._modules.get(name), nn.Module):
                name = f"qknorm_{role}_norm"  # a norm of the model's own the scheme does not replace (Gemma's v_norm)
            inner = attn._modules.get(name) if role in family.native else None
            old[name] = attn._modules.get(name)
            setattr(attn, name, _Tap(role, inner, self._sink(j)))
            norms[role] = name
        slots = hook_slots(family, {r for r in norms if r not in family.native})
        install(attn, slots, norms, (head_dim, heads, kv_heads, family.fused_layout), None, None)
        return old

    def _sink(self, j: int):
        heads = {"q": self.shapes[j][1], "k": self.shapes[j][2], "v": self.shapes[j][2]}

        def sink(role, x, y):
            if self.norms[j] is None:
                return
            if x.dim() == 4 and x.shape[-2] != heads[role] and x.shape[1] == heads[role]:
                x, y = x.transpose(1, 2), y.transpose(1, 2)  # a model that normalises (batch, heads, seq, dim)
            p = self.cfg.p if self.cfg.learned_logit_scale else None
            with torch.no_grad():
                self.moments[j][role].add(self.norms[j](x.detach().double()), y.detach(), p)

        return sink

    def _logits(self, index, module, q, k, mask, scaling, softcap):
        if index not in self.indices:
            return
        j = self.indices.index(index)
        top = head_max_logits(q, k, mask, scaling=float(scaling), causal=getattr(module, "is_causal", True))
        self.max_logit[j] = max(self.max_logit[j], float(top.max()))
        self.scaling[j] = float(scaling)

    def layer_stats(self) -> list[LayerStats]:
        out = []
        for j, m in enumerate(self.moments):
            rms = {r: (m[r].head_rms() if m[r].count else []) for r in "qkv"}
            out.append(LayerStats(self.indices[j], rms["q"], rms["k"], rms["v"], self.max_logit[j]))
        return out


@torch.no_grad()
def converted_max_logits(model, family, blocks, report: CalibrationReport, batch_size: int) -> None:
    """Largest pre-cap logit of every layer of the patched model (as its attention backend sees q and k:
    :class:`~hf_qknorm.modeling.telemetry.LogitTap`); with a cap, a warning for each layer where it reaches
    ``CAP_WARN_FRACTION`` of the cap."""
    seen = [0.0] * len(find_layers(model, family))

    def consume(index, attn, q, k, mask, scaling, softcap):
        top = head_max_logits(q, k, mask, scaling=float(scaling), causal=getattr(attn, "is_causal", True)).max()
        seen[index] = max(seen[index], float(top))

    tap, run = LogitTap(model, consume), text_runner(model)
    tap.attach()
    try:
        for start in range(0, len(blocks), batch_size):
            run(input_ids=blocks[start : start + batch_size].to(next(model.parameters()).device))
    finally:
        tap.detach()
    for stats, value in zip(report.layers, seen):
        stats.max_logit_converted = value
        top = max(value, stats.max_logit_original)
        if report.cap is not None and top >= CAP_WARN_FRACTION * report.cap:
            report.warnings.append(cap_warning(stats, report.cap))


def cap_warning(stats: LayerStats, c: float) -> str:
    """The warning for a layer whose largest logit (original or converted, before the cap) reaches ``c / 2``."""
    value = stats.max_logit_converted or 0.0
    top = max(value, stats.max_logit_original)
    return (
        f"layer {stats.layer}: the cap bites -- the largest logit on the calibration text is "
        f"{stats.max_logit_original:.2f} in the original model and {value:.2f} in the converted one before "
        f"the cap, and c*tanh(s/c) bends logits above c/2 = {c / 2:g} (s = {top:.2f} becomes "
        f"{c * math.tanh(top / c):.2f}); --softcap {math.ceil(2 * top)} or more keeps them nearly unchanged"
    )
