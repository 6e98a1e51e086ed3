"""The hook points of hookllm. Each function's signature and docstring are the hook's documentation.

Plugins implement hooks with ``from hookllm import hookimpl``. The core calls every hook through
pluggy with keyword arguments; an implementation may accept any subset of them. The core's own
defaults are registered as ``trylast`` plugins, so a plugin overrides only what it needs. Hook
wrappers (``@hookimpl(wrapper=True)``) and pluggy's tracing apply to every hook.

The hooks in :data:`MODEL_SCOPED` concern the checkpoint's model: of the active plugins that
register architectures (adapters), only the one serving the checkpoint receives them;
hook-only plugins receive them too.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any, Iterable

import pluggy

if TYPE_CHECKING:
    import fastapi
    import torch

    from hookllm.engine.async_llm import AsyncLLM
    from hookllm.outputs import RequestOutput
    from hookllm.plugins.context import EngineContext, RequestParameters
    from hookllm.worker.batch import Batch, LogitsJob, CachedRequestState
    from hookllm.entrypoints.chat import RenderedContent
    from hookllm.config import ModelConfig
    from hookllm.worker.model_runner import ModelInputs
    from hookllm.plugins.registry import ModelRegistry, ScopedRegistry
    from hookllm.sched.request import Request
    from hookllm.plugins.quantization import QuantizationMethod
    from hookllm.plugins.reasoning_parser import ReasoningParser
    from hookllm.plugins.tool_parser import ToolParser

PROJECT_NAME = "hookllm"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)

# Hooks that reach, among adapters, only the checkpoint's: another architecture's adapter that
# is active (selected by the user) must not load, render for or feed the wrong model.
MODEL_SCOPED = frozenset(
    {"load_model", "render_content_part", "preprocess_request", "prepare_inputs", "request_finished"})
# Hooks called on every installed plugin, active or not, once per process: a class plugin
# implements them as static or class methods (no engine, so no instance, exists yet).
INSTALLED_WIDE = frozenset({"register_models", "add_cli_options", "claim_request_parameters",
                            "register_tool_parsers", "register_reasoning_parsers",
                            "register_quantization_methods", "register_structured_output_backends"})


@hookspec
def register_models(registry: ScopedRegistry) -> None:
    """Register model classes by the ``architectures`` name of their config.json.

    Called on every installed plugin (selected or not), so the registry knows every
    architecture. ``registry.register(arch, target)``: ``target`` is a class or a lazy
    ``"module:Class"`` string imported only when that architecture is loaded::

        @hookimpl
        def register_models(registry):
            registry.register("GPT2LMHeadModel", "hookllm_gpt2.model:GPT2LMHeadModel")

    ``registry.register_fallback(target, claims, description=...)`` serves instead every
    architecture ``claims(name)`` accepts that no plugin registers by name, as the bundled
    ``transformers`` plugin does; ``--model-impl`` chooses between the two (docs/models.md).
    """


@hookspec(firstresult=True)
def load_model(
    model_config: ModelConfig, device: torch.device, dtype: torch.dtype, registry: ModelRegistry,
    context: EngineContext,
) -> torch.nn.Module | None:
    """Return a ready ``torch.nn.Module`` with its weights loaded, or None to pass.

    ``model_config`` is a :class:`hookllm.config.ModelConfig` (``path``, ``hf_config``,
    ``architecture``, ``plugin``: the adapter serving it); ``registry`` the
    :class:`hookllm.plugins.registry.ModelRegistry` (to build a sub-model, as the LLaVA adapter
    builds its text decoder). The first non-None result wins; the core default (``trylast``)
    builds ``registry.resolve(model_config.architecture, model_config.plugin)(hf_config)`` and
    calls its ``load_weights`` with the checkpoint's safetensors tensors. The module must
    satisfy :class:`hookllm.plugins.contract.ModelProtocol`.
    """


@hookspec(firstresult=True)
def render_content_part(part: dict[str, Any], model_config: ModelConfig,
                        context: EngineContext) -> RenderedContent | None:
    """Render one non-text chat content part (or CLI attachment) into prompt text and inputs.

    ``LLM.chat``, the server and ``hookllm generate --image`` hand every content part whose
    ``type`` is not ``"text"`` to this hook: an OpenAI-style ``{"type": "image_url",
    "image_url": {"url": ...}}``, ``{"type": "image", "image": PIL image or path}`` or a
    plugin's own type. Return a :class:`hookllm.entrypoints.chat.RenderedContent` with the text that
    stands for the part in the prompt (the model's placeholder) and the ``multi_modal_data``
    it adds, e.g. ``RenderedContent("<image>", {"image": [url]})``; or None to pass. A part
    that no active plugin renders is a ``ValueError`` naming its type. The core knows no
    model's placeholder: this hook is where a multimodal adapter says what it is::

        @hookimpl
        def render_content_part(part):
            if part["type"] == "image_url":
                return RenderedContent("<image>", {"image": [part["image_url"]["url"]]})
    """


@hookspec
def preprocess_request(request: Request, tokenizer: Any, model_config: ModelConfig, context: EngineContext) -> None:
    """Adjust a new request in place before it is queued.

    ``request`` is a :class:`hookllm.sched.request.Request` whose ``prompt_token_ids`` the core has
    already tokenized and checked (ids in the vocabulary; ``request.prompt`` holds the text, if
    any; ``request.multi_modal_data`` the user's non-text inputs). A multimodal adapter expands
    placeholders into the tokens its encoder fills (``request.reset_prompt``) and appends
    :class:`hookllm.sched.request.MultiModalItem` records (offset, length, content hash, data) to
    ``request.mm_items``. The length limits are checked after this hook. Raise ``ValueError``
    for bad input: only this request fails.

    A plugin that handles a ``SamplingParams`` field the core does not act on (such as
    ``structured_outputs``) takes it: it resets the field and drops the ``extra_args`` key of
    the same name in ``request.sampling_params`` (the request's own copy, e.g.
    ``dataclasses.replace``) and keeps what it needs in ``extra_args``. A parameter left there
    after this hook, or ``multi_modal_data`` that no plugin turned into ``mm_items``, is a
    ``ValueError`` (see ``claim_request_parameters``).
    """


@hookspec
def prepare_inputs(batch: Batch, inputs: ModelInputs, model: torch.nn.Module, context: EngineContext) -> None:
    """Adjust the model inputs the core built for this step, in place.

    ``batch`` is the step's read-only :class:`hookllm.worker.batch.Batch`: ``batch.requests`` in flat
    row order with ``batch.num_scheduled_tokens``; request ``i``'s rows are
    ``inputs.query_start[i]:inputs.query_start[i+1]`` and cover its positions
    ``batch.requests[i].num_computed_tokens`` onwards. ``inputs`` is a
    :class:`hookllm.worker.model_runner.ModelInputs`; set ``inputs.inputs_embeds`` (``[num_tokens,
    hidden]``) to feed embeddings instead of ``input_ids``.
    """


@hookspec
def start_logits_job(batch: Batch, context: EngineContext) -> LogitsJob | None:
    """Return a :class:`hookllm.worker.batch.LogitsJob` for this step's logits, or None (the usual answer).

    For logits work with a large host part, e.g. filling grammar masks. Called once the step's
    logits are computed. The job's ``run()`` does the host work and may wait for the previous
    step's tokens (``batch.in_flight_token_ids()``); its ``apply(logits)`` then changes the
    logits on the main thread, before ``process_logits``. With async scheduling and a step in
    flight, the runner defers the step: ``run()`` goes to a background thread while the main
    thread processes the previous step's outputs and schedules the next one, and the step is
    sampled when the next one starts (or its tokens are read). Otherwise ``run()`` runs inline.
    Either way the hooks see the same batch and the same logits, so the tokens are the same; a
    step for which every plugin returns None is sampled at once, as without this hook.
    """


@hookspec
def process_logits(logits: torch.Tensor, batch: Batch, context: EngineContext) -> None:
    """Modify ``logits`` (``[num_sampling_rows, vocab]``, float32) in place before sampling.

    Row ``j`` belongs to ``batch.sampling_requests[j]``, a read-only
    :class:`hookllm.worker.batch.CachedRequestState`: ``request_id``, ``sampling_params`` (with
    ``extra_args``), ``prompt_token_ids``, ``output_token_ids``, ``mm_items``. With async
    scheduling (the CUDA default) a decoding request's ``output_token_ids`` lacks the token of
    the step still running on the device; ``batch.exact_output_token_ids()`` waits for that
    step alone (not this one) and returns every sampling row's complete output ids. Logits
    jobs (``start_logits_job``) have been applied already.
    """


@hookspec(firstresult=True)
def sample(logits: torch.Tensor, batch: Batch, context: EngineContext) -> torch.Tensor | None:
    """Return a 1-D ``torch.long`` tensor with one token id per logits row, or None to pass.

    The core default does greedy, temperature, top-k, top-p and min-p sampling, with the
    engine's generator (``batch.generator``) or, for a request with a seed, noise hashed from the
    seed and the row's ``batch.sampling_positions``. A plugin returning anything
    else (floats, the wrong length) fails the step with an error naming the plugin.
    """


@hookspec
def request_finished(request: CachedRequestState, model: torch.nn.Module, context: EngineContext) -> None:
    """A request finished or was aborted: release what the plugin keeps for it where the model lives.

    Called in every worker (each tensor-parallel rank), with the request's read-only state and
    the loaded model, e.g. to drop the request's entries from an encoder cache or its grammar
    matcher kept in ``context.state_for(...)``. For what the finished request produced (its text,
    finish reason, metrics) use ``request_completed``, on the driver.
    """


@hookspec
def worker_shutdown(model: torch.nn.Module, context: EngineContext) -> None:
    """The engine is shutting down: stop what the plugin started where the model lives.

    Called once in every worker (each tensor-parallel rank), after its last step, with the
    loaded model: join the threads, stop the processes and free the buffers the plugin keeps in
    ``context.state_for(...)`` (the bundled ``structured`` plugin stops its matcher process here).
    For a thread pool a plugin started::

        @hookimpl
        def worker_shutdown(context):
            pool = getattr(context.state_for(__name__), "pool", None)
            if pool is not None:
                pool.shutdown()
    """


@hookspec
def request_completed(output: RequestOutput, context: EngineContext) -> None:
    """A request finished or was aborted: its final, complete :class:`hookllm.outputs.RequestOutput`.

    Called once per request on the driver (the process where requests are added and outputs are
    processed; never in a worker), whatever the request's ``output_kind``: ``output`` holds
    every token id, the text, the finish reason (``"abort"`` for an aborted request) and
    ``metrics``; for ``n > 1`` it is the parent's output with all ``n`` completions. Use it for
    what follows a request's result (logging, accounting, webhooks); use ``request_finished``
    to release state kept where the model runs. It runs on the engine's loop: hand slow work
    to a thread of your own::

        @hookimpl
        def request_completed(output):
            m = output.metrics
            logger.info("%s: %s after %.3f s", output.request_id, output.outputs[0].finish_reason,
                        m.finished_time - m.arrival_time)
    """


@hookspec
def claim_request_parameters() -> RequestParameters | None:
    """Name the request parameters this plugin handles: a :class:`hookllm.plugins.context.RequestParameters`.

    Called once on every installed plugin (selected or not). After the ``preprocess_request``
    hooks, a request is refused (``ValueError`` naming the request, the parameter and the
    installed plugins that would handle it) when a parameter is left that no active plugin
    took: a ``SamplingParams`` field the core does not act on (``structured_outputs``, or a
    field a plugin claims here) still set, or still an ``extra_args`` key; ``multi_modal_data``
    of a modality with no ``mm_items``; an ``extra_args`` key claimed only by plugins that are
    not active (a value equal to the plugin's flag default passes: the CLI sends every flag).
    ``extra_args`` keys no installed plugin claims pass, for the user's own hooks::

        @hookimpl
        def claim_request_parameters():
            return RequestParameters(modalities=("audio",), extra_args=("audio_language",))
    """


@hookspec
def add_cli_options(parser: argparse.ArgumentParser) -> None:
    """Add plugin-specific flags to ``hookllm generate`` and ``hookllm serve`` (all installed plugins).

    The parsed values reach every request as ``SamplingParams.extra_args[dest]``. On ``serve``
    they are the server-wide defaults: a request may set ``dest`` as a top-level body field, or
    in its ``extra_args``, which wins::

        @hookimpl
        def add_cli_options(parser):
            parser.add_argument("--ban", type=int, action="append", dest="banned_token_ids")
    """


@hookspec
def add_routes(app: fastapi.FastAPI, engine: AsyncLLM, context: EngineContext) -> None:
    """Add HTTP routes to the ``hookllm serve`` app (the active plugins' implementations, all called).

    ``app`` is the server's FastAPI app, with the OpenAI routes already in place (a route with
    the same path as one of them is never reached); ``engine`` is the server's
    :class:`hookllm.engine.async_llm.AsyncLLM`: ``async for out in engine.generate(prompt,
    params)``, ``await engine.tokenize(text)``, ``engine.get_stats()``, ``engine.config``.
    The server's ``--api-key`` guards these routes too::

        @hookimpl
        def add_routes(app, engine):
            @app.get("/v1/my-plugin/stats")
            async def stats():
                return {"running": engine.get_stats().num_running_reqs}
    """


@hookspec
def register_tool_parsers() -> dict[str, type[ToolParser]] | None:
    """Name the tool parsers this plugin provides: ``{name: ToolParser subclass}``.

    Called on every installed plugin (selected or not): ``hookllm serve --tool-call-parser NAME``
    takes the parser named NAME from whichever installed plugin registers it (a name two
    plugins register is refused). For ``tool_choice: "auto"`` the server makes one parser per
    reply, ``cls(tools)`` with the request's tool definitions (OpenAI's ``{"type": "function",
    "function": {...}}`` dicts), and feeds it the reply's text (after any reasoning section)
    as it is generated. A :class:`hookllm.plugins.tool_parser.ToolParser` turns text into
    content and tool calls, holding back what may still become a call; subclass its building
    blocks ``TaggedToolParser`` (calls between markers) or ``JsonCallsParser`` (a reply of JSON
    call objects), as the bundled ``hermes`` and ``llama3_json`` do::

        class CallTagParser(TaggedToolParser):      # <call>get_weather {"city": "Paris"}</call>
            start, end = "<call>", "</call>"

            def parse_call(self, body):
                name, _, arguments = body.strip().partition(" ")
                return ParsedToolCall(name, arguments or "{}") if name else None

        @hookimpl
        def register_tool_parsers():
            return {"calltag": CallTagParser}
    """


@hookspec
def register_reasoning_parsers() -> dict[str, type[ReasoningParser]] | None:
    """Name the reasoning parsers this plugin provides: ``{name: ReasoningParser subclass}``.

    Called on every installed plugin (selected or not): ``hookllm serve --reasoning-parser NAME``
    takes the parser named NAME from whichever installed plugin registers it. The server makes
    one parser per reply (``cls()``) and feeds it the reply's text as it is generated; a
    :class:`hookllm.plugins.reasoning_parser.ReasoningParser` splits it into
    ``reasoning_content`` and content (the content then goes to the tool parser, if any). The
    bundled ``qwen3`` and ``deepseek_r1`` are ``ThinkReasoningParser``s; one for other markers::

        class ThoughtParser(ThinkReasoningParser):
            start, end = "<thought>", "</thought>"

        @hookimpl
        def register_reasoning_parsers():
            return {"thought": ThoughtParser}
    """


@hookspec
def register_quantization_methods() -> dict[str, type[QuantizationMethod]] | None:
    """Name the quantization methods this plugin serves: ``{quant_method: QuantizationMethod subclass}``.

    Called on every installed plugin (selected or not). A checkpoint whose
    ``quantization_config.quant_method`` is NAME, or ``--quantization NAME``, is served by the
    class registered as NAME (no installed plugin, or two: an error naming the registered
    ones). A :class:`hookllm.plugins.quantization.QuantizationMethod` is built with the
    checkpoint's ``quantization_config`` and gives each linear and MoE layer its
    ``LinearMethod`` / ``MoeMethod``: the parameters the checkpoint holds, how each is sharded
    across ranks, and the matmul. A weight-only int8 method in a few lines::

        class Int8LinearMethod(LinearMethod):
            def create_weights(self, layer):
                rows = layer.weight.shape[0]
                layer.weight = nn.Parameter(torch.empty_like(layer.weight, dtype=torch.int8), requires_grad=False)
                layer.weight_scale = nn.Parameter(torch.empty(rows, 1), requires_grad=False)
                layer.weight_scale.param_layout = ParamLayout(("out",))  # sharded with the weight's rows

            def apply(self, layer, x, bias):
                return F.linear(x, layer.weight.to(x.dtype) * layer.weight_scale.to(x.dtype), bias)

        class Int8Method(QuantizationMethod):
            name = "int8-weight-only"

            def linear_method(self, prefix, layer):
                return Int8LinearMethod()

        @hookimpl
        def register_quantization_methods():
            return {"int8-weight-only": Int8Method}

    The bundled ``fp8`` plugin serves ``fp8`` and ``compressed-tensors`` FP8 checkpoints (and
    ``--quantization fp8`` on any other); the ``gpt_oss`` adapter serves ``mxfp4``.
    """


@hookspec
def register_structured_output_backends() -> dict[str, Iterable[str]] | None:
    """Name the structured output backends this plugin provides: ``{name: the kinds it enforces}``.

    The kinds are those of :class:`hookllm.sampling_params.StructuredOutputsParams`: ``json`` (a
    JSON schema), ``regex``, ``choice``, ``grammar``, ``json_object``. Called on every installed
    plugin (selected or not); a plugin whose backend needs a library that is missing registers
    nothing. This is how the core finds a plugin by what it can do rather than by its name:
    ``hookllm serve`` activates a plugin with a ``json`` backend (unless one is selected) for
    ``tool_choice: "required"`` and named functions, which constrain the reply to a JSON schema.
    The plugin enforces the constraints with the other hooks (it claims ``structured_outputs``
    with ``claim_request_parameters`` and takes it in ``preprocess_request``). The bundled
    ``structured`` plugin registers ``llguidance`` when llguidance is installed::

        @hookimpl
        def register_structured_output_backends():
            return {"my-regex-engine": ["regex", "choice"]}
    """
