"""Turning sampled tokens into what users read: text, logprobs and ``RequestOutput``s.

The output processor owns each request's detokenizer, text and logprobs (the scheduler owns
its tokens and status). It finds stop strings, which need the text, and says so to the engine,
which ends the request in the scheduler.
"""

from __future__ import annotations

from typing import Any

from hookllm.outputs import CompletionOutput, RequestOutput
from hookllm.request import Request, RequestStatus
from hookllm.tokenizer import IncrementalDetokenizer


class RequestTextState:
    __slots__ = ("detokenizer", "text", "logprobs", "sent_text", "sent_tokens")

    def __init__(self, detokenizer: IncrementalDetokenizer | None, wants_logprobs: bool):
        self.detokenizer = detokenizer
        self.text = ""
        self.logprobs: list[dict[int, float]] | None = [] if wants_logprobs else None
        # How much of the text and tokens earlier delta outputs carried.
        self.sent_text = 0
        self.sent_tokens = 0


class OutputProcessor:
    def __init__(self, tokenizer: Any | None):
        self.tokenizer = tokenizer
        self.states: dict[str, RequestTextState] = {}

    def add_request(self, request: Request) -> None:
        detokenizer = (IncrementalDetokenizer(self.tokenizer, request.prompt_token_ids,
                                              request.sampling_params.skip_special_tokens)
                       if self.tokenizer is not None else None)
        self.states[request.request_id] = RequestTextState(detokenizer, request.sampling_params.logprobs is not None)

    def remove_request(self, request_id: str) -> None:
        self.states.pop(request_id, None)

    def append_token(self, request: Request, logprobs: dict[int, float] | None) -> str | None:
        """Detokenize the request's newest token; the stop string its text now ends with, if any."""
        state = self.states[request.request_id]
        if logprobs is not None and state.logprobs is not None:
            state.logprobs.append(logprobs)
        if state.detokenizer is None or request.status is RequestStatus.FINISHED_STOPPED:
            return None  # no text, or a stop token ended it: a stop token adds no text
        previous_len = len(state.text)
        state.text += state.detokenizer.add(request.output_token_ids[-1])
        params = request.sampling_params
        if not params.stop or len(request.output_token_ids) < params.min_tokens:
            return None
        for stop in params.stop:
            # Only a match that ends in the new text is new; search from just before it.
            index = state.text.find(stop, max(0, previous_len - len(stop) + 1))
            if index != -1:
                state.text = state.text[: index + len(stop)] if params.include_stop_str_in_output else state.text[:index]
                return stop
        return None

    def make_output(self, request: Request) -> RequestOutput | None:
        """The output this step reports for ``request``, by its ``output_kind``; None for a
        final-only request still running."""
        kind = request.sampling_params.output_kind
        if kind == "final_only" and not request.is_finished:
            return None
        state = self.states[request.request_id]
        text, token_ids, logprobs = state.text, request.output_token_ids, state.logprobs
        if kind == "delta":
            text, token_ids = text[state.sent_text:], token_ids[state.sent_tokens:]
            logprobs = logprobs[state.sent_tokens:] if logprobs is not None else None
            state.sent_text, state.sent_tokens = len(state.text), len(request.output_token_ids)
        completion = CompletionOutput(
            index=0, text=text, token_ids=list(token_ids), finish_reason=request.status.value if request.is_finished else None,
            stop_reason=request.stop_reason, logprobs=list(logprobs) if logprobs is not None else None,
        )
        return RequestOutput(request.request_id, request.prompt, list(request.prompt_token_ids),
                             [completion], request.is_finished, num_cached_tokens=request.num_cached_tokens or 0)
