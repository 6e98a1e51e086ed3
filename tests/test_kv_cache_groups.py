"""KV cache groups: a model mixing sliding-window and full-attention layers frees, in its sliding
groups, the blocks that fell out of the window, while its full groups keep every block.

The grouping and the block accounting by hand, then a tiny random Gemma 2 (4 layers alternating
sliding (W = 32) and full, blocks of 16, prompts of 80-150 tokens) through the transformers
backend against transformers: greedy tokens and prompt logprobs under chunked prefill,
preemption by recompute and by swap, and prefix caching, sync and async; a Gemma 3 with two
sliding groups; and a long sequence in a cache too small to keep its every block.
"""

import logging

import pytest
from transformers import Gemma2Config, Gemma3TextConfig

from hookllm import SamplingParams, testing
from hookllm.config import layer_sliding_windows
from hookllm.sched.block_manager import BlockManager
from hookllm.sched.request import Request
from hookllm.worker.kv_cache_groups import KVCacheGroups, group_layers

from test_sliding_window_blocks import assert_no_block_held, slid, watch_blocks
from test_transformers_backend import VOCAB, assert_prompt_logprobs, expected_of, make_llm, small

WINDOW, BLOCK = 32, 16
GEMMA2 = dict(head_dim=16, num_hidden_layers=4, sliding_window=WINDOW, query_pre_attn_scalar=16,
              attn_logit_softcapping=5.0, final_logit_softcapping=3.0, initializer_range=0.05)
SCHEDULING = pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])


# -- the grouping -------------------------------------------------------------------------------------

def test_alternating_layers_make_a_full_and_a_sliding_group_sharing_two_slots():
    windows = layer_sliding_windows(Gemma2Config(num_hidden_layers=4, sliding_window=WINDOW))
    assert windows == [WINDOW, None, WINDOW, None]
    assert group_layers(windows, [(2, 16)] * 4, max_model_len=256) == KVCacheGroups((None, WINDOW), ((1, 3), (0, 2)))


def test_gemma3_1b_layers_make_groups_of_its_full_layer_count():
    windows = layer_sliding_windows(Gemma3TextConfig(num_hidden_layers=26, sliding_window=512))
    groups = group_layers(windows, [(1, 256)] * 26, max_model_len=32768)
    # 4 full layers (5, 11, 17, 23): groups of 4; 22 sliding ones make 6 groups, the last of 2.
    assert groups.windows == (None,) + (512,) * 6 and groups.num_slots == 4
    assert groups.layers[0] == (5, 11, 17, 23) and groups.layers[1] == (0, 1, 2, 3)
    assert [len(layers) for layers in groups.layers] == [4, 4, 4, 4, 4, 4, 2]
    assert sorted(i for layers in groups.layers for i in layers) == list(range(26))


def test_windows_never_sliding_within_max_model_len_count_as_full_attention():
    assert group_layers([4096, None, 4096, None], [(2, 16)] * 4, max_model_len=2048) == \
        KVCacheGroups((None,), ((0, 1, 2, 3),))


def test_layers_of_different_kv_shapes_fall_back_to_one_group_keeping_every_block(caplog):
    with caplog.at_level(logging.WARNING, logger="hookllm.worker.kv_cache_groups"):
        groups = group_layers([WINDOW, None], [(2, 16), (4, 16)], max_model_len=256)
    assert groups == KVCacheGroups((None,), ((0, 1),))
    assert "cannot share cache tensors" in caplog.text


# -- block accounting, without a model ---------------------------------------------------------------

def hybrid_manager(num_blocks: int, enable_prefix_caching: bool = False) -> BlockManager:
    return BlockManager(num_blocks, BLOCK, enable_prefix_caching, group_windows=(None, WINDOW))


