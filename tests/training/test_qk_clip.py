"""QK-Clip: the rescaling against a float64 reference written from the formula, the logits it leaves measured by an
attention function that materialises them (independent of the telemetry under test), GQA, biases, GPT-2's fused
c_attn, normalised models, peft, Trainer, a run whose baseline logits explode, and two gloo processes that clip
identically."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import hf_qknorm
from hf_qknorm import upstream
from hf_qknorm.portable import hooks
from hf_qknorm.reference import attention_reference
from tests._support.tiny_models import VOCAB, tiny_model
from tests._support.trainer_runs import free_port

ROOT = Path(__file__).resolve().parents[2]
CAPTURE = "qkclip_test_capture"
SEEN: dict = {}


def _capture(module, q, k, v, mask, scaling=None, dropout=0.0, softcap=None, **kwargs):
    """Plain attention that records each layer's per-head max of the materialised pre-cap logits."""
    scaling = q.shape[-1] ** -0.5 if scaling is None else scaling
    softcap = softcap if softcap is not None else getattr(module, "_qknorm_softcap", None)
    groups = q.shape[1] // k.shape[1]
    s = scaling * q.double() @ k.double().repeat_interleave(groups, 1).transpose(-1, -2)
    if mask is None:
        allowed = torch.ones(s.shape[-2:], dtype=torch.bool).tril()
    else:
        allowed = mask if mask.dtype == torch.bool else mask > torch.finfo(mask.dtype).min / 2
    per_head = s.masked_fill(~allowed, float("-inf")).amax(dim=(0, 2, 3))
    SEEN[module.layer_idx] = torch.maximum(SEEN.get(module.layer_idx, per_head), per_head)
    out = attention_reference(
        q, k, v, scaling=scaling, softcap=softcap, causal=mask is None, mask=None if mask is None else allowed
    )
    return out.transpose(1, 2).to(q.dtype), None


@pytest.fixture(autouse=True)
def capture_backend(monkeypatch):
    from transformers import AttentionInterface

    AttentionInterface.register(CAPTURE, _capture)
    monkeypatch.setattr(hooks, "CAP_READING_BACKENDS", hooks.CAP_READING_BACKENDS + (CAPTURE,))
    SEEN.clear()
    yield


def _true_maxima(model, ids, replay=None):
    """Per layer, the per-head max logit of a forward, measured by the capturing backend. QK-Clip bounds each layer
    on the input it saw, so after a clip each attention layer is ``replay``ed on its recorded input (a clipped
    earlier layer changes what later layers receive)."""
    from hf_qknorm.portable.layout import attention_modules

    backend, training = model.config._attn_implementation, model.training
    model.set_attn_implementation(CAPTURE)
    model.eval()  # QK-Clip records training forwards only: these measurements stay out of its record
    SEEN.clear()
    with torch.no_grad():
        if replay is None:
            model(ids)
        else:
            for attn, (args, kwargs) in zip(attention_modules(model)[1], replay):
                attn(*args, **kwargs)
    model.set_attn_implementation(backend)
    model.train(training)
    return [SEEN[i].clone() for i in sorted(SEEN)]


def _record_inputs(model, ids):
    """Each attention module's call arguments during one forward (to replay after a clip)."""
    from hf_qknorm.portable.layout import attention_modules

    calls, handles = [], []
    for attn in attention_modules(model)[1]:
        handles.append(
            attn.register_forward_pre_hook(
                lambda m, args, kwargs: calls.append(
                    (args, {k: v for k, v in kwargs.items() if k not in upstream.CALL_CACHE_NAMES})
                ),
                with_kwargs=True,
            )
        )
    with torch.no_grad():
        model(ids, use_cache=False)
    for h in handles:
        h.remove()
    return calls


def _big(model, factor):
    """Scale the q/k projections up so that the logits pass tau."""
    with torch.no_grad():
        for name, prm in model.named_parameters():
            if any(p in name for p in ("q_proj", "k_proj")):
                prm.mul_(factor)
            if "c_attn" in name:  # GPT-2: the Q and K columns only
                e = prm.shape[-1] // 3
                prm[..., : 2 * e].mul_(factor)
    return model


def _ids(seed=0, batch=2, seq=16):
    return torch.randint(1, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))


