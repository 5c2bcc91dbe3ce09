"""User-facing entry points: the one-shot CLI, the in-process Engine, and the HTTP server."""
