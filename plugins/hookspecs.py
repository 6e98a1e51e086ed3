"""The hook points of hookllm. Each function's signature, placement and docstring are the hook's documentation.

Plugins implement hooks with ``from hookllm import hookimpl``. The core calls every hook through
pluggy with keyword arguments; an implementation may accept any subset of them. The core's own
defaults are registered as ``trylast`` plugins, so a plugin overrides only what it needs. Hook
wrappers (``@hookimpl(wrapper=True)``) and pluggy's tracing apply to every hook.

Each spec says, as arguments of :func:`hookspec`, where the hook runs (``runs_in``), which
plugins receive it (``scope``) and at which stage of an engine's life (``stage``); the plugin
manager and the docs' hook reference read them from there. The specs below are grouped by stage.
Hooks renamed or changed in this release keep their old names for one release:
:mod:`hookllm.plugins.deprecated_hooks`.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Literal, TypeVar, get_args

import pluggy

if TYPE_CHECKING:
    import fastapi
    import torch

    from hookllm.engine.async_llm import AsyncLLM
    from hookllm.outputs import RequestOutput
    from hookllm.plugins.components import Components
    from hookllm.plugins.context import EngineContext, RequestParameters
    from hookllm.worker.batch import Batch, LogitsJob, CachedRequestState
    from hookllm.entrypoints.chat import RenderedContent
    from hookllm.worker.model_runner import ModelInputs
    from hookllm.plugins.registry import ScopedRegistry
    from hookllm.spec.proposer import SpecProposers
    from hookllm.engine.core_request import EngineCoreRequest

PROJECT_NAME = "hookllm"

hookimpl = pluggy.HookimplMarker(PROJECT_NAME)
_pluggy_hookspec = pluggy.HookspecMarker(PROJECT_NAME)

# Where a hook runs. "cli": the `hookllm` command as it parses its flags; "every": every process,
# when it discovers the installed plugins; "frontend": where prompts are rendered (each API
# server process; the caller's process offline); "engine": where requests are added and outputs
# processed (the engine process; the caller's offline); "worker": where the model lives (the
# worker, each tensor-parallel rank).
Process = Literal["cli", "every", "frontend", "engine", "worker"]
# Which plugins a hook reaches. "installed": every installed plugin, active or not, before any
# engine exists (a class plugin implements it as a static or class method); "active": the
# engine's active plugins; "model": the active plugins, but of the adapters only the one
# serving the checkpoint (another active adapter must not load, render for or feed the wrong model).
Scope = Literal["installed", "active", "model"]
# The stages of an engine's life, in order; the reference groups the hooks by them.
Stage = Literal["registration", "model loading", "request intake", "each step", "end of request", "shutdown",
                "server"]
PROCESS_NAMES: dict[str, str] = {
    "cli": "the `hookllm` command, as it parses its flags",
    "every": "every process, when it discovers the plugins",
    "frontend": "each API server process (the caller's process offline)",
    "engine": "the engine process (the caller's process offline)",
    "worker": "every worker (each tensor-parallel rank)",
}
SCOPE_NAMES: dict[str, str] = {
    "installed": "every installed plugin, active or not (static or class methods on a class plugin)",
    "active": "the active plugins",
    "model": "the active plugins; of the adapters, only the checkpoint's",
}

_F = TypeVar("_F", bound=Callable[..., Any])


@dataclass(frozen=True)
class Placement:
    """Where a hook runs, which plugins it reaches and at which stage: its :func:`hookspec` arguments."""

    runs_in: Process
    scope: Scope
    stage: Stage

    def __post_init__(self) -> None:
        for value, allowed in ((self.runs_in, Process), (self.scope, Scope), (self.stage, Stage)):
            if value not in get_args(allowed):
                raise ValueError(f"{value!r} is none of {', '.join(map(repr, get_args(allowed)))}")


def hookspec(*, runs_in: Process, scope: Scope, stage: Stage, firstresult: bool = False) -> Callable[[_F], _F]:
    """pluggy's hookspec marker, with the hook's :class:`Placement` recorded on the spec."""
    placement = Placement(runs_in, scope, stage)

    def mark(function: _F) -> _F:
        function.hookllm_placement = placement  # type: ignore[attr-defined]
        return _pluggy_hookspec(firstresult=firstresult)(function)

    return mark


def placements() -> dict[str, Placement]:
    """Every hook's name -> its placement, in the order the specs are defined (by stage)."""
    return {name: value.hookllm_placement for name, value in globals().items()
            if hasattr(value, PROJECT_NAME + "_spec") and hasattr(value, "hookllm_placement")}


