"""Engine and model configuration, resolved once when an engine starts."""

from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from hookllm.pooling_params import PoolerConfig

if TYPE_CHECKING:
    from hookllm.sched.kv_events import KVEventsConfig
    from hookllm.spec.config import SpeculativeConfig

DTYPES = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
}
LOAD_FORMATS = ("auto", "safetensors", "dummy")
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")  # auto: the model dtype; fp8 is e4m3 (vLLM's names)
PREEMPTION_MODES = ("recompute", "swap")
EXECUTOR_BACKENDS = ("uni", "mp", "ray")
# "transformers" is the bundled fallback plugin (hookllm.adapters.transformers; docs/models.md).
MODEL_IMPLS = ("auto", "native", "transformers")


def resolve_device(device: str | torch.device) -> torch.device:
    """"auto" is the current GPU if there is one, else the CPU; a bare "cuda" gets its index."""
    if str(device) == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    """"auto" is bf16 on a GPU and fp32 on the CPU."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; use auto or one of {', '.join(DTYPES)}")
    return DTYPES[dtype]


def load_hf_config(path: str | Path) -> Any:
    """The checkpoint's config: a transformers config when transformers knows the model type."""
    from transformers import AutoConfig, PretrainedConfig

    config_file = Path(path) / "config.json"
    if not config_file.exists():
        raise ValueError(f"{path} is not a model folder: it has no config.json")
    try:
        return AutoConfig.from_pretrained(str(path))
    except (ValueError, KeyError):
        # A model type transformers doesn't know (a third-party plugin's): keep the raw fields.
        return PretrainedConfig.from_dict(json.loads(config_file.read_text()))


def is_encoder(hf_config: Any) -> bool:
    """Whether the checkpoint is an encoder-only model (BERT, RoBERTa / XLM-R, ModernBERT...):
    one whose model type transformers gives a masked LM, encoder-decoders aside."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_MASKED_LM_MAPPING_NAMES

    return (getattr(hf_config, "model_type", None) in MODEL_FOR_MASKED_LM_MAPPING_NAMES
            and not getattr(hf_config, "is_encoder_decoder", False))


# ColBERT checkpoints as the colbert-ai library saves them (a BERT and a `linear` projection).
COLBERT_ARCHITECTURE = "HF_ColBERT"


def base_model_architecture(hf_config: Any) -> str:
    """The transformers base model class name of the checkpoint's model type (``BertModel``)."""
    from transformers.models.auto.modeling_auto import MODEL_MAPPING_NAMES

    name = MODEL_MAPPING_NAMES.get(getattr(hf_config, "model_type", None), "")
    return name if isinstance(name, str) else name[0]


def position_offset(hf_config: Any) -> int:
    """Where an encoder's position ids start: ``pad_token_id + 1`` for the RoBERTa family, whose
    transformers code numbers positions after the padding index (its embeddings'
    ``create_position_ids_from_input_ids``), else 0."""
    import sys

    import transformers

    model_cls = getattr(transformers, base_model_architecture(hf_config), None)
    if model_cls is None:
        return 0
    module = sys.modules[model_cls.__module__]
    after_padding = any(isinstance(obj, type) and hasattr(obj, "create_position_ids_from_input_ids")
                        for obj in vars(module).values())
    return hf_config.pad_token_id + 1 if after_padding else 0


def text_config_of(hf_config: Any) -> Any:
    """The decoder's config (a multimodal config nests it as ``text_config``)."""
    return getattr(hf_config, "text_config", None) or hf_config


def layer_sliding_windows(text_config: Any) -> list[int | None]:
    """Each decoder layer's sliding window in tokens (the query itself included), None for a
    layer attending to its whole prefix.

    transformers 5 configs list ``layer_types`` ("sliding_attention" layers use ``sliding_window``;
    Gemma 2/3, gpt-oss, Qwen2 with ``use_sliding_window``); configs without it (Mistral v0.1, a
    raw config) give every layer ``sliding_window`` unless ``use_sliding_window`` is false.
    """
    window = getattr(text_config, "sliding_window", None)
    layer_types = getattr(text_config, "layer_types", None)
    if layer_types is not None:
        return [window if kind == "sliding_attention" else None for kind in layer_types]
    if getattr(text_config, "use_sliding_window", True) is False:
        window = None
    # A third-party config may name no layer count: one entry then stands for every layer.
    return [window] * getattr(text_config, "num_hidden_layers", 1)


