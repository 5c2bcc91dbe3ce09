"""OpenAI-compatible API: schemas (protocol.py) and the serving classes behind /v1/completions and
/v1/chat/completions."""
