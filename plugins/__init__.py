"""The hook system: hookspecs, plugin discovery through entry points, and the core defaults."""

from hookllm.plugins.hookspecs import hookimpl, hookspec, PROJECT_NAME

__all__ = ["hookimpl", "hookspec", "PROJECT_NAME"]
