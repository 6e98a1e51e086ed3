"""Output processing: the engine core's per-step outputs in, what users read out.

The output processor owns each request's front-end state (vLLM's ``RequestState``): its
detokenizer, text, token ids, logprobs, timing, stop strings and, for ``n > 1``, the group of
its children. It never reads the scheduler's state: what it knows comes from the request's
:class:`hookllm.engine.core_request.EngineCoreRequest` when it was added and from
:class:`hookllm.engine.core.EngineCoreOutputs`. A stop string is found here, in the text; the
request is then finished here and its id is returned for the core to abort. Streamed text (delta and cumulative outputs) is never taken back: text that could still
become the start of a stop string is held back until it cannot, so the deltas always
concatenate to the final text.

When a user's request ends (finished or aborted) the ``engine_request_finished`` hook gets its
complete final output, once.
"""

from __future__ import annotations

import time
from typing import Any, Iterable, NamedTuple

from hookllm.engine.core import EngineCoreOutputs
from hookllm.engine.core_request import EngineCoreRequest
from hookllm.engine.input_processor import child_request_ids
from hookllm.engine.stop_strings import StopStringAutomaton, StopStringMatcher
from hookllm.outputs import (CompletionOutput, FlatLogprobs, LogprobsEntry, LogprobsRow, PoolingOutput,
                             PoolingRequestOutput, RequestMetrics, RequestOutput,
                             logprobs_entry)
from hookllm.plugins.manager import ActiveHooks
from hookllm.sampling_params import RequestOutputKind
from hookllm.tokenizer import IncrementalDetokenizer, TokenTexts


class ParentRequest:
    """A request with ``n`` > 1, run as ``n`` child requests that share the prompt's KV blocks.

    Reported vLLM's way: with ``final_only`` one ``RequestOutput`` holding the ``n`` completions
    (``CompletionOutput.index`` = i) once all finish; with ``cumulative`` / ``delta`` each child's
    progress as its own ``RequestOutput`` under the parent's id, carrying that child's completion
    only, and ``finished`` set on the output of the last child to finish.
    """

    def __init__(self, request_id: str, n: int, output_kind: RequestOutputKind):
        self.request_id = request_id
        self.child_ids = child_request_ids(request_id, n)
        self.index = {child_id: i for i, child_id in enumerate(self.child_ids)}
        self.output_kind = output_kind
        self.completions: dict[int, CompletionOutput] = {}  # final_only: each finished child's
        self.final: dict[int, CompletionOutput] = {}  # for engine_request_finished: each ended child's, complete
        self.num_finished = 0
        self.num_cached_tokens = 0  # the best hit among the children (the first computes the prompt)

    @property
    def finished(self) -> bool:
        return self.num_finished == len(self.child_ids)

    def add(self, output: RequestOutput) -> RequestOutput | None:
        """A child's output in, the parent's output to report (None while a final one is pending)."""
        completion = output.outputs[0]
        completion.index = self.index[output.request_id]
        self.num_finished += output.finished
        self.num_cached_tokens = max(self.num_cached_tokens, output.num_cached_tokens)
        if self.output_kind is RequestOutputKind.FINAL_ONLY:
            self.completions[completion.index] = completion
            if not self.finished:
                return None
            completions = [self.completions[i] for i in range(len(self.child_ids))]
        else:
            completions = [completion]
        return RequestOutput(self.request_id, output.prompt, output.prompt_token_ids, completions,
                             self.finished, num_cached_tokens=self.num_cached_tokens, lora_request=output.lora_request)


