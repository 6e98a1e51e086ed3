"""What the engine core drives: an executor runs each step's ``SchedulerOutput`` on the model.

Two executors satisfy :class:`Executor`: the in-process :class:`hookllm.worker.worker.Worker`
and :class:`hookllm.worker.multiproc_executor.MultiprocWorkers` (one spawned process per
tensor-parallel rank). Either returns, per launched step, a :class:`StepResult`: the one
step-output type the engine core sees, whether the tokens are on this process's device or
come back from rank 0.
"""

from __future__ import annotations

from typing import Any, Callable, Protocol, runtime_checkable

import torch

from hookllm.config import EngineConfig, ModelConfig
from hookllm.outputs import LogprobsRow
from hookllm.plugins.manager import ActiveHooks
from hookllm.sched.output import SchedulerOutput
from hookllm.spec.verify import SpecDecodeOutput
from hookllm.worker.kv_cache_groups import KVCacheGroups
from hookllm.worker.multiproc_executor import MultiprocWorkers
from hookllm.worker.worker import Worker


@runtime_checkable
class StepResult(Protocol):
    """A launched step whose tokens may not be read yet."""

    def resolve(self) -> tuple[list[int], list[LogprobsRow | None]]:
        """One token id per sampling row and its logprobs row (None if not asked); waits for
        the step if it still runs."""
        ...

    def prompt_logprobs(self) -> dict[str, list[LogprobsRow]]:
        """By request: one row per prompt token this step predicted."""
        ...

    def pooled(self) -> dict[str, torch.Tensor]:
        """By request: the pooled output (host, float32) of each pooling request this step completed."""
        ...

    def spec_decode(self) -> SpecDecodeOutput | None:
        """A speculating step's emitted tokens and next drafts, per sampling row (None otherwise)."""
        ...


@runtime_checkable
class Executor(Protocol):
    """The model, its KV cache and the steps run on them, in this process or in rank processes."""

    num_kv_blocks: int  # device KV blocks (the smallest rank's)
    num_host_blocks: int  # swap space, in blocks
    kv_cache_groups: KVCacheGroups
    startup_seconds: dict[str, float]  # each start-up phase, in order
    quantization_summary: str

    def execute(self, scheduler_output: SchedulerOutput, previous: StepResult | None = None) -> StepResult | None:
        """Launch a step; None when it schedules nothing (a snapshot of finished ids or swaps
        only). ``previous`` is this executor's result for the step still in flight, if any."""
        ...

    def collective_rpc(self, method: str | Callable[..., Any], args: tuple = (),
                       kwargs: dict[str, Any] | None = None) -> list[Any]:
        """Call a worker method by name, or a function with the worker as its first argument, on
        every rank between steps; each rank's result, in rank order."""
        ...

    def shutdown(self) -> None:
        """Release the KV cache and stop whatever the executor started."""
        ...


def make_executor(config: EngineConfig, model_config: ModelConfig, hooks: ActiveHooks) -> Executor:
    """The in-process worker, one process per rank (several ranks, or asked to run apart), or
    one Ray actor per rank."""
    if config.distributed_executor_backend == "ray":
        from hookllm.worker.ray_executor import RayWorkers

        return RayWorkers(config)
    if config.worker_in_own_process:
        return MultiprocWorkers(config)
    return Worker(config, model_config, hooks)
