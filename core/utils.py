"""Small helpers of the public API (vLLM's ``vllm.utils`` names)."""

from __future__ import annotations

import argparse
from typing import Sequence


class FlexibleArgumentParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` that takes ``--flag_name`` as well as ``--flag-name``.

    Underscores in a long option's name (before any ``=value``) become dashes before parsing,
    so scripts written either way work; values and positional arguments are left alone.
    """

    def parse_known_args(self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None):
        import sys

        args = list(sys.argv[1:] if args is None else args)
        end = args.index("--") if "--" in args else len(args)  # after "--" everything is positional
        return super().parse_known_args([_dashed(arg) for arg in args[:end]] + args[end:], namespace)


def _dashed(arg: str) -> str:
    if not arg.startswith("--"):
        return arg
    name, sep, value = arg.partition("=")
    return name.replace("_", "-") + sep + value
