"""The default model (SmolLM2-135M-Instruct, real weights) matches transformers token for token."""

import pytest

from hookllm import LLM, SamplingParams, testing
from hookllm.default_model import default_model_dir

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers.",
    "Explain what a GPU is in one sentence.",
]


@pytest.fixture(scope="module")
def smollm2():
    path = default_model_dir()
    return LLM(str(path), dtype="float32", device="cpu"), testing.load_reference(path)


def test_chat_prompt_tokens_equal_transformers_chat_template(smollm2):
    llm, _ = smollm2
    messages = [{"role": "user", "content": QUESTIONS[0]}]
    ours = llm.chat(messages, SamplingParams(max_tokens=1, temperature=0))[0].prompt_token_ids
    theirs = llm.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)
    assert ours == list(theirs["input_ids"])


def test_greedy_32_tokens_match_transformers(smollm2):
    llm, reference = smollm2
    prompts = [
        llm.tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                          tokenize=True, return_dict=True)["input_ids"]
        for q in QUESTIONS
    ]
    testing.assert_greedy_matches(llm, reference, [list(p) for p in prompts], max_tokens=32)


def test_answers_that_paris_is_the_capital_of_france(smollm2):
    llm, _ = smollm2
    out = llm.chat([{"role": "user", "content": QUESTIONS[0]}], SamplingParams(max_tokens=32, temperature=0))[0]
    assert "Paris" in out.outputs[0].text
    assert out.outputs[0].finish_reason == "stop"  # ended at <|im_end|>, before max_tokens
