"""Finding installed plugins (entry-point group ``hookllm.plugins``) and choosing the active set.

Every installed plugin contributes to the hooks of scope ``"installed"`` (``register_models``,
``register_components``, ``claim_request_parameters``, ``add_cli_options``); the other hooks run
only for the active plugins: those the user selected, the one that registered the checkpoint's
architecture, and the core defaults (of scope ``"model"``: of the adapters, only the one serving
the checkpoint). A plugin implementing hooks under their previous names is registered through
:func:`hookllm.plugins.deprecated_hooks.current_hooks`. A
plugin that fails to load is kept with its error, so it can be listed and reported when
selected, and never takes down the others.

A plugin is a module or a class. A class is instantiated (without arguments) each time an
engine's active hooks are built, so its instance is that engine's alone.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import os
from dataclasses import dataclass, field
from importlib import metadata
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, Callable, Iterable

import pluggy

from hookllm.plugins import hookspecs
from hookllm.plugins.components import ComponentKind, Components
from hookllm.spec.proposer import SpecProposers
from hookllm.plugins.context import EngineContext, RequestParameters
from hookllm.plugins.deprecated_hooks import DEPRECATED_HOOKS, current_hooks
from hookllm.plugins.registry import ModelRegistry
from hookllm.sampling_params import SamplingParams

if TYPE_CHECKING:
    from hookllm.engine.core_request import EngineCoreRequest

ENTRY_POINT_GROUP = "hookllm.plugins"
CORE_PLUGIN = "core"
# SamplingParams fields the core carries but never acts on: a plugin must take them (or their
# extra_args spelling) in preprocess_request, else the request is refused.
PLUGIN_FIELDS = ("structured_outputs",)
_DEFAULT_PARAMS = SamplingParams()
_NO_DEFAULT = object()  # an extra_args key a plugin names outright: any value needs the plugin


@dataclass
class PluginInfo:
    name: str
    module: Any  # the plugin: a module or a class (None when it failed to load)
    distribution: str = ""
    version: str = ""
    error: str | None = None
    hooks: list[str] = field(default_factory=list)
    architectures: list[str] = field(default_factory=list)
    parameters: RequestParameters = field(default_factory=RequestParameters)
    # extra_args keys from its add_cli_options dests -> the flag's default (what the CLI sends unasked)
    option_defaults: dict[str, Any] = field(default_factory=dict)
    # What its register_components registered: tool parsers, quantization methods, ...
    components: Components = field(default_factory=Components)

    def structured_output_kinds(self) -> set[str]:
        """The ``structured_outputs`` kinds (``json``, ``regex``, ...) the plugin's backends enforce."""
        return {kind for kinds in self.components.by_kind[ComponentKind.STRUCTURED_OUTPUT_BACKEND].values()
                for kind in kinds}


class _HookManager(pluggy.PluginManager):
    """pluggy's manager of hookllm's hooks; a plugin implementing hooks under their previous
    names is registered with them standing in for the current ones."""

    def register(self, plugin: Any, name: str | None = None) -> str | None:
        return super().register(current_hooks(plugin, name), name)


def _new_plugin_manager() -> pluggy.PluginManager:
    pm = _HookManager(hookspecs.PROJECT_NAME)
    pm.add_hookspecs(hookspecs)
    return pm


def _check_hooks(name: str, plugin: Any) -> list[str]:
    """The hooks ``plugin`` implements. ``ValueError`` for an implementation of no known hook
    (pluggy's ``check_pending``), one taking arguments its hook does not pass, or a class
    plugin's installed-wide hook that needs an instance."""
    pm = _new_plugin_manager()
    try:
        pm.register(plugin, name=name)
        callers = pm.get_hookcallers(pm.get_plugin(name)) or []
        unknown = [caller.name for caller in callers if not caller.has_spec()]
        if unknown:
            known = sorted(hookspecs.placements())
            raise ValueError(f"plugin {name!r} implements unknown hook(s) {', '.join(unknown)}; "
                             f"the hooks are: {', '.join(known)}")
        pm.check_pending()
    except pluggy.PluginValidationError as exc:
        raise ValueError(f"plugin {name!r}: {exc}") from None
    hooks = sorted(caller.name for caller in callers)
    if inspect.isclass(plugin):
        installed = hookspecs.hooks_in_scope("installed")
        installed |= {old.name for old in DEPRECATED_HOOKS.values() if old.replacement in installed}
        bound = [hook for hook in sorted(installed) if hasattr(plugin, hook)
                 and not isinstance(inspect.getattr_static(plugin, hook), (staticmethod, classmethod))]
        if bound:
            raise ValueError(f"plugin {name!r}: {', '.join(bound)} run before any engine (so any instance) exists: "
                             "make them @staticmethod or @classmethod")
    return hooks


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


