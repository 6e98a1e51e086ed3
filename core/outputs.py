"""What the engine returns for a request, vLLM-shaped."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, ClassVar

import msgspec

if TYPE_CHECKING:
    from hookllm.lora.request import LoRARequest


@dataclass
class Logprob:
    """One token's log-probability, its rank in the vocabulary (1 = most likely) and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One position's entries: the chosen (or prompt) token plus the top-k, keyed by token id.
LogprobsEntry = dict[int, Logprob]
# One position's logprobs as the worker reports them: token ids (the chosen or prompt token first,
# then the top ones, best first), their logprobs and their ranks. Lists, not objects: a step's rows
# are made from a few arrays, and cross process boundaries as they are.
LogprobsRow = tuple[list[int], list[float], list[int]]


def logprobs_entry(row: LogprobsRow, texts: list[str] | None = None) -> LogprobsEntry:
    """A row as vLLM's entry: the top tokens with their ranks, then the chosen one with its own
    (one key if it is among the top); ``texts``: each row token's ``decoded_token``."""
    ids, values, ranks = row
    texts = texts or [None] * len(ids)
    entry = {token: Logprob(value, rank, text)
             for token, value, rank, text in zip(ids[1:], values[1:], ranks[1:], texts[1:])}
    entry[ids[0]] = Logprob(values[0], ranks[0], texts[0])
    return entry


class FlatLogprobs(msgspec.Struct, array_like=True, eq=False, dict=True):
    """A completion's logprobs as the rows they came in (vLLM's ``FlatLogprobs``), read as a
    list of entries: an entry's ``Logprob`` objects are built when it is read, not by the engine
    for every token of every step. Each read builds new objects; compares equal to a list of the
    same entries.

    So are its tokens' texts (``decoded_token``, when ``detokenize``): looked up when an entry is
    read, by the ``token_texts`` of the process reading it (:meth:`decode_with`), so that neither
    the engine's step nor the pipe from an engine process carries them."""

    rows: list[LogprobsRow] = []
    detokenize: bool = False

    def decode_with(self, token_texts: Callable[[list[int]], list[str]] | None) -> "FlatLogprobs":
        """Read the entries' texts with ``token_texts`` (token ids to texts); returns self."""
        self.token_texts = token_texts
        return self

    def append(self, row: LogprobsRow) -> None:
        self.rows.append(row)

    def _entry(self, row: LogprobsRow) -> LogprobsEntry:
        token_texts = self.__dict__.get("token_texts") if self.detokenize else None
        return logprobs_entry(row, None if token_texts is None else token_texts(row[0]))

    def _with_rows(self, rows: list[LogprobsRow]) -> "FlatLogprobs":
        return FlatLogprobs(rows, self.detokenize).decode_with(self.__dict__.get("token_texts"))

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int | slice) -> Any:
        if isinstance(index, slice):
            return self._with_rows(self.rows[index])
        return self._entry(self.rows[index])

    def __iter__(self) -> Iterator[LogprobsEntry]:
        return map(self._entry, self.rows)

    def __add__(self, other: Sequence[LogprobsEntry]) -> Any:
        if isinstance(other, FlatLogprobs):
            return self._with_rows(self.rows + other.rows)
        return list(self) + list(other)

    def __radd__(self, other: Sequence[LogprobsEntry]) -> list:
        return list(other) + list(self)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (FlatLogprobs, list, tuple)):
            return list(self) == list(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"FlatLogprobs({list(self)!r})"


Sequence.register(FlatLogprobs)


@dataclass
class RequestMetrics:
    """Wall-clock times (``time.time()``) of a request's milestones; None until reached."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    # Speculative decoding: the guesses its steps verified, and those accepted.
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0


@dataclass(slots=True)  # made for every streamed request every step
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None  # sum of the sampled tokens' logprobs (when logprobs is set)
    logprobs: Sequence[LogprobsEntry] | None = None  # a FlatLogprobs from the engine
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    # None for the first prompt token (nothing predicts it), then one entry per prompt token.
    prompt_logprobs: list[LogprobsEntry | None] | None = None
    metrics: RequestMetrics | None = None
    num_cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    lora_request: LoRARequest | None = None  # the adapter the request ran with


@dataclass
class PoolingOutput:
    """A pooling request's result (vLLM's): ``data`` a float32 tensor on the host, the embedding
    ``[hidden]`` (or ``[dimensions]``) for the embed task, ``[prompt tokens, hidden]`` for encode."""

    data: Any


@dataclass
class PoolingRequestOutput:
    request_id: str
    outputs: PoolingOutput
    prompt_token_ids: list[int]
    finished: bool = True
    num_cached_tokens: int = 0


class EmbeddingOutput:
    """One embedding: ``embedding``, a list of floats. Made from the pooled vector (a host float32
    tensor, :meth:`of`), the list is built when first read: listing costs tens of nanoseconds a
    value, more than the model spends on a small encoder's embedding, so an embedding nobody
    reads as a list (the server's base64 answer, say) is never listed."""

    def __init__(self, embedding: list[float] | Any):
        self._embedding = embedding

    @classmethod
    def of(cls, data: Any) -> EmbeddingOutput:
        return cls(data)

    @property
    def embedding(self) -> list[float]:
        if not isinstance(self._embedding, list):
            self._embedding = self._embedding.tolist()
        return self._embedding

    @property
    def hidden_size(self) -> int:
        return len(self._embedding)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, EmbeddingOutput) and self.embedding == other.embedding

    def __repr__(self) -> str:
        return f"EmbeddingOutput(embedding={self.embedding!r})"


@dataclass
class _PooledListOutput:
    """A ``PoolingRequestOutput`` whose data, one vector, its task reads as a list."""

    request_id: str
    outputs: Any
    prompt_token_ids: list[int]
    finished: bool = True
    output_type: ClassVar[Any]  # its ``of`` makes it from the vector (a host tensor)

    @classmethod
    def from_base(cls, output: PoolingRequestOutput) -> Any:
        return cls(output.request_id, cls.output_type.of(output.outputs.data), output.prompt_token_ids,
                   output.finished)


@dataclass
class EmbeddingRequestOutput(_PooledListOutput):
    """``LLM.embed``'s output: ``outputs.embedding``."""

    output_type: ClassVar[Any] = EmbeddingOutput


@dataclass
class ClassificationOutput:
    probs: list[float]  # one per label (the head's raw logits with activation=False)

    @classmethod
    def of(cls, data: Any) -> ClassificationOutput:
        return cls(data.tolist())

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclass
class ClassificationRequestOutput(_PooledListOutput):
    """``LLM.classify``'s output: ``outputs.probs``."""

    output_type: ClassVar[Any] = ClassificationOutput


@dataclass
class ScoringOutput:
    score: float


@dataclass
class ScoringRequestOutput:
    """``LLM.score``'s output: a cross-encoder's probability for a pair, or the cosine similarity
    of an embedding model's two embeddings."""

    request_id: str
    outputs: ScoringOutput
    prompt_token_ids: list[int]
    finished: bool = True
