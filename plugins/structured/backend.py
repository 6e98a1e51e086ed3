"""The llguidance side of the structured plugin: compiling constraints, matchers, token masks.

Imported only when a request uses structured output (the plugin's hooks import it lazily).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from typing import Any

import llguidance
import llguidance.hf
import llguidance.torch
import torch

from hookllm.worker.batch import Batch, CachedRequestState
from hookllm.kernels import ops_for
from hookllm.plugins import structured
from hookllm.plugins.structured import COMPILED_KEY
from hookllm.sampling_params import SamplingParams, StructuredOutputsParams
from hookllm.utils import to_device_async

logger = logging.getLogger(__name__)

# Process-wide, as they hold no engine's state: building an LLTokenizer walks the whole
# vocabulary (~0.5 s for 49k tokens), so once per tokenizer; llguidance's thread pool, once.
_LL_TOKENIZERS: dict[str, llguidance.LLTokenizer] = {}


@dataclass(frozen=True)
class CompiledGrammar:
    """What a worker needs to build a request's matcher; plain data, so it pickles."""

    tokenizer_path: str
    eos_token_ids: tuple[int, ...]
    grammar: str  # llguidance's grammar text


@dataclass
class _Matcher:
    state: CachedRequestState  # the runner's object: a different one (a re-added request) starts over
    matcher: llguidance.LLMatcher
    tokenizer: llguidance.LLTokenizer
    consumed: int = 0  # output tokens the matcher has consumed
    error: str | None = None


_EXECUTOR: llguidance.LLExecutor | None = None


@dataclass
class EngineState:
    """The plugin's state in one engine, where the model runs."""

    matchers: dict[str, _Matcher] = field(default_factory=dict)  # by request id; dropped in request_finished
    bitmasks: dict[int, torch.Tensor] = field(default_factory=dict)  # host buffers by mask width (32-bit words)


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


def ll_tokenizer(path: str, eos_token_ids: tuple[int, ...], hf_tokenizer: Any = None) -> llguidance.LLTokenizer:
    """The LLTokenizer of the tokenizer at ``path`` (built once per process; a worker in another
    process loads the HF tokenizer from ``path``)."""
    tokenizer = _LL_TOKENIZERS.get(path)
    if tokenizer is None:
        if hf_tokenizer is None:
            from hookllm.tokenizer import load_tokenizer

            hf_tokenizer = load_tokenizer(path)
        tokenizer = llguidance.hf.from_tokenizer(hf_tokenizer, eos_token=list(eos_token_ids))
        _LL_TOKENIZERS[path] = tokenizer
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
        error = llguidance.LLMatcher.validate_grammar(grammar, ll_tokenizer(path, eos, tokenizer))
    except ValueError as exc:
        error = str(exc)
    if error:
        raise ValueError(f"request {request_id}: invalid structured_outputs.{spec.kind}: {error.strip()}")
    return CompiledGrammar(path, eos, grammar)


def _matcher_of(engine: EngineState, state: CachedRequestState) -> _Matcher:
    entry = engine.matchers.get(state.request_id)
    if entry is None or entry.state is not state:
        compiled: CompiledGrammar = state.sampling_params.extra_args[COMPILED_KEY]
        tokenizer = ll_tokenizer(compiled.tokenizer_path, compiled.eos_token_ids)
        # Building a matcher takes ~0.5 ms (llguidance drops the GIL for it).
        entry = _Matcher(state, llguidance.LLMatcher(tokenizer, compiled.grammar), tokenizer)
        engine.matchers[state.request_id] = entry
    return entry


def _advance(entries: list[_Matcher], in_flight: dict[str, int]) -> None:
    """Feed each matcher the output tokens it has not seen (the in-flight one included); record
    the first error. Only the new tokens are read: a request's output may be long. The usual
    step's one new token per matcher goes to llguidance's parallel consume, which runs without
    the GIL (consuming one matcher at a time holds it); a longer tail (a re-added request) goes
    alone."""
    single: list[tuple[_Matcher, int]] = []
    for entry in entries:
        state = entry.state
        new = state.all_token_ids[state.num_prompt_tokens + entry.consumed:]
        if state.request_id in in_flight:
            new.append(in_flight[state.request_id])
        entry.consumed += len(new)
        # A stopped matcher (the grammar is complete, EOS seen) takes nothing more: with ignore_eos
        # the request goes on sampling EOS, which is not an error.
        if not new or entry.error is not None or entry.matcher.is_stopped():
            continue
        if len(new) == 1:
            single.append((entry, new[0]))
        elif not entry.matcher.consume_tokens(new):
            _fail(entry)
    if single:
        accepted = _executor().consume_token_par([(entry.matcher, token) for entry, token in single])
        for (entry, _), ok in zip(single, accepted):
            if not ok:
                _fail(entry)


