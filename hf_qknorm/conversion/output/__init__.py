"""Writing: safetensors shard by shard (the checkpoint's tensor names, the source norms' forms), the exported config
and remote code, the model card template and the Hub upload."""
