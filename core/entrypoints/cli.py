"""The ``hookllm`` command (also ``python -m hookllm``): ``generate``, ``plugins``, and ``serve`` /
``complete`` / ``chat`` (hookllm.server)."""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import logging
import multiprocessing
import os
import sys
import textwrap
from pathlib import Path
from typing import NoReturn, Sequence

from hookllm import __version__
from hookllm.engine.arg_utils import DefaultsHelpFormatter, EngineArgs
from hookllm.logging_config import add_log_level_argument, configure_logging, resolve_level
from hookllm.utils import FlexibleArgumentParser

PLUGINS_WIDTH = 100  # columns `hookllm plugins` fits in


def _plugin_parser(plugin_manager) -> argparse.ArgumentParser:
    """The installed plugins' flags (``add_cli_options``) on a parser of their own, the parent of
    ``generate`` and ``serve``: its dests, listed as ``args.plugin_options``, are the flags' names,
    whose values reach every request as SamplingParams.extra_args."""
    parser = argparse.ArgumentParser(add_help=False)
    plugin_manager.all_plugins.hook.add_cli_options(parser=parser)
    parser.set_defaults(plugin_options=list(vars(parser.parse_args([]))))
    return parser


def _generate_parser(subparsers: argparse._SubParsersAction, plugin_parser: argparse.ArgumentParser) -> None:
    p = subparsers.add_parser("generate", help="generate text for one or more prompts", parents=[plugin_parser],
                              formatter_class=DefaultsHelpFormatter,
                              description="Each prompt is sent as a user message through the chat template "
                              "(the model's, or --chat-template); a model without one gets the prompts raw, "
                              "with a note on stderr. --no-chat always sends them raw.")
    p.add_argument("prompts", nargs="+", metavar="PROMPT", help="a prompt; - reads one from stdin")
    p.add_argument("--image", action="append", default=[], dest="images", metavar="PATH",
                   help="attach an image file (repeatable, in order); an image plugin renders it")
    p.add_argument("--max-tokens", type=int, default=128, help="most tokens to generate per prompt")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (0: greedy)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1: off)")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens (0: off)")
    p.add_argument("--no-chat", action="store_true", help="send prompts raw, without the chat template")
    p.add_argument("--chat-template", metavar="FILE_OR_STRING",
                   help="the chat template (a file, or the Jinja text itself) instead of the tokenizer's")
    add_log_level_argument(p)
    EngineArgs.add_cli_args(p)


def _check_device(device: str) -> None:
    """Fail before the model loads when the asked-for GPU is not there."""
    import torch

    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"--device {device}: no CUDA GPU is available (use --device cpu)")


def _run_generate(args: argparse.Namespace) -> int:
    from hookllm import LLM, SamplingParams
    from hookllm.entrypoints.chat import has_chat_template, read_chat_template, render_chat

    # Everything that can be checked without the model is checked first: loading takes a while.
    missing = [path for path in args.images if not Path(path).is_file()]
    if missing:
        raise ValueError(f"no such image file: {', '.join(missing)}")
    if args.no_chat and args.chat_template is not None:
        raise ValueError("--no-chat sends the prompts raw: it takes no --chat-template")
    chat_template = read_chat_template(args.chat_template)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, extra_args={name: getattr(args, name) for name in args.plugin_options})
    engine_config = EngineArgs.from_cli_args(args).create_engine_config()
    _check_device(engine_config.device)
    prompts = [sys.stdin.read() if prompt == "-" else prompt for prompt in args.prompts]
    llm = LLM(**dataclasses.asdict(engine_config))
    use_chat = not args.no_chat and (chat_template is not None or has_chat_template(llm.tokenizer))
    if not use_chat and not args.no_chat:
        print("hookllm: note: the model has no chat template, so the prompts are sent raw (--chat-template "
              "FILE_OR_STRING gives one; --no-chat says raw on purpose)", file=sys.stderr)
    if use_chat:
        # Attachments go first, as in most chat UIs; a plugin renders each into its placeholder.
        attachments = [{"type": "image", "image": path} for path in args.images]
        requests = [render_chat(llm.engine, [{"role": "user", "content": attachments + [{"type": "text", "text": p}]}],
                                chat_template) for p in prompts]
    else:
        requests = [{"prompt": p, "multi_modal_data": {"image": args.images}} if args.images else p for p in prompts]
    _stream(llm, requests, params, prompts if len(prompts) > 1 else None)
    return 0


def _stream(llm, requests: list, params, headings: list[str] | None) -> None:
    """Print each answer as its tokens arrive (delta outputs), in prompt order: the first
    unfinished answer streams; later ones are buffered until it ends."""
    from hookllm.sampling_params import RequestOutputKind

    engine = llm.engine
    params = dataclasses.replace(params, output_kind=RequestOutputKind.DELTA)
    request_ids: list[str] = []
    try:
        for request in requests:
            request_ids.append(engine.add_request(llm._next_request_id(), request, params))
        buffered: dict[str, list[str]] = {request_id: [] for request_id in request_ids}
        finished: set[str] = set()
        head, head_started = 0, False
        while head < len(request_ids):
            for output in engine.step() if engine.has_unfinished_requests() else []:
                buffered[output.request_id].append(output.outputs[0].text)
                if output.finished:
                    finished.add(output.request_id)
            while head < len(request_ids):
                request_id = request_ids[head]
                if headings is not None and not head_started:
                    print(f"--- {headings[head]}")
                head_started = True
                print("".join(buffered[request_id]), end="", flush=True)
                buffered[request_id].clear()
                if request_id not in finished:
                    break
                print()
                head, head_started = head + 1, False
    except BaseException:
        engine.abort_request(request_ids)
        raise


