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
from typing import Iterable

import pluggy

from hookllm.plugins import defaults, hookspecs
from hookllm.plugins.registry import ModelRegistry

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


def _new_plugin_manager() -> pluggy.PluginManager:
    pm = pluggy.PluginManager(hookspecs.PROJECT_NAME)
    pm.add_hookspecs(hookspecs)
    return pm


def _check_hooks(name: str, module: ModuleType) -> list[str]:
    """The hooks ``module`` implements. ``ValueError`` for an implementation of no known hook
    (pluggy's ``check_pending``) or one taking arguments its hook does not pass."""
    pm = _new_plugin_manager()
    try:
        pm.register(module, name=name)
        callers = pm.get_hookcallers(module) or []
        unknown = [caller.name for caller in callers if not caller.has_spec()]
        if unknown:
            known = sorted(n for n, f in vars(hookspecs).items() if pm.parse_hookspec_opts(hookspecs, n))
            raise ValueError(f"plugin {name!r} implements unknown hook(s) {', '.join(unknown)}; "
                             f"the hooks are: {', '.join(known)}")
        pm.check_pending()
    except pluggy.PluginValidationError as exc:
        raise ValueError(f"plugin {name!r}: {exc}") from None
    return sorted(caller.name for caller in callers)


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
            info.hooks = _check_hooks(ep.name, info.module)
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
        registrations = _new_plugin_manager()
        for info in self.loaded():
            registrations.register(info.module, name=info.name)
        for info in self.loaded():
            # One plugin at a time, so each registration is recorded under its plugin's name.
            others = [other.module for other in self.loaded() if other is not info]
            register = registrations.subset_hook_caller("register_models", remove_plugins=others)
            register(registry=self.registry.scoped(info.name))
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

    def active_hooks(self, names: list[str]) -> "ActiveHooks":
        """The hooks of the named plugins plus the core defaults (registered ``trylast``)."""
        pm = _new_plugin_manager()
        pm.register(defaults, name=CORE_PLUGIN)
        for name in dict.fromkeys(names):
            pm.register(self.plugins[name].module, name=name)
        return ActiveHooks(pm)


class ActiveHooks:
    """The hooks of one engine's active plugins: ``hooks.hook.NAME(**kwargs)`` calls them through pluggy."""

    def __init__(self, pm: pluggy.PluginManager):
        self.pm = pm
        self.hook = pm.hook

    @property
    def plugin_names(self) -> list[str]:
        return [name for name, _ in self.pm.list_name_plugin()]

    def overriding_plugins(self, hook_name: str) -> str:
        """The plugins other than the core implementing ``hook_name``, in pluggy's call order, as
        a phrase for an error message: the core defaults keep their contracts, so a firstresult
        hook's result that breaks one came from one of these."""
        impls = reversed(getattr(self.hook, hook_name).get_hookimpls())
        names = [repr(impl.plugin_name) for impl in impls if impl.plugin_name != CORE_PLUGIN]
        return f"plugin {names[0]}" if len(names) == 1 else "one of the plugins " + ", ".join(names)
