"""The previous release's hook names and argument lists, still served for this release.

A plugin implementing one (``request_finished``, ``preprocess_request(request, tokenizer,
model_config)``, ``register_tool_parsers``, ...) keeps working: as it is registered,
:func:`current_hooks` stands each such implementation in for the current hook, calling it the
old way, and a ``DeprecationWarning`` names the hook to implement instead.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, Callable

import pluggy
from pluggy._hooks import varnames

from hookllm.plugins import hookspecs
from hookllm.plugins.components import Components

# Arguments the hooks no longer pass because the context holds them: how to read each from it.
FROM_CONTEXT: dict[str, Callable[[Any], Any]] = {
    "tokenizer": lambda context: context.tokenizer,
    "model_config": lambda context: context.model_config,
    "registry": lambda context: context.registry,
}
_IMPL_MARK = hookspecs.PROJECT_NAME + "_impl"


@dataclass(frozen=True)
class DeprecatedHook:
    """An old hook: its name, the arguments it passed, and the current hook that replaces it.
    ``registers`` (old registration hooks) adds each entry of its ``{name: component}`` answer
    to the plugin's :class:`hookllm.plugins.components.Components`."""

    name: str
    arguments: tuple[str, ...]
    replacement: str
    registers: Callable[[Components, str, Any], None] | None = None

    def describes(self, argnames: tuple[str, ...]) -> bool:
        """Whether an implementation named ``self.name`` taking ``argnames`` is this old hook's:
        a renamed hook's always; a hook whose arguments changed, when it takes an old one."""
        return self.name != self.replacement or not set(argnames) <= set(_spec_arguments(self.replacement))

    def adapt(self, implementation: Callable[..., Any]) -> Callable[..., Any]:
        """An implementation of the replacement that calls ``implementation`` as the old hook did."""
        old_args = varnames(implementation)[0]
        unknown = [arg for arg in old_args if arg not in self.arguments]
        if unknown:
            raise pluggy.PluginValidationError(
                implementation, f"{self.name} takes no argument(s) {', '.join(unknown)}: its arguments are "
                                f"{', '.join(self.arguments)}")
        new_args = _spec_arguments(self.replacement)

        def replacement(*args: Any) -> Any:
            given = dict(zip(new_args, args))
            result = implementation(*(given[arg] if arg in given else FROM_CONTEXT[arg](given["context"])
                                      for arg in old_args))
            if self.registers is None:
                return result
            for name, component in (result or {}).items():
                self.registers(given["components"], name, component)
            return None

        # pluggy reads an implementation's argument names through __wrapped__: the replacement's.
        replacement.__wrapped__ = getattr(hookspecs, self.replacement)  # type: ignore[attr-defined]
        opts = dict(getattr(implementation, _IMPL_MARK))
        opts["specname"] = None
        setattr(replacement, _IMPL_MARK, opts)
        return replacement


def _spec_arguments(hook: str) -> tuple[str, ...]:
    return varnames(getattr(hookspecs, hook))[0]


DEPRECATED_HOOKS: dict[str, DeprecatedHook] = {hook.name: hook for hook in (
    DeprecatedHook("request_finished", ("request", "model", "context"), "worker_request_finished"),
    DeprecatedHook("request_completed", ("output", "context"), "engine_request_finished"),
    DeprecatedHook("preprocess_request", ("request", "tokenizer", "model_config", "context"), "preprocess_request"),
    DeprecatedHook("render_content_part", ("part", "model_config", "context"), "render_content_part"),
    DeprecatedHook("load_model", ("model_config", "device", "dtype", "registry", "context"), "load_model"),
    DeprecatedHook("register_tool_parsers", (), "register_components", Components.add_tool_parser),
    DeprecatedHook("register_reasoning_parsers", (), "register_components", Components.add_reasoning_parser),
    DeprecatedHook("register_quantization_methods", (), "register_components", Components.add_quantization_method),
    DeprecatedHook("register_structured_output_backends", (), "register_components",
                   Components.add_structured_output_backend),
)}


def _hook_implementations(plugin: Any) -> dict[str, Callable[..., Any]]:
    """Attribute name -> implementation, for each of ``plugin``'s hook implementations (found
    as pluggy finds them)."""
    parser = pluggy.PluginManager(hookspecs.PROJECT_NAME)
    return {attr: getattr(plugin, attr) for attr in dir(plugin) if parser.parse_hookimpl_opts(plugin, attr) is not None}


def current_hooks(plugin: Any, name: str) -> Any:
    """``plugin`` itself, or, when it implements old hooks, a stand-in holding its hooks under
    their current names (each old one adapted), after a ``DeprecationWarning`` per old hook."""
    hooks = _hook_implementations(plugin)
    old_ones = {}
    for attr, implementation in hooks.items():
        old = DEPRECATED_HOOKS.get(getattr(implementation, _IMPL_MARK).get("specname") or attr)
        if old is not None and old.describes(varnames(implementation)[0]):
            old_ones[attr] = old
    if not old_ones:
        return plugin
    for attr, old in old_ones.items():
        warnings.warn(f"plugin {name!r} implements the hook {old.name}{_signature(old.arguments)}, deprecated: "
                      f"implement {old.replacement}{_signature(_spec_arguments(old.replacement))} instead",
                      DeprecationWarning, stacklevel=3)
        adapted = old.adapt(hooks.pop(attr))
        if old.replacement in hooks:  # several old registration hooks, or old and new ones
            adapted = _chained(hooks[old.replacement], adapted, old.replacement)
        hooks[old.replacement] = adapted
    return _CurrentHooks(hooks)


class _CurrentHooks:
    """A plugin's hooks under their current names: what pluggy registers for a plugin that
    implements old ones (hashable, as pluggy needs, unlike a SimpleNamespace)."""

    def __init__(self, hooks: dict[str, Callable[..., Any]]):
        vars(self).update(hooks)


def _chained(first: Callable[..., Any], then: Callable[..., Any], hook: str) -> Callable[..., Any]:
    """One implementation of ``hook`` (a hook whose results are not used) calling two: a plugin
    implementing a hook under its old and its new name, or several old registration hooks."""
    spec_args = _spec_arguments(hook)

    def both(*args: Any) -> None:
        given = dict(zip(spec_args, args))
        for implementation in (first, then):
            implementation(*(given[arg] for arg in varnames(implementation)[0]))

    both.__wrapped__ = getattr(hookspecs, hook)  # type: ignore[attr-defined]
    setattr(both, _IMPL_MARK, getattr(then, _IMPL_MARK))
    return both


def _signature(arguments: tuple[str, ...]) -> str:
    return f"({', '.join(arguments)})"
