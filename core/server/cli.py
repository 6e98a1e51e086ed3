"""The ``serve``, ``complete`` and ``chat`` subcommands of ``hookllm``.

``serve`` takes every engine flag from ``EngineArgs.add_cli_args`` (generated from
``EngineConfig``). ``complete`` and ``chat`` are small clients of a running server that print
tokens as they arrive; they use only the standard library.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import re
import signal
import socket
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Iterator

from hookllm.plugins.components import ComponentKind
from hookllm.engine.arg_utils import DefaultsHelpFormatter, EngineArgs
from hookllm.logging_config import add_log_level_argument, configure_logging
from hookllm.server.lora_registry import parse_lora_module, runtime_updating_allowed
from hookllm.utils import join_or_kill

DEFAULT_URL = "http://127.0.0.1:8000"
# What an API server needs after its drain (--shutdown-timeout) to stop its engine client and exit
# an interpreter that imported torch, on a busy machine; past it, the parent kills it.
SHUTDOWN_MARGIN_S = 30.0

logger = logging.getLogger(__name__)


def add_parsers(subparsers: argparse._SubParsersAction, plugin_parser: argparse.ArgumentParser) -> None:
    """``plugin_parser``: the installed plugins' flags, which ``serve`` takes as request defaults."""
    serve = subparsers.add_parser("serve", help="run an OpenAI-compatible HTTP server", parents=[plugin_parser],
                                  formatter_class=DefaultsHelpFormatter)
    serve.add_argument("model_tag", nargs="?", metavar="MODEL", help="model folder (same as --model)")
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (loopback only by default)")
    serve.add_argument("--port", type=int, default=8000, help="port to listen on")
    serve.add_argument("--served-model-name", action="append", dest="served_model_names", metavar="NAME",
                       help="model name(s) clients use (repeatable; default: the hub id, or the model folder's name)")
    serve.add_argument("--api-key", default=os.environ.get("HOOKLLM_API_KEY") or None,
                       help="require 'Authorization: Bearer KEY' (default: env HOOKLLM_API_KEY)")
    serve.add_argument("--allowed-local-media-path", type=Path, metavar="DIR",
                       help="let chat image_url parts read file:// URLs inside DIR")
    serve.add_argument("--chat-template", metavar="FILE_OR_STRING",
                       help="the chat template (a file, or the Jinja text itself) for chats whose request gives "
                            "none, instead of the tokenizer's; needed for chat on a model without one")
    serve.add_argument("--shutdown-timeout", type=float, default=10.0,
                       help="seconds SIGTERM waits for in-flight requests before aborting them")
    add_log_level_argument(serve)  # uvicorn's too
    serve.add_argument("--enable-log-requests", action="store_true",
                       help="log each request's end (id, prompt and output tokens, finish reason, latency) at "
                            "debug level: shown with --log-level debug")
    serve.add_argument("--disable-log-requests", action="store_false", dest="enable_log_requests",
                       default=argparse.SUPPRESS,
                       help="vLLM's older flag, accepted: requests are not logged unless --enable-log-requests")
    serve.add_argument("--headless", action="store_true",
                       help="with --nnodes: run this node's ranks only (no API server, no engine); every node "
                            "but node 0 runs so")
    serve.add_argument("--grpc-port", type=int, default=None, metavar="PORT",
                       help="also serve vLLM's gRPC engine service (vllm.grpc.engine.VllmEngine), gRPC health and "
                            "reflection on this port, from the same engine (the grpc extra: pip install "
                            "'hookllm[grpc]')")
    serve.add_argument("--no-http", action="store_true", help="with --grpc-port: serve gRPC only (no HTTP port)")
    serve.add_argument("--grpc-max-concurrent-rpcs", type=int, default=1024, metavar="N",
                       help="gRPC calls in flight per API server; more get RESOURCE_EXHAUSTED")
    serve.add_argument("--grpc-max-message-bytes", type=int, default=4 * 1024 * 1024, metavar="BYTES",
                       help="largest gRPC message either way; a larger one gets RESOURCE_EXHAUSTED")
    serve.add_argument("--api-server-count", type=int, default=1, metavar="N",
                       help="API server processes sharing the port and the engine process(es): more than one when "
                            "a single process's event loop cannot keep up with the streams")
    serve.add_argument("--tool-call-parser", metavar="NAME", type=_parser_name(ComponentKind.TOOL_PARSER),
                       help="find chat replies' tool calls with this parser (bundled: hermes, llama3_json; "
                            "plugins add more), for tool_choice 'auto'")
    serve.add_argument("--reasoning-parser", metavar="NAME", type=_parser_name(ComponentKind.REASONING_PARSER),
                       help="split chat replies' reasoning into reasoning_content with this parser "
                            "(bundled: qwen3, deepseek_r1; plugins add more)")
    serve.add_argument("--enable-auto-tool-choice", action="store_true",
                       help="vLLM's flag, accepted so its command lines run: tool_choice 'auto' is on whenever "
                            "--tool-call-parser is given, and this flag without it is an error")
    serve.add_argument("--lora-modules", nargs="+", action="extend", type=parse_lora_module, default=[],
                       metavar="NAME=PATH",
                       help="LoRA adapters (PEFT folders) requests name as their model, with --enable-lora: "
                            "NAME=PATH, or JSON '{\"name\": ..., \"path\": ..., \"base_model_name\": ...}'; "
                            "several values, and the flag repeatable")
    EngineArgs.add_cli_args(serve)

    for name, help_ in (("complete", "stream a completion from a running server"),
                        ("chat", "chat with a running server (interactive without a message)")):
        client = subparsers.add_parser(name, help=help_, formatter_class=DefaultsHelpFormatter)
        client.add_argument("text", nargs="?" if name == "chat" else None, metavar="PROMPT" if name == "complete"
                            else "MESSAGE")
        client.add_argument("--url", default=DEFAULT_URL, help="the server's base URL")
        client.add_argument("--model", default=None, help="model name (default: the server's first)")
        client.add_argument("--api-key", default=os.environ.get("HOOKLLM_API_KEY"))
        client.add_argument("--max-tokens", type=int, default=256)
        client.add_argument("--temperature", type=float, default=0.0)
        if name == "chat":
            client.add_argument("--system", default=None, help="a system message")
            client.add_argument("--grpc", metavar="HOST:PORT", default=None,
                                help="chat over the gRPC engine service (hookllm serve --grpc-port, or vLLM's) "
                                     "instead of HTTP: the chat is rendered and decoded here, with the tokenizer")
            client.add_argument("--tokenizer", default=None,
                                help="with --grpc: the tokenizer's folder or hub id (default: the model the server "
                                     "reports)")


