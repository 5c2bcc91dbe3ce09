"""tokenloom: a CPU-first LLM serving engine in the spirit of SGLang."""

__version__ = "0.1.0"