def _option_defaults(add_cli_options: pluggy.HookCaller) -> dict[str, Any]:
    """The dests of the flags ``add_cli_options`` adds, with their defaults."""
    parser = argparse.ArgumentParser(add_help=False)
    add_cli_options(parser=parser)
    return vars(parser.parse_known_args([])[0])


class PluginManager:
    """All installed plugins, the model registry and request parameters they declare, and the
    hooks of an active set."""

    def __init__(self, plugins: dict[str, PluginInfo] | None = None):
        self.plugins = discover_plugins() if plugins is None else plugins
        self.registry = ModelRegistry()
        registrations = _new_plugin_manager()
        for info in self.loaded():
            registrations.register(info.module, name=info.name)
        for info in self.loaded():
            # One plugin at a time, so each declaration is recorded under its plugin's name.
            others = [registrations.get_plugin(other.name) for other in self.loaded() if other is not info]
            alone = lambda hook: registrations.subset_hook_caller(hook, remove_plugins=others)  # noqa: E731
            alone("register_models")(registry=self.registry.scoped(info.name))
            info.architectures = self.registry.architectures_of(info.name)
            info.option_defaults = _option_defaults(alone("add_cli_options"))
            declared = [p for p in alone("claim_request_parameters")() if p is not None]
            info.parameters = RequestParameters(*(
                tuple(dict.fromkeys(name for p in declared for name in getattr(p, part.name)))
                for part in dataclasses.fields(RequestParameters)))
            info.components = Components()
            alone("register_components")(components=info.components)
            alone("register_spec_proposers")(proposers=SpecProposers(info.components))
        self.all_plugins = registrations  # add_cli_options runs on every installed plugin

    def loaded(self) -> list[PluginInfo]:
        return [info for info in self.plugins.values() if info.module is not None]

    def component(self, kind: ComponentKind, name: str) -> Any:
        """The ``kind`` an installed plugin registers as ``name``; ``ValueError`` naming the
        registered ones when none or several do."""
        owners = [info for info in self.loaded() if name in info.components.by_kind[kind]]
        if len(owners) == 1:
            return owners[0].components.by_kind[kind][name]
        what = kind.value
        if owners:
            raise ValueError(f"{what} {name!r} is registered by several plugins: "
                             f"{', '.join(info.name for info in owners)}")
        known = sorted({named for info in self.loaded() for named in info.components.by_kind[kind]})
        raise ValueError(f"no installed plugin provides a {what} named {name!r}; "
                         f"the {what}s: {', '.join(known) or 'none'}")

    def structured_output_plugins(self, kind: str) -> list[str]:
        """The installed plugins whose structured output backends enforce ``kind`` (``json``: a
        JSON schema), by name."""
        return sorted(info.name for info in self.loaded() if kind in info.structured_output_kinds())

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

    def active_hooks(self, names: list[str], core: Any, context: EngineContext) -> "ActiveHooks":
        """The hooks of the named plugins (each class plugin instantiated for this engine) plus
        ``core``, the core's default implementations (registered ``trylast`` by their marks).
        ``context.model_config.plugin`` is the checkpoint's adapter: the other active adapters
        are left out of the model-scoped hooks."""
        pm = _new_plugin_manager()
        pm.register(core, name=CORE_PLUGIN)
        owner = context.model_config.plugin
        other_adapters = []
        for name in dict.fromkeys(names):
            plugin = self.plugins[name].module
            plugin = plugin() if inspect.isclass(plugin) else plugin
            pm.register(plugin, name=name)
            if self.plugins[name].architectures and name != owner:
                other_adapters.append(pm.get_plugin(name))
        return ActiveHooks(pm, context, self.plugins, other_adapters)


