"""The hook points of hookllm. Each function's docstring is the hook's documentation.

Plugins implement hooks with ``from hookllm import hookimpl``. The core calls every hook with
keyword arguments; an implementation may accept any subset of them. The core's own defaults
are registered as ``trylast`` plugins, so a plugin overrides only what it needs.
"""

from __future__ import annotations

import pluggy

PROJECT_NAME = "hookllm"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


@hookspec
def register_models(registry):
    """Register model classes by the ``architectures`` name of their config.json.

    Called on every installed plugin (selected or not), so the registry knows every
    architecture. ``registry.register(arch, target)``: ``target`` is a class or a lazy
    ``"module:Class"`` string imported only when that architecture is loaded::

        @hookimpl
        def register_models(registry):
            registry.register("GPT2LMHeadModel", "hookllm_gpt2.model:GPT2LMHeadModel")
    """


@hookspec(firstresult=True)
def load_model(model_config, device, dtype, registry):
    """Return a ready ``torch.nn.Module`` with its weights loaded, or None to pass.

    ``model_config`` is a :class:`hookllm.config.ModelConfig` (``path``, ``hf_config``,
    ``architecture``); ``device`` a ``torch.device``; ``dtype`` a ``torch.dtype``;
    ``registry`` the :class:`hookllm.registry.ModelRegistry` (to build a sub-model, as the
    LLaVA adapter builds its text decoder). The first non-None result wins; the core default
    (``trylast``) builds ``registry.resolve(model_config.architecture)(hf_config)`` and calls
    its ``load_weights`` with the checkpoint's safetensors tensors.
    """


@hookspec
def preprocess_request(request, tokenizer, model_config):
    """Adjust a new request in place before it is queued.

    ``request`` is a :class:`hookllm.request.Request` whose ``prompt_token_ids`` the core has
    already tokenized (``request.prompt`` holds the text, if any; ``request.multi_modal_data``
    the user's non-text inputs). A multimodal adapter expands placeholders into the tokens its
    encoder fills and appends :class:`hookllm.request.MultiModalItem` records (offset, length,
    content hash, data) to ``request.mm_items``. Raise ``ValueError`` for bad input: only this
    request fails.
    """


@hookspec
def prepare_inputs(batch, inputs, model):
    """Adjust the model inputs the core built for this step, in place.

    ``batch`` is the :class:`hookllm.scheduler.SchedulerOutput`: ``batch.requests`` in flat
    row order with ``batch.num_scheduled_tokens``; request ``i``'s rows are
    ``inputs.query_start[i]:inputs.query_start[i+1]`` and cover its positions
    ``request.num_computed_tokens`` onwards. ``inputs`` is a
    :class:`hookllm.model_runner.ModelInputs`; set ``inputs.inputs_embeds`` (``[num_tokens,
    hidden]``) to feed embeddings instead of ``input_ids``.
    """


@hookspec
def process_logits(logits, batch):
    """Modify ``logits`` (``[num_sampling_rows, vocab]``, float32) in place before sampling.

    Row ``j`` belongs to ``batch.sampling_requests[j]``; its ``sampling_params`` (including
    ``extra_args``) and ``all_token_ids`` are there for penalties, bans and grammar masks.
    With async scheduling (the CUDA default) a decoding request's ``all_token_ids`` lacks the
    token of the step still running (``request.num_output_placeholders`` says how many); run
    with ``async_scheduling=False`` when a plugin needs the exact history.
    """


@hookspec(firstresult=True)
def sample(logits, batch):
    """Return a 1-D ``torch.long`` tensor with one token id per logits row, or None to pass.

    The core default does greedy, temperature, top-k, top-p and min-p sampling with per-request
    seeds. A plugin returning anything else (floats, the wrong length) fails the step with an
    error naming the plugin.
    """


@hookspec
def request_finished(request):
    """A request finished or was aborted: release what the plugin keeps for it (e.g. an encoder cache)."""


@hookspec
def add_cli_options(parser):
    """Add plugin-specific flags to the ``hookllm generate`` argparse parser (all installed plugins).

    The parsed values reach every request as ``SamplingParams.extra_args[dest]``::

        @hookimpl
        def add_cli_options(parser):
            parser.add_argument("--ban", type=int, action="append", dest="banned_token_ids")
    """
