"""`NativeDecode`: a whole decode step of a small batch in one native call (csrc/decode_native.c), the CPU
counterpart of replaying a captured CUDA graph.

At batch 1 a decode step makes ~300 small kernel calls; their Python and dispatch overhead cost about as
much as streaming the weights. `NativeDecode.build` checks once, at load time, that the model and machine
fit (CPU, bfloat16, one process holding every layer, a Llama, Qwen3 or Qwen3-MoE model, the `cpu` attention
backend, the native kernels built; the KV pool bf16 or fp8, whose attention calls the fp8 kernels of
csrc/paged_attention_fp8.c); `run(batch)` then replaces `model(batch, attn_backend)` for decode batches of at most
`max_batch` requests. It runs the same kernels in the same order as the modular path. With AMX its matmuls
are the AMX kernel (csrc/amx_gemm.c), which the modular path also picks up to `cpu_gemm.AMX_M_MAX` rows, so
the two are bit-identical there; past that the modular path uses oneDNN. Without AMX the native step takes
1-4 requests and streams the weights through csrc/small_gemm.c, bit-identical to the modular path at one row
and equal up to float32 summation order at 2-4 (tests/integration/test_native_decode.py compares them). On
x86 CPUs with AVX2 but no AVX-512 (no oneDNN bf16 matmul there) both paths run every bf16 matmul, the LM head's
included, through csrc/tile_avx2.c's `avx2_bf16_linear` over the plain weight, so the two are bit-identical at
every batch size and the step takes up to `QUANT_MAX_BATCH` requests.
`--disable-native-decode` turns it off.

Quantized weights (--quantization gguf, and a Hugging Face checkpoint's integer weights re-expressed as GGUF
blocks: layers/int_quant.py): when every linear layer is kept quantized, each one is passed as a segment
descriptor and its matmul is csrc/quant_gemm.c's quant_linear, the kernel the modular path's
`quant_gemm.linear` calls, with the same row-count rule; the LM head is quantized the same way or (a float head
beside quantized layers, as GPTQ/AWQ/--torchao-config leave it) the float32-output kernel the modular path's
LM head calls; a GPTQ act-order layer's input is gathered in its columns' order first (the descriptor's input
order), as the modular path gathers it. So the two paths are bit-identical at every batch size,
and the step takes up to `QUANT_MAX_BATCH` requests. A model that mixes quantized and float linear layers (or
a quantized layer holding a float part) decodes through the modular path, as does one whose integer weights
stay on torch's kernels (w8a8_int8; no native descriptor).

Qwen3 and mixture-of-experts models (Qwen3-MoE-style: routed experts, per-head q/k norms, dense layers among
the sparse ones): the q/k norms are cpu_ops' in-place kernel and an MoE layer is csrc/quant_moe.c's block (the
router kernel, then the grouped experts), the very kernels the modular path calls, so the two stay bit-identical.
The experts must be GGUF-quantized in a type the native kernels run (a bf16 MoE decodes through the modular
path), one process (no TP: the modular path all-reduces the experts' float32 sum), no shared expert. The
attention's score scale is the modular path's own float (`scaling`), passed in: under -ffast-math a 1/sqrtf in
C is an approximate reciprocal square root, not the same float.

Tensor parallelism: each rank runs the step over its own shard (its heads, KV heads and MLP features; the
layer widths passed are the shard's), and the C loop all-reduces the outputs of o_proj and down_proj through
the TP group's shared-memory communicator (`ParallelContext.tp_comm`, distributed/shm_comm.py) — the same
all-reduce the modular path's RowParallelLinear calls, so the two paths stay comparable. The embedding's
all-reduce and the LM head's all-gather stay in Python around the call. Without a shared-memory communicator
(ranks on several hosts, --disable-custom-all-reduce) the step is not used at TP > 1: a gloo all-reduce per
half-layer costs more than the step saves.
"""

from __future__ import annotations

import ctypes
import logging
from dataclasses import fields

import torch

