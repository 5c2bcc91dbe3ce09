"""tokenloom: a CPU-first LLM serving engine in the spirit of SGLang."""

from typing import Any

from tokenloom.version import __version__

__all__ = ["Engine", "__version__"]


def __getattr__(name: str) -> Any:
    if name == "Engine":  # imported lazily: `import tokenloom` stays light for subprocesses and tools
        from tokenloom.entrypoints.engine import Engine

        return Engine
    raise AttributeError(name)
