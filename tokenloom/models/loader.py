"""Finding a model and building it with its weights: HF folder (safetensors), GGUF file, or dummy.

`resolve_model_source(args)` decides what the model path means (default model included), reads the
config and whether a GGUF's quantized tensors stay quantized (`--quantization`: gguf, the default for a .gguf
file, or none); `load_model(source, ...)` builds the Llama-family module for a layer range and TP shard and fills
it, logging its progress and a final line (layers, parameters, bytes, time; models/load_progress.py). Every
failure is raised at load time with the file and the problem in the message.

Hugging Face folders may hold a GPTQ/AWQ 4-bit (or GPTQ 8-bit) checkpoint (config.json's quantization_config;
models/prequant.py turns its packed tensors into `IntQuantMatrix` weights), or be quantized at load with
`--torchao-config` or `--quantization w8a8_int8` (`ModelSource.quantize_at_load`: every linear layer quantizes
its float shard in `prepare_for_inference`; the embedding and LM head stay in --dtype, as SGLang leaves them).
"""

from __future__ import annotations

import contextlib
import ctypes
import glob
import json
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from tokenloom.cache.memory_budget import model_nbytes
from tokenloom.config import PREQUANTIZED, ServerArgs
from tokenloom.distributed.parallel_state import ParallelContext
from tokenloom.model_config import ModelConfig, ModelConfigError
from tokenloom.models.default_model import resolve_model_path
from tokenloom.models.gguf_file import GGUFFile
from tokenloom.models.llama import LlamaForCausalLM
from tokenloom.models.load_progress import LoadProgress
from tokenloom.models.prequant import PrequantConfig, convert, read_quant_config, sidecar_quant_config
from tokenloom.models.registry import model_class_for

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class WeightLoadError(ValueError):
    """A weight file is missing, corrupt or does not match the config."""


@dataclass(frozen=True)
class ModelSource:
    kind: str  # "hf" (folder with config.json) or "gguf"
    path: str  # folder for hf, file for gguf
    config: ModelConfig
    load_format: str  # safetensors | gguf | dummy
    gguf: GGUFFile | None = field(default=None, compare=False, repr=False)  # parsed once, reused
    quantization: str = "none"  # gguf: the file's quantized tensors stay quantized; none: float --dtype
    quantize_at_load: str | None = None  # --torchao-config or w8a8_int8: the linear layers quantized at load
    prequant: PrequantConfig | None = None  # a GPTQ/AWQ checkpoint's quantization

    @property
    def tokenizer_dir(self) -> str:
        return self.path if self.kind == "hf" else os.path.dirname(self.path)