@dataclass
class ModelConfig:
    path: str
    hf_config: Any
    architecture: str
    dtype: torch.dtype
    max_model_len: int
    plugin: str | None = None  # the plugin whose registered class serves ``architecture``
    load_format: str = "auto"  # EngineConfig.load_format: "dummy" loads random weights
    # The hookllm.plugins.quantization.QuantizationMethod serving the checkpoint, if any.
    quantization: Any = None
    runner: str = "generate"  # EngineConfig.runner, resolved: "generate" or "pooling"
    pooler: PoolerConfig | None = None  # how the pooling runner pools (None when generating)
    spec_proposer: Any = None  # the proposer class speculative_config's method names (None: no speculation)
    spec_draft: "ModelConfig | None" = None  # the checkpoint of a proposer's own model (speculative_config's model)
    weight_prefix: str = ""  # put before every checkpoint tensor's name (a bare base model's: "model.")
    # An encoder (bidirectional attention): pooling only, each prompt computed in one step.
    encoder: bool = False

    @classmethod
    def from_path(cls, path: str, dtype: torch.dtype, max_model_len: int | None,
                  runner: str = "auto") -> "ModelConfig":
        hf_config = load_hf_config(path)
        architectures = getattr(hf_config, "architectures", None) or []
        if not architectures:
            raise ValueError(f"{path}/config.json names no architectures")
        text = text_config_of(hf_config)
        encoder = is_encoder(hf_config)
        limit = getattr(text, "max_position_embeddings", None) or getattr(text, "n_positions", None)
        if limit and encoder:
            limit -= position_offset(hf_config)
        if max_model_len is None:
            max_model_len = limit or 2048
        elif limit and max_model_len > limit:
            raise ValueError(f"max_model_len {max_model_len} exceeds the model's {limit} positions")
        architecture, weight_prefix = architectures[0], ""
        classifier = architecture.endswith("ForSequenceClassification")
        if architecture == COLBERT_ARCHITECTURE and encoder:
            # ColBERT's own format: its encoder's base model, whose tokens a `linear` layer
            # projects for late interaction (the pooler's).
            architecture = base_model_architecture(hf_config)
            pooler = PoolerConfig("cls", True, projection="linear.weight")
        elif classifier:
            pooler = PoolerConfig.classifier(hf_config, own_head=encoder)
        else:
            pooler = PoolerConfig.for_checkpoint(path, hf_config)
        if runner == "auto":
            runner = "pooling" if pooler is not None or encoder else "generate"
        if (classifier or encoder) and runner != "pooling":
            kind = "a classifier" if classifier else "an encoder"
            raise ValueError(f"{architecture} is {kind}: it runs with the pooling runner (LLM.embed, LLM.classify, "
                             "LLM.score), not --runner generate")
        if runner == "pooling":
            pooler = pooler or PoolerConfig.default(hf_config, encoder)
        # A decoder pools through its causal LM class; an encoder keeps its architecture (transformers'
        # own class serves it, head and all: hookllm.adapters.transformers.encoder).
        if runner == "pooling" and not encoder:
            if classifier:
                # Its decoder is the causal LM's, under the same names; its head (score.weight) is
                # the pooler's, and it has no LM head of its own.
                architecture = architecture[:-len("ForSequenceClassification")] + "ForCausalLM"
                text.tie_word_embeddings = True
            elif architecture.endswith("Model") and not architecture.endswith("PreTrainedModel"):
                # sentence-transformers saves a decoder's base model (LlamaModel, tensors named
                # without "model."): its causal LM class serves it, the head tied to the
                # embedding (it has none of its own, and the pooling runner computes no logits).
                architecture, weight_prefix = architecture[:-len("Model")] + "ForCausalLM", "model."
                text.tie_word_embeddings = True
        if architecture != architectures[0]:
            hf_config.architectures = [architecture]  # what the model class builds
        return cls(str(path), hf_config, architecture, dtype, int(max_model_len), runner=runner,
                   pooler=pooler if runner == "pooling" else None, weight_prefix=weight_prefix, encoder=encoder)


def _option(default: Any, help: str, **extra: Any) -> Any:
    """A config field with its command-line help (the CLI's engine flags are generated from these)."""
    kwargs = {"default_factory": default} if callable(default) else {"default": default}
    return field(metadata={"help": help, **extra}, **kwargs)


