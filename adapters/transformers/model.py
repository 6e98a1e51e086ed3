"""``TransformersForCausalLM``: any transformers causal LM behind hookllm's model contract.

The transformers class named by the checkpoint is built from its config with
``attn_implementation="hookllm"`` (see :mod:`.attention`): one paged ``Attention`` per attention
module carries the KV cache, and everything else (embeddings, RoPE variants, norms, MLPs, MoE
blocks, the LM head and its logit scaling) is transformers' own code. The flat batch goes in as
one sequence of ``T`` tokens (``input_ids[None]``, ``position_ids=positions[None]``); the paged
attention keeps the sequences apart. Under pipeline parallelism each stage builds, loads and runs
only its layers (:mod:`.pipeline`).
"""

from __future__ import annotations

import contextlib
import copy
import os
from typing import Any, Iterable, Iterator

import torch
from torch import nn

from hookllm.adapters.transformers import attention, lora, parallel, support
from hookllm.adapters.transformers.pipeline import StageCut
from hookllm.adapters.transformers.kernels import head_alone, use_hookllm_modules
from hookllm.adapters.transformers.weights import build_empty, load_checkpoint_tensors, materialize
from hookllm.distributed import get_pp_size, get_tp_size
from hookllm.hub.default_model import cache_dir
from hookllm.lora.layers import LoRAProjection


class TransformersForCausalLM(nn.Module):
    """A Hugging Face causal LM on hookllm's paged attention; built under ``building_on``
    (its device and dtype are the current defaults)."""

    supports_torch_compile = True
    supports_tensor_parallel = True  # split as the config's transformers plan says (.parallel)
    supports_pipeline_parallel = True  # cut into stages at the decoder's layer list (.pipeline)
    pipeline_intermediate_count = 1  # transformers' layers keep the residual inside

    def __init__(self, config: Any):
        super().__init__()
        model_cls = support.model_class(config)
        config = copy.deepcopy(config)  # the engine's copy keeps its attention implementation
        # Training-only outputs the head would otherwise read from the decoder.
        config.use_cache = False
        config.output_router_logits = False
        attention.register()
        dtype = torch.get_default_dtype()
        self.hf_model = build_empty(model_cls, config, dtype)
        support.check_structure(self.hf_model)
        # The decoder the CausalLM's forward calls before its head (OPT's model.decoder, most
        # models' model): forward runs it, compute_logits stands in for it.
        decoder = self.hf_model.get_decoder()
        path = next((p for p, m in self.hf_model.named_modules() if m is decoder), "")
        if not path:
            raise support.Unsupported(f"{model_cls.__name__}: no decoder module to run without its LM head")
        self._decoder_parent, _, self._decoder_name = path.rpartition(".")
        self.stage = StageCut(self.hf_model, decoder, config.num_hidden_layers) if get_pp_size() > 1 else None
        # Each rank keeps its slice of the split weights, so storage and loading are per slice.
        parallel.shard(self.hf_model)
        materialize(self.hf_model, dtype)
        # One paged layer per attention module, in layer_idx order, as transformers' code calls it.
        self._decoder_hidden_states = self._run_decoder  # compiled by use_torch_compile
        first_layer = self.stage.start if self.stage is not None else 0
        specs = attention.probe(self.hf_model, self._probe_forward, first_layer)
        self.attention = nn.ModuleList(attention.PagedLayer(spec) for spec in specs)
        self._head_input = StandIn()
        self._head_alone = False  # whether the logits are the output embeddings' alone (set by load_weights)
        self._route = attention.PagedRoute(self.attention, first_layer)

    @property
    def decoder(self) -> nn.Module:
        """The transformers decoder: the model without its LM head."""
        return self.hf_model.get_submodule(self._decoder_parent)._modules[self._decoder_name]

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.hf_model.get_input_embeddings()(input_ids)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, inputs_embeds: torch.Tensor | None = None,
                intermediate_tensors: torch.Tensor | None = None) -> torch.Tensor:
        with attention.routed_to(self._route), _graph_capture_hint(type(self.hf_model).__name__):
            return self._forward_layers(input_ids, positions, inputs_embeds, intermediate_tensors)

    def _forward_layers(self, input_ids: torch.Tensor, positions: torch.Tensor, inputs_embeds: torch.Tensor | None,
                        intermediate: torch.Tensor | None) -> torch.Tensor:
        if self.stage is None:
            return self._decoder_hidden_states(input_ids, positions, inputs_embeds)
        return self.stage.run(self._decoder_hidden_states, input_ids, positions, inputs_embeds, intermediate)

    def _probe_forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> None:
        """A forward of this stage's layers on ``input_ids`` (zeros from the previous stage)."""
        intermediate = None
        if self.stage is not None and not self.stage.is_first:
            intermediate = torch.zeros(1, input_ids.shape[0], self.hf_model.config.hidden_size)
        self._forward_layers(input_ids, positions, None, intermediate)

    def _run_decoder(self, input_ids: torch.Tensor, positions: torch.Tensor,
                     inputs_embeds: torch.Tensor | None) -> torch.Tensor:
        inputs = {"input_ids": input_ids[None]} if inputs_embeds is None else {"inputs_embeds": inputs_embeds[None]}
        return self.decoder(**inputs, position_ids=positions[None], use_cache=False)[0][0]

    def use_torch_compile(self, backend: str = "inductor") -> None:
        """Run the decoder through torch.compile (the worker calls this when CUDA graphs are on):
        inductor fuses the elementwise work transformers' code spreads over many small kernels.
        Shapes are dynamic, so one graph serves every token count (and one more for a single
        token); the CUDA-graph warm-up compiles them before any request. Under tensor parallelism
        the decoder stays eager, its collectives outside any trace.

        Inductor's compiled code (its FX graph and autograd caches, and Triton's kernels under
        them) is kept under hookllm's cache root, ``inductor/`` there, unless
        ``TORCHINDUCTOR_CACHE_DIR`` names another place: a restart, or a machine whose temporary
        folder was cleared, loads it instead of compiling again."""
        if get_tp_size() == 1:
            self._decoder_hidden_states = compile_dynamic(self._run_decoder, backend)

    def lora_projections(self) -> list[LoRAProjection]:
        """The decoder layers' projections for LoRA adapters (:mod:`.lora`)."""
        decoder_path = f"{self._decoder_parent}.{self._decoder_name}".lstrip(".")
        return lora.lora_projections(self.hf_model, self.decoder, decoder_path)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """The LM head and whatever transformers' CausalLM does after it (Gemma 2's final
        soft-cap, Cohere's ``logit_scale``, Granite's ``logits_scaling``...); see :meth:`load_weights`."""
        if self._head_alone:  # looked up at each call: a LoRA wrapper may have taken the head's place
            return self.hf_model.get_output_embeddings()(hidden_states)
        return self._causal_lm_logits(hidden_states)

    def _causal_lm_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """The transformers CausalLM's own forward with its decoder standing in for the given
        hidden states, so its head runs as transformers wrote it."""
        parent = self.hf_model.get_submodule(self._decoder_parent)
        return self._head_input.run(self.hf_model, parent, self._decoder_name, hidden_states[None],
                                    use_cache=False).logits[0]

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        """Whole checkpoint tensors, named as transformers names them (see :mod:`.weights`);
        then hookllm's kernels take over the modules they compute exactly (:mod:`.kernels`), and
        when the CausalLM's forward computes its LM head alone, the head runs without it (the
        forward costs the host about as much as a decode step's sampling)."""
        load_checkpoint_tensors(self.hf_model, weights)
        use_hookllm_modules(self.hf_model)
        self._head_alone = head_alone(self.hf_model.get_output_embeddings(), self._causal_lm_logits) is not None


