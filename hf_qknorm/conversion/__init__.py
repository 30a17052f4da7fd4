"""The offline converter, one folder per job: :mod:`.orchestration` (the request, checks, destination, processes,
progress), :mod:`.calibration` (streamed layer-wise calibration), :mod:`.healing` (distillation from the original)
and :mod:`.output` (shards, export, model card, Hub). Depends on :mod:`hf_qknorm.modeling`; nothing in the runtime
depends on it."""
