"""Structured output: JSON schema, regex, choice and Lark grammar constraints, on llguidance.

A request asks with ``SamplingParams(structured_outputs=StructuredOutputsParams(json=schema))``
(or ``regex=``, ``choice=``, ``grammar=``, ``json_object=True``), or with
``extra_args={"structured_outputs": {...}}``; select the plugin with ``--plugin structured`` /
``LLM(plugins=["structured"])``. It claims the ``structured_outputs`` parameter
(``claim_request_parameters``), so a request carrying it without the plugin active is refused
naming it. When llguidance is installed it registers the ``llguidance`` structured output
backend, for every kind (``register_components``): ``hookllm serve`` finds it
that way, for ``tool_choice``. Four ordinary hooks do the work:

- ``preprocess_request`` compiles and validates the constraint against the engine's tokenizer
  when the request is added (a bad schema or regex is a ``ValueError`` there) and replaces it,
  in the request's own copy of the params, by the compiled grammar in ``extra_args``, which
  travel to the worker;
- ``start_logits_job`` returns a job for the steps with constrained rows: its ``run`` (off the
  main thread while a step is in flight) advances one matcher per constrained request with the
  tokens it has not consumed yet and fills their token bitmasks (in the matcher process); its
  ``apply`` masks the logits in one batched device operation;
- ``worker_request_finished`` drops the matcher;
- ``worker_shutdown`` stops the matcher process.

The matchers live in a process of the plugin's own (``matcher_server.py``, started by the first
constrained step of an engine worker), so that their Python runs beside the engine's rather than
behind it on one GIL. What the engine side keeps (the constrained requests, the process, mask
buffers) is per engine, in the engine's context (``backend.engine_state``).

llguidance is imported inside the hooks (``hookllm.bundled.structured.backend``), so listing or
loading the plugin never needs it. An installed llguidance older than ``LLGUIDANCE_MIN_VERSION``
fails the plugin's load, naming the version it needs.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import importlib.util
from typing import Any

from packaging.version import Version

from hookllm.plugins.components import Components
from hookllm.plugins.context import EngineContext, RequestParameters
from hookllm.plugins.hookspecs import hookimpl
from hookllm.sampling_params import STRUCTURED_KINDS

COMPILED_KEY = "_structured_outputs_compiled"  # extra_args key the compiled grammar travels under
# The first llguidance whose LLTokenizer takes a list of EOS tokens (``eos_token=[...]``,
# ``.eos_tokens``); older ones fail on it at the first constrained request. pyproject.toml's
# ``structured`` extra names the same floor (tests/test_dependency_bounds.py checks).
LLGUIDANCE_MIN_VERSION = "1.7.0"


def check_llguidance_version() -> None:
    """Refuse an installed llguidance older than the backend needs, when the plugin loads rather
    than at the first constrained request. Without llguidance the plugin still loads (and
    registers no backend)."""
    try:
        installed = importlib.metadata.version("llguidance")
    except importlib.metadata.PackageNotFoundError:
        return
    if Version(installed) < Version(LLGUIDANCE_MIN_VERSION):
        raise ImportError(f"the structured plugin needs llguidance>={LLGUIDANCE_MIN_VERSION}, but {installed} is "
                          f"installed: pip install -U 'llguidance>={LLGUIDANCE_MIN_VERSION}'")


check_llguidance_version()


@hookimpl
def claim_request_parameters() -> RequestParameters:
    # Its masks follow the drafts before each row: a constrained request takes guesses.
    return RequestParameters(sampling_params=("structured_outputs",), drafted_extra_args=(COMPILED_KEY,))


@hookimpl
def register_components(components: Components) -> None:
    # Found, not imported: listing the plugin never imports llguidance.
    if importlib.util.find_spec("llguidance") is not None:
        components.add_structured_output_backend("llguidance", STRUCTURED_KINDS)


@hookimpl
def preprocess_request(request: Any, context: EngineContext) -> None:
    params = request.sampling_params
    # Unconstrained requests (most, where the server activates the plugin for every request)
    # return before the backend, and llguidance with it, is imported.
    if params.structured_outputs is None and "structured_outputs" not in params.extra_args:
        return
    from hookllm.bundled.structured import backend

    try:
        spec = backend.requested_spec(params)
    except ValueError as exc:
        raise ValueError(f"request {request.request_id}: {exc}") from None
    if spec is None:
        return
    compiled = backend.compile_request(request.request_id, spec, context.tokenizer, context.model_config)
    # The request's own copy of the params, the constraint taken (the engine refuses one left
    # there): the user's object stays as it was.
    extra_args = {key: value for key, value in params.extra_args.items() if key != "structured_outputs"}
    request.sampling_params = dataclasses.replace(params, structured_outputs=None,
                                                  extra_args={**extra_args, COMPILED_KEY: compiled})


@hookimpl
def start_logits_job(batch: Any, context: Any) -> Any:
    rows = [j for j, r in enumerate(batch.sampling_requests) if COMPILED_KEY in r.sampling_params.extra_args]
    if not rows:
        return None
    from hookllm.bundled.structured import backend

    return backend.MaskJob(batch, rows, backend.engine_state(context))


@hookimpl
def worker_request_finished(request: Any, context: Any) -> None:
    if COMPILED_KEY in request.sampling_params.extra_args:
        from hookllm.bundled.structured import backend

        backend.drop(backend.engine_state(context), request)


@hookimpl
def worker_shutdown(context: Any) -> None:
    namespace = context.state_for(__name__)
    if hasattr(namespace, "backend"):  # made by the first constrained step, so llguidance is there
        namespace.backend.close()
