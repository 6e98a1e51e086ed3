"""The step as data: the scheduler's batch is a plain snapshot that a runner anywhere can run."""

from __future__ import annotations

import dataclasses
import multiprocessing
import pickle
import re
import subprocess
from pathlib import Path

import numpy as np
import pytest

from hookllm import EngineConfig, LLMEngine, SamplingParams, testing
from hookllm.entrypoints.cli import main
from hookllm.sched.output import SchedulerOutput

ROOT = Path(__file__).resolve().parent.parent


def record_steps(engine: LLMEngine) -> list[tuple[bytes, list[int] | None]]:
    """Each step's pickled snapshot and the token ids the engine's own worker sampled for it."""
    steps = []
    execute = engine.engine_core.executor.execute

    def recording(scheduler_output, previous=None):
        result = execute(scheduler_output, previous)
        steps.append((pickle.dumps(scheduler_output), result.token_ids() if result is not None else None))
        return result

    engine.engine_core.executor.execute = recording
    return steps


def run_requests(engine: LLMEngine, prompts: list[list[int]]) -> None:
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, SamplingParams(max_tokens=6 + i, temperature=0.8, seed=i, logprobs=1))
    while engine.has_unfinished_requests():
        engine.step()


def replay_in_fresh_worker(config_bytes: bytes, snapshots: list[bytes], queue) -> None:
    """A spawned process: a worker rebuilt from the pickled config, fed only pickled snapshots."""
    from hookllm.worker.worker import Worker

    worker = Worker.from_config(pickle.loads(config_bytes))
    previous, sampled = None, []
    for snapshot in snapshots:
        # The step before is the one still on the device: its tokens feed requests that need them.
        previous = worker.execute(pickle.loads(snapshot), previous)
        sampled.append(previous.token_ids() if previous is not None else None)
    queue.put(sampled)


def test_a_snapshot_round_trips_through_pickle(tiny_llama_dir):
    engine = LLMEngine(EngineConfig(str(tiny_llama_dir), device="cpu", num_kv_blocks=32))
    steps = record_steps(engine)
    run_requests(engine, testing.random_prompts(3, 300, seed=3))
    for blob, _ in steps:
        snapshot = pickle.loads(blob)
        again = pickle.loads(pickle.dumps(snapshot))
        for field in dataclasses.fields(SchedulerOutput):
            a, b = getattr(snapshot, field.name), getattr(again, field.name)
            assert plain(a) == plain(b), field.name


def plain(value):
    """A snapshot's field as plain Python values (numpy arrays as lists), to compare."""
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, (list, tuple)):
        return [plain(item) for item in value]
    return value


def test_new_requests_cross_once_then_only_counts_and_new_tokens(tiny_llama_dir):
    engine = LLMEngine(EngineConfig(str(tiny_llama_dir), device="cpu", num_kv_blocks=32, async_scheduling=False))
    steps = record_steps(engine)
    run_requests(engine, [[5, 6, 7, 8]])
    first, *rest = [pickle.loads(blob) for blob, _ in steps if pickle.loads(blob).request_ids]
    assert [n.prompt_token_ids for n in first.new_requests] == [[5, 6, 7, 8]] and first.new_token_ids == [[]]
    assert all(not s.new_requests for s in rest)
    # Synchronously each decode step carries exactly the one token sampled by the step before.
    assert [s.new_token_ids[0] for s in rest] == [tokens for _, tokens in steps[:len(rest)]]


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_a_worker_in_a_spawned_process_gives_the_same_tokens_from_snapshots_alone(tiny_llama_dir, async_scheduling):
    config = EngineConfig(str(tiny_llama_dir), device="cpu", num_kv_blocks=12, max_num_batched_tokens=24,
                          async_scheduling=async_scheduling)
    engine = LLMEngine(config)
    steps = record_steps(engine)
    run_requests(engine, testing.random_prompts(5, 300, min_len=10, max_len=30, seed=4))  # chunked and preempted
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    process = context.Process(target=replay_in_fresh_worker,
                              args=(pickle.dumps(config), [blob for blob, _ in steps], queue))
    process.start()
    try:
        sampled = queue.get(timeout=120)
    finally:
        process.join(timeout=30)
        if process.is_alive():
            process.kill()
    assert sampled == [tokens for _, tokens in steps]


def test_the_core_names_no_model_placeholder():
    found = subprocess.run(["grep", "-rn", "<image>", str(ROOT / "core")], capture_output=True, text=True).stdout
    assert found == ""


def test_every_engine_config_field_is_a_cli_flag(capsys):
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    help_text = capsys.readouterr().out
    flags = set(re.findall(r"--[a-z][a-z0-9-]*", help_text))
    for field in dataclasses.fields(EngineConfig):
        flag = field.metadata.get("flag", "--" + field.name.replace("_", "-"))
        assert flag in flags, f"EngineConfig.{field.name} has no CLI flag"
