"""KV memory: request slots, KV slot allocators, the per-layer KV pool."""