def _parser_name(kind: ComponentKind) -> Any:
    """An argparse ``type``: the name of a ``kind`` that an installed plugin registers."""

    def checked(name: str) -> str:
        from hookllm.server.reply_parsing import installed_plugins

        try:
            installed_plugins().component(kind, name)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
        return name

    return checked


def run_serve(args: argparse.Namespace) -> int:
    from hookllm.engine.async_llm import AsyncLLM
    from hookllm.entrypoints.chat import read_chat_template
    from hookllm.hub import with_local_paths
    from hookllm.server.reply_parsing import installed_plugins
    from hookllm.server.tool_calling import with_json_schema_plugin

    if args.model_tag is not None:
        if args.model is not None and args.model != args.model_tag:
            raise ValueError(f"two models given: {args.model_tag} and --model {args.model}")
        args.model = args.model_tag
    media = args.allowed_local_media_path
    if media is not None and not media.is_dir():
        raise ValueError(f"--allowed-local-media-path {media} is not a folder")
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser NAME (the parser that reads the calls)")
    if args.api_server_count < 1:
        raise ValueError(f"--api-server-count must be >= 1, got {args.api_server_count}")
    if args.lora_modules and not args.enable_lora:
        raise ValueError("--lora-modules needs --enable-lora (the engine serves adapters only with it)")
    if args.headless:
        return _run_headless(args)
    if args.node_rank > 0:
        raise ValueError(f"--node-rank {args.node_rank}: the nodes after node 0 run ranks only: add --headless")
    args.chat_template = read_chat_template(args.chat_template)  # the text from here on
    # The key travels in an HTTP header: an empty one would leave the server open.
    if args.api_key is not None and not re.fullmatch(r"[!-~]+", args.api_key):
        raise ValueError("--api-key must be printable ASCII without spaces (an empty key would leave the server open)")
    _check_grpc_args(args)
    # A busy port is found now, not after the model has loaded.
    sock = None if args.no_http else _listening_socket(args.host, args.port)
    try:
        config = with_local_paths(EngineArgs.from_cli_args(args).create_engine_config())
        config.plugins = with_json_schema_plugin(config.plugins, installed_plugins())
        if args.api_server_count > 1:
            return _run_api_servers(args, config, sock)
        return _serve(args, AsyncLLM.from_engine_config(config), sock)
    finally:  # also when _serve ends with the SystemExit of a SIGTERM
        if sock is not None:
            sock.close()
        _stop_multiprocessing_servers()


