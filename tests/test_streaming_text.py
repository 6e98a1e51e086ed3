"""Streamed text is never taken back: text that may still become a stop string is held back."""

from __future__ import annotations

import pytest

from hookllm import LLM, RequestOutputKind, SamplingParams, testing

PROMPT = [3, 14, 15, 92, 65, 35, 89, 79, 32, 38]


@pytest.fixture(scope="module")
def llm(tiny_llama_dir) -> LLM:
    return LLM(str(tiny_llama_dir), dtype="float32", device="cpu")


@pytest.fixture(scope="module")
def free_text(llm) -> tuple[list[int], str]:
    out = llm.generate([PROMPT], testing.greedy(12), use_tqdm=False)[0].outputs[0]
    return out.token_ids, out.text


def stream(llm: LLM, params: SamplingParams) -> list:
    llm.engine.add_request("s", PROMPT, params)
    outputs = []
    while llm.engine.has_unfinished_requests():
        outputs += llm.engine.step()
    return outputs


def two_token_stop(llm, free_text) -> str:
    """A stop string spanning two output tokens, starting after the first few."""
    tokens, text = free_text
    tokenizer = llm.get_tokenizer()
    start = len(tokenizer.decode(tokens[:4]))
    stop = text[start:len(tokenizer.decode(tokens[:6]))]
    assert len(stop) >= 2 and text.find(stop) == start
    return stop


@pytest.mark.parametrize("include", [False, True])
def test_deltas_concatenate_to_the_final_text_with_a_two_token_stop_string(llm, free_text, include):
    stop = two_token_stop(llm, free_text)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, stop=[stop],
                            include_stop_str_in_output=include, output_kind=RequestOutputKind.DELTA)
    outputs = stream(llm, params)
    final = llm.generate([PROMPT], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, stop=[stop],
                                                  include_stop_str_in_output=include), use_tqdm=False)[0].outputs[0]
    assert final.finish_reason == "stop" and final.stop_reason == stop
    assert "".join(o.outputs[0].text for o in outputs) == final.text
    assert final.text == free_text[1][:free_text[1].find(stop) + (len(stop) if include else 0)]


def test_cumulative_text_only_grows(llm, free_text):
    stop = two_token_stop(llm, free_text)
    outputs = stream(llm, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, stop=[stop], output_kind="cumulative"))
    texts = [o.outputs[0].text for o in outputs]
    assert all(later.startswith(earlier) for earlier, later in zip(texts, texts[1:]))
    assert not any(stop[:2] in t for t in texts)  # the stop string's start never went out
