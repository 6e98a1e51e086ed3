"""Per-request pooling settings (vLLM's ``PoolingParams``) and how a checkpoint pools.

A pooling request runs one forward pass over its prompt and returns hidden states instead of
tokens: ``embed`` one vector per prompt (the model's pooling, then ``dimensions`` and
normalization), ``encode`` the last layer's hidden state of every prompt token, ``classify``
(and ``score``, a cross-encoder's one label over a pair of texts) a classification head's
probabilities over the last token.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

POOLING_TASKS = ("embed", "encode", "classify", "score")
POOLING_TYPES = ("last", "mean", "cls")
# sentence-transformers' pooling modes (1_Pooling/config.json) that hookllm computes.
SENTENCE_TRANSFORMERS_MODES = {"lasttoken": "last", "mean": "mean", "cls": "cls"}


@dataclass
class PoolingParams:
    """How to pool one request. ``dimensions`` keeps the first n values of an embedding (a
    Matryoshka-trained model's), before normalization; ``normalize`` None is the model's default.
    ``activation``: a classification's softmax over its labels (a sigmoid for one label); off,
    the head's raw logits."""

    task: str = "embed"
    dimensions: int | None = None
    normalize: bool | None = None
    activation: bool = True
    truncate_prompt_tokens: int | None = None  # keep the prompt's last n tokens
    extra_args: dict[str, Any] | None = None
    # Set by the engine from a prompt's token_type_ids: where a text pair's second text starts
    # (its tokens are of type 1 for a BERT-style cross-encoder).
    second_text_start: int | None = None

    def __post_init__(self) -> None:
        if self.task not in POOLING_TASKS:
            raise ValueError(f"pooling task must be one of {', '.join(POOLING_TASKS)}, got {self.task!r}")
        if self.dimensions is not None and (not isinstance(self.dimensions, int) or self.dimensions < 1):
            raise ValueError(f"dimensions must be a positive int, got {self.dimensions!r}")
        if self.truncate_prompt_tokens is not None and self.truncate_prompt_tokens < 1:
            raise ValueError(f"truncate_prompt_tokens must be at least 1, got {self.truncate_prompt_tokens}")
        if self.task != "embed" and self.dimensions is not None:
            raise ValueError(f"dimensions applies to the embed task only, not {self.task}")


@dataclass
class PoolerConfig:
    """How a checkpoint pools a prompt into one embedding: the hidden state of its ``last`` or
    first (``cls``) token, or their ``mean``; ``normalize``: to unit length by default.
    ``matryoshka``: whether a request may ask for fewer ``dimensions``. ``labels``: a
    classifier's labels' names, None for a model without a classification head; ``head``: the
    checkpoint tensor of a decoder classifier's head (``score.weight``, ``[labels, hidden]``),
    None where the model computes its own (an encoder's transformers classifier).
    ``projection``: a late-interaction model's (ColBERT's) per-token projection, the checkpoint
    tensor ``[dim, hidden]`` each token's hidden state goes through (then normalized) for
    ``encode`` and MaxSim scoring. ``dense``: the folders of a sentence-transformers pipeline's
    ``Dense`` modules, applied in order to the pooled embedding (before normalization), and
    ``dimension`` the size they leave (None: the hidden size)."""

    pooling_type: str = "last"
    normalize: bool = True
    matryoshka: bool = False
    head: str | None = None
    labels: list[str] | None = None
    projection: str | None = None
    dense: tuple[str, ...] = ()
    dimension: int | None = None
    # A plugin's pooler (``--pooler NAME``, ``Components.add_pooler``): every prompt token's
    # hidden state and the request in, the embedding out; pooling_type is then its name.
    custom: Callable[[Any, Any], Any] | None = None

    @classmethod
    def for_checkpoint(cls, path: str | Path, hf_config: Any) -> "PoolerConfig | None":
        """The sentence-transformers pipeline in ``path`` (``modules.json``: a Transformer, a
        Pooling module, Dense projections, Normalize), or None when the folder has none.
        ``ValueError`` for a module hookllm does not compute (max pooling, a Dense with a residual)."""
        folder = Path(path)
        modules_file = folder / "modules.json"
        if not modules_file.is_file():
            return None
        modules = [(module["type"].rsplit(".", 1)[-1], module) for module in json.loads(modules_file.read_text())]
        kinds = dict(modules)
        unknown = set(kinds) - {"Transformer", "Pooling", "Dense", "Normalize"}
        if unknown:
            raise ValueError(f"{modules_file}: sentence-transformers modules {sorted(unknown)} are not supported "
                             "(hookllm computes Transformer, Pooling, Dense and Normalize)")
        pooling_type = "cls"  # a Transformer alone: sentence-transformers' default for BERT-style models
        if "Pooling" in kinds:
            pooling_type = _pooling_type(folder / kinds["Pooling"]["path"] / "config.json")
        dense = tuple(module["path"] for kind, module in modules if kind == "Dense")
        dimension = None
        for module_path in dense:
            config = json.loads((folder / module_path / "config.json").read_text())
            if config.get("use_residual"):
                raise ValueError(f"{folder / module_path}: a Dense module with a residual connection is not supported")
            dimension = config["out_features"]
        return cls(pooling_type, "Normalize" in kinds, is_matryoshka(hf_config), dense=dense, dimension=dimension)

    @property
    def is_classifier(self) -> bool:
        return self.labels is not None

    @property
    def late_interaction(self) -> bool:
        return self.projection is not None

    @property
    def checkpoint_tensors(self) -> list[str]:
        """The checkpoint tensors the pooler reads (the model's loader skips them)."""
        return [name for name in (self.head, self.projection) if name is not None]

    @classmethod
    def classifier(cls, hf_config: Any, own_head: bool = False) -> "PoolerConfig":
        """A ``*ForSequenceClassification`` checkpoint's: a decoder's ``score`` head over the last
        token (transformers' own pooling for decoder classifiers), or with ``own_head`` the
        model's (an encoder's, whose transformers head pools as it was trained to)."""
        id2label = getattr(hf_config, "id2label", None) or {}
        num_labels = len(id2label) or getattr(hf_config, "num_labels", 2)
        labels = [str(id2label.get(i, id2label.get(str(i), f"LABEL_{i}"))) for i in range(num_labels)]
        return cls("cls" if own_head else "last", False, False, head=None if own_head else "score.weight",
                   labels=labels)

    @classmethod
    def default(cls, hf_config: Any, encoder: bool = False) -> "PoolerConfig":
        """A model's embedding without a sentence-transformers pipeline: a causal LM's last token,
        an encoder's first (CLS), normalized."""
        return cls("cls" if encoder else "last", True, is_matryoshka(hf_config))


def is_matryoshka(hf_config: Any) -> bool:
    """Whether the checkpoint's config says its embeddings may be cut (vLLM reads the same keys)."""
    return bool(getattr(hf_config, "is_matryoshka", False) or getattr(hf_config, "matryoshka_dimensions", None))


def _pooling_type(config_file: Path) -> str:
    """The one pooling mode of a sentence-transformers Pooling config: ``pooling_mode`` (recent
    releases) or the ``pooling_mode_*`` flags (older ones)."""
    config = json.loads(config_file.read_text())
    modes = config.get("pooling_mode")
    if modes is None:
        flags = {"pooling_mode_cls_token": "cls", "pooling_mode_mean_tokens": "mean",
                 "pooling_mode_max_tokens": "max", "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
                 "pooling_mode_weightedmean_tokens": "weightedmean", "pooling_mode_lasttoken": "lasttoken"}
        modes = [mode for flag, mode in flags.items() if config.get(flag)]
    modes = [modes] if isinstance(modes, str) else list(modes)
    if len(modes) != 1 or modes[0] not in SENTENCE_TRANSFORMERS_MODES:
        raise ValueError(f"{config_file}: pooling {modes} is not supported (one of "
                         f"{', '.join(SENTENCE_TRANSFORMERS_MODES)})")
    return SENTENCE_TRANSFORMERS_MODES[modes[0]]