def _check_grpc_args(args: argparse.Namespace) -> None:
    """``ValueError`` for gRPC flags that cannot work: --no-http alone, no grpc extra, a busy port."""
    if args.grpc_port is None:
        if args.no_http:
            raise ValueError("--no-http serves gRPC only: it needs --grpc-port PORT")
        return
    try:
        import grpc  # noqa: F401
        import grpc_health  # noqa: F401
        import grpc_reflection  # noqa: F401
    except ImportError as exc:
        raise ValueError(f"--grpc-port needs the grpc extra ({exc.name} is missing): "
                         "pip install 'hookllm[grpc]'") from None
    if not args.no_http and args.grpc_port == args.port:
        raise ValueError(f"--grpc-port {args.grpc_port} is the HTTP --port too: give each its own")
    for name in ("grpc_max_concurrent_rpcs", "grpc_max_message_bytes"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    _listening_socket(args.host, args.grpc_port).close()  # each API server binds it itself, later


def _run_headless(args: argparse.Namespace) -> int:
    """A node of ranks only: no port, no API server; it ends when the engine stops its ranks."""
    from hookllm.hub import with_local_paths
    from hookllm.worker.multinode import run_headless

    if args.nnodes < 2 or args.node_rank == 0:
        raise ValueError(f"--headless runs the ranks of a node after node 0: it needs --nnodes >= 2 and "
                         f"--node-rank >= 1 (got --nnodes {args.nnodes} --node-rank {args.node_rank})")
    return run_headless(with_local_paths(EngineArgs.from_cli_args(args).create_engine_config()))


def _listening_socket(host: str, port: int) -> socket.socket:
    """The server's socket, bound and listening; ``ValueError`` naming the address if it cannot be."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds: restarts need no wait
    try:
        sock.bind((host, port))
        sock.listen()
    except (OSError, OverflowError) as exc:  # OverflowError: a port outside 0-65535
        sock.close()
        raise ValueError(f"cannot listen on {host}:{port}: {getattr(exc, 'strerror', None) or exc}") from None
    return sock


def _serve(args: argparse.Namespace, engine: Any, sock: socket.socket | None,
           api_server: tuple[int, int] = (0, 1)) -> int:
    """Serve ``engine`` (an ``AsyncLLM``) on ``sock`` (bound to ``--host`` and ``--port``, maybe
    shared with other API server processes, ``api_server`` being this one's index and their
    count; None with ``--no-http``), and on ``--grpc-port``, until SIGTERM or SIGINT (status 0),
    or until the engine dies (status 1: its requests have failed with an error; a server that
    cannot serve exits, so a supervisor restarts it)."""
    import threading

    import uvicorn

    from hookllm.hub import short_model_name
    from hookllm.server.app import ServerSettings, build_app

    media = args.allowed_local_media_path
    # The model as typed (a hub id stays one: the config holds its snapshot folder); never its path.
    model = short_model_name(args.model or engine.config.model)
    settings = ServerSettings(served_model_names=args.served_model_names or [model], model_root=model,
                              api_key=args.api_key or None,
                              allowed_local_media_path=media.resolve() if media is not None else None,
                              plugin_options={name: getattr(args, name) for name in args.plugin_options},
                              tool_call_parser=args.tool_call_parser, reasoning_parser=args.reasoning_parser,
                              log_requests=args.enable_log_requests, chat_template=args.chat_template,
                              lora_modules=args.lora_modules, allow_runtime_lora_updating=runtime_updating_allowed(),
                              api_server=api_server)
    # uvicorn re-raises the SIGTERM/SIGINT it caught once it has shut down: end with status 0
    # then (a clean stop, not a crash) instead of the default handlers' kill or traceback.
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, _exit_after_shutdown)
    grpc_front = None
    if args.grpc_port is not None:
        from hookllm.server.grpc_server import GrpcFrontEnd, GrpcSettings

        grpc_settings = GrpcSettings(args.host, args.grpc_port, args.grpc_max_concurrent_rpcs,
                                     args.grpc_max_message_bytes, args.shutdown_timeout)

        def grpc_front(state: Any) -> Any:
            return GrpcFrontEnd(state, grpc_settings)

    try:
        if args.no_http:
            return _serve_grpc_only(engine, settings, grpc_front)
        app = build_app(engine, settings, grpc_front)
        front = app.state.grpc

        class Server(uvicorn.Server):
            async def shutdown(self, sockets: Any = None) -> None:
                if front is not None:
                    front.stop()  # gRPC drains alongside HTTP; the app's lifespan waits for it
                await super().shutdown(sockets)

        # uvicorn handles SIGINT/SIGTERM: stop accepting, let requests finish for up to
        # --shutdown-timeout, then the app's lifespan shuts the engine down (aborting the rest).
        server = Server(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                                       timeout_graceful_shutdown=args.shutdown_timeout))
        host, port = sock.getsockname()[:2]
        # uvicorn says where it listens only for a socket it bound itself.
        logger.info("serving on http://%s:%d", f"[{host}]" if ":" in host else host, port)
        engine_died = threading.Event()

        def stop_when_the_engine_dies() -> None:
            while not server.should_exit:
                if engine.wait_stopped(1.0) and not server.should_exit:
                    logger.error("the engine stopped: shutting the server down")
                    engine_died.set()
                    server.should_exit = True

        threading.Thread(target=stop_when_the_engine_dies, name="hookllm-engine-watch", daemon=True).start()
        server.run(sockets=[sock])
        return 1 if engine_died.is_set() else 0
    finally:
        engine.shutdown()


def _serve_grpc_only(engine: Any, settings: Any, grpc_front: Any) -> int:
    """``hookllm serve --grpc-port PORT --no-http``: the gRPC server alone, until SIGTERM or SIGINT
    (status 0, after in-flight calls had --shutdown-timeout to finish) or the engine's death (1)."""
    import asyncio
    import threading

    from hookllm.server.state import ServerState

    front = grpc_front(ServerState.create(engine, settings))
    engine_died = threading.Event()

    async def serve() -> None:
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, stop.set)

        def stop_when_the_engine_dies() -> None:
            while not stop.is_set():
                if engine.wait_stopped(1.0) and not stop.is_set():
                    logger.error("the engine stopped: shutting the server down")
                    engine_died.set()
                    loop.call_soon_threadsafe(stop.set)
                    return

        await front.start()
        threading.Thread(target=stop_when_the_engine_dies, name="hookllm-engine-watch", daemon=True).start()
        await stop.wait()
        await front.stop()

    asyncio.run(serve())
    return 1 if engine_died.is_set() else 0


