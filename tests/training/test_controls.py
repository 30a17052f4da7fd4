"""The training controls share one protocol (hf_qknorm.training.controls) and one Trainer adapter: QK-Clip, the Q/K
learning-rate rule and the monitor together in one Trainer run, checkpointed mid-run and resumed in a fresh Trainer,
end exactly where the uninterrupted run ends -- weights, every control's state and every callback's history."""

from __future__ import annotations

import json

import pytest
import torch

import hf_qknorm
from hf_qknorm.training.controls import ControlCallback, TrainingControl
from tests._support.tiny_models import VOCAB, tiny_model
from tests._support.trainer_runs import CountingText, training_args

CALLBACKS = (hf_qknorm.QKClipCallback, hf_qknorm.QKLearningRateCallback, hf_qknorm.QKMonitorCallback)


def _trainer(out, seed=3):
    from transformers import Trainer

    model = tiny_model("llama", seed=seed)
    hf_qknorm.patch_model(model, "qk_norm_cap", softcap=20.0)
    trainer = Trainer(
        model=model,
        args=training_args(out, gradient_checkpointing=False),
        train_dataset=CountingText(),
        callbacks=[hf_qknorm.QKClipCallback(tau=1.0), hf_qknorm.QKLearningRateCallback(tau=0.5)],
    )
    hf_qknorm.QKMonitorCallback.attach(trainer, every=2, warn_logit=0.5)  # an alert that fires, then stays quiet
    return trainer


def _callbacks(trainer):
    return {type(c): c for c in trainer.callback_handler.callbacks if isinstance(c, CALLBACKS)}


def test_a_resumed_run_ends_where_the_uninterrupted_run_ends(tmp_path):
    full = _trainer(tmp_path / "full")
    full.train()
    done = _callbacks(full)
    clip, monitor = done[hf_qknorm.QKClipCallback], done[hf_qknorm.QKMonitorCallback]
    clipped_at = [h["step"] for h in clip.history]
    assert clip.clip.steps == 6 and min(clipped_at) <= 3 < max(clipped_at)  # clips on both sides of the checkpoint
    assert [h["step"] for h in monitor.history] == [1, 3, 5] and len(monitor.alerts) >= 1

    ckpt = tmp_path / "full" / "checkpoint-3"
    saved = json.loads((ckpt / "trainer_state.json").read_text())["stateful_callbacks"]
    assert saved["QKClipCallback"]["attributes"]["restored"]["control"]["steps"] == 3
    assert [h["step"] for h in saved["QKMonitorCallback"]["attributes"]["restored"]["history"]] == [1, 3]

    resumed = _trainer(tmp_path / "resumed", seed=4)  # a fresh process's view: other weights, new callbacks
    resumed.train(resume_from_checkpoint=str(ckpt))
    again = _callbacks(resumed)
    for cls in CALLBACKS:
        assert again[cls].control.state_dict() == done[cls].control.state_dict(), cls.__name__
        assert again[cls].history == done[cls].history, cls.__name__
    for (name, a), b in zip(full.model.named_parameters(), resumed.model.parameters()):
        assert torch.equal(a, b), name


def test_one_adapter_for_every_control():
    """The callbacks only say how to build their control: no Trainer event is handled twice."""
    for cls in CALLBACKS:
        assert issubclass(cls, ControlCallback)
        assert not [name for name in vars(cls) if name.startswith("on_")], cls.__name__
    model = tiny_model("llama")
    for control in (hf_qknorm.QKClip(model), hf_qknorm.QKLearningRate(model), hf_qknorm.QKMonitor(model)):
        assert isinstance(control, TrainingControl)
        json.dumps(control.state_dict())  # goes into trainer_state.json
        control.close()


def test_attach_hooks_both_optimizer_points():
    """``control.attach(optimizer)``: a plain ``optimizer.step()`` then does what ``qk.step(optimizer)`` does."""
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(0))
    runs = []
    for hooked in (False, True):
        model = tiny_model("llama", dtype=torch.float64, seed=1)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        qk = hf_qknorm.QKLearningRate(model, tau=0.3)
        handle = qk.attach(opt) if hooked else None
        for _ in range(2):
            model(ids, labels=ids).loss.backward()
            opt.step() if hooked else qk.step(opt)
            opt.zero_grad()
        if handle is not None:
            handle.remove()
            assert not opt._optimizer_step_pre_hooks and not opt._optimizer_step_post_hooks
        runs.append(model.state_dict())
    for key in runs[0]:
        assert torch.equal(runs[0][key], runs[1][key]), key


def test_monitor_every_is_checked():
    with pytest.raises(ValueError, match="every must be a positive number of steps, got 0"):
        hf_qknorm.QKMonitorCallback(every=0)
