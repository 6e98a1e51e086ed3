"""Input processing: a prompt and its parameters in, engine requests out.

Validation, tokenization, the plugins' ``preprocess_request`` hooks, the rule that every
parameter an active plugin must handle is claimed by one, the length limits, and the fan-out of
``n > 1`` into child requests. Bad input raises ``ValueError`` naming the request, and nothing
of it reaches the engine core.
"""

from __future__ import annotations

import dataclasses
import numbers
from typing import Any

import torch

from hookllm.config import EngineConfig, ModelConfig, text_config_of
from hookllm.inputs import PromptType
from hookllm.lora.adapter import load_adapter
from hookllm.lora.request import LoRARequest
from hookllm.plugins.manager import ActiveHooks
from hookllm.pooling_params import PoolingParams
from hookllm.sampling_params import SamplingParams
from hookllm.engine.core_request import EngineCoreRequest

PROMPT_FIELDS = frozenset(("prompt", "prompt_token_ids", "multi_modal_data", "cache_salt", "token_type_ids"))
# What a pooling request carries where a generation request has its sampling parameters: it is
# never sampled (the scheduler ends it once its prompt is computed), and it has no text.
POOLING_SAMPLING = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False, output_kind="final_only")


class TokenizedText(dict):
    """A text prompt with the ids the engine's own tokenizer gave it (``tokenize_texts``): they
    are ints from 0, so a request made of it checks only the vocabulary's bound, not each id's
    type (a third of a long prompt's checks)."""


def child_request_ids(request_id: str, n: int) -> list[str]:
    """The ids of a request's ``n`` completions (vLLM's ``"{i}_{request_id}"``)."""
    return [f"{i}_{request_id}" for i in range(n)]