def compile_dynamic(fn: Any, backend: str) -> Any:
    """``fn`` through torch.compile with dynamic shapes, inductor's caches under hookllm's cache
    root (``inductor/``) unless ``TORCHINDUCTOR_CACHE_DIR`` names another place."""
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache_dir() / "inductor"))
    return torch.compile(fn, backend=backend, dynamic=True)


class StandIn(nn.Module):
    """Stands in for a transformers base model (a CausalLM's decoder, a classifier's encoder), so
    that what runs after it (the LM head, a classification head) runs as transformers wrote it
    on given hidden states: it returns them, and the base model's own ``pooler`` over them where
    it has one (BERT's dense + tanh of the CLS token)."""

    def __init__(self, pooler: nn.Module | None = None) -> None:
        super().__init__()
        self.pooler = pooler
        self.hidden_states: torch.Tensor | None = None

    def forward(self, *args: Any, **kwargs: Any) -> "HiddenStatesOutput":
        pooled = self.pooler(self.hidden_states) if self.pooler is not None else None
        return HiddenStatesOutput(self.hidden_states, pooled)

    def run(self, model: nn.Module, parent: nn.Module, name: str, hidden_states: torch.Tensor, **kwargs: Any) -> Any:
        """``model(**kwargs)`` with ``parent``'s submodule ``name`` replaced by this stand-in,
        which returns ``hidden_states`` (``[1, tokens, hidden]``)."""
        modules = parent._modules
        original = modules[name]
        modules[name], self.hidden_states = self, hidden_states
        try:
            return model(**kwargs)
        finally:
            modules[name], self.hidden_states = original, None


class HiddenStatesOutput:
    """What a stand-in for a transformers base model returns: ``outputs[0]`` or
    ``outputs.last_hidden_state``, and ``outputs[1]`` or ``outputs.pooler_output`` where it is
    given (BERT's); any other field is None."""

    def __init__(self, last_hidden_state: torch.Tensor, pooler_output: torch.Tensor | None = None):
        self.last_hidden_state = last_hidden_state
        self.pooler_output = pooler_output

    def __getitem__(self, index: int | slice) -> Any:
        fields = (self.last_hidden_state,) if self.pooler_output is None else (self.last_hidden_state, self.pooler_output)
        return fields[index]

    def __getattr__(self, name: str) -> None:
        return None


@contextlib.contextmanager
def _graph_capture_hint(architecture: str) -> Iterator[None]:
    """A forward that fails while a CUDA graph is being captured fails because transformers'
    code synchronizes with the host there: say so, and how to run such a model."""
    try:
        yield
    except RuntimeError as exc:
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"{architecture}: transformers' code cannot run inside a CUDA graph ({exc}); "
                               "start the engine with --enforce-eager") from exc
        raise
