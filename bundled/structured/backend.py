"""The llguidance side of the structured plugin: compiling constraints, tracking the constrained
requests, token masks.

Imported only when a request uses structured output (the plugin's hooks import it lazily). The
matchers themselves live in the plugin's matcher process (``matcher_server.py``), one per engine
worker, started with the first constrained step; this module keeps, per request, how many of its
tokens the process has seen.
"""

from __future__ import annotations

import json
import logging
import threading
from collections import deque
from copy import copy
from dataclasses import dataclass, field
from typing import Any

import llguidance
import torch

from hookllm.worker.batch import Batch, CachedRequestState
from hookllm.kernels import ops_for
from hookllm.bundled import structured
from hookllm.bundled.structured import COMPILED_KEY
from hookllm.bundled.structured.matcher_process import MatcherProcess, MatcherProcessExited
from hookllm.sampling_params import SamplingParams, StructuredOutputsParams

logger = logging.getLogger(__name__)

# Process-wide, as they hold no engine's state: a tokenizer's serialized form and its LLTokenizer
# (building one walks the whole vocabulary, ~0.5 s for 49k tokens), once per tokenizer.
_TOKENIZER_JSON: dict[str, str] = {}
_LL_TOKENIZERS: dict[tuple[str, tuple[int, ...]], llguidance.LLTokenizer] = {}


@dataclass(frozen=True)
class CompiledGrammar:
    """What a worker needs to build a request's matcher; plain data, so it pickles."""

    tokenizer_path: str
    eos_token_ids: tuple[int, ...]
    grammar: str  # llguidance's grammar text
    vocab_size: int  # the LLTokenizer's: a mask row holds (vocab_size + 31) // 32 words

    @property
    def tokenizer_key(self) -> tuple[str, tuple[int, ...]]:
        return self.tokenizer_path, self.eos_token_ids


@dataclass
class _Tracked:
    state: CachedRequestState  # the runner's object: a different one (a re-added request) starts over
    consumed: int = 0  # output tokens sent to the request's matcher


@dataclass
class EngineState:
    """The plugin's state in one engine, where the model runs."""

    matchers: dict[str, _Tracked] = field(default_factory=dict)  # by request id; dropped in worker_request_finished
    # Finished requests whose matchers go with the next step's message (appended on the main
    # thread, taken by the job's: a deque's append and popleft are atomic).
    drops: deque[str] = field(default_factory=deque)
    process: MatcherProcess | None = None  # started with the first constrained step
    bitmasks: dict[int, torch.Tensor] = field(default_factory=dict)  # host buffers by mask width (32-bit words)

    def close(self) -> None:
        if self.process is not None:
            self.process.close()
            self.process = None


def engine_state(context: Any) -> EngineState:
    """This engine's :class:`EngineState`, kept in its context (made on first use)."""
    namespace = context.state_for(structured.__name__)
    if not hasattr(namespace, "backend"):
        namespace.backend = EngineState()
    return namespace.backend


def requested_spec(params: SamplingParams) -> StructuredOutputsParams | None:
    """The request's constraint: the ``structured_outputs`` field, else ``extra_args["structured_outputs"]``."""
    spec = params.structured_outputs or params.extra_args.get("structured_outputs")
    if spec is None or isinstance(spec, StructuredOutputsParams):
        return spec
    if not isinstance(spec, dict):
        raise ValueError(f"extra_args['structured_outputs'] must be a dict, got {type(spec).__name__}")
    try:
        return StructuredOutputsParams(**spec)
    except TypeError as exc:  # an unknown key
        raise ValueError(f"structured_outputs: {exc}") from None


def tokenizer_json(path: str, hf_tokenizer: Any = None) -> str:
    """The serialized (``tokenizers`` JSON) form of the fast tokenizer at ``path``, which llguidance
    reads; a worker in another process loads the HF tokenizer from ``path``."""
    text = _TOKENIZER_JSON.get(path)
    if text is None:
        if hf_tokenizer is None:
            from hookllm.tokenizer import load_tokenizer

            hf_tokenizer = load_tokenizer(path)
        backend = getattr(hf_tokenizer, "backend_tokenizer", None)
        if backend is None:
            raise ValueError(f"structured_outputs needs a fast (tokenizers) tokenizer; {path} has a slow one")
        backend = copy(backend)  # added tokens included; no padding or truncation in the matcher's copy
        backend.no_padding()
        backend.no_truncation()
        text = _TOKENIZER_JSON[path] = backend.to_str()
    return text


