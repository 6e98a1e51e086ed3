"""The engine's per-token logprobs in the completions and the chat API's shapes."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from hookllm.engine.async_llm import AsyncLLM
from hookllm.server.protocol import ChatLogprobs, ChatTokenLogprob, CompletionLogprobs, TopLogprob


# What a logprob that is not a finite number (-inf for a token the request rules out, NaN from
# logits an extreme penalty overflowed) is written as: JSON has no such numbers, and vLLM writes -9999.0.
NON_FINITE_LOGPROB = -9999.0


def json_logprob(logprob: float) -> float:
    """``logprob`` as a JSON number: a non-finite one is ``NON_FINITE_LOGPROB``."""
    return logprob if math.isfinite(logprob) else NON_FINITE_LOGPROB


@dataclass
class TokenLogprob:
    token: str
    logprob: float | None  # None (and no top): a prompt's first token, which nothing predicts
    top: list[tuple[str, float]] | None


def convert_logprobs(engine: AsyncLLM, token_ids: list[int], entries: list[dict[int, Any]] | None,
                     num_top: int) -> list[TokenLogprob]:
    """The engine's per-token ``{token_id: Logprob}`` maps as (token text, logprob, top ``num_top``).

    The one place that reads the engine's logprob entries. Token texts are decoded one id at a time.
    """
    result = []
    for token_id, entry in zip(token_ids, entries or []):
        if entry is None:  # prompt logprobs start with None
            result.append(TokenLogprob(engine.decode_token(token_id), None, None))
            continue
        values = {tid: json_logprob(v.logprob) for tid, v in entry.items()}
        top = sorted(values.items(), key=lambda item: item[1], reverse=True)[:num_top]
        result.append(TokenLogprob(engine.decode_token(token_id), values[token_id],
                                   [(engine.decode_token(tid), lp) for tid, lp in top]))
    return result


def completion_logprobs(tokens: list[TokenLogprob], offset: int) -> CompletionLogprobs:
    out = CompletionLogprobs()
    for token in tokens:
        out.tokens.append(token.token)
        out.token_logprobs.append(token.logprob)
        out.top_logprobs.append(None if token.top is None else dict(token.top))
        out.text_offset.append(offset)
        offset += len(token.token)
    return out


def chat_logprobs(tokens: list[TokenLogprob]) -> ChatLogprobs:
    def utf8(text: str) -> list[int]:
        return list(text.encode("utf-8"))

    return ChatLogprobs(content=[
        ChatTokenLogprob(token=t.token, logprob=t.logprob, bytes=utf8(t.token),
                         top_logprobs=[TopLogprob(token=s, logprob=lp, bytes=utf8(s)) for s, lp in t.top])
        for t in tokens])
