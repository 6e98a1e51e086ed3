"""The ``hookllm`` command: ``generate``, ``plugins``, and ``serve`` / ``complete`` / ``chat`` (hookllm.server)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Sequence

from hookllm.arg_utils import EngineArgs


def _generate_parser(subparsers: argparse._SubParsersAction, plugin_manager) -> None:
    p = subparsers.add_parser("generate", help="generate text for one or more prompts",
                              formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("prompts", nargs="+", metavar="PROMPT")
    p.add_argument("--image", action="append", default=[], dest="images", metavar="PATH",
                   help="attach an image file (repeatable, in order); an image plugin renders it")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--no-chat", action="store_true", help="send prompts raw, without the chat template")
    EngineArgs.add_cli_args(p)
    core_options = {action.dest for action in p._actions}
    plugin_manager.all_plugins.hook.add_cli_options(parser=p)
    # Flags that plugins add reach them per request, as SamplingParams.extra_args.
    p.set_defaults(plugin_options=[a.dest for a in p._actions if a.dest not in core_options])


def _run_generate(args: argparse.Namespace) -> int:
    from hookllm import LLM, SamplingParams

    missing = [path for path in args.images if not Path(path).is_file()]
    if missing:
        raise ValueError(f"no such image file: {', '.join(missing)}")
    engine_config = EngineArgs.from_cli_args(args).create_engine_config()
    llm = LLM(**dataclasses.asdict(engine_config))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, extra_args={name: getattr(args, name) for name in args.plugin_options})
    tokenizer = llm.tokenizer
    use_chat = not args.no_chat and tokenizer is not None and getattr(tokenizer, "chat_template", None)
    many = len(args.prompts) > 1
    if use_chat:
        # Attachments go first, as in most chat UIs; a plugin renders each into its placeholder.
        attachments = [{"type": "image", "image": path} for path in args.images]
        conversations = [[{"role": "user", "content": attachments + [{"type": "text", "text": prompt}]}]
                         for prompt in args.prompts]
        outputs = llm.chat(conversations, params, use_tqdm=many)
    else:
        prompts = [{"prompt": p, "multi_modal_data": {"image": args.images}} if args.images else p
                   for p in args.prompts]
        outputs = llm.generate(prompts, params, use_tqdm=many)
    for prompt, output in zip(args.prompts, outputs):
        if many:
            print(f"--- {prompt}")
        print(output.outputs[0].text)
    return 0


def _run_plugins(args: argparse.Namespace, plugin_manager) -> int:
    rows = [
        {
            "name": info.name,
            "distribution": info.distribution,
            "version": info.version,
            "hooks": info.hooks,
            "architectures": info.architectures,
            "error": info.error,
        }
        for info in sorted(plugin_manager.plugins.values(), key=lambda i: i.name)
    ]
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    header = ("NAME", "PACKAGE", "HOOKS", "ARCHITECTURES", "ERROR")
    table = [header] + [
        (r["name"], f"{r['distribution']} {r['version']}".strip(), ", ".join(r["hooks"]),
         ", ".join(r["architectures"]), r["error"] or "")
        for r in rows
    ]
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    for row in table:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip())
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    from hookllm.plugins.manager import PluginManager

    plugin_manager = PluginManager()
    parser = argparse.ArgumentParser(prog="hookllm", description="LLM inference with pluggable models.")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _generate_parser(subparsers, plugin_manager)
    plugins = subparsers.add_parser("plugins", help="list installed plugins, their hooks and load errors")
    plugins.add_argument("--json", action="store_true", help="machine-readable output")
    from hookllm.server import cli as server_cli

    server_cli.add_parsers(subparsers)
    args = parser.parse_args(argv)
    try:
        if args.command == "plugins":
            return _run_plugins(args, plugin_manager)
        if args.command in server_cli.COMMANDS:
            return server_cli.run(args)
        return _run_generate(args)
    except ValueError as exc:
        print(f"hookllm: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
