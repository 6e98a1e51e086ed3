"""Stop strings: the automaton agrees with a naive search, many stop strings stop where one does,
and the server bounds how many it takes."""

from __future__ import annotations

import random

import pydantic
import pytest

from hookllm import SamplingParams, testing
from hookllm.engine.stop_strings import StopStringAutomaton, StopStringMatcher
from hookllm.server.protocol import MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS, CompletionRequest

PROMPT = "Paris is the capital of"
# Small alphabets make stop strings overlap, nest and repeat; two characters are beyond Latin-1.
ALPHABETS = ("ab", "abcé🙂")


def naive_matches(text: str, stops: list[str], reported: list[bool]) -> list[tuple[int, int]]:
    """(end, stop index) for every character at which a stop string ends, where reported: the
    first such stop string in ``stops``."""
    matches = []
    for end in range(1, len(text) + 1):
        ending = [i for i, stop in enumerate(stops) if text[:end].endswith(stop)]
        if ending and reported[end - 1]:
            matches.append((end, ending[0]))
    return matches


def naive_holdback(text: str, stops: list[str]) -> int:
    """The longest end of ``text`` that is the start, not the whole, of a stop string."""
    return max(length for stop in stops for length in range(len(stop)) if text.endswith(stop[:length]))


def random_case(rng: random.Random) -> tuple[str, list[str]]:
    alphabet = rng.choice(ALPHABETS)
    stops = ["".join(rng.choices(alphabet, k=rng.randint(1, 6))) for _ in range(rng.randint(1, 8))]
    return "".join(rng.choices(alphabet, k=rng.randint(0, 60))), stops


def random_chunks(rng: random.Random, text: str, max_chunk: int) -> list[tuple[str, bool]]:
    """``text`` cut into pieces of 0 to ``max_chunk`` characters, each reported or not at random."""
    chunks, start = [], 0
    while start < len(text):
        size = rng.randint(0, max_chunk)
        chunks.append((text[start:start + size], rng.random() < 0.8))
        start += size
    return chunks


def feed_all(matcher: StopStringMatcher,
             chunks: list[tuple[str, bool]]) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """Every (end, stop index) the matcher reports over ``chunks``, feeding a chunk's rest again
    after a match; and the holdback after each feed, with the text's length then."""
    matches, holdbacks, fed = [], [], 0
    for chunk, report in chunks:
        while True:
            match = matcher.feed(chunk, report)
            consumed = match[1] if match is not None else len(chunk)
            fed += consumed
            holdbacks.append((fed, matcher.holdback))
            if match is None:
                break
            matches.append((fed, match[0]))
            chunk = chunk[consumed:]
    return matches, holdbacks


@pytest.mark.parametrize("max_chunk", [1, 5], ids=["by-character", "in-chunks"])
def test_matcher_reports_the_matches_a_naive_search_finds(max_chunk):
    rng = random.Random(max_chunk)
    for _ in range(400):
        text, stops = random_case(rng)
        chunks = random_chunks(rng, text, max_chunk)
        reported = [report for chunk, report in chunks for _ in chunk]
        matches, _ = feed_all(StopStringMatcher(StopStringAutomaton(stops)), chunks)
        assert matches == naive_matches(text, stops, reported), (text, stops, chunks)


@pytest.mark.parametrize("max_chunk", [1, 5], ids=["by-character", "in-chunks"])
def test_holdback_is_the_longest_text_end_that_starts_a_stop_string(max_chunk):
    rng = random.Random(10 + max_chunk)
    for _ in range(400):
        text, stops = random_case(rng)
        _, holdbacks = feed_all(StopStringMatcher(StopStringAutomaton(stops)), random_chunks(rng, text, max_chunk))
        assert holdbacks == [(fed, naive_holdback(text[:fed], stops)) for fed, _ in holdbacks], (text, stops)


def test_children_sharing_an_automaton_keep_their_own_positions():
    automaton = StopStringAutomaton(["abc", "xy"])
    first, second = StopStringMatcher(automaton), StopStringMatcher(automaton)
    assert first.feed("ab") is None and second.feed("x") is None
    assert first.feed("c") == (0, 1) and second.feed("y") == (1, 1)


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return testing.LLM(str(tiny_llama_dir), dtype="float32", device="cpu")


def test_ten_thousand_stop_strings_stop_where_the_one_that_matches_does(llm):
    text = llm.generate(PROMPT, testing.greedy(40))[0].outputs[0].text
    stop = text[len(text) // 2: len(text) // 2 + 3]
    # Decoys start like the text does from each of its characters, then turn away from it with a
    # character the text lacks: each is a long partial match that never completes.
    rng = random.Random(0)
    absent = next(chr(c) for c in range(0x4E00, 0x9FFF) if chr(c) not in text)
    decoys = []
    while len(decoys) < 10_000:
        start = rng.randrange(len(text))
        lead = text[start: start + rng.randint(1, 20)]
        decoys.append((lead + absent + "".join(rng.choices("xyz", k=200)))[:200])
    assert all(len(decoy) == 200 and absent in decoy for decoy in decoys)

    def run(stops: list[str]):
        params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, stop=stops)
        return llm.generate(PROMPT, params)[0].outputs[0]

    alone, among_many = run([stop]), run(decoys + [stop])
    assert alone.finish_reason == "stop" and alone.text == text[: text.find(stop)]
    assert (among_many.text, among_many.token_ids, among_many.finish_reason, among_many.stop_reason) == \
        (alone.text, alone.token_ids, alone.finish_reason, alone.stop_reason)


def test_completion_request_refuses_more_than_the_stop_string_limit():
    with pytest.raises(pydantic.ValidationError) as caught:
        CompletionRequest(prompt="x", stop=[f"s{i}" for i in range(MAX_STOP_STRINGS + 1)])
    assert [error["loc"] for error in caught.value.errors()] == [("stop",)]


def test_completion_request_refuses_a_stop_string_over_the_length_limit():
    with pytest.raises(pydantic.ValidationError) as caught:
        CompletionRequest(prompt="x", stop="s" * (MAX_STOP_STRING_CHARS + 1))
    assert [error["loc"] for error in caught.value.errors()] == [("stop",)]


def test_completion_request_takes_stop_strings_at_the_limits():
    stops = ["s" * MAX_STOP_STRING_CHARS] * MAX_STOP_STRINGS
    assert CompletionRequest(prompt="x", stop=stops).stop == stops