def _run_plugins(args: argparse.Namespace, plugin_manager) -> int:
    from hookllm.plugins.components import ComponentKind

    registry = plugin_manager.registry
    fallbacks = registry.fallbacks
    rows = [
        {
            "name": info.name,
            "distribution": info.distribution,
            "version": info.version,
            "hooks": info.hooks,
            "architectures": info.architectures,
            # The names of what it registers (tool parsers, quantization methods, ...), by kind.
            **{kind.listing_key: info.components.names(kind) for kind in ComponentKind},
            "error": info.error,
            # Only a plugin that registered a fallback has this key: what the fallback claims.
            **({"fallback": fallbacks[info.name]} if info.name in fallbacks else {}),
        }
        for info in sorted(plugin_manager.plugins.values(), key=lambda i: i.name)
    ]
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    # A block per plugin, its lists wrapped: a table of them would not fit a terminal.
    lists = {"hooks": "hooks", "architectures": "architectures",
             **{kind.listing_key: f"{kind.value}s" for kind in ComponentKind}}
    width = max(len(label) for label in lists.values()) + 2
    for r in rows:
        package = f"{r['distribution']} {r['version']}".strip()
        print(f"{r['name']} ({package})" if package else r["name"])
        for label, value in (*((label, ", ".join(r[key])) for key, label in lists.items()),
                             ("fallback", r.get("fallback")), ("error", r["error"])):
            if value:
                print(_wrapped(value, f"  {label + ':':<{width}}"))
    # Who serves what: a native registration first, a fallback for everything else.
    print("\nserved by (--model-impl auto):")
    served = [(architecture, registry.explain(architecture)) for architecture in registry.architectures]
    served += [("any other architecture", f"{plugin} (fallback)") for plugin in fallbacks]
    width = max((len(architecture) for architecture, _ in served), default=0) + 4
    for architecture, how in served:
        print(_wrapped(how, f"  {architecture:<{width - 2}}"))
    return 0


def _wrapped(text: str, head: str) -> str:
    """``text`` after ``head``, wrapped to the listing's width under itself."""
    return textwrap.fill(text, PLUGINS_WIDTH, initial_indent=head, subsequent_indent=" " * len(head),
                         break_on_hyphens=False)


def _refuse_unrecognized(command: argparse.ArgumentParser, arguments: list[str]) -> NoReturn:
    """Exit as argparse does, but with the subcommand's usage (argparse shows the top level's)
    and, for a flag close to one the subcommand knows, that flag."""
    known = list(command._option_string_actions)
    guesses = [match for argument in arguments if argument.startswith("-")
               for match in difflib.get_close_matches(argument.split("=", 1)[0], known, n=1)]
    hint = f" (did you mean {', '.join(guesses)}?)" if guesses else ""
    command.error(f"unrecognized arguments: {' '.join(arguments)}{hint}")


def main(argv: Sequence[str] | None = None) -> int:
    from hookllm.plugins.manager import PluginManager

    plugin_manager = PluginManager()
    parser = FlexibleArgumentParser(prog="hookllm", description="LLM inference with pluggable models.",
                                    formatter_class=DefaultsHelpFormatter)
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    plugin_parser = _plugin_parser(plugin_manager)
    _generate_parser(subparsers, plugin_parser)
    plugins = subparsers.add_parser("plugins", help="list installed plugins, their hooks, what they register "
                                    "(architectures, parsers, quantization methods, ...) and load errors, and "
                                    "which plugin serves each architecture")
    plugins.add_argument("--json", action="store_true", help="machine-readable output")
    from hookllm.server import cli as server_cli

    server_cli.add_parsers(subparsers, plugin_parser)
    args, unrecognized = parser.parse_known_args(argv)
    if unrecognized:
        _refuse_unrecognized(subparsers.choices[args.command], unrecognized)
    try:
        if hasattr(args, "log_level"):  # the commands that run an engine
            args.log_level = resolve_level(args.log_level)
            configure_logging(args.log_level)
        if args.command == "plugins":
            return _run_plugins(args, plugin_manager)
        if args.command in server_cli.COMMANDS:
            return server_cli.run(args)
        return _run_generate(args)
    except ValueError as exc:
        print(f"hookllm: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("hookllm: interrupted", file=sys.stderr)
        return 130  # 128 + SIGINT, as shells report it


def console_main() -> NoReturn:
    """The ``hookllm`` command: ``main``, then, after a clean end that left no child process, an
    exit that skips tearing down the interpreter's heap (torch's modules and a model's objects:
    over a second, which a server's stop would otherwise wait for). Logs are flushed first."""
    try:
        code = main()
    except SystemExit as stop:  # hookllm serve ends with SystemExit(0) on SIGTERM
        code = stop.code
    if code in (0, None) and not multiprocessing.active_children():
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    sys.exit(code)


if __name__ == "__main__":
    console_main()