def _run_api_servers(args: argparse.Namespace, config: Any, sock: socket.socket) -> int:
    """The engine process (``--data-parallel-size`` of them) and ``--api-server-count`` API server
    processes, each a client of every engine over its own pipe, all accepting on ``sock``.
    SIGTERM (or SIGINT) here is passed on to the API servers, which drain as a single server
    does; the engines stop once the last of them has gone. Each child gets ``--shutdown-timeout``
    plus a margin to end, and is killed after that; the status is 0 only if every child ended
    cleanly on its own."""
    import multiprocessing
    import multiprocessing.connection
    import shutil
    import tempfile

    from hookllm.engine.core_client import start_engines

    metrics_dir = tempfile.mkdtemp(prefix="hookllm-metrics-")
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir  # the API servers inherit it: summed metrics
    wake_r, wake_w = os.pipe()
    previous_handlers: dict[int, Any] = {}
    try:
        engines = start_engines(config, num_clients=args.api_server_count)
        context = multiprocessing.get_context("spawn")
        servers = [context.Process(target=_api_server_main, args=(args, config, conns, sock, i),
                                   name=f"hookllm-api-server-{i}")
                   for i, conns in enumerate(zip(*[engine.client_conns for engine in engines]))]
        for server in servers:
            server.start()
        for engine in engines:
            for conn in engine.client_conns:
                conn.close()  # the servers hold them now: one that dies closes its pipe, and the engine sees it

        def stop(signum: int, frame: Any) -> None:
            for server in servers:
                if server.is_alive():
                    os.kill(server.pid, signal.SIGTERM)
            os.write(wake_w, b"\0")  # ends the wait below, which Python resumes after a handler

        # Ctrl-C's SIGINT has reached the servers already (one process group) and a SIGTERM after
        # it only repeats the request to stop; a SIGINT sent to this process alone needs passing on.
        previous_handlers.update({signum: signal.signal(signum, stop) for signum in (signal.SIGTERM, signal.SIGINT)})
        # Serve until told to stop: a server that ends before that (a crash) leaves the others serving.
        serving = {server.sentinel for server in servers}
        while serving:
            ready = multiprocessing.connection.wait([wake_r, *serving])
            if wake_r in ready:
                break
            serving.difference_update(ready)
        deadline = time.monotonic() + args.shutdown_timeout + SHUTDOWN_MARGIN_S
        clean = [join_or_kill(server, deadline) for server in servers]
        # The engines stop once the servers have gone, aborting what is left: they get their own deadline.
        clean += [engine.join(args.shutdown_timeout + SHUTDOWN_MARGIN_S) for engine in engines]
        return 0 if all(clean) else 1
    finally:
        for signum, handler in previous_handlers.items():
            signal.signal(signum, handler)  # before the pipe that ``stop`` writes to closes
        os.close(wake_r)
        os.close(wake_w)
        shutil.rmtree(metrics_dir, ignore_errors=True)


