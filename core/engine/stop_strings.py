"""Finding a request's stop strings in its text at a cost per character independent of their number.

An Aho-Corasick automaton over one request's stop strings: the text is fed to it as it grows,
one state per character. A state is the longest end of the text so far that is the start of
some stop string, so each state answers, in O(1), the two questions the output processor asks
after every token: which stop string, if any, ends at this character, and how much of the text's
end may still become a stop string (the streamed text held back).

The trie is built when the request is added, in time linear in the stop strings' total length
with the per-character work done by ``array`` in C. The failure links (and what follows from them)
are worked out the first time the text reaches a state: a request pays in Python only for the
part of the automaton its text visits, and never more than the full construction.
"""

from __future__ import annotations

import sys
from array import array
from typing import Sequence

_ROOT = 0
_NO_STOP = -1
_UTF32 = "utf-32-le" if sys.byteorder == "little" else "utf-32-be"  # array("I")'s byte order


class StopStringAutomaton:
    """The automaton over a request's stop strings (shared by the children of an ``n`` > 1 request:
    it holds no text position; each :class:`StopStringMatcher` does)."""

    def __init__(self, stops: Sequence[str]):
        if not stops or not all(stops):
            raise ValueError("a stop-string automaton needs non-empty stop strings")
        # Trie node i (the root is 0) is reached by the code point ``_code[i]``. Nodes are numbered
        # in insertion order, so a stop string's new nodes are consecutive: node i's parent is
        # i - 1 except where a stop string's new nodes start (``_starts``, one per stop string
        # at most), and those are the only children other than i + 1 (``_branches``). One flat
        # array costs 4 bytes a node where a dict a node costs hundreds.
        self._code = array("I", [0])
        self._starts: dict[int, int] = {}  # node -> parent, where the parent is not node - 1
        self._branches: dict[tuple[int, int], int] = {}  # (parent, code point) -> node, for _starts
        self._branching: set[int] = set()  # the parents in _branches
        self._own: dict[int, int] = {}  # node -> the first index in ``stops`` of the stop string it spells
        for index, stop in enumerate(stops):
            self._own.setdefault(self._insert(stop), index)
        # Filled in as the text reaches nodes: each node's failure link (the node of its longest
        # proper suffix that is in the trie) and its (match, holdback, depth), which need its
        # parent's and its link's. ``_resolved`` holds a node only once its parent and every node
        # on its failure chain are in it too.
        self._fail: dict[int, int] = {_ROOT: _ROOT}
        self._resolved: dict[int, tuple[int, int, int]] = {_ROOT: (_NO_STOP, 0, 0)}

    def _insert(self, stop: str) -> int:
        """Add ``stop`` to the trie; its last node."""
        node, matched = _ROOT, 0
        for char in stop:  # only the part shared with earlier stop strings is walked here
            child = self._child(node, ord(char))
            if child is None:
                break
            node, matched = child, matched + 1
        rest = stop[matched:]
        if not rest:
            return node
        first = len(self._code)
        if node != first - 1:
            self._starts[first] = node
            self._branches[(node, ord(rest[0]))] = first
            self._branching.add(node)
        self._code.frombytes(rest.encode(_UTF32))  # code points at C speed: build is most of the cost
        return len(self._code) - 1

    def _child(self, node: int, code: int) -> int | None:
        chain = node + 1
        if chain < len(self._code) and chain not in self._starts and self._code[chain] == code:
            return chain
        return self._branches.get((node, code))

    def _has_child(self, node: int) -> bool:
        chain = node + 1
        return (chain < len(self._code) and chain not in self._starts) or node in self._branching

    def next_state(self, node: int, code: int) -> int:
        """The state after reading ``code`` in state ``node`` (``node`` resolved)."""
        while True:
            child = self._child(node, code)
            if child is not None:
                return child
            if node == _ROOT:
                return _ROOT
            node = self._fail[node]

    def resolve(self, node: int) -> tuple[int, int]:
        """``node``'s (index of the stop string ending here, or -1; holdback length).

        The stop string ending here is the one of the failure chain's stop strings first in
        ``stops``. The holdback is the depth of the deepest node on the chain that has a child: the
        longest end of the text that is a proper start of a stop string.
        """
        resolved = self._resolved.get(node)
        if resolved is None:
            self._resolve(node)
            resolved = self._resolved[node]
        return resolved[0], resolved[1]

    def _resolve(self, node: int) -> None:
        """Resolve ``node`` and the unresolved nodes it needs first (iterative: the chain of
        them is as long as the longest stop string)."""
        pending = [node]
        while pending:
            current = pending[-1]
            if current in self._resolved:
                pending.pop()
                continue
            parent = self._starts.get(current, current - 1)
            up = self._resolved.get(parent)
            if up is None:
                pending.append(parent)
                continue
            link = self._fail.get(current)
            if link is None:
                # The parent's chain is resolved, so every link this walk follows is known.
                link = _ROOT if parent == _ROOT else self.next_state(self._fail[parent], self._code[current])
                self._fail[current] = link
            linked = self._resolved.get(link)
            if linked is None:
                pending.append(link)
                continue
            match = min((m for m in (self._own.get(current, _NO_STOP), linked[0]) if m != _NO_STOP), default=_NO_STOP)
            depth = up[2] + 1
            holdback = depth if self._has_child(current) else linked[1]
            self._resolved[current] = (match, holdback, depth)
            pending.pop()


class StopStringMatcher:
    """One request's position in its stop strings' automaton.

    ``feed`` each piece of new text. It reports the stop string whose occurrence ends earliest in
    the fed text; of several ending at the same character, the one first in the stop-string
    list. ``holdback`` is the length of the longest end of the text fed so far that is the start
    (not the whole) of some stop string.
    """

    __slots__ = ("automaton", "state", "holdback")

    def __init__(self, automaton: StopStringAutomaton):
        self.automaton = automaton
        self.state = _ROOT
        self.holdback = 0

    def feed(self, text: str, report: bool = True) -> tuple[int, int] | None:
        """Advance over ``text``. With ``report``, stop at the first character where a stop
        string ends and return (its index in the stop strings, how many characters of ``text``
        that consumed); None if none ends in ``text``. Without ``report``, stop strings ending in
        ``text`` are passed over (the text still counts as the start of later ones)."""
        automaton, state = self.automaton, self.state
        for consumed, char in enumerate(text, 1):
            state = automaton.next_state(state, ord(char))
            match, self.holdback = automaton.resolve(state)
            if report and match != _NO_STOP:
                self.state = state
                return match, consumed
        self.state = state
        return None
