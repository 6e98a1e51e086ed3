"""The pooling runner's side of a step: each pooling request's hidden states, pooled.

A pooling request's prompt may take several steps (chunked prefill): the pooler keeps what its
earlier chunks leave (the sum of their rows for a mean, the first row for CLS, every row for
the encode task) and, in the step whose chunk completes the prompt, returns its output on the
device: ``embed`` one float32 vector (pooled, cut to ``dimensions``, normalized), ``encode``
a ``[prompt tokens, hidden]`` float32 matrix. A prompt recomputed after a preemption starts over.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hookllm.pooling_params import PoolerConfig
from hookllm.worker.batch import Batch


class Pooler:
    def __init__(self, config: PoolerConfig):
        self.config = config
        # By request: the pooled part of the chunks before this step.
        self.partial: dict[str, torch.Tensor | list[torch.Tensor]] = {}

    def remove(self, request_id: str) -> None:
        self.partial.pop(request_id, None)

    def pool(self, hidden_states: torch.Tensor, batch: Batch, query_start: list[int],
             completing: list[int]) -> dict[str, torch.Tensor]:
        """Take this step's rows of every pooling request; return the output of those whose
        prompt it completes (``completing``: their indices in ``batch.requests``)."""
        completed = set(completing)
        outputs = {}
        for index, request in enumerate(batch.requests):
            params = request.pooling_params
            if params is None:
                continue
            rows = hidden_states[query_start[index]:query_start[index + 1]].float()
            request_id, first_chunk = request.request_id, request.num_computed_tokens == 0
            part = None if first_chunk else self.partial.get(request_id)
            if params.task == "encode":
                part = (part or []) + [rows]
            elif self.config.pooling_type == "mean":
                part = rows.sum(dim=0) if part is None else part + rows.sum(dim=0)
            elif self.config.pooling_type == "cls" and first_chunk:
                part = rows[0]
            if index not in completed:
                self.partial[request_id] = part
                continue
            self.partial.pop(request_id, None)
            if params.task == "encode":
                outputs[request_id] = torch.cat(part)
                continue
            embedding = {"last": lambda: rows[-1], "cls": lambda: part,
                         "mean": lambda: part / request.num_prompt_tokens}[self.config.pooling_type]()
            if params.dimensions is not None:
                embedding = embedding[:params.dimensions]
            if self.config.normalize if params.normalize is None else params.normalize:
                embedding = F.normalize(embedding, dim=-1)
            outputs[request_id] = embedding
        return outputs
