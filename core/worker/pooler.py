"""The pooling runner's side of a step: each pooling request's hidden states, pooled.

A pooling request's prompt may take several steps (chunked prefill): the pooler keeps what its
earlier chunks leave (the sum of their rows for a mean, the first row for CLS, every row for
the encode task) and, in the step whose chunk completes the prompt, returns its output on the
device: ``embed`` one float32 vector (pooled, cut to ``dimensions``, normalized), ``encode``
a ``[prompt tokens, hidden]`` float32 matrix, ``classify`` and ``score`` the classification
head's probabilities (a sigmoid for one label, else a softmax): a decoder's head over the last
token, or an encoder's own (its ``classify`` over the prompt's rows, all in one step). A prompt
recomputed after a preemption starts over.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn

from hookllm.config import ModelConfig
from hookllm.plugins.contract import SupportsClassification
from hookllm.pooling_params import PoolerConfig
from hookllm.worker.model_loader import load_tensor
from hookllm.worker.batch import Batch, CachedRequestState


class Pooler:
    def __init__(self, config: PoolerConfig, head: torch.Tensor | None = None,
                 classify: Callable[[torch.Tensor], torch.Tensor] | None = None,
                 projection: torch.Tensor | None = None, dense: nn.Module | None = None):
        self.config = config
        self.dense = dense  # a sentence-transformers pipeline's Dense modules, float32 on the device
        self.head = head  # [labels, hidden] float32 on the device: a decoder classifier's score head
        self.projection = projection  # [dim, hidden] float32: a late-interaction model's, for encode
        self.classify = classify  # an encoder classifier's: a prompt's rows -> its logits
        # By request: the pooled part of the chunks before this step.
        self.partial: dict[str, torch.Tensor | list[torch.Tensor]] = {}

    @classmethod
    def for_model(cls, model_config: ModelConfig, device: torch.device, model: torch.nn.Module) -> "Pooler":
        """The pooler of a model served by the pooling runner, a decoder's classification head
        (if any) read from the checkpoint (random with ``load_format="dummy"``)."""
        config = model_config.pooler
        hidden_size = model_config.hf_config.hidden_size

        def tensor(name: str | None, rows: int) -> torch.Tensor | None:
            if name is None:
                return None
            dummy = model_config.load_format == "dummy"
            value = torch.randn(rows, hidden_size) * 0.02 if dummy else load_tensor(model_config.path, name)
            return value.to(device, torch.float32)

        head = tensor(config.head, len(config.labels or ()))
        projection = tensor(config.projection, getattr(model_config.hf_config, "dim", 128))
        dense = None
        if config.dense:
            folders = [Path(model_config.path) / folder for folder in config.dense]
            dense = nn.Sequential(*map(dense_module, folders)).to(device, torch.float32)
        classify = model.classify if config.is_classifier and isinstance(model, SupportsClassification) else None
        return cls(config, head, classify, projection, dense)

    def remove(self, request_id: str) -> None:
        self.partial.pop(request_id, None)

    def pool(self, hidden_states: torch.Tensor, batch: Batch, query_start: list[int],
             completing: list[int]) -> dict[str, torch.Tensor]:
        """Take this step's rows of every pooling request; return the output of those whose
        prompt it completes (``completing``: their indices in ``batch.requests``)."""
        completed = set(completing)
        outputs = {}
        whole = []  # embed requests whose whole prompt is in this step: pooled together
        for index, request in enumerate(batch.requests):
            if request.pooling_params is None:
                continue
            if (index in completed and request.num_computed_tokens == 0 and request.pooling_params.task == "embed"
                    and self.config.custom is None):
                whole.append(index)
                continue
            rows = hidden_states[query_start[index]:query_start[index + 1]]
            request_id = request.request_id
            part = self._carry(request, rows, self.partial.pop(request_id, None))
            if index in completed:
                outputs[request_id] = self._output(request, rows, part)
            else:
                self.partial[request_id] = part
        if whole:
            outputs.update(self._embed_whole(hidden_states, batch, np.asarray(query_start), whole))
        return outputs

    def _embed_whole(self, hidden_states: torch.Tensor, batch: Batch, query_start: np.ndarray,
                     indices: list[int]) -> dict[str, torch.Tensor]:
        """The embeddings of prompts this step computes whole, in a few batched ops instead of a
        few per request: one gather (last, CLS) or one segment sum (mean) over the step's rows."""
        rows = np.asarray(indices)
        starts, ends = query_start[rows], query_start[rows + 1]
        device = hidden_states.device
        if self.config.pooling_type == "mean":
            # Each row's position among `indices`; the rows of other requests go to a last, dropped sum.
            lengths = ends - starts
            firsts = np.cumsum(lengths) - lengths  # each prompt's first row among the selected ones
            token_rows = np.repeat(starts - firsts, lengths) + np.arange(int(lengths.sum()))
            segments = np.full(hidden_states.shape[0], len(indices), dtype=np.int64)
            segments[token_rows] = np.repeat(np.arange(len(indices)), lengths)
            sums = torch.zeros(len(indices) + 1, hidden_states.shape[1], dtype=torch.float32, device=device)
            sums.index_add_(0, torch.from_numpy(segments).to(device, non_blocking=True), hidden_states.float())
            counts = torch.from_numpy(lengths.astype(np.float32)).to(device, non_blocking=True)
            embeddings = sums[:-1] / counts[:, None]
        else:
            picked = starts if self.config.pooling_type == "cls" else ends - 1
            embeddings = hidden_states[torch.from_numpy(picked).to(device, non_blocking=True)].float()
        if self.dense is not None:
            embeddings = self.dense(embeddings)
        requests = [batch.requests[index] for index in indices]
        plain = all(r.pooling_params.dimensions is None and r.pooling_params.normalize is None for r in requests)
        if plain and self.config.normalize:
            embeddings = F.normalize(embeddings, dim=-1)
        if plain:
            return {request.request_id: embedding for request, embedding in zip(requests, embeddings)}
        return {request.request_id: self._finish_embedding(request, embedding)
                for request, embedding in zip(requests, embeddings)}

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
        if params.task == "encode" and self.projection is not None:
            return F.normalize(torch.cat(part) @ self.projection.T, dim=-1)
        if params.task == "encode":
            return torch.cat(part)
        if params.task in ("classify", "score"):
            logits = self.head @ rows[-1].float() if self.head is not None else self.classify(rows).float()
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
        if self.dense is not None:
            embedding = self.dense(embedding)
        return self._finish_embedding(request, embedding)

    def _finish_embedding(self, request: CachedRequestState, embedding: torch.Tensor) -> torch.Tensor:
        """A pooled embedding cut to the request's ``dimensions`` and normalized if it asks."""
        params = request.pooling_params
        if params.dimensions is not None:
            embedding = embedding[:params.dimensions]
        if self.config.normalize if params.normalize is None else params.normalize:
            embedding = F.normalize(embedding, dim=-1)
        return embedding


def dense_module(folder: Path) -> nn.Module:
    """A sentence-transformers ``Dense`` module saved in ``folder``: its linear layer (weights
    from ``model.safetensors``, or an older release's ``pytorch_model.bin``) and its activation,
    a ``torch.nn`` class named in its config (Tanh when unnamed, as sentence-transformers has it)."""
    config = json.loads((folder / "config.json").read_text())
    activation = config.get("activation_function") or "torch.nn.modules.activation.Tanh"
    module_name, _, class_name = activation.rpartition(".")
    if not module_name.startswith("torch.nn"):
        raise ValueError(f"{folder}: activation {activation!r} is not a torch.nn module")
    linear = nn.Linear(config["in_features"], config["out_features"], bias=config.get("bias", True))
    weights_file = folder / "model.safetensors"
    weights = (load_file(str(weights_file)) if weights_file.exists()
               else torch.load(folder / "pytorch_model.bin", map_location="cpu", weights_only=True))
    linear.load_state_dict({name.removeprefix("linear."): tensor for name, tensor in weights.items()})
    return nn.Sequential(linear, getattr(importlib.import_module(module_name), class_name)())
