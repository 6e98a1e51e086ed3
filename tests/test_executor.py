"""The executor contract: the in-process worker and the rank processes both satisfy
``Executor``, and the engine core sees one step-output type, ``StepResult``, from either."""

from __future__ import annotations

import inspect

import pytest

from hookllm import LLM, testing
from hookllm.worker.executor import Executor, StepResult
from hookllm.worker.model_runner import StepOutput
from hookllm.worker.multiproc_executor import MultiprocWorkers, RemoteStepOutput
from hookllm.worker.worker import Worker


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return LLM(str(tiny_llama_dir), dtype="float32", device="cpu", max_model_len=64, num_kv_blocks=8)


def _parameter_names(function) -> list[str]:
    return list(inspect.signature(function).parameters)


def test_the_in_process_worker_is_an_executor(llm):
    assert isinstance(llm.engine.engine_core.executor, Executor)


def test_the_in_process_worker_returns_step_results(llm, monkeypatch):
    worker = llm.engine.engine_core.executor
    results = []

    def recording(*args, **kwargs):
        result = Worker.execute(worker, *args, **kwargs)
        results.append(result)
        return result

    monkeypatch.setattr(worker, "execute", recording)
    llm.generate([{"prompt_token_ids": [5, 6, 7]}], testing.greedy(3))
    launched = [result for result in results if result is not None]
    assert len(launched) == 3 and all(isinstance(result, StepResult) for result in launched)


@pytest.mark.parametrize("method", ["execute", "shutdown"])
def test_both_executors_take_the_protocols_arguments(method):
    expected = _parameter_names(getattr(Executor, method))
    assert _parameter_names(getattr(Worker, method)) == expected
    assert _parameter_names(getattr(MultiprocWorkers, method)) == expected


@pytest.mark.parametrize("method", ["resolve", "prompt_logprobs"])
def test_both_step_outputs_take_the_protocols_arguments(method):
    expected = _parameter_names(getattr(StepResult, method))
    assert _parameter_names(getattr(StepOutput, method)) == expected
    assert _parameter_names(getattr(RemoteStepOutput, method)) == expected
