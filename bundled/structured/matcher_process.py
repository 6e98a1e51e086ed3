"""The engine's end of the structured plugin's matcher process (``matcher_server.py``).

Advancing llguidance matchers and filling their masks is Rust that drops the GIL, but the Python
around it (one call per matcher, per step) queued behind the engine thread's scheduling and
output processing, and the main thread then waited for the masks. In a process of its own that
Python runs beside the engine's: a step costs the engine one message of new token ids, sent as
soon as the previous step's tokens are known, and one reply, read when the masks are needed; the
masks arrive in a shared buffer.
"""

from __future__ import annotations

import mmap
import os
import subprocess
import sys
from multiprocessing import Pipe
from multiprocessing.reduction import send_handle
from pathlib import Path

import torch

SERVER_SCRIPT = Path(__file__).with_name("matcher_server.py")
CLOSE_TIMEOUT_S = 5.0


class MatcherProcessError(RuntimeError):
    """The matcher process failed a step."""


class MatcherProcessExited(MatcherProcessError):
    """The matcher process is gone (killed, crashed), and its matchers with it."""


class MatcherProcess:
    """One matcher process: ``send_step`` sends a step's rows, ``receive_step`` returns its masks."""

    def __init__(self) -> None:
        self._connection, child_end = Pipe()
        # A script, not a multiprocessing child: it imports llguidance and numpy, not the engine.
        self._process = subprocess.Popen([sys.executable, str(SERVER_SCRIPT), str(child_end.fileno())],
                                         pass_fds=(child_end.fileno(),))
        child_end.close()
        self._tokenizers: set[tuple] = set()
        self._mapping: mmap.mmap | None = None
        self.masks: torch.Tensor | None = None  # [rows, words] int32, shared with the process
        self.last_step_seconds = 0.0  # the last step's time in the process, without the messages
        self._rows_in_flight: int | None = None  # the sent step's row count, until its result is taken

    def add_tokenizer(self, key: tuple, tokenizer_json: str, eos_token_ids: tuple[int, ...]) -> None:
        """Make the tokenizer ``key`` known to the process (once per key)."""
        if key not in self._tokenizers:
            self._send(("tokenizer", key, tokenizer_json, list(eos_token_ids)))
            self._tokenizers.add(key)

    def send_step(self, drops: list[str], rows: list[tuple[str, tuple, str | None, list[int], list[int]]],
                  words: int) -> None:
        """Start a step: drop the matchers of ``drops``; advance and mask ``rows``
        (``(request_id, tokenizer_key, grammar or None, new_tokens, drafts_before_row)``, see
        ``matcher_server.py``).
        ``receive_step`` takes its result; a step whose result was never taken (its job failed)
        is taken and dropped first."""
        if self._rows_in_flight is not None:
            self.receive_step()
        self._ensure_buffer(len(rows), words)
        self._send(("step", drops, rows))
        self._rows_in_flight = len(rows)

    def receive_step(self) -> tuple[torch.Tensor, list[tuple[str, str]]]:
        """The sent step's ``[len(rows), words]`` masks (a view of the shared buffer, valid until the
        next step) and failures, ``(request_id, reason)``; waits for the process if need be."""
        rows, self._rows_in_flight = self._rows_in_flight, None
        try:
            reply = self._connection.recv()
        except (EOFError, OSError):
            raise MatcherProcessExited(self._exited()) from None
        if reply[0] == "error":
            raise MatcherProcessError(f"the structured-output matcher process failed a step:\n{reply[1]}")
        _, failures, self.last_step_seconds = reply
        return self.masks[:rows], failures

    def close(self) -> None:
        """Stop the process (it exits when its connection closes) and release the buffer."""
        self._connection.close()
        try:
            self._process.wait(CLOSE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()
        self.masks = self._mapping = None  # the mapping goes with the last view of it

    def _ensure_buffer(self, rows: int, words: int) -> None:
        if self.masks is not None and self.masks.shape[1] == words and self.masks.shape[0] >= rows:
            return
        rows = max(rows, 2 * self.masks.shape[0] if self.masks is not None else 0)
        # Anonymous shared memory: nothing in the file system to be left behind.
        fd = os.memfd_create("hookllm-structured-masks")
        try:
            os.ftruncate(fd, rows * words * 4)
            mapping = mmap.mmap(fd, rows * words * 4)
            self._send(("buffer", rows, words))
            send_handle(self._connection, fd, self._process.pid)
        finally:
            os.close(fd)
        self._mapping = mapping  # the old one goes with the last view of it
        self.masks = torch.frombuffer(mapping, dtype=torch.int32).view(rows, words)

    def _send(self, message: tuple) -> None:
        try:
            self._connection.send(message)
        except OSError:
            raise MatcherProcessExited(self._exited()) from None

    def _exited(self) -> str:
        code = self._process.poll()
        return (f"the structured-output matcher process exited (code {code})" if code is not None
                else "the connection to the structured-output matcher process broke")
