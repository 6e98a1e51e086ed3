"""Parallel sampling: SamplingParams(n=k) returns k completions sharing the prompt's blocks."""

import dataclasses

import pytest

from hookllm import SamplingParams, testing
from hookllm.engine.beam_search import BeamSearchParams

PROMPT = {"prompt_token_ids": list(range(2, 45))}


def test_greedy_completions_all_equal_n_1(make_llm):
    llm = make_llm()
    single = llm.generate(PROMPT, testing.greedy(8))[0].outputs[0].token_ids
    output = llm.generate(PROMPT, dataclasses.replace(testing.greedy(8), n=3))[0]
    assert [c.index for c in output.outputs] == [0, 1, 2]
    assert [c.token_ids for c in output.outputs] == [single] * 3
    testing.assert_all_blocks_free(llm)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_seeded_completions_are_the_same_alone_and_in_a_batch(make_llm, async_scheduling):
    llm = make_llm(async_scheduling=async_scheduling)
    params = SamplingParams(n=3, seed=7, max_tokens=8, temperature=1.0, ignore_eos=True)
    alone = [c.token_ids for c in llm.generate(PROMPT, params)[0].outputs]
    others = [{"prompt_token_ids": p} for p in testing.random_prompts(3, 320, seed=5)]
    noise = SamplingParams(max_tokens=8, temperature=1.0)
    batched = llm.generate(others[:2] + [PROMPT] + others[2:], [noise, noise, params, noise])
    assert [c.token_ids for c in batched[2].outputs] == alone
    assert len({tuple(t) for t in alone}) == 3, "the children must draw different streams"
    # Child i is seeded seed + i: the same as a request with that seed.
    child_1 = llm.generate(PROMPT, dataclasses.replace(params, n=1, seed=8))[0].outputs[0].token_ids
    assert alone[1] == child_1


def test_delta_outputs_report_each_child_under_the_parent_id(make_llm):
    engine = make_llm().engine
    engine.add_request("p", PROMPT, SamplingParams(n=2, max_tokens=4, temperature=0.0, ignore_eos=True,
                                                   output_kind="delta"))
    tokens = {0: [], 1: []}
    finished = []
    while engine.has_unfinished_requests():
        for output in engine.step():
            assert output.request_id == "p" and len(output.outputs) == 1
            tokens[output.outputs[0].index] += output.outputs[0].token_ids
            finished.append(output.finished)
    assert len(tokens[0]) == len(tokens[1]) == 4 and tokens[0] == tokens[1]
    assert finished.count(True) == 1 and finished[-1]
    assert not engine.has_request("p")


def test_children_share_the_prompt_blocks(make_llm):
    llm = make_llm()
    output = llm.generate(PROMPT, dataclasses.replace(testing.greedy(4), n=4))[0]
    assert output.num_cached_tokens == 32  # children after the first hit the prompt's two full blocks


def test_n_below_1_is_refused():
    with pytest.raises(ValueError, match="n must be"):
        SamplingParams(n=0)


def test_beam_width_below_1_is_refused():
    with pytest.raises(ValueError, match="beam_width"):
        BeamSearchParams(beam_width=0, max_tokens=4)


def test_n_larger_than_the_cache_is_refused_with_nothing_allocated(make_llm):
    llm = make_llm(num_kv_blocks=8)
    with pytest.raises(ValueError, match=r"request big: n=5 .* 8"):
        llm.engine.add_request("big", PROMPT, SamplingParams(n=5, max_tokens=40))
    assert not llm.engine.has_request("big") and not llm.engine.has_unfinished_requests()
    assert not llm.engine.unfinished_request_ids()
    testing.assert_all_blocks_free(llm)
