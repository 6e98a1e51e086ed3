"""The ``hookllm`` logger tree's output: one stderr handler at the level that ``--log-level`` or
``HOOKLLM_LOGGING_LEVEL`` names, set up by the CLI in its own process and in each process the
server starts (API servers, the engine process), so a plugin's logger named ``hookllm.<...>``
is shown wherever its hook runs.

The library alone configures nothing: an application that embeds ``LLM`` keeps its own logging.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

LOG_LEVELS = ("critical", "error", "warning", "info", "debug")
LEVEL_ENV = "HOOKLLM_LOGGING_LEVEL"
DEFAULT_LEVEL = "info"
# The process name tells the server's processes apart (hookllm-engine-core, hookllm-api-server-N).
LOG_FORMAT = "%(levelname)s %(asctime)s [%(processName)s] %(name)s: %(message)s"
DATE_FORMAT = "%m-%d %H:%M:%S"


class StderrHandler(logging.StreamHandler):
    """Writes each record to ``sys.stderr`` as it is then, not as it was when the handler was
    made: the CLI run in a process that swaps stderr later (tests capturing it) keeps working."""

    def __init__(self) -> None:
        logging.Handler.__init__(self)  # StreamHandler's would fix the stream

    @property
    def stream(self) -> object:
        return sys.stderr


def resolve_level(flag: str | None) -> str:
    """The level to log at: the flag's, else ``HOOKLLM_LOGGING_LEVEL``'s, else info; a
    ``ValueError`` naming the setting for an unknown one."""
    level = flag or os.environ.get(LEVEL_ENV) or DEFAULT_LEVEL
    if level.lower() not in LOG_LEVELS:
        source = "--log-level" if flag else LEVEL_ENV
        raise ValueError(f"{source}: {level!r} is not a log level; use one of {', '.join(LOG_LEVELS)}")
    return level.lower()


def configure_logging(level: str | int) -> None:
    """Show the ``hookllm`` tree's records at ``level`` (a name of ``LOG_LEVELS``, or a number)
    and above on stderr. Called again (the CLI run twice in one process), it only sets the level."""
    logger = logging.getLogger("hookllm")
    if not any(isinstance(handler, StderrHandler) for handler in logger.handlers):
        handler = StderrHandler()
        handler.setFormatter(logging.Formatter(LOG_FORMAT, DATE_FORMAT))
        logger.addHandler(handler)
    logger.setLevel(level.upper() if isinstance(level, str) else level)


def current_level() -> int:
    """The ``hookllm`` tree's effective level here: what a process started from here logs at."""
    return logging.getLogger("hookllm").getEffectiveLevel()


def add_log_level_argument(parser: argparse.ArgumentParser) -> None:
    """A command's ``--log-level`` (resolved by ``resolve_level``)."""
    parser.add_argument("--log-level", type=str.lower, choices=LOG_LEVELS, default=None,
                        help=f"log level of hookllm and of plugins' loggers named hookllm.* "
                             f"(default: env {LEVEL_ENV}, else {DEFAULT_LEVEL})")
