"""What a plugin knows of the engine it serves: :class:`EngineContext`, and the declaration of the
request parameters a plugin handles (:class:`RequestParameters`).

One engine (one process holding hooks: the driver, each worker process) has one context, so
two engines in one process never share plugin state: a module-level plugin keeps its state in
``context.state_for(__name__)``, a class plugin on its instance (one per engine).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from hookllm.config import EngineConfig, ModelConfig
from hookllm.plugins.registry import ModelRegistry


@dataclass(eq=False)
class EngineContext:
    """One engine's configuration, tokenizer, model registry and per-plugin state; hooks receive
    it as ``context``.

    ``config`` is the engine's :class:`hookllm.config.EngineConfig`, ``model_config`` the
    checkpoint's :class:`hookllm.config.ModelConfig`, ``registry`` the
    :class:`hookllm.plugins.registry.ModelRegistry` of every installed plugin. ``tokenizer`` is
    the engine's tokenizer once the engine has loaded it; None before that, for a checkpoint
    without one, and in worker processes (which tokenize nothing).
    """

    config: EngineConfig
    model_config: ModelConfig
    registry: ModelRegistry
    tokenizer: Any = None
    _states: dict[str, SimpleNamespace] = field(default_factory=dict, repr=False)

    def state_for(self, key: str) -> SimpleNamespace:
        """This engine's state for ``key`` (a module-level plugin passes its ``__name__``): an
        empty namespace on first use, the same object after."""
        state = self._states.get(key)
        if state is None:
            state = self._states[key] = SimpleNamespace()
        return state


@dataclass(frozen=True)
class RequestParameters:
    """The request parameters a plugin handles: its ``claim_request_parameters`` answer.

    ``sampling_params``: ``SamplingParams`` fields its ``preprocess_request`` takes (resets to
    the default and removes from ``extra_args``, where the same name is the field's other
    spelling). ``modalities``: ``multi_modal_data`` keys its ``preprocess_request`` turns into
    ``mm_items``. ``extra_args``: ``SamplingParams.extra_args`` keys its hooks read (its
    ``add_cli_options`` dests count without being named here). ``drafted_extra_args``:
    ``extra_args`` keys (its own, set by the user or by its ``preprocess_request``) whose
    logits hooks handle a speculating step's rows, a request checking k guesses having k + 1
    (each row's output from ``batch.exact_output_token_ids()``): a request carrying other
    ``extra_args`` keys gets no guesses under speculative decoding.
    """

    sampling_params: tuple[str, ...] = ()
    modalities: tuple[str, ...] = ()
    extra_args: tuple[str, ...] = ()
    drafted_extra_args: tuple[str, ...] = ()