class RequestState:
    """One engine request's front-end state (a child's, for ``n`` > 1)."""

    __slots__ = ("request_id", "parent", "prompt", "prompt_token_ids", "params", "detokenizer", "token_ids",
                 "text", "logprobs", "cumulative_logprob", "prompt_logprobs", "metrics", "sent_text",
                 "sent_tokens", "finish_reason", "stop_reason", "num_cached_tokens", "stop_matcher", "lora_request")

    def __init__(self, request: EngineCoreRequest, parent: ParentRequest | None, tokenizer: Any | None,
                 stop_automaton: StopStringAutomaton | None, token_texts: TokenTexts | None):
        params = request.sampling_params
        self.request_id = request.request_id
        self.parent = parent
        self.prompt = request.prompt
        self.prompt_token_ids = request.prompt_token_ids
        self.lora_request = request.lora_request
        self.params = params
        self.detokenizer = (IncrementalDetokenizer(tokenizer, request.prompt_token_ids, params.skip_special_tokens)
                            if tokenizer is not None and params.detokenize else None)
        self.token_ids: list[int] = []
        self.text = ""
        self.logprobs: FlatLogprobs | None = None
        if params.logprobs is not None:  # texts looked up when read, with the engine's token_texts
            self.logprobs = FlatLogprobs([], params.detokenize and token_texts is not None).decode_with(token_texts)
        self.cumulative_logprob: float | None = 0.0 if params.logprobs is not None else None
        # The first prompt token has no logprob: nothing predicts it.
        self.prompt_logprobs: list[LogprobsEntry | None] | None = [None] if params.prompt_logprobs is not None else None
        self.metrics = RequestMetrics(arrival_time=time.time())
        # How much of the text and tokens earlier delta outputs carried.
        self.sent_text = 0
        self.sent_tokens = 0
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.num_cached_tokens = 0
        # Where the text stands in the stop strings (None without stop strings or without text).
        self.stop_matcher = (StopStringMatcher(stop_automaton)
                             if stop_automaton is not None and self.detokenizer is not None else None)


class OutputProcessorOutput(NamedTuple):
    request_outputs: list[RequestOutput]
    reqs_to_abort: list[str]  # engine requests this step stopped (a stop string): the core ends them


