"""What the input processor hands the engine core: one engine request, as plain data.

An :class:`EngineCoreRequest` is built from the user's prompt, adjusted in place by the plugins'
``preprocess_request`` hooks, fanned out into ``n`` children, and then given to the engine
core, whose scheduler makes its own scheduling state from it (``Scheduler.add_request``). The
output processor takes the same object: neither front-end side ever sees the scheduler's
``Request``.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any

from hookllm.lora.request import LoRARequest
from hookllm.pooling_params import PoolingParams
from hookllm.sampling_params import SamplingParams
from hookllm.sched.request import MultiModalItem


@dataclass
class EngineCoreRequest:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    prompt: str | None = None  # the prompt's text, when it was given as text
    multi_modal_data: dict[str, Any] | None = None  # the user's non-text inputs
    mm_items: list[MultiModalItem] = field(default_factory=list)  # what plugins made of them
    # Mixed into the hash of the request's first KV block (so into every block after it): requests
    # share cached blocks only when their salts are equal. From the prompt's "cache_salt"; a plugin
    # whose embeddings or K/V depend on more than the tokens and images sets it in preprocess_request.
    cache_salt: str | None = None
    # Prompt plus max_tokens, capped by max_model_len: set_length_limit sets it once the prompt is final.
    max_num_tokens: int = sys.maxsize
    # A pooling request's settings: it computes its prompt and ends, sampling nothing
    # (``sampling_params`` is then the input processor's stand-in, see POOLING_SAMPLING).
    pooling_params: PoolingParams | None = None
    # The LoRA adapter the request runs with (None: the base model); checked by the input processor.
    lora_request: LoRARequest | None = None

    def reset_prompt(self, token_ids: list[int]) -> None:
        """Replace the prompt (a plugin's ``preprocess_request`` expanding placeholders)."""
        self.prompt_token_ids = list(token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    def set_length_limit(self, max_model_len: int) -> None:
        """Check the prompt against ``max_model_len`` and set ``max_num_tokens`` (prompt plus
        ``max_tokens``, capped by ``max_model_len``); ``ValueError`` naming the request if it cannot run."""
        rid, n = self.request_id, self.num_prompt_tokens
        if n == 0:
            raise ValueError(f"request {rid}: the prompt is empty")
        if self.pooling_params is not None:  # no output token: the prompt may fill the model
            if n > max_model_len:
                raise ValueError(f"request {rid}: the input has {n} tokens, max_model_len is {max_model_len} "
                                 "(truncate_prompt_tokens keeps its end)")
            self.max_num_tokens = n
            return
        if n >= max_model_len:
            raise ValueError(f"request {rid}: the prompt has {n} tokens, max_model_len is {max_model_len} "
                             "(it must leave room for at least one output token)")
        max_tokens = self.sampling_params.max_tokens
        self.max_num_tokens = min(n + max_tokens, max_model_len) if max_tokens is not None else max_model_len
