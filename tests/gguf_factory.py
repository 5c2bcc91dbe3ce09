"""Tiny quantized GGUF files the tests write themselves, as llama.cpp's converter would, plus the float32
weights those files hold (the reference every quantized test compares against).

`write_gguf(path, hf_model, types)` takes a transformers Llama (tests/model_factory.py) and writes its
weights under llama.cpp's names, Q and K rows permuted as llama.cpp's convert_hf_to_gguf.py does for Llama
(so the loader's un-permute is exercised), each tensor in the type `types` picks (F32, Q8_0, Q4_0, Q4_1 via
the `gguf` package's own quantizer; Q4_K, Q5_K, Q6_K, which it cannot quantize, as random blocks with small
scales). It returns the HF-named float32 tensors that the `gguf` package dequantizes the file's bytes to:
loading them into the same transformers model gives an independent float reference of the file.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

_BLOCK = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
          "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
          "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
_GLOBAL = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
KQUANT_BYTES = {"Q2_K": 84, "Q4_K": 144, "Q5_K": 176, "Q6_K": 210}


def gguf_name(hf_name: str) -> str:
    if hf_name in _GLOBAL:
        return _GLOBAL[hf_name]
    parts = hf_name.split(".")  # model.layers.N.<module...>.weight
    return f"blk.{parts[2]}.{_BLOCK['.'.join(parts[3:-1])]}.{parts[-1]}"


def permute_qk(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter permute (rows (head, 2, dim/2) -> (head, dim/2, 2))."""
    return (w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape))


def random_kquant(qtype: str, rows: int, cols: int, seed: int) -> np.ndarray:
    """Random `qtype` blocks (uint8 [rows, row_bytes]) whose f16 scales are small and finite."""
    rng = np.random.default_rng(seed)
    blocks = rows * cols // 256
    raw = rng.integers(0, 256, size=(blocks, KQUANT_BYTES[qtype]), dtype=np.uint8)

    def f16(values: np.ndarray) -> np.ndarray:
        return values.astype(np.float16).view(np.uint8).reshape(blocks, 2)

    if qtype == "Q6_K":  # ql[128] qh[64] scales[16] (int8) d
        raw[:, 208:210] = f16(rng.uniform(2e-4, 6e-4, blocks))
    elif qtype == "Q2_K":  # scales[16] qs[64] d dmin (a type tokenloom refuses to keep quantized)
        raw[:, 80:82] = f16(rng.uniform(1e-4, 3e-4, blocks))
        raw[:, 82:84] = f16(rng.uniform(1e-4, 3e-4, blocks))
    else:  # d, dmin first, then the 6-bit scales and mins
        raw[:, 0:2] = f16(rng.uniform(1e-4, 3e-4, blocks))
        raw[:, 2:4] = f16(rng.uniform(1e-4, 3e-4, blocks))
    return raw.reshape(rows, -1)


def write_gguf(path: str, model: torch.nn.Module, types: Callable[[str], str], seed: int = 0
               ) -> dict[str, torch.Tensor]:
    """Write `model` (a transformers Llama) as a GGUF; `types(hf_name)` is the type of each 2-D weight
    (1-D tensors are F32). Returns the HF-named float32 tensors the file's bytes dequantize to."""
    import gguf

    cfg = model.config
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_rope_freq_base(float(getattr(cfg, "rope_theta", None) or 10000.0))
    writer.add_vocab_size(cfg.vocab_size)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    reference: dict[str, torch.Tensor] = {}
    for i, (name, tensor) in enumerate(model.state_dict().items()):
        if "rotary_emb" in name or (name == "lm_head.weight" and cfg.tie_word_embeddings):
            continue
        w = tensor.detach().float().numpy()
        heads = None
        if name.endswith("q_proj.weight"):
            heads = cfg.num_attention_heads
        elif name.endswith("k_proj.weight"):
            heads = cfg.num_key_value_heads
        kind = types(name) if w.ndim == 2 else "F32"
        qtype = gguf.GGMLQuantizationType[kind]
        if kind == "F32":
            data, stored = w, w
        elif kind in KQUANT_BYTES:
            data = random_kquant(kind, *w.shape, seed=seed * 1000 + i)  # the file's rows, already permuted
            stored = gguf.quants.dequantize(data, qtype).reshape(w.shape)
        else:
            data = gguf.quants.quantize(permute_qk(w, heads) if heads else w, qtype)
            stored = gguf.quants.dequantize(data, qtype).reshape(w.shape)
        if kind == "F32":
            writer.add_tensor(gguf_name(name), np.ascontiguousarray(permute_qk(w, heads) if heads else w))
        else:
            writer.add_tensor(gguf_name(name), data, raw_dtype=qtype)
        if heads and kind != "F32":  # what the file holds is permuted; the HF weight is its inverse
            rows = stored.shape[0]
            stored = stored.reshape(heads, rows // heads // 2, 2, -1).swapaxes(1, 2).reshape(stored.shape)
        reference[name] = torch.from_numpy(np.ascontiguousarray(stored, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return reference


def load_reference(model: torch.nn.Module, weights: dict[str, torch.Tensor]) -> torch.nn.Module:
    """`model` with `weights` (write_gguf's return) loaded: transformers on the file's dequantized weights."""
    state = model.state_dict()
    state.update(weights)
    if model.config.tie_word_embeddings:
        state["lm_head.weight"] = weights["model.embed_tokens.weight"]
    model.load_state_dict(state)
    return model.eval()
