"""``EngineArgs``: the engine's options as command-line flags, generated from ``EngineConfig``.

Every field of :class:`hookllm.config.EngineConfig` becomes a flag (``max_num_seqs`` ->
``--max-num-seqs``, booleans as ``--enforce-eager`` / ``--no-enforce-eager``), with the help
text and default the field declares, so a new option reaches ``hookllm generate`` and
``hookllm serve`` without touching the CLI. vLLM-shaped: ``EngineArgs.add_cli_args(parser)``,
``EngineArgs.from_cli_args(args)``, ``.create_engine_config()``.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from typing import Any

from hookllm.config import EngineConfig


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """The help formatter of every ``hookllm`` command: a flag's help ends with its default, once.

    A help text that already says ``default: ...`` (a default worked out at run time, such as
    "the model's positions") is left as it is, and a default of ``None`` or ``[]`` (nothing set)
    is not shown.
    """

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default in (None, []) or "default:" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def flag_name(field: dataclasses.Field) -> str:
    return field.metadata.get("flag", "--" + field.name.replace("_", "-"))


def _argument_options(field: dataclasses.Field) -> dict[str, Any]:
    """argparse keyword arguments for one config field, from its annotation and metadata."""
    annotation = str(field.type)
    options: dict[str, Any] = {"dest": field.name, "help": field.metadata["help"]}
    if "choices" in field.metadata:
        options["choices"] = field.metadata["choices"]
    if "metavar" in field.metadata:
        options["metavar"] = field.metadata["metavar"]
    if annotation.startswith("bool"):
        options["action"] = argparse.BooleanOptionalAction
    elif annotation.startswith("list["):
        options["action"] = "append"
    else:
        options["type"] = {"int": int, "float": float}.get(annotation.split(" | ")[0], str)
    if field.default is not dataclasses.MISSING:
        options["default"] = field.default
    else:
        options["default"] = field.default_factory()
    return options


@dataclass
class EngineArgs(EngineConfig):
    """The engine's options, as ``EngineConfig`` holds them, plus their command-line form."""

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        """Add one flag per ``EngineConfig`` field to ``parser`` (with ``DefaultsHelpFormatter``, help
        shows each default)."""
        group = parser.add_argument_group("engine options")
        for field in dataclasses.fields(EngineConfig):
            group.add_argument(flag_name(field), **_argument_options(field))
        return parser

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> "EngineArgs":
        return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(EngineConfig)})

    def create_engine_config(self) -> EngineConfig:
        return EngineConfig(**{f.name: getattr(self, f.name) for f in dataclasses.fields(EngineConfig)})
