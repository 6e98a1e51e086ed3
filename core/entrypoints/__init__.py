"""Entry points: the offline ``LLM`` API, the ``hookllm`` command line, chat rendering."""
