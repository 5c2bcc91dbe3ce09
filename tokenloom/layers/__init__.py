"""Model building blocks, written for tensor parallelism (plain at tp_size 1)."""