from tokenloom.distributed.parallel_state import SINGLE_PROCESS, ParallelContext
from tokenloom.forward_batch import ForwardBatch
from tokenloom.kernels import paged_attention, quant_gemm
from tokenloom.kernels.cpu_build import load_library
from tokenloom.kernels.quant_gemm import QuantMatrix
from tokenloom.layers import cpu_gemm
from tokenloom.layers.attention.cpu_paged import CpuDecodeMetadata, CpuPagedBackend
from tokenloom.layers.int_quant import IntQuantMatrix
from tokenloom.layers.moe import FusedMoE
from tokenloom.layers.quant_linear import QuantSegment, QuantWeight, quantized_weights
from tokenloom.model_config import ModelConfig
from tokenloom.models.llama import LlamaForCausalLM
from tokenloom.models.moe_decoder import MoEBlock, MoEForCausalLM
from tokenloom.models.qwen3 import Qwen3ForCausalLM

logger = logging.getLogger(__name__)

# The KV pool's element format as decode_forward_bf16 takes it (csrc/decode_native.c step_attention).
KV_FORMATS = {torch.bfloat16: 0, torch.float8_e4m3fn: 1, torch.float8_e5m2: 2}
DECODE_COMM_FAILED = -3  # decode_forward_bf16's return when a TP all-reduce timed out (csrc/decode_native.c)

# Requests per step up to which the native step is used. Without AMX its matmuls are the streaming kernel:
# bench/forward.py on SmolLM2 at context 256 (native vs modular, same run): 20.1 vs 26.9 ms at batch 1, 28.4
# vs 36.6 at 2, 36.0 vs 36.3 at 4, 38.5 vs 30.9 at 8, where oneDNN overtakes the streaming kernel.
MAX_BATCH = 4
# With AMX the native step's matmuls are the AMX kernel at any row count, and the step wins by 1.6x at 1-16
# requests (bench/forward.py), 1.25-1.38x at 32-128 (blocks of steps each, same runner) and breaks even at
# 256, where oneDNN's matmuls in the modular path are faster than the AMX kernel's.
AMX_MAX_BATCH = 256
# Quantized weights: both paths call the same quant_linear, so the native step only saves the modular path's
# per-call overhead and is used up to the same batch as with AMX.
QUANT_MAX_BATCH = 256


def _amx_copy(layer: torch.nn.Module) -> torch.Tensor | None:
    """The AMX tile-ordered copy of a linear layer's weight, or None."""
    packed = getattr(layer, "packed", None)
    return None if packed is None else packed.amx


def _quant_descriptor(weight: QuantWeight | None) -> torch.Tensor | None:
    """decode_native.c's descriptor of a quantized linear layer: {segment count, the address of its input order
    (an act-order layer's `in_perm`, int64; 0: none), then per segment its GGUF type, rows and the address of its
    prepared bytes}; None when the layer is not wholly quantized, a type has no native kernel here, or its
    segments take their input in different orders."""
    if weight is None:
        return None
    orders = {id(seg.in_perm): seg.in_perm for seg in weight.segments}
    if len(orders) != 1:
        return None
    order = next(iter(orders.values()))
    if order is not None and (order.dtype != torch.int64 or not order.is_contiguous()):
        return None
    values = [len(weight.segments), 0 if order is None else order.data_ptr()]
    for seg in weight.segments:
        if not isinstance(seg.weight, QuantMatrix) or not seg.weight.packed \
                or not quant_gemm.native_supported(seg.weight.qtype):
            return None
        qtype, address, rows, _ = quant_gemm.native_args(seg.weight)
        values += [qtype, rows, address]
    return torch.tensor(values, dtype=torch.int64)


def _layer_linears(layer: torch.nn.Module) -> list[torch.nn.Module]:
    """A decoder layer's linear layers in decode_native.c's field order: qkv, o, then (a dense MLP) gate_up,
    down; an MoE layer's experts are not linear layers here (see `_moe_descriptor`)."""
    attn, mlp = layer.self_attn, layer.mlp
    dense = [] if isinstance(mlp, MoEBlock) else [mlp.gate_up_proj, mlp.down_proj]
    return [attn.qkv_proj, attn.o_proj, *dense]