def _expected_rows(before, maxima, tau, alpha, heads, kv_heads, head_dim, conv1d, offset_k):
    """The formula, by hand: query head h's rows times gamma_h^alpha, key head g's rows times
    (min over its query heads of gamma_h)^(1-alpha)."""
    after = before.clone()
    groups = heads // kv_heads
    gamma = torch.clamp(tau / maxima, max=1.0)
    for h in range(heads):
        rows = slice(h * head_dim, (h + 1) * head_dim)
        if conv1d:
            after[:, rows] *= gamma[h] ** alpha
        else:
            after[rows] *= gamma[h] ** alpha
    for g in range(kv_heads):
        f = gamma[g * groups : (g + 1) * groups].min() ** (1 - alpha)
        rows = slice(offset_k + g * head_dim, offset_k + (g + 1) * head_dim)
        if conv1d:
            after[:, rows] *= f
        else:
            after[rows] *= f
    return after


@pytest.mark.parametrize("family,alpha", [("llama", 0.5), ("llama", 0.25), ("qwen2", 0.5), ("gpt2", 0.5)])
@pytest.mark.parametrize("kv_heads", [4, 2])
def test_rescaling_matches_the_formula_and_bounds_the_logits(family, alpha, kv_heads):
    if family == "gpt2" and kv_heads == 2:
        pytest.skip("GPT-2 has no GQA")
    tau = 5.0
    model = _big(
        tiny_model(family, dtype=torch.float64, **({} if family == "gpt2" else {"num_key_value_heads": kv_heads})), 20.0
    ).train()
    if family == "qwen2":
        with torch.no_grad():  # biases that matter
            for layer in model.model.layers:
                layer.self_attn.q_proj.bias.normal_(0, 2.0)
                layer.self_attn.k_proj.bias.normal_(0, 2.0)
    model.set_attn_implementation("sdpa")
    ids = _ids()
    clip = hf_qknorm.QKClip(model, tau=tau, alpha=alpha)
    true = _true_maxima(model.train(), ids)
    model(ids)  # the recorded forward (training mode)
    attn = (model.transformer.h if family == "gpt2" else model.model.layers)[0]
    attn = attn.attn if family == "gpt2" else attn.self_attn
    heads, d = 4, attn.head_dim
    kv = 4 if family == "gpt2" else kv_heads
    if family == "gpt2":
        before_w, before_b = attn.c_attn.weight.detach().clone(), attn.c_attn.bias.detach().clone()
    else:
        before = {n: getattr(attn, n).weight.detach().clone() for n in ("q_proj", "k_proj")}
        before_b = {
            n: getattr(attn, n).bias.detach().clone() for n in ("q_proj", "k_proj") if getattr(attn, n).bias is not None
        }
    for recorded, expected in zip(clip.maxima, true):
        torch.testing.assert_close(recorded, expected, rtol=1e-9, atol=1e-9)  # the telemetry, by brute force
    inputs = _record_inputs(model, ids)
    clipped = clip.step()
    assert clipped and all(s > tau for _, _, s, _ in clipped)
    if family == "gpt2":
        e = heads * d
        want = _expected_rows(before_w, true[0], tau, alpha, heads, kv, d, True, e)
        torch.testing.assert_close(attn.c_attn.weight, want)
        want_b = _expected_rows(before_b[None], true[0], tau, alpha, heads, kv, d, True, e)[0]
        torch.testing.assert_close(attn.c_attn.bias, want_b)
    else:
        both = torch.cat([before["q_proj"], before["k_proj"]])
        want = _expected_rows(both, true[0], tau, alpha, heads, kv, d, False, heads * d)
        torch.testing.assert_close(attn.q_proj.weight, want[: heads * d])
        torch.testing.assert_close(attn.k_proj.weight, want[heads * d :])
        if before_b:
            both_b = torch.cat([before_b["q_proj"], before_b["k_proj"]])[:, None]
            want_b = _expected_rows(both_b, true[0], tau, alpha, heads, kv, d, False, heads * d)[:, 0]
            torch.testing.assert_close(attn.q_proj.bias, want_b[: heads * d])
            torch.testing.assert_close(attn.k_proj.bias, want_b[heads * d :])
    after = _true_maxima(model, ids, replay=inputs)
    for layer, (old, new) in enumerate(zip(true, after)):
        assert torch.all(new <= tau * (1 + 1e-9)), (layer, new)
        if kv == heads:  # MHA: a clipped head lands exactly on tau, the others are untouched
            torch.testing.assert_close(new, torch.minimum(old, torch.full_like(old, tau)), rtol=1e-9, atol=1e-9)
    assert clip.step() == []  # the record was cleared


