"""Penalties, logit bias, allowed tokens and bad words: the logits the sampler receives equal
transformers' processors (or a hand computation) on the same weights, and greedy tokens equal
transformers' ``generate``."""

from __future__ import annotations

import pytest
import torch
from transformers import RepetitionPenaltyLogitsProcessor

from hookllm import LLM, SamplingParams, testing

from hookllm.worker import sampler

PROMPT = [3, 14, 15, 92, 65, 35, 89, 79, 32, 38]
ATOL = 1e-4


@pytest.fixture(scope="module")
def llm(tiny_llama_dir) -> LLM:
    return LLM(str(tiny_llama_dir), dtype="float32", device="cpu")


@pytest.fixture
def captured(monkeypatch) -> list[torch.Tensor]:
    """Every logits tensor the core sample hook receives (after the penalty stage and process_logits)."""
    seen: list[torch.Tensor] = []
    real = sampler.sample

    def capture(logits, *args):
        seen.append(logits.clone())
        return real(logits, *args)

    monkeypatch.setattr(sampler, "sample", capture)
    return seen


def raw_logits(reference, token_ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return reference(torch.tensor([token_ids])).logits[0, -1].float()


def run(llm: LLM, **params) -> list[int]:
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, **params)
    return llm.generate({"prompt_token_ids": PROMPT}, params, use_tqdm=False)[0].outputs[0].token_ids


def test_repetition_penalty_logits_equal_transformers_processor(llm, tiny_llama_reference, captured):
    tokens = run(llm, repetition_penalty=1.7)
    processor = RepetitionPenaltyLogitsProcessor(1.7)
    for step, logits in enumerate(captured):
        ids = PROMPT + tokens[:step]
        expected = processor(torch.tensor([ids]), raw_logits(tiny_llama_reference, ids)[None])[0]
        torch.testing.assert_close(logits[0], expected, atol=ATOL, rtol=0)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_repetition_penalty_greedy_equals_transformers_generate(tiny_llama_dir, tiny_llama_reference, async_scheduling):
    llm = LLM(str(tiny_llama_dir), dtype="float32", device="cpu", async_scheduling=async_scheduling)
    with torch.inference_mode():
        ids = torch.tensor([PROMPT])
        expected = tiny_llama_reference.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12,
                                                 min_new_tokens=12, do_sample=False, repetition_penalty=1.7,
                                                 eos_token_id=None, pad_token_id=0)[0, len(PROMPT):].tolist()
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, repetition_penalty=1.7)
    assert llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0].token_ids == expected
    assert expected != testing.reference_greedy(tiny_llama_reference, PROMPT, 12)  # the penalty mattered


def test_frequency_and_presence_penalties_count_output_tokens_only(llm, tiny_llama_reference, captured):
    tokens = run(llm, frequency_penalty=0.6, presence_penalty=0.9)
    for step, logits in enumerate(captured):
        ids = PROMPT + tokens[:step]
        counts = torch.bincount(torch.tensor(tokens[:step], dtype=torch.long), minlength=logits.shape[-1]).float()
        expected = raw_logits(tiny_llama_reference, ids) - 0.6 * counts - 0.9 * (counts > 0).float()
        torch.testing.assert_close(logits[0], expected, atol=ATOL, rtol=0)


def test_logit_bias_and_allowed_token_ids(llm, tiny_llama_reference, captured):
    allowed = [5, 17, 40, 200]
    tokens = run(llm, logit_bias={17: 3.0, 40: -2.5}, allowed_token_ids=allowed)
    assert set(tokens) <= set(allowed)
    for step, logits in enumerate(captured):
        raw = raw_logits(tiny_llama_reference, PROMPT + tokens[:step])
        expected = torch.full_like(raw, float("-inf"))
        expected[allowed] = raw[allowed] + torch.tensor([0.0, 3.0, -2.5, 0.0])
        torch.testing.assert_close(logits[0], expected, atol=ATOL, rtol=0)


def test_bad_words_ban_the_last_token_after_the_rest(llm, tiny_llama_reference):
    free = run(llm)
    # A two-token word of the free output whose text tokenizes back to those two tokens.
    for start in range(len(free) - 1):
        word = llm.get_tokenizer().decode(free[start:start + 2])
        spellings = llm.engine.input_processor._resolve_params("probe", SamplingParams(bad_words=[word])).bad_words_token_ids
        if free[start:start + 2] in spellings:
            break
    # By hand: greedy from transformers' logits, banning a spelling's last token where the output
    # ends with the tokens before it.
    expected: list[int] = []
    for _ in range(6):
        logits = raw_logits(tiny_llama_reference, PROMPT + expected)
        for spelling in spellings:
            if len(spelling) == 1 or expected[-(len(spelling) - 1):] == spelling[:-1]:
                logits[spelling[-1]] = float("-inf")
        expected.append(int(logits.argmax()))
    assert run(llm, bad_words=[word]) == expected != free


def test_penalised_and_plain_requests_share_a_batch(llm):
    plain_alone = run(llm)
    penalised_alone = run(llm, repetition_penalty=1.7, frequency_penalty=0.5)
    params = [SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, repetition_penalty=1.7, frequency_penalty=0.5),
              SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)]
    together = [o.outputs[0].token_ids for o in llm.generate([PROMPT, PROMPT], params, use_tqdm=False)]
    assert together == [penalised_alone, plain_alone]


def test_requests_without_penalties_allocate_no_penalty_state(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), dtype="float32", device="cpu")
    run(llm)
    adjuster = llm.engine.engine_core.executor.runner.logits_adjuster
    assert adjuster.counts.numel() == 0 and not adjuster.slots


def test_finished_requests_free_their_penalty_slots(llm):
    run(llm, repetition_penalty=1.2)
    adjuster = llm.engine.engine_core.executor.runner.logits_adjuster
    assert not adjuster.slots and len(adjuster.free) == adjuster.counts.shape[0] > 0


def test_the_penalty_stage_follows_rows_that_move_join_and_leave():
    """The stage keeps its row index while a step's requests repeat: when they reorder, a new
    one takes a slot or one leaves, the bias still lands on the row of the request that asked."""
    from hookllm.worker.batch import Batch, CachedRequestState
    from hookllm.worker.penalties import LogitsAdjuster

    def request(name: str, **params) -> CachedRequestState:
        return CachedRequestState(name, [1, 2], 2, SamplingParams(**params))

    biased, plain, late = request("biased", logit_bias={3: 5.0}), request("plain"), request("late", logit_bias={4: 7.0})
    adjuster = LogitsAdjuster(torch.device("cpu"))
    for r in (biased, plain):
        adjuster.add(r)

    def adjusted(*requests: CachedRequestState) -> torch.Tensor:
        logits = torch.zeros(len(requests), 6)
        adjuster.apply(logits, Batch(list(requests), [1] * len(requests), list(requests), [2] * len(requests), None))
        return logits

    assert adjusted(biased, plain)[:, 3].tolist() == [5.0, 0.0]
    assert adjusted(biased, plain)[:, 3].tolist() == [5.0, 0.0]  # the same rows again
    assert adjusted(plain, biased)[:, 3].tolist() == [0.0, 5.0]  # reordered
    adjuster.add(late)
    assert adjusted(plain, biased, late)[:, [3, 4]].tolist() == [[0.0, 0.0], [5.0, 0.0], [0.0, 7.0]]
    adjuster.remove("biased")
    assert adjusted(plain, late)[:, [3, 4]].tolist() == [[0.0, 0.0], [0.0, 7.0]]
