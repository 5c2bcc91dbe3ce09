"""`TokenTable`: the newest sampled token of every request row, on the device — where a decode step reads
its inputs (`tokens[req_pool_indices]`, mini-sglang's `token_pool[input_mapping]` with the mapping = rows).

Every step's sampler writes the token it sampled for each request at the request's row (extend steps too:
a non-final chunk's token is overwritten by the final chunk's before any decode reads it). A decode step
gathers its inputs by row on the forward side, so a batch planned before the previous step's tokens are known
(the overlap scheduler; later, pipeline micro-batches) needs no placeholders: forward steps run in launch
order, so the step that sampled a request's token has written it before the next step of that request reads
it. Invariant: a row is reused only after every launched batch of its request was processed (rows are freed
at `inflight == 0`), so no step reads a token of another request.
"""

from __future__ import annotations

import torch


class TokenTable:
    def __init__(self, rows: int, device: torch.device) -> None:
        self.tokens = torch.zeros(max(rows, 1), dtype=torch.int64, device=device)
        self.device = device

    def gather(self, rows: torch.Tensor) -> torch.Tensor:
        """The newest token of each of `rows` (forward side)."""
        return self.tokens.index_select(0, rows)

    def write(self, rows: torch.Tensor, token_ids: torch.Tensor) -> None:
        """Record one step's sampled tokens at their requests' rows (forward side, in step order)."""
        self.tokens.index_copy_(0, rows, token_ids if token_ids.dtype == torch.int64 else token_ids.to(torch.int64))
