"""hookllm: a vLLM-style LLM inference engine whose model support is made of pluggy plugins."""

from hookllm.plugins.hookspecs import hookimpl
from hookllm.sampling_params import RequestOutputKind, SamplingParams
from hookllm.pooling_params import PoolingParams
from hookllm.inputs import TextPrompt, TokensPrompt
from hookllm.outputs import (ClassificationRequestOutput, CompletionOutput, EmbeddingRequestOutput, Logprob,
                             PoolingRequestOutput, RequestMetrics, RequestOutput, ScoringRequestOutput)
from hookllm.config import EngineConfig
from hookllm.engine.arg_utils import EngineArgs
from hookllm.engine.llm_engine import LLMEngine
from hookllm.entrypoints.llm import LLM
from hookllm.engine.beam_search import BeamSearchOutput, BeamSearchParams
from hookllm.worker.model_runner import SamplerContractError

__version__ = "0.1.0"
__all__ = ["LLM", "LLMEngine", "EngineArgs", "EngineConfig", "SamplingParams", "RequestOutputKind", "TextPrompt",
           "TokensPrompt", "RequestOutput", "CompletionOutput", "Logprob", "RequestMetrics", "hookimpl",
           "SamplerContractError", "BeamSearchParams", "BeamSearchOutput", "PoolingParams", "PoolingRequestOutput",
           "EmbeddingRequestOutput", "ClassificationRequestOutput", "ScoringRequestOutput"]
