"""Offline beam search, vLLM-shaped: a loop over engine steps whose beams fork on shared blocks.

Each live beam is a request that computes its last token and reports the top ``2 * beam_width``
log-probabilities of the next one (``max_tokens=1``). The best continuations become the next
beams: each is forked from its parent with :meth:`LLMEngine.fork_request`, so it shares the
parent's KV blocks (a partial last block is copied before either writes into it) and computes
only its one new token. Selection follows transformers' ``generate(num_beams=k,
early_stopping=True)``: the top ``2k`` candidates by cumulative log-probability; those among the
top ``k`` that end (EOS, or the last allowed token) are finished hypotheses scored
``cum_logprob / generated_len ** length_penalty``; the best ``k`` others run on; the search stops
once ``k`` hypotheses are finished.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from hookllm.outputs import RequestOutput
from hookllm.sampling_params import SamplingParams

if TYPE_CHECKING:
    from hookllm.lora.request import LoRARequest
    from hookllm.engine.llm_engine import LLMEngine


@dataclass
class BeamSearchParams:
    """``temperature`` is accepted for vLLM compatibility; scores use the unscaled log-probabilities."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0

    def __post_init__(self) -> None:
        for name in ("beam_width", "max_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")


@dataclass
class BeamSearchSequence:
    """One returned beam: ``tokens`` are the prompt's then the generated ones (EOS included),
    ``text`` their decoding, ``cum_logprob`` the generated tokens' summed log-probabilities."""

    tokens: list[int]
    cum_logprob: float
    text: str | None = None
    score: float = 0.0  # cum_logprob / generated_len ** length_penalty, what beams are sorted by


@dataclass
class BeamSearchOutput:
    sequences: list[BeamSearchSequence] = field(default_factory=list)


@dataclass
class _Beam:
    request_id: str
    generated: list[int]
    cum_logprob: float


def beam_search(engine: "LLMEngine", prompt: Any, params: BeamSearchParams, ids: "itertools.count[int]",
                lora_request: LoRARequest | None = None) -> BeamSearchOutput:
    """Run one prompt's beam search to the end on ``engine`` (other requests may share the steps),
    with ``lora_request``'s adapter if given (every beam forks with it)."""
    k = params.beam_width
    if 2 * k > engine.max_logprobs:
        raise ValueError(f"beam_width={k} needs the top {2 * k} logprobs of each step, over the limit of "
                         f"{engine.max_logprobs} (max_logprobs, capped by the vocabulary)")
    step_params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, logprobs=2 * k,
                                 output_kind="final_only")
    eos = set() if params.ignore_eos else engine.eos_token_ids
    root = f"beam-{next(ids)}"
    engine.add_request(root, prompt, step_params, lora_request)
    engine.retain_blocks(root)
    beams = [_Beam(root, [], 0.0)]
    prompt_tokens: list[int] = []
    max_tokens = params.max_tokens  # capped by max_model_len once the prompt's length is known
    finished: list[tuple[float, list[int], float]] = []  # (score, generated tokens, cum_logprob)
    try:
        for length in itertools.count(1):
            outputs = _run(engine, [b.request_id for b in beams])
            if length == 1:
                prompt_tokens = list(outputs[root].prompt_token_ids)
                # As generate does, a beam ends at max_model_len.
                max_tokens = min(max_tokens, engine.model_config.max_model_len - len(prompt_tokens))
            # Entries may be floats or Logprob-like objects with a .logprob.
            logprobs = {request_id: {token: getattr(lp, "logprob", lp)
                                     for token, lp in output.outputs[0].logprobs[0].items()}
                        for request_id, output in outputs.items()}
            candidates = sorted(((b.cum_logprob + lp, i, token) for i, b in enumerate(beams)
                                 for token, lp in logprobs[b.request_id].items()), key=lambda c: -c[0])[:2 * k]
            last = length == max_tokens
            running: list[tuple[float, int, int]] = []
            for rank, (cum, i, token) in enumerate(candidates):
                if last or token in eos:
                    if rank < k:  # the rest only stand by so that k beams can run on
                        finished.append((cum / length ** params.length_penalty, beams[i].generated + [token], cum))
                elif len(running) < k:
                    running.append((cum, i, token))
            finished = sorted(finished, key=lambda f: -f[0])[:k]
            if last or len(finished) >= k:
                break
            next_beams = []
            for cum, i, token in running:
                child = f"beam-{next(ids)}"
                engine.fork_request(beams[i].request_id, child, [token], step_params)
                next_beams.append(_Beam(child, beams[i].generated + [token], cum))
            for b in beams:
                engine.release_request(b.request_id)
            beams = next_beams
    finally:
        for b in beams:
            engine.abort_request(b.request_id)
            engine.release_request(b.request_id)
    tokenizer = engine.get_tokenizer()
    sequences = [BeamSearchSequence(prompt_tokens + tokens, cum, score=score,
                                    text=tokenizer.decode(prompt_tokens + tokens) if tokenizer is not None else None)
                 for score, tokens, cum in finished]
    return BeamSearchOutput(sequences)


def _run(engine: "LLMEngine", request_ids: list[str]) -> dict[str, RequestOutput]:
    """Step the engine until each of ``request_ids`` has its one token: their final outputs."""
    wanted, found = set(request_ids), {}
    while len(found) < len(wanted) and engine.has_unfinished_requests():
        for output in engine.step():
            if output.request_id in wanted and output.finished:
                found[output.request_id] = output
    return found