def resolve_model_source(args: ServerArgs) -> ModelSource:
    path = resolve_model_path(args.model_path)
    fmt = args.load_format
    if os.path.isdir(path) and not os.path.exists(os.path.join(path, "config.json")):
        ggufs = sorted(glob.glob(os.path.join(path, "*.gguf")))
        if len(ggufs) == 1:
            path = ggufs[0]
        else:
            raise ModelConfigError(f"{path}: folder has no config.json (and not exactly one .gguf file)")
    if os.path.isfile(path):
        if fmt not in ("auto", "gguf", "dummy"):
            raise ModelConfigError(f"{path}: a file needs --load-format gguf (or auto), not {fmt}")
        if args.torchao_config or args.quantization in (*PREQUANTIZED, "w8a8_int8"):
            flag = f"--torchao-config {args.torchao_config}" if args.torchao_config \
                else f"--quantization {args.quantization}"
            raise ModelConfigError(f"{path}: {flag} applies to Hugging Face checkpoints; a .gguf file keeps its "
                                   "own quantized types (--quantization gguf) or is dequantized (none)")
        gguf = GGUFFile(path)
        # Quantized kernels exist for the CPU only: on CUDA a .gguf is dequantized unless gguf is asked for.
        on_cpu = args.device == "cpu"
        quantization = args.quantization or ("gguf" if fmt != "dummy" and on_cpu and _quant_kernels(path, gguf)
                                             else "none")
        if quantization == "gguf" and not on_cpu:
            raise ModelConfigError(f"{path}: --quantization gguf (weights kept quantized) runs on the CPU only; "
                                   f"use --quantization none with --device {args.device}")
        return ModelSource("gguf", path, _with_context(gguf.model_config(), args),
                           "dummy" if fmt == "dummy" else "gguf", gguf, quantization)
    cfg_path = os.path.join(path, "config.json")
    try:
        with open(cfg_path) as f:
            raw = json.load(f)
    except json.JSONDecodeError as e:
        raise ModelConfigError(f"{cfg_path}: not valid JSON ({e})") from None
    config = ModelConfig.from_hf_dict(raw, source=cfg_path)
    if fmt == "gguf":
        raise ModelConfigError(f"{path}: --load-format gguf needs a .gguf file")
    if args.quantization == "gguf":
        raise ModelConfigError(f"{path}: --quantization gguf needs a .gguf file; a Hugging Face folder holds float "
                               "weights (leave --quantization unset, or none)")
    quant_source = cfg_path
    if not raw.get("quantization_config") and (sidecar := sidecar_quant_config(path)) is not None:
        raw, quant_source = {**raw, "quantization_config": sidecar[0]}, sidecar[1]  # AutoGPTQ / AutoAWQ's file
    prequant = read_quant_config(raw, quant_source) if fmt != "dummy" else None
    _check_hf_quantization(args, prequant, path)
    at_load = args.torchao_config or ("w8a8_int8" if args.quantization == "w8a8_int8" else None)
    return ModelSource("hf", path, _with_context(config, args), "dummy" if fmt == "dummy" else "safetensors",
                       quantization=prequant.method if prequant else args.quantization or "none",
                       quantize_at_load=at_load, prequant=prequant)


def _quant_kernels(path: str, gguf: GGUFFile) -> bool:
    """Whether this CPU runs the native quantized kernels (x86 with AVX2 or AVX-512, and a C compiler) for every
    quantized type in the file. Without them a kept-quantized weight is dequantized on every call (the
    reference), far slower than dequantizing the file once: a .gguf is then loaded dequantized unless
    --quantization gguf asks otherwise."""
    from tokenloom.kernels import quant_gemm

    if quant_gemm.native_isa() == 0:
        logger.warning("%s: this CPU has no native quantized kernels (they need x86 AVX2 or AVX-512 and a C "
                       "compiler); the weights are dequantized at load (--quantization none); --quantization gguf "
                       "keeps them quantized through the slow reference path", path)
        return False
    missing = sorted(quant_gemm.type_name(t) for t in gguf.tensor_types()
                     if t in quant_gemm.QUANT_TYPES and not quant_gemm.native_supported(t))
    if missing:
        logger.warning("%s: this CPU's native quantized kernels have no %s kernel; the weights are dequantized "
                       "at load (--quantization none); --quantization gguf keeps them quantized, those tensors "
                       "through the slow reference path", path, " / ".join(missing))
        return False
    return True


def _check_hf_quantization(args: ServerArgs, prequant: PrequantConfig | None, path: str) -> None:
    """The flags against what the checkpoint is (a float one, or GPTQ/AWQ)."""
    found = prequant.method if prequant else None
    if args.quantization in PREQUANTIZED and args.quantization != found:
        raise ModelConfigError(f"{path}: --quantization {args.quantization}, but the checkpoint is "
                               f"{found + ' quantized' if found else 'a float one (no quantization_config)'}")
    if prequant and args.quantization == "none":
        raise ModelConfigError(f"{path}: a {found} checkpoint cannot be loaded with --quantization none "
                               f"(dequantizing it at load is not implemented); leave --quantization unset")
    at_load = f"--torchao-config {args.torchao_config}" if args.torchao_config \
        else "--quantization w8a8_int8" if args.quantization == "w8a8_int8" else None
    if prequant and at_load:
        raise ModelConfigError(f"{path}: {at_load} quantizes float weights, but this checkpoint is already "
                               f"{found} quantized")
    if (prequant or at_load) and args.device != "cpu":
        raise ModelConfigError(f"{path}: {found or at_load} weights run on the CPU only (torch's CPU int4/int8 "
                               f"kernels); --device {args.device} needs a float checkpoint")