def ll_tokenizer(path: str, eos_token_ids: tuple[int, ...], hf_tokenizer: Any = None) -> llguidance.LLTokenizer:
    """The LLTokenizer of the tokenizer at ``path`` with these EOS ids (built once per process)."""
    key = path, eos_token_ids
    tokenizer = _LL_TOKENIZERS.get(key)
    if tokenizer is None:
        tokenizer = _LL_TOKENIZERS[key] = llguidance.LLTokenizer(tokenizer_json(path, hf_tokenizer),
                                                                 eos_token=list(eos_token_ids))
    return tokenizer


def grammar_text(spec: StructuredOutputsParams) -> str:
    """llguidance's grammar for ``spec`` (not validated yet)."""
    kind = spec.kind
    if kind == "json":
        schema = spec.json
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as exc:
                raise ValueError(f"the JSON schema is not valid JSON: {exc}") from None
        if not isinstance(schema, (dict, bool)):
            raise ValueError(f"a JSON schema must be an object, got {type(schema).__name__}")
        return llguidance.LLMatcher.grammar_from_json_schema(schema)
    if kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"})
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(spec.regex)
    if kind == "choice":
        # Lark string literals take JSON's escapes; non-ASCII stays as it is.
        return llguidance.LLMatcher.grammar_from_lark(
            "start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in spec.choice))
    return llguidance.LLMatcher.grammar_from_lark(spec.grammar)


def compile_request(request_id: str, spec: StructuredOutputsParams, tokenizer: Any, model_config: Any
                    ) -> CompiledGrammar:
    """Compile and validate ``spec`` for the engine's tokenizer; ``ValueError`` naming the request
    and the problem."""
    from hookllm.engine.core import eos_token_ids

    if tokenizer is None:
        raise ValueError(f"request {request_id}: structured_outputs needs a tokenizer; "
                         f"{model_config.path} has none")
    path = str(tokenizer.name_or_path)
    # EOS ids the tokenizer lacks (a config naming more ids than the vocabulary has) cannot be masked in.
    eos = tuple(sorted(i for i in eos_token_ids(model_config, tokenizer) if i < len(tokenizer)))
    try:
        grammar = grammar_text(spec)
        ll = ll_tokenizer(path, eos, tokenizer)
        error = llguidance.LLMatcher.validate_grammar(grammar, ll)
    except ValueError as exc:
        error = str(exc)
    if error:
        raise ValueError(f"request {request_id}: invalid structured_outputs.{spec.kind}: {error.strip()}")
    return CompiledGrammar(path, eos, grammar, ll.vocab_size)


def _bitmask(engine: EngineState, rows: int, words: int) -> torch.Tensor:
    """A host buffer of ``rows`` masks, reused across steps (pinned on CUDA hosts). Reuse is safe:
    the copy that read it last step finished before that step's tokens were sampled, and this
    step's job waited for those tokens (``in_flight_token_ids``) before filling it."""
    buffer = engine.bitmasks.get(words)
    if buffer is None or buffer.shape[0] < rows:
        buffer = torch.empty(max(rows, 2 * (0 if buffer is None else buffer.shape[0])), words, dtype=torch.int32,
                             pin_memory=torch.cuda.is_available())
        engine.bitmasks[words] = buffer
    return buffer[:rows]


class MaskJob:
    """One step's grammar masks (the plugin's ``LogitsJob``): the constrained rows' new tokens go
    to the matcher process as soon as the previous step's tokens are known (``tokens_ready``, on
    the thread that read them, or ``run``, whichever comes first); ``apply`` takes back their
    masks and masks those rows of the logits."""

    def __init__(self, batch: Batch, rows: list[int], engine: EngineState):
        self.batch = batch
        self.rows = rows  # the constrained logits rows
        self.engine = engine
        self.in_flight: dict[str, int] = {}
        self.row_index: torch.Tensor | None = None  # ``rows`` as a host tensor, pinned on CUDA hosts
        self._sending = threading.RLock()  # re-entered: reading the in-flight tokens may call tokens_ready
        self._sent = False

    def tokens_ready(self) -> None:
        """The previous step's tokens were just read on the host: send now, so the process works
        while the engine processes outputs and schedules (the job thread would get the GIL for
        its message only when the main thread blocks)."""
        self._send_once()

    def run(self) -> None:
        """Send the step, if ``tokens_ready`` has not. The reply is read in ``apply``: a thread
        waiting for it here would then wait again for the GIL, which the main thread holds while
        it schedules."""
        self._send_once()

    def _send_once(self) -> None:
        with self._sending:
            if self._sent:
                return
            self._sent = True
            self.in_flight = self.batch.in_flight_token_ids()  # waits for the previous step alone
            self.row_index = torch.tensor(self.rows, pin_memory=torch.cuda.is_available())
            try:
                self._send()
            except MatcherProcessExited as exc:
                self._restart(exc)

    def apply(self, logits: torch.Tensor) -> None:
        engine = self.engine
        try:
            masks, failures = engine.process.receive_step()
        except MatcherProcessExited as exc:
            self._restart(exc)
            masks, failures = engine.process.receive_step()
        for request_id, reason in failures:
            logger.warning("request %s: structured output failed (%s); the request is ended with EOS",
                           request_id, reason)
        bitmask = _bitmask(engine, masks.shape[0], masks.shape[1])
        bitmask.copy_(masks)  # out of the shared buffer, which the next step refills
        apply_bitmask(logits, self.row_index, bitmask)

    def _restart(self, exc: MatcherProcessExited) -> None:
        # The matchers went with the process: a new one rebuilds them from every output token.
        logger.warning("%s; starting a new one", exc)
        self.engine.close()
        self.engine.matchers.clear()
        self.engine.drops.clear()
        self._send()

    def _send(self) -> None:
        """One message to the matcher process (started on first use): each constrained row's
        request, its grammar when the process has no matcher for it, its new tokens."""
        engine = self.engine
        if engine.process is None:
            engine.process = MatcherProcess()
        messages = []
        drafts = self.batch.drafts_before_rows()
        for j in self.rows:
            state = self.batch.sampling_requests[j]
            compiled: CompiledGrammar = state.sampling_params.extra_args[COMPILED_KEY]
            entry = engine.matchers.get(state.request_id)
            grammar = None
            if entry is None or entry.state is not state:
                entry = engine.matchers[state.request_id] = _Tracked(state)
                engine.process.add_tokenizer(compiled.tokenizer_key, tokenizer_json(compiled.tokenizer_path),
                                             compiled.eos_token_ids)
                grammar = compiled.grammar
            # Only the new tokens are read: a request's output may be long. A request checking
            # guesses has a row per guess after its first: those bring no new tokens.
            new = state.all_token_ids[state.num_prompt_tokens + entry.consumed:]
            if state.request_id in self.in_flight and not drafts[j]:
                new.append(self.in_flight[state.request_id])
            entry.consumed += len(new)
            messages.append((state.request_id, compiled.tokenizer_key, grammar, new, drafts[j]))
        words = (compiled.vocab_size + 31) // 32  # an engine's requests share one tokenizer
        drops = [engine.drops.popleft() for _ in range(len(engine.drops))]
        engine.process.send_step(drops, messages, words)


def apply_bitmask(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Set to -inf every token of ``logits[rows[k]]`` whose bit is 0 in ``bitmask[k]``; tokens past
    the mask's width (ids the tokenizer lacks) are masked too. One kernel on CUDA. ``rows`` and
    ``bitmask`` are host tensors, pinned on CUDA hosts, so neither copy waits for the device."""
    device = logits.device
    ops_for(logits).apply_token_bitmask(logits, bitmask.to(device, non_blocking=True),
                                        rows.to(device, non_blocking=True))


def drop(engine: EngineState, state: CachedRequestState) -> None:
    """Forget a finished request; its matcher goes with the next step's message."""
    entry = engine.matchers.get(state.request_id)
    if entry is not None and entry.state is state:
        del engine.matchers[state.request_id]
        engine.drops.append(state.request_id)
