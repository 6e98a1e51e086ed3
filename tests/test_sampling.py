"""The default sampler: seeds and their noise, greedy equivalence and the allowed sets of top-k/top-p/min-p."""

import math
import random

import pytest
import torch

from hookllm import SamplingParams, testing
from hookllm.worker.batch import CachedRequestState
from hookllm.kernels.reference import hashed_exponential_noise
from hookllm.kernels.reference import filter_thresholds
from hookllm.worker.sampler import sample, seeded_row_keys

PROMPTS = [[5, 9, 13, 200, 7], [42, 43, 44], [100] * 12]


def _requests(params_list):
    return [CachedRequestState(str(i), [1], 1, p) for i, p in enumerate(params_list)]


def _draw(logits_row, params, n=400, seed=0):
    """n samples from one row of logits under ``params``."""
    generator = torch.Generator().manual_seed(seed)
    logits = logits_row.repeat(n, 1)
    return sample(logits, _requests([params] * n), generator, [1] * n)


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


@pytest.mark.parametrize("top_k", [6, 100])
def test_a_top_k_of_the_whole_vocabulary_keeps_every_token(top_k):
    assert set(_draw(LOGITS, SamplingParams(temperature=1.0, top_k=top_k)).tolist()) == set(range(6))


def test_filters_apply_per_row():
    logits = LOGITS.repeat(2, 1)
    threshold = filter_thresholds(logits, torch.ones(2), torch.tensor([2, 0]), torch.ones(2), torch.zeros(2),
                                  needed=2, any_top_p=False)
    assert threshold.tolist() == [LOGITS[3].item(), float("-inf")]  # row 0 keeps 0.4 and 0.3


def kept_by_sorting(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """The filters the slow way, as a mask: sort each row, keep the first ``top_k``, then of
    those (renormalized) the prefix while the mass before a token is below ``top_p``, the tokens
    of at least ``min_p`` times the top probability, and always the top token."""
    vocab = logits.shape[1]
    values, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab)[None, :]
    keep = ranks < torch.where(top_k > 0, top_k, vocab)[:, None]
    probs = values.masked_fill(~keep, float("-inf")).softmax(dim=-1)
    keep &= ((probs.cumsum(dim=-1) - probs) < top_p[:, None]) | (top_p[:, None] >= 1.0)
    keep &= probs >= min_p[:, None] * probs[:, :1]
    keep[:, 0] = True
    return torch.zeros_like(keep).scatter_(1, order, keep)


@pytest.mark.parametrize("top_k, top_p, min_p", [
    ([5, 0, 40, 1], [1.0, 1.0, 1.0, 1.0], [0.0, 0.0, 0.0, 0.0]),  # top-k alone, one row unfiltered
    ([0, 0, 0, 0], [0.5, 0.9, 0.99, 1.0], [0.0, 0.0, 0.0, 0.0]),  # top-p alone: a sort of the vocabulary
    ([50, 20, 3, 50], [0.9, 0.5, 0.95, 1.0], [0.0, 0.0, 0.0, 0.0]),  # top-p within top-k: topk only
    ([0, 0, 0, 0], [1.0, 1.0, 1.0, 1.0], [0.05, 0.2, 0.5, 0.0]),  # min-p: no ranking at all
    ([50, 0, 10, 0], [0.9, 1.0, 0.8, 1.0], [0.1, 0.05, 0.0, 0.0]),  # all three together
])
def test_filter_thresholds_keep_what_sorting_keeps(top_k, top_p, min_p):
    """Random logits (no ties) at temperature 0.7: the thresholds keep exactly the sorted way's sets."""
    logits = torch.randn(4, 3000, generator=torch.Generator().manual_seed(sum(top_k))) * 3
    temperature = torch.full((4,), 0.7)
    k, p, m = torch.tensor(top_k), torch.tensor(top_p), torch.tensor(min_p)
    alone = bool(((p < 1) & (k <= 0)).any())
    threshold = filter_thresholds(logits, temperature, k, p, m, needed=3000 if alone else int(k.max()),
                                  any_top_p=bool((p < 1).any()))
    want = kept_by_sorting(logits / 0.7, k, p, m)
    assert torch.equal(logits >= threshold[:, None], want)