def _with_context(config: ModelConfig, args: ServerArgs) -> ModelConfig:
    """Apply --context-length (a sliding window no longer caps it: the attention backends honour windows)."""
    from dataclasses import replace

    length = args.context_length or config.max_position_embeddings
    return replace(config, max_position_embeddings=length) if length != config.max_position_embeddings \
        else config


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """`auto` is bfloat16: on this CPU (AMX) bf16 matmuls are ~3x fp32 and weights stream at half the bytes."""
    if name == "auto":
        return torch.bfloat16
    return _DTYPES[name]


def load_model(source: ModelSource, dtype: torch.dtype, device: torch.device, ctx: ParallelContext,
               start_layer: int = 0, end_layer: int | None = None, seed: int = 0) -> LlamaForCausalLM:
    cls = model_class_for(source.config.architecture)
    model = cls(source.config, ctx, dtype, start_layer, end_layer)
    progress = LoadProgress(model.required_weight_names())  # INFO lines while the tensors stream in
    if source.load_format == "dummy":
        _fill_dummy(model, seed)
    elif source.load_format == "gguf":
        gguf = source.gguf or GGUFFile(source.path)
        model.load_weights(progress.track(gguf.tensors(source.config, keep_quantized=source.quantization == "gguf")))
        gguf.release()  # the model holds copies; the map would keep the whole file resident
    else:
        tensors = _safetensors_tensors(source.path)
        model.load_weights(progress.track(convert(tensors, source.prequant) if source.prequant else tensors))
    model = model.to(device).eval()
    for name, module in model.named_modules():
        if hasattr(module, "quant_method"):  # the linear layers
            module.weight_name = f"{name}.weight"
            module.quant_method = source.quantize_at_load
    for module in model.modules():
        if hasattr(module, "prepare_for_inference"):
            module.prepare_for_inference()
    _return_freed_heap()
    progress.finished(model, dtype, model_nbytes(model),
                      what="random, --load-format dummy" if source.load_format == "dummy" else "")
    return model


def _return_freed_heap() -> None:
    """Give the heap memory the load freed (each tensor's first copy before its repacking) back to the system.
    glibc keeps freed blocks below its mmap threshold in its heap: after a 1.6 GB Q4_K_M MoE file (6144 expert
    matrices of ~0.25 MB) the process held 0.35 GB more than its tensors until trimmed. Not glibc: nothing."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).malloc_trim(0)


def _safetensors_tensors(folder: str) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    files = sorted(glob.glob(os.path.join(folder, "*.safetensors")))
    if not files:
        raise WeightLoadError(f"{folder}: no *.safetensors files (use --load-format dummy for random weights)")
    for file in files:
        try:
            handle = safe_open(file, framework="pt")
            keys = list(handle.keys())
        except Exception as e:
            raise WeightLoadError(f"{file}: corrupt or unreadable safetensors file ({e})") from None
        for key in keys:
            try:
                yield key, handle.get_tensor(key)
            except Exception as e:
                raise WeightLoadError(f"{file}: cannot read tensor {key} ({e})") from None


def _fill_dummy(model: torch.nn.Module, seed: int) -> None:
    """Random weights (std 0.02, norms at 1) reproducible from the seed; for tests and benchmarks."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("layernorm.weight") or name.endswith("norm.weight"):
            p.data.fill_(1.0)
        else:
            p.data.copy_(torch.randn(p.shape, generator=gen) * 0.02)
