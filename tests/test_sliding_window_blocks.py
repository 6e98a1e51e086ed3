"""Sliding-window models free the KV blocks that fall out of every window as a sequence advances.

A tiny Mistral (every layer slides over W = 40 tokens, blocks of 16) against transformers on
prompts longer than the window, in caches too small for full attention: greedy tokens, prompt
logprobs under chunked prefill, preemption by recompute and by swap, prefix caching, n > 1 and
beam search forks, sync and async scheduling. Out-of-window blocks read as NaN (the cache is
allocated NaN-filled), so a kernel reading one would show.
"""

import dataclasses
import math

import pytest
import torch
from transformers import Gemma3TextConfig, MistralConfig, PretrainedConfig, Qwen2Config

from hookllm import LLM, BeamSearchParams, SamplingParams, testing
from hookllm.config import layer_sliding_windows
from hookllm.sched.block_manager import BlockManager
from hookllm.sched.output import SchedulerOutput
from hookllm.sched.request import Request
from hookllm.sched.scheduler import Scheduler
from hookllm.worker.kv_cache_groups import group_layers

from test_beam_search import reference_beams

WINDOW, BLOCK = 40, 16
DECODE_PEAK = math.ceil(WINDOW / BLOCK) + 1  # blocks a decoding sequence may hold
TINY = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512, bos_token_id=0, eos_token_id=1)
# 7 usable blocks (block 0 is the null block): one 200-token sequence would need 13 without the window.
TIGHT = dict(num_kv_blocks=8, max_num_batched_tokens=16)
SCHEDULING = pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
MAX_TOKENS = 24


# -- the layers' windows from the HF config, and the KV cache groups they make --------------------

@pytest.mark.parametrize("config, windows, group_windows", [
    (MistralConfig(num_hidden_layers=3, sliding_window=64), [64] * 3, (64,)),
    (MistralConfig(num_hidden_layers=3, sliding_window=None), [None] * 3, (None,)),
    (Qwen2Config(num_hidden_layers=2, sliding_window=64), [None] * 2, (None,)),  # use_sliding_window off
    (Qwen2Config(num_hidden_layers=2, use_sliding_window=True, sliding_window=64, max_window_layers=0), [64] * 2,
     (64,)),
    (Qwen2Config(num_hidden_layers=3, use_sliding_window=True, sliding_window=64, max_window_layers=1),
     [None, 64, 64], (None, 64, 64)),
    (Gemma3TextConfig(num_hidden_layers=3, sliding_window=64, layer_types=["sliding_attention"] * 3), [64] * 3,
     (64,)),
    (Gemma3TextConfig(num_hidden_layers=7, sliding_window=64), [64] * 5 + [None, 64], (None,) + (64,) * 6),
    (MistralConfig(num_hidden_layers=2, sliding_window=4096), [4096] * 2, (None,)),  # never slides within 2048
    (PretrainedConfig(sliding_window=64), [64], (64,)),  # a third-party config naming no layer count
    (PretrainedConfig(sliding_window=64, use_sliding_window=False, num_hidden_layers=2), [None] * 2, (None,)),
], ids=["mistral", "mistral-full", "qwen2-off", "qwen2-all", "qwen2-hybrid", "all-sliding-types", "gemma3",
        "window-past-max-len", "raw", "raw-off"])
def test_sliding_windows_are_read_from_the_hf_config(config, windows, group_windows):
    assert layer_sliding_windows(config) == windows
    assert group_layers(windows, [(2, 16)] * len(windows), max_model_len=2048).windows == group_windows


# -- block accounting, without a model -------------------------------------------------------------

def run_alone(scheduler: Scheduler, request: Request, check) -> None:
    """Step ``request`` to its end with token 5 each step, calling ``check(batch)`` after each schedule."""
    scheduler.add(request)
    while scheduler.has_unfinished():
        batch = scheduler.schedule()
        check(batch)
        scheduler.update_from_output(batch, [5] * len(batch.sampling_rows))


