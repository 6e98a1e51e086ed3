"""Incremental detokenization gives exactly the text of decoding all output tokens at once."""

import pytest
from transformers import AutoTokenizer

from hookllm.tokenizer import IncrementalDetokenizer

# Multi-byte characters split across byte-level tokens, so partial characters must be held back.
TEXT = " The café in 東京 serves naïve crêpes — 42 of them."


class WithoutBackend:
    """A tokenizer seen without its ``tokenizers`` backend, as a slow (Python) tokenizer is."""

    def __init__(self, tokenizer):
        self.decode = tokenizer.decode


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_dir):
    return AutoTokenizer.from_pretrained(str(tiny_llama_dir))


@pytest.mark.parametrize("wrap", [lambda t: t, WithoutBackend], ids=["decode-stream", "window"])
def test_streamed_text_equals_decoding_all_tokens(tokenizer, wrap):
    prompt = tokenizer("Paris is")["input_ids"]
    output = tokenizer(TEXT)["input_ids"]
    assert any("\ufffd" in tokenizer.decode([t]) for t in output)  # some tokens are partial characters
    detokenizer = IncrementalDetokenizer(wrap(tokenizer), prompt, skip_special_tokens=True)
    pieces = [detokenizer.add(t) for t in output]
    assert "".join(pieces) == tokenizer.decode(output) == TEXT
    assert all("\ufffd" not in piece for piece in pieces)