def _moe_descriptor(lib: ctypes.CDLL, experts: FusedMoE) -> torch.Tensor:
    """decode_native.c's MoE block descriptor (its MOE_* fields): router, sizes, and the addresses of the
    per-expert type and data tables of `experts.native_tables` (kept alive by the layer)."""
    gu_types, gu_data, down_types, down_data = experts.native_tables
    values = [experts.router.data_ptr(), experts.num_experts, experts.top_k, int(experts.renormalize),
              experts.inter_local, gu_types.data_ptr(), gu_data.data_ptr(), down_types.data_ptr(),
              down_data.data_ptr()]
    if len(values) != lib.decode_moe_fields():
        raise RuntimeError(f"decode_native.c expects {lib.decode_moe_fields()} MoE descriptor fields")
    return torch.tensor(values, dtype=torch.int64)


def _unsupported_features(cfg: ModelConfig) -> list[str]:
    """The config's family fields (window, caps, norms, ...) set away from their Llama default that the one-call
    step does not compute: it computes Llama layers, Qwen3's per-head q/k norm, and routed experts."""
    handled = _MOE_FIELDS | ({"qk_norm"} if cfg.qk_norm == "head" else set())
    odd = [f.name for f in fields(ModelConfig)
           if f.name in _FAMILY_FIELDS - handled and getattr(cfg, f.name) != f.default]
    return odd + ([f"hidden_act={cfg.hidden_act}"] if cfg.hidden_act != "silu" else [])


_MOE_FIELDS = {"num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob", "moe_layers"}
_FAMILY_FIELDS = {"qk_norm", "attn_logit_softcap", "query_pre_attn_scalar", "sliding_window", "layer_types",
                  "rope_local_theta", "no_rope_layers", "partial_rotary_factor", "norm_weight_offset",
                  "sandwich_norms", "embedding_multiplier", "final_logit_softcap", "shared_expert_intermediate_size",
                  *_MOE_FIELDS}
# The model classes whose layers the one-call step computes (their forward is LlamaForCausalLM's).
_NATIVE_MODELS = (LlamaForCausalLM, Qwen3ForCausalLM, MoEForCausalLM)


def _has_int_weights(model: torch.nn.Module) -> bool:
    return any(isinstance(seg.weight, IntQuantMatrix) for module in model.modules()
               if isinstance(getattr(module, "quant", None), QuantWeight) for seg in module.quant.segments)


def _quant_head_descriptor(model: torch.nn.Module) -> torch.Tensor | None:
    qm = model.lm_head.quant_matrix()
    return None if qm is None else _quant_descriptor(QuantWeight([QuantSegment(0, qm)]))