def test_heads_below_tau_and_eval_forwards_are_left_alone():
    model = tiny_model("llama", dtype=torch.float64).train()
    clip = hf_qknorm.QKClip(model, tau=1e4)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    model(_ids())
    assert clip.step() == [] and all(torch.equal(state[k], v) for k, v in model.state_dict().items())
    model.eval()
    _big(model, 50.0)
    model(_ids())  # evaluation forwards are not recorded
    assert clip.maxima == [None, None] and clip.step() == []


@pytest.mark.parametrize("scheme,norm", [("qk_norm_cap", "layernorm"), ("qk_norm", "rmsnorm"), ("qk_norm", "lp")])
def test_normalised_models_clip_the_shared_gains(scheme, norm):
    model = tiny_model("llama", dtype=torch.float64)
    hf_qknorm.patch_model(
        model, scheme, norm=norm, p=3.0 if norm == "lp" else None, softcap=1e6 if scheme == "qk_norm_cap" else None
    )
    with torch.no_grad():
        for name, prm in model.named_parameters():
            if "q_norm" in name or "k_norm" in name:
                prm.mul_(3.0 if prm.numel() > 1 else 1.0).add_(0.1)
    model.train()
    ids = _ids()
    true = _true_maxima(model, ids)
    tau = 0.5 * float(torch.stack(true).max())
    clip = hf_qknorm.QKClip(model, tau=tau)
    model(ids)
    inputs = _record_inputs(model, ids)
    assert clip.step()
    after = _true_maxima(model, ids, replay=inputs)
    assert all(torch.all(a <= tau * (1 + 1e-9)) for a in after)
    # the worst head of each clipped layer ends on tau
    for old, new in zip(true, after):
        if float(old.max()) > tau:
            assert float(new.max()) == pytest.approx(tau, rel=1e-9)


@pytest.mark.parametrize("model_type", ["qwen3", "gemma3_text"])
def test_a_models_own_norms_are_clipped_through_their_gains(model_type):
    """Qwen3's q/k norms compute ``w * n(x)``, Gemma 3's ``(1 + w) * n(x)``: scaling Gemma's weight by the factor
    would scale its gain by less, and the logits would stay above tau."""
    if model_type == "qwen3":
        model = tiny_model(model_type, dtype=torch.float64)
    else:
        from transformers import AutoModelForCausalLM

        from hf_qknorm.verification.tiny import tiny_config

        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(tiny_config(model_type)).to(torch.float64)
        model.set_attn_implementation("qknorm")  # the backend that reports the logits of any model type
    offset = 1.0 if model_type == "gemma3_text" else 0.0
    with torch.no_grad():
        for layer in model.model.layers:
            for norm in (layer.self_attn.q_norm, layer.self_attn.k_norm):  # gains of 6, unequal across channels
                norm.weight.copy_(6.0 + torch.linspace(-1.0, 1.0, norm.weight.numel(), dtype=torch.float64) - offset)
    model.train()
    ids = _ids()
    true = _true_maxima(model, ids)
    tau = 0.5 * float(torch.stack(true).max())
    clip = hf_qknorm.QKClip(model, tau=tau)
    model(ids)
    inputs = _record_inputs(model, ids)
    clip.step()
    after = _true_maxima(model, ids, replay=inputs)  # Gemma's norms compute in float32: float32's resolution
    assert all(torch.all(a <= tau * (1 + 1e-6)) for a in after)
    for old, new in zip(true, after):  # the worst head of each clipped layer ends on tau
        if float(old.max()) > tau:
            assert float(new.max()) == pytest.approx(tau, rel=1e-6)


def test_lora_adapted_projections_scale_exactly():
    """A projection trained in full beside its LoRA adapter: its rows, bias and the adapter's B rows all scale, so
    the adapted output scales exactly (usual LoRA, with frozen base weights: tests/training/test_qk_clip_lora.py)."""
    from peft import LoraConfig, get_peft_model

    model = _big(tiny_model("llama", dtype=torch.float64, num_key_value_heads=4), 20.0)  # MHA: exact tau
    peft_model = get_peft_model(model, LoraConfig(target_modules=["q_proj", "k_proj"], r=4, init_lora_weights=False))
    for name, prm in peft_model.named_parameters():
        if "base_layer" in name:
            prm.requires_grad_(True)
    peft_model.train()
    ids = _ids()
    inner = peft_model.get_base_model()
    true = _true_maxima(inner, ids)
    clip = hf_qknorm.QKClip(peft_model, tau=5.0)
    peft_model(ids)
    inputs = _record_inputs(inner, ids)
    clip.step()
    after = _true_maxima(inner, ids, replay=inputs)
    for old, new in zip(true, after):
        torch.testing.assert_close(new, torch.clamp(old, max=5.0), rtol=1e-9, atol=1e-9)


