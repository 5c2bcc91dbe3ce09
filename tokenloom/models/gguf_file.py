"""Reading a llama.cpp GGUF file: model config from its metadata, HF-named tensors from its data.

`tensors(cfg, keep_quantized)`: with `keep_quantized` (--quantization gguf) every quantized 2-D tensor comes
out as a `QuantMatrix` holding the file's block bytes (one copy, the file's size), and a quantized type
tokenloom has no kernel for is a `QuantTypeError` naming the tensor and the type; float tensors (norms, F32/
F16/BF16 weights) come out as float32. Without it, every tensor is dequantized to float32 (whatever the
`gguf` package can dequantize). llama.cpp names are mapped to Hugging Face names; the Q/K row permutation
llama.cpp's converter applies to Llama-architecture checkpoints is undone (on float rows, or on whole block
rows of a `QuantMatrix`, which is exact) so RoPE sees the HF (rotate-half) layout.
"""

from __future__ import annotations

import contextlib
import gc
import re
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch

from tokenloom.kernels.quant_gemm import QUANT_TYPES, QuantMatrix, QuantSplitError, QuantTypeError, type_name
from tokenloom.model_config import ModelConfig, ModelConfigError

_GGUF_ARCH = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
              "gemma3": "Gemma3ForCausalLM",
              "qwen3": "Qwen3ForCausalLM", "smollm3": "SmolLM3ForCausalLM", "phi3": "Phi3ForCausalLM"}


def _phi3_extras(f: GGUFFile) -> dict[str, Any]:
    """llama.cpp's Phi-3 writer (convert_hf_to_gguf Phi3MiniModel): the rotated width as rope.dimension_count
    (partial rotary), the sliding window (0: none, Phi-4), and LongRoPE as two F32 tensors `rope_factors_long` /
    `rope_factors_short` with the original length and the attention factor as metadata (no scaling type)."""
    head_dim = int(f.field("phi3.embedding_length")) // int(f.field("phi3.attention.head_count"))
    out: dict[str, Any] = {}
    dims = f.field("phi3.rope.dimension_count")
    if dims:
        out["partial_rotary_factor"] = int(dims) / head_dim
    window = f.field("phi3.attention.sliding_window")
    out["sliding_window"] = int(window) if window else None
    orig = f.field("phi3.rope.scaling.original_context_length")
    if orig:
        out["original_max_position_embeddings"] = int(orig)
    factors = {t.name: t for t in f.reader.tensors if t.name in _CONFIG_TENSORS}
    if factors:
        if len(factors) != 2 or not orig:
            raise GGUFError(f"{f.path}: LongRoPE needs both rope_factors_long/short tensors and "
                            f"phi3.rope.scaling.original_context_length; found {sorted(factors)}, {orig}")
        scaling = {"rope_type": "longrope",
                   "long_factor": np.asarray(factors["rope_factors_long.weight"].data, np.float32).tolist(),
                   "short_factor": np.asarray(factors["rope_factors_short.weight"].data, np.float32).tolist()}
        attn = f.field("phi3.rope.scaling.attn_factor")
        if attn is not None:
            scaling["attention_factor"] = float(attn)
        out["rope_scaling"] = scaling
    return out


