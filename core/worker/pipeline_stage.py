"""This worker's place in a pipeline: what it receives from the stage before and hands on.

Every stage runs every step: the first embeds the tokens, each stage runs its layers on the
previous one's ``[2, num_tokens, hidden]`` hidden states and residual (point-to-point, between
ranks of equal tensor-parallel rank), and the last computes logits and samples. The sampled ids
then go back to every stage by one broadcast, so each stage's runner holds the same in-flight
tokens as a single-stage runner does (the first reads them as its next inputs under async
scheduling).
"""

from __future__ import annotations

import torch

from hookllm.distributed import (
    broadcast_from_last_stage, get_pp_rank, get_pp_size, receive_from_previous_stage, send_to_next_stage,
)


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

    def share_sampled(self, token_ids: torch.Tensor) -> None:
        """On the last stage: the step's sampled ids, to every other stage."""
        broadcast_from_last_stage(token_ids)

    def receive_sampled(self, num_rows: int) -> torch.Tensor:
        """On the other stages: the ids the last stage sampled for the step's ``num_rows`` rows."""
        return broadcast_from_last_stage(torch.empty(num_rows, dtype=torch.long, device=self.device))
