"""``speculative_config``: vLLM's keys for speculative decoding, as ``LLM(speculative_config={...})``
and ``hookllm serve --speculative-config JSON`` take them."""

from __future__ import annotations

from dataclasses import dataclass, field

from hookllm.utils import parse_json_config

# Most tokens a proposer may guess per step: each costs a row of the target's step.
MAX_SPECULATIVE_TOKENS = 16


def _types(*types: type) -> dict:
    """A field's accepted JSON types, where its default's type alone does not say them."""
    return {"types": types}


@dataclass
class SpeculativeConfig:
    method: str | None = field(default=None, metadata=_types(str, type(None)))
    num_speculative_tokens: int = field(default=0, metadata=_types(int))
    # A draft model's or head's folder (draft_model, eagle3); unused by ngram.
    model: str | None = field(default=None, metadata=_types(str, type(None)))
    # ngram: the suffix lengths looked up, longest first (vLLM's defaults: 5 and 5 when neither is set).
    prompt_lookup_min: int | None = field(default=None, metadata=_types(int, type(None)))
    prompt_lookup_max: int | None = field(default=None, metadata=_types(int, type(None)))
    # No speculation in a step while more requests than this run (None: always speculate).
    disable_by_batch_size: int | None = field(default=None, metadata=_types(int, type(None)))
    draft_tensor_parallel_size: int | None = field(default=None, metadata=_types(int, type(None)))

    def __post_init__(self) -> None:
        if self.method is None:
            # vLLM's rule: a draft model without a method is a draft model.
            self.method = "draft_model" if self.model else "ngram"
        if not 1 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"speculative_config's num_speculative_tokens must be in 1 .. {MAX_SPECULATIVE_TOKENS}, "
                             f"got {self.num_speculative_tokens}")
        if self.prompt_lookup_min is None:
            self.prompt_lookup_min = self.prompt_lookup_max or 5
        if self.prompt_lookup_max is None:
            self.prompt_lookup_max = self.prompt_lookup_min
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(f"speculative_config needs 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                             f"{self.prompt_lookup_min} and {self.prompt_lookup_max}")
        if self.disable_by_batch_size is not None and self.disable_by_batch_size < 1:
            raise ValueError("speculative_config's disable_by_batch_size must be >= 1, got "
                             f"{self.disable_by_batch_size}")
        if self.draft_tensor_parallel_size not in (None, 1):
            raise ValueError(f"speculative_config's draft_tensor_parallel_size {self.draft_tensor_parallel_size} "
                             "is not offered: a proposer runs on each rank whole (1)")

    @classmethod
    def parse(cls, value: "SpeculativeConfig | str | dict | None") -> "SpeculativeConfig | None":
        """A config from a JSON object (text or dict); ``ValueError`` naming what is wrong."""
        return parse_json_config(cls, value, "speculative_config")

    def speculates(self, num_running: int) -> bool:
        """Whether a step with ``num_running`` running requests speculates."""
        return self.disable_by_batch_size is None or num_running <= self.disable_by_batch_size
