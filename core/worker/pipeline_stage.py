"""This worker's place in a pipeline: what it receives from the stage before and hands on.

Every stage runs every step: the first embeds the tokens, each stage runs its layers on the
previous one's ``[2, num_tokens, hidden]`` hidden states and residual (point-to-point, between
ranks of equal tensor-parallel rank), and the last computes logits and samples. No stage waits
for another's tokens: the engine keeps one batch per stage in flight, each of other requests,
and schedules a request again only once its sampled token is back, so every input token reaches
the first stage from the engine (``SchedulerOutput.new_token_ids``).
"""

from __future__ import annotations

import torch

from hookllm.distributed import get_pp_rank, get_pp_size, receive_from_previous_stage, send_to_next_stage


class PipelineStage:
    def __init__(self, hidden_size: int, dtype: torch.dtype, device: torch.device):
        self.hidden_size, self.dtype, self.device = hidden_size, dtype, device
        self.is_first = get_pp_rank() == 0
        self.is_last = get_pp_rank() == get_pp_size() - 1

    def receive(self, num_tokens: int) -> torch.Tensor:
        """The previous stage's hidden states and residual for this step's ``num_tokens`` tokens."""
        return receive_from_previous_stage((2, num_tokens, self.hidden_size), self.dtype, self.device)

    def send(self, intermediate: torch.Tensor) -> None:
        send_to_next_stage(intermediate)