def test_gradient_accumulation_keeps_the_running_max():
    model = _big(tiny_model("llama", dtype=torch.float64), 20.0).train()
    clip = hf_qknorm.QKClip(model, tau=1e6)
    a, b = _ids(1), _ids(2)
    truth = [torch.maximum(x, y) for x, y in zip(_true_maxima(model, a), _true_maxima(model.train(), b))]
    model.train()
    model(a)
    model(b)
    for recorded, expected in zip(clip.maxima, truth):
        torch.testing.assert_close(recorded, expected, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_non_finite_and_non_positive_maxima_are_safe(family, caplog):
    """Megatron-LM's QK-Clip wrote NaN into the weights when a head's maximum logit was <= 0 next to a clipped head
    (a negative base under a fractional power; their PR #7517). Here: negative, zero and -inf maxima are left alone,
    NaN and +inf (an overflowed forward) are skipped with a warning rather than scaled by tau / inf = 0, and the one
    finite head above tau is clipped exactly as the formula says."""
    model = tiny_model(family, dtype=torch.float64, **({} if family == "gpt2" else {"num_key_value_heads": 4}))
    if family == "gpt2":
        with torch.no_grad():
            model.transformer.h[0].attn.c_attn.bias.normal_()  # zero at init: make the bias's scaling visible
    clip = hf_qknorm.QKClip(model.train(), tau=2.0)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    clip.maxima = [
        torch.tensor([-3.0, 0.0, float("nan"), 8.0], dtype=torch.float64),
        torch.tensor([float("inf"), -0.0, float("-inf"), 1.0], dtype=torch.float64),
    ]
    with caplog.at_level("WARNING", logger="hf_qknorm"):
        clipped = clip.step()
    assert [(i, h) for i, h, *_ in clipped] == [(0, 3)] and clipped[0][3] == pytest.approx(0.25)
    assert [(i, h) for i, h, _ in clip.last_skipped] == [(0, 2), (1, 0)]
    assert any("non-finite" in r.message for r in caplog.records)
    changed = set()
    for name, p in model.named_parameters():
        assert torch.isfinite(p).all(), name
        if not torch.equal(p, before[name]):
            changed.add(name)
    attn = model.transformer.h[0].attn if family == "gpt2" else model.model.layers[0].self_attn
    d = attn.head_dim
    if family == "gpt2":
        assert changed == {"transformer.h.0.attn.c_attn.weight", "transformer.h.0.attn.c_attn.bias"}
        w, w0 = attn.c_attn.weight, before["transformer.h.0.attn.c_attn.weight"]
        e = w.shape[1] // 3
        torch.testing.assert_close(w[:, 3 * d : 4 * d], w0[:, 3 * d : 4 * d] * 0.5)  # query head 3: 0.25 ** 0.5
        torch.testing.assert_close(w[:, e + 3 * d : e + 4 * d], w0[:, e + 3 * d : e + 4 * d] * 0.5)  # its key head
        assert torch.equal(w[:, : 3 * d], w0[:, : 3 * d]) and torch.equal(w[:, 2 * e :], w0[:, 2 * e :])
    else:
        assert changed == {"model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight"}
        torch.testing.assert_close(
            attn.q_proj.weight[3 * d :], before["model.layers.0.self_attn.q_proj.weight"][3 * d :] * 0.5
        )
        assert torch.equal(attn.q_proj.weight[: 3 * d], before["model.layers.0.self_attn.q_proj.weight"][: 3 * d])


def test_deepspeed_is_refused_by_the_weight_editing_controls():
    """ZeRO keeps fp32 master weights the rescale would not reach (Megatron-LM's QK-Clip under its distributed
    optimizer, PR #7382): refused by the Trainer callbacks (Trainer hands them the bare model) and by the classes."""
    from types import SimpleNamespace

    model = tiny_model("llama")
    for callback in (hf_qknorm.QKClipCallback(), hf_qknorm.QKLearningRateCallback()):
        with pytest.raises(NotImplementedError, match="does not support DeepSpeed"):
            callback.on_train_begin(SimpleNamespace(deepspeed="ds_config.json"), None, None, model=model)
    model.model.layers[0].self_attn.q_proj.weight.ds_id = 7  # how DeepSpeed marks the parameters it manages
    for control in (hf_qknorm.QKClip, hf_qknorm.QKLearningRate):
        with pytest.raises(NotImplementedError, match="ZeRO keeps its own fp32 master copy"):
            control(model)


def test_bad_settings_are_refused():
    model = tiny_model("llama")
    for tau in (0, -1.0, float("inf"), True):
        with pytest.raises(ValueError, match="tau must be a positive finite number"):
            hf_qknorm.QKClip(model, tau=tau)
    with pytest.raises(ValueError, match=r"alpha must be a number in \[0, 1\], got 1.5"):
        hf_qknorm.QKClipCallback(alpha=1.5)


def test_training_at_an_exploding_lr_stays_bounded():
    """At a learning rate where the unpatched model's largest logit runs away (past 10 x tau in 100 steps), QK-Clip
    keeps it bounded: each step's forward sees at most tau plus what one optimizer step adds (under 2 x tau here)."""

    def run(clip_on: bool):
        torch.manual_seed(0)
        model = tiny_model("llama", num_key_value_heads=4).train()
        opt = torch.optim.AdamW(model.parameters(), lr=0.05)
        clip = hf_qknorm.QKClip(model, tau=30.0) if clip_on else None
        tap_max = []
        monitor = hf_qknorm.QKMonitor(model)
        for step in range(100):
            ids = _ids(step, batch=4, seq=32)
            with monitor.record() as stats:
                loss = model(ids, labels=ids).loss
            tap_max.append(stats["qk/max_logit"])
            opt.zero_grad()
            loss.backward()
            opt.step()
            if clip is not None:
                clip.step()
        return tap_max, clip

    plain, _ = run(False)
    clipped, clip = run(True)
    assert max(plain) > 10 * 30.0 and plain[-1] > plain[50], plain  # the baseline's logits run away, still growing
    assert clip.clipped_steps > 0
    assert max(clipped) < 2 * 30.0, clipped


def test_trainer_callback(tmp_path):
    """QKClipCallback clips after every optimizer step of a Trainer run (gradient checkpointing on: the
    recomputation is recorded too, and changes nothing since it is the same forward)."""
    from transformers import Trainer

    from tests._support.trainer_runs import CountingText, training_args

    model = _big(tiny_model("llama", seed=3), 20.0)
    callback = hf_qknorm.QKClipCallback(tau=5.0)
    trainer = Trainer(
        model=model,
        args=training_args(tmp_path, max_steps=4, save_strategy="no"),
        train_dataset=CountingText(),
        callbacks=[callback],
    )
    trainer.train()
    clip = callback.clip
    assert clip.steps == 4 and clip.clipped_steps >= 1 and not clip._tap.attached
    ids = _ids()
    final = _true_maxima(model.train(), ids)
    assert all(torch.all(m <= 5.0 * 1.5) for m in final), final  # one optimizer step past the last clip


@pytest.mark.spawns
def test_two_processes_clip_identically(tmp_path):
    """Only rank 0's batch has the large logits; the all-reduced maxima make both ranks clip the same heads by the
    same factors, so their weights stay identical."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--master_port",
        str(free_port()),
        __file__,
        "--worker",
        str(tmp_path),
    ]
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300, cwd=ROOT)
    assert res.returncode == 0, res.stdout + res.stderr
    w0, w1 = (torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1))
    assert all(w0["local"]) and not any(w1["local"])  # rank 1 saw nothing itself
    assert w0["clipped"] and w0["clipped"] == w1["clipped"]
    for key in w0["state"]:
        assert torch.equal(w0["state"][key], w1["state"][key]), key


def _worker(out: Path) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = _big(tiny_model("llama", dtype=torch.float64), 20.0)  # same seed: same weights on both ranks
    clip = hf_qknorm.QKClip(model, tau=5.0)
    model.train(rank == 0)  # rank 1's forward is an evaluation: only rank 0 records (the large) logits
    model(_ids(rank))
    local = [m is not None for m in clip.maxima]
    clipped = clip.step()
    torch.save({"clipped": clipped, "state": model.state_dict(), "local": local}, out / f"rank{rank}.pt")
    dist.destroy_process_group()
    sys.stdout.flush()  # saved: leave without the interpreter's teardown, which gloo sometimes aborts (see
    sys.stderr.flush()  # tests/training/test_sharded.py's worker)
    os._exit(0)


if __name__ == "__main__" and "--worker" in sys.argv:
    _worker(Path(sys.argv[sys.argv.index("--worker") + 1]))