class ActiveHooks:
    """The hooks of one engine's active plugins: ``hooks.hook.NAME(**kwargs)`` calls them through
    pluggy; ``hooks.context`` is the engine's :class:`hookllm.plugins.context.EngineContext`."""

    def __init__(self, pm: pluggy.PluginManager, context: EngineContext, installed: dict[str, PluginInfo],
                 other_adapters: list[Any]):
        self.pm = pm
        self.context = context
        # What check_claimed reads for every request, worked out once per engine.
        self.loaded = [info for info in installed.values() if info.module is not None]
        self.active_names = frozenset(name for name, _ in pm.list_name_plugin())
        self.checked_fields = tuple(dict.fromkeys(
            [*PLUGIN_FIELDS, *(name for info in self.loaded for name in info.parameters.sampling_params)]))
        model_scoped = hookspecs.hooks_in_scope("model")
        self.hook = SimpleNamespace(**{
            name: pm.subset_hook_caller(name, other_adapters) if name in model_scoped else caller
            for name, caller in vars(pm.hook).items()})

    @property
    def drafted_extra_args(self) -> frozenset[str]:
        """The ``extra_args`` keys whose active plugins handle drafted rows (``RequestParameters``)."""
        return frozenset(key for info in self.loaded if info.name in self.active_names
                         for key in info.parameters.drafted_extra_args)

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

    def check_claimed(self, request: EngineCoreRequest) -> None:
        """Refuse ``request`` (``ValueError``) if it carries a parameter that no active plugin
        handles; called once the ``preprocess_request`` hooks have run. See the
        ``claim_request_parameters`` hookspec for the rule."""
        params = request.sampling_params
        for name in self.checked_fields:
            if name in params.extra_args or getattr(params, name, None) != getattr(_DEFAULT_PARAMS, name, None):
                self._refuse(request, name, lambda info: name in info.parameters.sampling_params)
        data = request.multi_modal_data or {}
        taken = {item.modality for item in request.mm_items}
        for modality in sorted(m for m, items in data.items() if items and m not in taken):
            self._refuse(request, f"multi_modal_data {modality!r}", lambda info: modality in info.parameters.modalities)
        for key, value in params.extra_args.items():
            owners = [info for info in self.loaded if self._claims_key(info, key, value)]
            if owners and not any(info.name in self.active_names for info in owners):
                self._refuse(request, f"extra_args key {key!r}", lambda info: info in owners)

    @staticmethod
    def _claims_key(info: PluginInfo, key: str, value: Any) -> bool:
        """Whether ``key=value`` in extra_args needs plugin ``info`` (a flag left at its default does not)."""
        default = info.option_defaults.get(key, _NO_DEFAULT)
        return key in info.parameters.extra_args or (default is not _NO_DEFAULT and value != default)

    def _refuse(self, request: EngineCoreRequest, parameter: str, handles: Callable[[PluginInfo], bool]) -> None:
        """``ValueError``: ``parameter`` of ``request`` is left over; names the installed plugins
        that ``handles`` it and why none of them took it."""
        owner = self.context.model_config.plugin
        handlers = [info for info in self.loaded if handles(info)]
        inactive = [info.name for info in handlers if info.name not in self.active_names]
        hints = [f"plugin {info.name!r} serves only {', '.join(info.architectures)}"
                 for info in handlers if info.name in self.active_names and info.architectures and info.name != owner]
        if inactive:
            hints.append("select one with " + " / ".join(f"--plugin {name} / LLM(plugins=[{name!r}])"
                                                         for name in inactive))
        raise ValueError(f"request {request.request_id}: no active plugin takes {parameter} for "
                         f"{self.context.model_config.architecture}; "
                         + ("; ".join(hints) or "no installed plugin handles it"))
