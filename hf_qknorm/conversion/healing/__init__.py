"""Healing: the converted model's attention layers distilled from the original's, layer by layer and then
optionally end to end, on text the original model writes itself."""
