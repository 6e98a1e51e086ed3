"""Prompt logprobs equal a transformers forward's log_softmax, also across prefill chunks."""

from __future__ import annotations

import pytest
import torch

from hookllm import LLM, Logprob, SamplingParams

PROMPT = [3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46, 26, 43, 38, 32, 79, 50, 28, 84, 19]


@pytest.fixture(scope="module")
def expected(tiny_llama_reference) -> torch.Tensor:
    with torch.no_grad():
        return tiny_llama_reference(torch.tensor([PROMPT])).logits[0].float().log_softmax(dim=-1)


def check(output, expected: torch.Tensor, k: int, prompt: list[int] = PROMPT) -> None:
    entries = output.prompt_logprobs
    assert len(entries) == len(prompt) and entries[0] is None
    for position, entry in enumerate(entries[1:]):
        row = expected[position]
        token = prompt[position + 1]
        assert abs(entry[token].logprob - row[token].item()) < 1e-4
        assert entry[token].rank == int((row > row[token]).sum()) + 1
        top = row.topk(k).indices.tolist()
        assert set(top) <= set(entry) and [entry[t].rank for t in top] == list(range(1, k + 1))
        assert len(entry) == k + (token not in top)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_prompt_logprobs_equal_transformers_log_softmax(tiny_llama_dir, expected, async_scheduling):
    llm = LLM(str(tiny_llama_dir), dtype="float32", device="cpu", async_scheduling=async_scheduling)
    out = llm.generate([PROMPT], SamplingParams(max_tokens=2, prompt_logprobs=3), use_tqdm=False)[0]
    check(out, expected, 3)
    assert isinstance(out.prompt_logprobs[1][PROMPT[1]], Logprob) and out.prompt_logprobs[1][PROMPT[1]].decoded_token


def test_prompt_logprobs_across_prefill_chunks(tiny_llama_dir, expected):
    # 7-token steps split the 20-token prompt into three chunks, one of which samples nothing.
    llm = LLM(str(tiny_llama_dir), dtype="float32", device="cpu", max_num_batched_tokens=7)
    out = llm.generate([PROMPT], SamplingParams(max_tokens=2, prompt_logprobs=1), use_tqdm=False)[0]
    check(out, expected, 1)


def test_requests_of_one_step_get_their_own_prompt_logprobs(tiny_llama_dir, tiny_llama_reference):
    """Prompts of several lengths asking 3, none, 0 and 1 top ones, prefilled in one step."""
    prompts = [PROMPT, PROMPT[:12], PROMPT[:9], PROMPT[5:]]
    asked = [3, None, 0, 1]
    llm = LLM(str(tiny_llama_dir), dtype="float32", device="cpu")
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                           [SamplingParams(max_tokens=2, prompt_logprobs=k) for k in asked], use_tqdm=False)
    assert outputs[1].prompt_logprobs is None
    for prompt, k, output in zip(prompts, asked, outputs):
        if k is not None:
            with torch.no_grad():
                expected = tiny_llama_reference(torch.tensor([prompt])).logits[0].float().log_softmax(dim=-1)
            check(output, expected, k, prompt)


def test_no_prompt_logprobs_unless_asked(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), dtype="float32", device="cpu")
    assert llm.generate([PROMPT], SamplingParams(max_tokens=2), use_tqdm=False)[0].prompt_logprobs is None


def test_sampled_logprobs_are_logprob_entries_with_ranks_and_a_cumulative_sum(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), dtype="float32", device="cpu")
    out = llm.generate([PROMPT], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, logprobs=2),
                       use_tqdm=False)[0].outputs[0]
    chosen = [entry[token] for token, entry in zip(out.token_ids, out.logprobs)]
    assert all(c.rank == 1 for c in chosen)  # greedy picks the top token
    assert out.cumulative_logprob == pytest.approx(sum(c.logprob for c in chosen))
