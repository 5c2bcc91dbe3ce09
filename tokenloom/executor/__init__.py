"""Device-side execution: ForwardBatch and the ModelRunner that runs it."""