def hooks_in_scope(scope: Scope) -> frozenset[str]:
    return frozenset(name for name, placement in placements().items() if placement.scope == scope)


# --- registration: every installed plugin, once per process -------------------------------


@hookspec(runs_in="every", scope="installed", stage="registration")
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


@hookspec(runs_in="every", scope="installed", stage="registration")
def register_components(components: Components) -> None:
    """Register the named components this plugin provides, on a :class:`hookllm.plugins.components.Components`.

    Called on every installed plugin (selected or not): a component is found by its kind and
    name from whichever installed plugin registers it (a name two plugins register is refused,
    naming both), so it needs no ``--plugin``. ``hookllm plugins`` lists them. The kinds:

    - ``components.add_tool_parser(name, cls)``: ``hookllm serve --tool-call-parser NAME``. For
      ``tool_choice: "auto"`` the server makes one parser per reply, ``cls(tools)`` with the
      request's tool definitions, and feeds it the reply's text (after any reasoning section) as
      it is generated. A :class:`hookllm.plugins.tool_parser.ToolParser` turns text into content
      and tool calls, holding back what may still become a call; its building blocks are
      ``TaggedToolParser`` (calls between markers) and ``JsonCallsParser`` (a reply of JSON call
      objects), as the bundled ``hermes`` and ``llama3_json`` use.
    - ``components.add_reasoning_parser(name, cls)``: ``hookllm serve --reasoning-parser NAME``.
      One parser per reply (``cls()``), fed the reply's text; a
      :class:`hookllm.plugins.reasoning_parser.ReasoningParser` splits it into
      ``reasoning_content`` and content. The bundled ``qwen3`` and ``deepseek_r1`` are
      ``ThinkReasoningParser``s.
    - ``components.add_quantization_method(name, cls)``: serves a checkpoint whose
      ``quantization_config.quant_method`` is NAME, or ``--quantization NAME``. A
      :class:`hookllm.plugins.quantization.QuantizationMethod` is built with the checkpoint's
      ``quantization_config`` and gives each linear and MoE layer its ``LinearMethod`` /
      ``MoeMethod`` (docs/quantization.md). The bundled ``fp8`` plugin serves ``fp8`` and
      ``compressed-tensors``; the ``gpt_oss`` adapter serves ``mxfp4``.
    - ``components.add_structured_output_backend(name, kinds)``: a backend enforcing the
      :class:`hookllm.sampling_params.StructuredOutputsParams` kinds ``kinds`` (``json``,
      ``regex``, ``choice``, ``grammar``, ``json_object``). This is how the core finds a plugin
      by what it can do: ``hookllm serve`` activates a plugin with a ``json`` backend (unless
      one is selected) for ``tool_choice: "required"`` and named functions. The plugin enforces
      the constraints with its other hooks (it claims ``structured_outputs`` with
      ``claim_request_parameters`` and takes it in ``preprocess_request``); one whose backend
      needs a library that is missing registers nothing.
    - ``components.add_pooler(name, pooler)``: ``--pooler NAME`` on the pooling runner
      (docs/pooling.md). ``pooler(hidden_states, request)`` gets every prompt token's last hidden
      state (``[tokens, hidden]`` float32, on the device; a chunked prompt's chunks joined) and the
      request's ``CachedRequestState``, and returns the embedding (1-D, on the device), which
      ``dimensions`` and normalization then apply to.

    A tool parser for a model that writes ``<call>get_weather {"city": "Paris"}</call>``, and a
    reasoning parser for other markers::

        class CallTagParser(TaggedToolParser):
            start, end = "<call>", "</call>"

            def parse_call(self, body):
                name, _, arguments = body.strip().partition(" ")
                return ParsedToolCall(name, arguments or "{}") if name else None

        class ThoughtParser(ThinkReasoningParser):
            start, end = "<thought>", "</thought>"

        @hookimpl
        def register_components(components):
            components.add_tool_parser("calltag", CallTagParser)
            components.add_reasoning_parser("thought", ThoughtParser)
    """


