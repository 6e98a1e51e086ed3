"""Hook-only plugins shipped with hookllm: structured output (llguidance), FP8 quantization, and
the tool-call and reasoning parsers. Each is a plugin like any pip-installed one: pyproject.toml
lists it under the ``hookllm.plugins`` entry points, and it uses only the public hook API of
:mod:`hookllm.plugins`; nothing in the core imports it."""
