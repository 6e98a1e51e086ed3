"""The default model (SmolLM2-135M-Instruct, real weights) matches transformers token for token."""

import pytest

from hookllm import LLM, SamplingParams, testing
from hookllm.hub.default_model import default_model_dir

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


# Mean absolute difference of the prompt logprobs (nats: each prompt token's log-probability given
# the tokens before it) allowed against fp32; measured 2026-12-01: see docs/quantization.md.
FP8_TOLERANCES = {"fp8 weights": 0.45, "fp8 KV cache": 0.2, "fp8 weights and KV cache": 0.5}


@pytest.mark.parametrize("name, options", [("fp8 weights", dict(quantization="fp8")),
                                           ("fp8 KV cache", dict(kv_cache_dtype="fp8")),
                                           ("fp8 weights and KV cache", dict(quantization="fp8", kv_cache_dtype="fp8"))])
def test_smollm2_quantized_to_fp8_stays_near_fp32(smollm2, name, options):
    _, reference = smollm2
    llm = LLM(str(default_model_dir()), dtype="float32", device="cpu", **options)
    prompt = list(llm.tokenizer.apply_chat_template([{"role": "user", "content": " ".join(QUESTIONS)}],
                                                    add_generation_prompt=True, tokenize=True,
                                                    return_dict=True)["input_ids"])
    import torch

    with torch.inference_mode():
        ours = testing.prompt_logits(llm, prompt).log_softmax(-1)
        theirs = reference(torch.tensor([prompt])).logits[0].float().log_softmax(-1)
    next_tokens = torch.tensor(prompt[1:])[:, None]
    distance = float((ours[:-1].gather(1, next_tokens) - theirs[:-1].gather(1, next_tokens)).abs().mean())
    print(f"{name}: {distance:.4f}")
    assert 0 < distance < FP8_TOLERANCES[name]


def test_ngram_speculation_on_a_repeating_prompt_accepts_and_changes_no_token(smollm2):
    llm, _ = smollm2  # its greedy tokens equal transformers' (above)
    speculating = LLM(str(default_model_dir()), dtype="float32", device="cpu",
                      speculative_config={"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2})
    counting = "Count with me: one two three four, one two three four, one two three four, one two"
    prompts = [{"prompt_token_ids": llm.tokenizer(counting)["input_ids"]},
               {"prompt_token_ids": list(llm.tokenizer.apply_chat_template(
                   [{"role": "user", "content": QUESTIONS[2]}], add_generation_prompt=True, tokenize=True,
                   return_dict=True)["input_ids"])}]
    params = SamplingParams(temperature=0, max_tokens=24)
    expected = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert [o.outputs[0].token_ids for o in speculating.generate(prompts, params, use_tqdm=False)] == expected
    assert speculating.engine.get_stats().spec_num_accepted_tokens > 0
    speculating.shutdown()


def test_the_model_as_its_own_draft_accepts_its_guesses_and_changes_no_token(smollm2):
    """``draft_model`` over the default model with itself as the draft: its cache follows the
    target's, so nearly every guess holds (the two run one token and a run of tokens at a time,
    whose sums may round apart at a near tie) and the tokens are those without speculation."""
    llm, _ = smollm2
    model_dir = str(default_model_dir())
    speculating = LLM(model_dir, dtype="float32", device="cpu",
                      speculative_config={"method": "draft_model", "model": model_dir, "num_speculative_tokens": 3})
    prompts = [{"prompt_token_ids": list(llm.tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=True,
        return_dict=True)["input_ids"])} for question in QUESTIONS[:2]]
    params = SamplingParams(temperature=0, max_tokens=16)
    expected = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert [o.outputs[0].token_ids for o in speculating.generate(prompts, params, use_tqdm=False)] == expected
    stats = speculating.engine.get_stats()
    assert stats.spec_num_accepted_tokens >= 0.8 * stats.spec_num_draft_tokens > 0
    speculating.shutdown()