def test_a_hybrid_request_holds_every_full_group_block_and_only_its_window_in_the_sliding_group():
    manager = hybrid_manager(20)  # 19 usable: block 0 is the null block
    request = Request("r", list(range(2, 102)), testing.greedy(40))
    assert manager.allocate_slots(request, 100)  # 100 tokens: 7 blocks in each group
    assert [len(ids) for ids in manager.live_block_ids(request)] == [7, 7] and manager.num_free_blocks == 5
    request.num_computed_tokens = 100
    # The next query (position 100) reads 69..100: blocks 4..6 of the sliding group; the full one reads all.
    assert manager.allocate_slots(request, 1)
    full, sliding = manager.block_ids(request)
    assert manager.null_block not in full and sliding[:4] == [manager.null_block] * 4
    assert [len(ids) for ids in manager.live_block_ids(request)] == [7, 3] and manager.num_free_blocks == 9
    # Decoding to 130 tokens: 9 blocks in the full group; the sliding one reads 99..129, blocks 6..8.
    for computed in range(101, 130):
        request.num_computed_tokens = computed
        assert manager.allocate_slots(request, 1)
    assert [len(ids) for ids in manager.live_block_ids(request)] == [9, 3] and manager.num_free_blocks == 7
    full, sliding = manager.block_ids(request)  # read again: both tables grew
    assert len(full) == 9 and sliding[:6] == [manager.null_block] * 6
    # Its peak with 16-token chunks: 9 full blocks, and 47 tokens straddling at most 4 sliding ones.
    assert manager.peak_blocks(130, 16) == 9 + 4 and manager.peak_blocks(130, 130) == 9 + 9
    manager.free(request)
    assert manager.num_free_blocks == 19 and manager.block_ids(request) == []


def test_a_forked_request_copies_its_partial_last_block_in_every_group():
    manager = hybrid_manager(12)
    parent = Request("parent", list(range(2, 42)), testing.greedy(4))  # 40 tokens: 3 blocks per group
    assert manager.allocate_slots(parent, 40)
    parent.num_computed_tokens = 40
    child = Request("child", parent.all_token_ids + [7], testing.greedy(4))
    child.num_computed_tokens = 40
    manager.fork(parent, child)
    assert manager.num_free_blocks == 11 - 6
    assert manager.allocate_slots(child, 1)
    # Both groups' last blocks were shared: each gets a private copy, the rest stay shared.
    copies = manager.take_copies()
    assert [source for source, _ in copies] == [manager.block_ids(parent)[0][2], manager.block_ids(parent)[1][2]]
    assert [ids[2] for ids in manager.block_ids(child)] == [copy for _, copy in copies]
    assert [ids[:2] for ids in manager.block_ids(child)] == [ids[:2] for ids in manager.block_ids(parent)]
    assert manager.num_free_blocks == 11 - 8


def test_a_prefix_hit_is_the_longest_run_usable_in_every_group():
    manager = hybrid_manager(20, enable_prefix_caching=True)
    prompt = list(range(2, 102))  # 100 tokens: 6 full blocks cached per group
    first = Request("first", prompt, testing.greedy(4))
    assert manager.allocate_slots(first, 100)
    full, sliding = (list(ids) for ids in manager.block_ids(first))
    manager.free(first)
    # The sliding group's block 4 is evicted: a run of 5 or 6 blocks would need it (a query at 80
    # or 96 reads from 49 or 65), a run of 4 needs blocks 2 and 3 only (a query at 64 reads from 33).
    evicted = manager.blocks[sliding[4]]
    del manager.cached[evicted.cache_key]
    evicted.cache_key = None
    hit = manager.find_cached_prefix(Request("again", prompt + [7], testing.greedy(4)))
    assert hit == list(zip(full[:4], [manager.null_block] * 2 + sliding[2:4]))
    again = Request("again", prompt + [7], testing.greedy(4))
    assert manager.allocate_slots(again, 101 - 64, hit)
    assert manager.block_ids(again)[0][:4] == full[:4] and manager.block_ids(again)[1][:4] == [0, 0] + sliding[2:4]
    # Without the full group's block 0 nothing is usable at all.
    del manager.cached[manager.blocks[full[0]].cache_key]
    manager.blocks[full[0]].cache_key = None
    assert manager.find_cached_prefix(Request("cold", prompt + [7], testing.greedy(4))) == []


# -- a tiny Gemma 2 through the transformers backend, against transformers ---------------------------

