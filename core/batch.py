"""The model runner's side of a step: per-request state it keeps, and the batch hooks receive.

The runner rebuilds these from :class:`hookllm.scheduler_output.SchedulerOutput` snapshots
alone, so it can live in another process. Hooks (``prepare_inputs``, ``process_logits``,
``sample``, ``request_finished``) read them and must not change them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from hookllm.request import MultiModalItem
from hookllm.sampling_params import SamplingParams

if TYPE_CHECKING:
    from hookllm.model_runner import StepOutput


@dataclass
class RequestState:
    """What the runner knows of one request (read-only for hooks)."""

    request_id: str
    all_token_ids: list[int]  # prompt, then the output tokens the scheduler has sent
    num_prompt_tokens: int
    sampling_params: SamplingParams
    mm_items: list[MultiModalItem] = field(default_factory=list)
    num_computed_tokens: int = 0  # before the current step
    # The runner owns the randomness: a seeded request draws from its own generator.
    generator: torch.Generator | None = None

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.all_token_ids[:self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[self.num_prompt_tokens:]


@dataclass
class Batch:
    """One step as hooks see it: ``requests`` in flat row order with ``num_scheduled_tokens``;
    ``sampling_requests`` are the rows of the logits (requests whose chunk reaches their end)."""

    requests: list[RequestState]
    num_scheduled_tokens: list[int]
    sampling_requests: list[RequestState]
    generator: torch.Generator  # the engine's generator, for requests without a seed
    previous: "StepOutput | None" = None  # the step still on the device, whose tokens are in flight

    def exact_output_token_ids(self) -> list[list[int]]:
        """Each sampling request's complete output ids, the in-flight token included.

        With async scheduling the previous step's tokens are not in ``output_token_ids`` yet;
        this waits for that step alone (not this one) to read them.
        """
        pending = self.previous.token_ids_by_request() if self.previous is not None else {}
        return [r.output_token_ids + ([pending[r.request_id]] if r.request_id in pending else [])
                for r in self.sampling_requests]