@hookspec(runs_in="every", scope="installed", stage="registration")
def register_spec_proposers(proposers: SpecProposers) -> None:
    """Register speculative decoding methods: ``proposers.add(name, cls)``, chosen by
    ``speculative_config``'s ``method`` NAME (``--speculative-config '{"method": NAME, ...}'``).

    Called on every installed plugin (selected or not), like ``register_components``. Each
    worker makes one proposer, ``cls(config, context)`` with the ``SpeculativeConfig``; after
    every step that speculates, ``propose(batch)`` gets a
    :class:`hookllm.spec.proposer.ProposalBatch` (each request's tokens so far, the target's
    hidden states) and returns up to ``batch.num_speculative_tokens`` guessed ids per request.
    The target then checks them all in one step and keeps what it would have sampled itself, so
    a proposer changes speed, never output. The bundled ``ngram`` looks the last tokens up in the
    request's own text. A proposer that guesses the rest of a phrase it knows::

        PHRASES = [[791, 6864, 315, 9822, 374, 12366, 13]]  # token ids of whole phrases

        class PhraseProposer:
            def __init__(self, config, context):
                self.k = config.num_speculative_tokens

            def propose(self, batch):
                guesses = []
                for i in range(len(batch.requests)):
                    history = batch.history(i)
                    guess = []
                    for phrase in PHRASES:
                        # the phrase's longest start that the history ends with
                        for n in range(len(phrase) - 1, 0, -1):
                            if history[-n:] == phrase[:n]:
                                guess = phrase[n:n + self.k]
                                break
                        if guess:
                            break
                    guesses.append(guess)
                return guesses

        @hookimpl
        def register_spec_proposers(proposers):
            proposers.add("phrases", PhraseProposer)
    """


@hookspec(runs_in="every", scope="installed", stage="registration")
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


@hookspec(runs_in="cli", scope="installed", stage="registration")
def add_cli_options(parser: argparse.ArgumentParser) -> None:
    """Add plugin-specific flags to ``hookllm generate`` and ``hookllm serve`` (all installed plugins).

    The parsed values reach every request as ``SamplingParams.extra_args[dest]``. On ``serve``
    they are the server-wide defaults: a request may set ``dest`` as a top-level body field, or
    in its ``extra_args``, which wins::

        @hookimpl
        def add_cli_options(parser):
            parser.add_argument("--ban", type=int, action="append", dest="banned_token_ids")
    """


# --- model loading --------------------------------------------------------------------------


@hookspec(runs_in="worker", scope="model", stage="model loading", firstresult=True)
def load_model(device: torch.device, dtype: torch.dtype, context: EngineContext) -> torch.nn.Module | None:
    """Return a ready ``torch.nn.Module`` with its weights loaded, or None to pass.

    The checkpoint is ``context.model_config`` (a :class:`hookllm.config.ModelConfig`: ``path``,
    ``hf_config``, ``architecture``, ``plugin``: the adapter serving it); ``context.registry``
    the :class:`hookllm.plugins.registry.ModelRegistry` (to build a sub-model from another
    plugin's class). The first non-None result wins; the core default (``trylast``) builds
    ``registry.resolve(model_config.architecture, model_config.plugin)(hf_config)`` (a
    :class:`hookllm.plugins.contract.SupportsMultiModal` class also gets its text decoder's
    registered class) and calls its ``load_weights`` with the checkpoint's safetensors tensors. The module must
    satisfy :class:`hookllm.plugins.contract.ModelProtocol`. A plugin loading its own format::

        @hookimpl
        def load_model(device, dtype, context):
            config = context.model_config
            model_cls = context.registry.resolve(config.architecture, config.plugin)
            with building_on(device, dtype):
                model = model_cls(config.hf_config)
            model.load_weights(read_my_format(config.path))
            return model.eval()
    """


