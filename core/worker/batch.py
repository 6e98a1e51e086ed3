"""The model runner's side of a step: per-request state it keeps, and the batch hooks receive.

The runner rebuilds these from :class:`hookllm.sched.output.SchedulerOutput` snapshots
alone, so it can live in another process. Hooks (``prepare_inputs``, ``start_logits_job``,
``process_logits``, ``sample``, ``worker_request_finished``) read them and must not change them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch

from hookllm.sched.request import MultiModalItem
from hookllm.lora.request import LoRARequest
from hookllm.pooling_params import PoolingParams
from hookllm.sampling_params import SamplingParams

if TYPE_CHECKING:
    from hookllm.worker.model_runner import StepOutput


@dataclass
class CachedRequestState:
    """What the runner knows of one request (read-only for hooks)."""

    request_id: str
    all_token_ids: list[int]  # prompt, then the output tokens the scheduler has sent
    num_prompt_tokens: int
    sampling_params: SamplingParams
    mm_items: list[MultiModalItem] = field(default_factory=list)
    num_computed_tokens: int = 0  # before the current step
    pooling_params: PoolingParams | None = None  # a pooling request's (it samples nothing)
    lora_request: LoRARequest | None = None  # its adapter (None: the base model)

    @cached_property
    def sampler_row(self) -> tuple[float, int, float, float, float]:
        """(temperature, top_k, top_p, min_p, seeded): the request's entry in the sampler's
        per-step table, built once; seeded is 1.0 for a sampled request with a seed."""
        params = self.sampling_params
        seeded = params.seed is not None and params.temperature > 0
        return params.temperature, params.top_k, params.top_p, params.min_p, float(seeded)

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.all_token_ids[:self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[self.num_prompt_tokens:]


@dataclass
class Batch:
    """One step as hooks see it: ``requests`` in flat row order with ``num_scheduled_tokens``;
    ``sampling_requests`` are the rows of the logits (requests whose chunk reaches their end),
    and ``sampling_positions`` the index each row's sampled token will have in its sequence
    (``num_computed_tokens`` plus the scheduled count), whatever the batch or the chunking.

    Under speculative decoding a request verifying k drafts (``spec_token_ids``) has k + 1
    consecutive logits rows: it appears k + 1 times in ``sampling_requests``, its positions
    counting up; row j predicts the token after its j-th draft."""

    requests: list[CachedRequestState]
    num_scheduled_tokens: list[int]
    sampling_requests: list[CachedRequestState]
    sampling_positions: list[int]
    generator: torch.Generator  # the engine's generator, for requests without a seed
    previous: "StepOutput | None" = None  # the step still on the device, whose tokens are in flight
    # Each request's row in the runner's persistent batch (hookllm.worker.input_batch), int64.
    rows: np.ndarray | None = None
    # The sampling requests' ``sampler_row``s as the persistent batch keeps them, [5, rows] float32.
    sampler_table: np.ndarray | None = None
    # A speculating step's drafts of each sampling request, once per request in order (empty:
    # none); None in a step without drafts.
    spec_token_ids: list[list[int]] | None = None

    def in_flight_token_ids(self) -> dict[str, int]:
        """The token each request sampled in the previous step, by request id: with async
        scheduling it is not in ``output_token_ids`` yet. Waits for that step alone (not this
        one); empty when no step is in flight."""
        return self.previous.token_ids_by_request() if self.previous is not None else {}

    def exact_output_token_ids(self) -> list[list[int]]:
        """Each sampling row's output ids before the token it samples: its request's complete
        output, the in-flight token included (waits as ``in_flight_token_ids`` does), then, in a
        speculating step, the drafts before the row."""
        pending = self.in_flight_token_ids()
        outputs = [r.output_token_ids + ([pending[r.request_id]] if r.request_id in pending else [])
                   for r in self.sampling_requests]
        if self.spec_token_ids is not None:
            outputs = [output + drafts for output, drafts in zip(outputs, self.drafts_before_rows())]
        return outputs

    def drafts_before_rows(self) -> list[list[int]]:
        """Each sampling row's drafts before it (its request's first j drafts for its row j;
        empty for every row of a step without drafts)."""
        if self.spec_token_ids is None:
            return [[] for _ in self.sampling_requests]
        return [drafts[:j] for drafts in self.spec_token_ids for j in range(len(drafts) + 1)]


class LogitsJob(Protocol):
    """A plugin's work on one step's logits, split so that its host part can run off the main
    thread (returned by the ``start_logits_job`` hook)."""

    def run(self) -> None:
        """The host work: in the runner's background thread when a step is in flight, else inline.

        May read the batch the job was made for and wait for the previous step's tokens
        (``batch.in_flight_token_ids()``); the runner changes no request state until ``apply``.
        Spend the time in code that releases the GIL (Rust, C), or the main thread waits for it.
        """

    def tokens_ready(self) -> None:
        """Optional (a job without it is only ``run``): called when the previous step's tokens
        reach the host, on the thread that read them (the engine's main thread in-process),
        before or while ``run`` runs. A job that hands its work to another process sends it here,
        so that work overlaps the engine's output processing and scheduling; ``run`` must then
        not send it again (whichever comes first does). An error is raised when the step samples.
        """

    def apply(self, logits: torch.Tensor) -> None:
        """On the main thread, once ``run`` returned: change ``logits`` (``[num_sampling_rows,
        vocab]``) in place with device operations, before ``process_logits`` and ``sample``."""
