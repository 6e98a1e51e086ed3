"""Adapters bundled with hookllm, each a plugin registered in hookllm's own entry points."""
