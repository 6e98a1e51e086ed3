"""hookllm: a vLLM-style LLM inference engine whose model support is made of pluggy plugins."""

from hookllm.plugins.hookspecs import hookimpl
from hookllm.sampling_params import SamplingParams
from hookllm.outputs import CompletionOutput, RequestOutput
from hookllm.config import EngineConfig
from hookllm.engine import LLMEngine
from hookllm.llm import LLM
from hookllm.beam_search import BeamSearchOutput, BeamSearchParams
from hookllm.model_runner import SamplerContractError

__version__ = "0.1.0"
__all__ = ["LLM", "LLMEngine", "EngineConfig", "SamplingParams", "RequestOutput", "CompletionOutput", "hookimpl",
           "SamplerContractError", "BeamSearchParams", "BeamSearchOutput"]