def _stop_multiprocessing_servers() -> None:
    """Stop multiprocessing's fork server and resource tracker, which starting processes started
    here, and wait for them: each ends only once every holder of its pipe has closed it, and this
    process exiting first would leave them running after ``hookllm serve`` has returned.

    ``ForkServer._stop`` and ``ResourceTracker._stop`` are private (Python 3.11 to 3.13 have them;
    elsewhere each still ends on its own just after this process). They wait without a deadline,
    so they run only when no child is left, i.e. no process of ours still holds their pipes."""
    import multiprocessing
    from multiprocessing import forkserver, resource_tracker

    if multiprocessing.active_children():
        return
    for server in (getattr(forkserver, "_forkserver", None), getattr(resource_tracker, "_resource_tracker", None)):
        stop = getattr(server, "_stop", None)
        if stop is not None:
            stop()


def _api_server_main(args: argparse.Namespace, config: Any, conns: tuple[Any, ...], sock: socket.socket,
                     index: int) -> None:
    from hookllm.engine.async_llm import AsyncLLM
    from hookllm.utils import name_this_process

    name_this_process("hookllm-api")
    configure_logging(args.log_level)  # spawned: it inherits no logging setup, only the resolved level
    # A SIGTERM while this server still starts (nothing to drain yet) is a clean stop too.
    signal.signal(signal.SIGTERM, _exit_after_shutdown)
    raise SystemExit(_serve(args, AsyncLLM(config=config, connections=list(conns)), sock,
                            (index, args.api_server_count)))