@dataclass
class EngineConfig:
    """Everything an engine (and a worker started elsewhere) needs to rebuild the same setup.

    Each field is a flag of ``hookllm generate`` and ``hookllm serve`` (``max_num_seqs`` ->
    ``--max-num-seqs``), generated by :class:`hookllm.engine.arg_utils.EngineArgs`.
    """

    model: str = _option(None, "a local folder (config.json + safetensors) or a Hugging Face hub id "
                               "(Qwen/Qwen3-0.6B); default: SmolLM2-135M-Instruct")
    plugins: list[str] = _option(list, "activate an installed plugin (repeatable)", flag="--plugin", metavar="NAME")
    pooler: str | None = _option(None, "the pooling runner's pooling: last, mean, cls, or a plugin's pooler "
                                 "(hookllm plugins lists them); default: the checkpoint's (its sentence-transformers "
                                 "pipeline), else last")
    runner: str = _option("auto", "generate tokens, or pool hidden states (embeddings: LLM.embed, /v1/embeddings); "
                          "auto: pooling for an encoder, a classifier or a checkpoint with a sentence-transformers "
                          "pipeline (modules.json)",
                          choices=["auto", "generate", "pooling"])
    model_impl: str = _option("auto", "which implementation serves the checkpoint's architecture: auto (a plugin's "
                              "native one, else the transformers fallback), native, or transformers (the "
                              "transformers modeling backend, for any causal LM)", choices=list(MODEL_IMPLS))
    dtype: str = _option("auto", "weights and activations dtype: auto (bf16 on GPU, fp32 on CPU), float32, bfloat16, float16")
    device: str = _option("auto", "auto, cpu, cuda or cuda:N")
    max_model_len: int | None = _option(None, "longest prompt + output in tokens (default: the model's positions)")
    block_size: int = _option(16, "tokens per KV-cache block")
    max_num_seqs: int = _option(256, "most requests in one step")
    max_num_batched_tokens: int = _option(8192, "most tokens in one step (prefill chunks + decodes)")
    num_kv_blocks: int | None = _option(None, "KV-cache blocks (default: sized from memory)")
    gpu_memory_utilization: float = _option(0.9, "share of GPU memory for weights, activations and KV cache")
    cpu_kv_cache_bytes: int = _option(1 << 30, "KV-cache bytes on the CPU")
    attention_backend: str = _option("auto", "attention kernels", choices=["auto", "torch", "triton"])
    enforce_eager: bool = _option(False, "CUDA: no CUDA graphs (and no torch.compile)")
    torch_compile: bool = _option(True, "CUDA graphs on: a model class that sets supports_torch_compile (the "
                                  "transformers backend) runs its forward through torch.compile, which fuses "
                                  "the small kernels between its matmuls")
    max_cuda_graph_batch_size: int = _option(512, "largest decode batch captured in a CUDA graph")
    max_cuda_graph_tokens: int = _option(8192, "CUDA: steps with prefill of up to this many tokens also run as CUDA "
                                         "graphs, padded to token buckets (0: they run eagerly)")
    warmup: bool = _option(True, "CUDA: at start-up, run synthetic steps that compile every kernel variant and "
                           "replay every CUDA graph, so no request waits for a compile")
    # Schedule step n+1 while the device runs step n (outputs lag one step).
    async_scheduling: bool | None = _option(None, "schedule the next step while the device runs this one (default: on for CUDA)")
    seed: int = _option(0, "seed of the engine's sampling generator")
    max_logprobs: int = _option(20, "most logprobs or prompt_logprobs a request may ask for (vLLM's limit)")
    enable_prefix_caching: bool = _option(True, "reuse the KV blocks of prompt prefixes already computed (automatic prefix caching)")
    # Given as a JSON string (the flag) or a dict; __post_init__ parses it.
    kv_events_config: KVEventsConfig | str | dict | None = _option(
        None, "publish KV-cache events (blocks entering and leaving the prefix cache) in vLLM's format, for "
        "prefix-aware routers: a JSON object with enable_kv_cache_events, publisher (zmq or null), endpoint "
        "(default tcp://*:5557) and topic (default \"\"), e.g. '{\"enable_kv_cache_events\": true}'")
    tokenizer: str | None = _option(None, "tokenizer folder (default: the model's)")
    tensor_parallel_size: int = _option(1, "GPUs (one worker process each) the model's layers are split across")
    pipeline_parallel_size: int = _option(1, "stages the decoder layers are cut into, each run by tensor_parallel_size "
                                          "ranks of its own (HOOKLLM_PP_LAYER_PARTITION=\"10,12\" sets each stage's count)")
    data_parallel_size: int = _option(1, "hookllm serve: engine processes (each a whole engine, with its own "
                                      "tensor_parallel_size GPUs) behind the API server; each request goes to the "
                                      "least busy one")
    enable_expert_parallel: bool = _option(False, "MoE models: each of the tensor_parallel_size ranks holds whole "
                                           "experts (a share of them) instead of a slice of every expert")
    distributed_executor_backend: str | None = _option(
        None, "where the model runs: uni, in the engine's process (one rank only), or mp, a process per rank, "
        "which at tensor_parallel_size 1 runs the worker's host work (inputs, launches) beside the scheduler's "
        "and the output processing, or ray, a Ray actor per rank on a running Ray cluster (pip install "
        "'hookllm[ray]') (default: uni for one rank, mp for several)", choices=list(EXECUTOR_BACKENDS))
    nnodes: int = _option(1, "hosts one engine's ranks run on (the mp executor): the same command on each, with its "
                          "--node-rank; nodes after the first run --headless")
    node_rank: int = _option(0, "this host's index among the --nnodes (0: the engine and the API server)")
    master_addr: str | None = _option(None, "node 0's address as the other nodes reach it (needed with --nnodes > 1)")
    master_port: int | None = _option(None, "torch.distributed's rendezvous port on node 0; the ranks' step "
                                            "connections use the next port (default: 29500 with --nnodes > 1, "
                                            "a free port on one node)")
    distributed_timeout: float = _option(600.0, "seconds for every node to join, and for the ranks to connect")
    custom_all_reduce: bool = _option(False, "tensor parallelism on CUDA: all-reduces up to 512 KiB through a "
                                      "one-shot kernel over the ranks' CUDA IPC buffers instead of NCCL (off by default "
                                      "until measured on two GPUs)")
    quantization: str | None = _option(None, "quantization method (default: the checkpoint's quant_method); fp8 on "
                                       "an unquantized checkpoint quantizes its linear layers at load")
    kv_cache_dtype: str = _option("auto", "KV-cache dtype: auto (the model dtype) or fp8 (e4m3, with the "
                                  "checkpoint's per-layer K/V scales, else 1.0)", choices=list(KV_CACHE_DTYPES))
    load_format: str = _option("auto", "auto or safetensors: read the checkpoint; dummy: random weights (benchmarks)",
                               choices=list(LOAD_FORMATS))
    preemption_mode: str = _option("recompute", "a preempted request is recomputed, or swapped: its KV blocks "
                                   "wait in host memory and come back as they were", choices=list(PREEMPTION_MODES))
    enable_lora: bool = _option(False, "serve LoRA adapters (PEFT folders) over the base model, many in one batch: "
                                "a request names its adapter (LLM.generate's lora_request, the server's model)")
    max_loras: int = _option(1, "LoRA: most adapters in one batch (the device slots); a request whose adapter has "
                             "no slot waits")
    max_lora_rank: int = _option(16, "LoRA: largest adapter rank served (slots are this wide: smaller ranks are "
                                 "zero-padded)")
    max_cpu_loras: int | None = _option(None, "LoRA: adapters kept in host memory for quick swap-in, least recently "
                                        "used out (default: max_loras)")
    speculative_config: SpeculativeConfig | str | dict | None = _option(
        None, "speculative decoding (vLLM's keys), a JSON object: method (ngram, or a proposer a plugin registers; "
        "`hookllm plugins` lists them), num_speculative_tokens, prompt_lookup_min / prompt_lookup_max (ngram), "
        "disable_by_batch_size, model, e.g. '{\"method\": \"ngram\", \"num_speculative_tokens\": 4}'")
    swap_space: float = _option(4.0, "GiB of host memory (pinned on CUDA) per worker for swapped KV blocks "
                                "(preemption_mode=swap)")

    @property
    def worker_in_own_process(self) -> bool:
        """Whether the model runs in worker processes (``distributed_executor_backend``'s "mp")."""
        return self.world_size > 1 or self.nnodes > 1 or self.distributed_executor_backend in ("mp", "ray")

    @property
    def world_size(self) -> int:
        """Ranks of one engine: tensor-parallel ranks times pipeline stages."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def rendezvous(self) -> str | None:
        """torch.distributed's init URL for the ranks when ``master_port`` fixes it (several
        nodes), else None (one node picks a free port)."""
        if self.master_port is None:
            return None
        return f"tcp://{self.master_addr or '127.0.0.1'}:{self.master_port}"

    def __post_init__(self) -> None:
        if self.model is None:
            from hookllm.hub.default_model import default_model_dir

            self.model = str(default_model_dir())
        self.model = str(self.model)
        if self.block_size <= 0 or self.block_size % 16:
            raise ValueError(f"block_size must be a positive multiple of 16, got {self.block_size}")
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")
        if self.max_cuda_graph_tokens < 0:
            raise ValueError(f"max_cuda_graph_tokens must be >= 0, got {self.max_cuda_graph_tokens}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.max_logprobs < 0:
            raise ValueError(f"max_logprobs must be >= 0, got {self.max_logprobs}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.max_loras < 1 or not 1 <= self.max_lora_rank <= 512:
            raise ValueError(f"max_loras must be >= 1 and max_lora_rank in [1, 512], got {self.max_loras} and "
                             f"{self.max_lora_rank}")
        if self.max_cpu_loras is None:
            self.max_cpu_loras = self.max_loras
        elif self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})")
        if self.data_parallel_size < 1:
            raise ValueError(f"data_parallel_size must be >= 1, got {self.data_parallel_size}")
        if self.distributed_executor_backend not in (None, *EXECUTOR_BACKENDS):
            raise ValueError(f"distributed_executor_backend must be one of {EXECUTOR_BACKENDS}, "
                             f"got {self.distributed_executor_backend!r}")
        if self.distributed_executor_backend == "ray":
            if importlib.util.find_spec("ray") is None:
                raise ValueError("distributed_executor_backend='ray' needs Ray, which is not installed: "
                                 "pip install 'hookllm[ray]'")
            if self.nnodes > 1:
                raise ValueError("nnodes is the mp executor's: under distributed_executor_backend='ray' the Ray "
                                 "cluster places the ranks on its nodes")
        if self.pipeline_parallel_size < 1:
            raise ValueError(f"pipeline_parallel_size must be >= 1, got {self.pipeline_parallel_size}")
        if self.distributed_executor_backend == "uni" and self.world_size > 1:
            raise ValueError(f"distributed_executor_backend='uni' runs one rank; tensor_parallel_size is "
                             f"{self.tensor_parallel_size} and pipeline_parallel_size {self.pipeline_parallel_size} (use 'mp')")
        if self.nnodes < 1 or not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node_rank must be in 0 .. nnodes - 1, got node_rank={self.node_rank} nnodes={self.nnodes}")
        if self.nnodes > 1:
            if not self.master_addr:
                raise ValueError(f"nnodes={self.nnodes} needs master_addr (--master-addr): node 0's address")
            if self.master_port is None:
                self.master_port = 29500
            if self.world_size % self.nnodes:
                raise ValueError(f"tensor_parallel_size x pipeline_parallel_size = {self.world_size} ranks do not "
                                 f"split evenly over nnodes={self.nnodes}")
            if self.distributed_executor_backend == "uni":
                raise ValueError("distributed_executor_backend='uni' runs one rank; nnodes > 1 needs 'mp'")
            if self.data_parallel_size > 1:
                raise ValueError("data_parallel_size > 1 with nnodes > 1 is not offered: run one engine per group "
                                 "of nodes, behind a router")
        if not self.distributed_timeout > 0:
            raise ValueError(f"distributed_timeout must be > 0 seconds, got {self.distributed_timeout}")
        if self.pipeline_parallel_size > 1 and self.custom_all_reduce:
            raise ValueError("custom_all_reduce is not offered with pipeline_parallel_size > 1 (NCCL all-reduces "
                             "within each stage)")
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format must be one of {LOAD_FORMATS}, got {self.load_format!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        if self.model_impl not in MODEL_IMPLS:
            raise ValueError(f"model_impl must be one of {MODEL_IMPLS}, got {self.model_impl!r}")
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption_mode must be one of {PREEMPTION_MODES}, got {self.preemption_mode!r}")
        if not self.swap_space >= 0:  # also refuses NaN
            raise ValueError(f"swap_space must be >= 0 GiB, got {self.swap_space}")
        from hookllm.sched.kv_events import KVEventsConfig

        self.kv_events_config = KVEventsConfig.parse(self.kv_events_config)
        from hookllm.spec.config import SpeculativeConfig

        self.speculative_config = SpeculativeConfig.parse(self.speculative_config)
        if self.speculative_config is not None and self.pipeline_parallel_size > 1:
            raise ValueError("speculative_config with pipeline_parallel_size > 1 is not offered: a step's drafts come "
                             "from the last stage's tokens, which the stages' batches in flight do not wait for")
