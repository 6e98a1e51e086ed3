"""Architecture name -> model class, filled by every installed plugin's ``register_models``."""

from __future__ import annotations

import importlib
from typing import Any, Iterable


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

    def owner(self, architecture: str, selected: Iterable[str] = ()) -> str:
        """The plugin whose class serves ``architecture``: the only one registering it, else the
        one of them that is ``selected``; ``ValueError`` when there is none or no single choice."""
        owners = self.owners(architecture)
        if not owners:
            raise ValueError(
                f"no installed plugin serves architecture {architecture!r}; "
                f"known architectures: {', '.join(self.architectures) or 'none'}"
            )
        chosen = owners if len(owners) == 1 else [o for o in owners if o in set(selected)]
        if len(chosen) != 1:
            raise ValueError(
                f"architecture {architecture!r} is registered by several plugins ({', '.join(owners)}); "
                "select exactly one of them with --plugin / LLM(plugins=[...])"
            )
        return chosen[0]

    def resolve(self, architecture: str, plugin: str | None = None) -> type:
        """The class for ``architecture``: ``plugin``'s registration, by default its :meth:`owner`'s."""
        target = self._entries.get(architecture, {}).get(plugin or self.owner(architecture))
        if target is None:
            raise ValueError(f"plugin {plugin!r} registers no architecture {architecture!r}")
        if isinstance(target, str):
            module, _, name = target.partition(":")
            target = getattr(importlib.import_module(module), name)
        return target


class ScopedRegistry:
    """What ``register_models`` receives: ``register`` records the calling plugin as the owner."""

    def __init__(self, registry: ModelRegistry, plugin: str):
        self._registry, self._plugin = registry, plugin

    def register(self, architecture: str, target: Any) -> None:
        self._registry.register(architecture, target, plugin=self._plugin)
