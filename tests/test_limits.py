"""Every limit a step depends on is checked when a request is added: a request over one is a
ValueError naming the field and the limit, and the engine goes on serving everyone else."""

from __future__ import annotations

import pytest

from hookllm import BeamSearchParams, SamplingParams, testing

PROMPT = {"prompt_token_ids": [5, 6, 7, 8]}
VOCAB = testing.tiny_llama_config().vocab_size


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    from hookllm import LLM

    return LLM(str(tiny_llama_dir), dtype="float32", device="cpu", num_kv_blocks=64)


def assert_serves_on(llm) -> None:
    assert not llm.engine.has_unfinished_requests()
    testing.assert_all_blocks_free(llm)
    assert len(llm.generate(PROMPT, testing.greedy(3), use_tqdm=False)[0].outputs[0].token_ids) == 3


@pytest.mark.parametrize("field", ["logprobs", "prompt_logprobs"])
def test_logprobs_over_max_logprobs_are_refused_naming_the_field_and_the_limit(llm, field):
    with pytest.raises(ValueError, match=rf"{field}=21 is over the limit of 20 \(max_logprobs=20"):
        llm.generate(PROMPT, SamplingParams(max_tokens=2, **{field: 21}), use_tqdm=False)
    assert_serves_on(llm)


def test_max_logprobs_is_an_engine_setting_capped_by_the_vocabulary(make_llm):
    llm = make_llm(num_kv_blocks=64, max_logprobs=10_000)
    with pytest.raises(ValueError, match=rf"logprobs={VOCAB + 1} is over the limit of {VOCAB} "):
        llm.generate(PROMPT, SamplingParams(max_tokens=2, logprobs=VOCAB + 1), use_tqdm=False)
    out = llm.generate(PROMPT, SamplingParams(max_tokens=1, logprobs=VOCAB, temperature=0), use_tqdm=False)[0]
    assert len(out.outputs[0].logprobs[0]) == VOCAB  # the whole vocabulary, ranked
    assert_serves_on(llm)


def test_a_beam_width_over_the_logprobs_limit_is_refused_naming_beam_width(llm):
    with pytest.raises(ValueError, match=r"beam_width=11 needs the top 22 logprobs of each step, over the limit of 20"):
        llm.beam_search([PROMPT], BeamSearchParams(beam_width=11, max_tokens=4))
    assert_serves_on(llm)


@pytest.mark.parametrize("max_tokens", [None, 2.5, True, 0])
def test_beam_search_params_refuse_a_max_tokens_that_is_not_a_positive_int(max_tokens):
    with pytest.raises(ValueError, match="max_tokens must be an int >= 1"):
        BeamSearchParams(beam_width=2, max_tokens=max_tokens)


def test_beam_search_past_max_model_len_ends_at_it_as_generate_does(make_llm):
    llm = make_llm(num_kv_blocks=64, max_model_len=12)
    [result] = llm.beam_search([PROMPT], BeamSearchParams(beam_width=2, max_tokens=50, ignore_eos=True))
    assert [len(s.tokens) for s in result.sequences] == [12, 12]
    assert len(llm.generate(PROMPT, SamplingParams(max_tokens=50, ignore_eos=True), use_tqdm=False)[0]
               .outputs[0].token_ids) == 12 - len(PROMPT["prompt_token_ids"])
    assert_serves_on(llm)


def test_none_in_the_list_of_sampling_params_is_refused_naming_the_item(llm):
    with pytest.raises(ValueError, match=r"sampling_params\[1\] must be a SamplingParams, got NoneType"):
        llm.generate([PROMPT, PROMPT], [SamplingParams(max_tokens=2), None], use_tqdm=False)
    assert_serves_on(llm)