@pytest.fixture(scope="module")
def gemma2(tmp_path_factory):
    prompts = testing.random_prompts(4, VOCAB, min_len=80, max_len=150, seed=5)
    return expected_of(Gemma2Config(**small(**GEMMA2)), tmp_path_factory.mktemp("gemma2-hybrid"), "transformers",
                       prompts)


@SCHEDULING
@pytest.mark.parametrize("preemption_mode", ["recompute", "swap"])
@pytest.mark.usefixtures("poisoned_empty")  # the KV cache starts NaN-filled
def test_tokens_and_prompt_logprobs_equal_transformers_with_blocks_freed(gemma2, async_scheduling, preemption_mode):
    # 15 usable blocks: the longest request (139 + 8 tokens) holds 10 full blocks and up to 5 sliding ones.
    llm = make_llm(gemma2, max_num_batched_tokens=32, num_kv_blocks=16, async_scheduling=async_scheduling,
                   preemption_mode=preemption_mode, swap_space=0.01)
    worker = llm.engine.engine_core.executor
    assert worker.kv_cache_groups == KVCacheGroups((None, WINDOW), ((1, 3), (0, 2)))
    assert [layer.kv_cache_group for layer in worker.attention_layers] == [1, 0, 1, 0]
    batches = watch_blocks(llm)
    requests = [{"prompt_token_ids": p} for p in gemma2.prompts]
    params = SamplingParams(max_tokens=len(gemma2.tokens[0]), temperature=0.0, ignore_eos=True, prompt_logprobs=1)
    outputs = llm.generate(requests, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == gemma2.tokens
    for output, prompt, expected in zip(outputs, gemma2.prompts, gemma2.logprobs):
        assert_prompt_logprobs(output, prompt, expected)
    assert any(len(b.sampling_rows) < len(b.request_ids) for b in batches), "no prefill was chunked"
    assert any(b.preempted_request_ids for b in batches), "no request was preempted"
    assert any(b.swap_out for b in batches) == (preemption_mode == "swap")
    assert slid(batches, WINDOW)
    assert_no_block_held(llm)


@SCHEDULING
def test_prefix_cache_hits_give_the_tokens_and_logprobs_of_no_caching(gemma2, async_scheduling):
    requests = [{"prompt_token_ids": p} for p in gemma2.prompts]
    # Prompts sharing 60- and 100-token prefixes (past the window) with different tails, in two
    # waves: the second finds the first's blocks, some freed by the window, some evicted.
    prefix = gemma2.prompts[3][:100]
    shared = [prefix[:60] + p[-20:] for p in gemma2.prompts[:3]] + [prefix + p[:9] for p in gemma2.prompts[:3]]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=2)
    results = {}
    for caching in (True, False):
        llm = make_llm(gemma2, async_scheduling=async_scheduling, enable_prefix_caching=caching, num_kv_blocks=64,
                       max_num_batched_tokens=32)
        watch_blocks(llm)
        # transformers' prompts twice: with caching, the second time reads both groups' blocks from the cache.
        for _ in range(2):
            outputs = llm.generate(requests, testing.greedy(len(gemma2.tokens[0])), use_tqdm=False)
            assert [o.outputs[0].token_ids for o in outputs] == gemma2.tokens
        assert (llm.engine.get_stats().prefix_cache_hits > 0) == caching
        outputs = [o.outputs[0] for wave in (shared[:3], shared[3:]) for o in
                   llm.generate([{"prompt_token_ids": p} for p in wave], params, use_tqdm=False)]
        results[caching] = ([c.token_ids for c in outputs],
                            [[e.logprob for entry in c.logprobs for e in entry.values()] for c in outputs])
        assert_no_block_held(llm)
    assert results[True][0] == results[False][0]
    for ours, theirs in zip(results[True][1], results[False][1]):
        assert ours == pytest.approx(theirs, abs=1e-4)


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    """Two sliding layers and a full one: three groups of one layer, sharing one slot."""
    layer_types = ["sliding_attention"] * 2 + ["full_attention"]
    config = Gemma3TextConfig(**small(**{**GEMMA2, "num_hidden_layers": 3}, layer_types=layer_types))
    prompts = testing.random_prompts(4, VOCAB, min_len=80, max_len=150, seed=5)
    return expected_of(config, tmp_path_factory.mktemp("gemma3-hybrid"), "transformers", prompts)


