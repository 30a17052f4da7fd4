"""The offline converter: calibration, statistics, shard-by-shard writing, export formats, model cards and Hub push.
Depends on :mod:`hf_qknorm.modeling`; nothing in the runtime depends on it."""
