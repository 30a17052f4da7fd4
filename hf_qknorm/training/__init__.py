"""Training helpers: the training controls (attention-logit monitor, Q/K learning rates, QK-Clip: one protocol and
one Trainer adapter, :mod:`.controls`), Muon and LoRA set-up.
Depends on :mod:`hf_qknorm.modeling`; nothing in the runtime depends on it."""
