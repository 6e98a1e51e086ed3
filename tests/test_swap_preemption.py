"""Preemption by swapping: a swapped request resumes exactly where it was, with no recompute."""

import pytest

from hookllm import testing
from hookllm.config import EngineConfig
from hookllm.sampling_params import SamplingParams

# 10 blocks of 16 tokens for 8 requests of up to 46 tokens, 24 tokens a step: preemptions.
TIGHT = dict(num_kv_blocks=10, max_num_batched_tokens=24)
PARAMS = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=1)
SCHEDULING = pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])


@pytest.fixture(scope="module")
def prompts():
    return testing.random_prompts(8, 320, min_len=10, max_len=30, seed=3)


def tokens_and_logprobs(outputs):
    completions = [o.outputs[0] for o in outputs]
    return ([c.token_ids for c in completions],
            [[entry[t].logprob for t, entry in zip(c.token_ids, c.logprobs)] for c in completions])


@pytest.fixture(scope="module")
def alone(tiny_llama_dir, prompts):
    """Each prompt run by itself in a roomy engine."""
    llm = testing.LLM(str(tiny_llama_dir), dtype="float32", device="cpu")
    return tokens_and_logprobs([llm.generate({"prompt_token_ids": p}, PARAMS)[0] for p in prompts])


@pytest.fixture(scope="module")
def run(tiny_llama_dir, prompts):
    """``run(async_scheduling, **config)``: (llm, batches, tokens, logprobs) of all prompts together
    in the tight engine; each configuration runs once per module."""
    cache = {}

    def tight_run(async_scheduling, **config):
        key = (async_scheduling, tuple(sorted(config.items())))
        if key not in cache:
            llm = testing.LLM(str(tiny_llama_dir), dtype="float32", device="cpu", async_scheduling=async_scheduling,
                              **TIGHT, **config)
            batches = testing.record_batches(llm.engine)
            outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], PARAMS)
            cache[key] = (llm, batches, *tokens_and_logprobs(outputs))
        return cache[key]
    return tight_run


def assert_same_outputs(got, expected):
    assert got[0] == expected[0]
    for ours, theirs in zip(got[1], expected[1]):
        assert ours == pytest.approx(theirs, abs=1e-5)


@SCHEDULING
def test_swap_gives_the_tokens_of_recompute_and_of_each_prompt_alone(run, alone, async_scheduling):
    _, _, *swapped = run(async_scheduling, preemption_mode="swap", swap_space=0.01)
    _, _, *recomputed = run(async_scheduling, preemption_mode="recompute")
    assert_same_outputs(swapped, alone)
    assert_same_outputs(recomputed, alone)


@SCHEDULING
def test_swapped_requests_resume_without_recompute(run, prompts, async_scheduling):
    _, batches, *_ = run(async_scheduling, preemption_mode="swap", swap_space=0.01)
    _, recompute_batches, *_ = run(async_scheduling, preemption_mode="recompute")
    assert any(b.preempted_request_ids for b in batches)
    assert any(b.swap_out for b in batches) and any(b.swap_in for b in batches)
    swapped_out = sorted(pair[1] for b in batches for pair in b.swap_out)
    assert sorted(pair[0] for b in batches for pair in b.swap_in) == swapped_out  # every host block comes back
    assert not any(b.swap_out or b.swap_in for b in recompute_batches)
    # Each token is computed once: the prompt, then every output but the last (never fed back).
    once = sum(len(p) + PARAMS.max_tokens - 1 for p in prompts)
    assert sum(b.total_num_tokens for b in batches) == once
    assert sum(b.total_num_tokens for b in recompute_batches) > once


@SCHEDULING
def test_tiny_swap_space_falls_back_to_recompute(run, alone, async_scheduling):
    block_bytes = run(async_scheduling, preemption_mode="swap", swap_space=0.01)[0].engine.engine_core.executor.block_bytes
    llm, batches, *outputs = run(async_scheduling, preemption_mode="swap", swap_space=3 * block_bytes / 2**30)
    _, roomy_batches, *_ = run(async_scheduling, preemption_mode="swap", swap_space=0.01)
    assert llm.engine.engine_core.scheduler.host_allocator.num_blocks == 3
    assert any(b.swap_out for b in batches)  # some preempted requests fit the 3 host blocks ...
    # ... and the others were recomputed: more tokens computed than when every one was swapped.
    assert sum(b.total_num_tokens for b in batches) > sum(b.total_num_tokens for b in roomy_batches)
    assert_same_outputs(outputs, alone)


@SCHEDULING
@pytest.mark.parametrize("swap_blocks", [3, None], ids=["tiny", "roomy"])
def test_every_device_and_host_block_is_free_after_draining(run, async_scheduling, swap_blocks):
    block_bytes = run(async_scheduling, preemption_mode="swap", swap_space=0.01)[0].engine.engine_core.executor.block_bytes
    swap_space = 0.01 if swap_blocks is None else swap_blocks * block_bytes / 2**30
    llm = run(async_scheduling, preemption_mode="swap", swap_space=swap_space)[0]
    testing.assert_all_blocks_free(llm)
    scheduler = llm.engine.engine_core.scheduler
    assert scheduler.host_allocator.num_free_blocks == scheduler.host_allocator.num_blocks
    assert not scheduler.swapped


@pytest.mark.parametrize("field, value", [("preemption_mode", "x"), ("swap_space", -1.0),
                                          ("swap_space", float("nan"))])
def test_bad_preemption_options_are_refused(tiny_llama_dir, field, value):
    with pytest.raises(ValueError, match=field):
        EngineConfig(model=str(tiny_llama_dir), **{field: value})


def test_aborting_a_swapped_request_frees_its_host_blocks(make_llm, prompts, alone):
    llm = make_llm(preemption_mode="swap", swap_space=0.01, **TIGHT)
    engine, scheduler = llm.engine, llm.engine.engine_core.scheduler
    ids = [engine.add_request(str(i), {"prompt_token_ids": p}, PARAMS) for i, p in enumerate(prompts)]
    finished = {}
    while not scheduler.swapped:
        finished.update({o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished})
    aborted = {r.request_id for r in scheduler.swapped}
    engine.abort_request(list(aborted))
    assert scheduler.host_allocator.num_free_blocks == scheduler.host_allocator.num_blocks
    while engine.has_unfinished_requests():
        finished.update({o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished})
    assert {i: finished[i] for i in ids if i not in aborted} == {i: t for i, t in zip(ids, alone[0]) if i not in aborted}
    testing.assert_all_blocks_free(llm)
