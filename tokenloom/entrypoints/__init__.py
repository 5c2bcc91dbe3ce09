"""User-facing entry points (CLI, later the Engine and HTTP server)."""
