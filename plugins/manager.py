"""Finding installed plugins (entry-point group ``hookllm.plugins``) and choosing the active set.

Every installed plugin contributes to ``register_models``; the other hooks run only for the
active plugins: those the user selected, the one that registered the checkpoint's
architecture, and the core defaults. A plugin that fails to load is kept with its error, so it
can be listed and reported when selected, and never takes down the others.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from importlib import metadata
from types import ModuleType
from typing import Any, Iterable

import pluggy

from hookllm.plugins import defaults, hookspecs
from hookllm.registry import ModelRegistry

ENTRY_POINT_GROUP = "hookllm.plugins"
CORE_PLUGIN = "core"


@dataclass
class PluginInfo:
    name: str
    module: ModuleType | None
    distribution: str = ""
    version: str = ""
    error: str | None = None
    hooks: list[str] = field(default_factory=list)
    architectures: list[str] = field(default_factory=list)


def _hook_names(module: ModuleType) -> list[str]:
    return sorted(
        name for name in dir(module)
        if getattr(getattr(module, name), hookspecs.PROJECT_NAME + "_impl", None) is not None
    )


def _validate(info: PluginInfo) -> None:
    known = {name for name in dir(hookspecs) if hasattr(getattr(hookspecs, name), hookspecs.PROJECT_NAME + "_spec")}
    unknown = [h for h in info.hooks if h not in known]
    if unknown:
        raise ValueError(
            f"plugin {info.name!r} implements unknown hook(s) {', '.join(unknown)}; "
            f"the hooks are: {', '.join(sorted(known))}"
        )


def _allowed_names() -> set[str] | None:
    """HOOKLLM_PLUGINS=a,b limits which entry points load; empty means none."""
    value = os.environ.get("HOOKLLM_PLUGINS")
    if value is None:
        return None
    return {name.strip() for name in value.split(",") if name.strip()}


def discover_plugins() -> dict[str, PluginInfo]:
    """Import every allowed entry point of the group, keeping load errors instead of raising."""
    allowed = _allowed_names()
    plugins: dict[str, PluginInfo] = {}
    for ep in metadata.entry_points(group=ENTRY_POINT_GROUP):
        if ep.name in plugins or (allowed is not None and ep.name not in allowed):
            continue
        dist = getattr(ep, "dist", None)
        info = PluginInfo(ep.name, None, dist.metadata["Name"] if dist else "", dist.version if dist else "")
        try:
            info.module = ep.load()
            info.hooks = _hook_names(info.module)
            _validate(info)
        except Exception as exc:  # noqa: BLE001 - any import failure is reported, not raised
            info.module = None
            info.error = f"{type(exc).__name__}: {exc}"
        plugins[ep.name] = info
    return plugins


class PluginManager:
    """All installed plugins, the model registry they fill, and hook callers for an active set."""

    def __init__(self, plugins: dict[str, PluginInfo] | None = None):
        self.plugins = discover_plugins() if plugins is None else plugins
        self.registry = ModelRegistry()
        registrations = pluggy.PluginManager(hookspecs.PROJECT_NAME)
        registrations.add_hookspecs(hookspecs)
        for info in self.loaded():
            registrations.register(info.module, name=info.name)
        for impl in registrations.hook.register_models.get_hookimpls():
            impl.function(registry=self.registry.scoped(impl.plugin_name))
        for info in self.loaded():
            info.architectures = self.registry.architectures_of(info.name)
        self.all_plugins = registrations  # add_cli_options runs on every installed plugin

    def loaded(self) -> list[PluginInfo]:
        return [info for info in self.plugins.values() if info.module is not None]

    def check_selected(self, names: Iterable[str]) -> list[str]:
        """Validate user-selected plugin names: unknown or broken ones raise ``ValueError``."""
        names = list(dict.fromkeys(names))
        for name in names:
            info = self.plugins.get(name)
            if info is None:
                installed = ", ".join(sorted(self.plugins)) or "none"
                raise ValueError(f"unknown plugin {name!r}; installed plugins: {installed}")
            if info.error:
                raise ValueError(f"plugin {name!r} failed to load: {info.error}")
        return names

    def model_owner(self, architecture: str, selected: list[str]) -> str:
        """The plugin whose class serves ``architecture``: a selected one wins a conflict."""
        owners = self.registry.owners(architecture)
        if not owners:
            raise ValueError(
                f"no installed plugin serves architecture {architecture!r}; "
                f"known architectures: {', '.join(self.registry.architectures) or 'none'}"
            )
        if len(owners) == 1:
            return owners[0]
        chosen = [o for o in owners if o in selected]
        if len(chosen) == 1:
            return chosen[0]
        raise ValueError(
            f"architecture {architecture!r} is registered by several plugins ({', '.join(owners)}); "
            "select exactly one of them with --plugin / LLM(plugins=[...])"
        )

    def active_hooks(self, names: list[str]) -> "HookCaller":
        """Hook callers over the named plugins plus the core defaults (registered ``trylast``)."""
        pm = pluggy.PluginManager(hookspecs.PROJECT_NAME)
        pm.add_hookspecs(hookspecs)
        pm.register(defaults, name=CORE_PLUGIN)
        for name in dict.fromkeys(names):
            pm.register(self.plugins[name].module, name=name)
        return HookCaller(pm)


class HookCaller:
    """Calls hooks of one active plugin set; ``call_first`` also says which plugin answered."""

    def __init__(self, pm: pluggy.PluginManager):
        self.pm = pm
        self.hook = pm.hook

    @property
    def plugin_names(self) -> list[str]:
        return [name for name, _ in self.pm.list_name_plugin()]

    def call_first(self, hook_name: str, **kwargs: Any) -> tuple[Any, str | None]:
        """Run a firstresult hook in pluggy's order; return (result, plugin name) of the first non-None."""
        for impl in reversed(getattr(self.hook, hook_name).get_hookimpls()):
            result = impl.function(**{k: kwargs[k] for k in impl.argnames})
            if result is not None:
                return result, impl.plugin_name
        return None, None
