"""Continuous batching is invisible: chunked prefill, mixed batches and preemption change no token."""

import random

import pytest

from hookllm import testing

MAX_TOKENS = 10


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(7)
    return [[rng.randrange(320) for _ in range(rng.randint(2, 70))] for _ in range(34)]


@pytest.fixture(scope="module")
def alone_outputs(tiny_llama_dir, prompts):
    """Each prompt run by itself in a roomy engine: the reference for every batched run."""
    llm = testing.LLM(str(tiny_llama_dir), dtype="float32", device="cpu")
    return [llm.generate({"prompt_token_ids": p}, testing.greedy(MAX_TOKENS))[0].outputs[0].token_ids
            for p in prompts]


SCHEDULING = pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])


@SCHEDULING
def test_tight_engine_chunks_prefills_and_preempts(make_llm, prompts, async_scheduling):
    llm = make_llm(max_num_batched_tokens=32, num_kv_blocks=12, async_scheduling=async_scheduling)
    batches = testing.record_batches(llm.engine)
    llm.generate([{"prompt_token_ids": p} for p in prompts], testing.greedy(MAX_TOKENS))
    # A scheduled request that does not sample this step runs part of its prompt.
    assert any(len(b.sampling_rows) < len(b.request_ids) for b in batches)
    assert any(b.preempted_request_ids for b in batches)
    assert all(b.total_num_tokens <= 32 for b in batches)


@SCHEDULING
def test_batched_greedy_equals_each_prompt_alone(make_llm, prompts, alone_outputs, async_scheduling):
    llm = make_llm(max_num_batched_tokens=32, num_kv_blocks=12, async_scheduling=async_scheduling)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], testing.greedy(MAX_TOKENS))
    assert [o.outputs[0].token_ids for o in outputs] == alone_outputs
    testing.assert_all_blocks_free(llm)


def test_max_num_seqs_bounds_the_running_batch(make_llm, prompts, alone_outputs):
    llm = make_llm(max_num_seqs=3)
    engine = llm.engine
    ids = [engine.add_request(str(i), {"prompt_token_ids": p}, testing.greedy(MAX_TOKENS)) for i, p in enumerate(prompts[:8])]
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert len(engine.engine_core.scheduler.running) <= 3
            if out.finished:
                finished[out.request_id] = out.outputs[0].token_ids
    assert [finished[i] for i in ids] == alone_outputs[:8]


@SCHEDULING
def test_aborting_midway_frees_blocks_and_leaves_others_unchanged(make_llm, prompts, alone_outputs, async_scheduling):
    llm = make_llm(max_num_batched_tokens=32, num_kv_blocks=12, async_scheduling=async_scheduling)
    engine = llm.engine
    ids = [engine.add_request(str(i), {"prompt_token_ids": p}, testing.greedy(MAX_TOKENS)) for i, p in enumerate(prompts)]
    aborted = set(ids[::3])
    finished = {}
    for _ in range(6):
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out.outputs[0].token_ids
    for request_id in aborted:
        engine.abort_request(request_id)
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.request_id not in aborted or out.request_id in finished
            if out.finished:
                finished[out.request_id] = out.outputs[0].token_ids
    for request_id, expected in zip(ids, alone_outputs):
        if request_id not in aborted:
            assert finished[request_id] == expected
    testing.assert_all_blocks_free(llm)


def test_blocks_are_freed_the_moment_a_request_finishes(make_llm):
    llm = make_llm(num_kv_blocks=16)
    engine = llm.engine
    short = engine.add_request("short", {"prompt_token_ids": [3] * 20}, testing.greedy(1))
    engine.add_request("long", {"prompt_token_ids": [4] * 20}, testing.greedy(5))
    outputs = {o.request_id: o for o in engine.step()}
    assert outputs[short].finished
    # The finished request's 2 blocks are back; the other still holds its 2.
    assert engine.engine_core.scheduler.block_manager.num_free_blocks == 16 - 2
    assert not engine.has_request(short)
