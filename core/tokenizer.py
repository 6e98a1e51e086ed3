"""Loading the checkpoint's tokenizer, detokenizing outputs incrementally, and token texts."""

from __future__ import annotations

from pathlib import Path
from typing import Any

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def load_tokenizer(path: str) -> Any | None:
    """The HF tokenizer in ``path``, or None for a checkpoint without tokenizer files."""
    if not any((Path(path) / name).exists() for name in TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


class IncrementalDetokenizer:
    """Appends the text of each new token without re-decoding the whole output.

    Fast (``tokenizers``-backed) tokenizers use its ``DecodeStream``, which holds back bytes
    until a character completes (about 0.7 us a token). Others decode a short window of
    trailing tokens and emit the new suffix, holding text back while it ends in U+FFFD. Both
    are primed with the prompt's last tokens so the first word's spacing is right.
    """

    PRIMING_TOKENS = 6

    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], skip_special_tokens: bool):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        context = list(prompt_token_ids[-self.PRIMING_TOKENS:])
        self.backend = getattr(tokenizer, "backend_tokenizer", None)
        if self.backend is not None:
            from tokenizers.decoders import DecodeStream

            self.stream = DecodeStream(skip_special_tokens=skip_special_tokens)
            for token_id in context:
                self.stream.step(self.backend, token_id)
        else:
            self.token_ids = context
            self.prefix_offset = 0
            self.read_offset = len(context)

    def add(self, token_id: int) -> str:
        """The text that token adds (possibly empty until a character completes)."""
        if self.backend is not None:
            return self.stream.step(self.backend, token_id) or ""
        self.token_ids.append(token_id)
        prefix = self._decode(self.token_ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.token_ids[self.prefix_offset:])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.token_ids)
            return full[len(prefix):]
        return ""

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)


class TokenTexts:
    """Each token id's text decoded alone (a logprobs entry's ``decoded_token``), remembered per
    id: the tokenizer decodes a token once, and a step's entries cost dictionary lookups (a
    ``batch_decode`` per entry took longer than the decode step it reported on)."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self._texts: dict[int, str] = {}

    def __call__(self, token_ids: list[int]) -> list[str]:
        texts = self._texts
        try:
            return [texts[t] for t in token_ids]
        except KeyError:
            missing = [t for t in dict.fromkeys(token_ids) if t not in texts]
            texts.update(zip(missing, self.tokenizer.batch_decode([[t] for t in missing])))
            return [texts[t] for t in token_ids]
