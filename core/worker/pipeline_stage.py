"""This worker's place in a pipeline: what it receives from the stage before and hands on.

Every stage runs every step: the first embeds the tokens, each stage runs its layers on the
previous one's output, ``[k, num_tokens, hidden]`` (the hidden states, and the residual where
the model passes it on: ``pipeline_intermediate_count``), point-to-point between ranks of equal
tensor-parallel rank,, and the last computes logits and samples. No stage waits
for another's tokens: the engine keeps one batch per stage in flight, each of other requests,
and schedules a request again only once its sampled token is back, so every input token reaches
the first stage from the engine (``SchedulerOutput.new_token_ids``).
"""

from __future__ import annotations

import torch

from hookllm.distributed import get_pp_rank, get_pp_size, receive_from_previous_stage, send_to_next_stage


class PipelineStage:
    def __init__(self, num_intermediates: int, hidden_size: int, dtype: torch.dtype, device: torch.device):
        self.shape = (num_intermediates, hidden_size)  # per token: what the model's stages pass on
        self.dtype, self.device = dtype, device
        self.is_first = get_pp_rank() == 0
        self.is_last = get_pp_rank() == get_pp_size() - 1

    def receive(self, num_tokens: int) -> torch.Tensor:
        """The previous stage's output (hidden states, and the residual where the model passes it
        on) for this step's ``num_tokens`` tokens."""
        count, hidden_size = self.shape
        return receive_from_previous_stage((count, num_tokens, hidden_size), self.dtype, self.device)

    def send(self, intermediate: torch.Tensor) -> None:
        send_to_next_stage(intermediate)
