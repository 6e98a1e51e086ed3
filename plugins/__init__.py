"""The hook framework: hookspecs, plugin discovery through entry points, the model registry and
the component registries. The core's own default hook implementations live with the worker
(``hookllm.worker.default_hooks``); the bundled hook-only plugins in ``hookllm.bundled``."""

from hookllm.plugins.hookspecs import hookimpl, hookspec, PROJECT_NAME

__all__ = ["hookimpl", "hookspec", "PROJECT_NAME"]
