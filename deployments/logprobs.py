"""OpenAI logprobs objects from the engine's per-position logprobs (``workers.engine.PositionLogprobs``).

Shapes and conventions as vLLM's OpenAI server (vllm 0.32.0): ``-inf`` becomes -9999.0, completions list
the position's own token plus the top ``logprobs`` tokens, text offsets count the returned token strings,
``return_tokens_as_token_ids`` names tokens ``token_id:N``. One difference: chat's ``top_logprobs`` are the N
most likely tokens in rank order, as OpenAI defines them (vLLM lists the sampled token first).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from vllm.entrypoints.openai.chat_completion.protocol import (
    ChatCompletionLogProb,
    ChatCompletionLogProbs,
    ChatCompletionLogProbsContent,
)
from vllm.entrypoints.openai.completion.protocol import CompletionLogProbs
from vllm.logprobs import Logprob

from workers.engine import PositionLogprobs

FLOOR = -9999.0  # what OpenAI's JSON says for a probability of zero


def _value(logprob: float) -> float:
    return max(logprob, FLOOR)


class TokenNames:
    """A token's string as the client asked for it: its decoded text, or ``token_id:N``."""

    def __init__(self, decode: Callable[[int], str], as_ids: bool = False) -> None:
        self._decode = decode
        self._as_ids = as_ids

    def __call__(self, token_id: int, decoded: str | None) -> str:
        if self._as_ids:
            return f"token_id:{token_id}"
        return decoded if decoded is not None else self._decode(token_id)


def chat(positions: Sequence[PositionLogprobs], top: int, names: TokenNames) -> ChatCompletionLogProbs:
    """``choices[i].logprobs`` of a chat completion (or of one stream chunk) for these generated tokens."""
    content = []
    for position in positions:
        token_id, logprob, _, decoded = position[0]
        token = names(token_id, decoded)
        best = sorted((e for e in position if e[2] is not None and e[2] <= top), key=lambda e: e[2] or 0)
        content.append(ChatCompletionLogProbsContent(
            token=token, logprob=_value(logprob), bytes=list(token.encode("utf-8", errors="replace")),
            top_logprobs=[ChatCompletionLogProb(token=(name := names(t, d)), logprob=_value(lp),
                                                bytes=list(name.encode("utf-8", errors="replace")))
                          for t, lp, _, d in _unique(best)]))
    return ChatCompletionLogProbs(content=content)


def _unique(entries: Sequence[tuple[int, float, int | None, str | None]]) -> list[tuple[int, float, int | None, str | None]]:
    seen: set[int] = set()
    return [e for e in entries if not (e[0] in seen or seen.add(e[0]))]  # type: ignore[func-returns-value]


def completion(positions: Sequence[PositionLogprobs | None], first_ids: Sequence[int], names: TokenNames,
               offset: int = 0) -> tuple[CompletionLogProbs, int]:
    """``choices[i].logprobs`` of a completion for these positions, and the text offset after them.

    A position without logprobs (the prompt's first token, when echoed) is named from ``first_ids``, which
    holds the token ids of those positions in order."""
    tokens: list[str] = []
    values: list[float | None] = []
    tops: list[dict[str, float] | None] = []
    offsets: list[int] = []
    plain = iter(first_ids)
    for position in positions:
        if position is None:
            token_id = next(plain)
            tokens.append(names(token_id, None))
            values.append(None)
            tops.append(None)
        else:
            token_id, logprob, _, decoded = position[0]
            tokens.append(names(token_id, decoded))
            values.append(_value(logprob))
            tops.append({names(t, d): _value(lp) for t, lp, _, d in _unique(position)})
        offsets.append(offset)
        offset += len(tokens[-1])
    return CompletionLogProbs(text_offset=offsets, token_logprobs=values, tokens=tokens, top_logprobs=tops), offset


def prompt_field(positions: Sequence[PositionLogprobs | None]) -> list[dict[int, Logprob] | None]:
    """vLLM's ``prompt_logprobs`` response field: per prompt position, token id -> Logprob."""
    return [None if position is None else
            {t: Logprob(logprob=_value(lp), rank=rank, decoded_token=d) for t, lp, rank, d in position}
            for position in positions]


def merge_chat(parts: Sequence[ChatCompletionLogProbs]) -> ChatCompletionLogProbs | None:
    """One response's logprobs from its deltas' pieces."""
    return ChatCompletionLogProbs(content=[c for part in parts for c in part.content or []]) if parts else None


def merge_completion(parts: Sequence[CompletionLogProbs]) -> CompletionLogProbs | None:
    if not parts:
        return None
    return CompletionLogProbs(text_offset=[o for x in parts for o in x.text_offset],
                              token_logprobs=[v for x in parts for v in x.token_logprobs],
                              tokens=[t for x in parts for t in x.tokens],
                              top_logprobs=[t for x in parts for t in x.top_logprobs])


def wanted(kind: str, request: Any) -> int | None:
    """How many top tokens the client asked for per generated token; None: no logprobs."""
    if kind == "chat":
        return (request.top_logprobs or 0) if request.logprobs else None
    return request.logprobs
