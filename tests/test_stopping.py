"""Stop conditions end the output at the right place: stop strings, stop token ids, max_tokens, EOS."""

import pytest

from hookllm import SamplingParams, testing

PROMPT = "Paris is the capital of"


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async"])
def llm(tiny_llama_dir, request):
    """With async scheduling a stopped request's token from the step in flight must be dropped."""
    return testing.LLM(str(tiny_llama_dir), dtype="float32", device="cpu", async_scheduling=request.param)


@pytest.fixture(scope="module")
def free_run(llm):
    """The unstopped greedy continuation: what every stopped run is compared against."""
    out = llm.generate(PROMPT, testing.greedy(40))[0].outputs[0]
    assert len(out.text) > 12
    return out


def test_max_tokens_is_exact(llm):
    for n in (1, 7, 23):
        out = llm.generate(PROMPT, testing.greedy(n))[0].outputs[0]
        assert len(out.token_ids) == n and out.finish_reason == "length"


def test_text_is_the_decoded_token_ids(llm, free_run):
    assert free_run.text == llm.tokenizer.decode(free_run.token_ids, skip_special_tokens=True)


def test_stop_string_cuts_the_text_before_it(llm, free_run):
    stop = free_run.text[5:9]
    expected = free_run.text[: free_run.text.find(stop)]
    out = llm.generate(PROMPT, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, stop=[stop]))[0].outputs[0]
    assert out.text == expected
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.token_ids == free_run.token_ids[: len(out.token_ids)]


def test_include_stop_str_in_output_keeps_it(llm, free_run):
    stop = free_run.text[5:9]
    expected = free_run.text[: free_run.text.find(stop) + len(stop)]
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, stop=stop, include_stop_str_in_output=True)
    assert llm.generate(PROMPT, params)[0].outputs[0].text == expected


def boundary_stop(llm, free_run) -> tuple[str, int, int]:
    """A stop string from the last character of the 4th token's text to the end of the 5th's
    (its first occurrence), and where the 4th and the 5th token's texts end."""
    text, tokens = free_run.text, free_run.token_ids
    fourth, fifth = (len(llm.tokenizer.decode(tokens[:k], skip_special_tokens=True)) for k in (4, 5))
    stop = text[fourth - 1:fifth]
    assert len(stop) >= 2 and text.find(stop) == fourth - 1
    return stop, fourth, fifth


def test_stop_string_ending_in_the_min_tokens_th_token_stops_the_output(llm, free_run):
    stop, fourth, _ = boundary_stop(llm, free_run)
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, stop=[stop], min_tokens=5)
    out = llm.generate(PROMPT, params)[0].outputs[0]
    assert out.text == free_run.text[: fourth - 1] and out.finish_reason == "stop"


def test_stop_string_ending_before_min_tokens_is_passed_over(llm, free_run):
    stop, _, fifth = boundary_stop(llm, free_run)
    # The first occurrence that ends in the 6th token's text or later, if any.
    later = free_run.text.find(stop, fifth - len(stop) + 1)
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, stop=[stop], min_tokens=6)
    out = llm.generate(PROMPT, params)[0].outputs[0]
    if later == -1:
        assert out.text == free_run.text and out.finish_reason == "length"
    else:
        assert out.text == free_run.text[:later] and out.finish_reason == "stop"


def test_stop_token_id_ends_the_output_on_that_token(llm, free_run):
    stop_id = free_run.token_ids[6]
    first = free_run.token_ids.index(stop_id)
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, stop_token_ids=[stop_id])
    out = llm.generate(PROMPT, params)[0].outputs[0]
    assert out.token_ids == free_run.token_ids[: first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_id


def test_eos_stops_unless_ignore_eos(make_llm, free_run):
    # Make the tiny model's EOS a token it is known to produce at step 4.
    llm = make_llm()
    llm.engine.engine_core.scheduler.eos_token_ids = {free_run.token_ids[3]}
    first = free_run.token_ids.index(free_run.token_ids[3])
    stopped = llm.generate(PROMPT, SamplingParams(max_tokens=40, temperature=0))[0].outputs[0]
    assert stopped.token_ids == free_run.token_ids[: first + 1] and stopped.finish_reason == "stop"
    ignored = llm.generate(PROMPT, testing.greedy(40))[0].outputs[0]
    assert ignored.token_ids == free_run.token_ids


def test_min_tokens_defers_stopping(make_llm, free_run):
    llm = make_llm()
    llm.engine.engine_core.scheduler.eos_token_ids = {free_run.token_ids[0]}
    out = llm.generate(PROMPT, SamplingParams(max_tokens=10, min_tokens=10, temperature=0))[0].outputs[0]
    assert len(out.token_ids) == 10


def test_output_stops_at_max_model_len(make_llm):
    llm = make_llm(max_model_len=64)
    out = llm.generate({"prompt_token_ids": [7] * 60}, SamplingParams(max_tokens=None, temperature=0, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 4 and out.outputs[0].finish_reason == "length"


def test_logprobs_come_from_the_processed_logits(llm):
    out = llm.generate(PROMPT, SamplingParams(max_tokens=3, temperature=0, ignore_eos=True, logprobs=2))[0].outputs[0]
    assert len(out.logprobs) == 3
    for token_id, entry in zip(out.token_ids, out.logprobs):
        assert token_id in entry and max(v.logprob for v in entry.values()) == entry[token_id].logprob <= 0.0