# --- request intake ---------------------------------------------------------------------------


@hookspec(runs_in="frontend", scope="model", stage="request intake", firstresult=True)
def render_content_part(part: dict[str, Any], context: EngineContext) -> RenderedContent | None:
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


@hookspec(runs_in="engine", scope="model", stage="request intake")
def preprocess_request(request: EngineCoreRequest, context: EngineContext) -> None:
    """Adjust a new request in place before it is queued.

    ``request`` is a :class:`hookllm.engine.core_request.EngineCoreRequest` (plain data the
    engine core turns into its scheduling state) whose ``prompt_token_ids`` the core has
    already tokenized (with ``context.tokenizer``) and checked (ids in the vocabulary;
    ``request.prompt`` holds the text, if any; ``request.multi_modal_data`` the user's non-text
    inputs). A multimodal adapter expands placeholders into the tokens its encoder fills
    (``request.reset_prompt``) and appends :class:`hookllm.sched.request.MultiModalItem` records
    (offset, length, content hash, data) to ``request.mm_items``. The length limits are checked
    after this hook. Raise ``ValueError`` for bad input: only this request fails.

    A plugin that handles a ``SamplingParams`` field the core does not act on (such as
    ``structured_outputs``) takes it: it resets the field and drops the ``extra_args`` key of
    the same name in ``request.sampling_params`` (the request's own copy, e.g.
    ``dataclasses.replace``) and keeps what it needs in ``extra_args``. A parameter left there
    after this hook, or ``multi_modal_data`` that no plugin turned into ``mm_items``, is a
    ``ValueError`` (see ``claim_request_parameters``). A plugin refusing over-long prompts::

        @hookimpl
        def preprocess_request(request, context):
            if len(request.prompt_token_ids) > 512:
                raise ValueError(f"request {request.request_id}: prompts are limited to 512 tokens")
    """


@hookspec(runs_in="frontend", scope="active", stage="request intake", firstresult=True)
def resolve_lora_adapter(lora_name: str, context: EngineContext) -> str | None:
    """Find the LoRA adapter a request names when no ``--lora-modules`` entry and no runtime load
    gave it: return the path of its PEFT folder (``adapter_config.json`` and
    ``adapter_model.safetensors``), or None to pass (vLLM's LoRA resolvers).

    The server asks this hook when a request's ``model`` is neither the served model nor a
    known adapter, with ``--enable-lora`` on; the first path returned is checked against the
    base model and registered under ``lora_name`` (later requests find it without asking), and
    when no plugin knows the name the request is a 404 naming it. An adapter store (a folder
    tree, a hub cache, an object store synced to local disk) is a plugin of a few lines::

        @hookimpl
        def resolve_lora_adapter(lora_name):
            folder = Path("/srv/adapters") / lora_name
            return str(folder) if (folder / "adapter_config.json").is_file() else None
    """


# --- each step, in every worker ----------------------------------------------------------------


@hookspec(runs_in="worker", scope="model", stage="each step")
def prepare_inputs(batch: Batch, inputs: ModelInputs, model: torch.nn.Module, context: EngineContext) -> None:
    """Adjust the model inputs the core built for this step, in place.

    ``batch`` is the step's read-only :class:`hookllm.worker.batch.Batch`: ``batch.requests`` in flat
    row order with ``batch.num_scheduled_tokens``; request ``i``'s rows are
    ``inputs.query_start[i]:inputs.query_start[i+1]`` and cover its positions
    ``batch.requests[i].num_computed_tokens`` onwards. ``inputs`` is a
    :class:`hookllm.worker.model_runner.ModelInputs`; set ``inputs.inputs_embeds`` (``[num_tokens,
    hidden]``) to feed embeddings instead of ``input_ids``::

        @hookimpl
        def prepare_inputs(inputs, model):
            inputs.inputs_embeds = model.embed_tokens(inputs.input_ids) * EMBEDDING_SCALE
    """


