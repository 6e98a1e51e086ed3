"""The default sampler: seeds, greedy equivalence and the allowed sets of top-k/top-p/min-p."""

import pytest
import torch

from hookllm import SamplingParams, testing
from hookllm.batch import RequestState
from hookllm.sampler import apply_top_k_top_p_min_p, sample

PROMPTS = [[5, 9, 13, 200, 7], [42, 43, 44], [100] * 12]


def _requests(params_list):
    return [RequestState(str(i), [1], 1, p) for i, p in enumerate(params_list)]


def _draw(logits_row, params, n=400, seed=0):
    """n samples from one row of logits under ``params``."""
    generator = torch.Generator().manual_seed(seed)
    logits = logits_row.repeat(n, 1)
    return sample(logits, _requests([params] * n), generator)


def test_seeded_sampling_is_reproducible(make_llm):
    llm = make_llm()
    params = SamplingParams(max_tokens=12, temperature=1.0, seed=1234, ignore_eos=True)
    first = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)]
    again = [o.outputs[0].token_ids for o in make_llm().generate([{"prompt_token_ids": p} for p in PROMPTS], params)]
    assert first == again


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_a_seed_gives_the_same_tokens_alone_or_in_a_batch(make_llm, async_scheduling):
    llm = make_llm(async_scheduling=async_scheduling)
    seeded = SamplingParams(max_tokens=12, temperature=0.9, seed=7, ignore_eos=True)
    alone = llm.generate({"prompt_token_ids": PROMPTS[0]}, seeded)[0].outputs[0].token_ids
    other = SamplingParams(max_tokens=12, temperature=1.0, ignore_eos=True)
    batch = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], [seeded, other, other])
    assert batch[0].outputs[0].token_ids == alone


def test_different_seeds_give_different_samples(make_llm):
    llm = make_llm()
    outs = [llm.generate({"prompt_token_ids": PROMPTS[0]},
                         SamplingParams(max_tokens=16, temperature=1.5, seed=s, ignore_eos=True))[0].outputs[0].token_ids
            for s in (1, 2)]
    assert outs[0] != outs[1]


def test_top_k_1_equals_greedy(make_llm):
    llm = make_llm()
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    greedy = llm.generate(prompts, testing.greedy(12))
    top1 = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=1.3, top_k=1, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in top1] == [o.outputs[0].token_ids for o in greedy]


# Hand-made distribution over 6 tokens: probabilities 0.4, 0.3, 0.15, 0.1, 0.04, 0.01.
PROBS = torch.tensor([0.15, 0.4, 0.01, 0.3, 0.1, 0.04])
LOGITS = PROBS.log()


@pytest.mark.parametrize("top_p, allowed", [(0.5, {1, 3}), (0.7, {1, 3}), (0.71, {1, 3, 0}), (0.9, {1, 3, 0, 4})])
def test_top_p_samples_only_from_the_nucleus(top_p, allowed):
    # The nucleus is the smallest set of most likely tokens whose mass reaches top_p.
    drawn = set(_draw(LOGITS, SamplingParams(temperature=1.0, top_p=top_p)).tolist())
    assert drawn == allowed


@pytest.mark.parametrize("min_p, allowed", [(0.5, {1, 3}), (0.3, {1, 3, 0}), (0.2, {1, 3, 0, 4})])
def test_min_p_samples_only_tokens_above_min_p_times_the_top_probability(min_p, allowed):
    drawn = set(_draw(LOGITS, SamplingParams(temperature=1.0, min_p=min_p)).tolist())
    assert drawn == allowed


def test_top_k_samples_only_the_k_most_likely():
    drawn = set(_draw(LOGITS, SamplingParams(temperature=1.0, top_k=3)).tolist())
    assert drawn == {1, 3, 0}


def test_filters_apply_per_row():
    logits = LOGITS.repeat(2, 1)
    masked = apply_top_k_top_p_min_p(logits, torch.tensor([2, 0]), torch.tensor([1.0, 1.0]), torch.tensor([0.0, 0.0]))
    assert torch.isinf(masked[0]).sum() == 4 and torch.isfinite(masked[1]).all()


def test_temperature_sampling_follows_the_distribution():
    counts = torch.bincount(_draw(LOGITS, SamplingParams(temperature=1.0), n=20000), minlength=6).float()
    assert torch.allclose(counts / counts.sum(), PROBS, atol=0.015)


def test_greedy_rows_stay_greedy_next_to_sampled_rows():
    logits = LOGITS.repeat(2, 1)
    tokens = sample(logits, _requests([SamplingParams(temperature=0.0), SamplingParams(temperature=1.0)]),
                    torch.Generator().manual_seed(0))
    assert tokens[0].item() == 1
