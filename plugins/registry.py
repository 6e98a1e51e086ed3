"""Architecture name -> model class, filled by every installed plugin's ``register_models``."""

from __future__ import annotations

import importlib
from typing import Any


class ModelRegistry:
    def __init__(self) -> None:
        # architecture -> {plugin name: class or "module:Class"}
        self._entries: dict[str, dict[str, Any]] = {}

    def register(self, architecture: str, target: Any, *, plugin: str = "core") -> None:
        self._entries.setdefault(architecture, {})[plugin] = target

    def scoped(self, plugin: str) -> "ScopedRegistry":
        """A view whose ``register`` records ``plugin`` as the owner."""
        return ScopedRegistry(self, plugin)

    @property
    def architectures(self) -> list[str]:
        return sorted(self._entries)

    def owners(self, architecture: str) -> list[str]:
        return sorted(self._entries.get(architecture, {}))

    def architectures_of(self, plugin: str) -> list[str]:
        return sorted(a for a, owners in self._entries.items() if plugin in owners)

    def resolve(self, architecture: str, plugin: str | None = None) -> type:
        """The class for ``architecture``; ``plugin`` picks among several registrations."""
        owners = self._entries.get(architecture)
        if not owners:
            raise ValueError(
                f"no plugin registers architecture {architecture!r}; known: {', '.join(self.architectures) or 'none'}"
            )
        if plugin is None:
            if len(owners) > 1:
                raise ValueError(
                    f"architecture {architecture!r} is registered by several plugins "
                    f"({', '.join(sorted(owners))}); select one with --plugin"
                )
            (plugin,) = owners
        target = owners[plugin]
        if isinstance(target, str):
            module, _, name = target.partition(":")
            target = getattr(importlib.import_module(module), name)
        return target


class ScopedRegistry:
    def __init__(self, registry: ModelRegistry, plugin: str):
        self._registry, self._plugin = registry, plugin

    def register(self, architecture: str, target: Any) -> None:
        self._registry.register(architecture, target, plugin=self._plugin)