def test_top_p_takes_the_nucleus_of_what_top_k_keeps_as_transformers_does():
    """p = (0.45, 0.35, 0.2), top-k 2, top-p 0.5: the top two renormalized are (0.5625, 0.4375),
    whose nucleus is the first alone (the whole distribution's would keep both); transformers'
    warpers chained on the same logits agree, on random rows with min-p too."""
    from transformers.generation.logits_process import MinPLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    logits = torch.tensor([[0.45, 0.35, 0.2]]).log()
    one = torch.ones(1)
    threshold = filter_thresholds(logits, one, torch.tensor([2]), torch.tensor([0.5]), torch.zeros(1), needed=2,
                                  any_top_p=True)
    assert (logits >= threshold[:, None]).tolist() == [[True, False, False]]
    rows = torch.randn(3, 400, generator=torch.Generator().manual_seed(5)) * 2
    for top_k, top_p, min_p in [(40, 0.6, 0.0), (10, 0.9, 0.0), (60, 0.8, 0.02)]:
        warped = TopKLogitsWarper(top_k)(None, rows.clone())
        warped = TopPLogitsWarper(top_p)(None, warped)
        if min_p:
            warped = MinPLogitsWarper(min_p)(None, warped)
        threshold = filter_thresholds(rows, torch.ones(3), torch.full((3,), top_k), torch.full((3,), top_p),
                                      torch.full((3,), min_p), needed=top_k, any_top_p=True)
        assert torch.equal(rows >= threshold[:, None], warped > float("-inf"))


def test_sampler_draws_only_the_filtered_tokens_of_each_row():
    """Through ``sample``: rows with top-k 2, top-p 0.71 and min-p 0.3 next to an unfiltered one."""
    requests = _requests([SamplingParams(temperature=1.0, top_k=2), SamplingParams(temperature=1.0, top_p=0.71),
                          SamplingParams(temperature=1.0, min_p=0.3), SamplingParams(temperature=1.0)])
    generator = torch.Generator().manual_seed(0)
    drawn = [set() for _ in requests]
    for _ in range(300):
        for row, token in enumerate(sample(LOGITS.repeat(4, 1), requests, generator, [1] * 4).tolist()):
            drawn[row].add(token)
    assert drawn[:3] == [{1, 3}, {1, 3, 0}, {1, 3, 0}] and drawn[3] == set(range(6))


def test_temperature_sampling_follows_the_distribution():
    counts = torch.bincount(_draw(LOGITS, SamplingParams(temperature=1.0), n=20000), minlength=6).float()
    assert torch.allclose(counts / counts.sum(), PROBS, atol=0.015)


def test_greedy_rows_stay_greedy_next_to_sampled_rows():
    logits = LOGITS.repeat(2, 1)
    tokens = sample(logits, _requests([SamplingParams(temperature=0.0), SamplingParams(temperature=1.0)]),
                    torch.Generator().manual_seed(0), [1, 1])
    assert tokens[0].item() == 1


def _noise(seeds, positions, vocab):
    return hashed_exponential_noise(torch.from_numpy(seeded_row_keys(seeds, positions)), vocab)


def _reference_noise(seed: int, position: int, index: int) -> float:
    """The seeded noise of one element, in plain Python ints (no 16-bit split of the products)."""
    mask = 0xFFFFFFFF

    def fmix32(h):
        h ^= h >> 16
        h = (h * 0x85EBCA6B) & mask
        h ^= h >> 13
        h = (h * 0xC2B2AE35) & mask
        return h ^ (h >> 16)

    def absorb(h, word):
        return fmix32(h ^ fmix32(word ^ 0x9E3779B9))

    folded = seed % 2**64
    h = 0
    for word in (folded & mask, folded >> 32, position, index):
        h = absorb(h, word)
    return -math.log(((h >> 9) + 0.5) / 2**23)


def test_seeded_noise_matches_the_hash_in_plain_integers():
    seeds, positions = [0, 1, -1, 2**63, 2**64 + 5, 5, 123456789012345], [0, 7, 3, 100000, 5, 5, 42]
    noise = _noise(seeds, positions, 300)
    expected = torch.tensor([[_reference_noise(s, p, j) for j in range(300)] for s, p in zip(seeds, positions)],
                            dtype=torch.float64)
    # The hash bits are exact; the float32 log is within a few ulps of the float64 one.
    torch.testing.assert_close(noise.double(), expected, rtol=1e-6, atol=0)
    assert torch.equal(noise[4], noise[5])  # seeds are folded to 64 bits