def test_several_sliding_groups_swap_and_hit_the_prefix_cache_as_transformers_computes(gemma3):
    # 21 usable blocks: the longest request holds 10 full blocks and up to 5 in each sliding group.
    llm = make_llm(gemma3, max_num_batched_tokens=32, num_kv_blocks=22, preemption_mode="swap", swap_space=0.01)
    assert llm.engine.engine_core.executor.kv_cache_groups == KVCacheGroups((None, WINDOW, WINDOW), ((2,), (0,), (1,)))
    batches = watch_blocks(llm)
    requests = [{"prompt_token_ids": p} for p in gemma3.prompts]
    params = SamplingParams(max_tokens=len(gemma3.tokens[0]), temperature=0.0, ignore_eos=True, prompt_logprobs=1)
    outputs = llm.generate(requests, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == gemma3.tokens
    for output, prompt, expected in zip(outputs, gemma3.prompts, gemma3.logprobs):
        assert_prompt_logprobs(output, prompt, expected)
    assert any(b.swap_out for b in batches) and slid(batches, WINDOW)
    assert_no_block_held(llm)
    roomy = make_llm(gemma3, max_num_batched_tokens=32, num_kv_blocks=96)
    watch_blocks(roomy)
    for _ in range(2):  # the second time from the prefix cache
        outputs = roomy.generate(requests, testing.greedy(len(gemma3.tokens[0])), use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outputs] == gemma3.tokens
    assert roomy.engine.get_stats().prefix_cache_hits > 0
    assert_no_block_held(roomy)


def test_a_sequence_too_long_to_keep_every_block_fits(gemma2):
    # The bytes of 12 blocks of all 4 layers make 24 blocks of one group's 2 layers (23 usable).
    every_layer_block_bytes = 4 * 2 * 2 * 16 * BLOCK * 4  # layers x (K, V) x kv heads x head dim x tokens x fp32
    llm = make_llm(gemma2, cpu_kv_cache_bytes=12 * every_layer_block_bytes, max_num_batched_tokens=16)
    manager, scheduler = llm.engine.engine_core.scheduler.block_manager, llm.engine.engine_core.scheduler
    assert llm.engine.engine_core.executor.num_kv_blocks == 24 and manager.num_blocks == 23
    # 150 + 100 tokens: 16 blocks per group. Kept, that is 16 blocks of all 4 layers (the cache has
    # 12). Freed, at most 16 + 4 are held at once: 31 + 16 tokens straddle 4 sliding blocks.
    assert manager.peak_blocks(250, 16) == 16 + 4
    prompt = testing.random_prompts(1, VOCAB, min_len=150, max_len=150, seed=6)[0]
    watch_blocks(llm)
    schedule, held = scheduler.schedule, []

    def recording():
        batch = schedule()
        held.append(manager.num_blocks - manager.num_free_blocks)
        return batch

    scheduler.schedule = recording
    runner = llm.engine.engine_core.executor.runner
    build_inputs, addresses = runner.build_inputs, []

    def aligned_inputs(*args):  # every group's plane 16-byte aligned, like the first's (odd counts included)
        inputs = build_inputs(*args)
        addresses.extend(t.data_ptr() for t in (*inputs.slot_mapping, *inputs.block_tables))
        return inputs

    runner.build_inputs = aligned_inputs
    output = llm.generate({"prompt_token_ids": prompt}, testing.greedy(100), use_tqdm=False)[0].outputs[0]
    assert addresses and all(address % 16 == 0 for address in addresses)
    assert output.token_ids == testing.reference_greedy(testing.load_reference(gemma2.path), prompt, 100)
    assert max(held) <= 16 + 4 and held[-1] == 16 + 3  # decoding: ceil(32 / 16) + 1 sliding blocks
    assert_no_block_held(llm)