def _fail(entry: _Matcher) -> None:
    entry.error = _reason(entry.matcher.get_error())
    logger.warning("request %s: structured output failed (%s); the request is ended with EOS",
                   entry.state.request_id, entry.error)


def _executor() -> llguidance.LLExecutor:
    """llguidance's thread pool, made once per process."""
    global _EXECUTOR
    if _EXECUTOR is None:
        _EXECUTOR = llguidance.LLExecutor()
    return _EXECUTOR


def _reason(error: str) -> str:
    # llguidance's error text dumps the parser state; its "Error: Parser Error: ..." line says why.
    for line in error.splitlines():
        if line.startswith("Error:"):
            return line.removeprefix("Error:").strip().removeprefix("Parser Error:").strip()
    return error.strip().splitlines()[0] if error.strip() else "the matcher refused a token"


def _bitmask(engine: EngineState, rows: int, words: int) -> torch.Tensor:
    """A host buffer of ``rows`` masks, reused across steps (pinned on CUDA hosts). Reuse is safe:
    the copy that read it last step finished before that step's tokens were sampled, and this
    step's job waited for those tokens (``in_flight_token_ids``) before filling it."""
    buffer = engine.bitmasks.get(words)
    if buffer is None or buffer.shape[0] < rows:
        buffer = llguidance.torch.allocate_token_bitmask(max(rows, 2 * (0 if buffer is None else buffer.shape[0])),
                                                         32 * words)
        engine.bitmasks[words] = buffer
    return buffer[:rows]


class MaskJob:
    """One step's grammar masks (the plugin's ``LogitsJob``): ``run`` advances the constrained
    rows' matchers and fills their bitmasks on the host, off the main thread when a step is in
    flight; ``apply`` masks those rows of the logits."""

    def __init__(self, batch: Batch, rows: list[int], engine: EngineState):
        self.batch = batch
        self.rows = rows  # the constrained logits rows
        self.engine = engine
        self.bitmask: torch.Tensor | None = None

    def run(self) -> None:
        in_flight = self.batch.in_flight_token_ids()  # waits for the previous step alone
        entries = [_matcher_of(self.engine, self.batch.sampling_requests[j]) for j in self.rows]
        _advance(entries, in_flight)
        self.bitmask = _fill(self.engine, entries)

    def apply(self, logits: torch.Tensor) -> None:
        apply_bitmask(logits, self.rows, self.bitmask)


def _fill(engine: EngineState, entries: list[_Matcher]) -> torch.Tensor:
    """The next-token bitmasks of ``entries``' matchers, one row each: EOS only for a stopped or
    failed matcher, else what its grammar allows."""
    tokenizer = entries[0].tokenizer  # an engine's requests share one
    bitmask = _bitmask(engine, len(entries), (tokenizer.vocab_size + 31) // 32)
    healthy, stopped = [], []
    for k, entry in enumerate(entries):
        if entry.error is not None or entry.matcher.is_stopped():
            stopped.append(k)
        else:
            healthy.append((entry.matcher, k))
    if stopped:  # EOS only: ends the request (unless ignore_eos); one copy for all those rows
        eos_only = torch.zeros(bitmask.shape[1], dtype=torch.int32)
        for eos in tokenizer.eos_tokens:
            eos_only[eos // 32] |= _bit(eos % 32)
        bitmask[stopped] = eos_only
    if healthy:
        # In Rust, on llguidance's thread pool, without the GIL.
        llguidance.torch.fill_next_token_bitmask_par(_executor(), healthy, bitmask)
    return bitmask


def _bit(index: int) -> int:
    # Bit 31 as a signed int32.
    return (1 << index) - (1 << 32 if index == 31 else 0)


def apply_bitmask(logits: torch.Tensor, rows: list[int], bitmask: torch.Tensor) -> None:
    """Set to -inf every token of ``logits[rows[k]]`` whose bit is 0 in ``bitmask[k]``; tokens past
    the mask's width (ids the tokenizer lacks) are masked too. One kernel on CUDA."""
    device = logits.device
    # The bitmask buffer is pinned already (see _bitmask): neither copy waits for the device.
    ops_for(logits).apply_token_bitmask(logits, bitmask.to(device, non_blocking=True),
                                        to_device_async(torch.tensor(rows), device))


def drop(engine: EngineState, state: CachedRequestState) -> None:
    entry = engine.matchers.get(state.request_id)
    if entry is not None and entry.state is state:
        del engine.matchers[state.request_id]