def test_a_long_sequence_holds_at_most_its_window_and_gives_the_rest_back():
    manager = BlockManager(12, BLOCK, enable_prefix_caching=True, group_windows=[WINDOW])
    # Chunks of 20 tokens start off block boundaries: one spans 5 blocks with the 39 tokens before it.
    scheduler = Scheduler(manager, max_num_seqs=4, max_num_batched_tokens=20)
    request = Request("long", list(range(2, 102)), testing.greedy(200), max_num_tokens=300)
    assert manager.num_blocks == 11 and manager.peak_blocks(request.max_num_tokens, 20) == 5
    held = []

    def check(batch: SchedulerOutput) -> None:
        live = manager.live_block_ids(request)[0]
        held.append(len(live))
        assert manager.num_free_blocks == manager.num_blocks - len(live)
        assert manager.null_block not in live and len(set(live)) == len(live)
        if batch.num_scheduled_tokens == [1]:
            assert len(live) <= DECODE_PEAK
        # The block table: null entries before the window of the step's first query, live ones after.
        first = max(0, (batch.num_computed_tokens[0] - WINDOW + 1) // BLOCK)
        table = manager.block_ids(request)[0]
        assert table[:first] == [manager.null_block] * first and table[first:] == live

    run_alone(scheduler, request, check)
    assert len(manager.block_ids(request)) == 0 and max(held) == 5 and held[-1] <= DECODE_PEAK
    assert manager.num_free_blocks == manager.num_blocks
    assert all(block.ref_count == 0 for block in manager.blocks)


def test_a_prefix_hit_needs_only_the_blocks_its_window_reads():
    # 8 blocks: the null block and 7 that a 100-token prompt fills.
    manager = BlockManager(8, BLOCK, enable_prefix_caching=True, group_windows=[WINDOW])
    prompt = list(range(2, 102))
    first = Request("first", prompt, testing.greedy(4))
    assert manager.allocate_slots(first, 100)
    blocks = list(manager.block_ids(first)[0])
    first.num_computed_tokens = 100
    manager.free_out_of_window(first)  # the next query (position 100) reads 61..100: blocks 3..6
    assert manager.block_ids(first) == [[manager.null_block] * 3 + blocks[3:]]
    assert manager.num_free_blocks == 3
    # Another prompt takes two free blocks: blocks 2 and 1 of the first, freed last (their hashes go).
    other = Request("other", list(range(200, 220)), testing.greedy(4))
    assert manager.allocate_slots(other, 20) and manager.block_ids(other) == [[blocks[2], blocks[1]]]
    # A query at 96 reads 57..96: blocks 3..5, all cached (held by the first request), so 96 tokens hit.
    again = Request("again", prompt + [7], testing.greedy(4))
    assert manager.find_cached_prefix(again) == [(block,) for block in [manager.null_block] * 3 + blocks[3:6]]
    # With block 4 gone, no run ending past it has its window cached: only block 0, still cached, hits.
    evicted = manager.blocks[blocks[4]]
    del manager.cached[evicted.cache_key]
    evicted.cache_key = None
    assert manager.find_cached_prefix(Request("partial", prompt + [7], testing.greedy(4))) == [(blocks[0],)]


def test_without_a_window_block_0_is_an_ordinary_block():
    manager = BlockManager(4, BLOCK)
    request = Request("r", list(range(2, 60)), testing.greedy(4))
    assert manager.allocate_slots(request, 58) and manager.block_ids(request) == [[0, 1, 2, 3]]
    request.num_computed_tokens = 58
    manager.free_out_of_window(request)
    assert manager.block_ids(request) == [[0, 1, 2, 3]] and manager.num_blocks == 4


# -- the engine, against transformers --------------------------------------------------------------

@pytest.fixture(scope="module")
def mistral(tmp_path_factory):
    """(path, reference model, prompts longer than the window, transformers' greedy tokens for them)."""
    path = testing.build_tiny_checkpoint(MistralConfig(**TINY, sliding_window=WINDOW), tmp_path_factory.mktemp("swa"))
    reference = testing.load_reference(path)
    prompts = testing.random_prompts(3, 320, min_len=60, max_len=130, seed=1)
    expected = [testing.reference_greedy(reference, p, MAX_TOKENS) for p in prompts]
    return path, reference, prompts, expected


def make_llm(path, **kwargs) -> LLM:
    return LLM(str(path), dtype="float32", device="cpu", **kwargs)


def watch_blocks(llm: LLM) -> list[SchedulerOutput]:
    """Record every batch, checking as it is scheduled that in each KV cache group each request
    holds only the blocks its window needs (every one without a window) and that no new token
    goes to the null block."""
    scheduler = llm.engine.engine_core.scheduler
    manager, schedule = scheduler.block_manager, scheduler.schedule
    batches = []

    def checking() -> SchedulerOutput:
        batch = schedule()
        for request_id, computed, count in zip(batch.request_ids, batch.num_computed_tokens,
                                               batch.num_scheduled_tokens):
            tables = manager.block_ids(scheduler.requests[request_id])
            for table, window in zip(tables, manager.group_windows, strict=True):
                first = 0 if window is None else max(0, (computed - window + 1) // BLOCK)
                end = -(-(computed + count) // BLOCK)
                assert table[:first] == [manager.null_block] * first and manager.null_block not in table[first:end]
                if window is not None:  # the chunk and the W - 1 tokens before it, however they straddle blocks
                    assert end - first <= -(-(window - 1 + count + BLOCK - 1) // BLOCK)
        batches.append(batch)
        return batch

    llm.engine.engine_core.scheduler.schedule = checking
    return batches


def assert_no_block_held(llm: LLM) -> None:
    manager = llm.engine.engine_core.scheduler.block_manager
    testing.assert_all_blocks_free(llm)
    assert all(block.ref_count == 0 for block in manager.blocks)
    assert all(manager.blocks[block_id].cache_key == key for key, block_id in manager.cached.items())


def slid(batches: list[SchedulerOutput], window: int = WINDOW) -> bool:
    """Whether some step's queries started past the first block of their window."""
    return any(computed - window + 1 >= BLOCK for batch in batches for computed in batch.num_computed_tokens)


@SCHEDULING
@pytest.mark.usefixtures("poisoned_empty")  # the KV cache starts NaN-filled
def test_tokens_and_prompt_logprobs_match_transformers_in_a_cache_too_small_for_full_attention(
        mistral, async_scheduling):
    path, reference, prompts, expected = mistral
    llm = make_llm(path, async_scheduling=async_scheduling, **TIGHT)
    assert llm.engine.engine_core.scheduler.block_manager.num_blocks == 7
    batches = watch_blocks(llm)
    params = dataclasses.replace(testing.greedy(MAX_TOKENS), prompt_logprobs=0)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    for prompt, output in zip(prompts, outputs):  # prefill in chunks of 16: each reads 39 keys before it
        with torch.inference_mode():
            logprobs = reference(torch.tensor([prompt])).logits[0].log_softmax(-1)
        theirs = logprobs[:-1].gather(1, torch.tensor(prompt[1:])[:, None])[:, 0].tolist()
        ours = [entry[token].logprob for entry, token in zip(output.prompt_logprobs[1:], prompt[1:])]
        assert ours == pytest.approx(theirs, abs=1e-4)
    assert slid(batches)
    assert_no_block_held(llm)


def test_a_request_too_long_for_the_cache_with_full_attention_is_admitted(mistral):
    path, _, _, _ = mistral
    llm = make_llm(path, **TIGHT)
    prompt = {"prompt_token_ids": list(range(2, 202))}
    # 300 tokens: 19 blocks with full attention, 5 under a window (16-token chunks and 39 tokens before).
    assert len(llm.generate(prompt, testing.greedy(100))[0].outputs[0].token_ids) == 100
    with pytest.raises(ValueError, match="needs 5 KV blocks, but the cache has only 3"):
        make_llm(path, num_kv_blocks=4, max_num_batched_tokens=16).generate(prompt, testing.greedy(100))


@SCHEDULING
@pytest.mark.parametrize("preemption_mode", ["recompute", "swap"])
def test_preempted_requests_resume_with_the_tokens_transformers_gives(mistral, async_scheduling, preemption_mode):
    path, _, prompts, expected = mistral
    llm = make_llm(path, async_scheduling=async_scheduling, preemption_mode=preemption_mode, swap_space=0.01,
                   num_kv_blocks=12, max_num_batched_tokens=48, enable_prefix_caching=False)
    batches = watch_blocks(llm)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts * 2], testing.greedy(MAX_TOKENS))
    assert [o.outputs[0].token_ids for o in outputs] == expected * 2
    assert any(batch.preempted_request_ids for batch in batches)
    assert any(batch.swap_out for batch in batches) == (preemption_mode == "swap")
    assert_no_block_held(llm)
    assert llm.engine.engine_core.scheduler.host_allocator.num_free_blocks == \
        llm.engine.engine_core.scheduler.host_allocator.num_blocks


@SCHEDULING
def test_prefix_caching_on_and_off_give_the_same_tokens_and_logprobs(mistral, async_scheduling):
    path, _, prompts, _ = mistral
    # Prompts sharing 70- and 100-token prefixes (past the window) with different tails.
    prefix = testing.random_prompts(1, 320, min_len=100, max_len=100, seed=9)[0]
    shared = [prefix[:70] + p[:12] for p in prompts] + [prefix + p[:5] for p in prompts]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=2)
    results = {}
    for caching in (True, False):
        llm = make_llm(path, async_scheduling=async_scheduling, enable_prefix_caching=caching,
                       num_kv_blocks=14, max_num_batched_tokens=32)
        watch_blocks(llm)
        # Two waves, so the second finds the first's blocks, some freed by the window, some evicted.
        outputs = [o.outputs[0] for wave in (shared[:3], shared[3:]) for o in
                   llm.generate([{"prompt_token_ids": p} for p in wave], params)]
        results[caching] = ([c.token_ids for c in outputs],
                            [[e.logprob for entry in c.logprobs for e in entry.values()] for c in outputs])
        assert (llm.engine.get_stats().prefix_cache_hits > 0) == caching
        assert_no_block_held(llm)
    assert results[True][0] == results[False][0]
    for ours, theirs in zip(results[True][1], results[False][1]):
        assert ours == pytest.approx(theirs, abs=1e-4)


@SCHEDULING
def test_parallel_samples_share_blocks_and_draw_as_seeded_requests_alone(mistral, async_scheduling):
    path, _, prompts, _ = mistral
    llm = make_llm(path, async_scheduling=async_scheduling, num_kv_blocks=16, max_num_batched_tokens=32)
    batches = watch_blocks(llm)
    params = SamplingParams(n=3, seed=7, max_tokens=MAX_TOKENS, temperature=1.0, ignore_eos=True)
    prompt = {"prompt_token_ids": prompts[2]}
    together = [c.token_ids for c in llm.generate(prompt, params)[0].outputs]
    alone = [llm.generate(prompt, dataclasses.replace(params, n=1, seed=7 + i))[0].outputs[0].token_ids
             for i in range(3)]
    assert together == alone and len({tuple(t) for t in together}) == 3
    assert slid(batches)
    assert_no_block_held(llm)


def test_beam_search_forks_match_transformers(mistral):
    path, reference, prompts, _ = mistral
    llm = make_llm(path, num_kv_blocks=24)
    prompt = prompts[0][:50]
    params = BeamSearchParams(beam_width=2, max_tokens=MAX_TOKENS, ignore_eos=True, length_penalty=0.7)
    ours = llm.beam_search({"prompt_token_ids": prompt}, params)[0].sequences
    theirs = reference_beams(reference, prompt, 2, MAX_TOKENS, None, 0.7)
    assert [s.tokens[len(prompt):] for s in ours] == [tokens for tokens, _ in theirs]
    assert [s.score for s in ours] == pytest.approx([score for _, score in theirs], abs=1e-4)
    assert_no_block_held(llm)


def test_a_native_model_mixing_full_and_sliding_layers_frees_its_sliding_groups_blocks(tmp_path):
    config = Qwen2Config(**TINY, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1)
    path = testing.build_tiny_checkpoint(config, tmp_path)
    llm = make_llm(path, max_num_batched_tokens=32)
    layers = llm.engine.engine_core.executor.model.model.layers
    assert [layer.self_attn.attn.sliding_window for layer in layers] == [None, WINDOW]
    assert [layer.self_attn.attn.kv_cache_group for layer in layers] == [0, 1]
    assert llm.engine.engine_core.scheduler.block_manager.group_windows == (None, WINDOW)
    batches = watch_blocks(llm)
    testing.assert_greedy_matches(llm, testing.load_reference(path),
                                  testing.random_prompts(2, 320, min_len=60, max_len=90, seed=2), max_tokens=12)
    assert slid(batches)
    assert_no_block_held(llm)


def test_prompt_logprobs_are_computed_for_every_prompt_token_despite_the_prefix_cache(mistral):
    path, _, prompts, _ = mistral
    llm = make_llm(path)
    params = dataclasses.replace(testing.greedy(2), prompt_logprobs=0)
    first, again = (llm.generate({"prompt_token_ids": prompts[0]}, params)[0] for _ in range(2))
    # A request asking for prompt logprobs does not look up the cache: it computes every position.
    assert again.num_cached_tokens == 0 and len(again.prompt_logprobs) == len(prompts[0])
    assert [e and {t: v.logprob for t, v in e.items()} for e in again.prompt_logprobs] == \
        [e and {t: v.logprob for t, v in e.items()} for e in first.prompt_logprobs]
