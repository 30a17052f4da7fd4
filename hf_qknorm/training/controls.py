"""One protocol for everything that acts on a training run, and one ``Trainer`` adapter for all of them.

The model is torchtitan's ``ModelConverter`` (``protocols/model_converter.py``): a control attaches to the model
when it is built (``QKClip(model)``, ``QKLearningRate(model)``, ``QKMonitor(model)``), acts at fixed points of every
optimizer step, and carries its own ``state_dict``/``load_state_dict`` so that a checkpoint holds it. The points:

    step_begin(step)         before the step's forward passes      (QKMonitor: starts recording on its steps)
    pre_optimizer_step()     before ``optimizer.step()``           (QKLearningRate: snapshots W_Q, W_K)
    post_optimizer_step()    after ``optimizer.step()``            (QKLearningRate: rescales the update; QKClip)
    step_end(step)           after the step: a record of it or None (QKMonitor's statistics, QKClip's clipped heads)

A plain loop calls them itself, or :meth:`TrainingControl.attach` hooks the two optimizer points onto
``optimizer.step()``. :class:`ControlCallback` makes any control a ``transformers.Trainer`` callback: it builds the
control when training begins, calls the points from the Trainer's events, logs each step's record, and saves the
control's state (and the records) with every checkpoint -- ``trainer_state.json``, as an ``ExportableState`` --
taking it back on ``trainer.train(resume_from_checkpoint=...)``, so a resumed run continues as the uninterrupted one.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from torch import nn
from transformers import TrainerCallback
from transformers.trainer_callback import ExportableState

from ..modeling.sharding import refuse_engines

logger = logging.getLogger(__name__)


class TrainingControl:
    """The protocol: every point is a no-op here; a control overrides the ones it acts at."""

    def step_begin(self, step: int) -> None:
        """Before the forward passes of optimizer step ``step`` (0 for the first)."""

    def pre_optimizer_step(self) -> None:
        """Right before ``optimizer.step()``."""

    def post_optimizer_step(self) -> None:
        """Right after ``optimizer.step()`` (torchtitan's ``post_optimizer_hook``)."""

    def step_end(self, step: int) -> dict | None:
        """After the step (``step`` counts the steps done, this one included): a JSON-able record of what the
        control did or measured, or ``None``. Its numbers are logged; the record is kept in the callback's history."""
        return None

    def state_dict(self) -> dict:
        """What a checkpoint must hold to resume exactly (JSON-able: it goes into ``trainer_state.json``)."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Take back what :meth:`state_dict` returned."""

    def close(self) -> None:
        """Detach from the model; the control's results stay readable."""

    def attach(self, optimizer: torch.optim.Optimizer) -> _Handles:
        """Run :meth:`pre_optimizer_step` and :meth:`post_optimizer_step` around every ``optimizer.step()`` (step
        hooks); returns a handle whose ``remove()`` takes both off."""
        return _Handles(
            optimizer.register_step_pre_hook(lambda opt, args, kwargs: self.pre_optimizer_step()),
            optimizer.register_step_post_hook(lambda opt, args, kwargs: self.post_optimizer_step()),
        )


class _Handles:
    def __init__(self, *handles):
        self.handles = handles

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


class ControlCallback(TrainerCallback, ExportableState):
    """A :class:`TrainingControl` as a ``transformers.Trainer`` callback: ``build(model)`` makes the control when
    training begins (:attr:`control`), and :attr:`history` holds ``{"step": n, **record}`` for every step whose
    :meth:`TrainingControl.step_end` returned a record; both survive a checkpoint and resume. Arguments:
    docs/training.md (Arguments of the controls)."""

    warn_without_trainer = False  # a control whose records are for the reporters says when it cannot reach them

    def __init__(self, build: Callable[[nn.Module], TrainingControl], what: str, *, trainer=None, args=None):
        self.build, self.what, self.trainer, self.args = build, what, trainer, dict(args or {})
        self.control: TrainingControl | None = None
        self.history: list[dict] = []
        self.restored: dict | None = None  # set by the Trainer when it rebuilds the callback from a checkpoint
        self._warned = False

    # -- checkpointing (ExportableState) -----------------------------------------------------------------------------
    def state(self) -> dict:
        saved = self.restored
        if self.control is not None:
            saved = {"control": self.control.state_dict(), "history": self.history}
        return {"args": self.args, "attributes": {"restored": saved}}

    def _saved(self, state) -> dict | None:
        """This callback's state from the checkpoint being resumed, if any (whether or not the Trainer rebuilt the
        callback from it)."""
        if self.restored is not None:
            return self.restored
        entry = (getattr(state, "stateful_callbacks", None) or {}).get(type(self).__name__)
        entry = entry[0] if isinstance(entry, list) and entry else entry
        return entry.get("attributes", {}).get("restored") if isinstance(entry, dict) else None

    # -- the Trainer's events ----------------------------------------------------------------------------------------
    def on_train_begin(self, args, state, control, model=None, **kwargs):
        refuse_engines(model, self.what, args)
        self.control = self.build(model)
        saved = self._saved(state)
        if saved is not None:
            self.control.load_state_dict(saved["control"])
            self.history = [dict(entry) for entry in saved["history"]]
        self.restored = None

    def on_step_begin(self, args, state, control, **kwargs):
        self.control.step_begin(state.global_step)

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self.control.pre_optimizer_step()

    def on_optimizer_step(self, args, state, control, **kwargs):
        self.control.post_optimizer_step()

    def on_step_end(self, args, state, control, **kwargs):
        record = self.control.step_end(state.global_step)
        if record is None:
            return
        self.history.append({"step": state.global_step, **record})
        numbers = {k: v for k, v in record.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        if self.trainer is not None:
            should_log = control.should_log  # Trainer.log clears it: keep this step's own (loss) log due
            self.trainer.log(dict(numbers))
            control.should_log = should_log
            return
        if self.warn_without_trainer and not self._warned:
            self._warned = True
            logger.warning(
                f"{type(self).__name__} was added without a trainer: its records go to state.log_history and "
                f"callback.history only; use {type(self).__name__}.attach(trainer) to reach the reporters"
            )
        state.log_history.append({**numbers, "step": state.global_step})

    def on_train_end(self, args, state, control, **kwargs):
        if self.control is not None:
            self.control.close()

    @classmethod
    def attach(cls, trainer, *args, **kwargs):
        """Make the callback with ``trainer`` (its records reach the reporters) and add it; returns it."""
        callback = cls(*args, trainer=trainer, **kwargs)
        trainer.add_callback(callback)
        return callback
