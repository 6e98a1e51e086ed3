"""Automatic prefix caching: same tokens and logprobs as without it, shared blocks never written,
no block leaked, images and cache salts keep different content apart."""

import random

import pytest

from hookllm import LLM, SamplingParams, testing
from hookllm.sched.block_manager import BlockManager
from hookllm.sched.request import MultiModalItem, Request

from llava_fixtures import checkpoint, reference  # noqa: F401 - LLaVA checkpoint and reference are fixtures


def shared_prefix_prompts(num: int, seed: int) -> list[list[int]]:
    """Prompts drawing on three shared prefixes (0 to 40 tokens) with unique suffixes."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(2, 320) for _ in range(length)] for length in (40, 23, 0)]
    return [rng.choice(prefixes) + [rng.randrange(2, 320) for _ in range(rng.randint(1, 20))] for _ in range(num)]


def run_mix(llm: LLM, prompts: list[list[int]], abort_every: int = 0) -> dict[str, tuple]:
    """Feed the prompts two per step, abort every ``abort_every``-th after its first step; the
    finished requests' (tokens, logprobs)."""
    engine = llm.engine
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=2, output_kind="final_only")
    pending = [(str(i), p) for i, p in enumerate(prompts)]
    finished, to_abort = {}, []
    while pending or engine.has_unfinished_requests():
        for request_id, prompt in pending[:2]:
            engine.add_request(request_id, prompt, params)
            if abort_every and int(request_id) % abort_every == abort_every - 1:
                to_abort.append(request_id)
        pending = pending[2:]
        outputs = engine.step()
        engine.abort_request(to_abort)
        to_abort = []
        for output in outputs:
            finished[output.request_id] = (output.outputs[0].token_ids, output.outputs[0].logprobs)
    return finished


def assert_no_block_held(llm: LLM) -> None:
    """Every block is free or cached-and-evictable: no reference left, the cache index consistent."""
    manager = llm.engine.engine_core.scheduler.block_manager
    testing.assert_all_blocks_free(llm)
    assert all(block.ref_count == 0 for block in manager.blocks)
    assert all(manager.blocks[block_id].cache_key == key for key, block_id in manager.cached.items())
    assert not llm.engine.engine_core.scheduler.retained


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_caching_on_and_off_give_the_same_tokens_and_logprobs(make_llm, async_scheduling):
    prompts = shared_prefix_prompts(14, seed=3)
    # A small token budget chunks prefills; 12 blocks force preemptions.
    kwargs = dict(max_num_batched_tokens=24, num_kv_blocks=12, async_scheduling=async_scheduling)
    cached = make_llm(enable_prefix_caching=True, **kwargs)
    plain = make_llm(enable_prefix_caching=False, **kwargs)
    ours, theirs = run_mix(cached, prompts, abort_every=5), run_mix(plain, prompts, abort_every=5)
    assert ours.keys() == theirs.keys() and len(ours) >= 10
    for request_id in ours:
        assert ours[request_id][0] == theirs[request_id][0]
        for step_ours, step_theirs in zip(ours[request_id][1], theirs[request_id][1]):
            assert step_ours.keys() == step_theirs.keys()
            assert [e.logprob for e in step_ours.values()] == pytest.approx(
                [e.logprob for e in step_theirs.values()], abs=1e-4)
    assert cached.engine.get_stats().prefix_cache_hits > 0
    assert plain.engine.get_stats().prefix_cache_queries == 0
    assert_no_block_held(cached)
    assert_no_block_held(plain)


