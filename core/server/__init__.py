"""``hookllm serve``: an OpenAI-compatible HTTP server over :class:`hookllm.engine.async_llm.AsyncLLM`.

``hookllm.server.app.build_app(engine, settings)`` builds the FastAPI app from the routers of the
``serving_*`` modules over one ``state.ServerState``; ``hookllm.server.cli`` holds the ``serve`` /
``complete`` / ``chat`` subcommands (importing it does not import FastAPI).
"""