class NativeDecode:
    def __init__(self, lib: ctypes.CDLL, model: torch.nn.Module, kv_pool,
                 parallel: ParallelContext = SINGLE_PROCESS) -> None:
        self._lib = lib
        self._model = model
        self._parallel = parallel
        self._comm = parallel.tp_comm if parallel.tp_size > 1 else None
        cfg = model.cfg
        fields = lib.decode_layer_fields()
        rows = []
        linears = [_layer_linears(layer) for layer in model.layers]
        # The AMX kernel runs only when every linear layer has its tile-ordered copy (all or none: the
        # modular path then picks the same kernel at these row counts, and the two stay bit-identical).
        self.uses_amx = all(_amx_copy(lin) is not None for group in linears for lin in group) \
            and _amx_copy(model.lm_head) is not None
        # Quantized: every linear layer (all or none; `_unsupported` refused a mix), the LM head quantized or not.
        quant = [[_quant_descriptor(lin.quant) for lin in group] for group in linears]
        self._lm_head_q = _quant_head_descriptor(model)
        self.quantized = all(d is not None for group in quant for d in group) and bool(quant)
        self._quant_descriptors = [d for group in quant for d in group]  # kept alive: their addresses are passed
        self._moe_descriptors = [_moe_descriptor(lib, layer.mlp.experts) if isinstance(layer.mlp, MoEBlock)
                                 else None for layer in model.layers]
        for i, layer in enumerate(model.layers):
            attn = layer.self_attn
            k_buf, v_buf = kv_pool.get_kv(model.start_layer + i)
            bias = attn.qkv_proj.bias
            # a MoE layer has no MLP linears: its four MLP slots stay 0 (the C loop reads F_MOE instead)
            group = linears[i] + [None] * (4 - len(linears[i]))
            amx_ptrs = [_amx_copy(lin).data_ptr() if self.uses_amx and lin is not None else 0 for lin in group]
            weights = [0 if lin is None or lin.weight is None else lin.weight.data_ptr() for lin in group]
            quant_ptrs = [0 if d is None else d.data_ptr() for d in quant[i] + [None] * (4 - len(quant[i]))]
            q_norm, k_norm = (getattr(attn, name, None) for name in ("q_norm", "k_norm"))
            norm_ptrs = [0, 0] if q_norm is None else [q_norm.weight.data_ptr(), k_norm.weight.data_ptr()]
            moe = self._moe_descriptors[i]
            rows.append([weights[0], 0 if bias is None else bias.data_ptr(), weights[1], weights[2], weights[3],
                         layer.input_layernorm.weight.data_ptr(), layer.post_attention_layernorm.weight.data_ptr(),
                         k_buf.data_ptr(), v_buf.data_ptr(), *amx_ptrs, *quant_ptrs, *norm_ptrs,
                         0 if moe is None else moe.data_ptr()])
            if len(rows[-1]) != fields:
                raise RuntimeError(f"decode_native.c expects {fields} fields per layer")
        # The tensors whose addresses are passed stay referenced by the model and the pool for its lifetime.
        self._layer_ptrs = torch.tensor(rows, dtype=torch.int64)
        self._kv_rows = kv_pool.k_buffers[0].shape[1]
        self._vocab_rows = model.lm_head.local_vocab
        self._kv_format = KV_FORMATS[kv_pool.dtype]
        float_head = self._lm_head_q is None  # (beside quantized layers: its kernel is the modular path's)
        self._lm_head_amx = _amx_copy(model.lm_head) if self.uses_amx or (self.quantized and float_head) else None
        head_packed = model.lm_head.packed  # the LM head's float32-output copy: AMX, else feature pairs
        self._lm_head_pair = None if self._lm_head_amx is not None or head_packed is None \
            or self._lm_head_q is not None else head_packed.pair
        # AVX2 builds (no AVX-512): every bf16 matmul, the LM head's too, is csrc/tile_avx2.c's over the plain
        # weight, in both paths at every row count (where oneDNN has no bf16 matmul: the layers' weights carry
        # the AVX2 mark; an AVX2 build on a CPU whose oneDNN has one, a test configuration, keeps MAX_BATCH)
        self.uses_avx2 = (not self.quantized and not self.uses_amx and head_packed is not None and head_packed.avx2
                          and all(getattr(lin, "packed", None) is not None and lin.packed.avx2
                                  for group in linears for lin in group))
        float_head_avx2 = float_head and head_packed is not None and head_packed.avx2
        self._lm_head_plain = model.lm_head.weight if self.uses_avx2 or float_head_avx2 else None
        self._vocab = model.lm_head.vocab_size
        dense = [layer.mlp for layer in model.layers if not isinstance(layer.mlp, MoEBlock)]
        self._dims = (cfg.hidden_size, attn.num_heads, attn.num_kv_heads, cfg.head_dim,
                      dense[0].down_proj.in_local if dense else 0)
        self._eps = cfg.rms_norm_eps
        self._scale = attn.scaling  # the modular path's score scale, to the bit
        self.max_batch = (QUANT_MAX_BATCH if self.quantized or self.uses_avx2 else AMX_MAX_BATCH if self.uses_amx
                          else MAX_BATCH)

    @classmethod
    def build(cls, model: torch.nn.Module, kv_pool, attn_backend, dtype: torch.dtype, device: torch.device,
              parallel: ParallelContext = SINGLE_PROCESS) -> NativeDecode | None:
        """A native decode step for this model, or None (with the reason logged) where it does not apply.
        At tp_size > 1 every rank of the group reaches the same answer (the checks read only shapes, the
        machine and whether the group has a shared-memory communicator, all alike on every rank)."""
        reason = cls._unsupported(model, attn_backend, dtype, device, parallel)
        if reason is None and kv_pool.dtype not in KV_FORMATS:
            reason = f"a {kv_pool.dtype} KV pool (it takes bfloat16, fp8_e4m3 and fp8_e5m2)"
        lib = None if reason else load_library("kernels")
        if reason is None and lib is None:
            reason = "the native kernels are not built on this machine"
        if reason is None and _quant_head_descriptor(model) is None:  # bf16 linears need the bf16 kernels
            ok_m, ok_k = ctypes.c_int(), ctypes.c_int()
            if not lib.small_gemm_supported(ctypes.byref(ok_m), ctypes.byref(ok_k)) and cpu_gemm._avx2() is None:
                reason = "the CPU has neither AVX512-BF16 nor AVX2 (for bf16 weights)"
        if reason is not None:
            logger.info("native decode step not used: %s", reason)
            return None
        native = cls(lib, model, kv_pool, parallel)
        logger.info("native decode step used for decode batches of up to %d request(s)%s", native.max_batch,
                    " (quantized matmuls)" if native.quantized else " (AMX matmuls)" if native.uses_amx
                    else " (AVX2 matmuls)" if native.uses_avx2 else "")
        return native

    @staticmethod
    def _unsupported(model, attn_backend, dtype: torch.dtype, device: torch.device,
                     parallel: ParallelContext) -> str | None:
        if device.type != "cpu" or dtype != torch.bfloat16:
            return "needs the CPU and bfloat16"
        if not (getattr(model, "is_first", False) and getattr(model, "is_last", False)):
            return "needs every layer in this process (no pipeline parallelism)"
        if parallel.tp_size > 1 and parallel.tp_comm is None:
            return ("at tp_size > 1 it needs the shared-memory all-reduce (TP ranks on one host, without "
                    "--disable-custom-all-reduce)")
        odd = _unsupported_features(model.cfg)
        if type(model) not in _NATIVE_MODELS or odd:
            return (f"{type(model).__name__} ({model.cfg.architecture}) is not a Llama, Qwen3 or Qwen3-MoE-style "
                    f"model" + (f" (it sets {', '.join(odd)})" if odd else ""))
        moes = [layer.mlp.experts for layer in model.layers if isinstance(layer.mlp, MoEBlock)]
        if moes and parallel.tp_size > 1:
            return "a mixture-of-experts model under tensor parallelism (its all-reduce is float32)"
        if any(moe.native_tables is None for moe in moes):
            return ("its experts are not all kept quantized in types the native kernels run (the one-call step "
                    "runs GGUF-quantized experts only)")
        if _has_int_weights(model):
            return ("the weights are integer weights on torch's kernels (w8a8_int8, or a shape the GGUF blocks "
                    "do not take), for which the native step has no kernel")
        if not isinstance(attn_backend, CpuPagedBackend):
            return "needs the `cpu` attention backend"
        if model.rotary.cos.dtype != torch.float32:
            return "the rotary tables are not float32"
        if model.rotary.long_after is not None:
            return "LongRoPE picks a table per request, which the native step does not"
        linears = [lin for layer in model.layers for lin in _layer_linears(layer)]
        if quantized_weights(model)[1] and any(_quant_descriptor(lin.quant) is None for lin in linears):
            return ("some linear layers are kept quantized and others not (or a type has no native kernel here); "
                    "the native step takes all-quantized or all-bf16 linear layers")
        if _quant_head_descriptor(model) is None and model.lm_head.packed is None:
            return "the LM head has no float32-output kernel here (AMX, AVX512-BF16 or AVX2)"
        cfg, attn = model.cfg, model.layers[0].self_attn
        widths = (cfg.hidden_size, attn.num_heads * cfg.head_dim,
                  *(layer.mlp.down_proj.in_local for layer in model.layers if not isinstance(layer.mlp, MoEBlock)))
        if any(w % 32 for w in widths):
            return f"layer widths {widths} are not multiples of 32"
        return None

    def applies(self, batch: ForwardBatch) -> bool:
        return (batch.forward_mode.is_decode() and batch.batch_size <= self.max_batch
                and not batch.return_all_logits and batch.pp_proxy is None
                and isinstance(batch.attn_metadata, CpuDecodeMetadata))

    def run(self, batch: ForwardBatch, trace: torch.Tensor | None = None) -> torch.Tensor:
        """float32 logits [B, vocab] of a decode batch whose attention metadata is built. `trace` (bf16,
        [layers, 3 * B * hidden] elements) receives, per layer, its output (bf16 [B, hidden]) then its float32
        residual stream ([B, hidden], two bf16 slots per value) when given."""
        model = self._model
        rotary = model.rotary
        # positions are seq_lens - 1 (seq_lens >= 1): the largest is max_seq_len - 1; the kernel would read the
        # rotary table out of bounds beyond it (an int check: `rotary.lookup`'s min/max ops cost tens of us here)
        if batch.max_seq_len > rotary.max_positions:
            raise ValueError(f"positions outside [0, {rotary.max_positions}) (the model's context length)")
        embedded = model.embed_tokens(batch.input_ids).contiguous()
        m = embedded.shape[0]
        positions = _int64(batch.positions)
        md: CpuDecodeMetadata = batch.attn_metadata
        kv_indptr, kv_indices, out_loc = _int64(md.kv_indptr), _int64(md.kv_indices), _int64(batch.out_cache_loc)
        logits = torch.empty(m, self._vocab_rows, dtype=torch.float32)
        hidden, heads, kv_heads, head_dim, inter = self._dims
        ptr = ctypes.c_void_p
        rc = self._lib.decode_forward_bf16(
            ptr(self._layer_ptrs.data_ptr()), ctypes.c_int(len(model.layers)), ptr(model.norm.weight.data_ptr()),
            ptr(None if self._lm_head_amx is None else self._lm_head_amx.data_ptr()),
            ptr(None if self._lm_head_pair is None else self._lm_head_pair.data_ptr()),
            ptr(None if self._lm_head_q is None else self._lm_head_q.data_ptr()),
            ptr(None if self._lm_head_plain is None else self._lm_head_plain.data_ptr()),
            ctypes.c_int64(self._vocab_rows),
            ptr(rotary.cos.data_ptr()), ptr(rotary.sin.data_ptr()), ctypes.c_int(hidden), ctypes.c_int(heads),
            ctypes.c_int(kv_heads), ctypes.c_int(head_dim), ctypes.c_int(inter), ctypes.c_float(self._eps),
            ctypes.c_int64(self._kv_rows),
            ctypes.c_int(m), ptr(embedded.data_ptr()), ptr(positions.data_ptr()), ptr(kv_indptr.data_ptr()),
            ptr(kv_indices.data_ptr()), ptr(out_loc.data_ptr()), ptr(logits.data_ptr()),
            ptr(None if trace is None else trace.data_ptr()), ctypes.c_int(torch.get_num_threads()),
            *paged_attention.plan_arguments(md.shared), ptr(None if self._comm is None else self._comm.handle),
            ctypes.c_int(self._kv_format), ctypes.c_float(self._scale))
        if rc == DECODE_COMM_FAILED:
            self._comm.raise_timeout("tensor-parallel all-reduce in the native decode step")
        if rc != 0:
            raise RuntimeError("native decode step failed (unsupported shape or out of memory)")
        return self._parallel.all_gather_last_dim(logits)[:, : self._vocab]


def _int64(t: torch.Tensor) -> torch.Tensor:
    """`t` as a contiguous int64 tensor, itself when it is one: this runs after the previous step's weight
    stream, when even a no-op conversion's dispatch costs tens of microseconds."""
    return t if t.dtype == torch.int64 and t.is_contiguous() else t.to(torch.int64).contiguous()