class OutputProcessor:
    def __init__(self, tokenizer: Any | None, hooks: ActiveHooks):
        self.tokenizer = tokenizer
        self.token_texts = TokenTexts(tokenizer) if tokenizer is not None else None
        self.hooks = hooks
        self.states: dict[str, RequestState] = {}  # by engine request id
        self.parents: dict[str, ParentRequest] = {}  # n > 1, by the user's request id
        # The lifecycle hook's complete outputs are built only when a plugin implements it.
        self.completed_hook = (hooks.hook.engine_request_finished if hooks.hook.engine_request_finished.get_hookimpls()
                               else None)

    def has_request(self, request_id: str) -> bool:
        """Whether ``request_id`` names an unfinished user request or engine request."""
        return request_id in self.states or request_id in self.parents

    def unfinished_request_ids(self) -> list[str]:
        """The user's unfinished requests (a parent's id for ``n`` > 1)."""
        ids = [rid for rid, state in self.states.items() if state.parent is None]
        return ids + list(self.parents)

    def add_request(self, request: EngineCoreRequest, engine_requests: list[EngineCoreRequest]) -> None:
        """Track a user's request, run as ``engine_requests`` (itself, or its ``n`` children)."""
        parent = None
        if engine_requests[0] is not request:
            parent = ParentRequest(request.request_id, len(engine_requests), request.sampling_params.output_kind)
            self.parents[request.request_id] = parent
        # Built once per user request: its n children share the stop strings, and so the automaton.
        stops = request.sampling_params.stop
        automaton = StopStringAutomaton(stops) if stops and self.tokenizer is not None else None
        for engine_request in engine_requests:
            self.states[engine_request.request_id] = RequestState(engine_request, parent, self.tokenizer, automaton,
                                                                  self.token_texts)

    def abort_requests(self, request_ids: Iterable[str]) -> list[str]:
        """Forget the user's requests (unknown ids pass); returns the engine requests to abort."""
        to_abort = []
        for request_id in request_ids:
            parent = self.parents.pop(request_id, None)
            for child_id in parent.child_ids if parent is not None else [request_id]:
                state = self.states.pop(child_id, None)
                if state is None:
                    continue
                to_abort.append(child_id)
                if self.completed_hook is not None:
                    state.finish_reason = "abort"
                    self._complete(state)
        return to_abort

    def process_outputs(self, core_outputs: EngineCoreOutputs) -> OutputProcessorOutput:
        """Apply one step's outputs; the user-facing outputs and the engine requests to abort."""
        now = time.time()
        for request_id in core_outputs.first_scheduled:
            state = self.states.get(request_id)
            if state is not None and state.metrics.first_scheduled_time is None:
                state.metrics.first_scheduled_time = now
        request_outputs, reqs_to_abort = [], []
        for core_output in core_outputs.outputs:
            state = self.states.get(core_output.request_id)
            if state is None:
                continue  # aborted, or stopped by a stop string, while the step ran
            if core_output.pooled is not None:
                del self.states[state.request_id]
                state.finish_reason = core_output.finish_reason
                request_outputs.append(PoolingRequestOutput(state.request_id, PoolingOutput(core_output.pooled),
                                                            state.prompt_token_ids, True, core_output.num_cached_tokens))
                if self.completed_hook is not None:
                    self._complete(state)
                continue
            if core_output.new_prompt_logprobs is not None:
                self._add_prompt_logprobs(state, core_output.new_prompt_logprobs)
            if not core_output.new_token_ids:
                continue
            state.num_cached_tokens = core_output.num_cached_tokens
            if core_output.num_draft_tokens:
                state.metrics.spec_num_draft_tokens += core_output.num_draft_tokens
                state.metrics.spec_num_accepted_tokens += core_output.num_accepted_tokens
            # Several tokens under speculative decoding: those after a stop string are dropped, and
            # the core's finish reason comes with the last (a stop token adds no text, the others do).
            logprobs, last = core_output.new_logprobs, len(core_output.new_token_ids) - 1
            for index, token_id in enumerate(core_output.new_token_ids):
                if index == last and core_output.finish_reason is not None:
                    state.finish_reason, state.stop_reason = core_output.finish_reason, core_output.stop_reason
                if self._append_token(state, token_id, None if logprobs is None else logprobs[index], now):
                    if core_output.finish_reason is None:
                        reqs_to_abort.append(state.request_id)
                    break
            output = self._make_output(state)
            parent = state.parent
            if output is not None and parent is not None:
                output = parent.add(output)
            if output is not None:
                request_outputs.append(output)
            if state.finish_reason is not None:
                del self.states[state.request_id]
                if parent is not None and parent.finished:
                    del self.parents[parent.request_id]
                if self.completed_hook is not None:
                    self._complete(state)
        return OutputProcessorOutput(request_outputs, reqs_to_abort)

    def _add_prompt_logprobs(self, state: RequestState, rows: list[LogprobsRow]) -> None:
        """A prefill chunk's prompt logprobs (a recomputed chunk after preemption adds nothing)."""
        if state.prompt_logprobs is None:
            return
        room = len(state.prompt_token_ids) - len(state.prompt_logprobs)
        for row in rows[:room]:
            state.prompt_logprobs.append(logprobs_entry(row, self._texts(row, state)))

    def _append_token(self, state: RequestState, token_id: int, logprobs: LogprobsRow | None, now: float) -> bool:
        """Take a new token and its text; True if a stop string ends in its text (the request then
        finishes here, with that string as its stop reason).

        Of the stop strings ending in the token's text, the one ending first wins, and of those
        ending at the same character the one first in ``stop`` (not simply the first in ``stop``
        of all that end in the token's text: the text stops where a character-by-character reader
        would). The text is cut before it (after it with ``include_stop_str_in_output``). Before ``min_tokens`` tokens no stop string is
        looked for, but their text is still read: a stop string that starts there and ends in
        the ``min_tokens``-th token's text or later stops the request.
        """
        state.token_ids.append(token_id)
        metrics = state.metrics
        if metrics.first_token_time is None:
            metrics.first_token_time = now
        metrics.last_token_time = now
        if logprobs is not None and state.logprobs is not None:
            state.logprobs.append(logprobs)  # kept as it came: entries are built when read
            state.cumulative_logprob += logprobs[1][0]
        if state.detokenizer is None or state.finish_reason == "stop":
            return False  # no text, or a stop token ended it: a stop token adds no text
        previous_len = len(state.text)
        new_text = state.detokenizer.add(token_id)
        state.text += new_text
        params = state.params
        if state.stop_matcher is None:
            return False
        match = state.stop_matcher.feed(new_text, report=len(state.token_ids) >= params.min_tokens)
        if match is None:
            return False
        index, consumed = match
        stop = params.stop[index]
        end = previous_len + consumed
        state.text = state.text[:end] if params.include_stop_str_in_output else state.text[: end - len(stop)]
        # It stops, also when its last token had just reached the length limit.
        state.finish_reason, state.stop_reason = "stop", stop
        return True

    def _make_output(self, state: RequestState) -> RequestOutput | None:
        """The output this step reports, by the request's ``output_kind``; None for a
        final-only request still running."""
        kind = state.params.output_kind
        finished = state.finish_reason is not None
        if kind is RequestOutputKind.FINAL_ONLY and not finished:
            return None
        text, output_ids, logprobs = state.text, state.token_ids, state.logprobs
        if finished:
            state.metrics.finished_time = time.time()
        # Text that may yet become a stop string waits; the final output has it all.
        matcher = state.stop_matcher
        ready = len(text) - matcher.holdback if matcher is not None and not finished else len(text)
        if kind is RequestOutputKind.DELTA:
            sent_tokens = state.sent_tokens
            text, token_ids = text[state.sent_text:ready], output_ids[sent_tokens:]
            logprobs = logprobs[sent_tokens:] if logprobs is not None else None
            state.sent_text, state.sent_tokens = ready, len(output_ids)
        else:  # the state's own lists go on growing: the output gets copies
            text, token_ids = text[:ready], list(output_ids)
            logprobs = logprobs[:] if logprobs is not None else None
        completion = CompletionOutput(0, text, token_ids, state.cumulative_logprob, logprobs,
                                      state.finish_reason, state.stop_reason)
        # The prompt's list is shared, not copied: a request's prompt ids never change, and
        # copying every prompt for every streamed step costs milliseconds.
        return RequestOutput(state.request_id, state.prompt, state.prompt_token_ids, [completion], finished,
                             state.prompt_logprobs, state.metrics, state.num_cached_tokens, state.lora_request)

    def _complete(self, state: RequestState) -> None:
        """An engine request has ended: the lifecycle hook gets its user request's complete
        output once all of it has (for ``n`` > 1, once every child has)."""
        completion = CompletionOutput(0, state.text, list(state.token_ids), state.cumulative_logprob,
                                      state.logprobs, state.finish_reason, state.stop_reason)
        parent = state.parent
        if parent is None:
            output = RequestOutput(state.request_id, state.prompt, state.prompt_token_ids, [completion], True,
                                   state.prompt_logprobs, state.metrics, state.num_cached_tokens, state.lora_request)
        else:
            completion.index = parent.index[state.request_id]
            parent.final[completion.index] = completion
            if len(parent.final) < len(parent.child_ids):
                return
            output = RequestOutput(parent.request_id, state.prompt, state.prompt_token_ids,
                                   [parent.final[i] for i in range(len(parent.child_ids))], True,
                                   metrics=state.metrics, num_cached_tokens=parent.num_cached_tokens,
                                   lora_request=state.lora_request)
        self.completed_hook(output=output, context=self.hooks.context)

    def _texts(self, row: LogprobsRow, state: RequestState) -> list[str] | None:
        """Each row token's text (vLLM's ``decoded_token``), None when text is off."""
        return self.token_texts(row[0]) if self.token_texts is not None and state.params.detokenize else None
