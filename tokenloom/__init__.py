"""tokenloom: a CPU-first LLM serving engine in the spirit of SGLang."""

from typing import Any

__version__ = "0.1.0"
__all__ = ["Engine"]


def __getattr__(name: str) -> Any:
    if name == "Engine":  # imported lazily: `import tokenloom` stays light for subprocesses and tools
        from tokenloom.entrypoints.engine import Engine

        return Engine
    raise AttributeError(name)
