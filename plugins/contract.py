"""What an adapter's model class must offer the core: :class:`ModelProtocol`.

The worker builds the class from the checkpoint's HF config, feeds ``load_weights`` the
checkpoint's tensors, runs ``forward`` on each step's flat batch and ``compute_logits`` on the
rows that sample; a multimodal model also implements :class:`SupportsMultiModal` (its encoder,
its placeholders, how its rows join the token embeddings), and the core runs the encoder and
keeps its outputs (:mod:`hookllm.multimodal`). Check a class with :func:`contract_violations`.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Iterable, Literal, Protocol, Sequence, runtime_checkable

if TYPE_CHECKING:
    import torch

    from hookllm.lora.layers import LoRAProjection
    from hookllm.sched.request import MultiModalItem


@runtime_checkable
class ModelProtocol(Protocol):
    """A ``torch.nn.Module`` over a flat batch: no batch dimension, no attention mask (the
    attention layers read the paged-cache metadata from the forward context)."""

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """``[num_tokens]`` ids and positions (or ``[num_tokens, hidden]`` embeddings instead of
        the ids) -> ``[num_tokens, hidden]`` hidden states."""

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``[num_tokens]`` -> ``[num_tokens, hidden]``: the token embedding."""

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """``[rows, hidden]`` -> ``[rows, vocab]``."""

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        """Copy ``(checkpoint name, tensor)`` pairs into the parameters; a missing or unexpected
        tensor is an error."""

    # What the class opts into, as class attributes (these are the defaults). The core reads
    # them with :func:`capability`, so a class need not subclass the protocol to have them.
    supports_tensor_parallel: ClassVar[bool] = False
    """Its layers split across tensor-parallel ranks (hookllm.layers' parallel ones) and its
    ``load_weights`` takes each rank's slices of the checkpoint's tensors."""
    supports_expert_parallel: ClassVar[bool] = False
    """Its MoE layers place whole experts per rank under ``enable_expert_parallel``."""
    supports_quantization: ClassVar[bool] = False
    """Its linear and MoE layers take a quantization method's parameters and matmul."""
    supports_torch_compile: ClassVar[bool] = False
    """It has ``use_torch_compile()``, called before the CUDA-graph warm-up when ``torch_compile`` is on."""
    supports_pipeline_parallel: ClassVar[bool] = False
    """Built for one pipeline stage (:func:`hookllm.distributed.stage_layer_range`): only that
    stage's layers (the first also the embedding, the last the final norm and the head), its
    ``load_weights`` skipping the rest; ``forward`` takes ``intermediate_tensors`` (what the
    previous stage returned, None on the first) and returns, on every stage but the last, a
    ``[pipeline_intermediate_count, num_tokens, hidden]`` tensor for the next."""
    pipeline_intermediate_count: ClassVar[int] = 2
    """How many ``[num_tokens, hidden]`` tensors a pipeline stage hands the next: by default the
    hidden states and the residual."""
    uses_token_types: ClassVar[bool] = False
    """It reads token types (a BERT-style encoder's segments) from the forward context's
    ``token_type_ids``, which the runner sets when a step holds a text pair that has them."""
    is_speculative_head: ClassVar[bool] = False
    """A speculative decoding head (an EAGLE-3 head), loaded only as ``speculative_config``'s
    ``model`` beside its target: serving it alone is refused."""

    @classmethod
    def __subclasshook__(cls, other: type) -> bool:
        # Structural on the methods alone: the flags have defaults, so a class need not set them
        # (typing refuses issubclass() for protocols with data members otherwise).
        if cls is not ModelProtocol:
            return NotImplemented
        return all(callable(getattr(other, name, None)) for name in _METHODS) or NotImplemented


_METHODS = ("forward", "embed_tokens", "compute_logits", "load_weights")
Capability = Literal["supports_tensor_parallel", "supports_expert_parallel", "supports_quantization",
                     "supports_torch_compile", "supports_pipeline_parallel", "pipeline_intermediate_count",
                     "uses_token_types", "is_speculative_head"]


def capability(model: Any, flag: Capability) -> Any:
    """A :class:`ModelProtocol` class attribute of ``model`` (a class or an instance), a
    capability flag or a setting: its own value, else the protocol's default."""
    return getattr(model, flag, getattr(ModelProtocol, flag))


@dataclass(frozen=True)
class Placeholder:
    """How one media item sits in a prompt: ``num_rows`` copies of ``token_id``, one per
    embedding row the encoder makes of it."""

    token_id: int
    num_rows: int


@runtime_checkable
class SupportsLoRA(Protocol):
    """A :class:`ModelProtocol` model that names the projections LoRA adapters may target, for
    ``enable_lora``. Without it the core finds hookllm's parallel linear layers under
    ``model.layers.*`` (the native decoders: ``qkv_proj`` and ``gate_up_proj`` each one fused
    projection of the PEFT modules q/k/v and gate/up)."""

    def lora_projections(self) -> list[LoRAProjection]:
        """Each projection to wrap: where it is (parent module and attribute), and which PEFT
        module names its output columns are, in order."""