_GGUF_ARCH["qwen3moe"] = "Qwen3MoeForCausalLM"
_GGUF_ARCH["qwen2moe"] = "Qwen2MoeForCausalLM"
_GGUF_ARCH["olmoe"] = "OlmoeForCausalLM"  # (Mixtral is written as "llama" with expert tensors: _moe_extras)
# Per architecture, a function reading that architecture's own metadata keys into HF config keys.
_GGUF_EXTRAS: dict[str, Callable[[GGUFFile], dict[str, Any]]] = {
    # llama.cpp writes no NoPE metadata for smollm3 and runs every 4th layer without RoPE (its smollm3.cpp).
    "smollm3": lambda f: {"no_rope_layer_interval": 4},
    "phi3": _phi3_extras,
}
# Tensors that are configuration, read by an extras function, not weights.
_CONFIG_TENSORS = {"rope_factors_long.weight", "rope_factors_short.weight"}
# Architectures whose converter permuted Q/K rows (llama.cpp's convert_hf_to_gguf LlamaModel.permute;
# SmolLM3Model is a LlamaModel, Qwen2/Qwen3 are not).
_PERMUTED_QK = {"llama", "mistral", "smollm3"}

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",  # Qwen3: per-head q/k RMSNorm weights
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Per architecture, llama.cpp block names whose HF name differs from `_BLOCK_NAMES` (fused tensors; Gemma's
# ffn_norm is the pre-feed-forward norm).
_ARCH_BLOCK_NAMES: dict[str, dict[str, str]] = {
    "phi3": {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},  # q|k|v rows; gate|up rows
    "gemma3": {"ffn_norm": "pre_feedforward_layernorm", "post_attention_norm": "post_attention_layernorm",
               "post_ffw_norm": "post_feedforward_layernorm", "attn_q_norm": "self_attn.q_norm",
               "attn_k_norm": "self_attn.k_norm"},
}
_BLOCK_NAMES.update({  # mixture of experts (3-D *_exps tensors are split per expert by `tensors`)
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
})
# Architectures whose converter stored every RMSNorm weight as 1 + w (llama.cpp's Gemma converters); the
# model takes HF's w, so the 1 is taken off at load (exact to float32 rounding).
_NORM_SHIFTED = {"gemma3"}
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")


class GGUFError(ValueError):
    """The file is not a GGUF this loader can read; the message names the file and the problem."""


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Pause the garbage collector while a GGUF file is parsed. Readers of GGUF metadata (the gguf package's,
    also under transformers' GGUF tokenizer loading) build a few hundred thousand small objects (one per
    token string and merge of the vocabulary), none in reference cycles; with the collector on, each of its
    collections walks every object the process holds, which made a read take 5x to 60x longer in a process
    holding models (seconds became minutes)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def _reader(path: str) -> Any:
    import gguf

    try:
        with gc_paused():
            return gguf.GGUFReader(path)
    except Exception as e:  # the gguf package raises bare ValueError/struct errors on corrupt files
        raise GGUFError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e})") from None