def _exit_after_shutdown(signum: int, frame: Any) -> None:
    raise SystemExit(0)


def _post_stream(args: argparse.Namespace, path: str, body: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """POST ``body`` with ``stream: true`` and yield each server-sent event's JSON."""
    headers = {"Content-Type": "application/json"}
    if args.api_key:
        headers["Authorization"] = f"Bearer {args.api_key}"
    if args.model:
        body["model"] = args.model
    request = urllib.request.Request(args.url.rstrip("/") + path, json.dumps({**body, "stream": True}).encode(),
                                     headers)
    try:
        with urllib.request.urlopen(request) as response:
            for line in response:
                line = line.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[len("data: "):])
                if "error" in event:
                    raise ValueError(f"server error: {event['error']['message']}")
                yield event
    except urllib.error.HTTPError as exc:
        try:
            message = json.loads(exc.read())["error"]["message"]
        except (ValueError, KeyError):
            message = str(exc)
        raise ValueError(f"server answered {exc.code}: {message}") from None
    except urllib.error.URLError as exc:
        raise ValueError(f"cannot reach {args.url}: {exc.reason}") from None


def run_complete(args: argparse.Namespace) -> int:
    body = {"prompt": args.text, "max_tokens": args.max_tokens, "temperature": args.temperature}
    for event in _post_stream(args, "/v1/completions", body):
        for choice in event["choices"]:
            print(choice["text"], end="", flush=True)
    print()
    return 0


def _chat_turn(args: argparse.Namespace, messages: list[dict[str, str]]) -> str:
    body = {"messages": messages, "max_tokens": args.max_tokens, "temperature": args.temperature}
    pieces = []
    for event in _post_stream(args, "/v1/chat/completions", body):
        for choice in event["choices"]:
            piece = choice["delta"].get("content") or ""
            pieces.append(piece)
            print(piece, end="", flush=True)
    print()
    return "".join(pieces)


class _GrpcChat:
    """Chat turns over the gRPC engine service, which takes and gives tokens: the chat template
    renders the prompt here and the tokenizer decodes the streamed tokens."""

    def __init__(self, args: argparse.Namespace):
        import grpc
        from transformers import AutoTokenizer

        from hookllm.grpc_client import GrpcClient

        self.rpc_error = grpc.RpcError
        self.client = GrpcClient(args.grpc)
        with self._errors(args.grpc):
            model = args.tokenizer or self.client.model_info().model_path
        self.tokenizer = AutoTokenizer.from_pretrained(model)

    @contextlib.contextmanager
    def _errors(self, target: str) -> Iterator[None]:
        try:
            yield
        except self.rpc_error as exc:
            raise ValueError(f"gRPC server {target} answered {exc.code().name}: {exc.details()}") from None

    def __call__(self, args: argparse.Namespace, messages: list[dict[str, str]]) -> str:
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        prompt = self.tokenizer(text, add_special_tokens=False)["input_ids"]  # the template wrote them
        token_ids: list[int] = []
        printed = ""
        with self._errors(args.grpc):
            for response in self.client.stream(prompt, max_tokens=args.max_tokens, temperature=args.temperature):
                token_ids += response.chunk.token_ids  # a complete message has no chunk: adds nothing
                reply = self.tokenizer.decode(token_ids, skip_special_tokens=True)
                print(reply[len(printed):], end="", flush=True)
                printed = reply
        print()
        return printed


def run_chat(args: argparse.Namespace) -> int:
    turn = _GrpcChat(args) if args.grpc else _chat_turn
    messages = [{"role": "system", "content": args.system}] if args.system else []
    if args.text is not None:
        messages.append({"role": "user", "content": args.text})
        turn(args, messages)
        return 0
    while True:  # interactive: one turn per line, until end of input
        try:
            line = input("> ")
        except EOFError:
            return 0
        messages.append({"role": "user", "content": line})
        messages.append({"role": "assistant", "content": turn(args, messages)})


COMMANDS = {"serve": run_serve, "complete": run_complete, "chat": run_chat}


def run(args: argparse.Namespace) -> int:
    return COMMANDS[args.command](args)

