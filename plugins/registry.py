"""Architecture name -> model class, filled by every installed plugin's ``register_models``.

A plugin registers architectures by name (a *native* implementation), or a *fallback*: one
class for every architecture a predicate claims (the bundled ``transformers`` plugin claims the
models transformers implements). An architecture goes to its native registration first and
to a fallback only when no plugin registers it by name, unless ``model_impl`` says otherwise.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Callable, Iterable

# ``model_impl`` values with a fixed meaning; any other value names the plugin of a fallback.
AUTO, NATIVE = "auto", "native"


@dataclass(frozen=True)
class Fallback:
    """A plugin's class for every architecture ``claims`` accepts; ``description`` says which."""

    target: Any  # a class, or a function architecture -> class; either may be given as "module:name"
    claims: Callable[[str], bool]
    description: str


class ModelRegistry:
    def __init__(self) -> None:
        # architecture -> {plugin name: class or "module:Class"}
        self._entries: dict[str, dict[str, Any]] = {}
        self._fallbacks: dict[str, Fallback] = {}

    def register(self, architecture: str, target: Any, *, plugin: str = "core") -> None:
        self._entries.setdefault(architecture, {})[plugin] = target

    def register_fallback(self, target: Any, claims: Callable[[str], bool], *, plugin: str = "core",
                          description: str = "") -> None:
        """``target`` serves every architecture for which ``claims(architecture)`` is true and no
        plugin registers by name (or all of them, under ``model_impl=plugin``)."""
        self._fallbacks[plugin] = Fallback(target, claims, description)

    def scoped(self, plugin: str) -> "ScopedRegistry":
        """A view whose ``register`` records ``plugin`` as the owner."""
        return ScopedRegistry(self, plugin)

    @property
    def architectures(self) -> list[str]:
        """The architectures registered by name (fallbacks claim theirs on demand)."""
        return sorted(self._entries)

    @property
    def fallbacks(self) -> dict[str, str]:
        """Plugin -> description of each registered fallback."""
        return {plugin: fallback.description for plugin, fallback in sorted(self._fallbacks.items())}

    def owners(self, architecture: str) -> list[str]:
        """The plugins registering ``architecture`` by name."""
        return sorted(self._entries.get(architecture, {}))

    def fallback_owners(self, architecture: str) -> list[str]:
        """The plugins whose fallback claims ``architecture``."""
        return [plugin for plugin, fallback in sorted(self._fallbacks.items()) if fallback.claims(architecture)]

    def architectures_of(self, plugin: str) -> list[str]:
        return sorted(a for a, owners in self._entries.items() if plugin in owners)

    def owner(self, architecture: str, selected: Iterable[str] = (), model_impl: str = AUTO) -> str:
        """The plugin whose class serves ``architecture``; ``ValueError`` when there is none or no
        single choice.

        ``model_impl``: ``"auto"``, a native registration if there is one, else a fallback that
        claims it; ``"native"``, native registrations only; a plugin name, that plugin's
        fallback. Among several candidates, the one of them that is ``selected`` wins.
        Fallbacks are asked only when needed (a claim may import a large library).
        """
        native = self.owners(architecture)
        if model_impl not in (AUTO, NATIVE):
            if model_impl not in self._fallbacks:
                raise ValueError(f"model_impl={model_impl!r} cannot serve architecture {architecture!r}: "
                                 f"plugin {model_impl!r} is not an installed fallback plugin")
            if not self._fallbacks[model_impl].claims(architecture):
                raise ValueError(f"model_impl={model_impl!r} cannot serve architecture {architecture!r}: "
                                 f"plugin {model_impl!r} does not claim it")
            return model_impl
        if model_impl == NATIVE and not native:
            fallbacks = self.fallback_owners(architecture)
            raise ValueError(
                f"model_impl='native': no installed plugin implements architecture {architecture!r} natively"
                + (f"; {', '.join(fallbacks)} serves it as a fallback (model_impl='auto' or "
                   f"{fallbacks[0]!r})" if fallbacks else ""))
        candidates = native or self.fallback_owners(architecture)
        if not candidates:
            raise ValueError(
                f"no installed plugin serves architecture {architecture!r}; "
                f"known architectures: {', '.join(self.architectures) or 'none'}"
                + "".join(f"; plugin {plugin!r} serves {fallback.description}"
                          for plugin, fallback in sorted(self._fallbacks.items()))
            )
        chosen = candidates if len(candidates) == 1 else [o for o in candidates if o in set(selected)]
        if len(chosen) != 1:
            raise ValueError(
                f"architecture {architecture!r} is registered by several plugins ({', '.join(candidates)}); "
                "select exactly one of them with --plugin / LLM(plugins=[...])"
            )
        return chosen[0]

    def resolve(self, architecture: str, plugin: str | None = None) -> type:
        """The class for ``architecture`` of ``plugin``, the plugin :meth:`owner` chose (by default
        asked here): its registration by name, else its fallback, whose claim ``owner`` checked."""
        plugin = plugin or self.owner(architecture)
        native = self._entries.get(architecture, {}).get(plugin)
        target = _load(native or self._fallbacks[plugin].target)
        if native is None and not isinstance(target, type):
            target = _load(target(architecture))  # a fallback picking the class by architecture
        return target

    def explain(self, architecture: str, selected: Iterable[str] = ()) -> str:
        """Who serves ``architecture`` under ``model_impl='auto'`` and why, in a phrase."""
        native = self.owners(architecture)
        try:
            owner = self.owner(architecture, selected)
        except ValueError:
            return f"several plugins ({', '.join(native)}): select one" if native else "no installed plugin"
        return f"{owner} ({'native' if owner in native else 'fallback'})"


class ScopedRegistry:
    """What ``register_models`` receives: ``register`` records the calling plugin as the owner."""

    def __init__(self, registry: ModelRegistry, plugin: str):
        self._registry, self._plugin = registry, plugin

    def register(self, architecture: str, target: Any) -> None:
        self._registry.register(architecture, target, plugin=self._plugin)

    def register_fallback(self, target: Any, claims: Callable[[str], bool], description: str = "") -> None:
        """Serve every architecture ``claims`` accepts that no plugin registers by name (see
        :meth:`ModelRegistry.register_fallback`)."""
        self._registry.register_fallback(target, claims, plugin=self._plugin, description=description)


def _load(target: Any) -> Any:
    """``target``, imported first if it is a "module:name" string."""
    if isinstance(target, str):
        module, _, name = target.partition(":")
        return getattr(importlib.import_module(module), name)
    return target
