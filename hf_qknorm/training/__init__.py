"""Training helpers: the attention-logit monitor, Q/K learning rates and LoRA set-up.
Depends on :mod:`hf_qknorm.modeling`; nothing in the runtime depends on it."""
