"""Calibration layer by layer, streaming the checkpoint: memory for one block, whatever the depth.

:func:`calibrate_checkpoint` never holds the model. It embeds the calibration and held-out blocks, then for each
decoder block in turn (:class:`hf_qknorm.conversion.calibration.streaming.StreamedCheckpoint`):

1. materialises the original block and the patched block from the source files;
2. runs the original block on the calibration activations that reach it, recording per-head q/k/v statistics
   (:class:`hf_qknorm.conversion.calibration.stats.ActivationRecorder`), the original attention layer's outputs (the
   targets) and the patched attention layer's inputs;
3. sets the new norms to the closed-form fit, then fits them to the original attention outputs
   (:mod:`hf_qknorm.conversion.calibration.localfit`);
4. moves every stream one block on -- the calibration activations through the original block, the held-out
   activations through the original block and through the patched block with identity, closed-form and calibrated
   norms -- and releases the block.

At the end the final norm and output head score the four held-out streams: the perplexity report (original,
identity init, least-squares init, calibrated init) costs no extra pass over the model. The calibration inputs of
each block are the original model's activations (each layer is fitted to the original layer on the same inputs);
on SmolLM2-135M feeding the converted model's activations instead gave no better a result (docs/conversion.md).
"""

from __future__ import annotations

import logging
import time

import torch

from ...modeling.telemetry import LogitTap, head_max_logits
from ...portable.schemes import QKNormConfig
from ..orchestration.progress import Stage
from .localfit import closed_form, fit_attention, norm_parameters, store_shared
from .stats import CAP_WARN_FRACTION, ActivationRecorder, CalibrationReport, cap_warning
from .streaming import FIT, BlockCall, StreamedCheckpoint, run_block, run_blocks, run_capturing

logger = logging.getLogger("hf_qknorm.conversion")

STREAMS = ("original", "identity", "least_squares", "calibrated")


def identity_values(stream: StreamedCheckpoint) -> dict[str, torch.Tensor]:
    """Identity init of every new norm parameter (weight 1, bias 0; Henry et al.'s logit scale for ``l2``/``lp``),
    by state-dict name. Where a new norm takes the place of the model's own per-head norm its start is that norm's
    gain (and bias), read when its layer is materialised (:meth:`StreamedCheckpoint.native_values`)."""
    from ...portable.norms import initial_value
    from .calibrate import new_norm_parameters

    return {
        name: torch.full(prm.shape, initial_value(stream.patched, name))
        for name, prm in new_norm_parameters(stream.patched).items()
    }


def calibrate_checkpoint(
    stream: StreamedCheckpoint,
    cfg: QKNormConfig,
    calib_blocks: torch.Tensor,
    eval_blocks: torch.Tensor,
    settings,
    progress: bool = True,
):
    """Calibrate every new norm of ``stream``'s patched model layer by layer (module docstring).

    Returns ``(values, report)``: the calibrated values by state-dict name (float32, on the CPU) and the
    :class:`CalibrationReport`."""
    t0 = time.time()
    ident = identity_values(stream)
    values = {k: v.clone() for k, v in ident.items()}
    least_squares = {k: v.clone() for k, v in ident.items()}
    with stream.outer():
        calib, calib_calls = stream.block_inputs(calib_blocks, 1)  # one block per call: one block per fit step
        held, eval_calls = stream.block_inputs(eval_blocks, settings.batch_size)
    # soft_cap adds no weights: identity, least squares and calibrated are one model, scored once
    names = STREAMS if ident else ("original", "identity")
    streams = {name: [h.clone() for h in held] for name in names}
    logger.log(
        logging.INFO if progress else logging.DEBUG,
        "calibration: %d blocks of %d tokens, %d held-out blocks, %d layers, %d layer-wise steps per layer, "
        "on %s with %d thread(s); embedded in %.1f s",
        len(calib_blocks),
        calib_blocks.shape[1],
        len(eval_blocks),
        stream.num_layers,
        settings.local_steps,
        stream.device,
        torch.get_num_threads(),
        time.time() - t0,
    )
    layers = []
    with Stage("calibrating layer by layer", stream.num_layers, "layers", progress) as stage:
        for i, orig, patched in stream.layers(ident):
            carried = stream.native_values(i)  # the model's own per-head norms: the new norms start from them
            ident.update(carried)
            values.update(carried)
            stream.set_values(carried)
            stats, calib = _fit_layer(stream, i, orig, patched, calib, calib_calls[i], cfg, settings, stage)
            for name in stream.layer_values(values, i):
                values[name] = stream.patched.get_parameter(name).detach().float().cpu().clone()
            least_squares.update(stats.pop("least_squares"))
            versions = {
                "identity": stream.layer_values(ident, i),
                "least_squares": stream.layer_values(least_squares, i),
                "calibrated": stream.layer_values(values, i),
            }
            _advance_eval(
                stream,
                orig,
                patched,
                streams,
                eval_calls[i],
                {k: versions[k] for k in names[1:]},
                lambda name, i=i: stage.update(0, note=f"layer {i}: held-out {name}"),
            )
            layers.append(stats["layer"])
            stage.update(
                1,
                note=f"layer {i}: output error {stats['layer'].fit_error_closed_form:.4f} -> "
                f"{stats['layer'].fit_error:.4f}",
            )
    with stream.outer():
        ppl = {name: stream.score(streams[name], eval_blocks, settings.batch_size)[0] for name in names}
    report = _report(cfg, ppl, calib_blocks, eval_blocks, layers, settings.local_steps if ident else 0)
    report.seconds = time.time() - t0
    return values, report