@runtime_checkable
class SupportsAuxHiddenStates(Protocol):
    """A :class:`ModelProtocol` model that can keep the residual stream entering chosen layers,
    for an EAGLE-3 head (``speculative_config`` ``method`` ``eagle3``), which reads three of them.
    Only the native decoders (``hookllm.adapters.llama`` and the families built on it) opt in."""

    def keep_aux_hidden_states(self, layers: Sequence[int], max_tokens: int) -> torch.Tensor:
        """From now on, each forward writes the residual stream entering each of ``layers`` (the
        embeddings for layer 0) into the returned buffer ``[max_tokens, len(layers) * hidden]``,
        its first rows the step's tokens, in the order given: a write inside the forward, so
        CUDA graphs capture it."""


@runtime_checkable
class SupportsMultiModal(Protocol):
    """A :class:`ModelProtocol` model whose prompts hold media items (images, ...), each turned
    into embedding rows by its encoder. Subclass it (``class M(nn.Module, SupportsMultiModal)``)
    to inherit the flag and the default merge.

    The core's part (:mod:`hookllm.multimodal`): the default ``load_model`` builds the class as
    ``cls(hf_config, text_model_cls)``, the text decoder being the class registered for
    ``hf_config.text_config``'s architecture; the model runner works out which rows of which
    items each step needs (a chunked prefill may cut an item), runs ``embed_multimodal`` once per
    distinct item (by content hash) for all of a step's new items together, keeps the result
    while a live request uses it, and hands each step's rows to ``merge_multimodal_embeddings``.
    The adapter's part: the methods below, and a ``preprocess_request`` hook that turns
    ``multi_modal_data`` into ``mm_items`` and expands the prompt's placeholders
    (:func:`hookllm.multimodal.expand_placeholders`).
    """

    supports_multimodal: ClassVar[Literal[True]] = True

    @classmethod
    def placeholder(cls, hf_config: Any, modality: str) -> Placeholder:
        """The prompt token and row count of one item of ``modality``."""

    def embed_multimodal(self, items: Sequence[MultiModalItem]) -> Sequence[torch.Tensor]:
        """The encoder: one ``[item.length, hidden]`` tensor per item (``item.data`` as the
        adapter's ``preprocess_request`` left it, on the host), in one batched call."""

    def merge_multimodal_embeddings(self, inputs_embeds: torch.Tensor, rows: torch.Tensor,
                                    embeddings: torch.Tensor) -> torch.Tensor:
        """``embed_tokens``' output for the step ``[num_tokens, hidden]``, the flat rows its items
        fill ``[n]`` and their embedding rows ``[n, hidden]`` -> the step's input embeddings.
        By default the item rows replace the placeholders' token embeddings."""
        inputs_embeds[rows] = embeddings.to(inputs_embeds.dtype)
        return inputs_embeds


@runtime_checkable
class SupportsClassification(Protocol):
    """A pooling model with its own classification head (an encoder's ``*ForSequenceClassification``,
    whose head pools as it was trained to): the pooler hands it a prompt's hidden states, all
    computed in one step, for the ``classify`` and ``score`` tasks. Without it, the checkpoint's
    ``score.weight`` is applied to the last token (a decoder classifier)."""

    def classify(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """``[prompt tokens, hidden]`` of one prompt -> its ``[labels]`` logits."""


def is_multimodal(model_cls: type) -> bool:
    """Whether ``model_cls`` implements :class:`SupportsMultiModal` (says so by its flag)."""
    return getattr(model_cls, "supports_multimodal", False) is True


def contract_violations(model_cls: type) -> list[str]:
    """How ``model_cls`` departs from :class:`ModelProtocol`: each member it lacks, or whose
    parameters (names, in order, and which have defaults) differ (a pipeline-parallel class's
    ``forward`` ends with ``intermediate_tensors=None``). Empty when it conforms."""
    problems = []
    for name in _METHODS:
        member = getattr(model_cls, name, None)
        if not callable(member):
            problems.append(f"{model_cls.__name__} has no method {name}")
            continue
        want = _parameters(getattr(ModelProtocol, name))
        if name == "forward" and capability(model_cls, "supports_pipeline_parallel"):
            want.append(("intermediate_tensors", True))
        got = _parameters(member)
        if got != want:
            problems.append(f"{model_cls.__name__}.{name}{_show(got)} should take {_show(want)}")
    return problems


def _parameters(function: Any) -> list[tuple[str, bool]]:
    """(name, has a default) of each parameter after ``self``."""
    params = list(inspect.signature(function).parameters.values())[1:]
    return [(p.name, p.default is not inspect.Parameter.empty) for p in params]


def _show(params: list[tuple[str, bool]]) -> str:
    return "(" + ", ".join(name + ("=..." if default else "") for name, default in params) + ")"