@hookspec(runs_in="worker", scope="active", stage="each step")
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
    step for which every plugin returns None is sampled at once, as without this hook::

        @hookimpl
        def start_logits_job(batch):
            rows = [j for j, r in enumerate(batch.sampling_requests) if "grammar" in r.sampling_params.extra_args]
            return GrammarMaskJob(batch, rows) if rows else None
    """


@hookspec(runs_in="worker", scope="active", stage="each step")
def process_logits(logits: torch.Tensor, batch: Batch, context: EngineContext) -> None:
    """Modify ``logits`` (``[num_sampling_rows, vocab]``, float32) in place before sampling.

    Row ``j`` belongs to ``batch.sampling_requests[j]``, a read-only
    :class:`hookllm.worker.batch.CachedRequestState`: ``request_id``, ``sampling_params`` (with
    ``extra_args``), ``prompt_token_ids``, ``output_token_ids``, ``mm_items``. With async
    scheduling (the CUDA default) a decoding request's ``output_token_ids`` lacks the token of
    the step still running on the device; ``batch.exact_output_token_ids()`` waits for that
    step alone (not this one) and returns every sampling row's complete output ids. Under
    speculative decoding a request checking k guessed tokens has k + 1 consecutive rows, one per
    position (``batch.sampling_positions``); its ``output_token_ids`` lack the guesses before a
    row. Logits jobs (``start_logits_job``) have been applied already::

        @hookimpl
        def process_logits(logits, batch):
            rows = [j for j, r in enumerate(batch.sampling_requests) if r.sampling_params.extra_args.get("no_eos")]
            logits[rows, EOS_TOKEN_ID] = float("-inf")
    """


@hookspec(runs_in="worker", scope="active", stage="each step", firstresult=True)
def sample(logits: torch.Tensor, batch: Batch, context: EngineContext) -> torch.Tensor | None:
    """Return a 1-D ``torch.long`` tensor with one token id per logits row, or None to pass.

    The core default does greedy, temperature, top-k, top-p and min-p sampling, with the
    engine's generator (``batch.generator``) or, for a request with a seed, noise hashed from the
    seed and the row's ``batch.sampling_positions``. A plugin returning anything
    else (floats, the wrong length) fails the step with an error naming the plugin::

        @hookimpl
        def sample(logits, batch):
            return logits.argmax(dim=-1)   # greedy for every request
    """


# --- end of request ------------------------------------------------------------------------------


@hookspec(runs_in="worker", scope="model", stage="end of request")
def worker_request_finished(request: CachedRequestState, model: torch.nn.Module, context: EngineContext) -> None:
    """A request finished or was aborted: release what the plugin keeps for it where the model lives.

    Called in every worker (each tensor-parallel rank), with the request's read-only state and
    the loaded model, e.g. to drop the request's grammar matcher or a per-request table kept in
    ``context.state_for(...)``. For what the finished request produced (its text,
    finish reason, metrics) use ``engine_request_finished``, in the engine process::

        @hookimpl
        def worker_request_finished(request, context):
            context.state_for(__name__).matchers.pop(request.request_id, None)
    """


@hookspec(runs_in="engine", scope="active", stage="end of request")
def engine_request_finished(output: RequestOutput, context: EngineContext) -> None:
    """A request finished or was aborted: its final, complete :class:`hookllm.outputs.RequestOutput`.

    Called once per request in the engine process (where requests are added and outputs are
    processed; never in a worker), whatever the request's ``output_kind``: ``output`` holds
    every token id, the text, the finish reason (``"abort"`` for an aborted request) and
    ``metrics``; for ``n > 1`` it is the parent's output with all ``n`` completions. Use it for
    what follows a request's result (logging, accounting, webhooks); use
    ``worker_request_finished`` to release state kept where the model runs. It runs on the
    engine's loop: hand slow work to a thread of your own::

        @hookimpl
        def engine_request_finished(output):
            m = output.metrics
            logger.info("%s: %s after %.3f s", output.request_id, output.outputs[0].finish_reason,
                        m.finished_time - m.arrival_time)
    """


# --- shutdown ------------------------------------------------------------------------------------


@hookspec(runs_in="worker", scope="active", stage="shutdown")
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


# --- server ---------------------------------------------------------------------------------------


@hookspec(runs_in="frontend", scope="active", stage="server")
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
