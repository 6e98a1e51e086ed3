"""The engine's per-token logprobs in the completions and the chat API's shapes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hookllm.engine.async_llm import AsyncLLM
from hookllm.server.protocol import ChatLogprobs, ChatTokenLogprob, CompletionLogprobs, TopLogprob


@dataclass
class TokenLogprob:
    token: str
    logprob: float
    top: list[tuple[str, float]]


def convert_logprobs(engine: AsyncLLM, token_ids: list[int], entries: list[dict[int, Any]] | None,
                     num_top: int) -> list[TokenLogprob]:
    """The engine's per-token ``{token_id: Logprob}`` maps as (token text, logprob, top ``num_top``).

    The one place that reads the engine's logprob entries. Token texts are decoded one id at a time.
    """
    result = []
    for token_id, entry in zip(token_ids, entries or []):
        values = {tid: v.logprob for tid, v in entry.items()}
        top = sorted(values.items(), key=lambda item: item[1], reverse=True)[:num_top]
        result.append(TokenLogprob(engine.decode_token(token_id), values[token_id],
                                   [(engine.decode_token(tid), lp) for tid, lp in top]))
    return result


def completion_logprobs(tokens: list[TokenLogprob], offset: int) -> CompletionLogprobs:
    out = CompletionLogprobs()
    for token in tokens:
        out.tokens.append(token.token)
        out.token_logprobs.append(token.logprob)
        out.top_logprobs.append(dict(token.top))
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
