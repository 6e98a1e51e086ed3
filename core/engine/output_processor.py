"""Turning sampled tokens into what users read: text, logprobs and ``RequestOutput``s.

The output processor owns each request's detokenizer, text, logprobs and timing (the scheduler
owns its tokens and status). It finds stop strings, which need the text, and says so to the
engine, which ends the request in the scheduler. Streamed text (delta and cumulative outputs)
is never taken back: text that could still become the start of a stop string is held back
until it cannot, so the deltas always concatenate to the final text.
"""

from __future__ import annotations

import time
from typing import Any

from hookllm.outputs import CompletionOutput, LogprobsEntry, RequestMetrics, RequestOutput
from hookllm.sched.request import Request, RequestStatus
from hookllm.sampling_params import RequestOutputKind
from hookllm.tokenizer import IncrementalDetokenizer


class RequestTextState:
    __slots__ = ("detokenizer", "text", "logprobs", "cumulative_logprob", "prompt_logprobs", "metrics",
                 "sent_text", "sent_tokens")

    def __init__(self, detokenizer: IncrementalDetokenizer | None, request: Request):
        params = request.sampling_params
        self.detokenizer = detokenizer
        self.text = ""
        self.logprobs: list[LogprobsEntry] | None = [] if params.logprobs is not None else None
        self.cumulative_logprob: float | None = 0.0 if params.logprobs is not None else None
        # The first prompt token has no logprob: nothing predicts it.
        self.prompt_logprobs: list[LogprobsEntry | None] | None = [None] if params.prompt_logprobs is not None else None
        self.metrics = RequestMetrics(arrival_time=time.time())
        # How much of the text and tokens earlier delta outputs carried.
        self.sent_text = 0
        self.sent_tokens = 0


class OutputProcessor:
    def __init__(self, tokenizer: Any | None):
        self.tokenizer = tokenizer
        self.states: dict[str, RequestTextState] = {}

    def add_request(self, request: Request) -> None:
        params = request.sampling_params
        detokenizer = (IncrementalDetokenizer(self.tokenizer, request.prompt_token_ids, params.skip_special_tokens)
                       if self.tokenizer is not None and params.detokenize else None)
        self.states[request.request_id] = RequestTextState(detokenizer, request)

    def remove_request(self, request_id: str) -> None:
        self.states.pop(request_id, None)

    def mark_scheduled(self, request_ids: list[str]) -> None:
        """Requests scheduled for the first time this step (the metrics' first_scheduled_time)."""
        now = time.time()
        for request_id in request_ids:
            state = self.states.get(request_id)
            if state is not None and state.metrics.first_scheduled_time is None:
                state.metrics.first_scheduled_time = now

    def add_prompt_logprobs(self, request: Request, entries: list[LogprobsEntry]) -> None:
        """A prefill chunk's prompt logprobs (a recomputed chunk after preemption adds nothing)."""
        state = self.states.get(request.request_id)
        if state is None or state.prompt_logprobs is None:
            return
        room = request.num_prompt_tokens - len(state.prompt_logprobs)
        for entry in entries[:room]:
            state.prompt_logprobs.append(self._decoded(entry, request))

    def append_token(self, request: Request, logprobs: LogprobsEntry | None) -> str | None:
        """Detokenize the request's newest token; the stop string its text now ends with, if any."""
        state = self.states[request.request_id]
        now = time.time()
        if state.metrics.first_token_time is None:
            state.metrics.first_token_time = now
        state.metrics.last_token_time = now
        if logprobs is not None and state.logprobs is not None:
            state.logprobs.append(self._decoded(logprobs, request))
            state.cumulative_logprob += logprobs[request.output_token_ids[-1]].logprob
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
        finished = request.is_finished
        if kind is RequestOutputKind.FINAL_ONLY and not finished:
            return None
        # Runs for every streamed request every step: each attribute is read once.
        state = self.states[request.request_id]
        text, output_ids, logprobs = state.text, request.output_token_ids, state.logprobs
        stops = request.sampling_params.stop
        if finished:
            state.metrics.finished_time = time.time()
        # Text that may yet become a stop string waits; the final output has it all.
        ready = len(text) - _stop_prefix_len(text, stops) if stops and not finished else len(text)
        if kind is RequestOutputKind.DELTA:
            sent_tokens = state.sent_tokens
            text, token_ids = text[state.sent_text:ready], output_ids[sent_tokens:]
            logprobs = logprobs[sent_tokens:] if logprobs is not None else None
            state.sent_text, state.sent_tokens = ready, len(output_ids)
        else:  # the request's own lists go on growing: the output gets copies
            text, token_ids = text[:ready], list(output_ids)
            logprobs = list(logprobs) if logprobs is not None else None
        completion = CompletionOutput(0, text, token_ids, state.cumulative_logprob, logprobs,
                                      request.status.value if finished else None, request.stop_reason)
        # The prompt's list is shared, not copied: a request's prompt ids never change (a plugin
        # replaces them whole), and copying every prompt for every streamed step costs milliseconds.
        return RequestOutput(request.request_id, request.prompt, request.prompt_token_ids, [completion], finished,
                             state.prompt_logprobs, state.metrics, request.num_cached_tokens or 0)

    def _decoded(self, entry: LogprobsEntry, request: Request) -> LogprobsEntry:
        """Fill in each entry token's text (vLLM's ``decoded_token``) unless text is off."""
        if self.tokenizer is not None and request.sampling_params.detokenize:
            ids = list(entry)
            for token_id, text in zip(ids, self.tokenizer.batch_decode([[t] for t in ids])):
                entry[token_id].decoded_token = text
        return entry


def _stop_prefix_len(text: str, stops: list[str]) -> int:
    """The longest end of ``text`` that is the start of a stop string (0 without stop strings)."""
    longest = 0
    for stop in stops:
        for length in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:length]):
                longest = length
                break
    return longest