class GGUFFile:
    """A parsed GGUF file: its metadata (the model's config, tokenizer fields) and its tensors, read through the
    gguf package's memory map of the whole file. Every tensor handed out is a copy, so `release()` after
    loading drops the map without touching the model."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._reader = _reader(path)
        self.arch = self.field("general.architecture")
        if self.arch not in _GGUF_ARCH:
            raise ModelConfigError(f"{path}: unsupported GGUF architecture {self.arch!r}; "
                                   f"supported: {', '.join(_GGUF_ARCH)}")

    @property
    def reader(self) -> Any:
        """The gguf package's reader, parsed again if `release()` dropped it."""
        if self._reader is None:
            self._reader = _reader(self.path)
        return self._reader

    def release(self) -> None:
        """Drop the reader and its memory map of the file. A process that keeps the map keeps every page of the
        file it read in its resident memory for its life (a 1.6 GB MoE file: 1.6 GB of RSS beside the weights'
        own copies); the page cache still holds the file for a later parse."""
        self._reader = None

    def field(self, key: str, default: Any = None) -> Any:
        f = self.reader.fields.get(key)
        if f is None:
            return default
        value = f.contents()
        return value

    def model_config(self) -> ModelConfig:
        return ModelConfig.from_hf_dict(self.hf_config(), source=self.path)

    def hf_config(self) -> dict[str, Any]:
        """The file's metadata as a Hugging Face config dict (`architectures`, `hidden_size`, ...), so GGUF
        and HF checkpoints go through one family parser (model_families.py). The keys every architecture
        has are read here; an architecture's own keys by its entry in `_GGUF_EXTRAS`."""
        a = self.arch

        def need(key: str) -> Any:
            value = self.field(f"{a}.{key}")
            if value is None:
                raise ModelConfigError(f"{self.path}: GGUF metadata lacks {a}.{key}")
            return value

        heads = int(need("attention.head_count"))
        hidden = int(need("embedding_length"))
        tokens = self.field("tokenizer.ggml.tokens")
        names = {t.name for t in self.reader.tensors}
        scaling = None
        scaling_type = self.field(f"{a}.rope.scaling.type")
        if scaling_type and scaling_type != "none":
            scaling = {"rope_type": scaling_type, "factor": float(self.field(f"{a}.rope.scaling.factor", 1.0))}
            orig = self.field(f"{a}.rope.scaling.original_context_length")
            if orig:
                scaling["original_max_position_embeddings"] = int(orig)
        eos = self.field("tokenizer.ggml.eos_token_id")
        config: dict[str, Any] = {
            "architectures": [_GGUF_ARCH[a]],
            "vocab_size": int(self.field(f"{a}.vocab_size") or (len(tokens) if tokens else 0)),
            "hidden_size": hidden,
            "intermediate_size": int(self.field(f"{a}.feed_forward_length") or 0),
            "num_hidden_layers": int(need("block_count")),
            "num_attention_heads": heads,
            "num_key_value_heads": int(self.field(f"{a}.attention.head_count_kv") or heads),
            "head_dim": int(self.field(f"{a}.attention.key_length") or hidden // heads),
            "rms_norm_eps": float(self.field(f"{a}.attention.layer_norm_rms_epsilon", 1e-6)),
            "rope_theta": float(self.field(f"{a}.rope.freq_base", 10000.0)),
            "rope_scaling": scaling,
            "max_position_embeddings": int(self.field(f"{a}.context_length", 2048)),
            "tie_word_embeddings": "output.weight" not in names,
            "attention_bias": "blk.0.attn_q.bias" in names,
            "bos_token_id": self.field("tokenizer.ggml.bos_token_id"),
            "eos_token_id": int(eos) if eos is not None else None,
        }
        extras = _GGUF_EXTRAS.get(a)
        if extras is not None:
            config.update(extras(self))
        return config

    def chat_template(self) -> str | None:
        return self.field("tokenizer.chat_template")

    def tensors(self, cfg: ModelConfig, keep_quantized: bool = False
                ) -> Iterator[tuple[str, torch.Tensor | QuantMatrix]]:
        """Yield (HF name, tensor) for every tensor, un-permuted: a `QuantMatrix` for a quantized 2-D tensor
        when `keep_quantized`, else float32 (see the module docstring)."""
        import gguf

        for t in self.reader.tensors:
            if t.name in _CONFIG_TENSORS:
                continue
            name = self._hf_name(t.name)
            shape = tuple(int(d) for d in reversed(t.shape.tolist()))
            shift = 1.0 if self.arch in _NORM_SHIFTED and name.endswith("norm.weight") else 0.0
            heads = None
            if self.arch in _PERMUTED_QK and name.endswith(("q_proj.weight", "k_proj.weight")):
                heads = cfg.num_attention_heads if "q_proj" in name else cfg.num_key_value_heads
            float_types = (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16,
                           gguf.GGMLQuantizationType.BF16)
            if len(shape) == 3:  # a stack of experts [E, rows, cols]: one HF per-expert tensor each
                yield from self._expert_tensors(t, name, shape, keep_quantized and t.tensor_type not in float_types)
                continue
            if keep_quantized and len(shape) == 2 and t.tensor_type not in float_types:
                yield name, self._quant_matrix(t, name, shape, heads)
                continue
            try:
                data = gguf.quants.dequantize(t.data, t.tensor_type)
            except NotImplementedError as e:
                raise GGUFError(f"{self.path}: tensor {t.name} has unsupported type "
                                f"{t.tensor_type.name}: {e}") from None
            try:
                array = np.ascontiguousarray(data, dtype=np.float32).reshape(shape)
            except ValueError as e:
                raise GGUFError(f"{self.path}: tensor {t.name} data does not fit shape {shape}: {e}") from None
            if not np.isfinite(array).all():
                raise GGUFError(f"{self.path}: tensor {t.name} ({t.tensor_type.name}) holds NaN or infinite values: "
                                "the file is corrupt or was written wrong")
            tensor = torch.from_numpy(array if array.flags.writeable else array.copy())
            if heads is not None:
                tensor = unpermute_qk(tensor, heads)
            yield name, tensor - shift if shift else tensor

    def _expert_tensors(self, t: Any, name: str, shape: tuple[int, ...], quantized: bool
                        ) -> Iterator[tuple[str, torch.Tensor | QuantMatrix]]:
        """`model.layers.N.mlp.experts.KIND.weight` [E, rows, cols] -> `...experts.{e}.KIND.weight` [rows, cols]:
        a QuantMatrix of the expert's own block rows when `quantized`, else float32."""
        import gguf

        base, kind = name.removesuffix(".weight").rsplit(".", 1)
        experts, rows, cols = shape
        if quantized:
            raw = np.asarray(t.data).reshape(experts, -1)
            for e in range(experts):
                qm = self._quant_matrix_raw(t, raw[e], f"{base}.{e}.{kind}.weight", (rows, cols))
                yield f"{base}.{e}.{kind}.weight", qm
            return
        try:
            data = gguf.quants.dequantize(t.data, t.tensor_type)
            array = np.ascontiguousarray(data, dtype=np.float32).reshape(shape)
        except (NotImplementedError, ValueError) as e:
            raise GGUFError(f"{self.path}: tensor {t.name} ({t.tensor_type.name}) cannot be read as {shape}: {e}"
                            ) from None
        if not np.isfinite(array).all():
            raise GGUFError(f"{self.path}: tensor {t.name} ({t.tensor_type.name}) holds NaN or infinite values: "
                            "the file is corrupt or was written wrong")
        for e in range(experts):
            yield f"{base}.{e}.{kind}.weight", torch.from_numpy(array[e].copy())

    def _quant_matrix_raw(self, t: Any, raw: Any, name: str, shape: tuple[int, int]) -> QuantMatrix:
        qtype = int(t.tensor_type)
        if qtype not in QUANT_TYPES:
            raise QuantTypeError(
                f"{self.path}: tensor {t.name} ({name}) is {t.tensor_type.name}, a type tokenloom does not keep "
                f"quantized (it keeps {', '.join(n for n, _, _ in QUANT_TYPES.values())}); run with "
                "--quantization none to dequantize the file to --dtype at load")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # a read-only memory map; from_gguf copies it
            return QuantMatrix.from_gguf(qtype, shape, raw, f"{self.path}: tensor {t.name}")

    def _quant_matrix(self, t: Any, name: str, shape: tuple[int, int], heads: int | None) -> QuantMatrix:
        qtype = int(t.tensor_type)
        if qtype not in QUANT_TYPES:
            raise QuantTypeError(
                f"{self.path}: tensor {t.name} ({name}) is {t.tensor_type.name}, a type tokenloom does not keep "
                f"quantized (it keeps {', '.join(n for n, _, _ in QUANT_TYPES.values())}); run with "
                "--quantization none to dequantize the file to --dtype at load")
        with warnings.catch_warnings():
            # The reader's bytes are a read-only memory map, which torch warns about; from_gguf copies them.
            warnings.simplefilter("ignore", UserWarning)
            qm = QuantMatrix.from_gguf(qtype, shape, t.data, f"{self.path}: tensor {t.name}")
        if heads is not None:
            # The permutation moves whole rows, so undoing it on the quantized rows is exact.
            qm = qm.permute_rows(unpermute_qk(torch.arange(qm.rows), heads))
        return qm

    def tensor_types(self) -> set[int]:
        """The GGML type ids of the file's tensors (F32, F16, the quantized ones)."""
        return {int(t.tensor_type) for t in self.reader.tensors}

    def check_tp_split(self, tp_size: int, ep_size: int = 1) -> None:
        """Refuse, before any rank loads, a --tp-size whose row-parallel split (input features) of a
        kept-quantized tensor would cut a block; the rank's own load raises the same. Split that way: o_proj,
        down_proj, a shared expert's down_proj, and the routed experts' down_proj (each rank a slice of every
        expert) unless expert parallelism (`ep_size` > 1) gives each rank whole experts."""
        split = {"attn_output", "ffn_down", "ffn_down_shexp"} | ({"ffn_down_exps"} if ep_size == 1 else set())
        for t in self.reader.tensors:
            m = _BLOCK_RE.match(t.name)
            qtype = int(t.tensor_type)
            if not m or m.group(2) not in split or qtype not in QUANT_TYPES:
                continue
            cols, block = int(t.shape[0]), QUANT_TYPES[qtype][1]
            if cols % tp_size or (cols // tp_size) % block:
                hint = " or give each rank whole experts (--ep-size)" if m.group(2) == "ffn_down_exps" else ""
                raise QuantSplitError(
                    f"{self.path}: tensor {t.name} ({type_name(qtype)}): --tp-size {tp_size} splits its {cols} "
                    f"input features into shards of {cols / tp_size:g}, which cuts its {block}-element "
                    f"{type_name(qtype)} blocks; choose a tp-size that divides {cols // block} blocks{hint}, or "
                    "run with --quantization none (weights dequantized to --dtype at load)")

    def _hf_name(self, name: str) -> str:
        if name in _GLOBAL_NAMES:
            return _GLOBAL_NAMES[name]
        m = _BLOCK_RE.match(name)
        names = {**_BLOCK_NAMES, **_ARCH_BLOCK_NAMES.get(self.arch, {})}
        if not m or m.group(2) not in names:
            raise GGUFError(f"{self.path}: unexpected tensor {name!r}")
        return f"model.layers.{m.group(1)}.{names[m.group(2)]}.{m.group(3)}"


def _gemma3_extras(f: GGUFFile) -> dict[str, Any]:
    """llama.cpp's gemma3 keys, read as its loader does: the window (absent: every layer global), the
    sliding pattern (a per-layer bool array, else every 6th layer global), the sliding layers' RoPE base
    (default 10000), the final soft-cap; the query scale is not stored: head_dim ** -0.5, or
    (hidden / heads) ** -0.5 for the 62-layer 27B model (llama.cpp's rule, after gemma_pytorch)."""
    a = f.arch
    layers = int(f.field(f"{a}.block_count"))
    heads = int(f.field(f"{a}.attention.head_count"))
    hidden = int(f.field(f"{a}.embedding_length"))
    head_dim = int(f.field(f"{a}.attention.key_length") or hidden // heads)
    window = f.field(f"{a}.attention.sliding_window")
    pattern = f.field(f"{a}.attention.sliding_window_pattern")
    if not window:
        types = ["full_attention"] * layers
    elif isinstance(pattern, list):
        types = ["sliding_attention" if p else "full_attention" for p in pattern]
    else:  # llama.cpp: layer i slides when n == 0 or i % n < n - 1
        n = 6 if pattern is None else int(pattern)
        types = ["sliding_attention" if n == 0 or (i + 1) % n else "full_attention" for i in range(layers)]
    return {
        "sliding_window": int(window) if window else None,
        "layer_types": types,
        "rope_local_base_freq": float(f.field(f"{a}.rope.freq_base_swa", 10000.0)),
        "final_logit_softcapping": f.field(f"{a}.final_logit_softcapping"),
        "query_pre_attn_scalar": hidden // heads if layers == 62 else head_dim,
    }


_GGUF_EXTRAS["gemma3"] = _gemma3_extras


def unpermute_qk(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Inverse of llama.cpp's permute: rows (head, dim/2, 2) -> (head, 2, dim/2)."""
    rows = w.shape[0]
    return (w.reshape(num_heads, rows // num_heads // 2, 2, *w.shape[1:]).transpose(1, 2)
            .reshape(w.shape))


def _moe_extras(f: GGUFFile) -> dict[str, Any]:
    """Expert counts, the expert FFN width, and which layers are sparse (those with a router tensor). The
    router renormalisation llama.cpp applies per architecture (src/models/*.cpp: qwen3moe and Mixtral's
    llama renormalise the top-k weights, qwen2moe and olmoe do not) is what the file means."""
    a = f.arch
    experts = f.field(f"{a}.expert_count")
    if not experts:
        return {}
    names = {t.name for t in f.reader.tensors}
    layers = int(f.field(f"{a}.block_count") or 0)
    sparse = [i for i in range(layers) if f"blk.{i}.ffn_gate_inp.weight" in names]
    expert_ff = f.field(f"{a}.expert_feed_forward_length") or f.field(f"{a}.feed_forward_length")
    config: dict[str, Any] = {"num_experts": int(experts), "num_local_experts": int(experts),
                              "num_experts_per_tok": int(f.field(f"{a}.expert_used_count") or 0),
                              "moe_intermediate_size": int(expert_ff),
                              "norm_topk_prob": a in ("qwen3moe", "llama"),
                              "mlp_only_layers": [i for i in range(layers) if i not in sparse]}
    if a == "llama":
        config["architectures"] = ["MixtralForCausalLM"]
    if a == "qwen2moe":
        config["qkv_bias"] = "blk.0.attn_q.bias" in names
        config["shared_expert_intermediate_size"] = int(f.field(f"{a}.expert_shared_feed_forward_length") or 0)
    return config


def _both(first: Callable[[GGUFFile], dict[str, Any]], second: Callable[[GGUFFile], dict[str, Any]]
          ) -> Callable[[GGUFFile], dict[str, Any]]:
    return lambda f: {**first(f), **second(f)}


for _arch in ("qwen3moe", "qwen2moe", "olmoe", "llama"):  # beside any other reader of the arch's keys
    _GGUF_EXTRAS[_arch] = _both(_GGUF_EXTRAS[_arch], _moe_extras) if _arch in _GGUF_EXTRAS else _moe_extras
