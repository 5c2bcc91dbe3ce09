"""The arithmetic ceiling of a many-at-once serving workload on a GGUF model: the multiply-adds its prompt and
output tokens need, at the machine's best bf16 matmul rate measured now, give the shortest time any server
doing those multiply-adds at that rate can take, and so the most output tokens/s it can reach.

Why: a throughput target against a peer (issue 30's (e): 3x llama-server's best) can sit above what the CPU
can compute. With 64 requests in flight a step is compute-bound, not bandwidth-bound: a target needing more
output tokens/s than the ceiling cannot be met by any kernel at that precision, and the report says so in
the same run instead of leaving it to be guessed.

Invariants:
- Multiply-adds per token through the blocks: the elements of every 2-D `blk.N.*` weight (each is one
  multiply-add per token; the norms' 1-D weights and biases are not matmuls), plus attention's QK and PV
  products at the token's context: 2 x context x heads x head_dim per layer. The LM head (`output.weight`,
  else the tied `token_embd.weight`) counts once per output token (the prompt's last position gives the
  first; a server computing logits for more positions does more).
- A request of P prompt tokens and O output tokens feeds P prompt positions (contexts 1..P) and O - 1
  generated ones (contexts P + 1 .. P + O - 1). FLOPs = 2 x multiply-adds.
- Mixture-of-experts files (expert tensors `*_exps`) are refused: their per-token work depends on routing.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

_BLOCK = re.compile(r"^blk\.\d+\.")
_HEAD = "output.weight"
_EMBED = "token_embd.weight"


@dataclass(frozen=True)
class TokenWork:
    """Per-token multiply-adds of a dense GGUF model: `block_macs` through every block's matmuls, `head_macs`
    for the LM head; attention's per-context-position work is `attn_macs_per_ctx` (all layers)."""
    block_macs: int
    head_macs: int
    attn_macs_per_ctx: int


def token_work(shapes: dict[str, tuple[int, ...]], layers: int, heads: int, head_dim: int) -> TokenWork:
    """TokenWork from tensor shapes (GGUF name -> dims) and the attention geometry."""
    if any("_exps" in name for name in shapes):
        raise ValueError("mixture-of-experts tensors: per-token work depends on routing")
    block = sum(math.prod(dims) for name, dims in shapes.items() if _BLOCK.match(name) and len(dims) == 2)
    head = shapes.get(_HEAD, shapes.get(_EMBED))
    if head is None:
        raise ValueError(f"no {_HEAD} or {_EMBED}: no LM head to count")
    return TokenWork(block, math.prod(head), 2 * layers * heads * head_dim)


def workload_flops(work: TokenWork, requests: int, prompt_len: int, output_len: int) -> float:
    """FLOPs of `requests` requests of `prompt_len` prompt and `output_len` output tokens (module docstring)."""
    if prompt_len < 1 or output_len < 1:
        raise ValueError("prompt and output lengths must be at least 1")
    fed = prompt_len + output_len - 1  # positions through the blocks
    contexts = fed * (fed + 1) // 2  # sum of contexts 1 .. fed
    macs = fed * work.block_macs + contexts * work.attn_macs_per_ctx + output_len * work.head_macs
    return 2.0 * requests * macs


def gguf_token_work(path: str) -> TokenWork:
    """TokenWork of the GGUF file at `path` (its tensor shapes and attention metadata, read as the loader
    reads them)."""
    from tokenloom.models.gguf_file import GGUFFile

    gguf = GGUFFile(path)
    arch = gguf.arch
    heads = int(gguf.field(f"{arch}.attention.head_count"))
    head_dim = gguf.field(f"{arch}.attention.key_length") or int(gguf.field(f"{arch}.embedding_length")) // heads
    shapes = {t.name: tuple(int(d) for d in t.shape) for t in gguf.reader.tensors}
    return token_work(shapes, int(gguf.field(f"{arch}.block_count")), heads, int(head_dim))


def best_bf16_gflops(threads: int = 2, reps: int = 20) -> float:
    """The best GFLOP/s of `reps` 2048^3 bf16 matmuls (torch, oneDNN) on `threads` threads: the rate a
    server's two threads reach at best. Best-of, since the ceiling is an upper bound."""
    import torch

    from bench.common import _best_matmul_gflops

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return _best_matmul_gflops(2048, 2048, 2048, torch.bfloat16, reps)
    finally:
        torch.set_num_threads(before)


def ceiling_tok_s(flops: float, output_tokens: int, gflops: float) -> float:
    """Output tokens/s if `flops` ran at `gflops` with nothing else taking time."""
    if gflops <= 0:
        raise ValueError(f"matmul rate must be positive, got {gflops}")
    return output_tokens / (flops / (gflops * 1e9))
