"""Bad input is refused with a ValueError naming the request and the field, never coerced, and
leaves nothing behind."""

from __future__ import annotations

import math

import pytest

from hookllm import LLM, SamplingParams, testing


@pytest.fixture(scope="module")
def llm(tiny_llama_dir) -> LLM:
    return LLM(str(tiny_llama_dir), dtype="float32", device="cpu")


def assert_nothing_left(llm: LLM) -> None:
    assert not llm.engine.has_unfinished_requests() and llm.engine.get_num_unfinished_requests() == 0
    testing.assert_all_blocks_free(llm)


@pytest.mark.parametrize("bad", [1.5, "3", None, True])
def test_non_int_token_ids_are_refused(llm, bad):
    with pytest.raises(ValueError, match=r"prompt 0: request \S+: prompt_token_ids must be ints"):
        llm.generate({"prompt_token_ids": [5, bad, 7]}, use_tqdm=False)
    assert_nothing_left(llm)


@pytest.mark.parametrize("bad", [-1, 10**6])
def test_token_ids_outside_the_vocabulary_are_refused(llm, bad):
    with pytest.raises(ValueError, match=r"prompt 0: request \S+: prompt token ids must be in \[0, \d+\)"):
        llm.generate({"prompt_token_ids": [5, bad, 7]}, use_tqdm=False)
    assert_nothing_left(llm)


def test_texts_the_engine_tokenizes_are_still_bounded_by_the_models_vocabulary(llm, monkeypatch):
    # Their ids skip the per-id type checks, not the vocabulary's bound (a tokenizer may have
    # added tokens the model's embeddings lack).
    processor = llm.engine.input_processor
    monkeypatch.setattr(processor, "vocab_size", 3)
    with pytest.raises(ValueError, match=r"prompt 0: request \S+: prompt token ids must be in \[0, 3\)"):
        llm.generate(["hello world", "the capital"], use_tqdm=False)
    assert_nothing_left(llm)


def test_prompt_token_ids_given_as_a_string_are_refused(llm):
    with pytest.raises(ValueError, match="prompt_token_ids must be a list of ints, got str"):
        llm.generate({"prompt_token_ids": "5 6 7"}, use_tqdm=False)


@pytest.mark.parametrize("prompts", [None, 3.5])
def test_generate_refuses_a_prompt_of_the_wrong_type(llm, prompts):
    with pytest.raises(ValueError, match="prompts must be a prompt or a list of prompts"):
        llm.generate(prompts, use_tqdm=False)


@pytest.mark.parametrize("field", ["temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                                   "repetition_penalty"])
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_non_finite_sampling_values_are_refused(field, value):
    with pytest.raises(ValueError, match=f"{field} must be a finite number"):
        SamplingParams(**{field: value})


def test_any_error_while_adding_removes_the_calls_earlier_requests(llm, monkeypatch):
    processor = llm.engine.input_processor
    real = processor._make_request
    calls = []

    def fail_on_second(request_id, prompt, params):
        calls.append(request_id)
        if len(calls) == 2:
            raise RuntimeError("tokenizer crashed")
        return real(request_id, prompt, params)

    monkeypatch.setattr(processor, "_make_request", fail_on_second)
    with pytest.raises(RuntimeError, match="tokenizer crashed"):
        llm.generate([[5, 6, 7], [8, 9]], SamplingParams(max_tokens=2), use_tqdm=False)
    monkeypatch.undo()
    assert_nothing_left(llm)
    assert llm.generate([[5, 6, 7]], testing.greedy(2), use_tqdm=False)[0].outputs[0].token_ids


def test_generated_request_ids_skip_ids_the_user_took(llm):
    llm.engine.add_request("0", [5, 6, 7], SamplingParams(max_tokens=2))
    llm.engine.add_request("1", [5, 6, 7], SamplingParams(max_tokens=2))
    llm._request_counter = iter(range(10))  # the next generated ids would be "0", "1", "2"
    outputs = llm.generate([[8, 9]], testing.greedy(2), use_tqdm=False)
    assert [o.request_id for o in outputs] == ["2"]
    llm.engine.abort_request(["0", "1"])
    assert_nothing_left(llm)


def test_stop_strings_need_detokenize():
    with pytest.raises(ValueError, match="detokenize=False"):
        SamplingParams(stop=["x"], detokenize=False)


def test_logit_bias_token_ids_must_be_ints():
    with pytest.raises(ValueError, match="logit_bias token ids must be ints"):
        SamplingParams(logit_bias={1.5: 2.0})


def test_a_refused_prompt_in_a_later_batch_aborts_every_request_of_the_call(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), dtype="float32", device="cpu", max_num_seqs=2)
    prompts = [[5, 6, 7]] * 4 + [{"prompt_token_ids": [5, None]}]
    with pytest.raises(ValueError, match=r"prompt 4: request \S+: prompt_token_ids must be ints"):
        llm.generate(prompts, SamplingParams(max_tokens=8), use_tqdm=False)
    assert_nothing_left(llm)
