"""A batch's token masks: a packed int32 bitmask, one row per request (bit t of word t // 32 set: token t
allowed, the layout both backends fill), applied to float32 logits.

`apply_bitmask` sets the logits of disallowed tokens of the listed rows to -inf in place. Unpacking reads
the bitmask as bytes and looks each byte up in a 256 x 8 table of its bits (one gather, little-endian: bit t
of a word is bit t % 8 of its byte t // 8), about 10x cheaper than shifting every bit out; columns past the
bitmask's width (logits wider than the vocabulary the grammar knows: padded LM heads) are disallowed too.
On the CPU the sampler uses the native kernel instead (kernels/cpu_ops.apply_token_bitmask, the same result in
one pass over the masked rows without unpacking, ~10x cheaper at a batch of 64 over a 49k vocabulary); this
torch expression is its reference and the path everywhere else.
"""

from __future__ import annotations

import sys

import torch

_BYTE_BITS = ((torch.arange(256)[:, None] >> torch.arange(8)) & 1).bool()  # [256, 8]: bits of each byte value
assert sys.byteorder == "little", "the byte view of the int32 bitmask assumes little-endian words"


def allocate_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    """An all-allowed bitmask for `rows` requests (-1: every bit set)."""
    return torch.full((rows, (vocab_size + 31) // 32), -1, dtype=torch.int32)


def allowed_tokens(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """bool [rows, vocab]: which tokens each row allows."""
    as_bytes = bitmask.contiguous().view(torch.uint8).to(torch.int64)  # [rows, words * 4]
    allowed = _BYTE_BITS.to(bitmask.device)[as_bytes].reshape(bitmask.shape[0], -1)
    if allowed.shape[1] >= vocab:
        return allowed[:, :vocab]
    pad = torch.zeros(allowed.shape[0], vocab - allowed.shape[1], dtype=torch.bool, device=allowed.device)
    return torch.cat([allowed, pad], dim=1)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None = None) -> None:
    """Set `logits[rows[i], t]` to -inf where row i of `bitmask` disallows token t (in place). `rows`: the
    logits rows the bitmask rows belong to (None: all rows, in order)."""
    allowed = allowed_tokens(bitmask, logits.shape[1])
    if rows is None or (rows.numel() == logits.shape[0] and bool((rows == torch.arange(rows.numel())).all())):
        logits.masked_fill_(~allowed, float("-inf"))
    else:
        logits[rows] = logits[rows].masked_fill(~allowed, float("-inf"))
