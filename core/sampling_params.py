"""Per-request sampling settings, vLLM-shaped."""

from __future__ import annotations

import copy
import enum
import math
from dataclasses import dataclass, field
from typing import Any


class RequestOutputKind(str, enum.Enum):
    """What ``LLMEngine.step`` reports for a request (vLLM's names). A ``str`` enum, so the
    strings "cumulative", "delta" and "final_only" compare equal to its members."""

    CUMULATIVE = "cumulative"  # everything so far, every step
    DELTA = "delta"  # only the step's new tokens and text
    FINAL_ONLY = "final_only"  # one output, when the request finishes


OUTPUT_KINDS = tuple(kind.value for kind in RequestOutputKind)


@dataclass
class StructuredOutputsParams:
    """A constraint on a request's output, shaped as vLLM's: set exactly one of ``json`` (a JSON
    schema, as a dict or a JSON string), ``regex``, ``choice`` (the output is one of these
    strings), ``grammar`` (a Lark grammar) or ``json_object=True`` (any JSON object). The
    ``structured`` plugin (``--plugin structured``) compiles and enforces it."""

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    def __post_init__(self) -> None:
        chosen = [name for name in STRUCTURED_KINDS if getattr(self, name) not in (None, False)]
        if len(chosen) != 1:
            raise ValueError(f"structured_outputs must set exactly one of {', '.join(STRUCTURED_KINDS)}; "
                             f"got {', '.join(chosen) or 'none'}")
        if self.choice is not None:
            self.choice = list(self.choice)
            if not self.choice or not all(isinstance(c, str) for c in self.choice):
                raise ValueError("structured_outputs.choice must be a non-empty list of strings")

    @property
    def kind(self) -> str:
        """The one field that is set."""
        return next(name for name in STRUCTURED_KINDS if getattr(self, name) not in (None, False))


STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass
class SamplingParams:
    """How to sample one request. Invalid values raise ``ValueError`` when constructed.

    ``temperature=0`` is greedy. ``top_k`` <= 0 means no top-k. ``max_tokens=None`` runs to
    the model's length limit. ``extra_args`` carries plugin-specific settings. ``output_kind``
    (a :class:`RequestOutputKind` or its string value) says what ``LLMEngine.step`` reports.

    Penalties follow vLLM: ``presence_penalty`` and ``frequency_penalty`` subtract from the
    logits of tokens already in the output (once, and once per occurrence);
    ``repetition_penalty`` divides positive (multiplies negative) logits of tokens in the
    prompt or the output. ``logit_bias`` adds to token logits; ``allowed_token_ids`` keeps only
    those tokens; ``bad_words`` are strings whose tokens may never be completed.
    ``prompt_logprobs=k`` returns each prompt token's logprob plus the top k;
    ``truncate_prompt_tokens=k`` keeps the prompt's last k tokens; ``detokenize=False`` skips text.
    """

    max_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    logprobs: int | None = None
    n: int = 1
    output_kind: RequestOutputKind | str = RequestOutputKind.CUMULATIVE
    extra_args: dict[str, Any] = field(default_factory=dict)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    prompt_logprobs: int | None = None
    truncate_prompt_tokens: int | None = None
    detokenize: bool = True
    # Set by the engine from ``bad_words`` (each word's token spellings); not a user field.
    bad_words_token_ids: list[list[int]] | None = None
    # A JSON schema / regex / choice / grammar constraint (a dict is read as the dataclass's fields).
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.extra_args = dict(self.extra_args or {})
        if isinstance(self.n, bool) or not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"n must be an int >= 1, got {self.n!r}")
        try:
            self.output_kind = RequestOutputKind(self.output_kind)
        except ValueError:
            raise ValueError(f"output_kind must be one of {OUTPUT_KINDS}, got {self.output_kind!r}") from None
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number, got {value!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1, 0 (off) or positive, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise ValueError(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise ValueError(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if self.repetition_penalty <= 0.0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.min_tokens < 0 or (self.max_tokens is not None and self.min_tokens > self.max_tokens):
            raise ValueError(f"min_tokens must be in [0, max_tokens], got {self.min_tokens}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or value < 0):
                raise ValueError(f"{name} must be an int >= 0, got {value!r}")
        if self.truncate_prompt_tokens is not None and (not _is_int(self.truncate_prompt_tokens)
                                                        or self.truncate_prompt_tokens < 1):
            raise ValueError(f"truncate_prompt_tokens must be an int >= 1, got {self.truncate_prompt_tokens!r}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        if self.stop and not self.detokenize:
            raise ValueError("stop strings need text: they cannot be used with detokenize=False")
        if self.logit_bias is not None:
            self.logit_bias = {_token_id(t, "logit_bias"): float(b) for t, b in dict(self.logit_bias).items()}
            if not all(math.isfinite(b) for b in self.logit_bias.values()):
                raise ValueError("logit_bias values must be finite")
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = [_token_id(t, "allowed_token_ids") for t in self.allowed_token_ids]
            if not self.allowed_token_ids:
                raise ValueError("allowed_token_ids must not be empty")
        if isinstance(self.structured_outputs, dict):
            try:
                self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
            except TypeError as exc:  # an unknown key
                raise ValueError(f"structured_outputs: {exc}") from None
        if self.bad_words is not None:
            self.bad_words = list(self.bad_words)
            if not all(isinstance(w, str) and w.strip() for w in self.bad_words):
                raise ValueError("bad_words must be non-empty strings")

    @property
    def needs_logits_processing(self) -> bool:
        """Whether the runner's penalty / bias stage has work for this request."""
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0
                or bool(self.logit_bias) or self.allowed_token_ids is not None or bool(self.bad_words_token_ids))

    def clone(self) -> "SamplingParams":
        """A deep copy (vLLM's ``clone``): changing it leaves this one as it is."""
        return copy.deepcopy(self)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _token_id(value: Any, name: str) -> int:
    # JSON object keys arrive as strings ("50256"): accept those that spell an int, nothing else.
    if isinstance(value, str) and value.lstrip("-").isdigit():
        value = int(value)
    if not _is_int(value) or value < 0:
        raise ValueError(f"{name} token ids must be ints >= 0, got {value!r}")
    return value