class InputProcessor:
    def __init__(self, config: EngineConfig, model_config: ModelConfig, tokenizer: Any | None, hooks: ActiveHooks):
        self.config = config
        self.model_config = model_config
        self.tokenizer = tokenizer
        self.hooks = hooks
        self.vocab_size: int | None = getattr(text_config_of(model_config.hf_config), "vocab_size", None)
        # The most logprobs a request may ask for: a step cannot return more than the vocabulary.
        self.max_logprobs = config.max_logprobs if self.vocab_size is None else min(config.max_logprobs,
                                                                                      self.vocab_size)
        self.checked_loras: dict[int, LoRARequest] = {}  # LoRA adapters checked, by lora_int_id

    def tokenize_texts(self, prompts: list[PromptType]) -> list[PromptType]:
        """``prompts`` with each non-empty text prompt (a str, or a dict of ``prompt`` alone)
        tokenized, in one batched call of the tokenizer (its Rust threads) instead of one per
        request: ``{"prompt": text, "prompt_token_ids": ids}``, the ids :meth:`process` would give."""
        texts = [index for index, prompt in enumerate(prompts)
                 if (isinstance(prompt, str) and prompt) or (isinstance(prompt, dict) and prompt.keys() == {"prompt"}
                                                             and isinstance(prompt["prompt"], str) and prompt["prompt"])]
        if self.tokenizer is None or len(texts) < 2:
            return prompts
        strings = [prompts[index] if isinstance(prompts[index], str) else prompts[index]["prompt"] for index in texts]
        tokenized = list(prompts)
        for index, text, token_ids in zip(texts, strings, self._token_ids_of(strings)):
            tokenized[index] = TokenizedText(prompt=text, prompt_token_ids=token_ids)
        return tokenized

    @property
    def tokenizes_in_rust(self) -> bool:
        """Whether texts are tokenized by a fast tokenizer's Rust code alone: it leaves Python's
        GIL meanwhile, and changes no tokenizer state, so a thread may tokenize beside the engine."""
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        return backend is not None and backend.truncation is None and backend.padding is None

    def _token_ids_of(self, texts: list[str]) -> list[list[int]]:
        """Each text's input ids, as ``tokenizer(texts)["input_ids"]`` gives them. A fast tokenizer
        with no truncation or padding set is called in Rust directly, through its batch encoder
        without offsets: transformers' wrapper would also build the masks and offsets nobody reads
        (a third of a short text's tokenizing time)."""
        if not self.tokenizes_in_rust:
            return self.tokenizer(texts)["input_ids"]
        return [encoding.ids for encoding in self.tokenizer.backend_tokenizer.encode_batch_fast(texts)]

    def process(self, request_id: str, prompt: PromptType, params: SamplingParams | PoolingParams | None,
                lora_request: LoRARequest | None = None) -> EngineCoreRequest:
        """The request for ``prompt``: tokenized, preprocessed by the plugins, its limits checked.
        ``PoolingParams`` make a pooling request (the pooling runner's), anything else a generation
        one; ``lora_request`` names its adapter (checked here, the first time its id is seen)."""
        request = self._process(request_id, prompt, params)
        if lora_request is not None:
            self._check_lora(request_id, lora_request)
            request.lora_request = lora_request
        return request

    def _process(self, request_id: str, prompt: PromptType,
                 params: SamplingParams | PoolingParams | None) -> EngineCoreRequest:
        if not isinstance(request_id, str):
            raise TypeError(
                f"add_request takes (request_id, prompt, params) in vLLM's order; the request id must be "
                f"a str, got {type(request_id).__name__}"
            )
        if isinstance(prompt, (SamplingParams, PoolingParams)) or not isinstance(
                params, (SamplingParams, PoolingParams, type(None))):
            raise TypeError("add_request takes (request_id, prompt, params) in vLLM's order, "
                            f"got a {type(prompt).__name__} as the prompt and a {type(params).__name__} as params")
        runner = self.model_config.runner
        if isinstance(params, PoolingParams) != (runner == "pooling"):
            wanted = "PoolingParams (LLM.embed, /v1/embeddings)" if runner == "pooling" else "SamplingParams"
            raise ValueError(f"request {request_id}: {self.config.model} runs the {runner} runner: a request "
                             f"takes {wanted}, got {type(params or SamplingParams()).__name__}")
        if isinstance(params, PoolingParams):
            return self._pooling_request(request_id, prompt, params)
        params = params or SamplingParams()
        if isinstance(prompt, dict) and prompt.get("token_type_ids") is not None:
            raise ValueError(f"request {request_id}: token_type_ids are for pooling requests (a cross-encoder's "
                             "text pair), not generation")
        self._check_logprobs(request_id, params)
        request = self._make_request(request_id, prompt, self._resolve_params(request_id, params))
        self.hooks.hook.preprocess_request(request=request, context=self.hooks.context)
        self.hooks.check_claimed(request)
        request.set_length_limit(self.model_config.max_model_len)
        return request

    def _pooling_request(self, request_id: str, prompt: PromptType, params: PoolingParams) -> EngineCoreRequest:
        pooler = self.model_config.pooler
        if pooler.late_interaction and params.task != "encode":
            raise ValueError(f"request {request_id}: {self.config.model} is a late-interaction model: it gives "
                             f"token embeddings (encode, score), not the {params.task} task")
        if params.task in ("classify", "score") and not pooler.is_classifier:
            raise ValueError(f"request {request_id}: the {params.task} task needs a classification head: "
                             f"{self.config.model} has none (a *ForSequenceClassification checkpoint has one)")
        if params.dimensions is not None:
            hidden_size = pooler.dimension or text_config_of(self.model_config.hf_config).hidden_size
            if not pooler.matryoshka:
                raise ValueError(f"request {request_id}: dimensions={params.dimensions}: {self.config.model} "
                                 "was not trained for Matryoshka embeddings (its config sets no is_matryoshka)")
            if params.dimensions > hidden_size:
                raise ValueError(f"request {request_id}: dimensions={params.dimensions} is over the model's "
                                 f"embedding size {hidden_size}")
        sampling = POOLING_SAMPLING  # shared, as one SamplingParams is by every prompt of an LLM call
        if params.truncate_prompt_tokens is not None:
            sampling = dataclasses.replace(sampling, truncate_prompt_tokens=params.truncate_prompt_tokens)
        request = self._make_request(request_id, prompt, sampling)
        token_types = prompt.get("token_type_ids") if isinstance(prompt, dict) else None
        if token_types is not None:
            start = second_text_start(request_id, token_types, prompt.get("prompt_token_ids"),
                                      len(request.prompt_token_ids))
            params = dataclasses.replace(params, second_text_start=start)
        request.pooling_params = params
        self.hooks.hook.preprocess_request(request=request, context=self.hooks.context)
        request.set_length_limit(self.model_config.max_model_len)
        return request

    def fan_out(self, request: EngineCoreRequest) -> list[EngineCoreRequest]:
        """The requests to queue: ``request`` itself, or its ``n`` children, child ``i`` seeded
        ``seed + i`` (the same ``n`` completions alone or in any batch)."""
        params = request.sampling_params
        if params.n == 1:
            return [request]
        children = []
        for i, child_id in enumerate(child_request_ids(request.request_id, params.n)):
            child_params = dataclasses.replace(params, n=1, seed=None if params.seed is None else params.seed + i)
            children.append(dataclasses.replace(request, request_id=child_id, sampling_params=child_params))
        return children

    def _check_lora(self, request_id: str, lora_request: LoRARequest) -> None:
        """The adapter is served (``enable_lora``) and fits the base model: its folder is read and
        checked once per ``lora_int_id``, which must keep naming the same adapter."""
        if not isinstance(lora_request, LoRARequest):
            raise ValueError(f"request {request_id}: lora_request must be a hookllm.lora.request.LoRARequest, "
                             f"got {type(lora_request).__name__}")
        if not self.config.enable_lora:
            raise ValueError(f"request {request_id}: LoRA adapter {lora_request.lora_name!r} asked, but this engine "
                             "serves none (start it with enable_lora=True / --enable-lora)")
        known = self.checked_loras.get(lora_request.lora_int_id)
        if known == lora_request:
            return
        if known is not None:
            raise ValueError(f"request {request_id}: lora_int_id {lora_request.lora_int_id} is adapter "
                             f"{known.lora_name!r} at {known.lora_path}; adapter {lora_request.lora_name!r} at "
                             f"{lora_request.lora_path} needs an id of its own")
        served = [self.config.model, getattr(self.model_config.hf_config, "_name_or_path", "")]
        load_adapter(lora_request, self.model_config.hf_config, self.config.max_lora_rank, torch.float32, served)
        self.checked_loras[lora_request.lora_int_id] = lora_request

    def _check_logprobs(self, request_id: str, params: SamplingParams) -> None:
        """Logprobs beyond ``max_logprobs`` or the vocabulary would fail the whole step: refuse them here."""
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value is not None and value > self.max_logprobs:
                raise ValueError(f"request {request_id}: {name}={value} is over the limit of {self.max_logprobs} "
                                 f"(max_logprobs={self.config.max_logprobs}, vocabulary {self.vocab_size})")

    def _resolve_params(self, request_id: str, params: SamplingParams) -> SamplingParams:
        """Resolve what needs the tokenizer (bad words' tokens). Returns the request's own copy
        when it changes anything: the user's object is never changed."""
        if not params.bad_words:
            return params
        if self.tokenizer is None:
            raise ValueError(f"request {request_id}: bad_words needs a tokenizer; {self.config.model} has none")
        params = params.clone()
        spellings: list[list[int]] = []
        for word in params.bad_words:
            # A word inside text usually follows a space: ban both spellings (as vLLM does).
            for text in (word.lstrip(), " " + word.lstrip()):
                ids = self.tokenizer.encode(text, add_special_tokens=False)
                if ids and ids not in spellings:
                    spellings.append(ids)
        params.bad_words_token_ids = spellings
        return params

    def _make_request(self, request_id: str, prompt: Any, params: SamplingParams) -> EngineCoreRequest:
        if isinstance(prompt, str):
            prompt = {"prompt": prompt}
        elif isinstance(prompt, (list, tuple)):
            prompt = {"prompt_token_ids": list(prompt)}
        if not isinstance(prompt, dict):
            raise ValueError(f"request {request_id}: a prompt is a string, a list of token ids or a dict, got "
                             f"{type(prompt).__name__}")
        unknown = set(prompt) - PROMPT_FIELDS
        if unknown:
            raise ValueError(f"request {request_id}: unknown prompt fields {sorted(unknown)}")
        text = prompt.get("prompt")
        token_ids = prompt.get("prompt_token_ids")
        if token_ids is None:
            if text is None:
                raise ValueError(f"request {request_id}: give 'prompt' or 'prompt_token_ids'")
            if self.tokenizer is None:
                raise ValueError(
                    f"request {request_id}: {self.config.model} has no tokenizer files; pass prompt_token_ids"
                )
            token_ids = self._token_ids_of([text])[0] if text else []
        elif not isinstance(token_ids, (list, tuple)):
            raise ValueError(f"request {request_id}: prompt_token_ids must be a list of ints, "
                             f"got {type(token_ids).__name__}")
        ours = isinstance(prompt, TokenizedText)  # ints from 0 already
        if not ours:
            token_ids = _int_list(request_id, token_ids)
        if params.truncate_prompt_tokens is not None:
            token_ids = token_ids[-params.truncate_prompt_tokens:]  # vLLM keeps the prompt's end
        if self.vocab_size is not None and token_ids and (max(token_ids) >= self.vocab_size
                                                          or (not ours and min(token_ids) < 0)):
            raise ValueError(f"request {request_id}: prompt token ids must be in [0, {self.vocab_size})")
        return EngineCoreRequest(request_id, token_ids, params, prompt=text,
                                 multi_modal_data=prompt.get("multi_modal_data"), cache_salt=prompt.get("cache_salt"))


