"""Rotary position embedding (NeoX/HF "rotate half" layout) with the config's theta, scaling and rotary width.

Supported `rope_scaling` types, each computed as transformers 5.24's rope init functions compute it
(modeling_rope_utils.py): none/default; `linear` (positions divided by the factor); `llama3` (frequency-
dependent interpolation); `yarn` (NTK-by-parts with beta_fast/beta_slow, `truncate`, and its attention factor
from `factor`/`mscale`/`mscale_all_dim` or given, which scales cos and sin); `longrope` and its older name `su`
(Phi-3: per-frequency `short_factor`/`long_factor`, attention factor sqrt(1 + ln(factor)/ln(original length)));
`dynamic` (NTK) only within the config's max_position_embeddings, where transformers leaves the frequencies at
their default values (it rescales only a forward longer than that, so a longer --context-length is refused).
Anything else is a start-up `ModelConfigError` naming the type, never a mid-request failure.

Partial rotary (`partial_rotary_factor` < 1, Phi-4-mini): only the first int(head_dim * factor) elements of each
head rotate, the rest pass through; the tables are that wide.

LongRoPE picks its factor set per token as transformers does per forward (`seq_len = max(position_ids) + 1`,
long when it exceeds original_max_position_embeddings): in `transformers.generate` the prompt is one forward, so
every prompt token uses the long factors iff the prompt is longer than the original length, and each decoded
token at position p iff p + 1 exceeds it. `lookup_batch` applies exactly that per request, from the batch's
prompt lengths, so the choice does not depend on how the prompt was chunked or batched. The tables then hold the
short rows [0, max_positions) and the long rows [max_positions, 2 * max_positions); a token's row is
position + max_positions when it is long.

The cos/sin tables are computed once in float32; on the CPU the rotation is one native in-place call per layer
(tokenloom/kernels/cpu_ops.py), partial widths included.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from tokenloom.kernels import cpu_ops
from tokenloom.model_config import ModelConfigError

if TYPE_CHECKING:
    from tokenloom.forward_batch import ForwardBatch
    from tokenloom.model_config import ModelConfig

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope", "su", "dynamic")


def rope_type(scaling: dict[str, Any] | None) -> str:
    scaling = scaling or {}
    return str(scaling.get("rope_type", scaling.get("type")) or "default")


def _base_inv_freq(dim: int, theta: float) -> torch.Tensor:
    # float32 arithmetic as transformers does it, so the angles agree to the last bit at long positions
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def _llama3(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    factor = float(scaling["factor"])
    low = float(scaling.get("low_freq_factor", 1.0))
    high = float(scaling.get("high_freq_factor", 4.0))
    old_ctx = float(scaling["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    smooth = (old_ctx / wavelen - low) / (high - low)
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    mid = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
    return torch.where(mid, (1 - smooth) * inv_freq / factor + smooth * inv_freq, scaled)


def _yarn(dim: int, theta: float, scaling: dict[str, Any]) -> tuple[torch.Tensor, float]:
    """YaRN (https://arxiv.org/abs/2309.00071) as transformers' _compute_yarn_parameters: interpolated and
    extrapolated frequencies blended by a linear ramp over the dimensions whose rotation counts lie between
    beta_slow and beta_fast at the original length; cos/sin scaled by the attention factor."""
    factor = float(scaling["factor"])
    orig = float(scaling["original_max_position_embeddings"])
    attention = scaling.get("attention_factor")
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")

    def get_mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if attention is None:
        attention = (get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim)
                     if mscale and mscale_all_dim else get_mscale(factor))
    beta_fast = float(scaling.get("beta_fast") or 32)
    beta_slow = float(scaling.get("beta_slow") or 1)

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(orig / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = theta ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention)


def _longrope(dim: int, theta: float, scaling: dict[str, Any]
              ) -> tuple[torch.Tensor, torch.Tensor, float, int]:
    """(short inv_freq, long inv_freq, attention factor, original length) as transformers'
    _compute_longrope_parameters; `factor` defaults to max_position_embeddings / original length (model_config
    fills it from the checkpoint's config before --context-length can change the context)."""
    orig = int(scaling["original_max_position_embeddings"])
    factor = float(scaling.get("factor") or 1.0)
    attention = scaling.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(orig))
    shape = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    freqs = []
    for key in ("short_factor", "long_factor"):
        ext = scaling.get(key)
        if not isinstance(ext, (list, tuple)) or len(ext) != dim // 2:
            raise ModelConfigError(f"rope_scaling {key} must list {dim // 2} numbers (one per rotary frequency "
                                   f"of {dim} rotated dimensions), got {ext!r:.80}")
        freqs.append(1.0 / (torch.tensor(ext, dtype=torch.float32) * theta ** shape))
    return freqs[0], freqs[1], float(attention), orig


class RotaryStep:
    """The rotation of one forward step: each token's table row, and the cos/sin rows in the compute dtype,
    built on first use by the torch path (the native CPU path reads the float32 tables directly)."""

    def __init__(self, rotary: RotaryEmbedding, positions: torch.Tensor, dtype: torch.dtype) -> None:
        self.rotary = rotary
        self.positions = positions  # table rows (= positions, + max_positions for LongRoPE's long tokens)
        self.dtype = dtype
        self._cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None

    def cos_sin(self) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin_signed for the step's tokens: [T, 1, R] each (R the rotary width), in the compute dtype."""
        if self._cos_sin is None:
            cos = self.rotary.cos.index_select(0, self.positions).to(self.dtype).unsqueeze(1)
            sin = self.rotary.sin.index_select(0, self.positions).to(self.dtype).unsqueeze(1)
            self._cos_sin = (cos, sin)
        return self._cos_sin


class RotaryEmbedding(nn.Module):
    """Holds the cos/sin tables; `lookup_batch` (or `lookup`) once per forward, `apply` per layer to the packed
    q|k heads."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict[str, Any] | None,
                 partial_rotary_factor: float = 1.0) -> None:
        super().__init__()
        dim = int(head_dim * partial_rotary_factor)
        if dim <= 0 or dim % 2 or dim > head_dim:
            raise ModelConfigError(f"partial_rotary_factor {partial_rotary_factor} of head_dim {head_dim} gives "
                                   f"{dim} rotated dimensions (must be even, 2..{head_dim})")
        kind = rope_type(scaling)
        scaling = scaling or {}
        attention = 1.0
        position_scale = 1.0
        self.long_after: int | None = None  # LongRoPE: original length past which the long factors apply
        inv_freq = _base_inv_freq(dim, theta)
        long_freq: torch.Tensor | None = None
        if kind == "default":
            pass
        elif kind == "linear":
            position_scale = 1.0 / float(scaling["factor"])
        elif kind == "llama3":
            inv_freq = _llama3(inv_freq, scaling)
        elif kind == "yarn":
            inv_freq, attention = _yarn(dim, theta, scaling)
        elif kind in ("longrope", "su"):
            inv_freq, long_freq, attention, self.long_after = _longrope(dim, theta, scaling)
        elif kind == "dynamic":
            limit = scaling.get("max_position_embeddings")
            if limit is None or max_positions > int(limit):
                raise ModelConfigError(
                    f"rope_scaling type 'dynamic' (NTK) rescales its frequencies with each forward's length past "
                    f"the checkpoint's max_position_embeddings ({limit}), which cached keys cannot follow; serve "
                    f"it with --context-length {limit} or less (where its frequencies are the default ones)")
        else:
            raise ModelConfigError(f"unsupported rope_scaling type {kind!r} (supported: "
                                   f"{', '.join(SUPPORTED_ROPE_TYPES)})")
        t = torch.arange(max_positions, dtype=torch.float32) * position_scale
        cos, sin = self._tables(t, inv_freq, attention)
        if long_freq is not None:
            long_cos, long_sin = self._tables(t, long_freq, attention)
            cos, sin = torch.cat((cos, long_cos)), torch.cat((sin, long_sin))
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        self.head_dim = head_dim
        self.rotary_dim = dim
        self.max_positions = max_positions
        self.attention_factor = attention

    @classmethod
    def for_model(cls, cfg: ModelConfig, theta: float | None = None) -> RotaryEmbedding:
        return cls(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta if theta is None else theta,
                   cfg.rope_scaling, cfg.partial_rotary_factor)

    @staticmethod
    def _tables(t: torch.Tensor, inv_freq: torch.Tensor, attention: float) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = torch.outer(t, inv_freq.float())
        cos, sin = freqs.cos(), freqs.sin()
        if attention != 1.0:
            cos, sin = cos * attention, sin * attention
        # Full-width rows so rotation is x * cos + roll(x, R/2) * sin_signed (the "rotate half" layout).
        return torch.cat((cos, cos), dim=-1), torch.cat((-sin, sin), dim=-1)

    def lookup(self, positions: torch.Tensor, dtype: torch.dtype,
               lengths: torch.Tensor | None = None) -> RotaryStep:
        """The step's rotation; positions must lie in [0, max_positions) (checked on the CPU, where the native
        kernel would otherwise read outside the table; on an accelerator the check would force a sync).
        `lengths` (LongRoPE only): per token, the sequence length transformers would see (see the module
        docstring); None: position + 1."""
        if positions.device.type == "cpu" and positions.numel() and (
                int(positions.min()) < 0 or int(positions.max()) >= self.max_positions):
            raise ValueError(f"positions outside [0, {self.max_positions}) (the model's context length)")
        rows = positions
        if self.long_after is not None:
            lengths = positions + 1 if lengths is None else lengths
            rows = positions + (lengths > self.long_after).to(positions.dtype) * self.max_positions
        return RotaryStep(self, rows, dtype)

    def lookup_batch(self, batch: ForwardBatch, dtype: torch.dtype) -> RotaryStep:
        """`lookup` for a forward batch: LongRoPE's length of a token is max(its request's prompt length,
        position + 1), as transformers.generate sees it; without prompt lengths in the batch, the request's
        length after this step (transformers' rule for one forward of these tokens)."""
        lengths = None
        if self.long_after is not None and batch.positions.numel():
            per_req = getattr(batch, "prompt_lens", None)
            if per_req is None:
                per_req = batch.seq_lens
            lengths = torch.maximum(per_req.to(batch.positions.dtype)[batch.token_req_index], batch.positions + 1)
        return self.lookup(batch.positions, dtype, lengths)

    @staticmethod
    def apply(x: torch.Tensor, step: RotaryStep) -> torch.Tensor:
        """Rotate x [T, H, D] (any number of heads at once, q and k together); a partial rotary rotates the first
        R elements of each head. The native CPU path rotates x in place and returns it; the torch path returns a
        new tensor."""
        if cpu_ops.available(x) and cpu_ops.rope_(x, step.positions, step.rotary.cos, step.rotary.sin):
            return x
        cos, sin = step.cos_sin()
        rot = step.rotary.rotary_dim
        if rot == x.shape[-1]:
            return torch.addcmul(x * cos, x.roll(rot // 2, dims=-1), sin)
        head = x[..., :rot]
        return torch.cat((torch.addcmul(head * cos, head.roll(rot // 2, dims=-1), sin), x[..., rot:]), dim=-1)