def test_a_shared_block_is_written_only_while_its_one_writer_fills_it(make_llm):
    llm = make_llm(max_num_batched_tokens=24, num_kv_blocks=14)
    manager, scheduler = llm.engine.engine_core.scheduler.block_manager, llm.engine.engine_core.scheduler
    original = scheduler.schedule
    checked = []

    def checking():
        batch = original()
        writers: dict[int, str] = {}
        for request_id, start, count in zip(batch.request_ids, batch.num_computed_tokens, batch.num_scheduled_tokens):
            row = manager.block_ids(scheduler.requests[request_id])[0]
            for index in range(start // 16, (start + count - 1) // 16 + 1):
                block = manager.blocks[row[index]]
                assert writers.setdefault(block.block_id, request_id) == request_id, "two writers of one block"
                # Shared while written only if it becomes a cached full block this very step
                # (a later request of the same step reads it after the forward writes it).
                assert block.ref_count == 1 or block.cache_key is not None
                checked.append(block.ref_count)
        return batch

    scheduler.schedule = checking
    params = SamplingParams(max_tokens=12, temperature=0.8, seed=1, n=3)
    llm.generate([{"prompt_token_ids": p} for p in shared_prefix_prompts(6, seed=4)], params)
    assert checked
    assert_no_block_held(llm)


def test_num_cached_tokens_and_hit_counters(make_llm):
    llm = make_llm()
    prefix = list(range(2, 42))  # 40 tokens: two full blocks
    first = llm.generate({"prompt_token_ids": prefix + [50, 51]}, testing.greedy(4))[0]
    second = llm.generate({"prompt_token_ids": prefix + [60]}, testing.greedy(4))[0]
    assert (first.num_cached_tokens, second.num_cached_tokens) == (0, 32)
    stats = llm.engine.get_stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (42 + 41, 32)


def test_reset_prefix_cache_forgets_cached_prompts(make_llm):
    llm = make_llm()
    prompt = {"prompt_token_ids": list(range(2, 42))}
    llm.generate(prompt, testing.greedy(2))
    assert llm.reset_prefix_cache()
    assert llm.generate(prompt, testing.greedy(2))[0].num_cached_tokens == 0


def test_reset_prefix_cache_refuses_while_a_request_holds_blocks(make_llm):
    llm = make_llm()
    llm.engine.add_request("held", {"prompt_token_ids": list(range(2, 42))}, testing.greedy(4))
    llm.engine.step()
    assert not llm.reset_prefix_cache()
    llm.engine.abort_request("held")
    assert llm.reset_prefix_cache()


def test_the_last_prompt_token_is_recomputed_on_a_full_hit(make_llm, tiny_llama_reference):
    llm = make_llm()
    prompt = list(range(2, 34))  # exactly two blocks
    llm.generate({"prompt_token_ids": prompt}, testing.greedy(2))
    again = llm.generate({"prompt_token_ids": prompt}, testing.greedy(6))[0]
    assert again.num_cached_tokens == 16
    assert again.outputs[0].token_ids == testing.reference_greedy(tiny_llama_reference, prompt, 6)


def test_different_cache_salts_share_nothing(make_llm):
    llm = make_llm()
    prompt = list(range(2, 40))
    llm.generate({"prompt_token_ids": prompt, "cache_salt": "tenant-a"}, testing.greedy(2))
    other = llm.generate({"prompt_token_ids": prompt, "cache_salt": "tenant-b"}, testing.greedy(2))[0]
    same = llm.generate({"prompt_token_ids": prompt, "cache_salt": "tenant-a"}, testing.greedy(2))[0]
    assert (other.num_cached_tokens, same.num_cached_tokens) == (0, 32)


def test_freed_cached_blocks_are_evicted_least_recently_freed_first():
    manager = BlockManager(4, 16, enable_prefix_caching=True)
    a, b = Request("a", list(range(33)), SamplingParams()), Request("b", list(range(100, 133)), SamplingParams())
    for request in (a, b):
        assert manager.allocate_slots(request, 17)  # two blocks each, the first full one cached
    manager.free(a)
    manager.free(b)
    assert len(manager.cached) == 2
    c = Request("c", list(range(200, 210)), SamplingParams())
    assert manager.allocate_slots(c, 10)  # takes a's never-cached tail block: both cached blocks survive
    d = Request("d", list(range(300, 320)), SamplingParams())
    assert manager.allocate_slots(d, 20)  # two more: b's tail, then a's cached block (freed before b's)
    assert [len(manager.find_cached_prefix(r)) for r in (Request("a2", list(range(33)), SamplingParams()),
                                                          Request("b2", list(range(100, 133)), SamplingParams()))] == [0, 1]


def test_image_content_is_part_of_the_block_hash():
    manager = BlockManager(8, 16, enable_prefix_caching=True)

    def image_request(request_id: str, content_hash: str) -> Request:
        request = Request(request_id, [5] * 40, SamplingParams())
        request.mm_items = [MultiModalItem("image", 3, 20, content_hash)]
        return request

    first = image_request("a", "cat")
    manager.allocate_slots(first, 40)
    assert len(manager.find_cached_prefix(image_request("b", "dog"))) == 0
    assert len(manager.find_cached_prefix(image_request("c", "cat"))) == 2


def test_llava_shares_blocks_only_for_the_same_image_and_skips_its_encoder(monkeypatch, checkpoint, reference):
    from llava_fixtures import random_image, reference_greedy, reference_inputs
    from test_llava_engine import count_encoded_images

    llm = LLM(str(checkpoint), plugins=["llava"], dtype="float32", device="cpu")
    calls = count_encoded_images(monkeypatch, llm)
    # The image's 16 rows fall in the first two blocks; the text after them makes a third.
    prompt = "USER: <image> What is this? The quick brown fox jumps over the lazy dog. ASSISTANT:"
    cat, dog = random_image(40, 30, seed=1), random_image(25, 50, seed=2)
    runs = [(image, llm.generate({"prompt": prompt, "multi_modal_data": {"image": [image]}}, testing.greedy(6))[0])
            for image in (cat, dog, cat)]
    assert [output.num_cached_tokens for _, output in runs] == [0, 0, 32]
    assert calls == [1, 1], "the cached image must not be encoded again"
    for image, output in runs:
        expected = reference_greedy(reference, reference_inputs(checkpoint, prompt, [image]), 6)
        assert output.outputs[0].token_ids == expected
    assert_no_block_held(llm)
