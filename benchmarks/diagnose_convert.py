"""Why a per-channel least-squares init recovers a real model poorly, and what each alternative buys.

On SmolLM2-135M-Instruct (``models/smollm2-135m``, see ``scripts/build_smollm2.py``) with ``qk_norm`` + RMSNorm,
calibrated on the first 90% of the bundled WikiText-2 text and scored on the last 10%, this script fits the new
q/k norm gains of every layer in several ways and reports held-out perplexity:

* ``identity``: gains 1 (what a conversion without calibration writes);
* ``ls``: the closed form -- per channel, least squares of the original q/k on the normalised q/k (the converter's
  first step); ``ls_head``: the same with one gain vector per head, ``(heads, head_dim)``;
* ``fit``: the layer-wise fit the converter uses -- Adam on the gains (log scale), one calibration block per step,
  minimising the attention layer's output error against the original layer on the original activations;
  ``fit_temp``: plus one logit temperature per query head; ``fit_head``: per-head gains;
  ``fit_seq``: the converted model's own activations as the inputs (GPTQ-style), targets from the original layer.

``--sinks`` also prints, for a few layers, the attention mass on the first token and the attention entropy of the
original model, the closed form and the fit. Rows are appended to ``benchmarks/results/convert_diagnosis.jsonl``.
This is a research script: per-head gains and temperatures are not a format the converter writes (see
docs/conversion.md, "Why the closed form is not enough").

    python benchmarks/diagnose_convert.py --variants ls ls_head fit fit_temp fit_head fit_seq --sinks
    python benchmarks/diagnose_convert.py --variants fit --calibration-blocks 4 8
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import platform
import sys
import time
from pathlib import Path

import torch
from torch.nn import functional as F

ROOT = Path(__file__).resolve().parent.parent
RESULTS = Path(__file__).parent / "results" / "convert_diagnosis.jsonl"
VARIANTS = ("identity", "ls", "ls_head", "fit", "fit_temp", "fit_head", "fit_seq")


def rms_n(x, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


class Gains(torch.nn.Module):
    """RMSNorm with gains ``(head_dim,)`` or ``(heads, head_dim)``, times an optional per-head temperature."""

    def __init__(self, w, eps, temp=None):
        super().__init__()
        self.weight, self.eps, self.temp = torch.nn.Parameter(w.clone()), eps, temp

    def forward(self, x):
        w = self.weight if self.temp is None else self.weight * self.temp[:, None]
        return (w * rms_n(x.float(), self.eps)).to(x.dtype)


def projections(attn, x):
    b, t, _ = x.shape
    return [F.linear(x, getattr(attn, f"{r}_proj").weight).view(b, t, -1, attn.head_dim) for r in "qkv"]


def least_squares(x, eps, per_head):
    n, y = rms_n(x.double(), eps), x.double()
    dims = (0, 1) if per_head else (0, 1, 2)
    return ((n * y).sum(dims) / (n * n).sum(dims)).float()


def attention(attn, q, k, v, wq, wk, pe, eps, rope):
    qn, kn = (rms_n(q, eps) * wq).transpose(1, 2), (rms_n(k, eps) * wk).transpose(1, 2)
    qn, kn = rope(qn, kn, *pe)
    o = F.scaled_dot_product_attention(qn, kn, v.transpose(1, 2), is_causal=True, scale=attn.scaling, enable_gqa=True)
    return F.linear(o.transpose(1, 2).reshape(q.shape[0], q.shape[1], -1), attn.o_proj.weight)


def fit(attn, x, target, pe, eps, rope, per_head, temp, steps, lr, seed):
    """Gains (and temperatures) for one layer; returns ``(wq, wk, relative error before, after)``."""
    with torch.no_grad():
        q, k, v = projections(attn, x)
    wq0, wk0 = least_squares(q, eps, per_head), least_squares(k, eps, per_head)
    tq, tk = torch.zeros_like(wq0, requires_grad=True), torch.zeros_like(wk0, requires_grad=True)
    tt = torch.zeros(q.shape[2], requires_grad=True)
    opt = torch.optim.Adam([tq, tk] + ([tt] if temp else []), lr=lr)
    denom, gen = target.pow(2).mean(), torch.Generator().manual_seed(seed)

    def gains():
        wq = wq0 * tq.exp()
        return (wq * tt.exp()[:, None] if temp else wq), wk0 * tk.exp()

    def error(idx):
        wq, wk = gains()
        return (attention(attn, q[idx], k[idx], v[idx], wq, wk, pe, eps, rope) - target[idx]).pow(2).mean() / denom

    with torch.no_grad():
        before = error(slice(None)).item()
    for step in range(steps):
        for g in opt.param_groups:
            g["lr"] = lr * 0.5 * (1 + math.cos(math.pi * step / steps))
        loss = error(torch.randint(0, len(q), (1,), generator=gen))
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        after = error(slice(None)).item()
    wq, wk = gains()
    return wq.detach(), wk.detach(), before, after


def run(args, variant, n_calib):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    import hf_qknorm
    from hf_qknorm.conversion.orchestration.texts import text_blocks
    from hf_qknorm.data import bundled_text, perplexity, split_text

    tok = AutoTokenizer.from_pretrained(args.src)
    calib_text, held = split_text(bundled_text("wikitext2"), 0.1)
    calib = text_blocks(calib_text, tok, 256, n_calib, "calibration")
    evals = text_blocks(held, tok, 256, args.eval_blocks, "held-out")
    original = AutoModelForCausalLM.from_pretrained(args.src, dtype=torch.float32).eval()
    model = AutoModelForCausalLM.from_pretrained(args.src, dtype=torch.float32).eval()
    eps = model.config.rms_norm_eps
    hf_qknorm.patch_model(model, "qk_norm", norm="rmsnorm")
    for p in [*model.parameters(), *original.parameters()]:
        p.requires_grad_(False)
    with torch.no_grad():
        h = original.model.embed_tokens(calib)
        pe = original.model.rotary_emb(h, torch.arange(h.shape[1])[None])
    h_orig, h_conv, errors, t0 = h, h.clone(), [], time.time()
    for i, (lo, lc) in enumerate(zip(original.model.layers, model.model.layers)):
        with torch.no_grad():
            x = lc.input_layernorm(h_conv) if variant == "fit_seq" else lo.input_layernorm(h_orig)
            target = lo.self_attn(x, position_embeddings=pe, attention_mask=None)[0]
        a = lc.self_attn
        if variant == "identity":
            wq = wk = torch.ones(a.head_dim)
        elif variant.startswith("ls"):
            with torch.no_grad():
                q, k, _ = projections(a, x)
            wq, wk = (least_squares(t, eps, variant == "ls_head") for t in (q, k))
        else:
            wq, wk, before, after = fit(
                a,
                x,
                target,
                pe,
                eps,
                apply_rotary_pos_emb,
                variant == "fit_head",
                variant == "fit_temp",
                args.steps,
                args.lr,
                args.seed + i,
            )
            errors.append((before, after))
        a.q_norm, a.k_norm = Gains(wq, eps), Gains(wk, eps)
        with torch.no_grad():
            h_orig = lo(h_orig, position_embeddings=pe, attention_mask=None)
            h_conv = lc(h_conv, position_embeddings=pe, attention_mask=None)
    return {
        "variant": variant,
        "calibration_blocks": n_calib,
        "eval_blocks": args.eval_blocks,
        "steps": args.steps if variant.startswith("fit") else 0,
        "lr": args.lr,
        "ppl_original": perplexity(original, evals, batch_size=4),
        "ppl_calibrated": perplexity(model, evals, batch_size=4),
        "fit_seconds": time.time() - t0,
        "layer_errors": errors,
    }


@torch.no_grad()
def sinks(args):
    """Attention on the first token and attention entropy: original, closed form, fit (layers ``--sink-layers``)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    from hf_qknorm.conversion.orchestration.texts import text_blocks
    from hf_qknorm.data import bundled_text, split_text

    tok = AutoTokenizer.from_pretrained(args.src)
    calib = text_blocks(split_text(bundled_text("wikitext2"), 0.1)[0], tok, 256, 16, "calibration")
    model = AutoModelForCausalLM.from_pretrained(args.src, dtype=torch.float32).eval().requires_grad_(False)
    eps, xs, pe = model.config.rms_norm_eps, {}, {}
    hooks = [
        model.model.layers[i].self_attn.register_forward_pre_hook(
            lambda m, a, kw, i=i: (
                xs.__setitem__(i, kw["hidden_states"]) or pe.__setitem__(0, kw["position_embeddings"])
            ),
            with_kwargs=True,
        )
        for i in args.sink_layers
    ]
    model(input_ids=calib)
    for hk in hooks:
        hk.remove()

    def probs(a, q, k, wq=None, wk=None):
        if wq is not None:
            q, k = rms_n(q, eps) * wq, rms_n(k, eps) * wk
        q, k = apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), *pe[0])
        s = (q @ k.repeat_interleave(q.shape[1] // k.shape[1], 1).transpose(-1, -2)) * a.scaling
        t = s.shape[-1]
        return s.masked_fill(~torch.ones(t, t, dtype=torch.bool).tril(), float("-inf")).softmax(-1)

    rows = []
    for i in args.sink_layers:
        a = model.model.layers[i].self_attn
        q, k, _ = projections(a, xs[i])
        target = a(xs[i], position_embeddings=pe[0], attention_mask=None)[0]
        with torch.enable_grad():
            wq, wk, _, _ = fit(
                a, xs[i], target, pe[0], eps, apply_rotary_pos_emb, False, False, args.steps, args.lr, args.seed + i
            )
        versions = {
            "original": probs(a, q, k),
            "least squares": probs(a, q, k, least_squares(q, eps, False), least_squares(k, eps, False)),
            "fit": probs(a, q, k, wq, wk),
        }
        kn = k.norm(dim=-1)
        row = {"layer": i, "key0_norm_ratio": (kn[:, 0].mean() / kn[:, 1:].mean()).item()}
        for name, p in versions.items():  # queries from position 16 on: a full context to choose from
            row[f"first_token_{name}"] = p[..., 16:, 0].mean().item()
            row[f"entropy_{name}"] = (-(p.clamp_min(1e-30).log() * p).sum(-1))[..., 16:].mean().item()
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--src", type=Path, default=ROOT / "models" / "smollm2-135m")
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    p.add_argument("--calibration-blocks", nargs="+", type=int, default=[16])
    p.add_argument("--eval-blocks", type=int, default=24)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sinks", action="store_true")
    p.add_argument("--sink-layers", nargs="+", type=int, default=[3, 8, 13, 20, 27])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--no-save", action="store_true")
    args = p.parse_args(argv)
    os.environ.setdefault("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_BF16")
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    import transformers

    meta = {
        "time": dt.datetime.now().isoformat(timespec="seconds"),
        "machine": platform.machine(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "threads": args.threads,
        "command": "python " + " ".join([os.path.relpath(__file__, ROOT), *(argv or sys.argv[1:])]),
    }
    rows = [{"kind": "sinks", **r, **meta} for r in sinks(args)] if args.sinks else []
    for n in args.calibration_blocks:
        for variant in args.variants:
            row = {"kind": "variant", **run(args, variant, n), **meta}
            o, c = row["ppl_original"], row["ppl_calibrated"]
            print(
                f"{variant:9s} calibration blocks {n:3d}: perplexity {o:.2f} -> {c:.2f} ({row['fit_seconds']:.0f} s)",
                flush=True,
            )
            rows.append(row)
    if not args.no_save:
        RESULTS.parent.mkdir(parents=True, exist_ok=True)
        with RESULTS.open("a") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
