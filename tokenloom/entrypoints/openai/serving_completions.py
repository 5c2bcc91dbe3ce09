"""POST /v1/completions: prompt (text, texts, token ids or lists of them) → `text_completion` objects.

`max_tokens` (default 16) becomes max_new_tokens, `seed` the per-request sampling seed, `logprobs: k` the
top-k logprobs per token (OpenAI's completions logprobs object), `echo` prepends the prompt. With `echo` and
`logprobs` the logprobs object covers the prompt's tokens and then the completion's, as OpenAI and vLLM
answer (prompt logprobs from position 0: the first token's logprob and top-k are null; `text_offset` counts
characters from the start of the echoed prompt). `echo` with `max_tokens: 0` scores the prompt without
generating (vLLM's prompt-only answer; SGLang refuses max_tokens 0 altogether).
"""

from __future__ import annotations

from typing import Any

from tokenloom.entrypoints.openai.protocol import (
    CompletionChoice,
    CompletionChunk,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    UsageInfo,
)
from tokenloom.entrypoints.openai.serving_base import OpenAIServingBase, finish_reason_of
from tokenloom.protocol import TokenizedRequest


class CompletionServing(OpenAIServingBase):
    request_model = CompletionRequest
    id_prefix = "cmpl"

    def tokenize(self, req: CompletionRequest) -> list[TokenizedRequest]:
        prompt = req.prompt
        if prompt == "" or prompt == [] or (isinstance(prompt, list) and any(p == "" or p == [] for p in prompt)):
            raise ValueError("Prompt cannot be empty")
        if req.max_tokens is not None and (req.max_tokens < 0 or (req.max_tokens == 0 and not req.echo)):
            raise ValueError(f"max_tokens must be positive (0 only with echo), got {req.max_tokens}")
        if req.logprobs is not None and not 0 <= req.logprobs <= self.tm.args.max_logprobs:
            raise ValueError(f"logprobs must be an integer in [0, {self.tm.args.max_logprobs}] (--max-logprobs), "
                             f"got {req.logprobs}")
        is_text = isinstance(prompt, str) or (isinstance(prompt, list) and isinstance(prompt[0], str))
        reqs, _ = self.tm.tokenize_batch(
            prompt if is_text else None, None if is_text else prompt,
            self.sampling_params(req, req.max_tokens), req.rid, stream=req.stream,
            return_logprob=req.logprobs is not None, top_logprobs_num=req.logprobs or 0,
            logprob_start_len=0 if req.echo and req.logprobs is not None else -1,
            bootstrap=(req.bootstrap_host, req.bootstrap_port, req.bootstrap_room))
        return reqs

    def _echo(self, req: CompletionRequest, index: int) -> str:
        if not req.echo:
            return ""
        prompt = req.prompt
        one = prompt if isinstance(prompt, str) or isinstance(prompt[0], int) else prompt[index // req.n]
        return one if isinstance(one, str) else self.tm.tokenizer.decode(one)

    def _logprobs(self, lps: list[list[Any]] | None, tops: list[list[list[Any]] | None] | None,
                  offset: int) -> CompletionLogprobs | None:
        if lps is None:
            return None
        tokens = self.tm.token_texts([t[1] for t in lps])
        offsets = []
        for token in tokens:
            offsets.append(offset)
            offset += len(token)
        top = None
        if tops is not None:
            top = [None if pos is None else
                   dict(zip(self.tm.token_texts([t[1] for t in pos]), (t[0] for t in pos), strict=True))
                   for pos in tops]
        return CompletionLogprobs(tokens=tokens, token_logprobs=[t[0] for t in lps], top_logprobs=top,
                                  text_offset=offsets)

    def _prompt_logprobs(self, req: CompletionRequest, meta: dict[str, Any]) -> CompletionLogprobs | None:
        """The echoed prompt's part of the logprobs object (None unless echo and logprobs)."""
        if not req.echo or req.logprobs is None:
            return None
        return self._logprobs(meta["input_token_logprobs"], meta.get("input_top_logprobs"), 0)

    @staticmethod
    def _joined(first: CompletionLogprobs | None, second: CompletionLogprobs | None) -> CompletionLogprobs | None:
        if first is None or second is None:
            return second or first
        top = None
        if first.top_logprobs is not None or second.top_logprobs is not None:
            top = (first.top_logprobs or []) + (second.top_logprobs or [])
        return CompletionLogprobs(tokens=first.tokens + second.tokens,
                                  token_logprobs=first.token_logprobs + second.token_logprobs,
                                  top_logprobs=top, text_offset=first.text_offset + second.text_offset)

    def make_response(self, req: CompletionRequest, outs: list[dict[str, Any]], usage: UsageInfo) -> CompletionResponse:
        choices = []
        for i, out in enumerate(outs):
            meta = out["meta_info"]
            echo = self._echo(req, i)
            reason, matched = finish_reason_of(meta["finish_reason"])
            choices.append(CompletionChoice(
                index=i, text=echo + out["text"], finish_reason=reason, matched_stop=matched,
                logprobs=self._joined(self._prompt_logprobs(req, meta), self._logprobs(
                    meta.get("output_token_logprobs"), meta.get("output_top_logprobs"), len(echo)))))
        return CompletionResponse(model=self.response_model_name(req), choices=choices, usage=usage)

    def first_chunks(self, req: CompletionRequest, rid: str, index: int, out: dict[str, Any]) -> list[dict[str, Any]]:
        echo = self._echo(req, index)
        if not echo:
            return []
        choice = CompletionChoice(index=index, text=echo, logprobs=self._prompt_logprobs(req, out["meta_info"]))
        return [self._chunk(req, rid, choice, None)]

    def delta_chunks(self, req: CompletionRequest, rid: str, index: int, delta: str, offset: int,
                     logprobs: list[list[Any]] | None, top: list[list[list[Any]]] | None,
                     finish: dict[str, Any] | None, usage: UsageInfo | None) -> list[dict[str, Any]]:
        reason, matched = finish_reason_of(finish)
        choice = CompletionChoice(index=index, text=delta, finish_reason=reason, matched_stop=matched,
                                  logprobs=self._logprobs(logprobs, top, len(self._echo(req, index)) + offset))
        return [self._chunk(req, rid, choice, usage)]

    def usage_chunk(self, req: CompletionRequest, rid: str, usage: UsageInfo) -> dict[str, Any]:
        return CompletionChunk(id=rid, model=self.response_model_name(req), choices=[], usage=usage).model_dump()

    def _chunk(self, req: CompletionRequest, rid: str, choice: CompletionChoice, usage: UsageInfo | None) -> dict:
        return CompletionChunk(id=rid, model=self.response_model_name(req), choices=[choice], usage=usage).model_dump()