def _report(cfg, ppl: dict, calib_blocks, eval_blocks, layers, local_steps: int) -> CalibrationReport:
    for name in STREAMS:
        ppl.setdefault(name, ppl["identity"])
    report = CalibrationReport(
        scheme=cfg.to_dict(),
        ppl_original=ppl["original"],
        ppl_identity=ppl["identity"],
        ppl_least_squares=ppl["least_squares"],
        ppl_calibrated=ppl["calibrated"],
        calibration_tokens=calib_blocks.numel(),
        eval_tokens=eval_blocks[:, 1:].numel(),
        steps=0,
        kl_start=None,
        kl_end=None,
        seconds=0.0,
        layers=layers,
        cap=cfg.softcap,
        local_steps=local_steps,
    )
    for s in layers:
        top = max(s.max_logit_converted or 0.0, s.max_logit_original)
        if report.cap is not None and top >= CAP_WARN_FRACTION * report.cap:
            report.warnings.append(cap_warning(s, report.cap))
    return report


def _fit_layer(stream, i, orig, patched, calib, calls: list[BlockCall], cfg, settings, stage):
    """Statistics, closed form and local fit of layer ``i``; returns its stats and the calibration activations
    after the original block."""
    family = stream.family
    o_attn, p_attn = getattr(orig, family.attention), getattr(patched, family.attention)
    recorder = ActivationRecorder(stream.original, family, cfg, stream.device, indices=[i])
    with torch.no_grad(), recorder:
        targets, out = run_capturing(orig, o_attn, calib, calls, "original")
        attn_calls = [attention_call(patched, p_attn, h, call) for h, call in zip(calib, calls)]
    stage.update(0, note=f"layer {i}: statistics")
    layer = recorder.layer_stats()[0]
    start = {k: p.detach().clone() for k, p in norm_parameters(p_attn).items()}  # identity, or the model's own norms
    closed_form(p_attn, recorder.moments[0], recorder.scaling[0] if recorder.scaling[0] is not None else 1.0)
    prefix = f"{stream.prefix}{i}.{family.attention}."
    ls = {prefix + k: p.detach().float().cpu().clone() for k, p in norm_parameters(p_attn).items()}
    every = max(1, settings.local_steps // 4)
    fit = fit_attention(
        p_attn,
        attn_calls,
        targets,
        steps=settings.local_steps,
        lr=settings.local_lr,
        seed=settings.seed + i,
        start=start,
        on_step=lambda s: (
            stage.update(0, note=f"layer {i}: step {s + 1}/{settings.local_steps}") if (s + 1) % every == 0 else None
        ),
    )
    layer.fit_error_closed_form, layer.fit_error = fit.error_closed_form, fit.error
    store_shared(p_attn, attn_calls)
    layer.max_logit_converted = _max_logit(stream, p_attn, attn_calls)
    return {"layer": layer, "least_squares": ls}, out


class _Stop(Exception):
    pass


def attention_call(block, attn, hidden, call: BlockCall, stream: str = FIT) -> BlockCall:
    """The arguments ``block``'s forward hands its attention module for ``hidden`` (the block stops there), in
    stream ``stream`` (by default the fits', :data:`~hf_qknorm.conversion.calibration.streaming.FIT`): a mapping the
    blocks share is that stream's copy, so a layer reading keys an earlier layer stored reads that stream's."""
    seen = {}

    def pre(module, args, kwargs):
        seen["call"] = BlockCall(tuple(a.detach() if torch.is_tensor(a) else a for a in args), dict(kwargs), True)
        raise _Stop

    handle = attn.register_forward_pre_hook(pre, with_kwargs=True)
    try:
        run_block(block, hidden, call, stream)
    except _Stop:
        pass
    finally:
        handle.remove()
    return seen["call"]


@torch.no_grad()
def _max_logit(stream, attn, calls: list[BlockCall]) -> float:
    """Largest pre-cap logit of the patched ``attn`` over the calibration calls, as its backend sees q and k."""
    from .localfit import attention_output

    best = [0.0]
    index = next(j for j, b in enumerate(stream.patched_blocks) if getattr(b, stream.family.attention) is attn)

    def consume(idx, module, q, k, mask, scaling, softcap):
        if idx == index:
            top = head_max_logits(q, k, mask, scaling=float(scaling), causal=getattr(module, "is_causal", True))
            best[0] = max(best[0], float(top.max()))

    tap = LogitTap(stream.patched, consume)
    tap.attach()
    try:
        for call in calls:
            attention_output(attn, call)
    finally:
        tap.detach()
    return best[0]


@torch.no_grad()
def _advance_eval(stream, orig, patched, streams, calls: list[BlockCall], versions: dict, tick) -> None:
    """Move the held-out streams one block on: the original block, and the patched block with each version of the
    new norms (``tick(name)`` after each: a heartbeat for the log)."""
    streams["original"] = run_blocks(orig, streams["original"], calls, "original")
    tick("original")
    for name, vals in versions.items():
        stream.set_values(vals)
        streams[name] = run_blocks(patched, streams[name], calls, name)
        tick(name)