def _int_list(request_id: str, token_ids: list | tuple) -> list[int]:
    """A prompt's token ids as a list of ints; never coerced: 1.5, "3", None or True in a prompt
    is a bug in the caller."""
    if set(map(type, token_ids)) <= {int}:  # a tokenizer's: checked in C-speed passes
        return list(token_ids)
    bad = [t for t in token_ids if isinstance(t, bool) or not isinstance(t, numbers.Integral)]
    if bad:
        raise ValueError(f"request {request_id}: prompt_token_ids must be ints, got {bad[0]!r}")
    return [int(t) for t in token_ids]


def second_text_start(request_id: str, token_types: Any, token_ids: Any, num_prompt_tokens: int) -> int | None:
    """Where a text pair's second text starts in the (possibly truncated) prompt, from the
    ``token_type_ids`` a BERT-style tokenizer gives the pair (0s, then 1s); None when all are 0."""
    if not isinstance(token_ids, (list, tuple)) or not isinstance(token_types, (list, tuple)) \
            or len(token_types) != len(token_ids):
        raise ValueError(f"request {request_id}: token_type_ids go with prompt_token_ids, one per token")
    types = list(token_types)
    if any(isinstance(t, bool) or t not in (0, 1) for t in types) or types != sorted(types):
        raise ValueError(f"request {request_id}: token_type_ids must be 0s then 1s (a text pair's two segments)")
    if 1 not in types:
        return None
    return max(0, types.index(1) - (len(types) - num_prompt_tokens))  # the truncation cut the prompt's start
