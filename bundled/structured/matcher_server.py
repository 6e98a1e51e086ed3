"""The structured plugin's matcher process: llguidance matchers and their token masks, away from
the engine's GIL.

Run as a script by :mod:`hookllm.bundled.structured.matcher_process` (``python matcher_server.py
FD``), it imports llguidance and numpy only, never hookllm or torch, so it starts in a fraction of
a second. It serves one connection (``multiprocessing.connection.Connection`` on the inherited
socket ``FD``) and exits when the other end closes it. Messages are tuples:

- ``("tokenizer", key, tokenizer_json, eos_token_ids)``: build an ``LLTokenizer`` under ``key``.
- ``("buffer", rows, words)``, followed by the buffer's file descriptor (``send_handle``): the
  shared ``[rows, words]`` int32 mask buffer the next steps fill.
- ``("step", drops, rows)``: forget the matchers of the request ids ``drops``; then for row ``k``
  of ``rows``, ``(request_id, tokenizer_key, grammar, new_tokens, drafts)``, start the request's
  matcher over when ``grammar`` is not None, feed it ``new_tokens`` and fill mask row ``k``: what
  the grammar allows after ``drafts`` (a speculating step's guesses before the row, taken back
  once the mask is filled), or EOS alone once the matcher stopped or failed (or refuses a
  draft: that row's sample is never kept, as the row before it rejects the draft). Reply
  ``("ok", failures, seconds)``, ``failures`` being ``(request_id, reason)`` of the matchers
  that failed in this step and ``seconds`` the time the step took here, or ``("error",
  traceback)`` if the step raised.
"""

from __future__ import annotations

import mmap
import sys
import time
import traceback
from multiprocessing.connection import Connection
from multiprocessing.reduction import recv_handle

import llguidance
import llguidance.numpy
import numpy as np


class _Entry:
    __slots__ = ("matcher", "tokenizer", "failed")

    def __init__(self, matcher: llguidance.LLMatcher, tokenizer: llguidance.LLTokenizer):
        self.matcher = matcher
        self.tokenizer = tokenizer
        self.failed = False


def reason(error: str) -> str:
    """The line of llguidance's error text that says why (it dumps the parser state too)."""
    for line in error.splitlines():
        if line.startswith("Error:"):
            return line.removeprefix("Error:").strip().removeprefix("Parser Error:").strip()
    return error.strip().splitlines()[0] if error.strip() else "the matcher refused a token"


class MatcherServer:
    def __init__(self) -> None:
        self.tokenizers: dict[tuple, llguidance.LLTokenizer] = {}
        self.entries: dict[str, _Entry] = {}
        self.executor = llguidance.LLExecutor()
        self.masks: np.ndarray | None = None
        self._mapping: mmap.mmap | None = None

    def add_tokenizer(self, key: tuple, tokenizer_json: str, eos_token_ids: list[int]) -> None:
        self.tokenizers[key] = llguidance.LLTokenizer(tokenizer_json, eos_token=eos_token_ids)

    def map_buffer(self, fd: int, rows: int, words: int) -> None:
        self._mapping = mmap.mmap(fd, rows * words * 4)
        self.masks = np.frombuffer(self._mapping, dtype=np.int32).reshape(rows, words)

    def step(self, drops: list[str], rows: list[tuple[str, tuple, str | None, list[int], list[int]]]
             ) -> list[tuple[str, str]]:
        for request_id in drops:
            self.entries.pop(request_id, None)
        entries = []
        for request_id, tokenizer_key, grammar, *_ in rows:
            if grammar is not None:
                tokenizer = self.tokenizers[tokenizer_key]
                self.entries[request_id] = _Entry(llguidance.LLMatcher(tokenizer, grammar), tokenizer)
            entries.append(self.entries[request_id])
        failures = self._advance(entries, [row[0] for row in rows], [row[3] for row in rows])
        self._fill(entries, [row[4] for row in rows])
        return failures

    def _advance(self, entries: list[_Entry], request_ids: list[str], new: list[list[int]]) -> list[tuple[str, str]]:
        """Feed each matcher its new tokens. A stopped matcher (the grammar complete, EOS seen)
        takes nothing more: with ignore_eos a request goes on sampling EOS, which is no error.
        One matcher after the other: a consume takes microseconds, less than handing it to
        llguidance's thread pool (``consume_token_par``), and this process has no GIL to share."""
        failures = []
        for entry, request_id, tokens in zip(entries, request_ids, new):
            if not tokens or entry.failed or entry.matcher.is_stopped():
                continue
            # consume_tokens of one token takes several times consume_token's time.
            accepted = (entry.matcher.consume_token(tokens[0]) if len(tokens) == 1
                        else entry.matcher.consume_tokens(tokens))
            if not accepted:
                entry.failed = True
                failures.append((request_id, reason(entry.matcher.get_error())))
        return failures

    def _fill(self, entries: list[_Entry], drafts: list[list[int]]) -> None:
        healthy, drafted = [], []
        for k, (entry, before) in enumerate(zip(entries, drafts)):
            if entry.failed or entry.matcher.is_stopped():
                self._eos_only(k, entry)
            elif before:
                drafted.append((entry, k, before))
            else:
                healthy.append((entry.matcher, k))
        if healthy:  # in Rust, on llguidance's threads
            llguidance.numpy.fill_next_token_bitmask_par(self.executor, healthy, self.masks)
        # After the rows without drafts: a drafted row's matcher is its request's, moved ahead and back.
        for entry, k, before in drafted:
            matcher = entry.matcher
            if matcher.validate_tokens(before) < len(before):  # checked first: a refused token breaks a matcher
                self._eos_only(k, entry)
                continue
            matcher.consume_tokens(before)
            if matcher.is_stopped():
                self._eos_only(k, entry)
            else:
                llguidance.numpy.fill_next_token_bitmask(matcher, self.masks, k)
            matcher.rollback(len(before))

    def _eos_only(self, k: int, entry: _Entry) -> None:
        """Mask row ``k`` allows EOS alone: it ends the request (unless ignore_eos)."""
        self.masks[k] = 0
        for eos in entry.tokenizer.eos_tokens:
            self.masks.view(np.uint32)[k, eos // 32] |= np.uint32(1 << (eos % 32))


def serve(connection: Connection) -> None:
    try:
        _serve(MatcherServer(), connection)
    except (EOFError, OSError):  # the engine closed its end (a reply left unread resets it)
        return


def _serve(server: MatcherServer, connection: Connection) -> None:
    while True:
        message = connection.recv()
        kind = message[0]
        try:
            if kind == "tokenizer":
                server.add_tokenizer(*message[1:])
            elif kind == "buffer":
                server.map_buffer(recv_handle(connection), *message[1:])
            else:
                start = time.perf_counter()
                failures = server.step(*message[1:])
                connection.send(("ok", failures, time.perf_counter() - start))
        except Exception:  # noqa: BLE001 - sent to the engine, which fails the step naming it
            if kind == "step":
                connection.send(("error", traceback.format_exc()))
            else:
                raise


if __name__ == "__main__":
    serve(Connection(int(sys.argv[1])))
