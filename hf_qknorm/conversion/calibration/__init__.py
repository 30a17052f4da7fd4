"""Calibration: the checkpoint streamed one decoder block at a time, the new norms fitted per layer (closed form,
then to the layer's output), the statistics and report, the optional end-to-end KL polish, and the one Adam loop
every fit of a conversion runs (:mod:`.optim`)."""
