"""Tensor parallelism through the engine: two gloo ranks in spawned worker processes, fed the
engine's snapshots, give TP=1's tokens and logprobs; a dead rank is an error, never a hang. One
rank in a process of its own (``distributed_executor_backend="mp"``) gives the in-process worker's."""

from __future__ import annotations

import os
import signal
import time

import pytest

import tp_helpers
from hookllm import LLM, EngineConfig, SamplingParams, testing
from hookllm.sched.output import SchedulerOutput
from hookllm.worker.executor import Executor
from hookllm.worker.multiproc_executor import WorkerError
from llava_fixtures import checkpoint, random_image  # noqa: F401 - checkpoint is a module fixture

PROMPTS = testing.random_prompts(4, 301, min_len=5, max_len=40, seed=7)
PARAMS = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=2)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp-engine")
    paths = {}
    for name, make in tp_helpers.CASES.items():
        paths[name] = testing.build_tiny_checkpoint(make(), root / name)
        tp_helpers.randomize_biases(paths[name])
    return paths


def cpu_llm(path, **kwargs) -> LLM:
    return LLM(str(path), device="cpu", dtype="float32", **kwargs)


def run(llm: LLM, prompts, params=PARAMS):
    try:
        return llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    finally:
        llm.engine.shutdown()


def assert_same_outputs(tp1, tp2) -> None:
    for a, b in zip(tp1, tp2):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for ours, theirs in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert ours.keys() == theirs.keys()
            assert all(abs(ours[t].logprob - theirs[t].logprob) < 1e-4 for t in ours)


@pytest.mark.parametrize("case", sorted(tp_helpers.CASES))
def test_tp2_greedy_tokens_and_logprobs_equal_tp1(checkpoints, case):
    path = checkpoints[case]
    tp1 = run(cpu_llm(path, num_kv_blocks=64), PROMPTS)
    tp2 = run(cpu_llm(path, num_kv_blocks=64, tensor_parallel_size=2), PROMPTS)
    assert_same_outputs(tp1, tp2)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_tp2_with_chunked_prefill_and_preemption_equals_tp1(checkpoints, async_scheduling):
    path, prompts = checkpoints["llama-gqa-bias"], testing.random_prompts(6, 301, min_len=10, max_len=30, seed=8)
    tight = dict(num_kv_blocks=8, max_num_batched_tokens=16, async_scheduling=async_scheduling)
    tp1 = run(cpu_llm(path, **tight), prompts)
    tp2_llm = cpu_llm(path, tensor_parallel_size=2, **tight)
    batches = testing.record_batches(tp2_llm.engine)
    assert_same_outputs(tp1, run(tp2_llm, prompts))
    assert any(b.preempted_request_ids for b in batches), "the tight cache was meant to force preemption"


def test_tp2_llava_shards_the_decoder_and_answers_as_tp1(checkpoint):  # noqa: F811
    prompts = [{"prompt": "USER: <image> What is this? ASSISTANT:", "multi_modal_data": {"image": [image]}}
               for image in (random_image(40, 30, seed=1), random_image(25, 50, seed=2))]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in cpu_llm(checkpoint).generate(prompts, params)]
    llm = cpu_llm(checkpoint, tensor_parallel_size=2)
    try:
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == expected
    finally:
        llm.engine.shutdown()


def test_one_rank_in_a_worker_process_samples_what_the_in_process_worker_does(checkpoints):
    path = checkpoints["llama-gqa-bias"]
    params = SamplingParams(max_tokens=8, temperature=0.8, seed=3, ignore_eos=True, logprobs=2)
    options = dict(num_kv_blocks=64, async_scheduling=True)
    in_process = run(cpu_llm(path, **options), PROMPTS, params)
    llm = cpu_llm(path, distributed_executor_backend="mp", **options)
    assert len(llm.engine.engine_core.executor.processes) == 1
    assert isinstance(llm.engine.engine_core.executor, Executor)
    assert_same_outputs(in_process, run(llm, PROMPTS, params))


@pytest.fixture(scope="module")
def tp2_llm(checkpoints):
    """One two-rank engine shared by the tests that only read from it."""
    llm = cpu_llm(checkpoints["llama-gqa-bias"], num_kv_blocks=64, tensor_parallel_size=2)
    yield llm
    llm.shutdown()


def test_collective_rpc_calls_every_rank_with_its_arguments(tp2_llm):
    assert tp2_llm.collective_rpc(tp_helpers.rank_of, args=(10,)) == [10, 11]
    # By name: a step that schedules nothing returns None on each rank.
    assert tp2_llm.collective_rpc("execute", args=(SchedulerOutput.empty([]),)) == [None, None]


def test_a_failing_collective_rpc_is_an_error_naming_the_rank_and_the_ranks_serve_on(tp2_llm):
    with pytest.raises(RuntimeError, match="(?s)collective_rpc failed on rank 0: .*no_such_method"):
        tp2_llm.collective_rpc("no_such_method")
    assert tp2_llm.collective_rpc(tp_helpers.rank_of) == [0, 1]


def test_apply_model_runs_on_each_ranks_shard(tp2_llm):
    assert tp2_llm.apply_model(tp_helpers.embedding_rows) == [160, 160]  # 320 rows split in two


def test_the_testing_kit_reads_prompt_logits_from_the_ranks(tp2_llm, checkpoints):
    reference = testing.load_reference(checkpoints["llama-gqa-bias"])
    testing.assert_prefill_logits_match(tp2_llm, reference, PROMPTS[0])
    testing.assert_all_blocks_free(tp2_llm)


def test_the_in_process_backend_with_several_ranks_is_refused():
    with pytest.raises(ValueError, match="distributed_executor_backend='uni' runs one rank; tensor_parallel_size is 2"):
        EngineConfig(model="unused", tensor_parallel_size=2, distributed_executor_backend="uni")


def test_heads_not_divisible_by_the_ranks_is_refused_before_loading(checkpoints):
    with pytest.raises(ValueError, match=r"num_attention_heads=4 is not divisible by tensor_parallel_size=3"):
        cpu_llm(checkpoints["llama-gqa-bias"], tensor_parallel_size=3)


def test_a_killed_rank_ends_the_engine_with_an_error_naming_it(checkpoints):
    llm = cpu_llm(checkpoints["llama-gqa-bias"], num_kv_blocks=64, tensor_parallel_size=2)
    engine = llm.engine
    engine.add_request("a", {"prompt_token_ids": PROMPTS[0]}, SamplingParams(max_tokens=200, ignore_eos=True))
    engine.step()
    os.kill(engine.engine_core.executor.processes[1].pid, signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(WorkerError, match="rank 1"):
        for _ in range(400):
            engine.step()
    assert time.monotonic() - start < 30
    assert not engine.engine_core.executor.processes  # every rank was stopped