def test_seeded_noise_depends_only_on_seed_and_position():
    pairs = [(seed, position) for seed in (3, 4, -3) for position in (1, 2, 60)]
    alone = [_noise([seed], [position], 500)[0] for seed, position in pairs]
    shuffled = random.Random(0).sample(range(len(pairs)), len(pairs))
    together = _noise([pairs[i][0] for i in shuffled], [pairs[i][1] for i in shuffled], 500)
    for row, i in enumerate(shuffled):
        assert torch.equal(together[row], alone[i])
    assert len({tuple(row.tolist()) for row in alone}) == len(pairs)


def test_a_seeded_row_samples_the_same_token_in_any_row_of_any_batch():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(32, 50, generator=gen) * 2
    seeded = [SamplingParams(temperature=0.9, seed=100 + i) for i in range(32)]
    positions = [5 + 3 * i for i in range(32)]
    alone = [sample(logits[i:i + 1], _requests([seeded[i]]), gen, positions[i:i + 1]).item() for i in range(32)]
    # The same rows, reversed and interleaved with unseeded and filtered rows.
    others = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=5), SamplingParams(temperature=0.0)]
    rows, params, batch_positions = [], [], []
    for i in reversed(range(32)):
        rows += [logits[i], logits[(i + 7) % 32]]
        params += [seeded[i], others[i % 3]]
        batch_positions += [positions[i], 1]
    tokens = sample(torch.stack(rows), _requests(params), gen, batch_positions)
    assert tokens[0::2].tolist() == alone[::-1]


def test_seeded_noise_is_exponential_and_uncorrelated():
    vocab = 1 << 16
    noise = _noise([0, 0, 1, 2**40, -7], [10, 11, 10, 0, 123], vocab)
    values = noise.flatten().double()
    n = values.numel()
    assert abs(values.mean().item() - 1.0) < 5 / math.sqrt(n)  # Exp(1): mean 1, standard deviation 1
    # Kolmogorov-Smirnov against 1 - exp(-x): 1.95 / sqrt(n) is the 0.1% critical value.
    cdf = 1 - torch.exp(-values.sort().values)
    ranks = torch.arange(1, n + 1, dtype=torch.float64)
    distance = torch.maximum(ranks / n - cdf, cdf - (ranks - 1) / n).max().item()
    assert distance < 1.95 / math.sqrt(n)
    # Neighbouring positions and seeds draw unrelated rows.
    correlation = torch.corrcoef(noise.double())
    off_diagonal = correlation[~torch.eye(len(noise), dtype=torch.bool)]
    assert off_diagonal.abs().max().item() < 5 / math.sqrt(vocab)


@pytest.mark.parametrize("vary", ["seed", "position"])
def test_seeded_sampling_follows_the_distribution(vary):
    # Many requests with their own seeds, or one seed over many positions: frequencies match PROBS.
    n = 20000
    seeds = list(range(n)) if vary == "seed" else [7] * n
    positions = [random.Random(n).randrange(4096) for _ in range(n)] if vary == "seed" else list(range(n))
    requests = [CachedRequestState(str(i), [1], 1, SamplingParams(temperature=1.0, seed=seed)) for i, seed in enumerate(seeds)]
    tokens = sample(LOGITS.repeat(n, 1), requests, torch.Generator().manual_seed(0), positions)
    counts = torch.bincount(tokens, minlength=6).double()
    expected = n * PROBS.double()
    chi_square = ((counts - expected) ** 2 / expected).sum().item()
    assert chi_square < 30  # 5 degrees of freedom: P(chi2 > 30) is about 1.5e-5


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_seeded_tokens_survive_chunking_and_preemption(make_llm, async_scheduling):
    prompts = testing.random_prompts(12, 320, min_len=10, max_len=50, seed=9)
    params = [SamplingParams(max_tokens=10, temperature=1.0, seed=i, ignore_eos=True) for i in range(len(prompts))]
    roomy = make_llm(async_scheduling=False)
    alone = [roomy.generate({"prompt_token_ids": p}, q)[0].outputs[0].token_ids for p, q in zip(prompts, params)]
    tight = make_llm(max_num_batched_tokens=32, num_kv_blocks=12, async_scheduling=async_scheduling)
    batches = testing.record_batches(tight.engine)
    outputs = tight.generate([{"prompt_token_ids": p} for p in prompts], params)
    assert any(b.preempted_request_ids for b in batches), "the test should preempt a request"
    assert [o.outputs[0].token_ids for o in outputs] == alone
