"""The pooling runner's side of a step: each pooling request's hidden states, pooled.

A pooling request's prompt may take several steps (chunked prefill): the pooler keeps what its
earlier chunks leave (the sum of their rows for a mean, the first row for CLS, every row for
the encode task) and, in the step whose chunk completes the prompt, returns its output on the
device: ``embed`` one float32 vector (pooled, cut to ``dimensions``, normalized), ``encode``
a ``[prompt tokens, hidden]`` float32 matrix, ``classify`` and ``score`` the classification
head's probabilities over the last token (a sigmoid for one label, else a softmax). A prompt
recomputed after a preemption starts over.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hookllm.config import ModelConfig
from hookllm.pooling_params import PoolerConfig
from hookllm.worker.model_loader import load_tensor
from hookllm.worker.batch import Batch, CachedRequestState


class Pooler:
    def __init__(self, config: PoolerConfig, head: torch.Tensor | None = None):
        self.config = config
        self.head = head  # [labels, hidden] float32 on the device: a classifier's score head
        # By request: the pooled part of the chunks before this step.
        self.partial: dict[str, torch.Tensor | list[torch.Tensor]] = {}

    @classmethod
    def for_model(cls, model_config: ModelConfig, device: torch.device) -> "Pooler":
        """The pooler of a model served by the pooling runner, its classification head (if any)
        read from the checkpoint (random with ``load_format="dummy"``)."""
        config = model_config.pooler
        head = None
        if config.head is not None:
            head = (torch.randn(len(config.labels), model_config.hf_config.hidden_size) * 0.02
                    if model_config.load_format == "dummy" else load_tensor(model_config.path, config.head))
            head = head.to(device, torch.float32)
        return cls(config, head)

    def remove(self, request_id: str) -> None:
        self.partial.pop(request_id, None)

    def pool(self, hidden_states: torch.Tensor, batch: Batch, query_start: list[int],
             completing: list[int]) -> dict[str, torch.Tensor]:
        """Take this step's rows of every pooling request; return the output of those whose
        prompt it completes (``completing``: their indices in ``batch.requests``)."""
        completed = set(completing)
        outputs = {}
        for index, request in enumerate(batch.requests):
            if request.pooling_params is None:
                continue
            rows = hidden_states[query_start[index]:query_start[index + 1]]
            request_id = request.request_id
            part = self._carry(request, rows, self.partial.pop(request_id, None))
            if index in completed:
                outputs[request_id] = self._output(request, rows, part)
            else:
                self.partial[request_id] = part
        return outputs

    def _carry(self, request: CachedRequestState, rows: torch.Tensor,
               part: torch.Tensor | list[torch.Tensor] | None) -> torch.Tensor | list[torch.Tensor] | None:
        """What the request's chunks so far leave for the next: every row (encode, a plugin's
        pooler), their sum (mean), the first row (CLS), or nothing (last). Kept rows are copies:
        the hidden states may be a CUDA graph's output buffer, which the next step overwrites."""
        first_chunk = request.num_computed_tokens == 0
        if first_chunk:
            part = None  # a prompt recomputed after a preemption starts over
        if request.pooling_params.task == "encode" or self.config.custom is not None:
            return (part or []) + [rows.to(torch.float32, copy=True)]
        if self.config.pooling_type == "mean":
            chunk_sum = rows.sum(dim=0, dtype=torch.float32)
            return chunk_sum if part is None else part + chunk_sum
        if self.config.pooling_type == "cls" and first_chunk:
            return rows[0].to(torch.float32, copy=True)
        return part

    def _output(self, request: CachedRequestState, rows: torch.Tensor,
                part: torch.Tensor | list[torch.Tensor] | None) -> torch.Tensor:
        """The completed request's output, from its last chunk's ``rows`` and what the chunks left."""
        params = request.pooling_params
        if params.task == "encode":
            return torch.cat(part)
        if params.task in ("classify", "score"):
            logits = self.head @ rows[-1].float()
            if params.activation:
                logits = logits.sigmoid() if logits.shape[0] == 1 else logits.softmax(dim=-1)
            return logits
        if self.config.custom is not None:
            embedding = self.config.custom(torch.cat(part), request)
        elif self.config.pooling_type == "mean":
            embedding = part / request.num_prompt_tokens
        elif self.config.pooling_type == "cls":
            embedding = part
        else:
            embedding = rows[-1].float()
        if params.dimensions is not None:
            embedding = embedding[:params.dimensions]
        if self.config.normalize if params.normalize is None else params.normalize:
            embedding = F.normalize(embedding, dim=-1)
        return embedding
