"""``python -m hookllm``: the ``hookllm`` command."""

from hookllm.entrypoints.cli import console_main

console_main()
